"""Answer files: the kept form of self-distillation data, and the shards rebuilt from them."""
import os

import numpy as np
import pytest
import torch

from vllm_mtpspec.answers import AnswersError, answers_path, read_answers, write_answers
from vllm_mtpspec.checkpoint import model_fingerprint
from vllm_mtpspec.shards import list_shards
from vllm_mtpspec.target import load_target
from vllm_mtpspec_train.answers import shards_from_answers

IDS, CATEGORIES = ["a", "b"], ["code", "general"]
PROMPTS = [[1, 2, 3], [4, 5]]
ANSWERS = [[49151, 7, 8, 9], [10]]


def write_example(path, **overrides):
    kwargs = dict(fingerprint="f" * 16, vocab_size=49152, max_new_tokens=4)
    kwargs.update(overrides)
    return write_answers(path, IDS, CATEGORIES, PROMPTS, ANSWERS, **kwargs)


def test_answers_round_trip_in_two_bytes_per_token(tmp_path):
    path = write_example(answers_path(tmp_path, 3))
    assert path.name == "answers-00003.npz" and not list(tmp_path.glob("*.partial"))
    kept = read_answers(path, fingerprint="f" * 16, vocab_size=49152)
    assert kept["ids"] == IDS and kept["categories"] == CATEGORIES
    assert kept["prompt_ids"] == PROMPTS and kept["answers"] == ANSWERS
    assert kept["meta"]["max_new_tokens"] == 4
    with np.load(path) as data:
        assert data["tokens"].dtype == np.uint16


def test_answers_of_another_model_or_a_damaged_file_are_refused(tmp_path):
    path = write_example(tmp_path / "answers-00000.npz")
    with pytest.raises(AnswersError, match="'model_fingerprint'.*another model"):
        read_answers(path, fingerprint="0" * 16)
    with pytest.raises(AnswersError, match="beyond the target's vocabulary of 1000"):
        read_answers(path, vocab_size=1000)
    truncated = tmp_path / "answers-00001.npz"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(AnswersError, match="answers-00001.npz: not a readable answer file.*generate it again"):
        read_answers(truncated)
    garbage = tmp_path / "answers-00002.npz"
    garbage.write_bytes(b"not a zip file at all")
    with pytest.raises(AnswersError, match="answers-00002.npz: not a readable answer file"):
        read_answers(garbage)


def test_shards_are_rebuilt_from_answers_by_teacher_forcing(tiny_smol_teacher, tmp_path):
    target = load_target(str(tiny_smol_teacher))
    tokenizer = target.tokenizer
    prompt_ids = [tokenizer.encode(text, add_special_tokens=False) for text in ("Say hello.", "Count to three.")]
    answers = [tokenizer.encode(text, add_special_tokens=False) for text in ("Hello!", "One, two, three.")]
    fingerprint = model_fingerprint(tiny_smol_teacher)
    vocab_size = target.model.config.vocab_size
    write_answers(answers_path(tmp_path / "answers", 0), ["a"], ["general"], prompt_ids[:1], answers[:1],
                  fingerprint=fingerprint, vocab_size=vocab_size)
    write_answers(answers_path(tmp_path / "answers", 1), ["c"], ["math"], prompt_ids[1:], answers[1:],
                  fingerprint=fingerprint, vocab_size=vocab_size)
    # A run on the first N shards reads only the first N answer files.
    first_only = shards_from_answers(tiny_smol_teacher, tmp_path / "answers", tmp_path / "shards", top_k=4, max_files=1)
    assert first_only == list_shards(tmp_path / "shards") and len(first_only) == 1
    rest = shards_from_answers(tiny_smol_teacher, tmp_path / "answers", tmp_path / "shards", top_k=4)
    written = list_shards(tmp_path / "shards")
    assert first_only + rest == written and len(written) == 2
    shard = torch.load(written[1], weights_only=True)
    assert shard["ids"] == ["c"] and shard["categories"] == ["math"] and shard["tokens"].tolist() == answers[1]
    # Row r holds the target's distribution where it predicts answer token r.
    with torch.no_grad():
        logits = target.model(input_ids=torch.tensor([prompt_ids[1] + answers[1]])).logits[0]
    first = len(prompt_ids[1]) - 1
    assert torch.equal(shard["topk_ids"].long(), logits[first:first + len(answers[1])].topk(4, dim=-1).indices)
    # Shards already there are kept; a file made by another model is refused by name.
    assert shards_from_answers(tiny_smol_teacher, tmp_path / "answers", tmp_path / "shards") == []
    # An answer file newer than its shard (made again) has its shard made again.
    later = written[0].stat().st_mtime + 10
    os.utime(answers_path(tmp_path / "answers", 0), (later, later))
    assert shards_from_answers(tiny_smol_teacher, tmp_path / "answers", tmp_path / "shards") == written[:1]
    write_answers(answers_path(tmp_path / "answers", 2), ["d"], ["general"], prompt_ids[:1], answers[:1],
                  fingerprint="not-this-model", vocab_size=vocab_size)
    with pytest.raises(AnswersError, match="answers-00002.npz: field 'model_fingerprint'"):
        shards_from_answers(tiny_smol_teacher, tmp_path / "answers", tmp_path / "shards")


