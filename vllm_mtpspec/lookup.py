"""Prompt lookup: drafts copied from the request's own context.

Small models repeat themselves and their prompts (code identifiers, lists, quoted text);
where the last few tokens occurred before, the tokens that followed them then are a
draft that is often right for several positions at once, where the heads' guesses
thin out after the first. The proposer uses such a draft in place of the heads' chain
when there is one (SpecOptions.prompt_lookup_max); verification is the same either way,
so output stays unchanged.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def lookup_draft(tokens: np.ndarray, *, min_n: int, max_n: int, k: int) -> list[int]:
    """tokens [L] (the context, last sampled token included) -> up to k tokens that
    followed the most recent earlier occurrence of its longest suffix of min_n..max_n
    tokens; [] when no such suffix occurred before."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. length - n - 1: every earlier n-gram, not the suffix itself.
        windows = sliding_window_view(tokens[:length - 1], n)
        starts = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(starts):
            follow = starts[-1] + n  # the most recent occurrence: the likeliest continuation
            return tokens[follow:follow + k].tolist()
    return []
