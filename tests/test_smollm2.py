"""The core on the real model: SmolLM2-135M-Instruct from its PyPI package, fp32."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.oracle import OracleDrafter
from vllm_mtpspec.config import SpecOptions
from vllm_mtpspec.prompts import apply_chat_template, load_prompts_jsonl
from vllm_mtpspec.reference import ReferenceDecoder, plain_greedy

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parent.parent
PROMPTS = ROOT / "benchmarks" / "prompts" / "demo.jsonl"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "vllm_mtpspec.cli", *args], capture_output=True, text=True, timeout=1800)


def test_fetch_prints_the_folder_last_and_is_idempotent(smollm2_fp32):
    first = run_cli("models", "fetch", "smollm2-135m-instruct", "--dtype", "fp32")
    assert first.returncode == 0, first.stderr
    folder = Path(first.stdout.strip().splitlines()[-1])
    assert folder == smollm2_fp32.model_dir
    marker = folder / ".complete"
    before = marker.stat().st_mtime_ns
    again = run_cli("models", "fetch", "smollm2-135m-instruct", "--dtype", "fp32")
    assert again.stdout.strip().splitlines()[-1] == str(folder)
    assert marker.stat().st_mtime_ns == before  # not converted a second time
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)


def test_check_lossless_on_ten_prompts_with_random_heads(smollm2_fp32, tmp_path):
    heads = tmp_path / "heads"
    assert run_cli("heads", "init", "--model", str(smollm2_fp32.model_dir), "--num-heads", "4", "--out", str(heads)).returncode == 0
    proc = run_cli("decode", "--model", str(smollm2_fp32.model_dir), "--heads", str(heads), "--prompts", str(PROMPTS),
                   "--tree", "consensus", "--max-new-tokens", "24", "--check-lossless", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["summary"]["prompts"] == 10
    assert report["summary"]["identical"] == 10
    assert all(row["identical"] for row in report["prompts"])


def test_heads_for_another_model_are_refused_at_start(smollm2_fp32, tiny_model_dir, tmp_path):
    heads = tmp_path / "tiny-heads"
    run_cli("heads", "init", "--model", str(tiny_model_dir), "--num-heads", "2", "--out", str(heads))
    proc = run_cli("decode", "--model", str(smollm2_fp32.model_dir), "--heads", str(heads), "--prompts", str(PROMPTS))
    assert proc.returncode == 2
    assert "belong to another model" in proc.stderr and "config.json" in proc.stderr


@pytest.mark.parametrize("tree", ["chain", "consensus"])
def test_oracle_heads_on_the_real_model_accept_every_draft(smollm2_fp32, tree):
    target, k = smollm2_fp32, 4
    prompt = load_prompts_jsonl(PROMPTS, limit=1)[0]
    ids = target.tokenizer.encode(apply_chat_template(target.tokenizer, prompt.text), add_special_tokens=False)
    expected = plain_greedy(target.model, ids, max_new_tokens=31, eos_token_ids=set())
    oracle = OracleDrafter(target.model, ids, expected, num_heads=k, vocab_size=target.model.config.vocab_size)
    decoder = ReferenceDecoder(target.model, oracle, SpecOptions(tree=tree, prompt_lookup_max=0))
    # The oracle's token is always the top-1 candidate: the tree's all-top-1 path is taken.
    top1_depth = max(len(p) for p in decoder.static_shape.paths if set(p) == {0})
    result = decoder.decode(ids, max_new_tokens=1 + 5 * (top1_depth + 1))
    assert result.tokens == expected[: len(result.tokens)] and len(result.tokens) == 1 + 5 * (top1_depth + 1)
    assert [s.accepted_len for s in result.steps] == [top1_depth + 1] * 5
