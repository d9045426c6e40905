"""Launchers for the forest decode kernels: checks, allocation and grids (no data-dependent host reads)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from arctic_dedup._triton_support import interpreting
from arctic_dedup.errors import PlanError

if TYPE_CHECKING:
    from arctic_dedup.forest.plan import ForestGrouping, ForestKernelConfig, ForestPlan, ForestWorkspace, _Sizes

__all__ = [
    "DecodeKnobs",
    "LaunchTimeline",
    "Partials",
    "allocate_partials",
    "check_decode_inputs",
    "launch_attention",
    "launch_combine",
    "launch_forest_decode",
    "launch_plan",
]

# Partials of one combine chunk held in registers at once (floats): 64 per thread with 4 warps.
COMBINE_CHUNK_FLOATS = 8192


@dataclass
class LaunchTimeline:
    """Per-program timestamps of forest decode's launches, for diagnosis (``benchmarks/fca_timeline.py``).

    Each launch made with these knobs writes one int64 row of 8 per program into ``launches[name]`` (``"one launch"``,
    ``"prefix pass"``, ``"suffix pass"``, ``"combine"``): entry, start (after waiting for the launch before it),
    end, the multiprocessor it ran on, and a tag (the work item, -1 for a program without one; the request for the
    combine), times from the device's nanosecond clock. CUDA only: the Triton interpreter has no clock to read.
    Buffers are made on first use and reused while the grid stays the same, so a captured graph rewrites them at
    every replay.
    """

    launches: dict[str, torch.Tensor] = field(default_factory=dict)

    def rows(self, name: str, programs: int, device: torch.device) -> torch.Tensor:
        if device.type != "cuda" or interpreting():
            raise PlanError("a LaunchTimeline reads the GPU's clock: use it on a CUDA device, not the interpreter.")
        buffer = self.launches.get(name)
        # One row per program of this launch exactly: no rows left over from a larger launch of another plan.
        if buffer is None or buffer.shape[0] != programs or buffer.device != device:
            buffer = torch.full((programs, 8), -1, dtype=torch.int64, device=device)
            self.launches[name] = buffer
        return buffer


@dataclass(frozen=True)
class DecodeKnobs:
    """Internal launch variants of forest decode, compared by ``benchmarks/fca_decode.py --diagnose`` (not public API).

    The defaults are the plan config's launches; every variant computes the same result.

    Attributes:
        split_passes: prefix items and suffix items in two launches, each with its own launch options.
        prefix_num_warps, prefix_num_stages: launch options of the prefix launch when split (``None``: the config's).
        max_registers: registers per thread the attention launches may use (Triton's ``maxnreg``; ``None``: what
            ptxas picks), e.g. 128 so that two 8-warp programs fit a multiprocessor; ignored by the interpreter.
        prefix_max_registers: the same for the prefix launch when split (``None``: ``max_registers``).
        side_stream: with ``split_passes`` on CUDA, the prefix launch runs on a side stream, concurrently with the
            suffix launch (two branches of a CUDA graph when captured); both join before the combine.
        combine_dim_block: head dims per combine program, overriding ``ForestKernelConfig.combine_dim_block``
            (``None``: the config's); a power of two >= 16.
        combine_chunk_cap: most partials a combine program loads at once, overriding the config's (``None``).
        combine_num_warps: warps per combine program (1, 2, 4 or 8), overriding the config's (``None``): fewer warps
            per program fit more programs on an SM, so a latency-bound combine takes fewer waves
            (sm90_compile_report.py gives the registers).
        suffix_programs_per_sm: the suffix pass of a split launch runs on a fixed grid of about this many programs
            per multiprocessor (rounded to whole kv-head groups), each looping over its slot's suffix items, instead
            of one program per item (``None``); e.g. 2 beside one prefix program per SM.
        interleave_items: a one-launch plan with groups alternates prefix and suffix items over the programs (even
            programs prefix items, odd ones suffix items) instead of all prefix items first.
        timeline: per-program timestamps of every launch (``LaunchTimeline``; CUDA only), ``None`` for none.
    """

    split_passes: bool = False
    prefix_num_warps: int | None = None
    prefix_num_stages: int | None = None
    max_registers: int | None = None
    prefix_max_registers: int | None = None
    side_stream: bool = False
    combine_dim_block: int | None = None
    combine_chunk_cap: int | None = None
    combine_num_warps: int | None = None
    suffix_programs_per_sm: int | None = None
    interleave_items: bool = False
    timeline: LaunchTimeline | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        from arctic_dedup.forest.plan import check_combine_shape

        check_combine_shape(self.combine_dim_block, self.combine_num_warps, self.combine_chunk_cap)
        for name in ("max_registers", "prefix_max_registers"):
            registers = getattr(self, name)
            if registers is not None and not 24 <= registers <= 255:
                raise ValueError(f"{name} must be in [24, 255] or None, got {registers}")
        if self.suffix_programs_per_sm is not None and self.suffix_programs_per_sm < 1:
            raise ValueError(f"suffix_programs_per_sm must be >= 1 or None, got {self.suffix_programs_per_sm}")


DEFAULT_KNOBS = DecodeKnobs()


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
    sizes: _Sizes,
    block_size: int,
    grouping: ForestGrouping | None,
    workspace: ForestWorkspace | None,
    config: ForestKernelConfig,
) -> None:
    """Fill a plan's buffers on the device: three launches with grouping, one without; no host reads."""
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
            views["combine_ready"].numel(),
            num_requests,
            block_size,
            sizes.suffix_target_items,
            config.split_granularity,
            BLOCK_R=block_requests,
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
        grouping.min_prefix_blocks,
        BLOCK_E=block_entries,
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
        views["combine_ready"].numel(),
        block_table.stride(0),
        max_blocks,
        workspace.num_cache_blocks,
        block_size,
        num_requests,
        grouping.min_group_size,
        grouping.min_prefix_blocks,
        math.ceil(grouping.min_grouped_fraction * num_requests),
        -1 if grouping.max_groups is None else grouping.max_groups,
        sizes.prefix_target_items,
        sizes.suffix_target_items,
        config.split_granularity,
        MEMBERS=sizes.members_per_tile,
        BLOCK_R=block_requests,
        BLOCK_E=block_entries,
        num_warps=finish_warps,
        **pdl,
    )


def allocate_partials(plan: ForestPlan, head_dim: int, device: torch.device) -> Partials:
    """Partial rows for every prefix item (``prefix_block_m`` rows) and suffix item (``rows``) the plan can hold."""
    rows = max(2, _next_power_of_two(plan.max_query_len * plan.queries_per_kv))
    prefix_rows = plan.max_prefix_work * plan.num_kv_heads * plan.prefix_block_m
    suffix_rows = plan.max_suffix_work * plan.num_kv_heads * rows
    part_out = torch.empty((prefix_rows + suffix_rows) * head_dim, dtype=torch.float32, device=device)
    part_lse = torch.empty(prefix_rows + suffix_rows, dtype=torch.float32, device=device)
    return Partials(out=part_out, lse=part_lse, prefix_rows=prefix_rows, rows=rows)


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index)


