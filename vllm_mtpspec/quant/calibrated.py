"""INT2 quantizers that look at what a layer is fed, in the same packed format as
round-to-nearest (int2.py): codes 0..3, an fp16 scale and minimum per group of inputs.

A layer's output error for inputs x is (W - Q) x, so what matters is E[(W - Q) x x^T
(W - Q)^T]: with H = E[x x^T] (the calibration inputs' second moment, one [in, in] matrix
per layer) the error of one output row is (w - q) H (w - q)^T.

- "search": per row and group, the scale and minimum from a grid of clipped ranges that
  give the least error weighted by diag(H) (a weight that meets large inputs counts more),
  instead of the group's full min..max range;
- "gptq": GPTQ (Frantar et al., 2022): the columns are quantized in order and each
  column's error is folded into the columns not yet quantized, along H's inverse, so later
  codes compensate earlier ones; each group's range is chosen (by the search above, on the
  already compensated weights) when the sweep reaches it;
- "gptq-refit": GPTQ's codes, then every row's scales and minimums refitted to them by
  least squares on the output error with the whole H (the ranges GPTQ picked were chosen
  group by group, before the codes after them existed).

Given H = identity and no clipping, both reduce to round-to-nearest (tests check this).
"""
from __future__ import annotations

import torch

from vllm_mtpspec.quant.int2 import LEVELS, Int2Weight, check_group_size, pack_codes

METHODS = ("rtn", "search", "gptq", "gptq-refit")
# What a heads config may record: these, and "qat" (vllm_mtpspec_train/quantize_aware.py).
RECORDED_METHODS = METHODS + ("qat",)
# Fractions of a group's range cut from its bottom and its top.
DEFAULT_CLIP_GRID = (0.0, 0.04, 0.08, 0.12, 0.16, 0.2, 0.25, 0.3)


class InputStatistics:
    """Accumulates H = E[x x^T] over calibration inputs x [..., in] (float64)."""

    def __init__(self, in_features: int) -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float64).cpu()
        self.sum += x.T @ x
        self.count += x.shape[0]

    @property
    def hessian(self) -> torch.Tensor:
        if not self.count:
            raise ValueError("no calibration inputs were seen for this layer")
        return (self.sum / self.count).float()


def quantize_group(w: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., g] with scale, low [..., 1] already rounded to fp16 -> (codes, values)."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round((w - low) / safe).clamp_(0, LEVELS)
    return codes, codes * scale + low


def clipped_ranges(w: torch.Tensor, weights: torch.Tensor, grid=DEFAULT_CLIP_GRID) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, groups, g], weights [groups, g] (diag H) -> the fp16-rounded (scale, low)
    [out, groups, 1] of the clipped range with the least weighted error per row and group.
    A grid of (0,) is round-to-nearest's full range."""
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    span = hi - lo
    best_err = best_scale = best_low = None
    for cut_low in grid:
        for cut_high in grid:
            if cut_low + cut_high >= 1:
                continue
            low = (lo + cut_low * span).half().float()
            scale = ((span * (1 - cut_low - cut_high)) / LEVELS).half().float()
            _, values = quantize_group(w, scale, low)
            err = ((w - values) ** 2 * weights).sum(-1, keepdim=True)
            if best_err is None:
                best_err, best_scale, best_low = err, scale, low
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_scale = torch.where(better, scale, best_scale)
                best_low = torch.where(better, low, best_low)
    return best_scale, best_low


