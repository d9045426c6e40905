"""Launchers for the row kernels: checks, allocation and grids. Inputs are ``[rows, row_size]`` contiguous views."""

from __future__ import annotations

import torch

from arctic_dedup.plan.index_map import IndexMap

__all__ = ["launch_gather_rows", "launch_scatter_copies", "launch_segment_sum_rows"]


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def _column_block(row_size: int, max_block: int) -> int:
    return max(16, min(_next_power_of_two(row_size), max_block))


def launch_gather_rows(
    src: torch.Tensor,
    index_map: IndexMap,
    fill_value: float,
    *,
    elements_per_program: int = 2048,
    max_block_cols: int = 512,
    num_warps: int = 4,
) -> torch.Tensor:
    """``[num_sources, R]`` -> ``[num_outputs, R]`` with ``out[i] = src[gather_index[i]]`` or ``fill_value``."""
    from arctic_dedup.packing._kernels import gather_rows_kernel

    src = src.contiguous()
    num_rows = index_map.num_outputs
    row_size = src.shape[1]
    dst = torch.empty((num_rows, row_size), dtype=src.dtype, device=src.device)
    if num_rows == 0 or row_size == 0:
        return dst
    block_cols = _column_block(row_size, max_block_cols)
    block_rows = max(1, min(_next_power_of_two(num_rows), elements_per_program // block_cols))
    grid = (triton_cdiv(num_rows, block_rows), triton_cdiv(row_size, block_cols))
    gather_rows_kernel[grid](
        src,
        dst,
        index_map.gather_index,
        num_rows,
        row_size,
        torch.full((1,), fill_value, dtype=src.dtype, device=src.device),
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        num_warps=num_warps,
    )
    return dst


def launch_scatter_copies(
    src: torch.Tensor,
    index_map: IndexMap,
    fill_value: float,
    *,
    copies_per_step: int = 4,
    max_block_cols: int = 4096,
    num_warps: int = 4,
    streaming_stores: bool = True,
) -> torch.Tensor:
    """The same result as ``launch_gather_rows``, computed from the sources' side.

    Each program reads one source row (one column block of it) once and stores it to all of its copies,
    ``copies_per_step`` output rows per store instruction, so a row shared by many samples costs one read from
    memory; output rows without a source get ``fill_value`` from one ``index_fill_``. The defaults won the H200
    sweeps (benchmarks/lab/results/pack_unpack_full_sweep.json, then pack_unpack.json: 3.42-3.54 TB/s, 80.5-83.4% of
    the copy rate, against at most 3.09 TB/s for the gather).
    """
    from arctic_dedup.packing._kernels import scatter_copies_kernel

    src = src.contiguous()
    row_size = src.shape[1]
    dst = torch.empty((index_map.num_outputs, row_size), dtype=src.dtype, device=src.device)
    if index_map.num_outputs == 0 or row_size == 0:
        return dst
    if index_map.fill_index.numel() > 0:
        dst.index_fill_(0, index_map.fill_index, fill_value)
    if index_map.num_sources == 0:
        return dst
    block_cols = _column_block(row_size, max_block_cols)
    copies = max(1, min(copies_per_step, _next_power_of_two(max(1, index_map.max_copies))))
    grid = (index_map.num_sources, triton_cdiv(row_size, block_cols))
    scatter_copies_kernel[grid](
        src,
        dst,
        index_map.copies_offsets,
        index_map.copies_index,
        row_size,
        COPIES_PER_STEP=copies,
        BLOCK_COLS=block_cols,
        STREAMING_STORES=streaming_stores,
        num_warps=num_warps,
    )
    return dst


def launch_segment_sum_rows(
    src: torch.Tensor, index_map: IndexMap, *, max_block_cols: int = 1024, num_warps: int = 4
) -> torch.Tensor:
    """``[num_outputs, R]`` -> ``[num_sources, R]``: each source row gets the sum of the output rows copying it."""
    import triton.language as tl

    from arctic_dedup.packing._kernels import segment_sum_rows_kernel

    src = src.contiguous()
    row_size = src.shape[1]
    dst = torch.empty((index_map.num_sources, row_size), dtype=src.dtype, device=src.device)
    if index_map.num_sources == 0 or row_size == 0:
        return dst
    block_cols = _column_block(row_size, max_block_cols)
    grid = (index_map.num_sources, triton_cdiv(row_size, block_cols))
    segment_sum_rows_kernel[grid](
        src,
        dst,
        index_map.copies_offsets,
        index_map.copies_index,
        row_size,
        ACCUMULATOR_DTYPE=tl.float64 if src.dtype == torch.float64 else tl.float32,
        BLOCK_COLS=block_cols,
        num_warps=num_warps,
    )
    return dst


def triton_cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)
