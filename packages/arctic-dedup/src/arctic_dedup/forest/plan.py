"""Group discovery from paged-KV block tables and the per-step forest plan (vectorized, on the device, no host sync).

Requests whose block tables start with the same physical block ids share those KV blocks (vLLM's prefix cache makes
the n samples of one prompt point at the same prompt blocks). For every request and every depth ``d`` the builder
counts how many requests of the batch hold the same block at ``d``; the request is cut at the depth that saves the
most block reads, ``(count - 1) * (d + 1)``, and joins the group of requests cut at the same physical block. Deep
sharing wins over shallow sharing of more requests only when it saves more (nested sharing, e.g. a system prompt
shared by all and prompts shared by their samples, cuts at the prompts). Each group's prefix is then *verified*: it is
the number of leading full blocks that every member holds identically and that lie entirely before every member's new
query tokens, so a table that breaks the prefix-cache invariants can only make groups smaller, never wrong.

Everything is fixed-shape torch on the tables' device: no ``.item()``, no dynamic shapes, so the builder runs inside
a CUDA graph and never stalls the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from arctic_dedup.errors import PlanError

__all__ = ["ForestGrouping", "ForestKernelConfig", "ForestPlan", "plan_forest", "plan_paged"]


@dataclass(frozen=True)
class ForestGrouping:
    """Which shared prefixes are worth a grouped prefix pass.

    Attributes:
        min_group_size: fewest requests that must share a prefix for it to be read once for all of them.
        min_prefix_blocks: fewest shared full KV blocks a group needs; shorter prefixes are read per request.
        min_grouped_fraction: if fewer than this fraction of the batch's requests end up in groups, no request is
            grouped (the whole batch runs per request).
        max_groups: if more than this many groups are found, no request is grouped; ``None`` means no limit.
    """

    min_group_size: int = 2
    min_prefix_blocks: int = 1
    min_grouped_fraction: float = 0.0
    max_groups: int | None = None

    def __post_init__(self) -> None:
        if self.min_group_size < 2:
            raise ValueError(f"min_group_size must be >= 2 (a group shares a prefix), got {self.min_group_size}")
        if self.min_prefix_blocks < 1:
            raise ValueError(f"min_prefix_blocks must be >= 1, got {self.min_prefix_blocks}")
        if not 0.0 <= self.min_grouped_fraction <= 1.0:
            raise ValueError(f"min_grouped_fraction must be in [0, 1], got {self.min_grouped_fraction}")
        if self.max_groups is not None and self.max_groups < 0:
            raise ValueError(f"max_groups must be >= 0 or None, got {self.max_groups}")


@dataclass(frozen=True)
class ForestKernelConfig:
    """Tile shapes and work sizes of the decode kernels (tuned by ``benchmarks/fca_decode.py``).

    Attributes:
        prefix_block_m: rows of one prefix tile (GQA heads x query tokens x requests); a power of two >= 16.
        prefix_block_n: KV tokens per inner step of the prefix pass.
        suffix_block_n: KV tokens per inner step of the suffix (per-request) pass.
        prefix_num_warps, prefix_num_stages, suffix_num_warps, suffix_num_stages: Triton launch options.
        waves: work items are sized so that about ``waves * multiprocessors`` programs run per pass.
        split_granularity: split lengths are rounded up to a multiple of this many tokens.
        multiprocessors: the device's multiprocessor count; ``None`` reads it from the device (8 on CPU).
    """

    prefix_block_m: int = 64
    prefix_block_n: int = 64
    suffix_block_n: int = 64
    prefix_num_warps: int = 4
    prefix_num_stages: int = 2
    suffix_num_warps: int = 4
    suffix_num_stages: int = 2
    waves: float = 4.0
    split_granularity: int = 128
    multiprocessors: int | None = None

    def __post_init__(self) -> None:
        for name in ("prefix_block_m", "prefix_block_n", "suffix_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.split_granularity < 1:
            raise ValueError(f"split_granularity must be >= 1, got {self.split_granularity}")
        if self.waves <= 0:
            raise ValueError(f"waves must be > 0, got {self.waves}")


@dataclass(frozen=True)
class ForestPlan:
    """One decode step's grouping and work lists; built once per step, read by every layer.

    Per request ``[N]`` (int32): ``prefix_blocks`` (shared full blocks read by the group pass, 0 when ungrouped),
    ``group_leader`` (the request whose block table row holds the group's prefix; itself when ungrouped),
    ``tile_of`` (prefix tile, -1 when ungrouped), ``slot_in_tile``.
    Per tile slot ``[N]``: ``tile_leader``, ``tile_prefix_blocks``, ``tile_members [N, members_per_tile]`` (-1 pads).
    Work lists: ``prefix_work_start [N + 1]`` / ``suffix_work_start [N + 1]`` are the first work item of each tile /
    request (splits of ``prefix_split_tokens [1]`` / ``suffix_split_tokens [1]`` tokens).
    Stats ``[1]`` (int64): ``num_groups``, ``num_grouped_requests``, ``saved_block_reads`` (per kv head and layer).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    prefix_blocks: torch.Tensor
    group_leader: torch.Tensor
    tile_of: torch.Tensor
    slot_in_tile: torch.Tensor
    tile_leader: torch.Tensor
    tile_prefix_blocks: torch.Tensor
    tile_members: torch.Tensor
    prefix_work_start: torch.Tensor
    prefix_split_tokens: torch.Tensor
    suffix_work_start: torch.Tensor
    suffix_split_tokens: torch.Tensor
    num_groups: torch.Tensor
    num_grouped_requests: torch.Tensor
    saved_block_reads: torch.Tensor
    block_size: int
    max_query_len: int
    queries_per_kv: int
    num_kv_heads: int
    members_per_tile: int
    prefix_block_m: int
    max_prefix_work: int
    max_suffix_work: int
    shares: bool
    config: ForestKernelConfig = field(default_factory=ForestKernelConfig)

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def _multiprocessors(device: torch.device, config: ForestKernelConfig) -> int:
    if config.multiprocessors is not None:
        return config.multiprocessors
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 8


def _exclusive_cumsum(values: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(values, 0) - values


def _work_list(lengths: torch.Tensor, target_items: int, granularity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split lengths ``[K]`` into items of one shared split length; returns (work_start ``[K + 1]``, split ``[1]``)."""
    total = lengths.sum().clamp_min(1)
    split = torch.div(total + target_items - 1, target_items, rounding_mode="floor")
    split = torch.div(split + granularity - 1, granularity, rounding_mode="floor") * granularity
    items = torch.div(lengths + split - 1, split, rounding_mode="floor")
    work_start = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=lengths.device)
    work_start[1:] = torch.cumsum(items, 0)
    return work_start.to(torch.int32), split.reshape(1).to(torch.int32)


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
    usable = valid & (shared >= grouping.min_group_size) & (depth[None, :] + 1 >= grouping.min_prefix_blocks)
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
    grouped = candidate & (size >= grouping.min_group_size) & (prefix >= grouping.min_prefix_blocks)

    num_groups = (grouped & (leader == requests)).sum()
    keep_batch = grouped.sum() >= math.ceil(grouping.min_grouped_fraction * num_requests)
    if grouping.max_groups is not None:
        keep_batch = keep_batch & (num_groups <= grouping.max_groups)
    grouped = grouped & keep_batch
    leader = torch.where(grouped, leader, requests)
    prefix = torch.where(grouped, prefix, 0)
    return leader, prefix, grouped


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
) -> ForestPlan:
    _check_inputs(block_table, seq_lens, query_start_loc, block_size, max_query_len, queries_per_kv, num_kv_heads)
    device = block_table.device
    num_requests, max_blocks = block_table.shape
    requests = torch.arange(num_requests, device=device)
    seq = seq_lens.to(torch.int64)
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)

    rows_per_member = max_query_len * queries_per_kv
    prefix_block_m = max(config.prefix_block_m, _next_power_of_two(max(16, rows_per_member)))
    members_per_tile = max(1, prefix_block_m // rows_per_member)
    programs = max(1, int(config.waves * _multiprocessors(device, config)))
    target_items = max(1, math.ceil(programs / num_kv_heads))

    if grouping is not None:
        # Only blocks that lie entirely before the new query tokens can be a prefix every query sees in full.
        eligible = torch.div((seq - query_lens).clamp_min(0), block_size, rounding_mode="floor").clamp_max(max_blocks)
        leader, prefix, grouped = _find_groups(block_table, eligible, num_cache_blocks, grouping)
    else:
        leader = requests.clone()
        prefix = torch.zeros(num_requests, dtype=torch.int64, device=device)
        grouped = torch.zeros(num_requests, dtype=torch.bool, device=device)

    is_leader = grouped & (leader == requests)
    group_size = torch.zeros(num_requests, dtype=torch.int64, device=device)
    group_size.scatter_add_(0, leader, grouped.to(torch.int64))
    group_size = torch.where(is_leader, group_size, 0)
    tiles_per_group = torch.div(group_size + members_per_tile - 1, members_per_tile, rounding_mode="floor")
    first_tile = _exclusive_cumsum(tiles_per_group)
    first_member = _exclusive_cumsum(group_size)
    order = torch.argsort(torch.where(grouped, leader, num_requests) * num_requests + requests)
    position = torch.empty_like(order)
    position[order] = requests
    rank = position - first_member[leader]
    tile_of = torch.where(grouped, first_tile[leader] + torch.div(rank, members_per_tile, rounding_mode="floor"), -1)
    slot = torch.where(grouped, rank % members_per_tile, 0)

    spare_tile = num_requests
    tile_index = torch.where(grouped, tile_of, spare_tile)
    tile_members = torch.full(((num_requests + 1) * members_per_tile,), -1, dtype=torch.int64, device=device)
    tile_members.scatter_(0, tile_index * members_per_tile + slot, requests)
    tile_members = tile_members[: num_requests * members_per_tile].view(num_requests, members_per_tile)
    tile_leader = torch.zeros(num_requests + 1, dtype=torch.int64, device=device)
    tile_leader.scatter_(0, tile_index, leader)
    tile_prefix = torch.zeros(num_requests + 1, dtype=torch.int64, device=device)
    tile_prefix.scatter_(0, tile_index, prefix)
    tile_leader, tile_prefix = tile_leader[:num_requests], tile_prefix[:num_requests]

    prefix_work_start, prefix_split = _work_list(tile_prefix * block_size, target_items, config.split_granularity)
    suffix_lengths = (seq - prefix * block_size).clamp_min(0)
    suffix_work_start, suffix_split = _work_list(suffix_lengths, target_items, config.split_granularity)

    num_groups = is_leader.sum().reshape(1)
    num_grouped = grouped.sum().reshape(1)
    saved = (prefix.sum() - torch.where(is_leader, prefix, 0).sum()).reshape(1)

    def as_int32(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(torch.int32).contiguous()

    return ForestPlan(
        block_table=block_table,
        seq_lens=as_int32(seq),
        query_start_loc=as_int32(query_start_loc),
        prefix_blocks=as_int32(prefix),
        group_leader=as_int32(leader),
        tile_of=as_int32(tile_of),
        slot_in_tile=as_int32(slot),
        tile_leader=as_int32(tile_leader),
        tile_prefix_blocks=as_int32(tile_prefix),
        tile_members=as_int32(tile_members),
        prefix_work_start=prefix_work_start,
        prefix_split_tokens=prefix_split,
        suffix_work_start=suffix_work_start,
        suffix_split_tokens=suffix_split,
        num_groups=num_groups,
        num_grouped_requests=num_grouped,
        saved_block_reads=saved,
        block_size=block_size,
        max_query_len=max_query_len,
        queries_per_kv=queries_per_kv,
        num_kv_heads=num_kv_heads,
        members_per_tile=members_per_tile,
        prefix_block_m=prefix_block_m,
        max_prefix_work=target_items + num_requests,
        max_suffix_work=target_items + num_requests,
        shares=grouping is not None,
        config=config,
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
) -> ForestPlan:
    """Find the groups of a decode batch and build the work lists of ``forest_decode``.

    Args:
        block_table: ``[N, max_blocks]`` int32 physical KV block ids per request (paged KV cache).
        seq_lens: ``[N]`` tokens per request in the KV cache, including this step's query tokens.
        query_start_loc: ``[N + 1]`` offsets of each request's query tokens in the packed query ``[T, H_q, D]``.
        block_size: tokens per KV block.
        num_cache_blocks: number of blocks in the KV cache (block ids are ``< num_cache_blocks``).
        max_query_len: upper bound of the query tokens of any request this step (1 for plain decode).
        queries_per_kv: query heads per KV head (GQA ratio).
        num_kv_heads: KV heads per layer (sizes the work so one pass fills the device).
        grouping: which groups to use (defaults to ``ForestGrouping()``).
        config: kernel tile and split sizes (defaults to ``ForestKernelConfig()``).

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
        config=config if config is not None else ForestKernelConfig(),
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
) -> ForestPlan:
    """A plan with no groups: every request reads its whole context (the per-request paged decode)."""
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
    )
