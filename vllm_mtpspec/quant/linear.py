"""Int2Linear: a linear layer that keeps only 2-bit codes, scales and minimums."""
from __future__ import annotations

import os

import torch
from torch import nn

from vllm_mtpspec.quant.int2 import Int2Weight, int2_matmul_reference, quantize_int2
from vllm_mtpspec.quant.triton_int2 import int2_matmul_triton, triton_available


def _use_triton(x: torch.Tensor, qw: Int2Weight) -> bool:
    # The interpreter is far slower than PyTorch: on CPU tensors only when asked for.
    if not triton_available() or qw.group_size % 16:
        return False
    if x.is_cuda:
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("MTPSPEC_INT2_KERNEL") == "triton"


def int2_matmul(x: torch.Tensor, qw: Int2Weight) -> torch.Tensor:
    """x @ dequant(W)^T: the Triton kernel on a GPU, the chunked PyTorch path elsewhere."""
    if _use_triton(x, qw):
        return int2_matmul_triton(x, qw)
    return int2_matmul_reference(x, qw)


class Int2Linear(nn.Module):
    def __init__(self, qweight: Int2Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        qweight.validate()
        self.in_features = qweight.in_features
        self.out_features = qweight.out_features
        self.group_size = qweight.group_size
        self.register_buffer("packed", qweight.packed)
        self.register_buffer("scales", qweight.scales)
        self.register_buffer("mins", qweight.mins)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group_size: int = 64) -> "Int2Linear":
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(quantize_int2(linear.weight.detach(), group_size=group_size), bias)

    @property
    def qweight(self) -> Int2Weight:
        return Int2Weight(self.packed, self.scales, self.mins, self.in_features, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int2_matmul(x, self.qweight)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits=2, group_size={self.group_size}"


def empty_int2_linear(in_features: int, out_features: int, *, group_size: int, bias: bool) -> Int2Linear:
    """An Int2Linear of the right shapes, for load_state_dict to fill."""
    padded_in = -(-in_features // group_size) * group_size
    groups = padded_in // group_size
    qweight = Int2Weight(
        packed=torch.zeros(out_features, padded_in // 4, dtype=torch.uint8),
        scales=torch.zeros(out_features, groups, dtype=torch.float16),
        mins=torch.zeros(out_features, groups, dtype=torch.float16),
        in_features=in_features,
        group_size=group_size,
    )
    return Int2Linear(qweight, torch.zeros(out_features) if bias else None)
