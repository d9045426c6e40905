"""The forest plan's types: the grouping rule, the kernel config, the planner's workspace and the plan itself.

``plan.py`` builds plans, ``_launch.py`` launches the planner and decode kernels over them; both read these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ForestGrouping", "ForestKernelConfig", "ForestPlan", "ForestScratch", "ForestWorkspace", "PlanSizes"]


@dataclass(frozen=True)
class ForestGrouping:
    """Which shared prefixes are worth a grouped prefix pass.

    Attributes:
        min_group_size: fewest requests that must share a prefix for it to be read once for all of them.
        min_additional_prefix_blocks: fewest shared full KV blocks a group needs; shorter prefixes are read per request.
        min_non_singleton_fraction: if fewer than this fraction of the batch's requests end up in groups, no request is
            grouped (the whole batch runs per request).
        max_non_singleton_groups: if more than this many groups are found, no request is grouped; 0 means no limit.
    """

    min_group_size: int = 2
    min_additional_prefix_blocks: int = 1
    min_non_singleton_fraction: float = 0.0
    max_non_singleton_groups: int = 0

    def __post_init__(self) -> None:
        if self.min_group_size < 2:
            raise ValueError(f"min_group_size must be >= 2 (a group shares a prefix), got {self.min_group_size}")
        if self.min_additional_prefix_blocks < 1:
            raise ValueError(f"min_additional_prefix_blocks must be >= 1, got {self.min_additional_prefix_blocks}")
        if not 0.0 <= self.min_non_singleton_fraction <= 1.0:
            raise ValueError(f"min_non_singleton_fraction must be in [0, 1], got {self.min_non_singleton_fraction}")
        if self.max_non_singleton_groups < 0:
            raise ValueError(
                f"max_non_singleton_groups must be >= 0 (0: no limit), got {self.max_non_singleton_groups}"
            )


@dataclass(frozen=True)
class ForestKernelConfig:
    """Tile shapes and work sizes of the decode kernels (tuned by ``benchmarks/fca_decode.py``).

    Attributes:
        prefix_block_m: rows of one prefix tile (GQA heads x query tokens x requests); a power of two >= 16.
        prefix_block_n: KV tokens per inner step of a prefix (group) work item.
        suffix_block_n: KV tokens per inner step of a suffix (per-request) work item.
        num_warps, num_stages: Triton launch options of the attention kernel (prefix and suffix items share them).
        prefix_waves: prefix items are sized so that about ``prefix_waves * multiprocessors`` programs read prefixes.
        waves: suffix items are sized so that about ``waves * multiprocessors`` programs read suffixes.
        split_granularity: split lengths are rounded up to a multiple of this many tokens.
        multiprocessors: the device's multiprocessor count; ``None`` reads it from the device (8 on CPU).
        split_passes: a plan with groups runs its prefix items as a launch of their own, then its suffix items, on
            the caller's stream; with dependent launches the suffix pass is scheduled once every prefix program has
            started (the prefix programs fill the device first) and waits for the prefix pass only at its end.
        combine_dim_block: head dims merged by one combine program (``None``: the whole head); a power of two >= 16.
        combine_num_warps: warps per combine program (1, 2, 4 or 8). The combine is latency-bound: narrower
            programs (fewer dims, fewer warps, fewer partials at a time) fit more of them on a multiprocessor, so
            it takes fewer waves.
        combine_chunk_cap: most partials a combine program loads at once (a power of two; more take more rounds).
        dependent_launches: programmatic dependent launch on CUDA devices of compute capability 9.0 and newer: each
            launch of the plan and the decode is scheduled while the launch before it on its stream finishes, and
            its programs wait on the device for that launch's results (same results, shorter launch gaps; also
            inside CUDA graphs). Ignored on other devices and under the Triton interpreter.
        early_combine: every attention item that writes a partial then counts itself done for its requests
            (``ForestPlan.combine_ready``), and each combine program merges its request as soon as that count is
            complete instead of after the whole attention launch; with dependent launches the combine then runs
            under the attention's last programs (same results; the last program to merge a request clears its
            count again).
    """

    prefix_block_m: int = 64
    prefix_block_n: int = 32
    suffix_block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3
    prefix_waves: float = 2.0
    waves: float = 2.0
    split_granularity: int = 128
    multiprocessors: int | None = None
    split_passes: bool = False
    combine_dim_block: int | None = None
    combine_num_warps: int = 4
    combine_chunk_cap: int = 16
    dependent_launches: bool = False
    early_combine: bool = False

    def __post_init__(self) -> None:
        for name in ("prefix_block_m", "prefix_block_n", "suffix_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        dim_block = self.combine_dim_block
        if dim_block is not None and (dim_block < 16 or dim_block & (dim_block - 1)):
            raise ValueError(f"combine_dim_block must be a power of two >= 16 or None, got {dim_block}")
        if self.combine_num_warps not in (1, 2, 4, 8):
            raise ValueError(f"combine_num_warps must be 1, 2, 4 or 8, got {self.combine_num_warps}")
        if self.combine_chunk_cap < 1 or self.combine_chunk_cap & (self.combine_chunk_cap - 1):
            raise ValueError(f"combine_chunk_cap must be a power of two >= 1, got {self.combine_chunk_cap}")
        if self.split_granularity < 1:
            raise ValueError(f"split_granularity must be >= 1, got {self.split_granularity}")
        if self.waves <= 0 or self.prefix_waves <= 0:
            raise ValueError(f"waves and prefix_waves must be > 0, got {self.waves} and {self.prefix_waves}")


class ForestWorkspace:
    """Device scratch of the group finder, zero between plans: keep one per KV cache and reuse it every step.

    Holds a block histogram and a leader slot per cache block (``2 * (num_cache_blocks + 1)`` int32) and a ticket
    counter. Each plan leaves it zero again, so steady-state planning needs no memset; plans that share a workspace
    must run in stream order (one planner, one stream).
    """

    def __init__(self, num_cache_blocks: int, device: torch.device | str) -> None:
        if num_cache_blocks < 1:
            raise ValueError(f"num_cache_blocks must be >= 1, got {num_cache_blocks}")
        self.num_cache_blocks = num_cache_blocks
        buffer = torch.zeros(2 * num_cache_blocks + 1, dtype=torch.int32, device=device)
        self.counts = buffer[:num_cache_blocks]
        self.leader_slots = buffer[num_cache_blocks : 2 * num_cache_blocks]
        self.ticket = buffer[2 * num_cache_blocks :]

    @property
    def device(self) -> torch.device:
        return self.counts.device


class ForestScratch:
    """Float32 scratch for the partial results of decode calls that never run at the same time (one stream), shared
    by the static plans of one model so that a plan per captured batch size does not hold scratch of its own.

    ``take`` hands out the front of one buffer; a request larger than the buffer allocates a new one (plans that
    recorded the old buffer's address keep it alive through their recorded launches), so handing out the largest
    request first, as vLLM does by capturing its largest batch size first, keeps a single buffer.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, numel: int, device: torch.device) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None or buffer.numel() < numel or buffer.device != device:
            buffer = self._buffer = torch.empty(numel, dtype=torch.float32, device=device)
        return buffer[:numel]


