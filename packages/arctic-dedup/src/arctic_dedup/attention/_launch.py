"""Launchers for the tree-attention Triton kernels: checks, allocation, block tables and grids."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from arctic_dedup._triton_support import interpreting
from arctic_dedup.attention.metadata import TreeAttentionMetadata
from arctic_dedup.attention.triton_config import TritonConfig, default_triton_config

if TYPE_CHECKING:
    from arctic_dedup.plan import Plan

__all__ = ["TritonConfig", "default_triton_config", "launch_backward", "launch_forward"]

# Tests set this to fill every new output with NaN, so an element a kernel forgets to write fails the comparison.
poison_outputs = False


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if poison_outputs:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products (tests hold them to 1e-5); tf32 would give about 1e-3.
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    # bf16/fp16 tl.dot gives wrong results in the CPU interpreter; compute in fp32 there.
    return interpreting() and dtype != torch.float32


def _check_contiguous_last(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.stride(-1) != 1:
            raise ValueError(f"expected unit stride along the head dim, got strides {tensor.stride()}.")


def _mask_arguments(softcap: float | None, sliding_window: int | None) -> tuple[float, int, bool, bool]:
    return (
        1.0 if softcap is None else float(softcap),
        0 if sliding_window is None else int(sliding_window),
        softcap is not None,
        sliding_window is not None,
    )


def launch_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    metadata: TreeAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    config: TritonConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, Hq, D]``, ``[T, Hkv, D]`` x2 -> (out ``[T, Hq, D]``, lse ``[Hq, T]`` fp32 natural log)."""
    from arctic_dedup.attention._kernels import tree_attention_fwd_kernel

    config.validate()
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    out = _empty(tuple(query.shape), query.dtype, query.device)
    lse = _empty((num_q_heads, num_tokens), torch.float32, query.device)
    plan = metadata.plan
    tables = metadata.tables(config.block_m, config.block_n, sliding_window)
    cap, window, use_cap, use_window = _mask_arguments(softcap, sliding_window)
    grid = (num_q_heads, tables.num_q_blocks)
    tree_attention_fwd_kernel[grid](
        query, key, value, out, lse,
        tables.kv_full_num, tables.kv_full_indices, tables.kv_part_num, tables.kv_part_indices, tables.q_block_order,
        plan.kv_visible_until, _positions(plan, sliding_window),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        out.stride(0), out.stride(1), tables.kv_full_indices.stride(0),
        num_tokens, float(scale), cap, window,
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        SOFTCAP=use_cap, WINDOW=use_window, UPCAST=_upcast(query.dtype), DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out, lse


def _positions(plan: Plan, sliding_window: int | None) -> torch.Tensor:
    """Logical positions as int32 with a sliding window; without one the kernels ignore them (any int32 [T])."""
    if sliding_window is None:
        return plan.kv_visible_until
    return plan.position_ids.to(torch.int32)


def _backward_statistics(lse: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """What the backward kernels read per query with ``fold_statistics``: ``lse / scale`` (subtracted from ``q.k``
    inside the product) or, with a softcap, ``lse * log2(e)`` (subtracted from the log2-domain score)."""
    if softcap is None:
        return lse / scale
    return lse * math.log2(math.e)


def launch_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_lse: torch.Tensor | None,
    metadata: TreeAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    config: TritonConfig,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``[T, Hq, D]`` out (and optionally of lse ``[T, Hq]``) -> dq, dk, dv in the input dtypes."""
    from arctic_dedup.attention._kernels import (
        tree_attention_bwd_dkdv_kernel,
        tree_attention_bwd_dq_kernel,
        tree_attention_bwd_preprocess_kernel,
    )

    config.validate()
    grad_out = grad_out.contiguous()
    _check_contiguous_last(query, key, value, out)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_q_heads // num_kv_heads
    device = query.device
    delta = _empty((num_q_heads, num_tokens), torch.float32, device)
    preprocess_block = 64 if not interpreting() else 16
    tree_attention_bwd_preprocess_kernel[(triton_cdiv(num_tokens, preprocess_block), num_q_heads)](
        out, grad_out, delta, out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1), num_tokens,
        HEAD_DIM=head_dim, BLOCK_M=preprocess_block,
    )  # fmt: skip
    if grad_lse is not None:
        # d lse / d score = p, so the lse gradient folds into delta: ds = p * (dp - (delta - dlse)).
        delta -= grad_lse.t().float()
    cap, window, use_cap, use_window = _mask_arguments(softcap, sliding_window)
    upcast = _upcast(query.dtype)
    precision = _dot_precision(query.dtype)
    plan = metadata.plan
    positions = _positions(plan, sliding_window)
    fold = config.fold_statistics
    statistics = _backward_statistics(lse, scale, softcap) if fold else lse
    atomic = config.atomic_dq and not deterministic
    dk = _empty(tuple(key.shape), key.dtype, device)
    dv = _empty(tuple(value.shape), value.dtype, device)
    if atomic:
        dq_accumulator = torch.zeros(tuple(query.shape), dtype=torch.float32, device=device)
    else:
        dq_accumulator = _empty(tuple(query.shape), query.dtype, device)
    tables = metadata.tables(config.bwd_block_m, config.bwd_block_n, sliding_window)
    tree_attention_bwd_dkdv_kernel[(num_kv_heads, tables.num_k_blocks)](
        query, key, value, grad_out, statistics, delta, dq_accumulator, dk, dv,
        tables.q_full_num, tables.q_full_indices, tables.q_part_num, tables.q_part_indices, tables.k_block_order,
        plan.kv_visible_until, positions,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        grad_out.stride(0), grad_out.stride(1), dq_accumulator.stride(0), dq_accumulator.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), tables.q_full_indices.stride(0),
        num_tokens, float(scale), cap, window,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=config.bwd_block_m, BLOCK_N=config.bwd_block_n,
        SOFTCAP=use_cap, WINDOW=use_window, UPCAST=upcast, ATOMIC_DQ=atomic, FOLD=fold,
        DP_FIRST=config.dp_first, DQ_SPLIT=config.split_atomic_dq and head_dim >= 32, DOT_PRECISION=precision,
        num_warps=config.bwd_num_warps, num_stages=config.bwd_num_stages,
    )  # fmt: skip
    if atomic:
        return dq_accumulator.to(query.dtype), dk, dv
    dq = dq_accumulator
    dq_tables = metadata.tables(config.dq_block_m, config.dq_block_n, sliding_window)
    tree_attention_bwd_dq_kernel[(num_q_heads, dq_tables.num_q_blocks)](
        query, key, value, grad_out, statistics, delta, dq,
        dq_tables.kv_full_num, dq_tables.kv_full_indices, dq_tables.kv_part_num, dq_tables.kv_part_indices,
        dq_tables.q_block_order, plan.kv_visible_until, positions,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1), dq_tables.kv_full_indices.stride(0),
        num_tokens, float(scale), cap, window,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=config.dq_block_m, BLOCK_N=config.dq_block_n,
        SOFTCAP=use_cap, WINDOW=use_window, UPCAST=upcast, FOLD=fold, DOT_PRECISION=precision,
        num_warps=config.dq_num_warps, num_stages=config.dq_num_stages,
    )  # fmt: skip
    return dq, dk, dv


def triton_cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)