def _padded(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    out_features, in_features = weight.shape
    padded_in = -(-in_features // group_size) * group_size
    if padded_in == in_features:
        return weight.float().clone()
    # Padding repeats each row's last real weight: it adds no new value to the group's range.
    pad = weight[:, -1:].float().expand(out_features, padded_in - in_features)
    return torch.cat([weight.float(), pad], dim=1)


def _pack(codes: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor, in_features: int,
          group_size: int) -> Int2Weight:
    return Int2Weight(pack_codes(codes.to(torch.uint8)), scales.to(torch.float16), lows.to(torch.float16),
                      in_features, group_size)


def search_int2(weight: torch.Tensor, hessian: torch.Tensor | None, *, group_size: int = 64,
                grid=DEFAULT_CLIP_GRID) -> Int2Weight:
    """Round-to-nearest within the clipped range per row and group that errs least,
    weighted by diag(hessian) (all ones when None)."""
    check_group_size(group_size)
    out_features, in_features = weight.shape
    w = _padded(weight, group_size)
    diag = torch.ones(in_features) if hessian is None else hessian.diagonal().float().clamp(min=0)
    weights = torch.zeros(w.shape[1])
    weights[:in_features] = diag  # padding never counts
    groups = w.view(out_features, -1, group_size)
    scale, low = clipped_ranges(groups, weights.view(-1, group_size).to(w.device), grid)
    codes, _ = quantize_group(groups, scale, low)
    return _pack(codes.view(out_features, -1), scale.squeeze(-1), low.squeeze(-1), in_features, group_size)


def gptq_int2(weight: torch.Tensor, hessian: torch.Tensor, *, group_size: int = 64, damping: float = 0.01,
              grid=DEFAULT_CLIP_GRID, block_size: int = 128) -> Int2Weight:
    """GPTQ with group-wise asymmetric 2-bit codes. damping: added to H's diagonal as a
    fraction of its mean, so that H is invertible and directions never seen move little."""
    check_group_size(group_size)
    out_features, in_features = weight.shape
    w = _padded(weight, group_size)
    padded_in = w.shape[1]
    h = torch.zeros(padded_in, padded_in, dtype=torch.float64)
    h[:in_features, :in_features] = hessian.double()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0  # padding and inputs that were always zero: nothing to compensate with
    h += damping * h.diagonal().mean() * torch.eye(padded_in, dtype=torch.float64)
    # Upper Cholesky factor of H^-1: row i holds how column i's error spreads to later columns.
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    weights = h.diagonal().float()
    block_size = max(group_size, block_size // group_size * group_size)
    codes = torch.zeros_like(w)
    scales = torch.zeros(out_features, padded_in // group_size)
    lows = torch.zeros_like(scales)
    for start in range(0, padded_in, block_size):
        end = min(start + block_size, padded_in)
        block = w[:, start:end].clone()
        errors = torch.zeros_like(block)
        inv = h_inv[start:end, start:end]
        for i in range(end - start):
            column = start + i
            if column % group_size == 0:
                g = column // group_size
                group = block[:, i:i + group_size].unsqueeze(1)
                scale, low = clipped_ranges(group, weights[column:column + group_size].view(1, -1), grid)
                scales[:, g], lows[:, g] = scale.view(-1), low.view(-1)
            g = column // group_size
            q_codes, values = quantize_group(block[:, i:i + 1], scales[:, g:g + 1], lows[:, g:g + 1])
            codes[:, column] = q_codes.squeeze(1)
            error = (block[:, i] - values.squeeze(1)) / inv[i, i]
            block[:, i:] -= error[:, None] * inv[i, i:][None]
            errors[:, i] = error
        w[:, end:] -= errors @ h_inv[start:end, end:]
    return _pack(codes, scales, lows, in_features, group_size)


def refit_ranges(weight: torch.Tensor, hessian: torch.Tensor, quantized: Int2Weight, *, rows_per_chunk: int = 64,
                 ridge: float = 1e-6) -> Int2Weight:
    """The same codes with each row's scales and minimums that make its output error
    (w - q) H (w - q)^T least. q = A theta is linear in theta = (scales, minimums) of the
    row's groups (A holds each input's code under its group's scale and a 1 under its
    group's minimum), so theta solves (A^T H A) theta = A^T H w, one small system per row.
    A row where the fp16-rounded fit errs more than the old ranges keeps the old ones."""
    from vllm_mtpspec.quant.int2 import unpack_codes

    out_features, in_features = weight.shape
    group_size, padded_in = quantized.group_size, quantized.padded_in
    groups = padded_in // group_size
    h = torch.zeros(padded_in, padded_in, dtype=torch.float64)
    h[:in_features, :in_features] = hessian.double()
    w = torch.zeros(out_features, padded_in, dtype=torch.float64)
    w[:, :in_features] = weight.double()
    codes = unpack_codes(quantized.packed).double()                              # [out, padded_in]
    member = torch.zeros(padded_in, groups, dtype=torch.float64)
    member[torch.arange(padded_in), torch.arange(padded_in) // group_size] = 1.0
    scales, mins = quantized.scales.clone(), quantized.mins.clone()

    def error(values: torch.Tensor, rows: slice) -> torch.Tensor:
        d = w[rows] - values
        return ((d @ h) * d).sum(-1)

    for start in range(0, out_features, rows_per_chunk):
        rows = slice(start, min(start + rows_per_chunk, out_features))
        a = torch.cat([codes[rows, :, None] * member, member.expand(codes[rows].shape[0], -1, -1)], dim=-1)
        ha = h @ a                                                               # [r, in, 2G]
        gram = a.transpose(1, 2) @ ha
        gram += ridge * gram.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None] * torch.eye(2 * groups, dtype=gram.dtype)
        theta = torch.linalg.solve(gram, (ha.transpose(1, 2) @ w[rows, :, None]).squeeze(-1))
        new_scales, new_mins = theta[:, :groups].half(), theta[:, groups:].half()
        old_values = (codes[rows].view(-1, groups, group_size) * scales[rows].double()[..., None]
                      + mins[rows].double()[..., None]).view(-1, padded_in)
        new_values = (codes[rows].view(-1, groups, group_size) * new_scales.double()[..., None]
                      + new_mins.double()[..., None]).view(-1, padded_in)
        better = error(new_values, rows) < error(old_values, rows)
        scales[rows] = torch.where(better[:, None], new_scales, scales[rows])
        mins[rows] = torch.where(better[:, None], new_mins, mins[rows])
    return Int2Weight(quantized.packed.clone(), scales, mins, in_features, group_size)
