"""Batched tree verification on the logits' device: the same verdicts as the host walk."""
import random

import torch

from vllm_mtpspec.batched_verify import (
    TreeBatch,
    draw_from,
    draw_uniforms,
    emitted_tokens,
    greedy_hits,
    read_verdicts,
    residual_draw,
    sampled_hits,
    stop_rows,
    walk,
)
from vllm_mtpspec.tree import tree_from_paths
from vllm_mtpspec.verify import verify_greedy

CPU = torch.device("cpu")


def verify_greedy_batch(batch, logits):
    edges, argmax = batch.on(CPU), logits.argmax(-1)
    walked, accepted = walk(batch, edges, greedy_hits(edges, argmax))
    bonus = argmax[stop_rows(walked, accepted)]
    return read_verdicts(batch, emitted_tokens(edges, walked, accepted, bonus), walked)


def verify_sampled_batch(batch, probs, generator):
    edges = batch.on(CPU)
    uniforms = draw_uniforms(batch.num_rows, CPU, [(range(batch.num_rows), generator)])
    walked, accepted = walk(batch, edges, sampled_hits(edges, probs, uniforms))
    stops = stop_rows(walked, accepted)
    bonus = residual_draw(batch, edges, probs, stops, draw_uniforms(len(batch.roots), CPU,
                                                                    [(range(len(batch.roots)), generator)]))
    return read_verdicts(batch, emitted_tokens(edges, walked, accepted, bonus), walked)


def random_shape(rng: random.Random, num_nodes: int):
    paths = []
    while len(paths) < num_nodes:
        parent = rng.choice([()] + paths)
        rank = sum(1 for p in paths if p[:-1] == parent)
        paths.append(parent + (rank,))
    return tree_from_paths(paths)


def test_greedy_walks_equal_the_host_walk_on_random_trees():
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    vocab = 5  # small, so the target's argmax often is a draft token
    for _ in range(40):
        trees = [random_shape(rng, rng.randint(1, 9)) for _ in range(rng.randint(1, 4))]
        tokens = [[rng.randrange(vocab) for _ in shape.paths] for shape in trees]
        batch = TreeBatch.of(list(zip(trees, tokens)))
        logits = torch.randn(batch.num_rows, vocab, generator=gen)
        got = verify_greedy_batch(batch, logits)
        for t, shape in enumerate(trees):
            rows = batch.tree_rows(t)
            want = verify_greedy(shape, torch.tensor(tokens[t]), logits[rows.start:rows.stop])
            assert got[t] == want


def test_the_first_matching_sibling_in_rank_order_is_accepted():
    shape = tree_from_paths([(0,), (1,), (0, 0), (1, 0)])
    batch = TreeBatch.of([(shape, [7, 7, 1, 2])])  # two siblings propose the same token
    logits = torch.zeros(5, 10)
    logits[0, 7] = logits[1, 1] = logits[3, 9] = 5.0  # root -> 7; after node 0 -> 1; then 9
    (verdict,) = verify_greedy_batch(batch, logits)
    assert verdict.accepted_nodes == [0, 2] and verdict.emitted == [7, 1, 9]


def test_sampled_walks_follow_the_target_row_by_row():
    """The first two emitted tokens: x0 ~ p(root); when x0 is a child's token, x1 ~ p(that
    child's row), else the walk ends. Empirical frequencies against the exact law."""
    gen = torch.Generator().manual_seed(1)
    vocab = 4
    shape = tree_from_paths([(0,), (1,), (0, 0)])
    tokens = [0, 1, 2]
    probs = torch.softmax(torch.randn(4, vocab, generator=gen), -1)
    batch = TreeBatch.of([(shape, tokens)])
    trials = 20_000
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(trials // 500):
        many = TreeBatch.of([(shape, tokens)] * 500)
        for verdict in verify_sampled_batch(many, probs.repeat(500, 1), gen):
            key = tuple(verdict.emitted[:2])
            counts[key] = counts.get(key, 0) + 1
    exact = {}
    for x0 in range(vocab):
        child = {0: 0, 1: 1}.get(x0)  # node 0 carries token 0, node 1 token 1
        if child is None:
            exact[(x0,)] = float(probs[0, x0])
        else:
            for x1 in range(vocab):
                exact[(x0, x1)] = float(probs[0, x0] * probs[child + 1, x1])
    assert set(counts) <= set(exact)
    for key, p in exact.items():
        observed = counts.get(key, 0) / trials
        assert abs(observed - p) < 4 * (p * (1 - p) / trials) ** 0.5 + 1e-3, (key, observed, p)
    assert batch.num_rows == 4


def test_seeded_rows_draw_from_their_own_generator():
    draws = []
    for _ in range(2):
        seeded = torch.Generator().manual_seed(123)
        draws.append(draw_uniforms(6, torch.device("cpu"), [(range(2, 5), seeded)]))
    assert torch.equal(draws[0][2:5], draws[1][2:5])         # the seeded rows repeat
    assert not torch.equal(draws[0][:2], draws[1][:2])       # the others do not
    expected = torch.rand(3, dtype=torch.float64, generator=torch.Generator().manual_seed(123))
    assert torch.equal(draws[0][2:5], expected)


def test_the_bonus_leaves_out_the_stop_rows_children_only():
    shape = tree_from_paths([(0,), (1,), (0, 0)])
    batch = TreeBatch.of([(shape, [0, 1, 2]), (shape, [0, 1, 2])])
    edges = batch.on(CPU)
    probs = torch.full((8, 4), 0.25)
    stops = torch.tensor([0, 5])  # tree 0 stopped at its root (children 0, 1), tree 1 at node 0 (child 2)
    draws = torch.stack([residual_draw(batch, edges, probs, stops, torch.rand(2, dtype=torch.float64))
                         for _ in range(400)])
    assert set(draws[:, 0].tolist()) == {2, 3} and set(draws[:, 1].tolist()) == {0, 1, 3}
    # Children that held all of p's mass: the bonus comes from the whole of p.
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 8)
    assert set(residual_draw(batch, edges, probs, stops, torch.tensor([0.3, 0.7], dtype=torch.float64)).tolist()) \
        <= {0, 1}


def test_a_draw_never_picks_a_token_of_probability_zero():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4 + [[0.0, 0.0, 0.0, 0.0, 1.0]])
    uniforms = torch.tensor([0.0, 0.4999, 0.5, 0.999999, 0.3], dtype=torch.float64)
    assert draw_from(probs, uniforms).tolist() == [1, 1, 3, 3, 4]


def test_siblings_that_repeat_a_token_do_not_count_it_twice():
    """Two children draft the same token: it is tried once, and the first emitted token
    still follows p (a repeat counted twice would inflate that token)."""
    gen = torch.Generator().manual_seed(2)
    shape = tree_from_paths([(0,), (1,)])
    probs = torch.tensor([[0.6, 0.3, 0.1]] * 3)
    many = TreeBatch.of([(shape, [0, 0])] * 20_000)
    firsts = torch.tensor([v.emitted[0] for v in verify_sampled_batch(many, probs.repeat(20_000, 1), gen)])
    observed = torch.bincount(firsts, minlength=3).double() / 20_000
    torch.testing.assert_close(observed, probs[0].double(), atol=0.015, rtol=0)
