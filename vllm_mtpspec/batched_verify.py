"""Lossless verification of many draft trees at once, on the device of the target's logits.

verify.py walks one tree on the host, token by token. Here every row (a tree's root or
node, scored in the target's one pass) decides at once which of its children it accepts,
and the walk from each root is a few gathers on the device:

- greedy: a row accepts its child whose token is the row's argmax;
- sampled, candidates tried in rank order with probability p(c), p renormalised after
  each miss (verify.py's rule): with one uniform u per row, the row accepts the child c_j
  whose cumulative probability p(c_1) + ... + p(c_j) is the first to pass u, and none when
  u is past all its children's mass. Each child is accepted with probability p(c) either way.
- the walk follows accepted children from the root; where it stops, the bonus token is
  the argmax (greedy) or a draw from p without that row's children (sampled).

Only the children's probabilities are read at every row; a full row of p is drawn from
once per tree (its bonus). Nothing is read back to the host except by read_verdicts(),
once per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from vllm_mtpspec.tree import TreeShape
from vllm_mtpspec.verify import Verdict

NO_TOKEN = -1  # emitted[t, d] past the end of tree t's walk


@dataclass(frozen=True)
class TreeBatch:
    """Where each tree's rows are in a compact [num_rows, V] block (its root, then its
    nodes in breadth-first order) and which row is whose child. Host data only: it comes
    from the trees' shapes, never from the device. Edges are grouped by parent row, each
    parent's children in rank order."""

    roots: tuple[int, ...]          # [T] the root's row of each tree
    edge_parents: tuple[int, ...]    # [E] a parent's row,
    edge_children: tuple[int, ...]   # [E] its child's row,
    edge_tokens: tuple[int, ...]     # [E] the child's draft token,
    edge_trees: tuple[int, ...]      # [E] and the tree they are in
    sibling_starts: tuple[int, ...]  # [E] the first edge of the same parent
    repeats: tuple[bool, ...]        # [E] an earlier sibling drafts the same token
    row_tokens: tuple[int, ...]      # [num_rows] a node row's draft token (NO_TOKEN for roots)
    num_rows: int
    max_depth: int

    @classmethod
    def of(cls, trees: Sequence[tuple[TreeShape, Sequence[int]]]) -> "TreeBatch":
        roots, parents, children, tokens, edge_trees, starts, repeats, row_tokens = [], [], [], [], [], [], [], []
        base, max_depth = 0, 0
        for t, (shape, node_tokens) in enumerate(trees):
            if len(node_tokens) != len(shape):
                raise ValueError(f"a tree of {len(shape)} nodes came with {len(node_tokens)} tokens")
            roots.append(base)
            row_tokens += [NO_TOKEN] + [int(x) for x in node_tokens]
            for row, kids in enumerate(shape.children):
                first = len(parents)
                for child in kids:
                    repeats.append(int(node_tokens[child]) in tokens[first:])
                    parents.append(base + row)
                    children.append(base + 1 + child)
                    tokens.append(int(node_tokens[child]))
                    edge_trees.append(t)
                    starts.append(first)
            base += len(shape) + 1
            max_depth = max(max_depth, shape.max_depth)
        return cls(tuple(roots), tuple(parents), tuple(children), tuple(tokens), tuple(edge_trees), tuple(starts),
                   tuple(repeats), tuple(row_tokens), base, max_depth)

    def tree_rows(self, index: int) -> range:
        end = self.roots[index + 1] if index + 1 < len(self.roots) else self.num_rows
        return range(self.roots[index], end)

    def on(self, device: torch.device) -> "EdgeTensors":
        def as_tensor(values):
            return torch.tensor(values, dtype=torch.long, device=device)

        return EdgeTensors(as_tensor(self.edge_parents), as_tensor(self.edge_children), as_tensor(self.edge_tokens),
                           as_tensor(self.edge_trees), as_tensor(self.sibling_starts),
                           torch.tensor(self.repeats, dtype=torch.bool, device=device), as_tensor(self.roots),
                           as_tensor(self.row_tokens))


@dataclass(frozen=True)
class EdgeTensors:
    """A TreeBatch's index arrays on the device (built once per step)."""

    parents: torch.Tensor
    children: torch.Tensor
    tokens: torch.Tensor
    trees: torch.Tensor
    sibling_starts: torch.Tensor
    repeats: torch.Tensor
    roots: torch.Tensor
    row_tokens: torch.Tensor


def greedy_hits(edges: EdgeTensors, argmax: torch.Tensor) -> torch.Tensor:
    """argmax [num_rows] -> [E] bool: the child is its parent row's argmax."""
    return edges.tokens == argmax[edges.parents]


