"""The Ray training job end to end on tiny models: data from vLLM, 2 Ray workers, a killed
worker that resumes from its checkpoint, export, and heads that load and decode."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from vllm_mtpspec.config import SpecOptions
from vllm_mtpspec.drafter import HeadsDrafter
from vllm_mtpspec.prompts import load_prompts_jsonl
from vllm_mtpspec.reference import ReferenceDecoder, plain_greedy
from vllm_mtpspec.shards import list_shards
from vllm_mtpspec.target import load_heads_for, load_target
from vllm_mtpspec_train.answers import teacher_forced
from vllm_mtpspec_train.config import TrainConfig, TrainConfigError
from vllm_mtpspec_train.data import generate_self_distillation
from vllm_mtpspec_train.train import ensure_data, run_training

pytestmark = pytest.mark.slow
PROMPTS = Path(__file__).parent.parent / "benchmarks" / "prompts" / "demo.jsonl"


def metrics(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_data(tiny_smol_teacher, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-data")
    prompts = load_prompts_jsonl(PROMPTS)
    generate_self_distillation(tiny_smol_teacher, prompts[:8], root / "train", max_new_tokens=48, shard_size=4)
    generate_self_distillation(tiny_smol_teacher, prompts[8:], root / "held", max_new_tokens=48, shard_size=4)
    return root


def test_max_train_shards_takes_the_first_shards(tiny_smol_teacher, tiny_data):
    config = TrainConfig(model=str(tiny_smol_teacher), train_data=str(tiny_data / "train"),
                         held_out_data=str(tiny_data / "held"), max_train_shards=1)
    train, held = ensure_data(config, Path(tiny_smol_teacher))
    assert train == list_shards(tiny_data / "train")[:1] and len(list_shards(tiny_data / "train")) == 2
    assert held == list_shards(tiny_data / "held")
    with pytest.raises(TrainConfigError, match="max_train_shards=0"):
        TrainConfig(max_train_shards=0)


def test_several_sources_train_together_their_shards_interleaved(tiny_smol_teacher, tiny_data, tmp_path):
    first, later = tmp_path / "first-turns", tmp_path / "later-turns"
    config = TrainConfig(model=str(tiny_smol_teacher), train_data=[str(first), str(later)], held_out_data=None,
                         train_answers=[str(tiny_data / "train" / "answers"), str(tiny_data / "held" / "answers")])
    train, _ = ensure_data(config, Path(tiny_smol_teacher))
    a, b = list_shards(first), list_shards(later)
    assert len(a) == 2 and len(b) >= 1 and sorted(train) == sorted(a + b)
    assert train[0] in (a[0], b[0]) and [p for p in train if p in a] == a  # each source's own order
    assert {train[0].parent, train[1].parent} == {first, later}  # the sources take turns
    with pytest.raises(TrainConfigError, match="one answers folder per train_data folder"):
        TrainConfig(train_data=[str(first), str(later)], train_answers=[str(first)])
    with pytest.raises(TrainConfigError, match="one answers folder per train_data folder"):
        TrainConfig(train_data=str(first), train_answers=[str(first)])


def test_a_shard_budget_splits_evenly_over_the_sources_and_builds_no_more(tiny_smol_teacher, tiny_data, tmp_path):
    first, later = tmp_path / "first-turns", tmp_path / "later-turns"
    config = TrainConfig(model=str(tiny_smol_teacher), train_data=[str(first), str(later)], held_out_data=None,
                         train_answers=[str(tiny_data / "train" / "answers"), str(tiny_data / "held" / "answers")],
                         max_train_shards=2)
    train, _ = ensure_data(config, Path(tiny_smol_teacher))
    assert len(list_shards(first)) == 1 and len(list_shards(later)) == 1  # only the shards it trains on
    assert train == [list_shards(first)[0], list_shards(later)[0]]
    # Shards an earlier run left behind do not change the mix of a same-budget run.
    ensure_data(dataclasses.replace(config, max_train_shards=None), Path(tiny_smol_teacher))
    assert len(list_shards(first)) == 2
    again, _ = ensure_data(config, Path(tiny_smol_teacher))
    assert again == train


def test_split_budget_is_even_where_the_sources_allow():
    from vllm_mtpspec_train.train import split_budget

    assert split_budget(24, [125, 168]) == [12, 12]
    assert split_budget(5, [10, 10]) == [3, 2]
    assert split_budget(24, [4, 100]) == [4, 20]  # a short source leaves the rest to the others
    assert split_budget(24, [4, 5]) == [4, 5]
    assert split_budget(3, [0, 9, 9]) == [0, 2, 1]


def test_interleaving_spreads_a_smaller_source_evenly():
    from vllm_mtpspec_train.train import interleave

    big, small = [Path(f"a{i}") for i in range(4)], [Path(f"b{i}") for i in range(2)]
    assert [p.name for p in interleave([big, small])] == ["a0", "b0", "a1", "a2", "b1", "a3"]
    assert interleave([big]) == big


def test_data_shards_hold_answers_hidden_states_and_distributions(tiny_data):
    shard = torch.load(list_shards(tiny_data / "train")[0], weights_only=True)
    n = int(shard["offsets"][-1])
    assert shard["hidden"].shape == (n, 128) and shard["tokens"].shape == (n,)
    # Greedy answers: every token is the target's own top-1.
    assert torch.equal(shard["topk_ids"][:, 0].long(), shard["tokens"].long())


def test_shards_come_back_from_the_kept_answers(tiny_smol_teacher, tiny_data, tmp_path):
    # The answer files are all another machine needs: the same shards are rebuilt from them.
    assert len(list((tiny_data / "train" / "answers").glob("answers-*.npz"))) == 2
    config = TrainConfig(model=str(tiny_smol_teacher), train_data=str(tmp_path / "train"), held_out_data=None,
                         train_answers=str(tiny_data / "train" / "answers"))
    rebuilt, _ = ensure_data(config, Path(tiny_smol_teacher))
    original = list_shards(tiny_data / "train")
    assert [p.name for p in rebuilt] == [p.name for p in original]
    for mine, theirs in zip(rebuilt, original):
        mine, theirs = torch.load(mine, weights_only=True), torch.load(theirs, weights_only=True)
        assert mine["ids"] == theirs["ids"] and mine["prompt_ids"] == theirs["prompt_ids"]
        for key in ("offsets", "tokens", "hidden", "topk_ids", "topk_logprobs"):
            assert torch.equal(mine[key], theirs[key]), key


def test_posthoc_job_two_workers_survives_a_killed_worker(tiny_smol_teacher, tiny_data, tmp_path):
    config = TrainConfig(
        model=str(tiny_smol_teacher), train_data=str(tiny_data / "train"), held_out_data=str(tiny_data / "held"),
        num_heads=3, epochs=6, batch_size=16, lr=3e-3, num_negatives=256, num_workers=2,
        storage_path=str(tmp_path / "ray"), name="posthoc", checkpoint_every=4, fail_at_step=6, max_failures=1,
        out=str(tmp_path / "heads"), quantize_aware_steps=5,
    )
    summary = run_training(config)
    rows = metrics(tmp_path / "ray" / "posthoc")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0] * 0.9, losses
    resumed = [r for r in rows if r.get("event") == "resumed"]
    assert resumed and resumed[0]["step"] == 4  # died at 6, back from the step-4 checkpoint
    assert any(p.name.startswith("checkpoint_") for p in (tmp_path / "ray" / "posthoc").iterdir())
    assert Path(summary["loss_curves"]).is_file()
    assert len(summary["held_out"]["fp32"]["top1"]) == 3
    assert summary["held_out"]["fp32"]["mean_accepted_len"]["chain"] >= 1.0
    # The INT2 copy is GPTQ's, fine-tuned (quantize_aware_steps); it is scored beside the FP heads.
    int2_config = json.loads((Path(summary["int2_dir"]) / "config.json").read_text())
    assert int2_config["quantization"]["method"] == "qat"
    assert len(summary["held_out"]["int2"]["top1"]) == 3
    # The exported heads (and their INT2 copy) load against the model and decode losslessly.
    target = load_target(str(tiny_smol_teacher), dtype="fp32")
    ids = target.tokenizer.encode("Hello there", add_special_tokens=False)
    expected = plain_greedy(target.model, ids, max_new_tokens=16, eos_token_ids=set())
    for heads_dir in (summary["heads_dir"], summary["int2_dir"]):
        heads = load_heads_for(target, heads_dir)
        decoder = ReferenceDecoder(target.model, HeadsDrafter(heads, target.model), SpecOptions(tree="consensus"))
        assert decoder.decode(ids, max_new_tokens=16).tokens == expected


@pytest.mark.parametrize("head_kind", ["parallel", "sequential"])
def test_cotrained_student_and_heads(tiny_smol_teacher, tiny_smol_student, tiny_data, tmp_path, head_kind):
    config = TrainConfig(
        model=str(tiny_smol_teacher), mode="cotrain", student=str(tiny_smol_student),
        train_data=str(tiny_data / "train"), held_out_data=None, num_heads=2, epochs=8, batch_size=2,
        lr=3e-3, num_negatives=256, num_workers=1, storage_path=str(tmp_path / "ray"), name="cotrain",
        checkpoint_every=100, out=str(tmp_path / "heads"), int2_group_size=None, head_kind=head_kind,
        head_input="hidden+token" if head_kind == "sequential" else "hidden",
    )
    summary = run_training(config)
    rows = [r for r in metrics(tmp_path / "ray" / "cotrain") if "kd" in r]
    assert rows[-1]["kd"] < rows[0]["kd"] and rows[-1]["mtp"] < rows[0]["mtp"], rows
    student = load_target(summary["student_dir"], dtype="fp32")
    heads = load_heads_for(student, summary["heads_dir"])  # fingerprinted to the trained student
    assert heads.num_heads == 2 and heads.config.head_kind == head_kind


def test_a_cotrained_draft_block_shapes_the_student_and_is_calibrated_on_its_states(
        tiny_smol_teacher, tiny_smol_student, tiny_data, tmp_path):
    config = TrainConfig(
        model=str(tiny_smol_teacher), mode="cotrain", student=str(tiny_smol_student), head_kind="attention",
        train_data=str(tiny_data / "train"), held_out_data=str(tmp_path / "teacher-held-out"),
        held_out_answers=str(tiny_data / "held" / "answers"), num_heads=2, epochs=8,
        batch_size=2, lr=3e-3, num_negatives=256, storage_path=str(tmp_path / "ray"), name="cotrain-block",
        checkpoint_every=100, out=str(tmp_path / "block"), int2_group_size=None, context_rows=64,
        bf16_autocast=True,
    )
    summary = run_training(config)
    rows = [r for r in metrics(tmp_path / "ray" / "cotrain-block") if "kd" in r]
    assert rows[-1]["kd"] < rows[0]["kd"] and rows[-1]["mtp"] < rows[0]["mtp"], rows
    student = load_target(summary["student_dir"], dtype="fp32")
    block = load_heads_for(student, summary["heads_dir"])
    assert block.config.head_kind == "attention" and block.num_heads == 2
    # Calibrated on the trained student's pass along the teacher's held-out answers; the
    # teacher's own states along them are never needed, so never computed.
    assert not list_shards(tmp_path / "teacher-held-out")
    held = list_shards(tmp_path / "block" / "student-held-out")
    assert held and summary["held_out"]["fp32"]["mean_accepted_len"]["chain"] > 0
    states = torch.load(held[0], weights_only=True)
    expected = teacher_forced(student, list(states["prompt_ids"][0]), states["tokens"][: int(states["offsets"][1])]
                              .tolist(), top_k=8)[0]
    torch.testing.assert_close(states["hidden"][: int(states["offsets"][1])], expected)


def test_the_arms_without_cotraining_train_the_student_alone_then_a_drafter_on_it_frozen(
        tiny_smol_teacher, tiny_smol_student, tiny_data, tmp_path, monkeypatch):
    import shutil

    # A student named relative to where the job starts: Ray's workers run elsewhere.
    shutil.copytree(tiny_smol_student, tmp_path / "student")
    monkeypatch.chdir(tmp_path)
    common = dict(model=str(tiny_smol_teacher), mode="cotrain", train_data=str(tiny_data / "train"),
                  held_out_data=None, num_heads=2, epochs=6, batch_size=2, lr=3e-3, num_negatives=256,
                  storage_path=str(tmp_path / "ray"), checkpoint_every=100, int2_group_size=None)
    alone = run_training(TrainConfig(**common, student="student", mtp_weight=0.0, name="alone",
                                     out=str(tmp_path / "alone")))
    rows = metrics(tmp_path / "ray" / "alone")
    assert rows[-1]["kd"] < rows[0]["kd"] and not any("mtp" in r for r in rows), rows
    assert "heads_dir" not in alone and not (tmp_path / "alone" / "config.json").exists()
    distilled = alone["student_dir"]
    frozen = run_training(TrainConfig(**common, student=distilled, freeze_student=True, name="frozen",
                                      out=str(tmp_path / "frozen")))
    rows = metrics(tmp_path / "ray" / "frozen")
    assert rows[-1]["mtp"] < rows[0]["mtp"] and not any("kd" in r for r in rows), rows
    before = AutoModelForCausalLM.from_pretrained(distilled).state_dict()
    after = AutoModelForCausalLM.from_pretrained(frozen["student_dir"]).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the student did not move
    load_heads_for(load_target(distilled, dtype="fp32"), frozen["heads_dir"])  # the drafter fits the student
    for refused, message in [({"mode": "posthoc", "freeze_student": True}, "freeze_student with mode='posthoc'"),
                             ({"student": "s"}, "student='s' with mode='posthoc'"),
                             ({"mode": "posthoc", "mtp_weight": 0.0}, "mtp_weight=0.0: must be > 0"),
                             ({"mode": "cotrain", "student": "s", "freeze_student": True, "mtp_weight": 0.0},
                              "trains nothing")]:
        with pytest.raises(TrainConfigError, match=message):
            TrainConfig(**refused)


def test_sequential_heads_train_on_their_own_states_and_the_answers_tokens(tiny_smol_teacher, tiny_data, tmp_path):
    from vllm_mtpspec.sequential_heads import SequentialHeads

    config = TrainConfig(
        model=str(tiny_smol_teacher), train_data=str(tiny_data / "train"), held_out_data=str(tiny_data / "held"),
        head_kind="sequential", head_input="hidden+token", mlp_size=64, num_heads=3, epochs=6, batch_size=16,
        lr=3e-3, num_negatives=256, storage_path=str(tmp_path / "ray"), name="sequential", checkpoint_every=100,
        out=str(tmp_path / "heads"), int2_method="gptq",
    )
    summary = run_training(config)
    losses = [r["loss"] for r in metrics(tmp_path / "ray" / "sequential") if "loss" in r]
    assert losses[-1] < losses[0] * 0.9, losses
    held_out = summary["held_out"]["fp32"]
    # Scored along the answers' chains (per-depth conditional top-1, the chain) and by the
    # trees the heads grow themselves (no fixed-shape tree applies to them).
    assert len(held_out["conditional_top1"]) == 3
    assert set(held_out["mean_accepted_len"]) == {"chain", "chain+lookup", "dynamic"}
    assert json.loads((Path(summary["int2_dir"]) / "config.json").read_text())["quantization"]["method"] == "gptq"
    target = load_target(str(tiny_smol_teacher), dtype="fp32")
    ids = target.tokenizer.encode("Hello there", add_special_tokens=False)
    expected = plain_greedy(target.model, ids, max_new_tokens=16, eos_token_ids=set())
    for heads_dir in (summary["heads_dir"], summary["int2_dir"]):
        heads = load_heads_for(target, heads_dir)
        assert isinstance(heads, SequentialHeads)
        for tree in ("chain", "dynamic"):
            decoder = ReferenceDecoder(target.model, HeadsDrafter(heads, target.model), SpecOptions(tree=tree))
            assert decoder.decode(ids, max_new_tokens=16).tokens == expected
    with pytest.raises(TrainConfigError, match="head_kind='sequential' with head_input='hidden'.*hidden\\+token"):
        TrainConfig(head_kind="sequential")


def test_an_attention_draft_block_trains_on_answers_read_with_their_prompt_rows(tiny_smol_teacher, tiny_data,
                                                                                  tmp_path, monkeypatch):
    from vllm_mtpspec.checkpoint import load_heads
    from vllm_mtpspec.draft_block import DraftBlock

    common = dict(model=str(tiny_smol_teacher), head_kind="attention", num_heads=2, epochs=40, batch_size=4,
                  lr=3e-3, num_negatives=256, storage_path=str(tmp_path / "ray"), checkpoint_every=100,
                  int2_group_size=None)
    # Shards of answer rows alone would teach it to draft without the context: refused.
    with pytest.raises(TrainConfigError, match="carries no prompt rows.*--context-rows"):
        run_training(TrainConfig(**common, train_data=str(tiny_data / "train"), held_out_data=None, name="no-context",
                                 out=str(tmp_path / "nothing")))
    # Data folders relative to the working directory, as in the shipped configs: Ray Train's
    # workers run elsewhere and must still find the shards.
    monkeypatch.chdir(tmp_path)
    config = TrainConfig(**{**common, "int2_group_size": 32, "int2_method": "gptq"}, train_data="train",
                         held_out_data="held", train_answers=str(tiny_data / "train" / "answers"),
                         held_out_answers=str(tiny_data / "held" / "answers"), name="block", out=str(tmp_path / "block"))
    summary = run_training(config)  # the shards, with prompt rows, come back from the answers
    rows = [r for r in metrics(tmp_path / "ray" / "block") if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"] * 0.8, rows
    block = load_heads(summary["heads_dir"])
    assert isinstance(block, DraftBlock) and block.num_heads == 2
    held_out = summary["held_out"]["fp32"]
    assert len(held_out["conditional_top1"]) == 2 and held_out["mean_accepted_len"]["chain"] >= 1.0
    # Its INT2 copy, GPTQ calibrated on the training shards' answers with their prompt rows.
    int2 = load_heads(summary["int2_dir"])
    assert isinstance(int2, DraftBlock) and int2.is_quantized
    assert int2.config.quantization.method == "gptq" and "answer rows (with their context)" in \
        int2.config.quantization.calibration
    assert len(summary["held_out"]["int2"]["conditional_top1"]) == 2
    with pytest.raises(TrainConfigError, match="head_kind='attention': quantization-aware steps"):
        TrainConfig(head_kind="attention", quantize_aware_steps=10)
    # Trained further reading target layers 0 and 1 too: shards without them are refused,
    # shards rebuilt with them train the grown fusion.
    grown = dict(common, epochs=10, init_from=summary["heads_dir"], feature_layers=[0, 1],
                 train_answers=str(tiny_data / "train" / "answers"), held_out_answers=str(tiny_data / "held" / "answers"))
    with pytest.raises(TrainConfigError, match=r"keep the states entering target layers none.*--feature-layers 0,1"):
        run_training(TrainConfig(**grown, train_data="train", held_out_data="held", name="no-layers",
                                 out=str(tmp_path / "nothing")))
    summary = run_training(TrainConfig(**grown, train_data="train-layers", held_out_data="held-layers",
                                       name="grown", out=str(tmp_path / "grown")))
    rows = [r for r in metrics(tmp_path / "ray" / "grown") if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"], rows
    block = load_heads(summary["heads_dir"])
    assert block.feature_layers == [0, 1] and block.layer_fuse.weight.abs().sum() > 0  # it trained from zero
    with pytest.raises(TrainConfigError, match="feature_layers=\\[2\\] with head_kind='parallel'"):
        TrainConfig(feature_layers=[2])


def test_online_block_two_workers_repeats_step_for_step_and_resumes_from_a_killed_worker(tiny_smol_teacher, tiny_data,
                                                                                          tmp_path):
    """data_source 'online': each of 2 workers records its share of the answers with the target and
    trains on it, no shards written. A run with the same config and seed repeats step for step, a
    killed worker included: back from the last checkpoint, it takes the steps the first run took."""
    from vllm_mtpspec.checkpoint import load_heads
    from vllm_mtpspec.draft_block import DraftBlock

    common = dict(model=str(tiny_smol_teacher), head_kind="attention", data_source="online", num_heads=2,
                  train_answers=str(tiny_data / "train" / "answers"), held_out_data=str(tmp_path / "held"),
                  held_out_answers=str(tiny_data / "held" / "answers"), context_rows=16, batch_rows=128,
                  max_steps=7, warmup_steps=2, lr=3e-3, num_negatives=256, num_workers=2, checkpoint_every=3,
                  log_every=1, storage_path=str(tmp_path / "ray"), int2_group_size=None)
    summary = run_training(TrainConfig(**common, name="online", out=str(tmp_path / "heads")))
    run_training(TrainConfig(**common, name="killed", fail_at_step=5, max_failures=1, out=str(tmp_path / "again")))
    first = {r["step"]: r["loss"] for r in metrics(tmp_path / "ray" / "online") if "loss" in r}
    rows = metrics(tmp_path / "ray" / "killed")
    assert [r["step"] for r in rows if r.get("event") == "resumed"] == [3]  # died at 5, back from step 3
    again = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert [step for step, _ in again] == [1, 2, 3, 4, 4, 5, 6, 7]
    assert sorted(first) == list(range(1, 8)) and len(set(first.values())) == 7
    assert all(loss == first[step] for step, loss in again), (first, again)
    assert not list(tmp_path.glob("ray/*/shard-*.pt"))  # nothing written for training but checkpoints
    block = load_heads(summary["heads_dir"])
    assert isinstance(block, DraftBlock) and block.num_heads == 2
    init = load_heads(tmp_path / "ray" / "online" / "init-heads")
    assert not torch.equal(block.q_proj.weight, init.q_proj.weight)  # it trained
    assert summary["steps"] == 7 and summary["train_answers"] == 8
    assert len(summary["held_out"]["fp32"]["conditional_top1"]) == 2  # scored on the held-out shards built for it


def test_a_local_run_needs_no_ray_and_resumes_from_its_checkpoint_after_a_kill(tiny_smol_teacher, tiny_data,
                                                                               tmp_path):
    """runner 'local': the same loop in one process, with Ray made unimportable. Killed at
    step 5 and started again, it resumes from its step-3 checkpoint and takes the steps an
    uninterrupted local run took, loss for loss."""
    import subprocess
    import sys

    from vllm_mtpspec.checkpoint import load_heads

    common = dict(model=str(tiny_smol_teacher), head_kind="attention", data_source="online", num_heads=2,
                  train_answers=str(tiny_data / "train" / "answers"), held_out_data=str(tmp_path / "held"),
                  held_out_answers=str(tiny_data / "held" / "answers"), context_rows=16, batch_rows=128,
                  max_steps=7, warmup_steps=2, lr=3e-3, num_negatives=256, runner="local", checkpoint_every=3,
                  log_every=1, storage_path=str(tmp_path / "runs"), int2_group_size=None)

    def run(name: str, **fields) -> int:
        config = tmp_path / f"{name}.json"
        config.write_text(json.dumps({**common, "name": name, "out": str(tmp_path / f"{name}-heads"), **fields}))
        no_ray = ("import sys; sys.modules['ray'] = None; from vllm_mtpspec_train.train import main; "
                  f"sys.exit(main(['--config', {str(config)!r}]))")
        return subprocess.run([sys.executable, "-c", no_ray], capture_output=True, text=True).returncode

    assert run("whole") == 0
    assert run("killed", fail_at_step=5) == 1
    assert run("killed") == 0
    first = {r["step"]: r["loss"] for r in metrics(tmp_path / "runs" / "whole") if "loss" in r}
    rows = metrics(tmp_path / "runs" / "killed")
    assert [r["step"] for r in rows if r.get("event") == "resumed"] == [3]
    again = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert [step for step, _ in again] == [1, 2, 3, 4, 4, 5, 6, 7]  # died before step 5, back from 3
    assert sorted(first) == list(range(1, 8)) and all(loss == first[step] for step, loss in again), (first, again)
    assert len(list((tmp_path / "runs" / "killed" / "local-checkpoints").glob("checkpoint_*"))) == 2
    init = load_heads(tmp_path / "runs" / "whole" / "init-heads")
    assert not torch.equal(load_heads(tmp_path / "whole-heads").q_proj.weight, init.q_proj.weight)
    with pytest.raises(TrainConfigError, match="runner='local'.*num_workers=2.*give num_workers 1"):
        TrainConfig(**{**common, "num_workers": 2})
    with pytest.raises(TrainConfigError, match="runner='local'.*data_source='shards'.*Ray Data"):
        TrainConfig(**{**common, "data_source": "shards"})


@pytest.mark.parametrize("head_kind", ["parallel", "sequential"])
def test_heads_train_on_the_online_path_without_shards(tiny_smol_teacher, tiny_data, tmp_path, head_kind):
    """Every drafter kind trains from answer files alone: parallel and sequential heads as the
    draft block does, their rows recorded by the target in the worker, no shards written."""
    from vllm_mtpspec.checkpoint import load_heads

    config = TrainConfig(model=str(tiny_smol_teacher), head_kind=head_kind, data_source="online", num_heads=2,
                         head_input="hidden+token", train_answers=str(tiny_data / "train" / "answers"),
                         held_out_data=str(tmp_path / "held"), held_out_answers=str(tiny_data / "held" / "answers"),
                         batch_rows=64, max_steps=12, warmup_steps=2, lr=3e-3, num_negatives=256, runner="local",
                         checkpoint_every=6, log_every=1, storage_path=str(tmp_path / "runs"), int2_group_size=None,
                         name=head_kind, out=str(tmp_path / "heads"))
    summary = run_training(config)
    rows = [r for r in metrics(tmp_path / "runs" / head_kind) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert sum(r["loss"] for r in rows[-3:]) < sum(r["loss"] for r in rows[:3]), rows
    heads, init = load_heads(summary["heads_dir"]), load_heads(tmp_path / "runs" / head_kind / "init-heads")
    assert heads.config.head_kind == head_kind
    assert any(not torch.equal(a, b) for a, b in zip(heads.state_dict().values(), init.state_dict().values()))
    assert not list(tmp_path.glob("runs/*/shard-*.pt"))
    assert len(summary["held_out"]["fp32"]["conditional_top1"]) == 2


def test_clear_errors(tiny_smol_teacher, tmp_path):
    not_jsonl = tmp_path / "prompts.jsonl"
    not_jsonl.write_text("just some text\nthat is not json\n")
    with pytest.raises(Exception, match="JSON"):
        ensure_data(TrainConfig(model=str(tiny_smol_teacher), prompts=str(not_jsonl),
                                train_data=str(tmp_path / "d1"), held_out_data=None), Path(tiny_smol_teacher))
    with pytest.raises(TrainConfigError, match="the data set is empty"):
        ensure_data(TrainConfig(model=str(tiny_smol_teacher), train_data=str(tmp_path / "nothing"),
                                held_out_data=None), Path(tiny_smol_teacher))
    with pytest.raises(TrainConfigError, match="unknown field"):
        TrainConfig.from_dict({"epochz": 3})
    with pytest.raises(TrainConfigError, match="needs 'student'"):
        TrainConfig(mode="cotrain")


SHIPPED_CONFIGS = Path(__file__).parents[1] / "vllm_mtpspec_train" / "configs"


@pytest.mark.parametrize("path", sorted(p for p in SHIPPED_CONFIGS.rglob("*") if p.suffix in (".json", ".yaml", ".yml")),
                         ids=lambda p: p.relative_to(SHIPPED_CONFIGS).as_posix())
def test_every_shipped_training_config_is_one_the_job_accepts(path):
    config = TrainConfig.from_file(path)
    assert config.model and config.train_data


def test_a_config_files_error_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "block.json"
    path.write_text(json.dumps({"head_kind": "attention", "quantize_aware_steps": 10}))
    with pytest.raises(TrainConfigError, match=f"{path}: head_kind='attention': quantization-aware steps .*"
                                               "set quantize_aware_steps to 0"):
        TrainConfig.from_file(path)


def test_training_continues_from_earlier_heads_of_the_same_shape_and_model(tiny_smol_teacher, tiny_smol_student,
                                                                            tmp_path):
    from vllm_mtpspec.checkpoint import HeadsError, load_heads, save_heads
    from vllm_mtpspec.heads_init import init_heads
    from vllm_mtpspec_train.train import initial_heads

    teacher = load_target(str(tiny_smol_teacher), dtype="fp32")
    earlier = init_heads(teacher.model, tiny_smol_teacher, num_heads=2, head_input="hidden+token", mlp_size=32,
                         init_std=0.05, seed=3)
    earlier_dir = save_heads(earlier, tmp_path / "earlier")
    config = TrainConfig(model=str(tiny_smol_teacher), num_heads=2, head_input="hidden+token", mlp_size=32,
                         init_from=str(earlier_dir))
    start = initial_heads(config, Path(tiny_smol_teacher))
    for name, tensor in earlier.state_dict().items():
        torch.testing.assert_close(start.state_dict()[name], tensor)
    fresh = initial_heads(TrainConfig(model=str(tiny_smol_teacher), num_heads=2, head_input="hidden+token",
                                      mlp_size=32), Path(tiny_smol_teacher))
    assert not torch.equal(fresh.down[0].weight, earlier.down[0].weight)  # fresh heads start at zero there
    with pytest.raises(TrainConfigError, match=r"init_from=.*earlier: its heads have \{'mlp_size': 32\}.*'mlp_size': 0"):
        initial_heads(TrainConfig(model=str(tiny_smol_teacher), num_heads=2, head_input="hidden+token",
                                  init_from=str(earlier_dir)), Path(tiny_smol_teacher))
    with pytest.raises(HeadsError, match="another model of the same shape"):
        initial_heads(config, Path(tiny_smol_student))
    # An attention draft block trains further from its own directory; parallel heads are not one.
    from vllm_mtpspec.heads_init import init_draft_block

    block_dir = save_heads(init_draft_block(teacher.model, tiny_smol_teacher, num_heads=2, seed=5), tmp_path / "b")
    as_block = dict(model=str(tiny_smol_teacher), head_kind="attention", num_heads=2, int2_group_size=None)
    resumed = initial_heads(TrainConfig(**as_block, init_from=str(block_dir)), Path(tiny_smol_teacher))
    torch.testing.assert_close(resumed.q_proj.weight, load_heads(block_dir).q_proj.weight)
    with pytest.raises(TrainConfigError, match=r"its heads have \{'head_kind': 'parallel'\}"):
        initial_heads(TrainConfig(**as_block, init_from=str(earlier_dir)), Path(tiny_smol_teacher))
    # mlp_size sets a fresh block's MLP width (the target layer's where unset) and must match
    # a block trained further; an EAGLE-3 layer is shaped like the target's layer and refuses it.
    layer_width = teacher.model.config.intermediate_size
    narrow = initial_heads(TrainConfig(**as_block, mlp_size=layer_width // 2), Path(tiny_smol_teacher))
    assert narrow.config.block.mlp_size == layer_width // 2 and narrow.gate_proj.weight.shape[0] == layer_width // 2
    assert initial_heads(TrainConfig(**as_block), Path(tiny_smol_teacher)).gate_proj.weight.shape[0] == layer_width
    with pytest.raises(TrainConfigError, match=rf"its heads have \{{'mlp_size': {layer_width}\}}"):
        initial_heads(TrainConfig(**as_block, mlp_size=layer_width // 2, init_from=str(block_dir)),
                      Path(tiny_smol_teacher))
    with pytest.raises(TrainConfigError, match="mlp_size=16 with head_kind='eagle3'.*remove mlp_size"):
        TrainConfig(model=str(tiny_smol_teacher), head_kind="eagle3", mlp_size=16, int2_group_size=None)
    # Sequential heads start from parallel heads: every depth a copy of their head 1.
    seeded = initial_heads(TrainConfig(model=str(tiny_smol_teacher), num_heads=2, head_input="hidden+token",
                                       mlp_size=32, head_kind="sequential", init_from=str(earlier_dir)),
                           Path(tiny_smol_teacher))
    assert seeded.config.head_kind == "sequential"
    for block in seeded.blocks:
        torch.testing.assert_close(block.weight, earlier.block.weight[:32])


def test_unreachable_ray_address_is_a_clear_error(tmp_path):
    import ray

    from vllm_mtpspec_train.train import connect_ray

    ray.shutdown()  # an earlier test's local instance would be reused
    with pytest.raises(TrainConfigError, match="cannot reach a Ray cluster"):
        connect_ray(TrainConfig(address="ray://127.0.0.1:1"))


def test_an_eagle3_layer_trains_online_tied_to_the_targets_lm_head(tiny_smol_teacher, tiny_data, tmp_path):
    """The eagle3 kind trains as the block does (whole answers with their prompt rows, the
    states entering its feature layers recorded by the target in the worker), through the
    target's LM head on its normalized output; an untied one is refused."""
    from vllm_mtpspec.checkpoint import load_heads
    from vllm_mtpspec.eagle3_layer import Eagle3Layer

    common = dict(model=str(tiny_smol_teacher), head_kind="eagle3", data_source="online", num_heads=2,
                  feature_layers=[0, 1], train_answers=str(tiny_data / "train" / "answers"),
                  held_out_data=str(tmp_path / "held"), held_out_answers=str(tiny_data / "held" / "answers"),
                  context_rows=16, batch_rows=128, max_steps=12, warmup_steps=2, lr=3e-3, num_negatives=256,
                  runner="local", checkpoint_every=6, log_every=1, storage_path=str(tmp_path / "runs"),
                  int2_group_size=None)
    with pytest.raises(TrainConfigError, match="head_kind='eagle3' projects through the target's LM head"):
        TrainConfig(**common, tied=False)
    summary = run_training(TrainConfig(**common, name="eagle3", out=str(tmp_path / "heads")))
    rows = [r for r in metrics(tmp_path / "runs" / "eagle3") if "loss" in r]
    assert sum(r["loss"] for r in rows[-3:]) < sum(r["loss"] for r in rows[:3]), rows
    layer, init = load_heads(summary["heads_dir"]), load_heads(tmp_path / "runs" / "eagle3" / "init-heads")
    assert isinstance(layer, Eagle3Layer) and layer.config.tied and layer.feature_layers == [0, 1]
    assert not torch.equal(layer.fc.weight, init.fc.weight)
    assert len(summary["held_out"]["fp32"]["conditional_top1"]) == 2
