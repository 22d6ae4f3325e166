"""Reading a model's input embedding and LM head straight from its safetensors files
(training workers need them as plain tensors; the model itself is never built there)."""
from __future__ import annotations

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
    """[V, d] input embedding and [V, d] LM head, fp32. The embedding is what the model
    feeds its first layer (Gemma's rows times sqrt(d), as vLLM's embed_input_ids and
    transformers' embedding module give them), so a drafter reads the same inputs in
    training as when it serves; the LM head is the raw rows (the same tensor where the
    model ties them and does not scale)."""
    from vllm_mtpspec.model_profile import model_profile

    path = Path(model_dir)
    rows = read_tensor(path, EMBED)
    if rows is None:
        raise ValueError(f"{path}: no input embedding among {EMBED} in its safetensors files")
    profile = model_profile(path)
    rows = rows.float()
    lm_head = None if profile.tied_embeddings else read_tensor(path, LM_HEAD)
    lm_head = rows if lm_head is None else lm_head.float()  # a folder without lm_head.weight ties them
    embed = rows * profile.embed_scale if profile.embed_scale != 1.0 else rows
    return embed, lm_head