def sampled_hits(edges: EdgeTensors, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [num_rows, V], uniforms [num_rows] -> [E] bool: the child whose cumulative
    probability among its siblings (in rank order) is the first to pass the row's uniform.
    A sibling that repeats an earlier one's token has no mass left: that token was tried."""
    p = probs[edges.parents, edges.tokens].double().masked_fill(edges.repeats, 0.0)
    total = p.cumsum(0)
    before_siblings = torch.where(edges.sibling_starts > 0, total[(edges.sibling_starts - 1).clamp(min=0)],
                                  torch.zeros_like(total))
    upto = total - before_siblings  # p(c_1) + ... + p(c_j) within the parent
    u = uniforms.double()[edges.parents]
    return (upto > u) & (upto - p <= u)


def walk(batch: TreeBatch, edges: EdgeTensors, hits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hits [E] (at most one per parent row; the first in rank order counts) -> (walked
    rows [T, max_depth + 1], -1 past each walk's end; accepted nodes per tree [T])."""
    sentinel = batch.num_rows
    accepted_child = torch.full((batch.num_rows + 1,), sentinel, dtype=torch.long, device=hits.device)
    if batch.edge_parents:
        # Rank order: a child's row grows with its rank among its siblings (breadth-first).
        candidates = torch.where(hits, edges.children, torch.full_like(edges.children, sentinel))
        accepted_child.scatter_reduce_(0, edges.parents, candidates, reduce="amin")
    row, alive = edges.roots, torch.ones_like(edges.roots, dtype=torch.bool)
    walked, accepted = [], torch.zeros_like(edges.roots)
    for _ in range(batch.max_depth + 1):
        walked.append(torch.where(alive, row, -1))
        following = accepted_child[row]
        alive = alive & (following != sentinel)
        accepted += alive.long()
        row = torch.where(alive, following, row)
    return torch.stack(walked, dim=1), accepted


def stop_rows(walked: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """[T] the row each walk stopped at (where the bonus token is chosen)."""
    return walked.gather(1, accepted[:, None]).squeeze(1)


def residual_draw(batch: TreeBatch, edges: EdgeTensors, probs: torch.Tensor, stops: torch.Tensor,
                  uniforms: torch.Tensor) -> torch.Tensor:
    """A draw [T] from p at each stop row with that row's children taken out (all of p where
    they held all of its mass)."""
    vocab = probs.shape[-1]
    rows = probs[stops].double()
    if batch.edge_parents:
        keep = torch.ones_like(rows).view(-1)
        at_stop = edges.parents == stops[edges.trees]
        # amin: a token some other row of the tree drafts too stays unless this row drafts it.
        keep.scatter_reduce_(0, edges.trees * vocab + edges.tokens, (~at_stop).double(), reduce="amin")
        residual = rows * keep.view_as(rows)
        rows = torch.where(residual.sum(-1, keepdim=True) > 0, residual, rows)
    return draw_from(rows, uniforms)


def emitted_tokens(edges: EdgeTensors, walked: torch.Tensor, accepted: torch.Tensor,
                   bonus: torch.Tensor) -> torch.Tensor:
    """[T, max_depth + 1]: the accepted nodes' draft tokens, the bonus, then NO_TOKEN."""
    depth = torch.arange(walked.shape[1], device=walked.device)[None]
    node_tokens = edges.row_tokens[walked[:, 1:].clamp(min=0)]  # the d-th accepted node's token at d
    node_tokens = torch.cat([node_tokens, torch.full_like(walked[:, :1], NO_TOKEN)], dim=1)
    tokens = torch.where(depth < accepted[:, None], node_tokens, NO_TOKEN)
    return torch.where(depth == accepted[:, None], bonus[:, None].long(), tokens)


def draw_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [R, V], uniforms [R] in [0, 1) -> one token per row distributed as probs: the
    first token whose cumulative probability passes the row's uniform (accumulated in
    float64; a token of probability 0 is never drawn)."""
    cdf = probs.double().cumsum(dim=-1)
    targets = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def draw_uniforms(num_rows: int, device: torch.device,
                  generators: Sequence[tuple[range, torch.Generator]] = ()) -> torch.Tensor:
    """Uniforms [num_rows] in [0, 1) on `device`; the rows of each (rows, generator) pair
    are drawn from that generator on the generator's own device (seeded requests), the rest
    from the device's default generator."""
    uniforms = torch.rand(num_rows, device=device, dtype=torch.float64)
    for rows, generator in generators:
        if len(rows):
            own = torch.rand(len(rows), device=generator.device, dtype=torch.float64, generator=generator)
            uniforms[rows.start:rows.stop] = own.to(device)
    return uniforms


def read_verdicts(batch: TreeBatch, emitted: torch.Tensor, walked: torch.Tensor) -> list[Verdict]:
    """The walks as host verdicts (accepted node indices, emitted tokens): the step's one
    read from the device."""
    both = torch.cat([emitted, walked], dim=1).tolist()
    width = emitted.shape[1]
    result = []
    for t, row in enumerate(both):
        tokens = [x for x in row[:width] if x != NO_TOKEN]
        root = batch.roots[t]
        accepted = [r - root - 1 for r in row[width + 1: width + len(tokens)]]
        result.append(Verdict(accepted, tokens))
    return result
