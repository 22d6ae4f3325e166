"""Triton, when installed: the kernels are optional and their callers fall back to
PyTorch without it. Set TRITON_INTERPRET=1 before the first import to run the kernels
on CPU tensors (how the tests check them)."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None


def triton_available() -> bool:
    return triton is not None
