"""Reading a model's input embedding and LM head straight from its safetensors files
(training workers need them as plain tensors; the model itself is never built there)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

EMBED = ("model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight")
LM_HEAD = ("lm_head.weight",)


def read_tensor(model_dir: Path, names: tuple[str, ...], *, rows: int | None = None) -> torch.Tensor | None:
    """The first of `names` found in the folder's safetensors files (only its first
    `rows` rows when given, read without loading the rest); None if none is there."""
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                if name in f.keys():
                    return f.get_tensor(name) if rows is None else f.get_slice(name)[:rows]
    return None


def embedding_and_lm_head(model_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """[V, d] input embedding and [V, d] LM head (the same tensor for tied models), fp32."""
    path = Path(model_dir)
    embed = read_tensor(path, EMBED)
    if embed is None:
        raise ValueError(f"{path}: no input embedding among {EMBED} in its safetensors files")
    config = json.loads((path / "config.json").read_text())
    lm_head = None if config.get("tie_word_embeddings", False) else read_tensor(path, LM_HEAD)
    return embed.float(), (embed if lm_head is None else lm_head).float()