@dataclass(frozen=True)
class ForestPlan:
    """One decode step's grouping and work lists; built once per step, read by every layer.

    Per request ``[N]`` (int32): ``prefix_blocks`` (shared full blocks read by the group pass, 0 when ungrouped),
    ``group_leader`` (the request whose block table row holds the group's prefix; itself when ungrouped),
    ``tile_of`` (prefix tile, -1 when ungrouped), ``slot_in_tile``.
    Per tile ``[N]`` (the first ``num_tiles`` entries are set): ``tile_leader``, ``tile_prefix_blocks``,
    ``tile_member_start`` / ``tile_member_count`` (a range of ``member_list [N]``, the grouped requests in tile order).
    Work list: ``work_start [2N + 1]``, the first work item of each owner; owners ``0..N-1`` are tiles (prefix items
    of ``split_tokens[0]`` tokens), owners ``N..2N-1`` are requests (suffix items of ``split_tokens[1]`` tokens); a
    remainder under an eighth of a split joins the owner's last item.
    Stats (int32 ``[1]`` views): ``num_groups``, ``num_grouped_requests``, ``saved_block_reads`` (per kv head, layer);
    ``stats [3]`` views all three (copy it to keep a step's counters when the plan's buffers are reused).
    ``combine_ready [N * H_kv]``: per (request, kv head), the attention items done so far in a decode call with
    ``ForestKernelConfig.early_combine``; zero after planning and again after every such call, so the decode calls
    of one plan must run in stream order.
    ``leaves_ungrouped``: the decode attends only the grouped requests (writes only their rows); the caller attends
    the others itself, over ``standard_seq_lens [N]`` (int32: a request's length where it is ungrouped, 0 where it is
    grouped, so a standard paged kernel given these lengths attends exactly the requests this plan leaves out);
    ``standard_seq_lens`` is ``None`` for a plan that leaves nothing out.
    ``persistent``: the plan of a ``StaticForestPlan``, refilled in place every step (its recorded launches are never
    dropped, since a captured CUDA graph may hold their scratch). ``scratch``: where its decode calls take their
    partial buffers (``None``: each new tensor layout allocates its own).
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
    tile_member_start: torch.Tensor
    tile_member_count: torch.Tensor
    member_list: torch.Tensor
    work_start: torch.Tensor
    split_tokens: torch.Tensor
    num_groups: torch.Tensor
    num_grouped_requests: torch.Tensor
    saved_block_reads: torch.Tensor
    stats: torch.Tensor
    combine_ready: torch.Tensor
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
    leaves_ungrouped: bool = False
    standard_seq_lens: torch.Tensor | None = None
    persistent: bool = False
    scratch: ForestScratch | None = field(default=None, compare=False, repr=False)
    # The launches of this plan's first decode call per tensor layout, replayed by later layers (forest/_replay.py);
    # filled by forest_decode, never copied by dataclasses.replace.
    launches: dict[tuple[Any, ...], tuple[Any, ...]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    # The torch path's gather indices per (block size, device), built by its first call of this plan
    # (forest/_torch_decode.py); never copied by dataclasses.replace, dropped when a persistent plan is refilled.
    torch_indices: dict[tuple[Any, ...], Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass(frozen=True)
class PlanSizes:
    """Host-side sizes of a plan: everything the launches need that does not depend on the tables' contents."""

    num_requests: int
    members_per_tile: int
    prefix_block_m: int
    prefix_target_items: int
    suffix_target_items: int
    max_prefix_work: int
    max_suffix_work: int
