"""benchmarks/ngram_positions.py's checks (tests/ngram_positions_checks.py), each in a child
process, so that this process never loads numba (that file says why)."""
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = Path(__file__).parent / "ngram_positions_checks.py"
NAMES = ("check_ngram_drafts_what_follows_a_repeat_of_the_last_two_tokens_and_nothing_without_one",
         "check_each_position_counts_ngram_and_the_block_on_the_same_answer_rows",
         "check_a_replay_steps_by_what_each_step_keeps")


@pytest.mark.parametrize("name", NAMES)
def test_ngram_positions(name):
    done = subprocess.run([sys.executable, str(CHECKS), name], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


def test_every_check_is_run():
    source = CHECKS.read_text()
    assert sorted(NAMES) == sorted(line[4:line.index("(")] for line in source.splitlines()
                                   if line.startswith("def check_"))
