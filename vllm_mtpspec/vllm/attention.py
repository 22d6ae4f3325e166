"""Tree attention over vLLM's paged KV cache: the PyTorch path.

A tree request's query tokens are its root (the token sampled last step) and its nodes,
whose keys and values vLLM has just written into their own slots at the end of the
request's sequence. Each of them attends to the whole cached prefix and, among the new
tokens, only to itself and its ancestors: never to siblings or cousins. vLLM's CPU
attention kernel takes no mask, so the runner hook lets the stock kernel attend the whole
batch causally and then recomputes the rows of tree requests here. The same function is
the oracle for any faster kernel. All tree requests of a step go through one padded
gather and one batched product per layer.

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
    keys, values = gather_blocks(kv_cache, layout, block_row[: -(-seq_len // layout.block_size)][None])
    return keys[0, :, :seq_len], values[0, :, :seq_len]


def gather_blocks(kv_cache: torch.Tensor, layout: BlockLayout, blocks: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [R, nb] block ids -> keys and values [R, H_kv, nb * block_size, D], in order."""
    num_blocks_total, num_kv_heads, block_size, _ = kv_cache.shape
    rows, num_blocks = blocks.shape
    flat = kv_cache.reshape(num_blocks_total, num_kv_heads, -1)[blocks.long()]       # [R, nb, H, bs*2D]
    out = []
    for index in (layout.key_index, layout.value_index):
        part = flat[..., index]                                                          # [R, nb, H, bs, D]
        out.append(part.permute(0, 2, 1, 3, 4).reshape(rows, num_kv_heads, num_blocks * block_size, -1))
    return out[0], out[1]


@dataclass(frozen=True)
class TreeAttentionPlan:
    """Where every tree request's query rows and keys are, shared by all layers of a step."""

    query_rows: torch.Tensor  # [R, n_max] rows of the step's query (padding repeats a real row)
    row_valid: torch.Tensor   # [R, n_max] bool
    blocks: torch.Tensor      # [R, nb_max] block ids (padding: block 0, masked out)
    mask: torch.Tensor        # [R, n_max, nb_max * block_size] bool: what each row attends to


def plan_tree_attention(step: TreeStep, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, block_size: int) -> TreeAttentionPlan:
    ends, lens = query_start_loc.tolist(), seq_lens.tolist()
    n_max = max(t.num_query_tokens for t in step.trees)
    nb_max = max(-(-lens[t.batch_index] // block_size) for t in step.trees)
    count = len(step.trees)
    query_rows = torch.zeros(count, n_max, dtype=torch.long)
    row_valid = torch.zeros(count, n_max, dtype=torch.bool)
    blocks = torch.zeros(count, nb_max, dtype=block_table.dtype)
    mask = torch.zeros(count, n_max, nb_max * block_size, dtype=torch.bool)
    for r, tree in enumerate(step.trees):
        i, n = tree.batch_index, tree.num_query_tokens
        seq_len, first = lens[i], ends[i + 1] - n
        query_rows[r] = first
        query_rows[r, :n] = torch.arange(first, first + n)
        row_valid[r, :n] = True
        nb = -(-seq_len // block_size)
        blocks[r, :nb] = block_table[i, :nb]
        mask[r, :n, : seq_len - n] = True
        mask[r, :n, seq_len - n: seq_len] = tree.attention_mask
        mask[r, n:, 0] = True  # padding rows attend somewhere; their output is dropped
    return TreeAttentionPlan(query_rows, row_valid, blocks, mask)


def masked_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """query [R, n, H, D]; keys/values [R, H_kv, L, D]; mask [R, n, L] bool (row attends
    to key) -> [R, n, H, D] in query's dtype. Query head h reads KV head h // (H // H_kv),
    as in vLLM."""
    rows, n, num_heads, head_size = query.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    q = query.float().reshape(rows, n, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)  # [R, Hkv, G, n, D]
    scores = torch.matmul(q, keys.float().unsqueeze(2).transpose(-1, -2)) * scale              # [R, Hkv, G, n, L]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values.float().unsqueeze(2))              # [R, Hkv, G, n, D]
    return out.permute(0, 3, 1, 2, 4).reshape(rows, n, num_heads, head_size).to(query.dtype)


def overwrite_tree_rows(plan: TreeAttentionPlan, query: torch.Tensor, kv_cache: torch.Tensor, layout: BlockLayout,
                        output: torch.Tensor, scale: float) -> None:
    """Replace the causal output rows of every tree request with tree attention, all tree
    requests at once. query [T, H, D]; output [T, H * D] or [T, H, D], written in place."""
    num_heads, head_size = query.shape[1], query.shape[2]
    keys, values = gather_blocks(kv_cache, layout, plan.blocks)
    attended = masked_attention(query[plan.query_rows], keys, values, plan.mask, scale)   # [R, n_max, H, D]
    out = output.view(output.shape[0], num_heads, head_size)
    out[plan.query_rows[plan.row_valid]] = attended[plan.row_valid]
