# mypy: disable-error-code="no-untyped-def"
"""Round-to-nearest-even helpers the fused kernels share (``@triton.jit`` code only), exact in the interpreter."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded(value, dtype: tl.constexpr):
    """fp32 ``value`` rounded to nearest even in ``dtype``, returned as fp32.

    bf16 rounds on the bits: Triton's interpreter truncates fp32 -> bf16 casts, and this is exactly what the GPU's
    round-to-nearest-even conversion gives, so the same code is exact on both (NaNs pass through unchanged).
    """
    if dtype == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return tl.where(value != value, value, bits.to(tl.float32, bitcast=True))
    else:
        return value.to(dtype).to(value.dtype)


@triton.jit
def cast_rounded(value, dtype: tl.constexpr):
    """``value`` converted to ``dtype`` with round-to-nearest-even (see ``rounded``)."""
    if value.dtype == tl.float64:
        return value.to(dtype)
    else:
        return rounded(value, dtype).to(dtype)
