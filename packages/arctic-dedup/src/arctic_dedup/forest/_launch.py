"""Launchers for the forest decode kernels: checks, allocation and grids (no data-dependent host reads)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from arctic_dedup._triton_support import interpreting
from arctic_dedup.errors import PlanError
from arctic_dedup.forest._replay import MAX_LAYOUTS_PER_PLAN, LaunchRecorder, call_key, replay
from arctic_dedup.forest.plan_types import ForestGrouping, ForestKernelConfig, ForestPlan, ForestWorkspace, PlanSizes

__all__ = [
    "Partials",
    "allocate_partials",
    "check_decode_inputs",
    "launch_attention",
    "launch_combine",
    "launch_forest_decode",
    "launch_plan",
    "replay_forest_decode",
]

# Partials of one combine chunk held in registers at once (floats): 64 per thread with 4 warps.
COMBINE_CHUNK_FLOATS = 8192
# Floats between the starts of partial buffers carved from one scratch tensor (256 bytes).
SCRATCH_ALIGNMENT = 64


@dataclass(frozen=True)
class Partials:
    """Scratch of one decode call: normalized fp32 partial outputs and their log-sum-exps (prefix rows first)."""

    out: torch.Tensor
    lse: torch.Tensor
    prefix_rows: int
    rows: int


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


@functools.cache
def _compute_capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def dependent_launches(config: ForestKernelConfig, device: torch.device) -> bool:
    """Programmatic dependent launch: the config asks for it and the device has it (CUDA, compute capability >=
    9.0, not the interpreter)."""
    if not (config.dependent_launches and device.type == "cuda" and not interpreting()):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _compute_capability(index) >= (9, 0)


def _pdl_options(enabled: bool, mode: int = 1) -> dict[str, Any]:
    """The ``PDL`` constexpr of a forest kernel (modes: ``_kernels`` docstring) and Triton's launch option."""
    return {"PDL": mode, "launch_pdl": True} if enabled else {"PDL": 0}


def _previous_power_of_two(value: int) -> int:
    return 1 << max(0, value.bit_length() - 1)


def check_decode_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: ForestPlan,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
) -> None:
    if query.dim() != 3:
        raise PlanError(f"query must be [T, H_q, D], got shape {tuple(query.shape)}.")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4:
            raise PlanError(
                f"{name} must be [num_blocks, block_size, H_kv, D] (any strides), got shape {tuple(cache.shape)}; "
                "permute a head-major cache with .permute(0, 2, 1, 3) (a view, no copy)."
            )
        if cache.device != query.device or cache.dtype != query.dtype:
            raise PlanError(
                f"{name} is {cache.dtype} on {cache.device} but query is {query.dtype} on {query.device}; the KV "
                "cache and the query must share dtype and device (quantized KV caches are not supported)."
            )
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    if tuple(value_cache.shape) != tuple(key_cache.shape):
        raise PlanError(
            f"value_cache shape {tuple(value_cache.shape)} differs from key_cache {tuple(key_cache.shape)}."
        )
    if block_size != plan.block_size or num_kv_heads != plan.num_kv_heads:
        raise PlanError(
            f"the plan was built for block_size={plan.block_size}, num_kv_heads={plan.num_kv_heads} but the cache "
            f"has block_size={block_size}, num_kv_heads={num_kv_heads}; rebuild the plan for this cache."
        )
    if query.shape[1] != num_kv_heads * plan.queries_per_kv or query.shape[2] != head_dim:
        raise PlanError(
            f"query [T, H_q, D] = {tuple(query.shape)} does not match H_q = H_kv * queries_per_kv = "
            f"{num_kv_heads} * {plan.queries_per_kv} and D = {head_dim} of the cache; rebuild the plan."
        )
    if plan.block_table.device != query.device:
        raise PlanError(f"the plan is on {plan.block_table.device} but query is on {query.device}.")
    if out is not None and (tuple(out.shape) != tuple(query.shape) or out.device != query.device):
        raise PlanError(f"out must have the query's shape {tuple(query.shape)} and device, got {tuple(out.shape)}.")
    if lse is not None and (
        tuple(lse.shape) != tuple(query.shape[:2]) or lse.dtype != torch.float32 or lse.device != query.device
    ):
        raise PlanError(f"lse must be float32 [T, H_q] = {tuple(query.shape[:2])}, got {lse.dtype} {tuple(lse.shape)}.")