def launch_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: ForestPlan,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    partials: Partials,
    knobs: DecodeKnobs = DEFAULT_KNOBS,
    passes: tuple[int, ...] | None = None,
) -> list[Any]:
    """The attention launch(es): ``passes`` (0 both kinds of items, 1 prefix items, 2 suffix items) default to the
    knobs' choice. Returns what each launch returned (the compiled kernels on CUDA) for resource reports."""
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
    prefix_warps = knobs.prefix_num_warps if knobs.prefix_num_warps is not None else config.num_warps
    prefix_stages = knobs.prefix_num_stages if knobs.prefix_num_stages is not None else config.num_stages
    if wide:
        prefix_warps, prefix_stages = max(prefix_warps, 8), min(prefix_stages, 2)
    fuse = fused_combine(plan)
    split = knobs.split_passes or config.split_passes or fuse
    if passes is None:
        passes = (1, 2) if split and plan.shares else (0,)
    # A pass alone is allowed for timing; the suffix pass then reads what the last prefix pass left.
    if fuse and passes not in ((1, 2), (1,), (2,)):
        raise PlanError(
            "a plan with fuse_combine runs the prefix pass, then the suffix pass (passes=(1, 2)); got "
            f"passes={passes}. Leave passes unset, or plan with fuse_combine=False."
        )
    if early_combine(plan) and passes not in ((0,), (1, 2)):
        raise PlanError(
            f"a plan with early_combine counts every attention item for the combine that follows; passes={passes} "
            "would leave counts behind. Run all items (leave passes unset), or plan with early_combine=False."
        )
    if 1 in passes and not plan.shares:
        raise PlanError("a prefix pass needs a plan with groups (plan_forest), got a plan without (plan_paged).")
    table = plan.block_table
    if table.stride(1) != 1:
        table = table.contiguous()
    k_strides = key_cache.stride()
    v_strides = value_cache.stride()
    q_strides = query.stride()
    prefix_rows = partials.prefix_rows
    owners_block = _next_power_of_two(max(2, 2 * num_requests))
    pdl = dependent_launches(config, query.device)
    # The suffix pass reads nothing the prefix pass writes: chained, it starts beside the prefix pass's last wave.
    chained = config.chain_passes and not fuse and passes == (1, 2)
    chain = pdl and chained
    early = early_combine(plan)
    # An early combine starts before this launch ends and reads the plan at once: every attention launch waits for
    # the plan before it lets the next launch be scheduled (PDL mode 2), so a combine program that runs implies a
    # finished plan.
    plain_mode = 2 if early else 1

    # A persistent suffix pass: a fixed grid of slots (each a group of kv-head programs) loops over the items.
    suffix_slots = plan.max_suffix_work
    per_sm = knobs.suffix_programs_per_sm
    if per_sm is not None:
        from arctic_dedup.forest.plan import _multiprocessors

        wanted = math.ceil(per_sm * _multiprocessors(query.device, config) / num_kv_heads)
        suffix_slots = max(1, min(plan.max_suffix_work, wanted))

    interleave = knobs.interleave_items and plan.shares and passes == (0,)
    one_launch = plan.max_prefix_work + plan.max_suffix_work
    if interleave:
        one_launch = 2 * max(plan.max_prefix_work, plan.max_suffix_work)

    def launch(which: int) -> Any:
        programs = {0: one_launch, 1: plan.max_prefix_work, 2: suffix_slots}
        warps, stages = (prefix_warps, prefix_stages) if which == 1 else (num_warps, num_stages)
        registers = knobs.max_registers
        if which == 1 and knobs.prefix_max_registers is not None:
            registers = knobs.prefix_max_registers
        limits = {"maxnreg": registers} if registers is not None and not interpreting() else {}
        grid = programs[which] * num_kv_heads
        name = {0: "one launch", 1: "prefix pass", 2: "suffix pass"}[which]
        timeline = knobs.timeline.rows(name, grid, query.device) if knobs.timeline is not None else lse
        return forest_attention_kernel[(grid,)](
            query,
            key_cache,
            value_cache,
            table,
            plan.query_start_loc,
            plan.seq_lens,
            plan.prefix_blocks,
            plan.tile_of,
            plan.slot_in_tile,
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
            timeline,
            HAS_PREFIX=plan.shares,
            FUSE=fuse,
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
            PERSISTENT=per_sm is not None and which == 2,
            INTERLEAVE=interleave and which == 0,
            TIMELINE=knobs.timeline is not None,
            num_warps=warps,
            num_stages=stages,
            **_pdl_options(pdl, {1: 2, 2: 3}[which] if chain else plain_mode),
            **limits,
        )

    # With a fused combine the suffix pass reads the prefix pass's partials: both stay on one stream, in order.
    if (knobs.side_stream or config.split_passes) and not (fuse or chained) and passes == (1, 2) and query.is_cuda:
        main = torch.cuda.current_stream(query.device)
        side = _side_stream(query.device.index if query.device.index is not None else torch.cuda.current_device())
        side.wait_stream(main)
        with torch.cuda.stream(side):
            compiled = [launch(1)]
        compiled.append(launch(2))
        main.wait_stream(side)
        return compiled
    return [launch(which) for which in passes]


