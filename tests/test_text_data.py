"""Dataset-text shards (Medusa-1's training data) in the self-distillation layout."""
import torch

from vllm_mtpspec.prompts import Prompt
from vllm_mtpspec.shards import list_shards
from vllm_mtpspec.target import load_target
from vllm_mtpspec_train.examples import load_examples
from vllm_mtpspec_train.text_data import generate_text_data


def test_dataset_answers_become_shards_the_training_job_reads(tiny_smol_teacher, tmp_path):
    target = load_target(str(tiny_smol_teacher))
    prompts = [Prompt("Say hello.", "general", "a"), Prompt("No answer here.", "general", "b"),
               Prompt("Count to three.", "math", "c")]
    answers = {"a": "Hello there, friend!", "c": "One, two, three."}
    out = generate_text_data(target, prompts, answers, tmp_path / "text", max_new_tokens=5, shard_size=1, top_k=4)
    shards = list_shards(out)
    assert len(shards) == 2  # the prompt without an answer is skipped
    shard = torch.load(shards[1], weights_only=True)
    assert shard["ids"] == ["c"]
    answer_ids = target.tokenizer.encode("One, two, three.", add_special_tokens=False)
    assert len(answer_ids) > 5 and shard["tokens"].tolist() == answer_ids[:5]  # cut to max_new_tokens
    # The rows' teacher-forced distributions are shard_from_answers's, checked in test_answers.py.
    assert shard["hidden"].shape == (5, target.model.config.hidden_size)
    examples = load_examples(shards, num_heads=2)
    assert len(examples["token"]) > 0 and examples["targets"].shape[1] == 2
    # Written shards are kept: a second run has nothing left to do.
    written = [f.stat().st_mtime_ns for f in shards]
    generate_text_data(target, prompts, answers, out, max_new_tokens=5, shard_size=1, top_k=4)
    assert [f.stat().st_mtime_ns for f in list_shards(out)] == written
