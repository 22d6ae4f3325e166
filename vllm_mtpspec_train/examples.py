"""Training examples from self-distillation shards.

Row r of an answer holds h_r (the hidden state that produced answer token r), so head i
learns answer token r + i + 1 and the target's distribution for it (top-k at row r + i + 1).
Positions past the end of the answer are marked -1 and ignored by the losses.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


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