def launch_plan(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    views: dict[str, torch.Tensor],
    sizes: PlanSizes,
    block_size: int,
    grouping: ForestGrouping | None,
    workspace: ForestWorkspace | None,
    config: ForestKernelConfig,
    grouping_gate: torch.Tensor | None = None,
    leave_ungrouped: bool = False,
) -> None:
    """Fill a plan's buffers on the device: three launches with grouping, one without; no host reads.

    ``grouping_gate`` (int32 ``[1]`` on the device, optional): where it holds 0 the grouping launches find no groups.
    ``leave_ungrouped``: ungrouped requests get no work items and ``views["standard_seq_lens"]`` their lengths.
    """
    from arctic_dedup.forest._kernels import (
        plan_count_kernel,
        plan_cut_kernel,
        plan_group_kernel,
        plan_paged_kernel,
    )

    num_requests = sizes.num_requests
    pdl = _pdl_options(dependent_launches(config, block_table.device))
    block_requests = _next_power_of_two(max(2, num_requests))
    finish_warps = 4 if block_requests <= 1024 else 8
    if grouping is None or workspace is None:
        plan_paged_kernel[(1,)](
            seq_lens,
            views["prefix_blocks"],
            views["group_leader"],
            views["tile_of"],
            views["slot_in_tile"],
            views["work_start"],
            views["split_tokens"],
            views["num_groups"],
            views["combine_ready"],
            views["standard_seq_lens"],
            views["combine_ready"].numel(),
            num_requests,
            block_size,
            sizes.suffix_target_items,
            config.split_granularity,
            BLOCK_R=block_requests,
            LEAVE_UNGROUPED=leave_ungrouped,
            num_warps=finish_warps,
            **pdl,
        )
        return
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    max_blocks = block_table.shape[1]
    block_entries = min(1024, _next_power_of_two(max(16, max_blocks)))
    scratch = torch.empty(7 * num_requests, dtype=torch.int32, device=block_table.device)
    cut_key, leader_of, rank_of, group_min, group_count, first_tile, first_member = scratch.view(7, num_requests)
    grid = (num_requests,)
    plan_count_kernel[grid](
        block_table,
        seq_lens,
        query_start_loc,
        workspace.counts,
        group_min,
        group_count,
        block_table.stride(0),
        max_blocks,
        workspace.num_cache_blocks,
        block_size,
        BLOCK_E=block_entries,
        **pdl,
    )
    plan_cut_kernel[grid](
        block_table,
        seq_lens,
        query_start_loc,
        workspace.counts,
        workspace.leader_slots,
        cut_key,
        block_table.stride(0),
        max_blocks,
        workspace.num_cache_blocks,
        block_size,
        num_requests,
        grouping.min_group_size,
        grouping.min_additional_prefix_blocks,
        grouping_gate,
        BLOCK_E=block_entries,
        HAS_GATE=grouping_gate is not None,
        **pdl,
    )
    plan_group_kernel[grid](
        block_table,
        seq_lens,
        query_start_loc,
        workspace.counts,
        workspace.leader_slots,
        workspace.ticket,
        cut_key,
        leader_of,
        rank_of,
        group_min,
        group_count,
        first_tile,
        first_member,
        views["prefix_blocks"],
        views["group_leader"],
        views["tile_of"],
        views["slot_in_tile"],
        views["tile_leader"],
        views["tile_prefix_blocks"],
        views["tile_member_start"],
        views["tile_member_count"],
        views["member_list"],
        views["work_start"],
        views["split_tokens"],
        views["num_groups"],
        views["combine_ready"],
        views["standard_seq_lens"],
        views["combine_ready"].numel(),
        block_table.stride(0),
        max_blocks,
        workspace.num_cache_blocks,
        block_size,
        num_requests,
        grouping.min_group_size,
        grouping.min_additional_prefix_blocks,
        math.ceil(grouping.min_non_singleton_fraction * num_requests),
        grouping.max_non_singleton_groups or -1,
        sizes.prefix_target_items,
        sizes.suffix_target_items,
        config.split_granularity,
        MEMBERS=sizes.members_per_tile,
        BLOCK_R=block_requests,
        BLOCK_E=block_entries,
        LEAVE_UNGROUPED=leave_ungrouped,
        num_warps=finish_warps,
        **pdl,
    )


