"""Draft trees: which candidates of which heads the target verifies in one pass.

A tree is a set of root-to-node paths of candidate ranks: the node (0, 2) is the top-1
candidate of head 0 followed by the third candidate of head 1. The root (not a node) is
the token the target sampled last; a node at depth d holds a guess for the token d steps
after it. Nodes are kept breadth-first (by depth, then by path), so every prefix of the
node list is itself a tree: a scheduler may cut the tail and what stays still verifies.

Presets:
- chain: the top-1 candidate of each head.
- consensus: up to 5 candidates for head 0 and 2 for deeper heads, the most promising
  `max_nodes` of them; the target's choice is kept whenever it is among the candidates,
  which is the "top-1 in a head's top-5" consensus rule made lossless.
- static: any ranks, chosen from measured rank accuracies to maximise the expected
  accepted length under a node budget (Medusa's construction).
- dynamic: per step, from the heads' actual (temperature-scaled) probabilities, grows
  the nodes of highest path probability and stops below a threshold (adaptive depth).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import torch

from vllm_mtpspec.config import ConfigError

Path = tuple[int, ...]

CONSENSUS_WIDTHS = (5, 2)  # head 0, then every deeper head
# Used by consensus/static trees when the heads carry no measured accuracies: rank r of
# head d is right about PRIOR_BASE[d] * PRIOR_DECAY**r of the time (the shape of Medusa's
# published per-head curves).
PRIOR_BASE = (0.55, 0.35, 0.25, 0.18, 0.13, 0.10, 0.08, 0.06)
PRIOR_DECAY = 0.45


@dataclass(frozen=True)
class TreeShape:
    paths: tuple[Path, ...]  # breadth-first

    def __post_init__(self) -> None:
        seen: set[Path] = set()
        for path in self.paths:
            if not path or any(r < 0 for r in path):
                raise ValueError(f"tree path {path}: must be a non-empty tuple of ranks >= 0")
            if path in seen:
                raise ValueError(f"tree path {path} appears twice")
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(f"tree path {path}: its parent {path[:-1]} must come before it")
            seen.add(path)
        if list(self.paths) != sorted(self.paths, key=_bfs_key):
            raise ValueError("tree paths must be breadth-first: use tree_from_paths() to sort them")

    def __len__(self) -> int:
        return len(self.paths)

    @cached_property
    def parents(self) -> tuple[int, ...]:
        """Index of each node's parent; -1 for children of the root."""
        index = {p: i for i, p in enumerate(self.paths)}
        return tuple(index[p[:-1]] if len(p) > 1 else -1 for p in self.paths)

    @cached_property
    def is_chain(self) -> bool:
        """Every node hangs below the one before it (an empty shape counts too)."""
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """1 for children of the root: the node's position is context length + depth - 1
        counted from the root's position."""
        return tuple(len(p) for p in self.paths)

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        return tuple(p[-1] for p in self.paths)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[0] are the root's children; children[j + 1] those of node j (by rank)."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for node, parent in enumerate(self.parents):
            kids[parent + 1].append(node)
        return tuple(tuple(sorted(k, key=lambda n: self.ranks[n])) for k in kids)

    def ancestor_mask(self, *, include_root: bool = False) -> torch.Tensor:
        """[n, n] bool: mask[i, j] is True when node j is node i or one of its ancestors.
        With include_root, [n + 1, n + 1] with the root in row/column 0 (seen by all)."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                mask[node] |= mask[parent]
        if not include_root:
            return mask
        full = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        full[:, 0] = True
        full[1:, 1:] = mask
        return full

    def leaf_paths(self) -> list[list[int]]:
        """Node indices from the root's child down to each leaf."""
        paths = []
        for node in range(len(self)):
            if not self.children[node + 1]:
                chain = [node]
                while self.parents[chain[-1]] >= 0:
                    chain.append(self.parents[chain[-1]])
                paths.append(chain[::-1])
        return paths

    def prefix(self, num_nodes: int) -> "TreeShape":
        return TreeShape(self.paths[:num_nodes])

    def limit_depth(self, depth: int) -> "TreeShape":
        return TreeShape(tuple(p for p in self.paths if len(p) <= depth))

    def node_tokens(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids [k, K]: the candidates of each head, best first -> tokens [n]."""
        if not len(self):
            return topk_ids.new_empty(0)
        depth_idx = torch.tensor([d - 1 for d in self.depths], device=topk_ids.device)
        rank_idx = torch.tensor(self.ranks, device=topk_ids.device)
        return topk_ids[depth_idx, rank_idx]

    @property
    def max_rank(self) -> int:
        return max(self.ranks, default=-1) + 1


def _bfs_key(path: Path) -> tuple[int, Path]:
    return (len(path), path)


def tree_from_paths(paths: Sequence[Sequence[int]]) -> TreeShape:
    return TreeShape(tuple(sorted((tuple(p) for p in paths), key=_bfs_key)))


def chain_tree(depth: int) -> TreeShape:
    return TreeShape(tuple((0,) * d for d in range(1, depth + 1)))


def prior_rank_accuracy(depth: int, max_rank: int) -> list[list[float]]:
    return [
        [PRIOR_BASE[min(d, len(PRIOR_BASE) - 1)] * PRIOR_DECAY**r for r in range(max_rank)]
        for d in range(depth)
    ]


def best_expected_tree(
    rank_accuracy: Sequence[Sequence[float]],
    *,
    depth: int,
    max_nodes: int,
    widths: Sequence[int] | None = None,
) -> TreeShape:
    """The tree of at most `max_nodes` nodes that maximises the expected accepted length
    sum over nodes of prod(accuracy along the path), taking nodes best-first. Because a
    child never scores above its parent, best-first is optimal."""
    if len(rank_accuracy) < depth:
        raise ConfigError(f"rank accuracies cover {len(rank_accuracy)} heads, the tree needs {depth}")

    def width(d: int) -> int:
        w = len(rank_accuracy[d])
        if widths is not None:
            w = min(w, widths[min(d, len(widths) - 1)])
        return w

    frontier: list[tuple[float, Path]] = [(-rank_accuracy[0][r], (r,)) for r in range(width(0))]
    heapq.heapify(frontier)
    chosen: list[Path] = []
    while frontier and len(chosen) < max_nodes:
        neg_score, path = heapq.heappop(frontier)
        chosen.append(path)
        d = len(path)
        if d < depth:
            for r in range(width(d)):
                heapq.heappush(frontier, (neg_score * rank_accuracy[d][r], path + (r,)))
    return tree_from_paths(chosen)


def consensus_tree(depth: int, *, max_nodes: int = 16, rank_accuracy=None) -> TreeShape:
    acc = rank_accuracy or prior_rank_accuracy(depth, CONSENSUS_WIDTHS[0])
    return best_expected_tree(acc, depth=depth, max_nodes=max_nodes, widths=CONSENSUS_WIDTHS)


def static_tree(depth: int, *, max_nodes: int = 16, rank_accuracy=None) -> TreeShape:
    acc = rank_accuracy or prior_rank_accuracy(depth, 8)
    return best_expected_tree(acc, depth=depth, max_nodes=max_nodes)


@dataclass
class DynamicTree:
    shape: TreeShape
    tokens: torch.Tensor       # [n]
    path_probs: list[float] = field(default_factory=list)  # [n], by the heads' estimate


def dynamic_tree(
    head_probs: torch.Tensor,
    *,
    max_nodes: int = 16,
    top_k: int = 4,
    min_path_prob: float = 0.02,
) -> DynamicTree:
    """head_probs [k, V] (temperature-scaled) -> the nodes of highest path probability.
    Growth stops at the budget or where the best remaining path falls below min_path_prob,
    so confident heads get deep trees and unsure ones shallow (or empty) trees."""
    depth = head_probs.shape[0]
    top_p, top_ids = head_probs.float().topk(min(top_k, head_probs.shape[-1]), dim=-1)
    top_p, top_ids = top_p.tolist(), top_ids
    frontier: list[tuple[float, Path]] = [(-top_p[0][r], (r,)) for r in range(len(top_p[0]))]
    heapq.heapify(frontier)
    chosen: dict[Path, float] = {}
    while frontier and len(chosen) < max_nodes:
        neg_p, path = heapq.heappop(frontier)
        if -neg_p < min_path_prob:
            break
        chosen[path] = -neg_p
        d = len(path)
        if d < depth:
            for r in range(len(top_p[d])):
                heapq.heappush(frontier, (neg_p * top_p[d][r], path + (r,)))
    shape = tree_from_paths(chosen)
    return DynamicTree(shape, shape.node_tokens(top_ids), [chosen[p] for p in shape.paths])


def build_static_shape(preset: str, depth: int, *, max_nodes: int, rank_accuracy=None) -> TreeShape:
    """The fixed shape of a chain / consensus / static tree for `depth` heads."""
    if preset == "chain":
        return chain_tree(depth)
    if preset == "consensus":
        return consensus_tree(depth, max_nodes=max_nodes, rank_accuracy=rank_accuracy)
    if preset == "static":
        return static_tree(depth, max_nodes=max_nodes, rank_accuracy=rank_accuracy)
    raise ConfigError(f"tree={preset!r} has no fixed shape (dynamic trees are built per step)")


def path_probs(shape: TreeShape, top_p: torch.Tensor) -> torch.Tensor:
    """top_p [B, k, R]: each head's probabilities of its top-R candidates -> [B, n], the
    heads' estimate that each node's whole path is right."""
    if not len(shape):
        return top_p.new_empty(top_p.shape[0], 0)
    depth_idx = torch.tensor([d - 1 for d in shape.depths], device=top_p.device)
    rank_idx = torch.tensor(shape.ranks, device=top_p.device)
    probs = top_p[:, depth_idx, rank_idx].clone()
    for node, parent in enumerate(shape.parents):  # parents come first (breadth-first)
        if parent >= 0:
            probs[:, node] *= probs[:, parent]
    return probs


def prune(shape: TreeShape, keep: Sequence[bool]) -> TreeShape:
    """The nodes marked keep; callers keep a node's ancestors whenever they keep the node
    (true of any threshold on path probabilities, which never grow with depth)."""
    return TreeShape(tuple(p for p, k in zip(shape.paths, keep) if k))
