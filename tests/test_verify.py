"""Verification rules: greedy equals argmax decoding, and sampling keeps the target's
distribution (chi-square tests with fixed seeds; one test shows they catch a wrong rule)."""
import pytest
import torch

from tests.stats import TRIALS, VOCAB, assert_follows, random_dists
from vllm_mtpspec.tree import chain_tree, tree_from_paths
from vllm_mtpspec.verify import verify_greedy, verify_sampled


def test_greedy_accepts_the_longest_matching_path_and_adds_the_bonus():
    shape = tree_from_paths([(0,), (1,), (0, 0), (1, 0), (1, 0, 0)])
    tokens = torch.tensor([4, 2, 5, 3, 1])
    logits = torch.full((6, VOCAB), -5.0)
    for row, best in enumerate([2, 0, 3, 0, 1, 0]):  # root->2 (node 1)->3 (node 3)->1 (node 4)->0
        logits[row, best] = 5.0
    verdict = verify_greedy(shape, tokens, logits)
    assert verdict.accepted_nodes == [1, 3, 4]
    assert verdict.emitted == [2, 3, 1, 0]
    nothing = verify_greedy(shape, tokens, torch.zeros(6, VOCAB).index_fill_(1, torch.tensor([0]), 1.0))
    assert nothing.accepted_nodes == [] and nothing.emitted == [0]


def test_deterministic_candidates_keep_the_target_distribution():
    shape = tree_from_paths([(0,), (1,), (2,), (0, 0), (0, 1)])
    tokens = torch.tensor([2, 0, 4, 1, 3])
    probs = random_dists(len(shape) + 1, seed=0)
    gen = torch.Generator().manual_seed(1)
    verdicts = [verify_sampled(shape, tokens, probs, generator=gen) for _ in range(TRIALS)]
    assert_follows([v.emitted[0] for v in verdicts], probs[0])
    # After the first token was node 0's (token 2), the next follows the target at node 0.
    assert_follows([v.emitted[1] for v in verdicts if v.accepted_nodes[:1] == [0]], probs[1])
    assert any(len(v.accepted_nodes) == 2 for v in verdicts)


@pytest.mark.parametrize("num_children", [1, 2])
def test_sampled_drafts_keep_the_target_distribution(num_children):
    depth = 2
    paths = [(r,) for r in range(num_children)] + [(r, 0) for r in range(num_children)]
    shape = tree_from_paths(paths)
    target = random_dists(len(shape) + 1, seed=2)
    draft = random_dists(depth, seed=3)
    gen = torch.Generator().manual_seed(4)
    first, second = [], []
    for _ in range(TRIALS):
        tokens = torch.stack([torch.multinomial(draft[d - 1], 1, generator=gen)[0] for d in shape.depths])
        v = verify_sampled(shape, tokens, target, draft_probs=draft, generator=gen)
        first.append(v.emitted[0])
        if v.accepted_nodes[:1] == [0]:
            second.append(v.emitted[1])
    assert_follows(first, target[0])
    node0_row = 1
    assert_follows(second, target[node0_row])


def broken_chain_rule(target, draft, token, gen):
    """A subtly wrong rule: on rejection, resample from p instead of norm(max(p - q, 0))."""
    if torch.rand((), generator=gen) < min(1.0, float(target[0, token] / draft[0, token])):
        return int(token)
    return int(torch.multinomial(target[0], 1, generator=gen))


def test_the_statistical_test_catches_a_wrong_residual():
    target = random_dists(2, seed=5)
    draft = random_dists(1, seed=6)
    gen = torch.Generator().manual_seed(7)
    samples = [broken_chain_rule(target, draft, torch.multinomial(draft[0], 1, generator=gen)[0], gen)
               for _ in range(TRIALS)]
    with pytest.raises(AssertionError):
        assert_follows(samples, target[0])
    # ... while the real rule on the same inputs passes.
    shape = chain_tree(1)
    right = [verify_sampled(shape, torch.multinomial(draft[0], 1, generator=gen), target, draft_probs=draft,
                            generator=gen).emitted[0] for _ in range(TRIALS)]
    assert_follows(right, target[0])


def test_drafts_from_a_draft_vocabulary_keep_the_target_distribution():
    # The draft puts no mass outside its vocabulary (the first half of the tokens); the
    # target's tokens outside it still come out at their rate, through the residual.
    shape = chain_tree(2)
    target = random_dists(3, seed=8)
    draft = random_dists(2, seed=9)
    draft[:, VOCAB // 2:] = 0.0
    draft /= draft.sum(-1, keepdim=True)
    gen = torch.Generator().manual_seed(10)
    first = []
    for _ in range(TRIALS):
        tokens = torch.stack([torch.multinomial(draft[d], 1, generator=gen)[0] for d in range(2)])
        first.append(verify_sampled(shape, tokens, target, draft_probs=draft, generator=gen).emitted[0])
    assert_follows(first, target[0])
    assert any(t >= VOCAB // 2 for t in first)
