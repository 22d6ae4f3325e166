"""Training examples from self-distillation shards.

Row r of an answer holds h_r (the hidden state that produced answer token r), so head i
learns answer token r + i + 1 and the target's distribution for it (top-k at row r + i + 1).
Positions past the end of the answer are marked -1 and ignored by the losses.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

class ShardsError(ValueError):
    """Shards that cannot serve what was asked of them; the message says how to rebuild them."""


# Prompt rows kept before each answer for draft modules that attend over the context.
CONTEXT_ROWS = 512


def shard_examples(shard: dict, num_heads: int) -> dict[str, np.ndarray]:
    """All rows of one shard as column arrays (what Ray Data and the evaluators consume)."""
    offsets = shard["offsets"].tolist()
    tokens = shard["tokens"].long()
    topk_ids, topk_lp = shard["topk_ids"], shard["topk_logprobs"]
    n, k = tokens.numel(), topk_ids.shape[1]
    targets = torch.full((n, num_heads), -1, dtype=torch.int64)
    teacher_ids = torch.full((n, num_heads, k), -1, dtype=torch.int32)
    teacher_lp = torch.full((n, num_heads, k), float("-inf"), dtype=torch.float16)
    answer = torch.zeros(n, dtype=torch.int64)
    position = torch.zeros(n, dtype=torch.int64)
    for j, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        answer[start:end] = j
        position[start:end] = torch.arange(end - start)
        for i in range(num_heads):
            lo, hi = start, end - (i + 1)  # rows whose row + i + 1 is still in the answer
            if hi > lo:
                targets[lo:hi, i] = tokens[lo + i + 1 : end]
                teacher_ids[lo:hi, i] = topk_ids[lo + i + 1 : end]
                teacher_lp[lo:hi, i] = topk_lp[lo + i + 1 : end]
    keep = targets[:, 0] >= 0  # rows with at least one target
    return {
        "hidden": shard["hidden"][keep].numpy(),
        "token": tokens[keep].numpy(),
        "targets": targets[keep].numpy(),
        "teacher_ids": teacher_ids[keep].numpy(),
        "teacher_logprobs": teacher_lp[keep].float().numpy(),
        "answer": answer[keep].numpy(),
        "position": position[keep].numpy(),
    }


def load_examples(shard_files: list[Path], num_heads: int) -> dict[str, np.ndarray]:
    parts = [shard_examples(torch.load(f, weights_only=True), num_heads) for f in shard_files]
    if not parts:
        raise ValueError("no shards: the data set is empty")
    out = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
    # Answer indices restart in each shard: make them unique across shards.
    base = 0
    answers = []
    for p in parts:
        answers.append(p["answer"] + base)
        base += int(p["answer"].max()) + 1 if len(p["answer"]) else 0
    out["answer"] = np.concatenate(answers)
    return out


def has_context_rows(shard: dict) -> bool:
    return "context_hidden" in shard


def layer_columns(shard: dict, feature_layers, where: str = "these shards") -> list[int]:
    """Where each of feature_layers sits in the shard's layer_hidden; refused when the
    shards did not keep one of them."""
    kept = shard["feature_layers"].tolist() if "feature_layers" in shard else []
    missing = [layer for layer in feature_layers if layer not in kept]
    if missing:
        raise ShardsError(f"{where} keep the states entering target layers {kept or 'none'}, and the draft block "
                          f"reads layers {list(feature_layers)} (block.feature_layers): rebuild them with "
                          f"`python -m training.data --context-rows {CONTEXT_ROWS} --feature-layers "
                          f"{','.join(map(str, feature_layers))}` into a new folder")
    return [kept.index(layer) for layer in feature_layers]


def answer_sequence(shard: dict, j: int, feature_layers=()) -> dict[str, torch.Tensor]:
    """Answer j with the prompt rows before it, as an attention draft block reads them.

    features [T, d]: the kept context rows, then the answer rows; tokens [T]: the token
    each row produced (the next prompt token, then the answer's own); positions [T]: the
    rows' places in prompt + answer; first_answer_row: where the answer's rows begin;
    with feature_layers, layer_features [T, n, d]: the states entering those layers."""
    start, end = int(shard["offsets"][j]), int(shard["offsets"][j + 1])
    prompt = list(shard["prompt_ids"][j])
    answer = shard["tokens"][start:end].long()
    if has_context_rows(shard):
        c0, c1 = int(shard["context_offsets"][j]), int(shard["context_offsets"][j + 1])
        context = shard["context_hidden"][c0:c1]
    else:
        context = shard["hidden"][:0]
    c = context.shape[0]
    first = len(prompt) - 1  # the prompt position of answer row 0
    tokens = torch.cat([torch.tensor(prompt[len(prompt) - c:], dtype=torch.long), answer])
    sequence = {
        "features": torch.cat([context.float(), shard["hidden"][start:end].float()]),
        "tokens": tokens,
        "positions": torch.arange(first - c, first + end - start),
        "first_answer_row": c,
    }
    if feature_layers:
        columns = layer_columns(shard, feature_layers)
        answer_layers = shard["layer_hidden"][start:end, columns]
        context_layers = shard["context_layer_hidden"][c0:c1, columns] if c else answer_layers[:0]
        sequence["layer_features"] = torch.cat([context_layers.float(), answer_layers.float()])
    return sequence
