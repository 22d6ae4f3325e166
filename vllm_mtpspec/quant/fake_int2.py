"""Quantization-aware fine-tuning for INT2 heads: each matrix's weight is seen through
its 2-bit codes while it trains, and its per-group scale and minimum train with it.

    q = low + scale * clamp(round((w - low) / scale), 0, 3)

round's gradient is taken as 1 (the straight-through estimator), so w learns where its
code should land and scale / low learn the group's range (as in LSQ). The result packs
into the usual format (int2.py): the learned ranges rounded to fp16, the codes of the
trained weights.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from vllm_mtpspec.quant.int2 import LEVELS, Int2Weight, check_group_size, pack_codes


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.round(x) - x).detach()


class FakeInt2(nn.Module):
    """A parametrization of a [out, in] weight: its 2-bit fake-quantized value."""

    def __init__(self, init: Int2Weight) -> None:
        super().__init__()
        check_group_size(init.group_size)
        self.group_size, self.in_features = init.group_size, init.in_features
        self.scale = nn.Parameter(init.scales.float().clone())
        self.low = nn.Parameter(init.mins.float().clone())

    def _groups(self, weight: torch.Tensor) -> torch.Tensor:
        out_features, in_features = weight.shape
        padded = self.scale.shape[1] * self.group_size
        if padded != in_features:
            weight = torch.cat([weight, weight[:, -1:].expand(out_features, padded - in_features)], dim=1)
        return weight.view(out_features, -1, self.group_size)

    def codes(self, weight: torch.Tensor) -> torch.Tensor:
        scale, low = self.scale.detach().half().float(), self.low.detach().half().float()
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        return torch.round((self._groups(weight.detach()) - low[..., None]) / safe[..., None]).clamp_(0, LEVELS)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        scale, low = self.scale[..., None], self.low[..., None]
        safe = torch.where(scale.abs() < 1e-8, torch.full_like(scale, 1e-8), scale)
        codes = torch.clamp(_round_ste((self._groups(weight) - low) / safe), 0, LEVELS)
        values = codes * scale + low
        return values.view(weight.shape[0], -1)[:, : self.in_features]

    def packed(self, weight: torch.Tensor) -> Int2Weight:
        codes = self.codes(weight).view(weight.shape[0], -1).to(torch.uint8)
        return Int2Weight(pack_codes(codes), self.scale.detach().half(), self.low.detach().half(), self.in_features,
                          self.group_size)


def attach(linear: nn.Linear, init: Int2Weight) -> FakeInt2:
    """Fake-quantize linear.weight from now on, starting from init's ranges."""
    fake = FakeInt2(init).to(linear.weight.device)
    parametrize.register_parametrization(linear, "weight", fake)
    return fake


def pack(linear: nn.Linear) -> Int2Weight:
    """The packed form of a fake-quantized linear (attach() first)."""
    fake = linear.parametrizations.weight[0]
    return fake.packed(linear.parametrizations.weight.original)
