# mypy: disable-error-code="no-untyped-def"
"""Triton kernels of the depthwise causal conv (``@triton.jit`` code only; launchers and autograd in
``causal_conv.py``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_rows(source_ptr, stride_row, rows, channels, channel_mask, num_tokens):
    """``source[rows, channels]`` ``[BLOCK_T, BLOCK_C]``, zero for rows outside ``[0, num_tokens)``."""
    row_mask = (rows >= 0) & (rows < num_tokens)
    pointers = source_ptr + rows.to(tl.int64)[:, None] * stride_row + channels[None, :]
    return tl.load(pointers, mask=row_mask[:, None] & channel_mask[None, :], other=0.0)


@triton.jit
def _causal_conv_forward_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    num_tokens,
    num_channels,
    stride_x,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACCUMULATOR_DTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < num_channels
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=ACCUMULATOR_DTYPE)
    for tap in tl.static_range(WIDTH):
        # Tap j reads token t - (K - 1) + j (conv1d is a cross-correlation over the last K tokens).
        values = _load_rows(x_ptr, stride_x, rows - (WIDTH - 1) + tap, channels, channel_mask, num_tokens)
        tap_weight = tl.load(weight_ptr + channels * WIDTH + tap, mask=channel_mask, other=0.0)
        acc += values.to(ACCUMULATOR_DTYPE) * tap_weight.to(ACCUMULATOR_DTYPE)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channels, mask=channel_mask, other=0.0).to(ACCUMULATOR_DTYPE)[None, :]
    out_pointers = out_ptr + rows.to(tl.int64)[:, None] * num_channels + channels[None, :]
    out_mask = (rows < num_tokens)[:, None] & channel_mask[None, :]
    tl.store(out_pointers, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _causal_conv_backward_kernel(
    x_ptr,
    grad_out_ptr,
    taps_ptr,
    grad_x_ptr,
    grad_weight_partial_ptr,
    grad_bias_partial_ptr,
    num_tokens,
    num_channels,
    stride_x,
    stride_grad_out,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACCUMULATOR_DTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
):
    chunk = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < num_channels
    tile_rows = tl.arange(0, BLOCK_T)
    # Row j of this tile-shaped accumulator holds tap j's dweight sums (BLOCK_T >= K): the column sums broadcast
    # back into the tiles' own register layout, so no layout conversion per tap.
    grad_weight = tl.zeros([BLOCK_T, BLOCK_C], dtype=ACCUMULATOR_DTYPE)
    grad_bias = tl.zeros([BLOCK_C], dtype=ACCUMULATOR_DTYPE)
    # The taps' weights, loaded once into the same tile shape (row j = tap j) instead of once per row tile.
    tap_mask = (tile_rows < WIDTH)[:, None] & channel_mask[None, :]
    taps = tl.load(taps_ptr + tile_rows[:, None] * num_channels + channels[None, :], mask=tap_mask, other=0.0)
    for tile in range(TILES_PER_PROGRAM):
        rows = (chunk * TILES_PER_PROGRAM + tile) * BLOCK_T + tile_rows
        grad_out = _load_rows(grad_out_ptr, stride_grad_out, rows, channels, channel_mask, num_tokens)
        grad_out = grad_out.to(ACCUMULATOR_DTYPE)
        grad_x = tl.zeros([BLOCK_T, BLOCK_C], dtype=ACCUMULATOR_DTYPE)
        for tap in tl.static_range(WIDTH):
            tap_weight = tl.sum(tl.where(tile_rows[:, None] == tap, taps, 0.0), axis=0)
            # dx[s] gets weight[j] * dout[s + (K - 1) - j]; the last tap's rows are the tile itself.
            if tap == WIDTH - 1:
                shifted_grad_out = grad_out
            else:
                shifted_grad_out = _load_rows(
                    grad_out_ptr, stride_grad_out, rows + (WIDTH - 1 - tap), channels, channel_mask, num_tokens
                ).to(ACCUMULATOR_DTYPE)
            grad_x += shifted_grad_out * tap_weight[None, :]
            shifted_x = _load_rows(x_ptr, stride_x, rows - (WIDTH - 1) + tap, channels, channel_mask, num_tokens)
            tap_sum = tl.sum(grad_out * shifted_x.to(ACCUMULATOR_DTYPE), axis=0)
            grad_weight += tl.where(tile_rows[:, None] == tap, tap_sum[None, :], 0.0)
        if HAS_BIAS:
            grad_bias += tl.sum(grad_out, axis=0)
        grad_x_pointers = grad_x_ptr + rows.to(tl.int64)[:, None] * num_channels + channels[None, :]
        grad_x_mask = (rows < num_tokens)[:, None] & channel_mask[None, :]
        tl.store(grad_x_pointers, grad_x.to(grad_x_ptr.dtype.element_ty), mask=grad_x_mask)
    # Partials are [num_chunks, K, C] and [num_chunks, C]: channels contiguous, so the stores coalesce.
    grad_weight_rows = (chunk.to(tl.int64) * WIDTH + tile_rows)[:, None] * num_channels
    tl.store(grad_weight_partial_ptr + grad_weight_rows + channels[None, :], grad_weight, mask=tap_mask)
    if HAS_BIAS:
        tl.store(grad_bias_partial_ptr + chunk.to(tl.int64) * num_channels + channels, grad_bias, mask=channel_mask)