def fused_combine(plan: ForestPlan) -> bool:
    """Whether the suffix pass merges prefix partials itself (``ForestKernelConfig.fuse_combine``, plans with
    groups only)."""
    return plan.config.fuse_combine and plan.shares


def early_combine(plan: ForestPlan) -> bool:
    """Whether attention items count themselves done and combine programs wait for their own request's count
    instead of the whole attention launch (``ForestKernelConfig.early_combine``; not with a fused combine)."""
    return plan.config.early_combine and not fused_combine(plan)


def launch_combine(
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: ForestPlan,
    partials: Partials,
    head_dim: int,
    knobs: DecodeKnobs = DEFAULT_KNOBS,
) -> Any:
    """Merge every request's partials (requests written directly by the attention launch are skipped)."""
    from arctic_dedup.forest._kernels import forest_combine_kernel

    head_block = max(16, _next_power_of_two(head_dim))
    config = plan.config
    early = early_combine(plan)
    dim_block = min(head_block, knobs.combine_dim_block or config.combine_dim_block or head_block)
    num_warps = knobs.combine_num_warps if knobs.combine_num_warps is not None else config.combine_num_warps
    dim_chunks = head_block // dim_block
    rows = partials.rows
    cap = knobs.combine_chunk_cap if knobs.combine_chunk_cap is not None else config.combine_chunk_cap
    chunk = max(1, min(cap, _previous_power_of_two(COMBINE_CHUNK_FLOATS // (rows * dim_block))))
    grid = plan.num_requests * plan.num_kv_heads * dim_chunks
    timeline = knobs.timeline.rows("combine", grid, out.device) if knobs.timeline is not None else lse
    return forest_combine_kernel[(grid,)](
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
        timeline,
        HAS_PREFIX=plan.shares,
        FUSE=fused_combine(plan),
        G=plan.queries_per_kv,
        QMAX=plan.max_query_len,
        PREFIX_BLOCK_M=plan.prefix_block_m,
        ROWS=rows,
        CHUNK=chunk,
        DIM_BLOCK=dim_block,
        EARLY=early,
        LOAD_CACHE=".cg" if early else "",
        TIMELINE=knobs.timeline is not None,
        num_warps=num_warps,
        # An early combine lets the next launch be scheduled at once and waits for the attention launch at its end.
        **_pdl_options(dependent_launches(config, out.device), 3 if early else 1),
    )


def launch_forest_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: ForestPlan,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    knobs: DecodeKnobs = DEFAULT_KNOBS,
) -> None:
    partials = allocate_partials(plan, query.shape[2], query.device)
    launch_attention(query, key_cache, value_cache, plan, scale, out, lse, partials, knobs)
    launch_combine(out, lse, plan, partials, query.shape[2], knobs)
