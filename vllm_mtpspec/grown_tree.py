"""Dynamic trees grown depth by depth, for heads whose deeper drafts read their own
earlier guesses (sequential heads, the attention draft block).

Parallel heads give every depth's candidates at once, so a tree is any choice among them
(tree.py). A sequential head's candidates at depth i depend on which token stands before
them, so each node's children come from a draft step on that node's own state and token.
As EAGLE-2 does, the tree grows one depth at a time: one batched draft step over the
frontier (the `top_k` nodes of highest path probability at the depth just grown, across
every request of the batch at once), whose `top_k` likeliest children per node become the
next depth's candidates. At the end each request keeps the `max_nodes` nodes of highest
path probability (at least `min_path_prob`). A node's path probability never exceeds its
parent's, so a kept node's ancestors are kept too and the result is a tree.

A node's path in the TreeShape is its ranks among its parent's children: (0, 0) is the
likeliest child of the likeliest first draft. Verification reads only the shape and the
tokens, so it is unchanged, and it is lossless for any tokens.

Everything stays on the drafting device until the end, where one read to the host carries
every candidate of every depth.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_mtpspec.tree import DynamicTree, tree_from_paths

# (depth index i, states [n, w] of the nodes at depth i, their tokens [n] as target ids)
#   -> (the states [n, w'] that guess the next token, its probabilities [n, N] over the
#       draft entries, temperature-scaled). A node's children get its state, so a state
#   may be wider than the roots' and grow with depth: it carries whatever the children's
#   step reads of their path (an attention block's entries for the path's nodes).
DraftStep = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def grow_trees(step: DraftStep, states: torch.Tensor, tokens: torch.Tensor, *, depth: int, max_nodes: int,
               top_k: int, min_path_prob: float, token_ids: torch.Tensor | None = None) -> list[DynamicTree]:
    """states [B, d]: the target's states that produced tokens [B] (each request's root)
    -> per request, the grown tree with its node tokens (target ids) and path
    probabilities. token_ids: the target id of each draft entry (None: entry v is id v)."""
    batch = states.shape[0]
    if depth <= 0:
        return [DynamicTree(tree_from_paths([]), torch.empty(0, dtype=torch.long), []) for _ in range(batch)]
    device = states.device
    frontier_states, frontier_tokens = states[:, None], tokens[:, None]
    frontier_p = torch.ones(batch, 1, device=device)
    frontier_node = torch.full((batch, 1), -1, dtype=torch.long, device=device)  # -1: the root
    levels, grown = [], 0
    for i in range(depth):
        slots = frontier_p.shape[1]
        next_states, probs = step(i, frontier_states.reshape(batch * slots, -1), frontier_tokens.reshape(-1))
        k = min(top_k, probs.shape[-1])
        child_p, entries = probs.float().clamp_max(1.0).topk(k, dim=-1)                     # [B * F, k]
        child_p = (frontier_p[:, :, None] * child_p.view(batch, slots, k)).view(batch, slots * k)
        child_tokens = (entries if token_ids is None else token_ids[entries]).view(batch, slots * k)
        parents = frontier_node[:, :, None].expand(batch, slots, k).reshape(batch, slots * k)
        ranks = torch.arange(k, device=device).repeat(slots).expand(batch, slots * k)
        levels.append(torch.stack([child_p.double(), parents.double(), ranks.double(), child_tokens.double()]))
        if i + 1 < depth:
            frontier_p, chosen = child_p.topk(min(top_k, slots * k), dim=-1)                # [B, F']
            owner = chosen // k                                                            # its parent's slot
            width = next_states.shape[-1]
            frontier_states = next_states.view(batch, slots, width).gather(
                1, owner[..., None].expand(-1, -1, width))
            frontier_tokens = child_tokens.gather(1, chosen)
            frontier_node = grown + chosen
        grown += slots * k
    # One read to the host: [4, B, nodes] of path probability, parent, rank and token.
    table = torch.cat(levels, dim=-1).tolist()
    return [_select(p, parents, ranks, toks, max_nodes=max_nodes, min_path_prob=min_path_prob)
            for p, parents, ranks, toks in zip(*table)]


def _select(path_p: list[float], parents: list[float], ranks: list[float], tokens: list[float], *,
            max_nodes: int, min_path_prob: float) -> DynamicTree:
    """One request's grown nodes -> its tree of the max_nodes likeliest (parents before
    children among equals: a node is never likelier than its parent)."""
    paths: list[tuple[int, ...]] = []
    depths: list[int] = []
    for parent, rank in zip(parents, ranks):  # parents are grown before their children
        path = (paths[int(parent)] if parent >= 0 else ()) + (int(rank),)
        paths.append(path)
        depths.append(len(path))
    order = sorted(range(len(paths)), key=lambda n: (-path_p[n], depths[n], n))
    kept = [n for n in order if path_p[n] >= min_path_prob][:max(max_nodes, 0)]
    shape = tree_from_paths([paths[n] for n in kept])
    by_path = {paths[n]: n for n in kept}
    nodes = [by_path[path] for path in shape.paths]
    return DynamicTree(shape, torch.tensor([int(tokens[n]) for n in nodes], dtype=torch.long),
                       [path_p[n] for n in nodes])
