"""2-bit heads by a chosen method: round-to-nearest, or calibrated on the heads' real
inputs (quant/calibrated.py).

Calibration runs the full-precision heads on rows of the target's hidden states and the
sampled tokens (self-distillation shards: what the heads see when drafting) and keeps,
for every matrix, the second moment of what it is fed: the block reads u = [h; s e] (a
sequential head's block_i its own u_i), each hidden-layer projection D_i its head's
activations, each untied projection its head's state. An attention draft block's
matrices see what its unrolled pass feeds them: the context's entries and every depth of
the answer rows' chains (calibration_data.py).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch import nn

from vllm_mtpspec.heads import DraftModule, MTPHeads
from vllm_mtpspec.quant import Int2Linear, quantize_int2
from vllm_mtpspec.quant.calibrated import METHODS, InputStatistics, gptq_int2, refit_ranges, search_int2


def head_linears(heads: DraftModule) -> dict[str, nn.Module]:
    """Every matrix of the heads (full-precision or INT2) by its state-dict prefix ("block"
    or "blocks.0", "down.0", "proj.1", ...), in the order the heads registered them."""
    return {name: m for name, m in heads.named_modules() if isinstance(m, (nn.Linear, Int2Linear))}


@contextmanager
def recorded_inputs(heads: DraftModule) -> Iterator[dict[str, InputStatistics]]:
    """Each matrix's input statistics, by name, gathered from every pass of the heads
    while the context is open (any head kind: a draft block's passes are its own)."""
    if heads.is_quantized:
        raise ValueError("calibrate the full-precision heads, not quantized ones")
    linears = head_linears(heads)
    stats = {name: InputStatistics(linear.in_features) for name, linear in linears.items()}
    hooks = [linear.register_forward_pre_hook(lambda module, args, name=name: stats[name].add(args[0]))
             for name, linear in linears.items()]
    try:
        yield stats
    finally:
        for hook in hooks:
            hook.remove()


@torch.inference_mode()
def input_statistics(heads: MTPHeads, batches: Iterable[tuple[torch.Tensor, torch.Tensor | None]], *,
                     lm_head=None) -> dict[str, InputStatistics]:
    """batches of (hidden [n, d], token embeddings [n, d] or None) -> each matrix's
    input statistics (MLP heads)."""
    with recorded_inputs(heads) as stats:
        for hidden, embeds in batches:
            head_hidden = heads.hidden(hidden.float(), None if embeds is None else embeds.float())
            if heads.proj is not None:
                heads.project(head_hidden, lm_head)
    return stats


def quantize_heads(heads: DraftModule, *, method: str = "rtn", group_size: int = 64,
                   statistics: dict[str, InputStatistics] | None = None, calibration: str | None = None
                   ) -> DraftModule:
    """A 2-bit copy of the heads; `statistics` (input_statistics) are needed for every
    method but "rtn". `calibration` describes the calibration data in the heads config."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}: choose one of {METHODS}")
    if method != "rtn" and statistics is None:
        raise ValueError(f"method={method!r} needs calibration inputs (the heads' inputs from training shards)")
    linears = head_linears(heads)

    def int2(linear: nn.Linear):
        weight = linear.weight.detach().float()
        if method == "rtn":
            return quantize_int2(weight, group_size=group_size)
        name = next(n for n, lin in linears.items() if lin is linear)
        hessian = statistics[name].hessian
        if method == "search":
            return search_int2(weight, hessian, group_size=group_size)
        quantized = gptq_int2(weight, hessian, group_size=group_size)
        return refit_ranges(weight, hessian, quantized) if method == "gptq-refit" else quantized

    return heads.quantized(group_size=group_size, int2=int2, method=method, calibration=calibration)
