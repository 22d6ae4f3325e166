"""The Triton tree-attention kernel against the PyTorch path, under TRITON_INTERPRET=1."""
import pytest

from tests.interpreter import run_under_triton_interpreter

pytest.importorskip("triton")

CHECK = r"""
import random
import torch
from vllm_mtpspec.tree import tree_from_paths
from vllm_mtpspec.vllm.attention import masked_attention
from vllm_mtpspec.vllm.triton_tree_attention import tree_attention

def random_tree(num_nodes, rng):
    paths, children = [], {(): 0}
    for _ in range(num_nodes):
        parent = rng.choice([()] + paths)
        path = parent + (children[parent],)
        children[parent] += 1
        children[path] = 0
        paths.append(path)
    return tree_from_paths(paths)

def check(block_size, tree_sizes, layout, heads=(4, 2), head_size=64, seed=0):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_heads, num_kv_heads = heads
    seq_lens = [rng.randint(1, 3 * block_size) + n + 1 for n in tree_sizes]
    nb = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nb) + 3
    if layout == "flash":     # [2, blocks, block_size, H_kv, D]
        kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size)
        key_cache, value_cache = kv[0], kv[1]
    else:                     # [blocks, 2, block_size, H_kv, D]: strided views
        kv = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size)
        key_cache, value_cache = kv[:, 0], kv[:, 1]
    perm = torch.randperm(num_blocks)
    rows, n_max, nb_max = len(tree_sizes), max(tree_sizes) + 1, max(nb)
    blocks = torch.zeros(rows, nb_max, dtype=torch.int32)
    tree_mask = torch.zeros(rows, n_max, n_max, dtype=torch.bool)
    dense_mask = torch.zeros(rows, n_max, nb_max * block_size, dtype=torch.bool)
    used = 0
    for r, n in enumerate(tree_sizes):
        blocks[r, :nb[r]] = perm[used:used + nb[r]].int()
        used += nb[r]
        m = random_tree(n, rng).ancestor_mask(include_root=True)
        tree_mask[r, :n + 1, :n + 1] = m
        prefix = seq_lens[r] - (n + 1)
        dense_mask[r, :n + 1, :prefix] = True
        dense_mask[r, :n + 1, prefix:seq_lens[r]] = m
        dense_mask[r, n + 1:, 0] = True
    query = torch.randn(rows, n_max, num_heads, head_size)
    keys = key_cache[blocks.long()].permute(0, 3, 1, 2, 4).reshape(rows, num_kv_heads, -1, head_size)
    values = value_cache[blocks.long()].permute(0, 3, 1, 2, 4).reshape(rows, num_kv_heads, -1, head_size)
    expected = masked_attention(query, keys, values, dense_mask, 0.125)
    got = tree_attention(query, key_cache, value_cache, blocks, torch.tensor(seq_lens, dtype=torch.int32),
                         torch.tensor([n + 1 for n in tree_sizes], dtype=torch.int32), tree_mask, 0.125, block_n=32)
    for r, n in enumerate(tree_sizes):
        torch.testing.assert_close(got[r, :n + 1], expected[r, :n + 1], atol=1e-4, rtol=1e-4)
        assert not got[r, n + 1:].any(), "padding rows stay zero"

check(16, [0, 3, 7], "flash")
check(32, [1, 15], "triton", heads=(4, 1))
check(16, [63, 5], "flash", heads=(2, 2), head_size=48, seed=1)
print("triton-tree-ok")
"""


def test_triton_tree_attention_matches_the_pytorch_path_under_the_interpreter():
    run_under_triton_interpreter(CHECK, "triton-tree-ok")
