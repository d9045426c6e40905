# mypy: disable-error-code="no-untyped-def"
"""Triton kernels of the fused SwiGLU ``silu(gate) * up`` (``@triton.jit`` code only; autograd in ``swiglu.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from arctic_zorro_train.kernels._rounding import cast_rounded, rounded


@triton.jit
def _swiglu_forward_kernel(gate_ptr, up_ptr, out_ptr, num_elements, COMPUTE_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(COMPUTE_DTYPE)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(COMPUTE_DTYPE)
    # transformers: act_fn(gate) comes out in the activations' dtype, then the product rounds again.
    activated = rounded(gate * tl.sigmoid(gate), gate_ptr.dtype.element_ty)
    tl.store(out_ptr + offsets, cast_rounded(activated * up, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    gate_ptr,
    up_ptr,
    grad_out_ptr,
    grad_gate_ptr,
    grad_up_ptr,
    num_elements,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(COMPUTE_DTYPE)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(COMPUTE_DTYPE)
    grad_out = tl.load(grad_out_ptr + offsets, mask=mask, other=0.0).to(COMPUTE_DTYPE)
    sigmoid = tl.sigmoid(gate)
    activated = rounded(gate * sigmoid, gate_ptr.dtype.element_ty)
    # The product's backward rounds grad_out * up to the activations' dtype before silu's backward (fp32 inside).
    grad_activated = rounded(grad_out * up, gate_ptr.dtype.element_ty)
    grad_gate = grad_activated * sigmoid * (1.0 + gate * (1.0 - sigmoid))
    tl.store(grad_gate_ptr + offsets, cast_rounded(grad_gate, grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_up_ptr + offsets, cast_rounded(grad_out * activated, grad_up_ptr.dtype.element_ty), mask=mask)