def allocate_partials(plan: ForestPlan, head_dim: int, device: torch.device) -> Partials:
    """Partial rows for every prefix item (``prefix_block_m`` rows) and suffix item (``rows``) the plan can hold."""
    rows = max(2, _next_power_of_two(plan.max_query_len * plan.queries_per_kv))
    prefix_rows = plan.max_prefix_work * plan.num_kv_heads * plan.prefix_block_m
    suffix_rows = plan.max_suffix_work * plan.num_kv_heads * rows
    total = prefix_rows + suffix_rows
    if plan.scratch is None:
        part_out = torch.empty(total * head_dim, dtype=torch.float32, device=device)
        part_lse = torch.empty(total, dtype=torch.float32, device=device)
    else:
        # The log-sum-exps start on a 256-byte boundary, as a separate allocation would.
        lse_offset = -(-total * head_dim // SCRATCH_ALIGNMENT) * SCRATCH_ALIGNMENT
        buffer = plan.scratch.take(lse_offset + total, device)
        part_out, part_lse = buffer[: total * head_dim], buffer[lse_offset:]
    return Partials(out=part_out, lse=part_lse, prefix_rows=prefix_rows, rows=rows)


def launch_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: ForestPlan,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    partials: Partials,
    recorder: LaunchRecorder | None = None,
) -> None:
    """The attention launch: one launch of all items, or with ``split_passes`` (plans with groups) the prefix pass
    and then the suffix pass on the caller's stream. ``recorder`` (CUDA) launches and records them for replay."""
    from arctic_dedup.forest._kernels import forest_attention_kernel

    config = plan.config
    num_requests = plan.num_requests
    num_kv_heads = plan.num_kv_heads
    group_size = plan.queries_per_kv
    query_max = plan.max_query_len
    head_dim = query.shape[2]
    head_block = max(16, _next_power_of_two(head_dim))
    rows_per_request = query_max * group_size
    suffix_block_m = max(16, _next_power_of_two(rows_per_request))
    upcast = interpreting() or query.dtype == torch.float32
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    scale_log2 = float(scale) * 1.4426950408889634
    # 256-wide heads: 4 warps spill the prefix accumulator and 128-token tiles overflow shared memory (ptxas report).
    wide = head_block >= 256
    num_warps = max(config.num_warps, 8) if wide else config.num_warps
    prefix_block_n = min(config.prefix_block_n, 64) if wide else config.prefix_block_n
    suffix_block_n = min(config.suffix_block_n, 64) if wide else config.suffix_block_n
    num_stages = min(config.num_stages, 2) if wide else config.num_stages
    split = config.split_passes and plan.shares
    table = plan.block_table
    if table.stride(1) != 1:
        table = table.contiguous()
    k_strides = key_cache.stride()
    v_strides = value_cache.stride()
    q_strides = query.stride()
    prefix_rows = partials.prefix_rows
    owners_block = _next_power_of_two(max(2, 2 * num_requests))
    pdl = dependent_launches(config, query.device)
    early = config.early_combine
    # An early combine starts before this launch ends and reads the plan at once: every attention launch waits for
    # the plan before it lets the next launch be scheduled (PDL mode 2), so a combine program that runs implies a
    # finished plan. Split passes: the suffix pass reads nothing the prefix pass writes, so it is scheduled once every
    # prefix program has started (mode 2, then 3) and waits for the prefix pass only at its end.
    plain_mode = 2 if early else 1
    modes = {1: 2, 2: 3} if pdl and split else {0: plain_mode, 1: plain_mode, 2: plain_mode}
    programs = {0: plan.max_prefix_work + plan.max_suffix_work, 1: plan.max_prefix_work, 2: plan.max_suffix_work}
    for which in (1, 2) if split else (0,):
        grid = (programs[which] * num_kv_heads,)
        args = (
            query,
            key_cache,
            value_cache,
            table,
            plan.query_start_loc,
            plan.seq_lens,
            plan.prefix_blocks,
            plan.tile_of,
            plan.tile_leader,
            plan.tile_prefix_blocks,
            plan.tile_member_start,
            plan.tile_member_count,
            plan.member_list,
            plan.work_start,
            plan.split_tokens,
            out,
            lse,
            partials.out,
            partials.lse,
            partials.out[prefix_rows * head_dim :],
            partials.lse[prefix_rows:],
            plan.combine_ready,
            scale_log2,
            q_strides[0],
            q_strides[1],
            q_strides[2],
            k_strides[0],
            k_strides[1],
            k_strides[2],
            k_strides[3],
            v_strides[0],
            v_strides[1],
            v_strides[2],
            v_strides[3],
            table.stride(0),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            lse.stride(0),
            lse.stride(1),
            num_requests,
            head_dim,
            num_kv_heads,
        )
        options = dict(
            HAS_PREFIX=plan.shares,
            OWNERS_BLOCK=owners_block,
            G=group_size,
            QMAX=query_max,
            PAGE=plan.block_size,
            PREFIX_BLOCK_M=plan.prefix_block_m,
            SUFFIX_BLOCK_M=suffix_block_m,
            ROWS=partials.rows,
            PREFIX_BLOCK_N=prefix_block_n,
            SUFFIX_BLOCK_N=suffix_block_n,
            HEAD_DIM=head_block,
            UPCAST=upcast,
            DOT_PRECISION=precision,
            PASS=which,
            EARLY=early,
            num_warps=num_warps,
            num_stages=num_stages,
            **_pdl_options(pdl, modes[which]),
        )
        if recorder is not None:
            recorder.launch(forest_attention_kernel, grid, args, options)
        else:
            forest_attention_kernel[grid](*args, **options)


