"""Drafting in INT8 on the CPU: the heads' matrices and the draft vocabulary's LM-head rows
held as INT8, one scale per output row, and multiplied by fbgemm's dynamic-INT8 GEMM,
which quantizes each call's input on the fly (one scale per call).

At small batches a draft step reads every head weight and every LM-head row for a handful
of rows of input: on a CPU it is bound by memory bandwidth, and INT8 reads a quarter of
fp32's bytes. Drafts change a little (a logit moves by about 1% of the largest); the
output does not, since the target alone verifies them.

The inputs are quantized to 7 bits (`reduce_range`): on CPUs without VNNI fbgemm adds
pairs of 8-bit products in 16-bit registers, which saturate at full range (measured:
5-9% error in a logit, against 1.3% at 7 bits).

fbgemm reaches PyTorch through its quantized tensors, which PyTorch deprecates but the
torch the CPU build pins still has; `int8_blocker()` says whether this one does.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from vllm_mtpspec.quant.linear import Int2Linear

_REDUCE_RANGE = True


def _packed(weight: torch.Tensor, bias: torch.Tensor | None):
    """fbgemm's prepacked form of weight [out, in] with one symmetric scale per row."""
    weight = weight.detach().float().contiguous()
    scales = (weight.abs().amax(1) / 127.0).clamp_min(1e-12).double()
    zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
    with warnings.catch_warnings():
        # The deprecation of quantized tensors: int8_blocker() checks that they still exist.
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(quantized, None if bias is None else bias.detach().float())


class Int8Linear(nn.Linear):
    """An nn.Linear that multiplies by an INT8 copy of its weight and holds nothing else of
    it: the floating-point weight it was made from is freed (the INT8 copy is a quarter of
    fp32's bytes). `weight` stays, on the meta device, so that asking a layer for its shape
    or dtype gets the answer it always did while reading its values fails loudly;
    `dense_weight` gives the values the INT8 codes stand for."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.in_features, out.out_features = linear.in_features, linear.out_features
        out._int8 = _packed(linear.weight, linear.bias)
        out.weight = nn.Parameter(torch.empty_like(linear.weight, device="meta"), requires_grad=False)
        out.bias = linear.bias
        return out

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in]: each INT8 code times its row's scale."""
        quantized, _ = torch.ops.quantized.linear_unpack(self._int8)
        return quantized.dequantize().to(dtype)

    @classmethod
    def from_int2(cls, int2: "Int2Linear") -> "Int8Linear":
        """The values an INT2 matrix's codes stand for, in INT8: INT2's PyTorch path
        dequantizes the whole matrix at every call, a CPU's INT8 product reads a byte per
        weight instead."""
        from vllm_mtpspec.quant.int2 import dequantize_int2

        linear = nn.Linear(int2.in_features, int2.out_features, bias=int2.bias is not None, device="meta")
        linear.weight = nn.Parameter(dequantize_int2(int2.qweight), requires_grad=False)
        if int2.bias is not None:
            linear.bias = nn.Parameter(int2.bias.detach().float(), requires_grad=False)
        return cls.from_linear(linear)

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> "Int8Linear":
        """x -> x @ weight.T (no bias): an LM head's rows."""
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
        return cls.from_linear(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():  # (a draft step's calls are many and small)
            flat = flat.float().contiguous()
        y = torch.ops.quantized.linear_dynamic(flat, self._int8, _REDUCE_RANGE).view(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)


def int8_linears(module: nn.Module) -> int:
    """Replaces every nn.Linear and Int2Linear inside module (in place) by its Int8Linear;
    returns how many."""
    from vllm_mtpspec.quant.linear import Int2Linear

    replaced = 0
    for name, child in list(module.named_modules()):
        if type(child) is nn.Linear or isinstance(child, Int2Linear):
            parent, _, attribute = name.rpartition(".")
            int8 = Int8Linear.from_int2(child) if isinstance(child, Int2Linear) else Int8Linear.from_linear(child)
            setattr(module.get_submodule(parent), attribute, int8)
            replaced += 1
    return replaced


def int8_blocker(device: torch.device | str) -> str | None:
    """Why the heads cannot draft in INT8 here (None when they can)."""
    if torch.device(device).type != "cpu":
        return f"its kernels (fbgemm's dynamic-INT8 GEMM) run on the CPU only, and this engine runs on {device}"
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return f"this torch ({torch.__version__}) was built without fbgemm"
    try:
        Int8Linear.from_weight(torch.ones(2, 4))(torch.ones(1, 4))
    except (RuntimeError, AttributeError, NotImplementedError) as error:
        return f"this torch ({torch.__version__}) lacks fbgemm's dynamic-INT8 linear ({error})"
    return None
