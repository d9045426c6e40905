"""Launchers for the forest decode kernels: checks, allocation and grids (no data-dependent host reads)."""

from __future__ import annotations

import math

import torch

from arctic_dedup._triton_support import interpreting
from arctic_dedup.errors import PlanError
from arctic_dedup.forest.plan import ForestPlan

__all__ = ["check_decode_inputs", "launch_forest_decode"]


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


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


def launch_forest_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: ForestPlan,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    from arctic_dedup.forest._kernels import combine_kernel, prefix_attention_kernel, suffix_attention_kernel

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
    prefix_warps = max(config.prefix_num_warps, 8) if wide else config.prefix_num_warps
    prefix_block_n = min(config.prefix_block_n, 64) if wide else config.prefix_block_n
    suffix_block_n = min(config.suffix_block_n, 64) if wide else config.suffix_block_n
    device = query.device
    table = plan.block_table
    k_strides = key_cache.stride()
    v_strides = value_cache.stride()
    q_strides = query.stride()

    suffix_out = torch.empty(
        plan.max_suffix_work * num_kv_heads * suffix_block_m * head_dim, dtype=torch.float32, device=device
    )
    suffix_lse = torch.empty(plan.max_suffix_work * num_kv_heads * suffix_block_m, dtype=torch.float32, device=device)
    suffix_attention_kernel[(plan.max_suffix_work, num_kv_heads)](
        query,
        key_cache,
        value_cache,
        table,
        plan.query_start_loc,
        plan.seq_lens,
        plan.prefix_blocks,
        plan.suffix_work_start,
        plan.suffix_split_tokens,
        suffix_out,
        suffix_lse,
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
        head_dim,
        num_kv_heads,
        NUM_REQUESTS=num_requests,
        SEARCH_STEPS=max(1, math.ceil(math.log2(num_requests + 1))) + 1,
        G=group_size,
        QMAX=query_max,
        PAGE=plan.block_size,
        BLOCK_M=suffix_block_m,
        BLOCK_N=suffix_block_n,
        HEAD_DIM=head_block,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        num_warps=config.suffix_num_warps,
        num_stages=config.suffix_num_stages,
    )

    if plan.shares:
        prefix_block_m = plan.prefix_block_m
        prefix_out = torch.empty(
            plan.max_prefix_work * num_kv_heads * prefix_block_m * head_dim, dtype=torch.float32, device=device
        )
        prefix_lse = torch.empty(
            plan.max_prefix_work * num_kv_heads * prefix_block_m, dtype=torch.float32, device=device
        )
        prefix_attention_kernel[(plan.max_prefix_work, num_kv_heads)](
            query,
            key_cache,
            value_cache,
            table,
            plan.query_start_loc,
            plan.tile_leader,
            plan.tile_members,
            plan.tile_prefix_blocks,
            plan.prefix_work_start,
            plan.prefix_split_tokens,
            prefix_out,
            prefix_lse,
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
            head_dim,
            num_kv_heads,
            NUM_TILES=num_requests,
            SEARCH_STEPS=max(1, math.ceil(math.log2(num_requests + 1))) + 1,
            MEMBERS=plan.members_per_tile,
            G=group_size,
            QMAX=query_max,
            PAGE=plan.block_size,
            BLOCK_M=prefix_block_m,
            BLOCK_N=prefix_block_n,
            HEAD_DIM=head_block,
            UPCAST=upcast,
            DOT_PRECISION=precision,
            num_warps=prefix_warps,
            num_stages=config.prefix_num_stages,
        )
    else:
        prefix_block_m = 16
        prefix_out = suffix_out
        prefix_lse = suffix_lse

    combine_kernel[(num_requests, num_kv_heads)](
        out,
        lse,
        plan.query_start_loc,
        plan.tile_of,
        plan.slot_in_tile,
        plan.prefix_work_start,
        prefix_out,
        prefix_lse,
        plan.suffix_work_start,
        suffix_out,
        suffix_lse,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse.stride(0),
        lse.stride(1),
        head_dim,
        num_kv_heads,
        HAS_PREFIX=plan.shares,
        G=group_size,
        QMAX=query_max,
        PREFIX_BLOCK_M=prefix_block_m,
        SUFFIX_BLOCK_M=suffix_block_m,
        BLOCK_R=max(16, _next_power_of_two(rows_per_request)),
        HEAD_DIM=head_block,
        num_warps=4 if head_block * rows_per_request <= 4096 else 8,
    )
