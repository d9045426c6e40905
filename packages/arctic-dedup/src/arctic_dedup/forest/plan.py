"""Group discovery from paged-KV block tables and the per-step forest plan (vectorized, on the device, no host sync).

Requests whose block tables start with the same physical block ids share those KV blocks (vLLM's prefix cache makes
the n samples of one prompt point at the same prompt blocks). For every request and every depth ``d`` the builder
counts how many requests of the batch hold the same block at ``d``; the request is cut at the depth that saves the
most block reads, ``(count - 1) * (d + 1)``, and joins the group of requests cut at the same physical block. Deep
sharing wins over shallow sharing of more requests only when it saves more (nested sharing, e.g. a system prompt
shared by all and prompts shared by their samples, cuts at the prompts). Each group's prefix is then *verified*: it is
the number of leading full blocks that every member holds identically and that lie entirely before every member's new
query tokens, so a table that breaks the prefix-cache invariants can only make groups smaller, never wrong.

On CUDA the builder is three Triton launches over the block tables (a block histogram, the cuts, the groups and
work lists) with a reusable ``ForestWorkspace``: no ``.item()``, no sorts, no dynamic shapes, so it runs inside a CUDA
graph and never stalls the host. On CPU builds the same plan is built with plain torch.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from arctic_dedup._triton_support import Backend, resolve_backend
from arctic_dedup.errors import PlanError
from arctic_dedup.forest._launch import launch_plan
from arctic_dedup.forest.plan_types import (
    ForestGrouping,
    ForestKernelConfig,
    ForestPlan,
    ForestScratch,
    ForestWorkspace,
    PlanSizes,
)

__all__ = [
    "ForestGrouping",
    "ForestKernelConfig",
    "ForestPlan",
    "ForestScratch",
    "ForestWorkspace",
    "default_forest_config",
    "plan_forest",
    "plan_paged",
]


# ``plan_forest``'s rule when no config is given, measured on the H200 (RL-8x16 and one group of 16 x (8192 + 512)
# tokens; the rounds and their numbers are in benchmarks/lab/TRIED_AND_REJECTED.md). Every batch merges with one-warp
# combine programs over 64-dim slices, 8 partials at a time (combine 7.3 -> 4.8 us on 8 x 16), uses dependent
# launches where the device has them (whole op 166.4 -> 165.6 us) and the early combine, with 64-token prefix tiles.
_EVERY_BATCH = ForestKernelConfig(
    prefix_block_n=64,
    combine_dim_block=64,
    combine_num_warps=1,
    combine_chunk_cap=8,
    dependent_launches=True,
    early_combine=True,
)
# At most one (request, kv head) pair per multiprocessor: one wave of long items with 64x64 prefix tiles (34.4 us
# against 40.8 us with 64x32 tiles). Larger batches: 64-token prefix tiles in a prefix pass of their own (8 x 16:
# 161.0 us against 169.0 us in one launch, where the large prefix tiles cost the suffix items a third of their
# slots), then the suffix pass on the same stream (round 17 A/B: 163.5-164.0 us against 166.2-166.8 us for the two
# passes on two streams).
_ONE_WAVE = replace(_EVERY_BATCH, prefix_waves=1.0, waves=1.0)
_MANY_WAVES = replace(_EVERY_BATCH, split_passes=True)


def default_forest_config(num_requests: int, num_kv_heads: int, multiprocessors: int) -> ForestKernelConfig:
    """``plan_forest``'s config when none is given: one wave of long items for a batch with at most one
    (request, kv head) pair per multiprocessor, split prefix and suffix passes for larger batches."""
    return _ONE_WAVE if num_requests * num_kv_heads <= multiprocessors else _MANY_WAVES


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def _multiprocessors(device: torch.device, config: ForestKernelConfig) -> int:
    if config.multiprocessors is not None:
        return config.multiprocessors
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 8


def _sizes(
    num_requests: int,
    device: torch.device,
    max_query_len: int,
    queries_per_kv: int,
    num_kv_heads: int,
    config: ForestKernelConfig,
    grouped: bool,
) -> PlanSizes:
    rows_per_member = max_query_len * queries_per_kv
    prefix_block_m = max(config.prefix_block_m, _next_power_of_two(max(16, rows_per_member)))
    members_per_tile = max(1, prefix_block_m // rows_per_member)
    multiprocessors = _multiprocessors(device, config)
    prefix_target = max(1, math.ceil(config.prefix_waves * multiprocessors / num_kv_heads))
    suffix_target = max(1, math.ceil(config.waves * multiprocessors / num_kv_heads))
    # Each owner rounds its item count up once; with groups of >= 2 and >= 2 members per tile, tiles <= 3N/4.
    max_tiles = num_requests if members_per_tile == 1 else (3 * num_requests) // 4
    return PlanSizes(
        num_requests=num_requests,
        members_per_tile=members_per_tile,
        prefix_block_m=prefix_block_m,
        prefix_target_items=prefix_target,
        suffix_target_items=suffix_target,
        max_prefix_work=prefix_target + max_tiles if grouped else 0,
        max_suffix_work=suffix_target + num_requests,
    )


def _check_inputs(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    max_query_len: int,
    queries_per_kv: int,
    num_kv_heads: int,
) -> None:
    if block_table.dim() != 2:
        raise PlanError(
            f"block_table must be [num_requests, max_blocks], got shape {tuple(block_table.shape)}; pass the paged "
            "KV block table of the decode batch."
        )
    num_requests = block_table.shape[0]
    if num_requests == 0:
        raise PlanError("the decode batch is empty (block_table has 0 rows); call forest decode with >= 1 request.")
    if tuple(seq_lens.shape) != (num_requests,) or tuple(query_start_loc.shape) != (num_requests + 1,):
        raise PlanError(
            f"expected seq_lens [{num_requests}] and query_start_loc [{num_requests + 1}] for {num_requests} block "
            f"table rows, got {tuple(seq_lens.shape)} and {tuple(query_start_loc.shape)}."
        )
    for name, tensor in (("block_table", block_table), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if tensor.dtype not in (torch.int32, torch.int64):
            raise PlanError(f"{name} must be int32 or int64, got {tensor.dtype}; cast it with .to(torch.int32).")
        if tensor.device != block_table.device:
            raise PlanError(f"{name} is on {tensor.device} but block_table is on {block_table.device}; move them.")
    if block_size < 1 or max_query_len < 1 or queries_per_kv < 1 or num_kv_heads < 1:
        raise PlanError(
            f"block_size, max_query_len, queries_per_kv and num_kv_heads must be >= 1, got {block_size}, "
            f"{max_query_len}, {queries_per_kv}, {num_kv_heads}."
        )


def _find_groups(
    block_table: torch.Tensor,
    eligible_blocks: torch.Tensor,
    num_cache_blocks: int,
    grouping: ForestGrouping,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (leader ``[N]``, prefix blocks ``[N]``, grouped ``[N]`` bool), all int64/bool on the device."""
    num_requests, max_blocks = block_table.shape
    device = block_table.device
    requests = torch.arange(num_requests, device=device)
    depth = torch.arange(max_blocks, device=device)
    valid = depth[None, :] < eligible_blocks[:, None]
    ids = block_table.to(torch.int64)
    # Entries past a request's eligible blocks (padding, partial or new blocks) count under one spare id.
    spare = num_cache_blocks
    keys = torch.where(valid, ids.clamp(0, spare), spare)
    counts = torch.zeros(spare + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, keys.reshape(-1), torch.ones_like(keys).reshape(-1))
    shared = torch.where(valid, counts[keys], 0)
    usable = valid & (shared >= grouping.min_group_size) & (depth[None, :] + 1 >= grouping.min_additional_prefix_blocks)
    savings = torch.where(usable, (shared - 1) * (depth[None, :] + 1), 0)
    cut = torch.argmax(savings, dim=1)
    best = savings.gather(1, cut[:, None]).squeeze(1)
    candidate = best > 0
    cut_key = torch.where(candidate, keys.gather(1, cut[:, None]).squeeze(1), spare)
    leader_of_key = torch.full((spare + 1,), num_requests, dtype=torch.int64, device=device)
    leader_of_key.scatter_reduce_(0, cut_key, requests, reduce="amin")
    leader = torch.where(candidate, leader_of_key[cut_key], requests)

    both_valid = valid & valid[leader]
    same = (ids == ids[leader]) & both_valid
    common = same.to(torch.int64).cumprod(1).sum(1)
    group_prefix = torch.full((num_requests,), max_blocks, dtype=torch.int64, device=device)
    group_prefix.scatter_reduce_(0, leader, common, reduce="amin")
    prefix = group_prefix[leader]
    group_size = torch.zeros(num_requests, dtype=torch.int64, device=device)
    group_size.scatter_add_(0, leader, candidate.to(torch.int64))
    size = group_size[leader]
    grouped = candidate & (size >= grouping.min_group_size) & (prefix >= grouping.min_additional_prefix_blocks)

    num_groups = (grouped & (leader == requests)).sum()
    keep_batch = grouped.sum() >= math.ceil(grouping.min_non_singleton_fraction * num_requests)
    if grouping.max_non_singleton_groups > 0:
        keep_batch = keep_batch & (num_groups <= grouping.max_non_singleton_groups)
    grouped = grouped & keep_batch
    leader = torch.where(grouped, leader, requests)
    prefix = torch.where(grouped, prefix, 0)
    return leader, prefix, grouped


