# mypy: disable-error-code="no-untyped-def"
"""Triton kernels of the fused RMS norms (``@triton.jit`` code only; launchers and autograd in ``norms.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from arctic_zorro_train.kernels._rounding import cast_rounded as _cast
from arctic_zorro_train.kernels._rounding import rounded as _rounded


@triton.jit
def _zero_centered_forward_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    rstd_ptr,
    num_rows,
    width,
    x_row_stride,
    eps,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WIDTH: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    columns = tl.arange(0, BLOCK_WIDTH)
    row_mask = rows < num_rows
    column_mask = columns < width
    mask = row_mask[:, None] & column_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + columns[None, :], mask=mask, other=0.0).to(COMPUTE_DTYPE)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / width + eps)
    scale = 1.0 + tl.load(weight_ptr + columns, mask=column_mask, other=0.0).to(COMPUTE_DTYPE)
    out = x * rstd[:, None] * scale[None, :]
    tl.store(out_ptr + rows[:, None] * width + columns[None, :], _cast(out, out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _zero_centered_backward_kernel(
    x_ptr,
    weight_ptr,
    rstd_ptr,
    grad_out_ptr,
    grad_x_ptr,
    grad_weight_partial_ptr,
    num_rows,
    width,
    x_row_stride,
    grad_out_row_stride,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WIDTH: tl.constexpr,
):
    program = tl.program_id(0)
    columns = tl.arange(0, BLOCK_WIDTH)
    column_mask = columns < width
    scale = 1.0 + tl.load(weight_ptr + columns, mask=column_mask, other=0.0).to(COMPUTE_DTYPE)
    grad_weight = tl.zeros([BLOCK_ROWS, BLOCK_WIDTH], dtype=COMPUTE_DTYPE)
    for block in range(program, tl.cdiv(num_rows, BLOCK_ROWS), tl.num_programs(0)):
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        row_mask = rows < num_rows
        mask = row_mask[:, None] & column_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + columns[None, :], mask=mask, other=0.0).to(COMPUTE_DTYPE)
        grad_out = tl.load(
            grad_out_ptr + rows[:, None] * grad_out_row_stride + columns[None, :], mask=mask, other=0.0
        ).to(COMPUTE_DTYPE)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        normed = x * rstd[:, None]
        grad_weight += grad_out * normed
        grad_normed = grad_out * scale[None, :]
        # d(x * rstd)/dx: rstd * (g - normed * mean(g * normed)) per row.
        projection = tl.sum(grad_normed * normed, axis=1) / width
        grad_x = rstd[:, None] * (grad_normed - normed * projection[:, None])
        tl.store(
            grad_x_ptr + rows[:, None] * width + columns[None, :],
            _cast(grad_x, grad_x_ptr.dtype.element_ty),
            mask=mask,
        )
    tl.store(grad_weight_partial_ptr + program * width + columns, tl.sum(grad_weight, axis=0), mask=column_mask)


@triton.jit
def _gated_forward_kernel(
    x_ptr,
    gate_ptr,
    weight_ptr,
    out_ptr,
    rstd_ptr,
    num_rows,
    width,
    x_row_stride,
    gate_row_stride,
    eps,
    PRODUCT_DTYPE: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WIDTH: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    columns = tl.arange(0, BLOCK_WIDTH)
    row_mask = rows < num_rows
    column_mask = columns < width
    mask = row_mask[:, None] & column_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + columns[None, :], mask=mask, other=0.0).to(COMPUTE_DTYPE)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / width + eps)
    # transformers: h.to(input_dtype), then weight * h in promote_types(weight, input), then * silu(gate.float()).
    normed = _rounded(x * rstd[:, None], x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + columns, mask=column_mask, other=0.0).to(COMPUTE_DTYPE)
    product = weight[None, :] * normed.to(COMPUTE_DTYPE)
    if ROUND_PRODUCT:
        # The fp32 product of two bf16 (or fp16) values is exact, so this is torch's rounded low-precision product.
        product = _rounded(product, PRODUCT_DTYPE)
    gate_pointers = gate_ptr + rows[:, None] * gate_row_stride + columns[None, :]
    gate = tl.load(gate_pointers, mask=mask, other=0.0).to(COMPUTE_DTYPE)
    silu = gate * tl.sigmoid(gate)
    out = product * silu.to(COMPUTE_DTYPE)
    tl.store(out_ptr + rows[:, None] * width + columns[None, :], _cast(out, out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _gated_backward_kernel(
    x_ptr,
    gate_ptr,
    weight_ptr,
    rstd_ptr,
    grad_out_ptr,
    grad_x_ptr,
    grad_gate_ptr,
    grad_weight_partial_ptr,
    num_rows,
    width,
    x_row_stride,
    gate_row_stride,
    grad_out_row_stride,
    PRODUCT_DTYPE: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WIDTH: tl.constexpr,
):
    program = tl.program_id(0)
    columns = tl.arange(0, BLOCK_WIDTH)
    column_mask = columns < width
    weight = tl.load(weight_ptr + columns, mask=column_mask, other=0.0).to(COMPUTE_DTYPE)
    grad_weight = tl.zeros([BLOCK_ROWS, BLOCK_WIDTH], dtype=COMPUTE_DTYPE)
    for block in range(program, tl.cdiv(num_rows, BLOCK_ROWS), tl.num_programs(0)):
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        row_mask = rows < num_rows
        mask = row_mask[:, None] & column_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + columns[None, :], mask=mask, other=0.0).to(COMPUTE_DTYPE)
        gate = tl.load(gate_ptr + rows[:, None] * gate_row_stride + columns[None, :], mask=mask, other=0.0).to(
            COMPUTE_DTYPE
        )
        grad_out = tl.load(
            grad_out_ptr + rows[:, None] * grad_out_row_stride + columns[None, :], mask=mask, other=0.0
        ).to(COMPUTE_DTYPE)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        # Recompute the forward's values, roundings included: autograd multiplies by what the forward produced.
        normed = x * rstd[:, None]
        normed_rounded = _rounded(normed, x_ptr.dtype.element_ty)
        product = weight[None, :] * normed_rounded
        if ROUND_PRODUCT:
            product = _rounded(product, PRODUCT_DTYPE)
        sigmoid = tl.sigmoid(gate)
        grad_product = grad_out * gate * sigmoid
        # silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
        grad_gate = grad_out * product * sigmoid * (1.0 + gate * (1.0 - sigmoid))
        grad_weight += grad_product * normed_rounded
        grad_normed = grad_product * weight[None, :]
        projection = tl.sum(grad_normed * normed, axis=1) / width
        grad_x = rstd[:, None] * (grad_normed - normed * projection[:, None])
        outputs = rows[:, None] * width + columns[None, :]
        tl.store(grad_x_ptr + outputs, _cast(grad_x, grad_x_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_gate_ptr + outputs, _cast(grad_gate, grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_weight_partial_ptr + program * width + columns, tl.sum(grad_weight, axis=0), mask=column_mask)
