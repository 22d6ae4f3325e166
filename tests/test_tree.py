import itertools

import pytest
import torch

from vllm_mtpspec.tree import (
    TreeShape,
    best_expected_tree,
    build_static_shape,
    chain_tree,
    consensus_tree,
    dynamic_tree,
    tree_from_paths,
)
from vllm_mtpspec.tree_builder import DraftTreeBuilder


def expected_len(shape, acc):
    total = 0.0
    for path in shape.paths:
        p = 1.0
        for d, r in enumerate(path):
            p *= acc[d][r]
        total += p
    return total


def test_paths_are_sorted_breadth_first_and_every_prefix_is_a_tree():
    shape = tree_from_paths([(0, 1, 0), (1,), (0,), (0, 1), (0, 0), (1, 0)])
    assert shape.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 1, 0))
    for n in range(len(shape) + 1):
        shape.prefix(n)  # raises if a node's parent were cut off


def test_missing_parent_and_bad_order_are_refused():
    with pytest.raises(ValueError, match="parent"):
        tree_from_paths([(0,), (1, 0)])
    with pytest.raises(ValueError, match="breadth-first"):
        TreeShape(((0,), (0, 0), (1,)))


def test_parents_depths_children_and_leaves():
    shape = tree_from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 1, 0)])
    assert shape.parents == (-1, -1, 0, 0, 1, 3)
    assert shape.depths == (1, 1, 2, 2, 2, 3)
    assert shape.children[0] == (0, 1)
    assert shape.children[1] == (2, 3)
    assert shape.leaf_paths() == [[0, 2], [1, 4], [0, 3, 5]]


def test_ancestor_mask_matches_path_prefixes():
    shape = consensus_tree(4, max_nodes=20)
    mask = shape.ancestor_mask()
    for i, pi in enumerate(shape.paths):
        for j, pj in enumerate(shape.paths):
            assert bool(mask[i, j]) == (pi[: len(pj)] == pj)
    full = shape.ancestor_mask(include_root=True)
    assert full[:, 0].all() and not full[0, 1:].any()


def test_chain_and_node_tokens():
    shape = chain_tree(3)
    assert shape.paths == ((0,), (0, 0), (0, 0, 0))
    topk = torch.tensor([[5, 6], [7, 8], [9, 10]])
    assert shape.node_tokens(topk).tolist() == [5, 7, 9]
    tree = tree_from_paths([(0,), (1,), (1, 1)])
    assert tree.node_tokens(topk).tolist() == [5, 6, 8]
    assert shape.is_chain and TreeShape(()).is_chain
    assert not tree.is_chain and not tree_from_paths([(0,), (1,)]).is_chain


def test_consensus_tree_keeps_to_its_widths_and_budget():
    shape = consensus_tree(4, max_nodes=16)
    assert len(shape) == 16
    assert {p[0] for p in shape.paths} == set(range(5))
    assert all(r < 2 for p in shape.paths for r in p[1:])


def test_best_expected_tree_is_optimal_on_small_cases():
    acc = [[0.6, 0.2, 0.1], [0.4, 0.15, 0.05], [0.3, 0.1, 0.02]]
    all_paths = [p for d in range(1, 4) for p in itertools.product(range(3), repeat=d)]
    for budget in (1, 3, 5):
        best = max(
            expected_len(tree_from_paths(subset), acc)
            for subset in itertools.combinations(all_paths, budget)
            if all(len(p) == 1 or p[:-1] in subset for p in subset)
        )
        got = best_expected_tree(acc, depth=3, max_nodes=budget)
        assert expected_len(got, acc) == pytest.approx(best)


def test_dynamic_tree_follows_confidence_and_stops_below_threshold():
    vocab = 10
    confident = torch.full((3, vocab), 0.01)
    confident[:, 3] = 0.91
    tree = dynamic_tree(confident, max_nodes=8, top_k=3, min_path_prob=0.5)
    assert tree.shape.paths == ((0,), (0, 0), (0, 0, 0))  # a deep chain
    assert tree.tokens.tolist() == [3, 3, 3]
    unsure = torch.full((3, vocab), 1.0 / vocab)
    assert len(dynamic_tree(unsure, max_nodes=8, min_path_prob=0.2).shape) == 0
    wide = dynamic_tree(unsure, max_nodes=8, top_k=4, min_path_prob=0.0)
    # All four first-level candidates (0.1 each) come before any second-level one (0.01).
    assert len(wide.shape) == 8 and wide.shape.paths[:4] == ((0,), (1,), (2,), (3,))


def test_static_presets_are_deterministic():
    assert build_static_shape("static", 3, max_nodes=10) == build_static_shape("static", 3, max_nodes=10)
    assert build_static_shape("chain", 2, max_nodes=10) == chain_tree(2)


def _head_probs(rows):
    """rows: per draft, per head, {token: prob} -> probs [B, k, V] (V = 8)."""
    probs = torch.zeros(len(rows), len(rows[0]), 8)
    for b, heads in enumerate(rows):
        for d, dist in enumerate(heads):
            for token, p in dist.items():
                probs[b, d, token] = p
    return probs


def test_draft_builder_cuts_chains_where_the_path_probability_falls():
    builder = DraftTreeBuilder("chain", 3, max_nodes=3, min_path_prob=0.1, dynamic_top_k=4)
    probs = _head_probs([
        [{1: .9, 0: .1}, {2: .6, 0: .4}, {3: .2, 0: .8}],    # paths .9, .54, .43
        [{4: .6, 0: .4}, {5: .15, 6: .1}, {7: 1.}],         # paths .6, .09: cut after one
    ])
    assert builder.build(probs) == [(chain_tree(3), [1, 2, 0]), (chain_tree(1), [4])]
    assert builder.build(probs[:, :2]) == [(chain_tree(2), [1, 2]), (chain_tree(1), [4])]  # fewer heads


def test_draft_builder_prunes_static_trees_and_keeps_to_the_budget():
    builder = DraftTreeBuilder("consensus", 2, max_nodes=6, min_path_prob=0.2, dynamic_top_k=4)
    shape = builder.static_shape
    probs = _head_probs([[{1: .6, 2: .3, 3: .1}, {4: .7, 5: .2, 6: .1}]])
    [(tree, tokens)] = builder.build(probs)
    # Every kept node's path probability clears the threshold, every dropped one does not.
    p = {(0,): .6, (1,): .3, (2,): .1}
    for path in shape.paths:
        prob = p[path[:1]] * ([.7, .2, .1][path[1]] if len(path) > 1 else 1.0)
        assert (path in tree.paths) == (prob >= 0.2), path
    assert tokens == tree.node_tokens(torch.tensor([[1, 2, 3], [4, 5, 6]])).tolist()
    [(small, _)] = builder.build(probs, budget=2)
    assert small.paths == tuple(p for p in tree.paths if p in shape.paths[:2])