def test_an_answers_folder_of_another_prompt_list_is_refused_before_generating(tmp_path):
    from vllm_mtpspec.prompts import Prompt
    from vllm_mtpspec_train.data import _answered, generate_answers

    write_example(answers_path(tmp_path, 0))  # answers prompts "a", "b"
    prompts = [Prompt("x", "general", pid) for pid in ("a", "b", "c")]
    assert _answered(tmp_path, 0, prompts[:2])
    assert _answered(tmp_path, 0, prompts[:1])  # a longer list's file serves a shorter list
    # The last file of a smaller prompt list: made again with the prompts it lacks.
    assert not _answered(tmp_path, 0, prompts)
    with pytest.raises(AnswersError, match="answers-00000.npz: field 'ids' answers other prompts.*--answers"):
        generate_answers("no-model-needed", [Prompt("x", "general", "z")] + prompts, tmp_path, shard_size=3)
    # Lists that part after their first prompt: the error names where, not two equal first ids.
    with pytest.raises(AnswersError, match=r"prompt 1 of file 0: 'b' answered, 'c' in this list"):
        _answered(tmp_path, 0, [prompts[0], prompts[2]])


def test_shards_can_carry_the_prompt_rows_before_each_answer(tiny_smol_teacher, tmp_path):
    from vllm_mtpspec.shards import answer_sequence

    target = load_target(str(tiny_smol_teacher))
    prompt = target.tokenizer.encode("Name three colours, please.", add_special_tokens=False)
    answer = target.tokenizer.encode("Red, green, blue.", add_special_tokens=False)
    write_answers(answers_path(tmp_path / "answers", 0), ["a"], ["general"], [prompt], [answer],
                  fingerprint=model_fingerprint(tiny_smol_teacher), vocab_size=target.model.config.vocab_size)
    shards_from_answers(tiny_smol_teacher, tmp_path / "answers", tmp_path / "shards", top_k=4, context_rows=3)
    shard = torch.load(list_shards(tmp_path / "shards")[0], weights_only=True)
    with torch.no_grad():
        states = target.model.get_decoder()(input_ids=torch.tensor([prompt + answer])).last_hidden_state[0]
    first = len(prompt) - 1
    torch.testing.assert_close(shard["context_hidden"].float(), states[first - 3:first].half().float())
    assert shard["context_offsets"].tolist() == [0, 3]
    seq = answer_sequence(shard, 0)
    # Each row beside the token it produced, at its place in prompt + answer.
    assert seq["tokens"].tolist() == prompt[-3:] + answer and seq["first_answer_row"] == 3
    assert seq["positions"].tolist() == list(range(first - 3, first + len(answer)))
    torch.testing.assert_close(seq["features"], states[first - 3:first + len(answer)].half().float())


def test_an_answer_file_with_unknown_labels_is_refused_naming_the_field(tmp_path):
    path = write_answers(tmp_path / "answers-00000.npz", ["a"], ["general"], [[1, 2]], [[3, 4]], fingerprint="f",
                         vocab_size=10, labels="writer")
    with pytest.raises(AnswersError, match=r"answers-00000.npz: field 'labels' is 'writer', not one of \('answer', 'target'\)"):
        read_answers(path)


def test_shards_are_refused_for_human_text_which_only_the_online_path_labels(tiny_smol_teacher, tmp_path):
    write_answers(answers_path(tmp_path / "answers", 0), ["a"], ["general"], [[1, 2, 3]], [[4, 5, 6]],
                  fingerprint=model_fingerprint(tiny_smol_teacher), vocab_size=49152, labels="target")
    with pytest.raises(AnswersError, match=r"answers-00000.npz: field 'labels' is 'target'.*data_source 'online'"):
        shards_from_answers(tiny_smol_teacher, tmp_path / "answers", tmp_path / "shards")
    assert not list_shards(tmp_path / "shards")
