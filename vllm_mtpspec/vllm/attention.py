"""Tree attention over vLLM's paged KV cache: the PyTorch path.

A tree request's query tokens are its root (the token sampled last step) and its nodes,
whose keys and values vLLM has just written into their own slots at the end of the
request's sequence. Each of them attends to the whole cached prefix and, among the new
tokens, only to itself and its ancestors: never to siblings or cousins. vLLM's CPU
attention kernel takes no mask, so the runner hook lets the stock kernel attend the whole
batch causally and then recomputes the rows of tree requests here. The same function is
the oracle for any faster kernel.

Cache layout (vLLM's CPU backend): per layer [num_blocks, num_kv_heads, block_size,
2 * head_size]; inside one block and head, where each token's key and value elements
lie depends on the kernel's ISA (the "vec" kernel, for one, stores keys transposed). The
layout is read once per ISA and shape by writing probe tokens with vLLM's own cache op,
so this path follows whatever the kernel does.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vllm_mtpspec.vllm.tree_step import TreeStep


@dataclass(frozen=True)
class BlockLayout:
    """Flat offsets, within one block and KV head, of each token's key and value elements."""

    key_index: torch.Tensor    # [block_size, head_size]
    value_index: torch.Tensor  # [block_size, head_size]

    @property
    def block_size(self) -> int:
        return self.key_index.shape[0]


@functools.lru_cache(maxsize=None)
def probe_block_layout(isa: str, block_size: int, head_size: int, dtype: torch.dtype) -> BlockLayout:
    """Write probe tokens through vLLM's cache op and see where their elements land. Keys
    are written positive and values negative; one probe encodes the token offset, one the
    element: small integers, exact in every cache dtype."""
    from vllm import _custom_ops as ops

    offsets = torch.arange(block_size)
    probes = []
    for code in (offsets[:, None].expand(block_size, head_size),
                 torch.arange(head_size)[None, :].expand(block_size, head_size)):
        cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = split_cpu_kv_cache(cache)
        key = (code + 1).to(dtype).unsqueeze(1).contiguous()                 # [bs, 1, D]
        ops.cpu_attn_reshape_and_cache(key, -key, key_cache, value_cache, offsets, isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        probes.append(cache.reshape(-1).float())
    token_code, element_code = probes
    layout = []
    for sign in (1, -1):
        index = torch.full((block_size, head_size), -1, dtype=torch.long)
        where = (token_code * sign > 0).nonzero().view(-1)
        index[(token_code[where] * sign).long() - 1, (element_code[where] * sign).long() - 1] = where
        if (index < 0).any():
            raise RuntimeError(f"vLLM's CPU KV cache layout for isa={isa!r} was not recognised")
        layout.append(index)
    return BlockLayout(*layout)


def split_cpu_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The views vLLM's CPU backend hands its cache op and kernel."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    view = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1)
    key_cache, value_cache = view.chunk(2, dim=2)
    return key_cache, value_cache


def gather_sequence(kv_cache: torch.Tensor, layout: BlockLayout, block_row: torch.Tensor,
                    seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's keys and values, each [H_kv, seq_len, D]."""
    num_blocks_total, num_kv_heads, block_size, _ = kv_cache.shape
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache.reshape(num_blocks_total, num_kv_heads, -1)[block_row[:num_blocks].long()]  # [nb, H, bs*2D]
    out = []
    for index in (layout.key_index, layout.value_index):
        part = blocks[:, :, index]                                          # [nb, H, bs, D]
        out.append(part.permute(1, 0, 2, 3).reshape(num_kv_heads, num_blocks * block_size, -1)[:, :seq_len])
    return out[0], out[1]


def masked_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     new_token_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """query [n, H, D]; keys/values [H_kv, L, D] whose last n entries are the query tokens';
    new_token_mask [n, n] bool (row attends to column) -> [n, H, D] in query's dtype.
    Query head h reads KV head h // (H // H_kv), as in vLLM."""
    n, num_heads, head_size = query.shape
    num_kv_heads, seq_len, _ = keys.shape
    mask = torch.ones(n, seq_len, dtype=torch.bool, device=query.device)
    mask[:, seq_len - n:] = new_token_mask
    group = num_heads // num_kv_heads
    q = query.float().reshape(n, num_kv_heads, group, head_size).permute(1, 2, 0, 3)   # [H_kv, G, n, D]
    scores = torch.matmul(q, keys.float().unsqueeze(1).transpose(-1, -2)) * scale        # [H_kv, G, n, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values.float().unsqueeze(1))        # [H_kv, G, n, D]
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, head_size).to(query.dtype)


def paged_tree_attention(query: torch.Tensor, kv_cache: torch.Tensor, layout: BlockLayout,
                         block_row: torch.Tensor, seq_len: int, new_token_mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """One request: query [n, H, D] for its last n tokens -> attention output [n, H, D]."""
    keys, values = gather_sequence(kv_cache, layout, block_row, seq_len)
    return masked_attention(query, keys, values, new_token_mask.to(query.device), scale)


def overwrite_tree_rows(step: TreeStep, query: torch.Tensor, kv_cache: torch.Tensor, layout: BlockLayout,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                        output: torch.Tensor, scale: float) -> None:
    """Replace the causal output rows of every tree request with tree attention.
    query [T, H, D]; output [T, H * D] or [T, H, D], written in place."""
    num_heads, head_size = query.shape[1], query.shape[2]
    out = output.view(output.shape[0], num_heads, head_size)
    ends = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for tree in step.trees:
        i = tree.batch_index
        rows = slice(ends[i + 1] - tree.num_query_tokens, ends[i + 1])
        out[rows] = paged_tree_attention(query[rows], kv_cache, layout, block_table[i], lens[i],
                                         tree.attention_mask, scale)
