"""Random token trees and paged caches in the layout of vLLM's GPU backends, for the tree
attention checks. Imports torch and vllm_mtpspec only, so the GPU check script
(benchmarks/gpu_check.py) runs the same checks on a machine without pytest or vLLM."""
import torch

from vllm_mtpspec.tree import tree_from_paths


def random_tree(num_nodes, gen):
    """Every node hangs under a random earlier node (or the root)."""
    children = {(): 0}
    paths = []
    for _ in range(num_nodes):
        parents = [()] + paths
        parent = parents[int(torch.randint(len(parents), (1,), generator=gen, device=gen.device))]
        path = parent + (children[parent],)
        children[parent] += 1
        children[path] = 0
        paths.append(path)
    return tree_from_paths(paths)


def backend_cache(num_blocks, block_size, num_kv_heads, head_size, physical, gen=None, device=None):
    """A layer's cache as FlashAttention and Triton receive it: the logical [num_blocks,
    H_kv, block_size, 2 * D] view, over storage laid out NHD (their default) or HND."""
    if physical == "NHD":
        return torch.randn(num_blocks, block_size, num_kv_heads, 2 * head_size, generator=gen,
                           device=device).transpose(1, 2)
    return torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_size, generator=gen, device=device)
