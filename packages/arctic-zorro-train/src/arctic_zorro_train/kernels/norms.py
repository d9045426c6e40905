# mypy: disable-error-code="no-untyped-def"
"""Fused RMS norms of Qwen3.5 / Qwen3-Next: one Triton pass forward, one backward, instead of ~8 fp32 torch passes.

``zero_centered_rms_norm`` is ``Qwen3_5RMSNorm`` (scale ``1 + weight``); ``gated_rms_norm`` is
``Qwen3_5RMSNormGated`` (norm, ``weight *`` in the promoted dtype, ``* silu(gate)``). Both run over rows ``[R, D]``:
short rows share a program (``BLOCK_ROWS`` rows of ``BLOCK_WIDTH = next_power_of_2(D)`` columns), a row up to
``MAX_WIDTH`` wide fits one program. The backward saves only the inputs and the per-row ``rstd`` (fp32) and
recomputes the rest; each backward program loops over row blocks and writes its share of the weight gradient to
one row of an fp32 ``[programs, D]`` buffer that torch sums (deterministic, no atomics).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from arctic_zorro_train.kernels._launch_support import (
    accumulator_dtype,
    kernels_usable,
    new_buffer,
    triton_compute_dtype,
)
from arctic_zorro_train.kernels._norm_kernels import (
    _gated_backward_kernel,
    _gated_forward_kernel,
    _zero_centered_backward_kernel,
    _zero_centered_forward_kernel,
)

__all__ = ["MAX_WIDTH", "fused_norms_usable", "gated_rms_norm", "zero_centered_rms_norm"]

# The widest row one program holds in registers (fp32 ``x``, gradient and weight at 16 warps).
MAX_WIDTH = 32768
# Tests set this to fill every new output with NaN, so an element a kernel forgets to write fails the comparison.
poison_outputs = False

# Elements per program: short rows are grouped until a program holds about this many (D=128: 32 rows).
_ELEMENTS_PER_PROGRAM = 4096
# Backward warps per multiprocessor: each program loops over row blocks, so this also sets the weight-gradient
# buffer's rows. 16 was the best of a development sweep on the H200 for the gated norm over [278528, 128] (not
# recorded; benchmarks/fused_kernels.py times the result).
_BACKWARD_WARPS_PER_SM = 16
# Under the interpreter programs run one after another; a few keep the loop and the partial sums exercised.
_INTERPRETED_BACKWARD_PROGRAMS = 3
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TRITON_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


@dataclass(frozen=True)
class _RowTiling:
    """How rows ``[R, D]`` map onto programs: ``block_rows`` rows of ``block_width`` columns each."""

    block_rows: int
    block_width: int
    num_warps: int

    def row_blocks(self, num_rows: int) -> int:
        return triton.cdiv(num_rows, self.block_rows)


def _row_tiling(num_rows: int, width: int) -> _RowTiling:
    block_width = triton.next_power_of_2(width)
    block_rows = max(1, min(_ELEMENTS_PER_PROGRAM // block_width, triton.next_power_of_2(max(num_rows, 1))))
    # About 8-32 fp32 values of each tensor per thread.
    num_warps = min(16, max(4, block_rows * block_width // 512))
    return _RowTiling(block_rows=block_rows, block_width=block_width, num_warps=num_warps)


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _backward_programs(device: torch.device, tiling: _RowTiling, num_rows: int) -> int:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        programs = _multiprocessor_count(index) * max(1, _BACKWARD_WARPS_PER_SM // tiling.num_warps)
    else:
        programs = _INTERPRETED_BACKWARD_PROGRAMS
    return max(1, min(programs, tiling.row_blocks(num_rows)))


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _check_inputs(name: str, x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None = None) -> None:
    supported = ", ".join(str(dtype) for dtype in _SUPPORTED_DTYPES)
    named = {"x": x, "weight": weight} if gate is None else {"x": x, "gate": gate, "weight": weight}
    for label, tensor in named.items():
        if tensor.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name}: {label} must be one of {supported}; got {tensor.dtype}. Cast it first.")
        if tensor.device != x.device:
            raise ValueError(
                f"{name}: {label} is on {tensor.device} but x is on {x.device}; move every input to one device."
            )
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"{name}: expected x [..., D] and weight [D]; got x {tuple(x.shape)} and weight {tuple(weight.shape)}. "
            "Pass the norm's own weight (hidden size D) and inputs whose last dimension is D."
        )
    width = weight.shape[0]
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(
            f"{name}: the fused kernel takes rows of 1 to {MAX_WIDTH} elements; got D = {width}. "
            "Use the transformers module for wider rows."
        )
    if gate is not None and gate.shape != x.shape:
        raise ValueError(
            f"{name}: gate must have x's shape {tuple(x.shape)}; got {tuple(gate.shape)}. Pass the gate projection "
            "for the same tokens and heads as x."
        )
    if gate is not None and weight.dtype == torch.float64 and x.dtype != torch.float64:
        raise ValueError(
            f"{name}: a float64 weight needs float64 x; got x {x.dtype}. Pass weight.to(x.dtype) or weight.float()."
        )


class _ZeroCenteredRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        num_rows, width = x.shape
        tiling = _row_tiling(num_rows, width)
        out = new_buffer((num_rows, width), x.dtype, x.device, poison=poison_outputs)
        rstd = new_buffer((num_rows,), accumulator_dtype(x.dtype), x.device, poison=poison_outputs)
        if num_rows > 0:
            _zero_centered_forward_kernel[(tiling.row_blocks(num_rows),)](
                x,
                weight,
                out,
                rstd,
                num_rows,
                width,
                x.stride(0),
                eps,
                COMPUTE_DTYPE=triton_compute_dtype(x.dtype),
                BLOCK_ROWS=tiling.block_rows,
                BLOCK_WIDTH=tiling.block_width,
                num_warps=tiling.num_warps,
            )
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        grad_out = _last_dim_contiguous(grad_out)
        num_rows, width = x.shape
        tiling = _row_tiling(num_rows, width)
        programs = _backward_programs(x.device, tiling, num_rows)
        grad_x = new_buffer((num_rows, width), x.dtype, x.device, poison=poison_outputs)
        grad_weight_partial = new_buffer((programs, width), accumulator_dtype(x.dtype), x.device, poison=poison_outputs)
        if num_rows > 0:
            _zero_centered_backward_kernel[(programs,)](
                x,
                weight,
                rstd,
                grad_out,
                grad_x,
                grad_weight_partial,
                num_rows,
                width,
                x.stride(0),
                grad_out.stride(0),
                COMPUTE_DTYPE=triton_compute_dtype(x.dtype),
                BLOCK_ROWS=tiling.block_rows,
                BLOCK_WIDTH=tiling.block_width,
                num_warps=tiling.num_warps,
            )
        else:
            grad_weight_partial.zero_()
        return grad_x, grad_weight_partial.sum(0).to(weight.dtype), None


def _product_constants(weight_dtype: torch.dtype, x_dtype: torch.dtype) -> dict[str, Any]:
    """The gated product's dtype (torch's ``promote_types(weight, x)``) and whether it rounds below fp32."""
    product_dtype = torch.promote_types(weight_dtype, x_dtype)
    return {"PRODUCT_DTYPE": _TRITON_DTYPES[product_dtype], "ROUND_PRODUCT": product_dtype.itemsize < 4}


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        num_rows, width = x.shape
        tiling = _row_tiling(num_rows, width)
        out = new_buffer((num_rows, width), x.dtype, x.device, poison=poison_outputs)
        rstd = new_buffer((num_rows,), accumulator_dtype(x.dtype), x.device, poison=poison_outputs)
        if num_rows > 0:
            _gated_forward_kernel[(tiling.row_blocks(num_rows),)](
                x,
                gate,
                weight,
                out,
                rstd,
                num_rows,
                width,
                x.stride(0),
                gate.stride(0),
                eps,
                COMPUTE_DTYPE=triton_compute_dtype(x.dtype),
                **_product_constants(weight.dtype, x.dtype),
                BLOCK_ROWS=tiling.block_rows,
                BLOCK_WIDTH=tiling.block_width,
                num_warps=tiling.num_warps,
            )
        ctx.save_for_backward(x, gate, weight, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        x, gate, weight, rstd = ctx.saved_tensors
        grad_out = _last_dim_contiguous(grad_out)
        num_rows, width = x.shape
        tiling = _row_tiling(num_rows, width)
        programs = _backward_programs(x.device, tiling, num_rows)
        grad_x = new_buffer((num_rows, width), x.dtype, x.device, poison=poison_outputs)
        grad_gate = new_buffer((num_rows, width), gate.dtype, x.device, poison=poison_outputs)
        grad_weight_partial = new_buffer((programs, width), accumulator_dtype(x.dtype), x.device, poison=poison_outputs)
        if num_rows > 0:
            _gated_backward_kernel[(programs,)](
                x,
                gate,
                weight,
                rstd,
                grad_out,
                grad_x,
                grad_gate,
                grad_weight_partial,
                num_rows,
                width,
                x.stride(0),
                gate.stride(0),
                grad_out.stride(0),
                **_product_constants(weight.dtype, x.dtype),
                COMPUTE_DTYPE=triton_compute_dtype(x.dtype),
                BLOCK_ROWS=tiling.block_rows,
                BLOCK_WIDTH=tiling.block_width,
                num_warps=tiling.num_warps,
            )
        else:
            grad_weight_partial.zero_()
        return grad_x, grad_gate, grad_weight_partial.sum(0).to(weight.dtype), None


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` as ``[R, D]`` rows with unit stride along D (a view when the layout allows one)."""
    return _last_dim_contiguous(tensor.reshape(-1, tensor.shape[-1]))


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen3_5RMSNorm`` / ``Qwen3NextRMSNorm``: ``(x * rsqrt(mean(x^2) + eps) * (1 + weight)).type_as(x)``.

    Args:
        x: ``[..., D]`` in fp16, bf16, fp32 or fp64; rows may be strided (a last dim that is not contiguous is
            copied first).
        weight: ``[D]``, the zero-centered scale (the module's ``weight``), any of those dtypes.
        eps: added to the mean square.

    Returns:
        ``[..., D]`` in ``x``'s dtype, equal to the module's output up to the order of the fp32 row sum. The backward
        gives ``x``'s gradient in ``x``'s dtype and ``weight``'s in ``weight``'s dtype, both computed in fp32
        (float64 for float64 x, see ``accumulator_dtype``; the weight's summed over rows deterministically).

    Raises:
        ValueError: a dtype outside those four, inputs on different devices, ``weight`` not ``[D]``, or ``D`` above
            ``MAX_WIDTH``.
    """
    _check_inputs("zero_centered_rms_norm", x, weight)
    out = _ZeroCenteredRMSNorm.apply(_rows(x), _last_dim_contiguous(weight), float(eps))
    return out.view(x.shape)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen3_5RMSNormGated``, casts included.

    With ``dt = x.dtype``: ``normed = (x.float() * rsqrt(mean(x^2) + eps)).to(dt)``; ``product = weight * normed``
    in ``promote_types(weight.dtype, dt)`` (rounded to bf16 when both are bf16, as torch does); the result is
    ``(product * silu(gate.float())).to(dt)``.

    Args:
        x: ``[..., D]`` in fp16, bf16, fp32 or fp64; rows may be strided.
        gate: ``[..., D]``, ``x``'s shape, any of those dtypes.
        weight: ``[D]``; float64 only with float64 ``x``.
        eps: added to the mean square.

    Returns:
        ``[..., D]`` in ``x``'s dtype. The backward gives the gradients autograd gives for the transformers code
        (casts act as identity), computed in fp32 (float64 for float64 x), each in its input's dtype.

    Raises:
        ValueError: a dtype outside those four, a float64 weight with lower-precision ``x``, inputs on different
            devices, ``gate`` not shaped like ``x``, ``weight`` not ``[D]``, or ``D`` above ``MAX_WIDTH``.
    """
    _check_inputs("gated_rms_norm", x, weight, gate)
    out = _GatedRMSNorm.apply(_rows(x), _rows(gate), _last_dim_contiguous(weight), float(eps))
    return out.view(x.shape)


def fused_norms_usable(tensor: torch.Tensor) -> bool:
    """Whether the fused norms can run on ``tensor``: a CUDA tensor, or a CPU one under ``TRITON_INTERPRET=1``."""
    return kernels_usable(tensor)
