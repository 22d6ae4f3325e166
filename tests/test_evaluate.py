"""Greedy replay along a recorded answer: what eval-heads and the training summary report."""
import torch

from training.evaluate import replay_tree
from vllm_mtpspec.tree import chain_tree, tree_from_paths


def test_replay_accepts_the_longest_right_path_and_adds_the_bonus_token():
    answer = torch.tensor([10, 11, 12, 13, 14, 15])
    rows = torch.full((6, 2), 99)
    rows[0] = torch.tensor([11, 12])        # both right: 2 accepted + bonus
    rows[3] = torch.tensor([14, 99])        # first right only
    assert replay_tree(chain_tree(2), rows, answer) == [3, 2]  # rows 0 and 3, then the answer ends
    # A tree: the second-rank candidate at depth 1 is right where the first is not.
    tree = tree_from_paths([(0,), (1,), (1, 0)])
    nodes = torch.full((6, 3), 99)
    nodes[0] = torch.tensor([77, 11, 12])
    assert replay_tree(tree, nodes, answer)[0] == 3


def test_a_looked_up_chain_replaces_the_heads_where_there_is_one():
    answer = torch.tensor([10, 11, 12, 13, 14, 15])
    rows = torch.full((6, 2), 99)
    lookup = {0: [11, 12, 13], 4: [77]}
    assert replay_tree(chain_tree(2), rows, answer, lambda r: lookup.get(r, [])) == [4, 1]