def _plan_buffers(num_requests: int, num_kv_heads: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Every per-step output of the planner as views of one int32 allocation (no kernel launch)."""
    names = (
        "prefix_blocks",
        "group_leader",
        "tile_of",
        "slot_in_tile",
        "tile_leader",
        "tile_prefix_blocks",
        "tile_member_start",
        "tile_member_count",
        "member_list",
    )
    per_request = len(names) * num_requests
    ready = num_requests * num_kv_heads
    # Per request: the named views, then standard_seq_lens last (after the work list, stats and early-combine counts).
    size = per_request + 2 * num_requests + 1 + 2 + 3 + ready + num_requests
    buffer = torch.empty(size, dtype=torch.int32, device=device)
    views = {name: buffer[i * num_requests : (i + 1) * num_requests] for i, name in enumerate(names)}
    views["work_start"] = buffer[per_request : per_request + 2 * num_requests + 1]
    tail = per_request + 2 * num_requests + 1
    views["split_tokens"] = buffer[tail : tail + 2]
    views["num_groups"] = buffer[tail + 2 : tail + 3]
    views["num_grouped_requests"] = buffer[tail + 3 : tail + 4]
    views["saved_block_reads"] = buffer[tail + 4 : tail + 5]
    views["stats"] = buffer[tail + 2 : tail + 5]
    views["combine_ready"] = buffer[tail + 5 : tail + 5 + ready]
    views["standard_seq_lens"] = buffer[tail + 5 + ready :]
    return views


def _split_tokens(total: torch.Tensor, target_items: int, granularity: int) -> torch.Tensor:
    split = torch.div(total.clamp_min(1) + target_items - 1, target_items, rounding_mode="floor")
    return torch.div(split + granularity - 1, granularity, rounding_mode="floor") * granularity


def _item_count(lengths: torch.Tensor, split: torch.Tensor) -> torch.Tensor:
    items = torch.div(lengths - torch.div(split, 8, rounding_mode="floor") + split - 1, split, rounding_mode="floor")
    return torch.where(lengths > 0, items.clamp_min(1), 0)


def _fill_torch(
    views: dict[str, torch.Tensor],
    seq: torch.Tensor,
    leader: torch.Tensor,
    prefix: torch.Tensor,
    grouped: torch.Tensor,
    sizes: PlanSizes,
    block_size: int,
    granularity: int,
    leave_ungrouped: bool,
) -> None:
    """The finishing step of the planner in plain torch (the CPU path; mirrors ``_finish_plan`` in the kernels)."""
    num_requests = sizes.num_requests
    members = sizes.members_per_tile
    device = seq.device
    requests = torch.arange(num_requests, device=device)
    is_leader = grouped & (leader == requests)
    size = torch.zeros(num_requests, dtype=torch.int64, device=device)
    size.scatter_add_(0, leader, grouped.to(torch.int64))
    size = size[leader]
    order = torch.argsort(torch.where(grouped, leader, num_requests) * num_requests + requests)
    position = torch.empty_like(order)
    position[order] = requests
    group_tiles = torch.where(is_leader, torch.div(size + members - 1, members, rounding_mode="floor"), 0)
    group_members = torch.where(is_leader, size, 0)
    first_tile = torch.cumsum(group_tiles, 0) - group_tiles
    first_member = torch.cumsum(group_members, 0) - group_members
    rank = position - first_member[leader]
    tile = torch.where(grouped, first_tile[leader] + torch.div(rank, members, rounding_mode="floor"), -1)
    slot = torch.where(grouped, rank % members, 0)
    for name in ("tile_leader", "tile_prefix_blocks", "tile_member_start", "tile_member_count", "member_list"):
        views[name].zero_()
    member_at = first_member[leader] + rank
    views["member_list"][member_at[grouped]] = requests[grouped].to(torch.int32)
    opens = grouped & (slot == 0)
    views["tile_leader"][tile[opens]] = leader[opens].to(torch.int32)
    views["tile_prefix_blocks"][tile[opens]] = prefix[opens].to(torch.int32)
    views["tile_member_start"][tile[opens]] = member_at[opens].to(torch.int32)
    views["tile_member_count"][tile[opens]] = torch.clamp(size - rank, max=members)[opens].to(torch.int32)

    prefix_tokens = views["tile_prefix_blocks"].to(torch.int64) * block_size
    suffix_tokens = (seq - prefix * block_size).clamp_min(0)
    if leave_ungrouped:
        views["standard_seq_lens"].copy_(torch.where(grouped, 0, seq).to(torch.int32))
        suffix_tokens = torch.where(grouped, suffix_tokens, 0)
    prefix_split = _split_tokens(prefix_tokens.sum(), sizes.prefix_target_items, granularity)
    suffix_split = _split_tokens(suffix_tokens.sum(), sizes.suffix_target_items, granularity)
    prefix_items = _item_count(prefix_tokens, prefix_split)
    suffix_items = _item_count(suffix_tokens, suffix_split)
    views["work_start"][0] = 0
    views["work_start"][1 : num_requests + 1] = torch.cumsum(prefix_items, 0).to(torch.int32)
    views["work_start"][num_requests + 1 :] = (prefix_items.sum() + torch.cumsum(suffix_items, 0)).to(torch.int32)
    views["split_tokens"].copy_(torch.stack([prefix_split, suffix_split]).to(torch.int32))
    views["prefix_blocks"].copy_(prefix.to(torch.int32))
    views["group_leader"].copy_(leader.to(torch.int32))
    views["tile_of"].copy_(tile.to(torch.int32))
    views["slot_in_tile"].copy_(slot.to(torch.int32))
    views["num_groups"].copy_(is_leader.sum().reshape(1).to(torch.int32))
    views["num_grouped_requests"].copy_(grouped.sum().reshape(1).to(torch.int32))
    saved = prefix.sum() - torch.where(is_leader, prefix, 0).sum()
    views["saved_block_reads"].copy_(saved.reshape(1).to(torch.int32))
    views["combine_ready"].zero_()


def _fill(
    block_table: torch.Tensor,
    seq: torch.Tensor,
    starts: torch.Tensor,
    views: dict[str, torch.Tensor],
    sizes: PlanSizes,
    *,
    block_size: int,
    num_cache_blocks: int,
    grouping: ForestGrouping | None,
    config: ForestKernelConfig,
    workspace: ForestWorkspace | None,
    backend: Backend,
    grouping_gate: torch.Tensor | None = None,
    leave_ungrouped: bool = False,
) -> None:
    """Write one step's plan into ``views`` (int32 ``seq`` and ``starts``); never reads the device on the host.
    Where ``grouping_gate`` (int32 ``[1]``) holds 0, grouping finds no groups. ``leave_ungrouped``: see
    ``ForestPlan.leaves_ungrouped``."""
    device = block_table.device
    num_requests = block_table.shape[0]
    if resolve_backend(backend, block_table) == "triton":
        if grouping is not None:
            if workspace is None:
                workspace = ForestWorkspace(num_cache_blocks, device)
            elif workspace.num_cache_blocks < num_cache_blocks or workspace.device != device:
                raise PlanError(
                    f"the workspace was made for {workspace.num_cache_blocks} cache blocks on {workspace.device}, "
                    f"but this plan has {num_cache_blocks} blocks on {device}; make a ForestWorkspace for this cache."
                )
        launch_plan(
            block_table,
            seq,
            starts,
            views,
            sizes,
            block_size,
            grouping,
            workspace,
            config,
            grouping_gate,
            leave_ungrouped,
        )
        return
    requests = torch.arange(num_requests, device=device)
    if grouping is not None:
        # Only blocks that lie entirely before the new query tokens can be a prefix every query sees in full.
        seq64 = seq.to(torch.int64)
        query_lens = (starts[1:] - starts[:-1]).to(torch.int64)
        max_blocks = block_table.shape[1]
        eligible = torch.div((seq64 - query_lens).clamp_min(0), block_size, rounding_mode="floor")
        if grouping_gate is not None:
            eligible = torch.where(grouping_gate.to(device) != 0, eligible, 0)
        leader, prefix, grouped = _find_groups(block_table, eligible.clamp_max(max_blocks), num_cache_blocks, grouping)
    else:
        leader = requests.clone()
        prefix = torch.zeros(num_requests, dtype=torch.int64, device=device)
        grouped = torch.zeros(num_requests, dtype=torch.bool, device=device)
    _fill_torch(
        views,
        seq.to(torch.int64),
        leader,
        prefix,
        grouped,
        sizes,
        block_size,
        config.split_granularity,
        leave_ungrouped,
    )


def _build(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    block_size: int,
    num_cache_blocks: int,
    max_query_len: int,
    queries_per_kv: int,
    num_kv_heads: int,
    grouping: ForestGrouping | None,
    config: ForestKernelConfig,
    workspace: ForestWorkspace | None,
    backend: Backend,
    leave_ungrouped: bool = False,
) -> ForestPlan:
    _check_inputs(block_table, seq_lens, query_start_loc, block_size, max_query_len, queries_per_kv, num_kv_heads)
    device = block_table.device
    num_requests = block_table.shape[0]
    sizes = _sizes(num_requests, device, max_query_len, queries_per_kv, num_kv_heads, config, grouping is not None)
    views = _plan_buffers(num_requests, num_kv_heads, device)
    seq = seq_lens.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    _fill(
        block_table,
        seq,
        starts,
        views,
        sizes,
        block_size=block_size,
        num_cache_blocks=num_cache_blocks,
        grouping=grouping,
        config=config,
        workspace=workspace,
        backend=backend,
        leave_ungrouped=leave_ungrouped,
    )
    standard_seq_lens = views.pop("standard_seq_lens")
    return ForestPlan(
        block_table=block_table,
        seq_lens=seq,
        query_start_loc=starts,
        block_size=block_size,
        max_query_len=max_query_len,
        queries_per_kv=queries_per_kv,
        num_kv_heads=num_kv_heads,
        members_per_tile=sizes.members_per_tile,
        prefix_block_m=sizes.prefix_block_m,
        max_prefix_work=sizes.max_prefix_work,
        max_suffix_work=sizes.max_suffix_work,
        shares=grouping is not None,
        config=config,
        leaves_ungrouped=leave_ungrouped,
        standard_seq_lens=standard_seq_lens if leave_ungrouped else None,
        persistent=False,
        scratch=None,
        **views,
    )


def plan_forest(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    block_size: int,
    num_cache_blocks: int,
    max_query_len: int,
    queries_per_kv: int,
    num_kv_heads: int,
    grouping: ForestGrouping | None = None,
    config: ForestKernelConfig | None = None,
    workspace: ForestWorkspace | None = None,
    backend: Backend = "auto",
    leave_ungrouped: bool = False,
) -> ForestPlan:
    """Find the groups of a decode batch and build the work lists of ``forest_decode``.

    The plan depends only on the block table and lengths, so build it once per step and pass it to every layer.
    On CUDA it takes three small kernel launches and never synchronizes with the host.

    Args:
        block_table: ``[N, max_blocks]`` int32 physical KV block ids per request (paged KV cache).
        seq_lens: ``[N]`` tokens per request in the KV cache, including this step's query tokens.
        query_start_loc: ``[N + 1]`` offsets of each request's query tokens in the packed query ``[T, H_q, D]``.
        block_size: tokens per KV block.
        num_cache_blocks: number of blocks in the KV cache (block ids are ``< num_cache_blocks``; ids outside
            ``[0, num_cache_blocks)`` are never grouped).
        max_query_len: upper bound of the query tokens of any request this step (1 for plain decode).
        queries_per_kv: query heads per KV head (GQA ratio).
        num_kv_heads: KV heads per layer (sizes the work so one pass fills the device).
        grouping: which groups to use (defaults to ``ForestGrouping()``).
        config: kernel tile and split sizes (defaults to ``default_forest_config``: a rule by batch size).
        workspace: a ``ForestWorkspace`` for this cache, reused every step (made, zeroed, per call when ``None``).
        backend: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"torch"`` (CPU builds), or ``"auto"``.
        leave_ungrouped: ``forest_decode`` attends only the grouped requests; the caller attends the others with its
            own paged kernel over ``plan.standard_seq_lens`` (their lengths, 0 for grouped requests), before or
            after the decode (``ForestPlan.leaves_ungrouped``).

    Returns:
        A ``ForestPlan`` of device tensors; building it never synchronizes with the host.
    """
    return _build(
        block_table,
        seq_lens,
        query_start_loc,
        block_size=block_size,
        num_cache_blocks=num_cache_blocks,
        max_query_len=max_query_len,
        queries_per_kv=queries_per_kv,
        num_kv_heads=num_kv_heads,
        grouping=grouping if grouping is not None else ForestGrouping(),
        config=config
        if config is not None
        else default_forest_config(
            block_table.shape[0], num_kv_heads, _multiprocessors(block_table.device, ForestKernelConfig())
        ),
        workspace=workspace,
        backend=backend,
        leave_ungrouped=leave_ungrouped,
    )


def plan_paged(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    block_size: int,
    max_query_len: int,
    queries_per_kv: int,
    num_kv_heads: int,
    config: ForestKernelConfig | None = None,
    backend: Backend = "auto",
) -> ForestPlan:
    """A plan with no groups: every request reads its whole context (the per-request paged decode; one launch)."""
    return _build(
        block_table,
        seq_lens,
        query_start_loc,
        block_size=block_size,
        num_cache_blocks=0,
        max_query_len=max_query_len,
        queries_per_kv=queries_per_kv,
        num_kv_heads=num_kv_heads,
        grouping=None,
        config=config if config is not None else ForestKernelConfig(),
        workspace=None,
        backend=backend,
    )
