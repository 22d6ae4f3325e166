"""Dynamic trees grown depth by depth from a draft step that reads each node's own state
and token (grown_tree.py): the likeliest paths, every node's children its own step's, one
batched step per depth for the whole batch."""
import itertools

import pytest
import torch

from vllm_mtpspec.grown_tree import grow_trees
from vllm_mtpspec.tree_builder import DraftTreeBuilder

VOCAB = 3


def table_step(seed: int = 0, vocab: int = VOCAB, calls: list | None = None):
    """A draft step whose next-token distribution depends on the whole path so far: the
    state is a running code of (depth, tokens); the probabilities a fixed random table's
    row for it."""
    table = torch.softmax(3 * torch.randn(97, vocab, generator=torch.Generator().manual_seed(seed)), dim=-1)

    def step(i, states, tokens):
        if calls is not None:
            calls.append(states.shape[0])
        code = (states[:, 0].long() * 31 + tokens * 7 + i + 1) % 97
        return code[:, None].double().repeat(1, states.shape[1]), table[code]

    return step, table


def brute_force_paths(step, state: int, root: int, depth: int):
    """Every path of ranks down to `depth`, with its path probability and tokens."""
    out = {}

    def expand(path, p, s, token, i):
        if i == depth:
            return
        new_state, probs = step(i, torch.tensor([[float(s)]]), torch.tensor([token]))
        q, ids = probs[0].sort(descending=True)
        for r in range(len(q)):
            child = path + (r,)
            out[child] = (p * float(q[r]), int(ids[r]))
            expand(child, p * float(q[r]), int(new_state[0, 0]), int(ids[r]), i + 1)

    expand((), 1.0, state, root, 0)
    return out


@pytest.mark.parametrize("max_nodes", [1, 3, 5, 12])
def test_with_every_candidate_in_the_frontier_the_tree_is_the_likeliest_paths(max_nodes):
    step, _ = table_step()
    tree, = grow_trees(step, torch.full((1, 2), 5.0), torch.tensor([1]), depth=2, max_nodes=max_nodes,
                       top_k=VOCAB, min_path_prob=0.0)
    every = brute_force_paths(step, 5, 1, depth=2)
    best = sorted(every, key=lambda path: (-every[path][0], len(path)))[:max_nodes]
    assert set(tree.shape.paths) == set(best)
    for node, path in enumerate(tree.shape.paths):
        assert tree.tokens[node] == every[path][1]
        assert tree.path_probs[node] == pytest.approx(every[path][0], rel=1e-6)


def test_each_depth_is_one_step_over_the_whole_batchs_frontier():
    calls = []
    step, _ = table_step(calls=calls)
    grow_trees(step, torch.arange(4.0)[:, None], torch.tensor([0, 1, 2, 0]), depth=3, max_nodes=8, top_k=2,
               min_path_prob=0.0)
    assert calls == [4, 4 * 2, 4 * 2]  # the roots, then each request's 2 likeliest nodes per depth


def test_rows_grown_together_equal_rows_grown_alone():
    step, _ = table_step(seed=3)
    states, roots = torch.tensor([[2.0], [9.0], [4.0]]), torch.tensor([2, 0, 1])
    together = grow_trees(step, states, roots, depth=3, max_nodes=6, top_k=2, min_path_prob=0.01)
    for b in range(3):
        alone, = grow_trees(step, states[b:b + 1], roots[b:b + 1], depth=3, max_nodes=6, top_k=2, min_path_prob=0.01)
        assert together[b].shape == alone.shape and together[b].tokens.tolist() == alone.tokens.tolist()


def test_the_budget_and_the_threshold_cut_the_tree_and_what_stays_is_a_tree():
    step, _ = table_step(seed=5)
    for max_nodes, threshold in itertools.product([2, 4, 16], [0.0, 0.05, 0.3]):
        tree, = grow_trees(step, torch.tensor([[1.0]]), torch.tensor([2]), depth=4, max_nodes=max_nodes, top_k=2,
                           min_path_prob=threshold)
        assert len(tree.shape) <= max_nodes  # TreeShape itself checks that every parent is kept
        assert all(p >= threshold for p in tree.path_probs)
        for node, parent in enumerate(tree.shape.parents):
            if parent >= 0:
                assert tree.path_probs[node] <= tree.path_probs[parent]


def test_node_tokens_are_the_targets_ids_of_the_draft_entries():
    step, _ = table_step(seed=2)
    ids = torch.tensor([40, 7, 19])
    entry = {40: 0, 7: 1, 19: 2, 1: 1}  # the root (1) is given as the target's id and as entry 1

    def step_on_target_ids(i, states, tokens):  # the step embeds target ids: the same step on entries
        return step(i, states, torch.tensor([entry[int(t)] for t in tokens]))

    mapped, = grow_trees(step_on_target_ids, torch.tensor([[3.0]]), torch.tensor([1]), depth=2, max_nodes=6, top_k=3,
                         min_path_prob=0.0, token_ids=ids)
    plain, = grow_trees(step, torch.tensor([[3.0]]), torch.tensor([1]), depth=2, max_nodes=6, top_k=3,
                        min_path_prob=0.0)
    assert mapped.shape == plain.shape
    assert mapped.tokens.tolist() == ids[plain.tokens].tolist()


def test_no_depth_grows_an_empty_tree_and_only_dynamic_builders_grow():
    step, _ = table_step()
    tree, = grow_trees(step, torch.zeros(1, 1), torch.tensor([0]), depth=0, max_nodes=4, top_k=2, min_path_prob=0.0)
    assert len(tree.shape) == 0 and tree.tokens.numel() == 0
    builder = DraftTreeBuilder("consensus", 2, max_nodes=4, min_path_prob=0.0, dynamic_top_k=2)
    with pytest.raises(ValueError, match="only dynamic trees are grown"):
        builder.grow(step, torch.zeros(1, 1), torch.tensor([0]), depth=2)
