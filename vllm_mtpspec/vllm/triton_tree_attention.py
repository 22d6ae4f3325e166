"""Tree attention over a paged KV cache: the Triton kernel for GPUs.

The same computation as attention.masked_attention (the PyTorch path, and this kernel's
oracle), reading keys and values straight from the paged cache instead of gathering
them: each tree request's new tokens (its root and its nodes) attend to the request's
whole cached prefix and, among the new tokens, to what its tree mask allows (itself and
its ancestors).

One program per (request, new token, query head) walks the request's sequence in tiles
of BLOCK_N tokens, finds each token's block through the block table, and keeps an
online softmax in fp32. The caches are taken as [num_blocks, block_size, num_kv_heads,
head_size] views with any strides, which is how vLLM's GPU backends can hand their
caches over (FlashAttention: kv_cache[0] / kv_cache[1]; Triton: kv_cache[:, 0] / [:, 1]).

Runs on GPUs, and on CPU tensors under TRITON_INTERPRET=1 (how CI checks it).
"""
from __future__ import annotations

import torch

from vllm_mtpspec.triton_support import tl, triton

if triton is not None:

    @triton.jit
    def _tree_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, blocks_ptr, seq_lens_ptr, num_new_ptr, tree_mask_ptr, out_ptr,
        scale,
        stride_qr, stride_qn, stride_qh,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_br, stride_mr, stride_mn,
        stride_or, stride_on, stride_oh,
        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        r = tl.program_id(0)
        i = tl.program_id(1)
        h = tl.program_id(2)
        kv_head = h // GROUP
        num_new = tl.load(num_new_ptr + r)
        seq_len = tl.load(seq_lens_ptr + r)
        prefix = seq_len - num_new
        # Padding rows (i >= num_new) walk nothing and store nothing.
        end = tl.where(i < num_new, seq_len, 0)

        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_SIZE
        q = tl.load(q_ptr + r * stride_qr + i * stride_qn + h * stride_qh + offs_d, mask=d_ok, other=0.0)
        q = q.to(tl.float32)

        # A finite start keeps exp(m_old - m_new) defined when a whole tile is masked out.
        m_i = tl.full((), -1.0e30, tl.float32)
        l_i = tl.zeros((), tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for start in range(0, end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            in_seq = pos < seq_len
            block = tl.load(blocks_ptr + r * stride_br + pos // BLOCK_SIZE, mask=in_seq, other=0)
            slot = pos % BLOCK_SIZE
            kv_ok = in_seq[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks
                        + kv_head * stride_kh + offs_d[None, :] * stride_kd, mask=kv_ok, other=0.0)
            s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale
            new = pos - prefix  # index among the new tokens (negative: the cached prefix)
            is_new = in_seq & (new >= 0)
            tree_ok = tl.load(tree_mask_ptr + r * stride_mr + i * stride_mn + new, mask=is_new, other=0) != 0
            allowed = in_seq & ((new < 0) | tree_ok)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                        + kv_head * stride_vh + offs_d[None, :] * stride_vd, mask=kv_ok, other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        out = acc / l_i
        tl.store(out_ptr + r * stride_or + i * stride_on + h * stride_oh + offs_d,
                 out.to(out_ptr.dtype.element_ty), mask=d_ok & ((offs_d * 0 + i) < num_new))


def tree_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor,
                   seq_lens: torch.Tensor, num_new: torch.Tensor, tree_mask: torch.Tensor, scale: float,
                   *, block_n: int = 64) -> torch.Tensor:
    """query [R, N, H, D]: each tree request's new tokens (its last num_new[r] cached
    positions), padded to N; key_cache / value_cache [num_blocks, block_size, H_kv, D];
    blocks [R, nb] the requests' block tables; seq_lens [R] cached tokens including the
    new ones; tree_mask [R, N, N] bool: new token i may attend to new token j. Returns
    [R, N, H, D] in query's dtype (padding rows are zero)."""
    if triton is None:
        raise RuntimeError("tree_attention needs Triton (pip install triton), or use attention.masked_attention")
    rows, n_max, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split over {num_kv_heads} KV heads")
    query = query.contiguous() if query.stride(-1) != 1 else query
    mask = tree_mask.to(torch.int8).contiguous()
    out = torch.zeros_like(query)
    grid = (rows, n_max, num_heads)
    _tree_attention_kernel[grid](
        query, key_cache, value_cache, blocks, seq_lens, num_new, mask, out,
        float(scale),
        query.stride(0), query.stride(1), query.stride(2),
        *key_cache.stride(), *value_cache.stride(),
        blocks.stride(0), mask.stride(0), mask.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=key_cache.shape[1], HEAD_SIZE=head_size,
        BLOCK_D=triton.next_power_of_2(head_size), BLOCK_N=block_n,
    )
    return out
