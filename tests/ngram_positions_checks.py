"""benchmarks/ngram_positions.py: ngram's and the block's tokens at the same answer positions.

Run by tests/test_ngram_positions.py, each check in a child process of its own: the benchmark
imports vLLM's ngram proposer, which loads numba, and with numba's llvmlite objects in
sys.modules vLLM's CPU kernel-override scan (vllm/triton_utils/dispatcher.py) fails in every
later test that starts an engine in the pytest process.

    python tests/ngram_positions_checks.py CHECK_NAME
"""
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np

from vllm_mtpspec_train.fit_copy_bias import AnswerRows

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "ngram_positions.py"
spec = importlib.util.spec_from_file_location("ngram_positions", SCRIPT)
ngram_positions = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ngram_positions)


def check_ngram_drafts_what_follows_a_repeat_of_the_last_two_tokens_and_nothing_without_one():
    assert ngram_positions.ngram_draft(np.array([5, 6, 7, 8, 9, 5, 6]), 3).tolist() == [7, 8, 9]
    assert ngram_positions.ngram_draft(np.array([5, 6, 7, 8, 9, 1, 6]), 3).tolist() == []


def check_each_position_counts_ngram_and_the_block_on_the_same_answer_rows():
    answer = np.array([10, 11, 12, 13, 14])
    # The block drafts the right next token at rows 0 and 2 and nothing right elsewhere.
    top1 = np.array([[11], [99], [13], [99], [99]])
    a = AnswerRows("a", "test", np.array([1, 10, 11, 12, 2]), answer, top1, np.full((5, 1), -1),
                   np.full((5, 1), np.inf, np.float32), np.zeros(5, np.int64))
    drafts, ngram, block = ngram_positions.positions(a, {}, depth=1)
    # Row 1 ends the context with 10, 11, seen in the prompt, followed by 12: ngram drafts 12 and it is right.
    # Row 2 ends with 11, 12, followed by 2 in the prompt: ngram drafts 2, wrong. Rows 0 and 3 have no repeat.
    assert drafts.tolist() == [False, True, True, False]
    assert ngram.tolist() == [1, 2, 1, 1]
    assert block.tolist() == [2, 1, 2, 1]


def check_a_replay_steps_by_what_each_step_keeps():
    steps, drafted = ngram_positions.replay(np.array([True, False, True, True, False]), np.array([2, 9, 3, 9, 9]))
    assert steps == [2, 3] and drafted == [True, True]
    summary = ngram_positions.summary([(np.array([True, False]), np.array([2, 1]), np.array([1, 3]))])
    assert summary["paired_ngram"] == 2 and summary["paired_block"] == 1 and summary["block_elsewhere"] == 3
    assert math.isclose(summary["replay_block_every_step"], 2.0)   # steps of 1 at row 0 and 3 at row 1


if __name__ == "__main__":
    globals()[sys.argv[1]]()
