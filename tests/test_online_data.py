"""The training job's online data path (vllm_mtpspec_train/online.py) must train an attention draft
block on exactly the examples the shard path's BlockModule reads: the same rows, targets,
teacher distributions and unrolled chains. Run here on the CPU with a tiny random Llama."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.test_draft_block import make_block, tiny_block_for


@pytest.mark.parametrize("feature_layers", [(), (0, 1)])
def test_chains_of_chosen_rows_are_the_rows_of_the_full_unrolled_pass(feature_layers):
    block = make_block(num_heads=3, feature_layers=feature_layers)
    d = block.config.hidden_size
    torch.manual_seed(1)
    b, t = 2, 9
    features = torch.randn(b, t, d, dtype=torch.float64)
    embeds = [torch.randn(b, t, d, dtype=torch.float64) for _ in range(3)]
    positions = torch.arange(t).expand(b, t) + torch.tensor([[0], [5]])
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, 7:] = False                                                  # the second sequence is shorter
    layers = torch.randn(b, t, len(feature_layers), d, dtype=torch.float64) if feature_layers else None
    rows = torch.tensor([[4, 5, 6, 7, 8], [3, 4, 5, 6, 6]])
    full = block.unrolled(features, embeds, positions, valid, layers)
    chosen = block.unrolled(features, embeds, positions, valid, layers, query_rows=rows)
    for depth, (whole, part) in enumerate(zip(full, chosen)):
        torch.testing.assert_close(part, whole[torch.arange(b)[:, None], rows], msg=f"depth {depth + 1}")


@torch.no_grad()
def test_recorded_rows_and_batches_are_the_shards_examples(tiny_model):
    from vllm_mtpspec.shards import answer_sequence, unroll_sequences
    from vllm_mtpspec_train.answers import shard_from_answers
    from vllm_mtpspec_train.examples import shard_examples
    from vllm_mtpspec_train.online import batch_examples, record_rows, unrolled_states

    torch.manual_seed(2)
    pairs = [(torch.randint(0, 256, (n,)).tolist(), torch.randint(0, 256, (m,)).tolist())
             for n, m in [(9, 6), (3, 8), (14, 5)]]
    layers = [0, 1]
    block = tiny_block_for(tiny_model, num_heads=3, feature_layers=layers).double()
    embed = tiny_model.get_input_embeddings().weight.double()
    # Batched (padded) passes of the target, against one pass per answer.
    store = record_rows(tiny_model, pairs, context_rows=4, feature_layers=layers, top_k=3, batch_tokens=40,
                        device=torch.device("cpu"))
    shard = shard_from_answers(SimpleNamespace(model=tiny_model), ["a", "b", "c"], ["general"] * 3,
                               [p for p, _ in pairs], [a for _, a in pairs], top_k=3, context_rows=4,
                               feature_layers=layers)
    examples = shard_examples({**shard, "hidden": torch.zeros(shard["tokens"].numel(), 1)}, 3)
    batch = batch_examples(store, [0, 1, 2], 3)
    mine = unrolled_states(block, {**batch, "features": batch["features"].double(),
                                   "layer_features": batch["layer_features"].double()}, embed)
    mine = mine[batch["loss_b"], batch["loss_r"]]
    theirs = []
    for j in range(3):
        seq = answer_sequence(shard, j, layers)
        seq = {**seq, "features": seq["features"].double(), "layer_features": seq["layer_features"].double()}
        states = unroll_sequences(block, [seq], embed)[0, seq["first_answer_row"]:]
        theirs.append(states[: len(pairs[j][1]) - 1])                   # rows with a next token
    torch.testing.assert_close(mine, torch.cat(theirs), atol=1e-3, rtol=1e-3)
    assert batch["targets"].tolist() == examples["targets"].tolist()
    assert batch["teacher_ids"].tolist() == examples["teacher_ids"].tolist()
    torch.testing.assert_close(batch["teacher_logprobs"], torch.from_numpy(examples["teacher_logprobs"]))
    assert store.context == [4, 2, 4]                                   # capped by the prompt rows there are


@torch.no_grad()
def test_heads_rows_are_the_shards_examples(tiny_model):
    """Parallel and sequential heads read answer rows alone: the online rows must be the
    columns shard_examples gives the shard path."""
    from vllm_mtpspec_train.answers import shard_from_answers
    from vllm_mtpspec_train.examples import shard_examples
    from vllm_mtpspec_train.online import record_rows, row_examples

    torch.manual_seed(4)
    pairs = [(torch.randint(0, 256, (n,)).tolist(), torch.randint(0, 256, (m,)).tolist())
             for n, m in [(9, 6), (3, 8), (14, 2)]]
    store = record_rows(tiny_model, pairs, context_rows=0, feature_layers=[], top_k=3, batch_tokens=40,
                        device=torch.device("cpu"))
    shard = shard_from_answers(SimpleNamespace(model=tiny_model), ["a", "b", "c"], ["general"] * 3,
                               [p for p, _ in pairs], [a for _, a in pairs], top_k=3)
    theirs = shard_examples(shard, 3)
    mine = row_examples(store, [0, 1, 2], 3)
    assert len(mine["token"]) == 5 + 7 + 1
    for key in ("token", "targets", "teacher_ids"):
        assert mine[key].tolist() == theirs[key].tolist(), key
    torch.testing.assert_close(mine["teacher_logprobs"], torch.from_numpy(theirs["teacher_logprobs"]))
    torch.testing.assert_close(mine["hidden"], torch.from_numpy(theirs["hidden"]).float(), atol=2e-3, rtol=2e-3)


def test_length_batches_keep_padded_rows_within_the_budget():
    from vllm_mtpspec_train.online import length_batches

    lengths = [5, 9, 3, 12, 7, 30]
    batches = length_batches(lengths, 24, sorted(range(6), key=lambda i: lengths[i]))
    assert sorted(i for batch in batches for i in batch) == list(range(6))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 24


def test_heads_trained_elsewhere_are_calibrated_and_kept_in_their_dtype(tiny_model, tiny_model_dir, tmp_path):
    """python -m vllm_mtpspec_train.export (heads trained outside the Ray job): temperatures fitted and rank accuracies measured on the
    held-out shards, the weights written back as they came (fp16), the run's log drawn."""
    import json

    from vllm_mtpspec.checkpoint import load_heads, save_heads, stored_dtype
    from vllm_mtpspec.heads_init import init_draft_block
    from vllm_mtpspec.shards import write_shard
    from vllm_mtpspec_train.answers import shard_from_answers
    from vllm_mtpspec_train.evaluate import TEMPERATURE_GRID
    from vllm_mtpspec_train.export import main

    torch.manual_seed(3)
    run = tmp_path / "run"
    block = init_draft_block(tiny_model, tiny_model_dir, num_heads=2)
    save_heads(block.half(), run / "heads")
    (run / "summary.json").write_text(json.dumps({"train": {"steps": 2}}))
    (run / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 - s, "ce_0": 1.0, "ce_1": 2.0})
                                                 + "\n" for s in (1, 2)))
    pairs = [(torch.randint(0, 256, (7,)).tolist(), torch.randint(0, 256, (12,)).tolist()) for _ in range(3)]
    shard = shard_from_answers(SimpleNamespace(model=tiny_model), ["a", "b", "c"], ["general"] * 3,
                               [p for p, _ in pairs], [a for _, a in pairs], top_k=3, context_rows=4)
    write_shard(tmp_path / "held-out", 0, shard)
    before = json.loads((run / "heads" / "config.json").read_text())
    assert main([str(run / "heads"), "--held-out", str(tmp_path / "held-out"), "--out", str(tmp_path / "out"),
                 "--model", str(tiny_model_dir)]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert before["rank_accuracy"] is None and len(config["rank_accuracy"]) == 2
    assert all(t in TEMPERATURE_GRID for t in config["temperatures"])
    assert stored_dtype(tmp_path / "out") == torch.float16
    load_heads(tmp_path / "out")                                      # loads, every tensor checked
    summary = json.loads((tmp_path / "out" / "train_summary.json").read_text())
    assert summary["training"] == {"train": {"steps": 2}}
    assert summary["held_out"]["fp32"]["rows"] > 0
    from PIL import Image

    with Image.open(tmp_path / "out" / "loss_curves.png") as plot:  # a palette PNG: a third of RGBA's bytes
        assert plot.mode == "P" and plot.size == (840, 480)


def test_conditional_hits_count_a_depth_only_while_the_chain_before_it_is_right():
    """The held-out scorers' shared count (vllm_mtpspec_train/evaluate.py), along one answer and from
    per-row targets."""
    from vllm_mtpspec_train.evaluate import chain_hits, conditional_hits

    tokens = torch.tensor([5, 6, 7, 8, 9])
    top1 = torch.tensor([[6, 7],      # both right
                         [7, 0],      # depth 1 right, depth 2 wrong
                         [0, 9],      # depth 1 wrong: depth 2 not asked, though it guessed right
                         [9, 3],      # depth 1 right; the answer ends before depth 2
                         [1, 1]])     # nothing left to guess
    hits, asked = conditional_hits(top1, tokens)
    assert hits.tolist() == [3, 1] and asked.tolist() == [4, 2]
    targets = torch.tensor([[6, 7], [7, 8], [8, 9], [9, -1], [-1, -1]])
    hits, asked = chain_hits(top1, targets)
    assert hits.tolist() == [3, 1] and asked.tolist() == [4, 2]


def test_epoch_batches_cover_every_answer_once_and_depend_on_the_seed_alone():
    from types import SimpleNamespace

    from vllm_mtpspec_train.online import epoch_batches, seed_of

    store = SimpleNamespace(context=[3, 0, 5, 2, 7, 1], length=[9, 4, 20, 6, 3, 11], num_answers=6)
    first = epoch_batches(store, batch_rows=30, seed=seed_of(0, 1, 2))
    assert sorted(a for batch in first for a in batch) == list(range(6))
    assert epoch_batches(store, batch_rows=30, seed=seed_of(0, 1, 2)) == first
    assert len({str(epoch_batches(store, batch_rows=30, seed=seed_of(0, 1, e))) for e in range(8)}) > 1
    assert seed_of(0, 1, 2) != seed_of(0, 2, 1)


def test_the_learning_rate_warms_up_then_falls_with_the_step():
    from vllm_mtpspec_train.train import lr_factor

    factors = [lr_factor(s, warmup_steps=4, total_steps=20) for s in range(20)]
    assert factors[:4] == pytest.approx([0.25 * 1.0, 0.5 * 0.95, 0.75 * 0.9, 1.0 * 0.85])
    assert all(a >= b for a, b in zip(factors[3:], factors[4:]))
    assert factors[-1] == pytest.approx(0.05)


@pytest.mark.parametrize("fields, message", [
    ({"head_kind": "attention", "data_source": "online", "train_answers": "a"},
     r"data_source='online': the schedule is in steps.*set max_steps"),
    ({"mode": "cotrain", "student": "s", "data_source": "online", "train_answers": "a", "max_steps": 5},
     r"data_source='online' with mode='cotrain'.*set data_source='shards'"),
    ({"data_source": "online", "train_answers": "a", "max_steps": 5, "quantize_aware_steps": 3, "int2_group_size": 64},
     r"data_source='online' with quantize_aware_steps.*set quantize_aware_steps to 0 or data_source='shards'"),
    ({"head_kind": "attention", "data_source": "online", "max_steps": 5}, r"data_source='online' reads answer files: set train_answers"),
    ({"head_kind": "attention", "data_source": "online", "train_answers": "a", "max_steps": 5,
      "int2_method": "gptq"}, r"data_source='online' with int2_method='gptq'.*use int2_method 'rtn'"),
    ({"data_source": "memory"}, r"data_source='memory': choose one of \('shards', 'online'\)"),
    ({"warmup_steps": 0}, r"warmup_steps=0: must be a whole number >= 1"),
    ({"max_steps": "100"}, r"max_steps='100': must be a whole number >= 1"),
])
def test_a_bad_online_config_names_the_file_the_field_and_the_fix(tmp_path, fields, message):
    import json

    from vllm_mtpspec_train.config import TrainConfig, TrainConfigError

    path = tmp_path / "block.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(TrainConfigError, match=f"^{path}: {message}"):
        TrainConfig.from_file(path)


def test_online_answer_folders_without_answers_are_a_clear_error(tiny_model_dir, tmp_path):
    from vllm_mtpspec_train.config import TrainConfig, TrainConfigError
    from vllm_mtpspec_train.train import _online_answers

    config = TrainConfig(model=str(tiny_model_dir), head_kind="attention", data_source="online", max_steps=5,
                         train_answers=[str(tmp_path / "empty")])
    with pytest.raises(TrainConfigError, match=r"train_answers: .*empty: no answer files.*restore_answers.sh"):
        _online_answers(config, tiny_model_dir)


@torch.no_grad()
def test_human_text_is_labelled_with_the_targets_own_top1_and_fed_as_written(tiny_model):
    from vllm_mtpspec_train.online import TrainingAnswer, batch_examples, record_rows

    torch.manual_seed(3)
    prompt, text = torch.randint(0, 256, (7,)).tolist(), torch.randint(0, 256, (9,)).tolist()
    answers = [TrainingAnswer(prompt, text, False), TrainingAnswer(prompt, text, True)]
    store = record_rows(tiny_model, answers, context_rows=3, feature_layers=[], top_k=2, batch_tokens=64,
                        device=torch.device("cpu"))
    logits = tiny_model(torch.tensor([prompt + text])).logits[0]
    top1 = logits[len(prompt) - 1:-1].argmax(-1)                        # the target's choice for each text token
    assert not torch.equal(top1, torch.tensor(text))                     # a random text: the labels must differ
    own, human = (slice(store.start[a].item(), store.start[a].item() + 3 + 9) for a in (0, 1))
    assert store.tokens[own].tolist() == store.tokens[human].tolist()    # both read the text as written
    assert store.labels[own][3:].tolist() == text                        # the target's own answer: its tokens
    assert store.labels[human][3:].tolist() == top1.tolist()             # human text: the target's top-1
    batch = batch_examples(store, [1], depth=2)
    assert batch["targets"][:, 0].tolist() == top1[1:].tolist()          # depth 1 from answer row r: label of r + 1
    assert batch["targets"][:-1, 1].tolist() == top1[2:].tolist()


def test_answer_files_of_human_text_say_so_and_the_job_reads_it(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from tests.conftest import make_tiny_smol
    from vllm_mtpspec.answers import read_answers
    from vllm_mtpspec.prompts import Prompt
    from vllm_mtpspec_train.data import write_text_answers
    from vllm_mtpspec_train.online import read_answer_dirs

    model_dir = make_tiny_smol(tmp_path / "smol", seed=0)
    texts = [(Prompt("Describe the package `alpha`.", "package-docs", "a"), "Alpha parses dates. " * 3),
             (Prompt("Describe the package `beta`.", "package-docs", "b"), "Beta draws plots. " * 40),
             (Prompt("Describe the package `gamma`.", "package-docs", "c"), "Gamma reads files.")]
    write_text_answers(model_dir, texts, tmp_path / "answers", max_new_tokens=32, shard_size=2)
    first = read_answers(tmp_path / "answers" / "answers-00000.npz")
    assert first["meta"]["labels"] == "target"
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    whole, cut = first["answers"]
    assert whole == tokenizer.encode("Alpha parses dates. Alpha parses dates. Alpha parses dates.",
                                     add_special_tokens=False) + [tokenizer.eos_token_id]
    assert len(cut) == 32 and cut[-1] != tokenizer.eos_token_id        # cut texts do not end the turn
    read = read_answer_dirs([str(tmp_path / "answers")], fingerprint=None, vocab_size=49152)
    assert [answer.labels_from_target for answer in read] == [True, True, True]
    assert len(read_answer_dirs([str(tmp_path / "answers")], fingerprint=None, vocab_size=49152,
                                files_per_dir=[1])) == 2              # the first answer file only


def test_max_train_shards_counts_answer_files_on_the_online_path(tiny_model_dir, tmp_path):
    from vllm_mtpspec.answers import answers_path, write_answers
    from vllm_mtpspec.checkpoint import model_fingerprint
    from vllm_mtpspec_train.config import TrainConfig
    from vllm_mtpspec_train.train import _online_answers

    for folder, files in (("many", 3), ("few", 1)):
        for index in range(files):
            write_answers(answers_path(tmp_path / folder, index), [f"{folder}{index}"], ["general"], [[1, 2, 3]],
                          [[4, 5, 6, 7]], fingerprint=model_fingerprint(tiny_model_dir), vocab_size=256)
    config = TrainConfig(model=str(tiny_model_dir), head_kind="attention", data_source="online", max_steps=5,
                         train_answers=[str(tmp_path / "many"), str(tmp_path / "few")], max_train_shards=3)
    summary = _online_answers(config, tiny_model_dir)
    assert summary["answer_files_per_dir"] == [2, 1]                   # split as evenly as the folders allow
    assert summary["train_answers"] == 3 and summary["train_answer_tokens"] == 12


def test_human_text_cli_names_the_sources_it_has_and_needs_no_shard_folder(capsys):
    from vllm_mtpspec_train.data import main

    with pytest.raises(SystemExit):
        main(["--prompts", "dataframebench", "--human-text", "--answers", "somewhere"])
    assert "--human-text writes the texts of --prompts sharegpt or package-docs into --answers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--prompts", "sharegpt", "--answers-only"])          # generating answers still needs --out
    assert "--out: give the folder for the shards" in capsys.readouterr().err


