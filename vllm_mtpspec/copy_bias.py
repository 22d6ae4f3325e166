"""Copy bias: a draft block's chain leans toward what its context repeats.

Small models loop, quote their prompts and repeat names. Where the context's last n
tokens occurred before, the tokens that followed them then are a likely continuation:
vLLM's ngram drafts only those. The block drafts every step and is right more often, but
the two miss in different places: at the turn of a loop the block is often sure of
something else. The copy bias adds beta(n) to the logit of the token that followed the
most recent of the longest earlier repeats of the context's end, at each depth of the
chain while the chain has followed that continuation. beta depends on the repeat's
length; it is fitted per drafter, on answers of sources it is not scored on
(vllm_mtpspec_train/fit_copy_bias.py), and stored in its config (`copy_bias`).

It changes only which tokens the block drafts (and their draft probabilities), so output
stays the target's. Chains of a draft block take it (DraftBlock.draft_chains, and the
teacher-forced replay in vllm_mtpspec_train/evaluate.py); dynamic trees, prompt lookup's
drafts and the reference decoder draft without it.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from vllm_mtpspec.host_copy import to_device_without_waiting

# Repeat lengths with a bias of their own: a repeat of n tokens takes the bias of the
# longest of these that is at most n.
REPEAT_LENGTHS = (1, 2, 3, 4, 8, 16, 32)
LONGEST_REPEAT = REPEAT_LENGTHS[-1]


def repeat_bucket(length: int) -> int:
    """The entry of REPEAT_LENGTHS whose bias a repeat of `length` tokens takes (0: none)."""
    bucket = 0
    for lo in REPEAT_LENGTHS:
        if length >= lo:
            bucket = lo
    return bucket


def check_copy_bias(biases: dict) -> dict[str, float]:
    """A config's copy_bias {repeat length: logit bias} with keys as JSON writes them;
    raises ValueError naming the bad entry."""
    out = {}
    for key, value in biases.items():
        if str(key) not in {str(n) for n in REPEAT_LENGTHS}:
            raise ValueError(f"copy_bias key {key!r}: repeat lengths are {', '.join(map(str, REPEAT_LENGTHS))}")
        if not isinstance(value, (int, float)) or math.isnan(value) or value == -math.inf:
            raise ValueError(f"copy_bias[{key!r}]={value!r}: give a number (leave the key out for no bias)")
        out[str(key)] = float(value)
    return out


def bias_for(biases: dict[str, float], length: int) -> float | None:
    """The logit bias for a repeat of `length` tokens, or None where there is none."""
    bucket = repeat_bucket(length)
    return biases.get(str(bucket)) if bucket else None


def longest_repeat(tokens: np.ndarray, k: int) -> tuple[int, np.ndarray]:
    """tokens [L] (the context, its newest token last) -> (n, up to k tokens): n the length
    (at most LONGEST_REPEAT) of the longest suffix that occurred earlier, and what followed
    its most recent earlier occurrence; (0, []) where the newest token is new."""
    length = len(tokens)
    # Earlier positions that end a repeat of the last n tokens, for n = 1, 2, ...
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1]) if length > 1 else np.zeros(0, np.int64)
    if not len(ends):
        return 0, tokens[:0]
    n = 1
    while n < min(LONGEST_REPEAT, length - 1):
        back = ends - n
        longer = ends[(back >= 0) & (tokens[np.maximum(back, 0)] == tokens[length - 1 - n])]
        if not len(longer):
            break
        ends, n = longer, n + 1
    follow = int(ends[-1]) + 1
    return n, tokens[follow:follow + k]


def copy_drafts(contexts: list[np.ndarray], depth: int, biases: dict[str, float],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per context: the continuation of its longest earlier repeat and the bias it takes:
    (tokens [B, depth], -1 past its end or with no bias; biases [B] float32), on device
    (copied from the host, never read back)."""
    tokens = np.full((len(contexts), depth), -1, dtype=np.int64)
    bias = np.zeros(len(contexts), dtype=np.float32)
    for i, context in enumerate(contexts):
        n, follow = longest_repeat(np.asarray(context), depth)
        beta = bias_for(biases, n)
        if beta is not None:
            tokens[i, :len(follow)] = follow
            bias[i] = beta
    return (to_device_without_waiting(torch.from_numpy(tokens), device),
            to_device_without_waiting(torch.from_numpy(bias), device))


def lean(logits: torch.Tensor, copy_tokens: torch.Tensor, bias: torch.Tensor, following: torch.Tensor,
         draft_ids: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, N] of one depth with bias [B] added at copy_tokens [B] (target ids, -1:
    none) for the rows still following their continuation (following [B] bool). With a
    draft vocabulary (draft_ids [N]: each entry's target id), a token outside it takes no
    bias. Everything stays on logits' device."""
    if draft_ids is None:
        index, known = copy_tokens.clamp_min(0), copy_tokens >= 0
    else:
        same = copy_tokens[:, None] == draft_ids[None, :]                    # [B, N]
        index, known = same.int().argmax(-1), same.any(-1)
    add = torch.where(following & known, bias, torch.zeros_like(bias)).to(logits.dtype)
    return logits.scatter_add(-1, index[:, None], add[:, None])


def following_after(following: torch.Tensor, drafted: torch.Tensor, copy_tokens: torch.Tensor,
                    draft_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Whether each chain still follows its continuation after drafting `drafted` [B]
    (entries of the draft vocabulary where there is one) against copy_tokens [B]."""
    token = drafted if draft_ids is None else draft_ids[drafted]
    return following & (token == copy_tokens)


def repeats_along(context: np.ndarray, first: int, rows: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """At each answer row r (context[:first + r + 1] known): the length of the longest
    earlier repeat (lengths [rows]) and what followed it (tokens [rows, depth], -1 past
    its end), as longest_repeat finds them while drafting."""
    lengths = np.zeros(rows, dtype=np.int64)
    tokens = np.full((rows, depth), -1, dtype=np.int64)
    for r in range(rows):
        lengths[r], follow = longest_repeat(context[:first + r + 1], depth)
        tokens[r, :len(follow)] = follow
    return lengths, tokens


def along_answer(context: np.ndarray, first: int, rows: int, depth: int,
                 biases: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced: at answer row r and depth i, the copy token and its bias where a
    chain that is still right follows the continuation (its first i tokens are the
    answer's): (tokens [rows, depth], -1 where none; bias [rows, depth], 0 where none)."""
    lengths, follows = repeats_along(context, first, rows, depth)
    tokens = np.full((rows, depth), -1, dtype=np.int64)
    bias = np.zeros((rows, depth), dtype=np.float32)
    for r in range(rows):
        beta = bias_for(biases, int(lengths[r]))
        if beta is None:
            continue
        truth = context[first + r + 1:first + r + 1 + depth]
        for i, token in enumerate(follows[r][follows[r] >= 0]):
            tokens[r, i], bias[r, i] = token, beta
            if i >= len(truth) or token != truth[i]:
                break  # a chain still right leaves the continuation here
    return torch.from_numpy(tokens), torch.from_numpy(bias)