def launch_combine(
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: ForestPlan,
    partials: Partials,
    head_dim: int,
    recorder: LaunchRecorder | None = None,
) -> None:
    """Merge every request's partials (requests written directly by the attention launch are skipped)."""
    from arctic_dedup.forest._kernels import forest_combine_kernel

    head_block = max(16, _next_power_of_two(head_dim))
    config = plan.config
    early = config.early_combine
    dim_block = min(head_block, config.combine_dim_block or head_block)
    dim_chunks = head_block // dim_block
    rows = partials.rows
    chunk = max(1, min(config.combine_chunk_cap, _previous_power_of_two(COMBINE_CHUNK_FLOATS // (rows * dim_block))))
    grid = plan.num_requests * plan.num_kv_heads * dim_chunks
    args = (
        out,
        lse,
        plan.query_start_loc,
        plan.tile_of,
        plan.slot_in_tile,
        plan.work_start,
        partials.out,
        partials.lse,
        plan.combine_ready,
        partials.prefix_rows,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse.stride(0),
        lse.stride(1),
        plan.num_requests,
        head_dim,
        plan.num_kv_heads,
        dim_chunks,
    )
    options = dict(
        HAS_PREFIX=plan.shares,
        G=plan.queries_per_kv,
        QMAX=plan.max_query_len,
        PREFIX_BLOCK_M=plan.prefix_block_m,
        ROWS=rows,
        CHUNK=chunk,
        DIM_BLOCK=dim_block,
        EARLY=early,
        LOAD_CACHE=".cg" if early else "",
        num_warps=config.combine_num_warps,
        # An early combine lets the next launch be scheduled at once and waits for the attention launch at its end.
        **_pdl_options(dependent_launches(config, out.device), 3 if early else 1),
    )
    if recorder is not None:
        recorder.launch(forest_combine_kernel, (grid,), args, options)
    else:
        forest_combine_kernel[(grid,)](*args, **options)


def replay_forest_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: ForestPlan,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> bool:
    """Replay the launches an earlier call of this layout recorded on ``plan``; False when there are none (that call
    validated the same shapes, dtypes and devices against this plan, so a replay needs no checks)."""
    if not plan.launches:
        return False
    return replay(plan.launches, (query, key_cache, value_cache, out, lse), scale)


def launch_forest_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: ForestPlan,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Set up and launch the decode kernels through Triton; on CUDA also record them on ``plan`` so that the next
    calls of this layout (the model's other layers) only launch (``replay_forest_decode``)."""
    tensors = (query, key_cache, value_cache, out, lse)
    recorder = LaunchRecorder(tensors) if query.is_cuda and not interpreting() else None
    partials = allocate_partials(plan, query.shape[2], query.device)
    launch_attention(query, key_cache, value_cache, plan, scale, out, lse, partials, recorder)
    launch_combine(out, lse, plan, partials, query.shape[2], recorder)
    if recorder is not None:
        if len(plan.launches) >= MAX_LAYOUTS_PER_PLAN and not plan.persistent:
            plan.launches.clear()
        plan.launches[call_key(tensors, scale)] = tuple(recorder.launches)
