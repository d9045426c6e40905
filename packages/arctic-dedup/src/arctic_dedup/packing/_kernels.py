# mypy: disable-error-code="no-untyped-def"
"""Triton kernels for row gathers and deterministic segmented row sums (``@triton.jit`` code only)."""

import triton
import triton.language as tl


@triton.jit
def gather_rows_kernel(
    src_ptr,
    dst_ptr,
    index_ptr,
    num_rows,
    row_size,
    fill_ptr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    row_ok = rows < num_rows
    col_ok = cols < row_size
    source = tl.load(index_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    has_source = source >= 0
    load_mask = (row_ok & has_source)[:, None] & col_ok[None, :]
    values = tl.load(src_ptr + source[:, None] * row_size + cols[None, :], mask=load_mask, other=0)
    fill = tl.load(fill_ptr)
    values = tl.where(has_source[:, None], values, fill)
    tl.store(dst_ptr + rows[:, None] * row_size + cols[None, :], values, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def segment_sum_rows_kernel(
    src_ptr,
    dst_ptr,
    offsets_ptr,
    index_ptr,
    row_size,
    ACCUMULATOR_DTYPE: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < row_size
    begin = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    total = tl.zeros([BLOCK_COLS], dtype=ACCUMULATOR_DTYPE)
    for position in range(begin, end):
        source = tl.load(index_ptr + position).to(tl.int64)
        total += tl.load(src_ptr + source * row_size + cols, mask=col_ok, other=0).to(total.dtype)
    tl.store(dst_ptr + row * row_size + cols, total.to(dst_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def scatter_copies_kernel(
    src_ptr,
    dst_ptr,
    offsets_ptr,
    index_ptr,
    row_size,
    COPIES_PER_STEP: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    STREAMING_STORES: tl.constexpr,
):
    """One source row per program (and column block): read it once, store it to every output row that copies it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < row_size
    begin = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    values = tl.load(src_ptr + row * row_size + cols, mask=col_ok, other=0)
    tile = tl.broadcast_to(values[None, :], (COPIES_PER_STEP, BLOCK_COLS))
    for first in range(begin, end, COPIES_PER_STEP):
        positions = first + tl.arange(0, COPIES_PER_STEP)
        position_ok = positions < end
        targets = tl.load(index_ptr + positions, mask=position_ok, other=0).to(tl.int64)
        pointers = dst_ptr + targets[:, None] * row_size + cols[None, :]
        mask = position_ok[:, None] & col_ok[None, :]
        if STREAMING_STORES:
            tl.store(pointers, tile, mask=mask, cache_modifier=".cs")
        else:
            tl.store(pointers, tile, mask=mask)
