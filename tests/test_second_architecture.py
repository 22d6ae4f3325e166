"""Architectures beside Llama served through vLLM with the plugin, greedy output identical to
vLLM alone's: random Gemma 3 and Qwen3 folders saved by transformers (no code names them),
and the real Gemma 3 270M past its sliding window."""
from __future__ import annotations

import gc
import os
import shutil

import pytest
import torch

ENGINE = dict(dtype="float32", max_model_len=2048, kv_cache_memory_bytes=256 << 20, enforce_eager=True,
              enable_prefix_caching=True, max_num_seqs=4, disable_log_stats=False)
# Text that repeats (prompt lookup drafts from it) and text that does not.
PROMPTS = [
    "Hi! Tell me about the weather.",
    " ".join(f"Item {i} costs {i * 7} dollars and ships in {i % 5 + 1} days." for i in range(30)) + " So item",
    "Write a list of ten fruits, one per line:",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
]


def tiny_folder(out, architecture: str):
    """A random model of `architecture` with SmolLM2's tokenizer: 4 layers, head_dim 64."""
    import transformers

    from vllm_mtpspec.models import fetch_model

    common = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    config = {
        "gemma3": lambda: transformers.Gemma3TextConfig(**common, sliding_window=32, query_pre_attn_scalar=64),
        "qwen3": lambda: transformers.Qwen3Config(**common),
    }[architecture]()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    source = fetch_model("smollm2-135m-instruct", dtype="fp32")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out)
    return out


def fresh_drafter(model_dir, out, kind: str):
    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.kinds.registry import kind_named
    from vllm_mtpspec.model_profile import model_profile
    from vllm_mtpspec.target import load_target

    target = load_target(str(model_dir), dtype="fp32")
    layers = model_profile(model_dir).default_feature_layers
    heads = kind_named(kind).initial_heads(target.model, model_dir, num_heads=3, seed=0, feature_layers=layers)
    return save_heads(heads, out)


def served(model_dir, prompts, max_tokens: int, **kwargs):
    from vllm import LLM, SamplingParams

    llm = LLM(str(model_dir), **ENGINE, **kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    drafts = sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
    result = [list(o.outputs[0].token_ids) for o in outs], [len(o.prompt_token_ids) for o in outs], drafts
    del llm
    gc.collect()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("architecture,kind", [("gemma3", "attention"), ("qwen3", "eagle3")])
def test_a_folder_of_another_architecture_serves_losslessly_with_a_fresh_drafter(tmp_path, architecture, kind):
    """The drafter reads the target's layers (vLLM's EAGLE-3 interface; Gemma 3's the
    plugin gives it) and prompt lookup drafts where the text repeats, past Gemma's window."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    model_dir = tiny_folder(tmp_path / architecture, architecture)
    heads = fresh_drafter(model_dir, tmp_path / "heads", kind)
    alone, prompt_lengths, _ = served(model_dir, PROMPTS, 96)
    speculated, _, drafts = served(model_dir, PROMPTS, 96, speculative_config={
        "method": "mtpspec", "model": str(heads), "num_speculative_tokens": 3, "draft_size": "fixed",
        "batch_backoff_start": 64})
    assert max(prompt_lengths) + 96 > 3 * 32  # past Gemma's window of 32
    assert drafts > 0
    assert speculated == alone


@pytest.mark.slow
def test_gemma3_270m_serves_losslessly_past_its_sliding_window(tmp_path):
    """The real Gemma 3 270M (fp32): a prompt of more than 1,024 tokens and answers, with a
    fresh block reading layers 2, 9, 15, drafting chains beside prompt lookup."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_mtpspec.models import fetch_model

    model_dir = fetch_model("gemma3-270m", dtype="fp32")
    heads = fresh_drafter(model_dir, tmp_path / "heads", "attention")
    long = " ".join(f"Section {i}: the committee reviewed item {i} and approved a budget of {i * 13} dollars."
                    for i in range(60)) + "\nSummary of the sections above:"
    prompts = [long, "The capital of France is", "def fibonacci(n):\n"]
    alone, prompt_lengths, _ = served(model_dir, prompts, 64)
    speculated, _, drafts = served(model_dir, prompts, 64, speculative_config={
        "method": "mtpspec", "model": str(heads), "num_speculative_tokens": 3, "draft_size": "fixed",
        "batch_backoff_start": 64})
    assert prompt_lengths[0] > 1024
    assert drafts > 0
    assert speculated == alone
