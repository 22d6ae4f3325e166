"""Triton kernel for y = x @ dequant(W)^T with 2-bit group-wise weights.

Each program computes a [BLOCK_M, BLOCK_N] tile of y. It walks the inputs in steps of
BLOCK_K, loads the packed bytes of a [BLOCK_N, BLOCK_K] weight tile (each byte is read by
the four codes it holds: the loads hit the same cache line), shifts the code out,
applies the group's scale and minimum, and accumulates in fp32. BLOCK_K divides the
group size, so one K step never straddles two groups.

Runs on GPUs, and on CPU tensors under TRITON_INTERPRET=1 (how CI checks it).
"""
from __future__ import annotations

import torch

from vllm_mtpspec.quant.int2 import Int2Weight
from vllm_mtpspec.triton_support import tl, triton, triton_available  # noqa: F401 (re-exported)

if triton is not None:

    @triton.jit
    def _int2_matmul_kernel(
        x_ptr, packed_ptr, scales_ptr, mins_ptr, y_ptr,
        M, N, K,
        stride_xm, stride_pn, stride_sn, stride_ym,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            byte = tl.load(packed_ptr + offs_n[:, None] * stride_pn + (offs_k[None, :] // 4),
                           mask=n_ok[:, None] & k_ok[None, :], other=0)
            codes = ((byte >> ((offs_k[None, :] % 4) * 2).to(tl.uint8)) & 3).to(tl.float32)
            group = k0 // GROUP
            scale = tl.load(scales_ptr + offs_n * stride_sn + group, mask=n_ok, other=0.0).to(tl.float32)
            low = tl.load(mins_ptr + offs_n * stride_sn + group, mask=n_ok, other=0.0).to(tl.float32)
            w = codes * scale[:, None] + low[:, None]  # [BLOCK_N, BLOCK_K]
            acc += tl.dot(x, tl.trans(w))
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def int2_matmul_triton(x: torch.Tensor, qw: Int2Weight, *, block_m: int = 16, block_n: int = 64) -> torch.Tensor:
    """x [..., in] @ dequant(W)^T -> [..., out] with the Triton kernel."""
    if triton is None:
        raise RuntimeError("triton is not installed: pip install 'vllm-mtpspec[triton]'")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[1] != qw.padded_in:  # zero inputs meet the zero padding of the last group
        x2 = torch.nn.functional.pad(x2, (0, qw.padded_in - x2.shape[1]))
    x2 = x2.contiguous()
    M, K = x2.shape
    N = qw.out_features
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_k = min(qw.group_size, 64)
    while qw.group_size % block_k:
        block_k //= 2
    block_k = max(block_k, 16)  # tl.dot needs K >= 16
    if qw.group_size % block_k:
        raise ValueError(f"group_size={qw.group_size}: the Triton kernel needs a multiple of 16")
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _int2_matmul_kernel[grid](
        x2, qw.packed, qw.scales, qw.mins, y,
        M, N, K,
        x2.stride(0), qw.packed.stride(0), qw.scales.stride(0), y.stride(0),
        GROUP=qw.group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y.view(*lead, N)
