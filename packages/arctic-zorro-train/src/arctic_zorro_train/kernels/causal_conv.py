# mypy: disable-error-code="no-untyped-def"
"""Depthwise causal conv over the packed token stream ``x [T, C]`` (the Gated DeltaNet conv), fused in Triton.

Works on the ``[T, C]`` layout directly (channels contiguous), so no transposed copies: ``F.conv1d`` needs
``[1, C, T]`` and its depthwise kernels run far slower than the bytes need on the H200 (the hybrid profile,
``benchmarks/lab/results/zorro_profile_hybrid.json``: 0.78 ms per forward over [8192, 8704]). Programs tile
``[BLOCK_T, BLOCK_C]``; each of the ``K`` taps is one load of the tile shifted by a few rows (the halo rows come
from L1/L2, so HBM sees each element about once).

The backward is one kernel: dx is the anti-causal conv of ``dout`` with the taps reversed, and each program also
sums ``dout * x_shifted`` (dweight) and ``dout`` (dbias) over its chunk of rows into ``[num_chunks, K, C]`` and
``[num_chunks, C]`` fp32 partial buffers (channels contiguous) that torch sums afterwards: deterministic, no atomics.

Timing against ``F.conv1d``: ``benchmarks/fused_kernels.py``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from arctic_zorro_train.kernels._launch_support import (
    accumulator_dtype,
    kernels_usable,
    new_buffer,
    triton_compute_dtype,
)

__all__ = ["CausalConvTiles", "causal_conv_usable", "causal_depthwise_conv"]

MAX_WIDTH = 8
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None

# Tests set this to fill every new output and partial buffer with NaN, so an element a kernel skips fails them.
poison_outputs = False


@dataclass(frozen=True)
class CausalConvTiles:
    """Tile sizes (powers of two) and warps of the two kernels; blocks shrink to the tensor when it is smaller.

    ``backward_tiles_per_program``: row tiles each backward program walks through, so the dweight / dbias partial
    buffers have ``ceil(T / (backward_block_t * backward_tiles_per_program))`` rows instead of one per tile.
    """

    # Defaults: the fastest of a development sweep on the H200 (bf16, T=8704, C=8192, K=4, Triton 3.6; not recorded,
    # benchmarks/fused_kernels.py re-times the backward's candidates). Tiles of more than 64 elements per thread
    # spill. The backward wants all of a tile's rows in each thread (1024 channels = 4 warps x 32 lanes x 8): its
    # column sums then need no cross-warp reduction. With Triton 3.7.1 that default spills 260 bytes per thread
    # (benchmarks/lab/results/sm90_compile_report.txt).

    forward_block_t: int = 16
    forward_block_c: int = 512
    forward_num_warps: int = 4
    backward_block_t: int = 4
    backward_block_c: int = 1024
    backward_num_warps: int = 4
    backward_tiles_per_program: int = 16

    def validate(self) -> None:
        for name in ("forward_block_t", "forward_block_c", "backward_block_t", "backward_block_c"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"CausalConvTiles.{name} must be a power of two, got {value}.")
        if self.backward_tiles_per_program < 1:
            raise ValueError(
                f"CausalConvTiles.backward_tiles_per_program must be >= 1, got {self.backward_tiles_per_program}."
            )


if _TRITON_AVAILABLE:
    import triton

    from arctic_zorro_train.kernels._conv_kernels import (
        _causal_conv_backward_kernel,
        _causal_conv_forward_kernel,
    )


def causal_conv_usable(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``tensor``: a CUDA tensor, or a CPU tensor under Triton's interpreter
    (``TRITON_INTERPRET=1``, which must be set before ``triton`` is first imported); both need ``triton``."""
    return _TRITON_AVAILABLE and kernels_usable(tensor)


def _check_arguments(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(
            f"x must be [T, C] (tokens, channels), got shape {tuple(x.shape)}; flatten the batch first, e.g. "
            "x.reshape(-1, x.shape[-1])."
        )
    channels = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(
            f"weight must be [C, K] = [{channels}, K], got shape {tuple(weight.shape)}; for an "
            "nn.Conv1d(groups=C) weight [C, 1, K] pass conv.weight.squeeze(1)."
        )
    width = weight.shape[1]
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"the conv width K (weight.shape[1]) must be 1 to {MAX_WIDTH}, got {width}.")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != channels):
        raise ValueError(f"bias must be [C] = [{channels}] or None, got shape {tuple(bias.shape)}.")
    named = {"x": x, "weight": weight} if bias is None else {"x": x, "weight": weight, "bias": bias}
    for name, tensor in named.items():
        if tensor.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(
                f"{name} must be float16, bfloat16, float32 or float64, got {tensor.dtype}; cast it, e.g. "
                f"{name}.to(torch.bfloat16)."
            )
        if tensor.device != x.device:
            raise ValueError(
                f"x, weight and bias must be on one device; x is on {x.device}, {name} on {tensor.device}. "
                f"Move it with {name}.to(x.device)."
            )
    if bias is not None and bias.dtype != weight.dtype:
        raise ValueError(
            f"bias and weight must share a dtype (as in nn.Conv1d), got bias {bias.dtype} and weight {weight.dtype}; "
            "cast the bias with bias.to(weight.dtype)."
        )
    if not causal_conv_usable(x):
        raise RuntimeError(
            f"causal_depthwise_conv needs a CUDA tensor (or TRITON_INTERPRET=1 for CPU tensors) and the `triton` "
            f"package; got a {x.device.type} tensor, triton installed: {_TRITON_AVAILABLE}. Check "
            "causal_conv_usable(x) first and fall back to F.conv1d."
        )


