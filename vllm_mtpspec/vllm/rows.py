"""Where, in a step's sampled hidden states, each request's last sampled token came from."""
from __future__ import annotations


def last_sampled_rows(
    sampled_token_ids: list[list[int]],
    num_draft_tokens: list[int] | None,
    num_hidden_rows: int,
    tree_rows: dict[int, int] | None = None,
) -> list[tuple[int, int]]:
    """(request index, row of sample_hidden_states) for every request that sampled.

    vLLM keeps num_drafts + 1 rows per request when any request carried drafts (one row
    per request otherwise). The last sampled token of a chain request that emitted a
    tokens came from its row a - 1 (the bonus or recovered token's position); for a tree
    request, from the row of its last accepted node (tree_rows, by request index).
    Requests that sampled nothing (a partial prefill) are skipped.
    """
    tree_rows = tree_rows or {}
    with_drafts = num_draft_tokens is not None and num_hidden_rows != len(sampled_token_ids)
    pairs = []
    offset = 0
    for i, tokens in enumerate(sampled_token_ids):
        if tokens:
            pairs.append((i, offset + tree_rows.get(i, len(tokens) - 1)))
        offset += (num_draft_tokens[i] + 1) if with_drafts else 1
    return pairs
