"""Block tables for the Triton kernels: per query block the key blocks to visit (and the transpose), split into
fully visible blocks (no element mask) and partial ones, with a sliding window folded in.

The packed length is padded to a multiple of both block sizes and padded keys are visible to nobody, so a block
listed as full never reaches past ``T`` and its loads need no bounds mask; a sliding window (logical positions)
drops tiles that lie entirely outside it and demotes tiles it cuts to partial; a work order (heaviest blocks first)
sets the grid. Built on the plan's device without host syncs, once per (plan, block sizes, window), by
``prepare_tree_attention`` (``metadata.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KernelTables", "build_kernel_tables"]


@dataclass(frozen=True)
class KernelTables:
    """``kv_*`` rows: query blocks (``[num_q_blocks]`` counts, ``[num_q_blocks, num_k_blocks]`` ascending indices);
    ``q_*`` rows: key blocks. ``q_block_order`` / ``k_block_order``: block ids sorted by descending work (int32)."""

    block_m: int
    block_n: int
    num_q_blocks: int
    num_k_blocks: int
    kv_full_num: torch.Tensor
    kv_full_indices: torch.Tensor
    kv_part_num: torch.Tensor
    kv_part_indices: torch.Tensor
    q_full_num: torch.Tensor
    q_full_indices: torch.Tensor
    q_part_num: torch.Tensor
    q_part_indices: torch.Tensor
    q_block_order: torch.Tensor
    k_block_order: torch.Tensor


def _compact(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean ``[rows, cols]`` -> (counts int32 ``[rows]``, selected columns first and ascending, int32)."""
    cols = selected.shape[1]
    column = torch.arange(cols, device=selected.device)
    order = torch.argsort(torch.where(selected, column, column + cols), dim=1, stable=True)
    return selected.sum(dim=1, dtype=torch.int32), order.to(torch.int32).contiguous()


def _pad_to(values: torch.Tensor, length: int) -> torch.Tensor:
    out = values.new_zeros(length)
    out[: values.shape[0]] = values
    return out


def _block_min_max(values: torch.Tensor, block: int, fill_min: int, fill_max: int) -> tuple[torch.Tensor, ...]:
    """Per block of ``values`` (padded with -1 past the end): min and max ignoring padding."""
    per_block = values.view(-1, block)
    padding = per_block < 0
    block_min = torch.where(padding, fill_min, per_block).min(dim=1).values
    block_max = torch.where(padding, fill_max, per_block).max(dim=1).values
    return block_min, block_max


def build_kernel_tables(
    kv_visible_until: torch.Tensor,
    position_ids: torch.Tensor,
    block_m: int,
    block_n: int,
    sliding_window: int | None = None,
) -> KernelTables:
    """Classify every (query block, key block) tile as skipped, partial or full; see the module docstring."""
    num_tokens = int(kv_visible_until.shape[0])
    device = kv_visible_until.device
    span = max(block_m, block_n)
    padded = max(span, -(-num_tokens // span) * span)
    num_q, num_k = padded // block_m, padded // block_n
    # Larger than any position, small enough that differences of two of them cannot overflow int64.
    big = 1 << 40
    token = torch.arange(padded, device=device)
    real = token < num_tokens
    until = torch.zeros(padded, dtype=torch.long, device=device)
    until[:num_tokens] = kv_visible_until.long()
    # Padded keys have until = 0, which no query is below: never visible, and their block is never full.
    key_until = until.view(num_k, block_n)
    until_min = key_until.min(dim=1).values
    until_max = key_until.max(dim=1).values
    key_first = torch.arange(num_k, device=device) * block_n
    key_last = key_first + block_n - 1
    query_first = torch.arange(num_q, device=device) * block_m
    query_last = query_first + block_m - 1
    any_visible = (key_first[None, :] <= query_last[:, None]) & (until_max[None, :] > query_first[:, None])
    # A query block reaching past T is never full: its padded rows must be masked.
    query_real = query_last < num_tokens
    all_visible = (
        (key_last[None, :] <= query_first[:, None]) & (until_min[None, :] > query_last[:, None]) & query_real[:, None]
    )
    if sliding_window is not None:
        positions = torch.where(real, _pad_to(position_ids.long(), padded), -1)
        q_pos_min, q_pos_max = _block_min_max(positions, block_m, big, -1)
        k_pos_min, k_pos_max = _block_min_max(positions, block_n, big, -1)
        # Some pair within the window / every pair within the window (conservative in the first, exact bound in
        # the second since it uses the extreme positions of both blocks).
        window_any = (q_pos_min[:, None] - k_pos_max[None, :]) < sliding_window
        window_all = (q_pos_max[:, None] - k_pos_min[None, :]) < sliding_window
        any_visible &= window_any
        all_visible &= window_all
    partial = any_visible & ~all_visible
    kv_full_num, kv_full_indices = _compact(all_visible)
    kv_part_num, kv_part_indices = _compact(partial)
    q_full_num, q_full_indices = _compact(all_visible.t())
    q_part_num, q_part_indices = _compact(partial.t())
    q_work = kv_full_num + kv_part_num
    k_work = q_full_num + q_part_num
    return KernelTables(
        block_m=block_m,
        block_n=block_n,
        num_q_blocks=num_q,
        num_k_blocks=num_k,
        kv_full_num=kv_full_num,
        kv_full_indices=kv_full_indices,
        kv_part_num=kv_part_num,
        kv_part_indices=kv_part_indices,
        q_full_num=q_full_num,
        q_full_indices=q_full_indices,
        q_part_num=q_part_num,
        q_part_indices=q_part_indices,
        q_block_order=torch.argsort(q_work, descending=True, stable=True).to(torch.int32),
        k_block_order=torch.argsort(k_work, descending=True, stable=True).to(torch.int32),
    )
