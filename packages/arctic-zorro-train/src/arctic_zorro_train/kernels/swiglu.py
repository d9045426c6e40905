"""Fused SwiGLU, ``silu(gate) * up`` of the MLPs: one Triton pass forward, one backward.

transformers runs it as two elementwise kernels forward (``silu``, then the product, each rounding to the
activations' dtype) and three backward, and saves ``gate``, ``silu(gate)`` and ``up``; this saves ``gate`` and
``up`` and recomputes the rest, with the same roundings (so bf16 outputs and gradients equal transformers').
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from torch.autograd.function import once_differentiable

from arctic_zorro_train.kernels._launch_support import new_buffer, triton_compute_dtype
from arctic_zorro_train.kernels._swiglu_kernels import _swiglu_backward_kernel, _swiglu_forward_kernel

__all__ = ["swiglu"]

# Tests set this to fill every new output with NaN, so an element a kernel forgets to write fails the comparison.
poison_outputs = False
_BLOCK = 2048
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = new_buffer(tuple(gate.shape), gate.dtype, gate.device, poison=poison_outputs)
        if gate.numel():
            _swiglu_forward_kernel[(triton.cdiv(gate.numel(), _BLOCK),)](
                gate, up, out, gate.numel(), COMPUTE_DTYPE=triton_compute_dtype(gate.dtype), BLOCK=_BLOCK
            )
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_gate = new_buffer(tuple(gate.shape), gate.dtype, gate.device, poison=poison_outputs)
        grad_up = new_buffer(tuple(up.shape), up.dtype, up.device, poison=poison_outputs)
        if gate.numel():
            _swiglu_backward_kernel[(triton.cdiv(gate.numel(), _BLOCK),)](
                gate,
                up,
                grad_out,
                grad_gate,
                grad_up,
                gate.numel(),
                COMPUTE_DTYPE=triton_compute_dtype(gate.dtype),
                BLOCK=_BLOCK,
            )
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate, up [...]`` of one shape, dtype and device; the result in that dtype.

    Equal to ``F.silu(gate) * up`` in torch, roundings included: ``silu(gate)`` is rounded to the dtype before the
    product, and the backward rounds ``grad * up`` before silu's derivative (computed in fp32, float64 for float64
    inputs), as autograd does. Non-contiguous inputs are copied first.

    Raises:
        ValueError: shapes, dtypes or devices differ, or a dtype other than fp16, bf16, fp32, fp64.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"swiglu needs gate and up of one shape, dtype and device; got {tuple(gate.shape)} {gate.dtype} "
            f"{gate.device} and {tuple(up.shape)} {up.dtype} {up.device}. Pass gate_proj(x) and up_proj(x)."
        )
    if gate.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"swiglu takes fp16, bf16, fp32 or fp64 tensors, got {gate.dtype}; cast them first.")
    out: torch.Tensor = _SwiGLU.apply(gate.contiguous(), up.contiguous())
    return out
