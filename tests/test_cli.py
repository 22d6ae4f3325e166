import json
import shutil
import subprocess
import sys

import pytest
import torch

from vllm_mtpspec.cli import build_parser, main

SUBCOMMANDS = [[], ["models"], ["models", "fetch"], ["models", "list"], ["heads"], ["heads", "init"],
               ["heads", "info"], ["heads", "quantize"], ["heads", "cast"], ["heads", "draft-vocab"], ["decode"], ["demo"],
               ["eval-heads"]]


@pytest.mark.parametrize("words", SUBCOMMANDS, ids=lambda w: " ".join(w) or "mtpspec")
def test_every_subcommand_has_help(words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(words + ["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: mtpspec" in out and len(out.splitlines()) > 3


def test_console_script_is_installed():
    proc = subprocess.run([sys.executable, "-m", "vllm_mtpspec.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "decode" in proc.stdout


def test_the_training_commands_come_from_entry_points_and_train_owns_its_flags(capsys):
    """train and eval-heads live in vllm_mtpspec_train, registered under mtpspec.commands
    (the library never imports that package); train's arguments all go to the Ray job."""
    from importlib.metadata import entry_points

    assert {e.name for e in entry_points(group="mtpspec.commands")} >= {"train", "eval-heads"}
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0 and "usage: mtpspec train" in capsys.readouterr().out
    assert main(["train", "--config", "/no/such/config.json", "--max-steps", "3"]) == 2
    assert "training config /no/such/config.json does not exist" in capsys.readouterr().err


def test_without_the_training_package_its_commands_name_the_extra_to_install(monkeypatch, capsys):
    import vllm_mtpspec.cli

    monkeypatch.setattr(vllm_mtpspec.cli, "entry_points", lambda group: [])
    for command in (["train", "--config", "c.json"], ["eval-heads", "--model", "m"]):
        assert main(command) == 2
        assert 'the training package is not installed; install the training job with: pip install ' \
               '"vllm-mtpspec[train]"' in capsys.readouterr().err


def test_a_missing_module_of_the_train_extra_is_named_with_the_extra(capsys):
    from vllm_mtpspec_train.commands import needs_train_extra

    def needs_ray():
        raise ModuleNotFoundError("No module named 'ray'", name="ray")

    def has_a_bug():
        raise ModuleNotFoundError("No module named 'vllm_mtpspec.missing'", name="vllm_mtpspec.missing")

    assert needs_train_extra("train", needs_ray) == 2
    assert 'ray is not installed; the training job needs the train extra: pip install "vllm-mtpspec[train]"' \
        in capsys.readouterr().err
    with pytest.raises(ModuleNotFoundError):  # not the extra's: a real error, raised as it is
        needs_train_extra("train", has_a_bug)


def test_heads_init_info_quantize_on_a_model_folder(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "heads"
    assert main(["heads", "init", "--model", str(tiny_model_dir), "--num-heads", "3", "--untied", "--out", str(out)]) == 0
    assert main(["heads", "info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert info["num_heads"] == 3 and info["tied"] is False and info["bits_per_weight"] == 32.0
    assert main(["heads", "quantize", str(out), "--group-size", "32", "--out", str(tmp_path / "q")]) == 0
    capsys.readouterr()
    assert main(["heads", "info", str(tmp_path / "q"), "--json"]) == 0
    qinfo = json.loads(capsys.readouterr().out)
    assert qinfo["bits_per_weight"] == 2.0 + 32 / 32  # 2-bit codes + fp16 scale and min per 32
    assert qinfo["bytes_on_disk"] < info["bytes_on_disk"] / 8


def test_heads_cast_halves_the_file_and_keeps_the_heads(tiny_model, tiny_model_dir, tmp_path, capsys):
    import torch
    from safetensors import safe_open

    from vllm_mtpspec.checkpoint import load_heads

    out = tmp_path / "heads"
    assert main(["heads", "init", "--model", str(tiny_model_dir), "--num-heads", "3", "--mlp-size", "96",
                 "--head-input", "hidden+token", "--out", str(out)]) == 0
    assert main(["heads", "cast", str(out), "--out", str(tmp_path / "half")]) == 0
    with safe_open(str(tmp_path / "half" / "heads.safetensors"), framework="pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.float16}
    assert (tmp_path / "half" / "heads.safetensors").stat().st_size < 0.55 * (out / "heads.safetensors").stat().st_size
    full, half = load_heads(out), load_heads(tmp_path / "half")  # loads into the heads' fp32 parameters
    h, e = torch.randn(4, 64), torch.randn(4, 64)
    lm_head = tiny_model.get_output_embeddings()
    torch.testing.assert_close(half(h, token_embeds=e, lm_head=lm_head), full(h, token_embeds=e, lm_head=lm_head),
                               rtol=1e-2, atol=1e-2)
    assert main(["heads", "quantize", str(out), "--out", str(tmp_path / "q"), "--group-size", "32"]) == 0
    assert main(["heads", "cast", str(tmp_path / "q"), "--out", str(tmp_path / "q16")]) == 2
    assert "INT2 heads keep their packed codes" in capsys.readouterr().err


def test_errors_name_the_problem_and_exit_2(tiny_model_dir, tmp_path, capsys):
    assert main(["heads", "info", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    out = tmp_path / "h"
    main(["heads", "init", "--model", str(tiny_model_dir), "--num-heads", "2", "--out", str(out)])
    assert main(["heads", "quantize", str(out), "--group-size", "6", "--out", str(tmp_path / "q")]) == 2
    assert "group_size" in capsys.readouterr().err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert main(["decode", "--model", str(tiny_model_dir), "--heads", str(out), "--prompts", str(prompts),
                 "--num-heads", "3"]) == 2
    assert "num_speculative_tokens=3 but the heads directory has only 2 heads" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("this is not json\n")
    assert main(["decode", "--model", str(tiny_model_dir), "--heads", str(out), "--prompts", str(bad)]) == 2
    assert "not a JSON line" in capsys.readouterr().err


def test_heads_quantize_calibrated_on_shards(tiny_model_dir, tmp_path, capsys):
    from vllm_mtpspec.checkpoint import load_heads
    from vllm_mtpspec.shards import write_shard

    out = tmp_path / "h"
    main(["heads", "init", "--model", str(tiny_model_dir), "--num-heads", "2", "--head-input", "hidden+token",
          "--out", str(out)])
    assert main(["heads", "quantize", str(out), "--method", "gptq", "--out", str(tmp_path / "q")]) == 2
    assert "--method gptq needs --calibration" in capsys.readouterr().err
    assert main(["heads", "quantize", str(out), "--method", "gptq", "--calibration", str(tmp_path / "none"),
                 "--out", str(tmp_path / "q")]) == 2
    assert "holds no shard-*.pt files" in capsys.readouterr().err
    n, vocab = 300, json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    write_shard(tmp_path / "shards", 0, {"hidden": torch.randn(n, 64).half(), "tokens": torch.randint(0, vocab, (n,)),
                                         "offsets": torch.tensor([0, n])})
    assert main(["heads", "quantize", str(out), "--method", "search", "--calibration", str(tmp_path / "shards"),
                 "--model", str(tiny_model_dir), "--calibration-rows", "200", "--group-size", "32",
                 "--out", str(tmp_path / "q")]) == 0
    quant = load_heads(tmp_path / "q").config.quantization
    assert quant.method == "search" and quant.calibration.startswith("200 rows of")


def test_heads_draft_vocab_keeps_the_most_frequent_answer_tokens(tiny_model_dir, tmp_path, capsys):
    from vllm_mtpspec.answers import answers_path, write_answers
    from vllm_mtpspec.checkpoint import load_heads

    out = tmp_path / "heads"
    assert main(["heads", "init", "--model", str(tiny_model_dir), "--num-heads", "2", "--out", str(out)]) == 0
    write_answers(answers_path(tmp_path / "answers", 0), ["a", "b"], ["chat", "chat"], [[1, 2], [3]],
                  [[9, 9, 9, 4, 4, 7], [4, 9, 200]], fingerprint="f", vocab_size=256)
    assert main(["heads", "draft-vocab", str(out), "--size", "3", "--answers", str(tmp_path / "answers"),
                 "--out", str(tmp_path / "dv")]) == 0
    assert "3 most frequent tokens of 9 answer tokens" in capsys.readouterr().err
    assert load_heads(tmp_path / "dv").draft_vocab.tolist() == [9, 4, 7]
    assert main(["heads", "info", str(tmp_path / "dv"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["draft_vocab_size"] == 3
    assert main(["heads", "draft-vocab", str(out), "--size", "3", "--answers", str(tmp_path / "empty"),
                 "--out", str(tmp_path / "dv2")]) == 2
    assert "holds no answers-*.npz files" in capsys.readouterr().err
    assert main(["heads", "draft-vocab", str(out), "--size", "0", "--answers", str(tmp_path / "answers"),
                 "--out", str(tmp_path / "dv2")]) == 2
    assert "--size 0: must lie in 1..256" in capsys.readouterr().err


def scored(heads, shards, model, capsys) -> str:
    """What `mtpspec eval-heads` prints for heads on the tiny test answers' shards."""
    capsys.readouterr()
    assert main(["eval-heads", "--model", str(model), "--heads", str(heads), "--prompts", str(shards)]) == 0
    printed = capsys.readouterr().out
    assert "11 positions" in printed and "top-1 when the heads before it were right" in printed
    return printed


def test_a_draft_block_is_made_inspected_quantized_and_scored_and_refused_data_it_cannot_read(tiny_smol_teacher,
                                                                                             tmp_path, capsys):
    from vllm_mtpspec.answers import answers_path, write_answers
    from vllm_mtpspec.checkpoint import load_heads, model_fingerprint
    from vllm_mtpspec_train.answers import shards_from_answers

    out = tmp_path / "block"
    assert main(["heads", "init", "--model", str(tiny_smol_teacher), "--kind", "attention", "--num-heads", "2",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["heads", "info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["head_kind"] == "attention" and info["block"]["kv_heads"] == 1 and "mlp_size" not in info
    assert info["parameters"] == sum(t.numel() for t in load_heads(out).state_dict().values())
    assert main(["heads", "quantize", str(out), "--out", str(tmp_path / "rtn")]) == 0
    assert load_heads(tmp_path / "rtn").is_quantized
    answers = tmp_path / "answers"
    write_answers(answers_path(answers, 0), ["a", "b"], ["general", "code"], [[1, 9, 40, 7], [5, 6, 7, 8, 9]],
                  [[11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26]],
                  fingerprint=model_fingerprint(tiny_smol_teacher), vocab_size=49152)
    shards_from_answers(tiny_smol_teacher, answers, tmp_path / "answer-rows", top_k=4)
    assert main(["eval-heads", "--model", str(tiny_smol_teacher), "--heads", str(out),
                 "--prompts", str(tmp_path / "answer-rows")]) == 2
    assert "carry none (context_hidden)" in capsys.readouterr().err
    gptq = ["heads", "quantize", str(out), "--method", "gptq", "--model", str(tiny_smol_teacher), "--out",
            str(tmp_path / "gptq"), "--calibration"]
    assert main(gptq + [str(tmp_path / "answer-rows")]) == 2
    assert "answer-rows/shard-00000.pt: an attention draft block is calibrated on answers read with the prompt " \
           "rows before them, and this shard keeps none" in capsys.readouterr().err
    shards_from_answers(tiny_smol_teacher, answers, tmp_path / "with-context", top_k=4, context_rows=512)
    assert main(gptq + [str(tmp_path / "with-context")]) == 0
    quantization = load_heads(tmp_path / "gptq").config.quantization
    # Both answers, each whole.
    assert quantization.method == "gptq" and quantization.calibration.startswith(f"{6 + 7} answer rows")
    for heads in (out, tmp_path / "gptq"):
        printed = scored(heads, tmp_path / "with-context", tiny_smol_teacher, capsys)
    assert "chain+lookup (prompt lookup's draft where found" in printed
    shutil.copytree(tmp_path / "with-context", tmp_path / "second-source")
    assert main(["eval-heads", "--model", str(tiny_smol_teacher), "--heads", str(out),
                 "--prompts", f"{tmp_path / 'with-context'},{tmp_path / 'second-source'}"]) == 0
    printed = capsys.readouterr().out
    assert "22 positions" in printed and "[source with-context] rows 11" in printed
    assert "[source second-source] rows 11" in printed


@pytest.mark.parametrize("kind", ["sequential", "attention"])
def test_every_head_kind_is_inspected_cast_and_scored_with_and_without_a_draft_vocabulary(kind, tiny_smol_teacher,
                                                                                         tmp_path, capsys):
    import torch
    from safetensors import safe_open

    from vllm_mtpspec.answers import answers_path, write_answers
    from vllm_mtpspec.checkpoint import load_heads, model_fingerprint
    from vllm_mtpspec_train.answers import shards_from_answers

    out = tmp_path / kind
    assert main(["heads", "init", "--model", str(tiny_smol_teacher), "--kind", kind, "--num-heads", "3",
                 "--head-input", "hidden+token", "--mlp-size", "64", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["heads", "info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["head_kind"] == kind and info["num_heads"] == 3
    assert info["parameters"] == sum(t.numel() for t in load_heads(out).state_dict().values())
    assert main(["heads", "cast", str(out), "--out", str(tmp_path / "half")]) == 0
    with safe_open(str(tmp_path / "half" / "heads.safetensors"), framework="pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.float16}
    full, half = load_heads(out), load_heads(tmp_path / "half")
    assert type(half) is type(full) and half.config.head_kind == kind
    for name, tensor in full.state_dict().items():
        torch.testing.assert_close(half.state_dict()[name], tensor.half().float())
    answers = tmp_path / "answers"
    write_answers(answers_path(answers, 0), ["a", "b"], ["general", "code"], [[1, 9, 40, 7], [5, 6, 7, 8, 9]],
                  [[11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26]],
                  fingerprint=model_fingerprint(tiny_smol_teacher), vocab_size=49152)
    shards_from_answers(tiny_smol_teacher, answers, tmp_path / "rows", top_k=4, context_rows=512)
    assert main(["heads", "draft-vocab", str(out), "--size", "8", "--answers", str(answers),
                 "--out", str(tmp_path / "dv")]) == 0
    assert load_heads(tmp_path / "dv").draft_vocab.numel() == 8
    for heads in (out, tmp_path / "dv"):
        scored(heads, tmp_path / "rows", tiny_smol_teacher, capsys)


def test_commands_take_the_drafter_shipped_for_their_model_and_name_the_fix_where_none_ships(tmp_path):
    """A known model gets its own shipped drafter; a Hugging Face folder (which has a
    config.json too) is never mistaken for one, and a command without a drafter says what
    to pass."""
    from vllm_mtpspec.shipped import SHIPPED_HEADS, shipped_heads_dir, shipped_heads_for

    assert shipped_heads_dir("smollm2-135m-instruct") == SHIPPED_HEADS / "smollm2-135m-instruct"
    (tmp_path / "config.json").write_text("{}")
    assert shipped_heads_dir(str(tmp_path)) is None
    with pytest.raises(SystemExit, match=r"mtpspec serve: no drafter ships for .*; pass --heads DIR"):
        shipped_heads_for(str(tmp_path), "mtpspec serve")
    with pytest.raises(SystemExit):  # an unknown model name is refused by the parser
        build_parser().parse_args(["demo", "--model", "no-such-model"])
