"""Group-wise asymmetric 2-bit weights: pack, unpack and a PyTorch dequantizing matmul.

A weight matrix W [out, in] is cut along `in` into groups of `group_size` inputs. Each
group keeps its minimum and its step (scale): w ~= min + q * scale with q in {0, 1, 2, 3}.
Four q values share one byte, lowest bits first. Scales and minimums are stored in fp16,
so a weight costs 2 + 32 / group_size bits (2.5 at the default group of 64).

`in` need not be a multiple of the group size: the last group is padded with zeros that
never meet an input (the matmul pads the input with zeros too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LEVELS = 3  # the largest 2-bit code


class QuantError(ValueError):
    """Bad quantization parameters or a quantized tensor set that does not fit together."""


@dataclass
class Int2Weight:
    packed: torch.Tensor   # [out, padded_in // 4] uint8
    scales: torch.Tensor   # [out, padded_in // group_size] fp16
    mins: torch.Tensor     # [out, padded_in // group_size] fp16
    in_features: int
    group_size: int

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def padded_in(self) -> int:
        return self.packed.shape[1] * 4

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.mins))

    def validate(self, *, where: str = "int2 weight") -> None:
        """Checks that the three tensors describe one matrix; loaders call this."""
        g = self.group_size
        check_group_size(g)
        if self.packed.dtype != torch.uint8 or self.packed.dim() != 2:
            raise QuantError(f"{where}: packed codes must be a 2-D uint8 tensor, got {self.packed.dtype} {tuple(self.packed.shape)}")
        if self.padded_in % g or not (self.padded_in - g < self.in_features <= self.padded_in):
            raise QuantError(
                f"{where}: {self.padded_in} packed inputs do not fit in_features={self.in_features} "
                f"with group_size={g}; the file is truncated or was written with another group size"
            )
        groups = (self.out_features, self.padded_in // g)
        for name, tensor in (("scales", self.scales), ("mins", self.mins)):
            if tuple(tensor.shape) != groups:
                raise QuantError(f"{where}: {name} has shape {tuple(tensor.shape)}, expected {groups}")


def check_group_size(group_size: int) -> None:
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 4:
        raise QuantError(
            f"group_size={group_size!r}: must be a positive multiple of 4 (four 2-bit codes "
            "share a byte); 64 is the default"
        )


def quantize_int2(weight: torch.Tensor, *, group_size: int = 64) -> Int2Weight:
    """Quantizes a 2-D float weight [out, in] to 2-bit codes with a scale and min per group."""
    check_group_size(group_size)
    if weight.dim() != 2 or weight.numel() == 0:
        raise QuantError(f"can only quantize a non-empty 2-D weight, got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    padded_in = -(-in_features // group_size) * group_size
    w = torch.zeros(out_features, padded_in, dtype=torch.float32, device=weight.device)
    w[:, :in_features] = weight.float()
    groups = w.view(out_features, padded_in // group_size, group_size)
    # Padding would drag a group's range towards zero: take min/max over real inputs only.
    real = torch.zeros(padded_in, dtype=torch.bool, device=weight.device)
    real[:in_features] = True
    real = real.view(1, -1, group_size)
    lo = groups.masked_fill(~real, float("inf")).amin(dim=-1)
    hi = groups.masked_fill(~real, float("-inf")).amax(dim=-1)
    scales = ((hi - lo) / LEVELS).to(torch.float16)
    mins = lo.to(torch.float16)
    # Codes are chosen against the fp16 values that will be stored, so a weight that is
    # exactly representable comes back exactly.
    safe_scales = torch.where(scales == 0, torch.ones_like(scales), scales).float()
    codes = torch.round((groups - mins.float().unsqueeze(-1)) / safe_scales.unsqueeze(-1))
    codes = codes.clamp_(0, LEVELS).to(torch.uint8).view(out_features, padded_in)
    return Int2Weight(pack_codes(codes), scales, mins, in_features, group_size)


def stack_rows(weights: list[Int2Weight]) -> Int2Weight:
    """Matrices that read the same input, as one whose output rows are theirs in order
    (each row keeps its own codes, scales and minimums: the same values exactly)."""
    first = weights[0]
    if any((w.in_features, w.group_size) != (first.in_features, first.group_size) for w in weights):
        raise QuantError("only matrices with the same in_features and group_size stack: "
                         f"{[(w.in_features, w.group_size) for w in weights]}")
    return Int2Weight(torch.cat([w.packed for w in weights]), torch.cat([w.scales for w in weights]),
                      torch.cat([w.mins for w in weights]), first.in_features, first.group_size)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[out, n] codes in 0..3 -> [out, n // 4] bytes, code j of a byte in bits 2j..2j+1."""
    c = codes.view(codes.shape[0], -1, 4).to(torch.uint8)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_codes: [out, n // 4] bytes -> [out, n] codes."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 3).view(packed.shape[0], -1)


def dequantize_int2(qw: Int2Weight, *, rows: slice = slice(None), dtype=torch.float32) -> torch.Tensor:
    """Full-precision rows of the weight [rows, in_features]."""
    codes = unpack_codes(qw.packed[rows]).to(dtype)
    n_rows = codes.shape[0]
    codes = codes.view(n_rows, -1, qw.group_size)
    w = codes * qw.scales[rows].to(dtype).unsqueeze(-1) + qw.mins[rows].to(dtype).unsqueeze(-1)
    return w.view(n_rows, -1)[:, : qw.in_features]


def int2_matmul_reference(x: torch.Tensor, qw: Int2Weight, *, rows_per_chunk: int = 4096) -> torch.Tensor:
    """x [..., in] @ W^T -> [..., out], dequantizing `rows_per_chunk` output rows at a time
    so that a large vocab projection is never held in full precision."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], qw.out_features, dtype=x.dtype, device=x.device)
    for start in range(0, qw.out_features, rows_per_chunk):
        rows = slice(start, min(start + rows_per_chunk, qw.out_features))
        out[:, rows] = x2 @ dequantize_int2(qw, rows=rows, dtype=x.dtype).T
    return out.view(*lead, qw.out_features)