def _rows_with_unit_channel_stride(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels take any row stride but need channels contiguous."""
    return tensor if tensor.stride(1) == 1 else tensor.contiguous()


def _weights_by_tap(weight: torch.Tensor, x_dtype: torch.dtype) -> torch.Tensor:
    """``weight [C, K]`` -> ``[K, C]`` in the accumulator dtype: each tap's weights load contiguously."""
    accumulator = accumulator_dtype(x_dtype)
    return weight.t().to(accumulator).contiguous()


def _block(limit: int, extent: int) -> int:
    """The tile size along a dimension of ``extent`` elements: ``limit``, or less (down to 16) for a short one."""
    return min(limit, max(16, triton.next_power_of_2(extent)))


def _launch_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: CausalConvTiles
) -> torch.Tensor:
    num_tokens, num_channels = x.shape
    out = new_buffer((num_tokens, num_channels), x.dtype, x.device, poison=poison_outputs)
    if out.numel() == 0:
        return out
    block_t = _block(tiles.forward_block_t, num_tokens)
    block_c = _block(tiles.forward_block_c, num_channels)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_channels, block_c))
    weight = weight.contiguous()
    _causal_conv_forward_kernel[grid](
        x,
        weight,
        weight if bias is None else bias,
        out,
        num_tokens,
        num_channels,
        x.stride(0),
        WIDTH=weight.shape[1],
        HAS_BIAS=bias is not None,
        ACCUMULATOR_DTYPE=triton_compute_dtype(x.dtype),
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        num_warps=tiles.forward_num_warps,
    )
    return out


def _launch_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool, tiles: CausalConvTiles
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx ``[T, C]`` in x's dtype, dweight ``[C, K]`` and dbias ``[C]`` (None without a bias) in weight's dtype)."""
    num_tokens, num_channels = x.shape
    width = weight.shape[1]
    accumulator = accumulator_dtype(x.dtype)
    grad_x = new_buffer((num_tokens, num_channels), x.dtype, x.device, poison=poison_outputs)
    if grad_x.numel() == 0:
        grad_weight = torch.zeros_like(weight)
        return grad_x, grad_weight, torch.zeros(num_channels, dtype=weight.dtype, device=x.device) if has_bias else None
    # The tile doubles as the dweight accumulator (one row per tap), so it has at least K rows.
    block_t = max(_block(tiles.backward_block_t, num_tokens), triton.next_power_of_2(width))
    block_c = _block(tiles.backward_block_c, num_channels)
    tiles_per_program = min(tiles.backward_tiles_per_program, triton.cdiv(num_tokens, block_t))
    num_chunks = triton.cdiv(num_tokens, block_t * tiles_per_program)
    grad_weight_partial = new_buffer((num_chunks, width, num_channels), accumulator, x.device, poison=poison_outputs)
    grad_bias_partial = new_buffer(
        (num_chunks, num_channels) if has_bias else (1,), accumulator, x.device, poison=poison_outputs
    )
    grid = (num_chunks, triton.cdiv(num_channels, block_c))
    _causal_conv_backward_kernel[grid](
        x,
        grad_out,
        _weights_by_tap(weight, x.dtype),
        grad_x,
        grad_weight_partial,
        grad_bias_partial,
        num_tokens,
        num_channels,
        x.stride(0),
        grad_out.stride(0),
        WIDTH=width,
        HAS_BIAS=has_bias,
        ACCUMULATOR_DTYPE=triton_compute_dtype(x.dtype),
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        TILES_PER_PROGRAM=tiles_per_program,
        num_warps=tiles.backward_num_warps,
    )
    grad_weight = grad_weight_partial.sum(0).t().to(weight.dtype).contiguous()
    grad_bias = grad_bias_partial.sum(0).to(weight.dtype) if has_bias else None
    return grad_x, grad_weight, grad_bias


class CausalDepthwiseConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: CausalConvTiles
    ) -> torch.Tensor:
        x = _rows_with_unit_channel_stride(x)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.tiles = tiles
        return _launch_forward(x, weight, None if bias is None else bias.contiguous(), tiles)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_x, grad_weight, grad_bias = _launch_backward(
            _rows_with_unit_channel_stride(grad_out), x, weight, ctx.has_bias, ctx.tiles
        )
        return grad_x, grad_weight, grad_bias, None


def causal_depthwise_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, tiles: CausalConvTiles | None = None
) -> torch.Tensor:
    """Depthwise causal conv along the tokens: ``x [T, C]``, ``weight [C, K]`` (K from 1 to 8), ``bias [C]`` or
    None -> ``[T, C]`` in x's dtype, differentiable in all three.

    ``out[t, c] = bias[c] + sum_{j<K} weight[c, j] * x[t - (K - 1) + j, c]`` with ``x[t < 0] = 0``, i.e.
    ``F.conv1d(x.t()[None], weight[:, None, :], bias, padding=K - 1, groups=C)[0, :, :T].t()``, accumulated in fp32
    (fp64 for fp64 x) and rounded once. ``weight`` may be in another dtype than ``x`` (e.g. fp32 weights with bf16
    activations); dweight and dbias come back in weight's dtype, dx in x's. x may have any row stride; a tensor
    whose channels are not contiguous is copied first. Check ``causal_conv_usable(x)`` before calling.
    ``tiles`` overrides the tile sizes (``CausalConvTiles()`` otherwise).
    """
    _check_arguments(x, weight, bias)
    tiles = CausalConvTiles() if tiles is None else tiles
    tiles.validate()
    out: torch.Tensor = CausalDepthwiseConvFunction.apply(x, weight, bias, tiles)
    return out
