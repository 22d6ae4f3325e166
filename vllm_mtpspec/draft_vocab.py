"""A draft vocabulary: heads that guess among the N most frequent tokens only.

Most of a draft step's time is the vocab projection, one row of the LM head per token of
the target's vocabulary for every head (49,152 rows for SmolLM2). The target's answers
use few of them: in the committed self-distilled answers the 16,384 most frequent tokens
cover 97.4% of held-out answer tokens. Heads with a draft vocabulary (FR-Spec, EAGLE-3)
project onto those N rows and map their guesses back to the target's ids before anyone
else sees them. Verification is untouched, so output stays exactly the target's; a token
outside the draft vocabulary is simply never drafted.

The id map (`draft_token_ids`, the target ids of the N entries, most frequent first) is
stored in the heads' safetensors and its size in config.json (`draft_vocab_size`; 0 is
the whole vocabulary). Tied heads slice the target's own LM head by it at load time;
untied heads keep N-row projections of their own.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


def most_frequent_tokens(token_arrays: Iterable[np.ndarray], *, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent ids among the arrays (ties: the smaller id first), int64."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size}: must lie in 1..{vocab_size}")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for tokens in token_arrays:
        counts += np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count, descending; then by id
    return torch.from_numpy(order[:size].copy())


def coverage(token_arrays: Iterable[np.ndarray], draft_token_ids: torch.Tensor, *, vocab_size: int) -> float:
    """The share of the tokens that the draft vocabulary holds."""
    inside = np.zeros(vocab_size, dtype=bool)
    inside[draft_token_ids.numpy()] = True
    held = total = 0
    for tokens in token_arrays:
        tokens = np.asarray(tokens, dtype=np.int64)
        held += int(inside[tokens].sum())
        total += len(tokens)
    return held / max(total, 1)


def check_id_map(draft_token_ids: torch.Tensor, *, vocab_size: int) -> str | None:
    """Why an id map cannot serve (None when it can)."""
    if draft_token_ids.dtype != torch.int64 or draft_token_ids.dim() != 1:
        return f"must be a 1-D int64 tensor, not {draft_token_ids.dtype} of shape {tuple(draft_token_ids.shape)}"
    if len(draft_token_ids) and (int(draft_token_ids.min()) < 0 or int(draft_token_ids.max()) >= vocab_size):
        return f"holds ids outside the target's vocabulary 0..{vocab_size - 1}"
    if len(torch.unique(draft_token_ids)) != len(draft_token_ids):
        return "holds an id more than once"
    return None


class SlicedLMHead(torch.nn.Module):
    """The target's LM head restricted to the draft vocabulary, from its N rows (in the
    id map's order): [n, d] -> [n, N]."""

    def __init__(self, rows: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", rows.detach().clone().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.weight.dtype) @ self.weight.T


def to_target_vocab(logits: torch.Tensor, draft_token_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """[..., N] logits over the draft vocabulary -> [..., V] over the target's, -inf where
    the draft vocabulary has no entry (identity without a draft vocabulary)."""
    if draft_token_ids is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., draft_token_ids.to(logits.device)] = logits
    return full
