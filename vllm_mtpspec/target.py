"""Loading a target model with transformers, and heads checked against it."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from vllm_mtpspec.checkpoint import check_heads_match_model, load_heads, model_fingerprint, read_heads_config
from vllm_mtpspec.heads import MTPHeads
from vllm_mtpspec.models import resolve_model

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Target:
    model: object
    model_dir: Path

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir))

    @property
    def eos_token_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        gen = getattr(self.model, "generation_config", None)
        extra = getattr(gen, "eos_token_id", None)
        ids.update(extra if isinstance(extra, list) else [extra])
        return {i for i in ids if i is not None}


def load_target(model: str, *, dtype: str = "fp32") -> Target:
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model(model, dtype="fp32" if dtype == "fp32" else "bf16")
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=TORCH_DTYPES[dtype], attn_implementation="sdpa")
    return Target(hf.eval(), model_dir)


def load_heads_for(target: Target, heads_dir: str | Path) -> MTPHeads:
    """Heads, refused before use if they were made for another model."""
    config = read_heads_config(heads_dir)
    cfg = target.model.config
    check_heads_match_model(
        config,
        heads_dir=heads_dir,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        fingerprint=model_fingerprint(target.model_dir),
    )
    return load_heads(heads_dir, dtype=next(target.model.parameters()).dtype)
