"""INT2 group-wise quantization of head weights."""
from vllm_mtpspec.quant.int2 import (
    Int2Weight,
    QuantError,
    dequantize_int2,
    int2_matmul_reference,
    quantize_int2,
)
from vllm_mtpspec.quant.linear import Int2Linear, empty_int2_linear, int2_matmul

__all__ = [
    "Int2Linear",
    "Int2Weight",
    "QuantError",
    "dequantize_int2",
    "empty_int2_linear",
    "int2_matmul",
    "int2_matmul_reference",
    "quantize_int2",
]
