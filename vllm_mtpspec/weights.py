"""Reading a model's input embedding and LM head straight from its safetensors files
(training workers need them as plain tensors; the model itself is never built there)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

EMBED = ("model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight")
LM_HEAD = ("lm_head.weight",)


def _read(model_dir: Path, names: tuple[str, ...]) -> torch.Tensor | None:
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                if name in f.keys():
                    return f.get_tensor(name)
    return None


def embedding_and_lm_head(model_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """[V, d] input embedding and [V, d] LM head (the same tensor for tied models), fp32."""
    path = Path(model_dir)
    embed = _read(path, EMBED)
    if embed is None:
        raise ValueError(f"{path}: no input embedding among {EMBED} in its safetensors files")
    config = json.loads((path / "config.json").read_text())
    lm_head = None if config.get("tie_word_embeddings", False) else _read(path, LM_HEAD)
    return embed.float(), (embed if lm_head is None else lm_head).float()