@torch.no_grad()
def test_layer_states_beyond_fp16s_range_are_kept_finite_online_and_in_shards(tiny_model):
    """The states entering a layer are the unnormalized residual stream: Gemma 3 270M's reach
    1e5 past its ninth layer, beyond fp16's 65,504, and a row stored as inf made the whole
    training loss NaN. Both data paths keep them finite and close to the fp32 states."""
    import copy

    from vllm_mtpspec_train.answers import shard_from_answers
    from vllm_mtpspec_train.online import record_rows, recording_layer_inputs

    model = copy.deepcopy(tiny_model)
    model.get_input_embeddings().weight.mul_(1e6)                      # a residual stream far past 65,504
    pairs = [([1, 2, 3, 4, 5], [6, 7, 8])]
    with recording_layer_inputs(model.get_decoder(), [1], whole_batch=True) as entering:
        model.get_decoder()(input_ids=torch.tensor([pairs[0][0] + pairs[0][1]]))
    exact = entering[1][0, 1:7].float()                                # rows 1 .. 6: context 3, answer 3
    assert exact.abs().max() > 65504
    store = record_rows(model, pairs, context_rows=3, feature_layers=[1], top_k=2, batch_tokens=40,
                        device=torch.device("cpu"))
    torch.testing.assert_close(store.layer_features[:, 0].float(), exact, rtol=1e-2, atol=0.0)
    shard = shard_from_answers(SimpleNamespace(model=model), ["a"], ["general"], [pairs[0][0]], [pairs[0][1]],
                               top_k=2, context_rows=3, feature_layers=[1])
    stored = [v for k, v in shard.items() if "layer" in k and torch.is_tensor(v) and v.is_floating_point()]
    assert stored and all(torch.isfinite(v.float()).all() for v in stored)
