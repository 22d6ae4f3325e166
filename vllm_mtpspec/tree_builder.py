"""Each step's draft trees by one rule wherever drafts are made (the reference decoder
and vLLM's proposer): fixed shapes chosen among every depth's candidates (tree.py), or
trees grown depth by depth from the drafter's own guesses (grown_tree.py). Its own module
because grown_tree.py builds on tree.py's shapes."""
from __future__ import annotations

import torch

from vllm_mtpspec.grown_tree import grow_trees
from vllm_mtpspec.tree import TreeShape, build_static_shape, chain_tree, dynamic_tree, path_probs, prune


class DraftTreeBuilder:
    """Each step's draft trees from the heads' probabilities, by one rule wherever
    drafts are made (the reference decoder and vLLM's proposer).

    chain / consensus / static: a fixed shape, limited to the heads asked for and to the
    node budget, then cut where a node's path probability falls below min_path_prob.
    dynamic: the nodes of highest path probability, grown per step.
    """

    def __init__(self, preset: str, depth: int, *, max_nodes: int, min_path_prob: float,
                 dynamic_top_k: int, rank_accuracy=None) -> None:
        self.max_nodes = max_nodes
        self.min_path_prob = min_path_prob
        self.dynamic_top_k = dynamic_top_k
        self.static_shape = None if preset == "dynamic" else build_static_shape(
            preset, depth, max_nodes=max_nodes, rank_accuracy=rank_accuracy)
        self._pruned_shapes: dict[tuple, TreeShape] = {}
        self._cut_shapes: dict[tuple[int, int], TreeShape] = {}

    def build(self, probs: torch.Tensor, *, budget: int | None = None,
              token_ids: torch.Tensor | None = None) -> list[tuple[TreeShape, list[int]]]:
        """probs [B, d, V], temperature-scaled (d may be fewer heads than the shape was
        built for) -> per row, the tree and its node tokens, breadth-first. token_ids: the
        target id of each of the V entries (a draft vocabulary; None: entry v is id v)."""
        budget = self.max_nodes if budget is None else min(budget, self.max_nodes)
        if self.static_shape is None:
            trees = [dynamic_tree(p, max_nodes=budget, top_k=self.dynamic_top_k,
                                  min_path_prob=self.min_path_prob) for p in probs]
            return [(t.shape, _to_target(t.tokens, token_ids).tolist()) for t in trees]
        shape = self._cut_shape(probs.shape[1], budget)
        if shape.is_chain:
            return [(chain_tree(len(ids)), ids) for ids, _ in self.chains(probs[:, :len(shape)], token_ids=token_ids)]
        top_p, top_ids = probs.topk(max(shape.max_rank, 1), dim=-1)          # [B, d, R]
        top_ids = _to_target(top_ids, token_ids)
        keep = path_probs(shape, top_p) >= self.min_path_prob               # [B, n]
        out = []
        for b in range(probs.shape[0]):
            pruned = self._pruned(shape, keep[b])
            out.append((pruned, pruned.node_tokens(top_ids[b]).tolist()))
        return out

    def grow(self, step, states: torch.Tensor, tokens: torch.Tensor, *, depth: int, budget: int | None = None,
             token_ids: torch.Tensor | None = None) -> list[tuple[TreeShape, list[int]]]:
        """Dynamic trees of heads whose deeper drafts read their own guesses, grown depth by
        depth by `step` (grown_tree.py) from each row's state [B, d] and root token [B],
        under the same node budget, top-k and threshold as build's."""
        if self.static_shape is not None:
            raise ValueError("only dynamic trees are grown; a fixed shape is chosen among every depth's candidates")
        budget = self.max_nodes if budget is None else min(budget, self.max_nodes)
        trees = grow_trees(step, states, tokens, depth=depth, max_nodes=budget, top_k=self.dynamic_top_k,
                           min_path_prob=self.min_path_prob, token_ids=token_ids)
        return [(t.shape, t.tokens.tolist()) for t in trees]

    def _cut_shape(self, depth: int, budget: int) -> TreeShape:
        key = (depth, budget)
        if key not in self._cut_shapes:
            shape = self.static_shape.limit_depth(depth)
            self._cut_shapes[key] = shape.prefix(min(budget, len(shape)))  # breadth-first: the shallow nodes stay
        return self._cut_shapes[key]

    def chains(self, probs: torch.Tensor, *, token_ids: torch.Tensor | None = None) -> list[tuple[list[int], list[float]]]:
        """probs [B, d, V] -> per row, the chain of each head's top-1 up to the cut and each
        token's path probability (the heads' chance that the chain is right up to it), in
        one vectorised pass and one read back to the host. token_ids: as for build."""
        top_p, top_ids = probs.float().max(dim=-1)                           # [B, d]
        top_ids = _to_target(top_ids, token_ids)
        path = torch.cumprod(top_p, dim=-1)
        d = path.shape[-1]
        # Token ids below 2**24 are exact in float32: ids and probabilities travel together.
        rows = torch.cat([path, top_ids.to(path.dtype)], dim=-1).tolist()
        out = []
        for row in rows:
            n = sum(1 for p in row[:d] if p >= self.min_path_prob)  # path probabilities only fall
            out.append(([int(t) for t in row[d:d + n]], row[:n]))
        return out

    def _pruned(self, shape: TreeShape, keep: torch.Tensor) -> TreeShape:
        key = (shape.paths, keep.cpu().numpy().tobytes())
        if key not in self._pruned_shapes:
            self._pruned_shapes[key] = prune(shape, keep.tolist())
        return self._pruned_shapes[key]


def _to_target(entries: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
    """Draft-vocabulary entries -> the target's token ids."""
    return entries if token_ids is None else token_ids[entries]
