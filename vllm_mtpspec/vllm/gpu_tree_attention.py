"""Tree attention inside vLLM's GPU attention backends (FlashAttention and Triton).

Both keep a layer's paged cache as a [num_blocks, num_kv_heads, block_size, 2 * head_size]
view whose last dimension holds a token's key, then its value, and both write the step's
keys and values into it before their forward runs (`forward_includes_kv_cache_update` is
False). So, as on the CPU (attention.py), the stock kernel attends the step causally and
the rows of tree requests are recomputed afterwards: the Triton kernel
(triton_tree_attention.py) reads the cache in place through the block table, and each
row sees the cached prefix and, among the step's new tokens, itself and its ancestors.

What the layers of a step share is planned once, on the host, from the runner's
host-side query offsets, and copied to the device; the sequence lengths and block rows
are gathered from the backend's metadata on the device. Nothing here reads a device
value back, so tree attention adds no host sync to a step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from vllm_mtpspec.vllm.tree_step import TreeStep
from vllm_mtpspec.vllm.triton_tree_attention import tree_attention

# The backends whose cache layout and write order this module relies on: (module, class).
GPU_TREE_ATTENTION_IMPLS = (
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl"),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl"),
)


def paged_keys_and_values(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The [num_blocks, block_size, num_kv_heads, head_size] key and value views, taken as
    the backends take them."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


@dataclass(frozen=True)
class PagedTreePlan:
    """Where every tree request's query tokens are in the step, on the step's device."""

    batch_index: torch.Tensor   # [R] long: its row of the batch (and of the block table)
    query_rows: torch.Tensor    # [R, n_max] long: its query tokens' rows (padding repeats the first)
    num_new: torch.Tensor       # [R] int32: its query tokens, the root and the nodes
    tree_mask: torch.Tensor     # [R, n_max, n_max] bool: query token i sees query token j
    written_rows: torch.Tensor  # [V] long: the step's rows that tree attention replaces
    written_from: torch.Tensor  # [V] long: each one's row of the [R * n_max] result


def plan_paged_tree_attention(step: TreeStep, query_start_loc: Sequence[int], device: torch.device) -> PagedTreePlan:
    """query_start_loc: the step's query offsets by batch row, host-side (the runner's)."""
    n_max = max(tree.num_query_tokens for tree in step.trees)
    count = len(step.trees)
    host = torch.device("cpu")  # filled element by element: on the host, then copied over once
    batch_index = torch.empty(count, dtype=torch.long, device=host)
    query_rows = torch.empty(count, n_max, dtype=torch.long, device=host)
    num_new = torch.empty(count, dtype=torch.int32, device=host)
    tree_mask = torch.zeros(count, n_max, n_max, dtype=torch.bool, device=host)
    written_rows, written_from = [], []
    for r, tree in enumerate(step.trees):
        n = tree.num_query_tokens
        first = int(query_start_loc[tree.batch_index + 1]) - n
        batch_index[r] = tree.batch_index
        query_rows[r] = first
        query_rows[r, :n] = torch.arange(first, first + n, device=host)
        num_new[r] = n
        tree_mask[r, :n, :n] = tree.attention_mask
        written_rows.extend(range(first, first + n))
        written_from.extend(range(r * n_max, r * n_max + n))
    return PagedTreePlan(batch_index.to(device), query_rows.to(device), num_new.to(device), tree_mask.to(device),
                         torch.tensor(written_rows, device=device), torch.tensor(written_from, device=device))


def overwrite_tree_rows_paged(plan: PagedTreePlan, query: torch.Tensor, kv_cache: torch.Tensor,
                              block_table: torch.Tensor, seq_lens: torch.Tensor, output: torch.Tensor,
                              head_size: int, scale: float) -> None:
    """Replace the causal output rows of every tree request with tree attention. query
    [T, H, D]; block_table [num_reqs, max_blocks] and seq_lens [num_reqs] (cached tokens,
    the step's included) as the backend's metadata holds them; output [T, H, D] or
    [T, H * D], written in place."""
    num_heads = query.shape[1]
    key_cache, value_cache = paged_keys_and_values(kv_cache, head_size)
    attended = tree_attention(query[plan.query_rows], key_cache, value_cache,
                              block_table.index_select(0, plan.batch_index),
                              seq_lens.index_select(0, plan.batch_index), plan.num_new, plan.tree_mask, scale)
    out = output.view(output.shape[0], num_heads, head_size)
    out[plan.written_rows] = attended.view(-1, num_heads, head_size)[plan.written_from]


def move_paged_kv(kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, sources: list[int],
                  destinations: list[int]) -> None:
    """Copy keys and values from the sources' slots to the destinations' slots, every
    layer (see kv_compaction.py). sources and destinations index the step's tokens;
    slot_mapping [T] is the step's slot of each, on the caches' device."""
    if not sources:
        return
    count = len(sources)
    slots = slot_mapping[torch.tensor(sources + destinations, device=slot_mapping.device)].long()
    seen: set[int] = set()
    for kv_cache in kv_caches:
        if kv_cache is None or id(kv_cache) in seen:
            continue
        seen.add(id(kv_cache))
        tokens = kv_cache.transpose(1, 2)               # [num_blocks, block_size, H_kv, 2 * D], a view
        block_size = tokens.shape[1]
        blocks, offsets = slots // block_size, slots % block_size
        moved = tokens[blocks[:count], offsets[:count]]  # every source read before any write
        tokens[blocks[count:], offsets[count:]] = moved
