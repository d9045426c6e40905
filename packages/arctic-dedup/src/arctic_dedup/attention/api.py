"""``tree_attention``: exact attention over a plan's prefix tree, one function in front of every backend."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal, get_args, overload

import torch

from arctic_dedup._triton_support import interpreting, triton_available
from arctic_dedup.attention.auto import BACKENDS, ConcreteBackend, TreeAttentionBackend, choose_backend
from arctic_dedup.attention.metadata import TreeAttentionMetadata, prepare_tree_attention
from arctic_dedup.attention.reference import MAX_REFERENCE_SCORES, tree_attention_reference
from arctic_dedup.errors import PlanError

if TYPE_CHECKING:
    from arctic_dedup.plan import Plan

__all__ = ["SUPPORTED_DTYPES", "SUPPORTED_HEAD_DIMS", "auto_backends", "tree_attention"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Only the reference computes in float64 (for exact tests of whole models); the fused backends refuse it.
REFERENCE_ONLY_DTYPES = (torch.float64,)
# 64, 128 and 256 are the head dims of the supported models; 16 and 32 keep interpreter tests cheap.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


def _check_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: Plan,
    scale: float | None,
    sliding_window: int | None,
    softcap: float | None,
    backend: str,
) -> None:
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
            raise ValueError(
                f"{name} must be a [T, H, D] tensor, got {getattr(tensor, 'shape', type(tensor))}; flatten the "
                "batch into the packed stream (one row per packed token) first."
            )
        if tensor.dtype not in SUPPORTED_DTYPES + REFERENCE_ONLY_DTYPES:
            raise TypeError(
                f"{name} must be bfloat16, float16 or float32 (or float64 with backend='reference'), got "
                f"{tensor.dtype}."
            )
    num_tokens = plan.num_packed_tokens
    if query.shape[0] != num_tokens:
        raise PlanError(
            f"query has {query.shape[0]} rows but the plan packs {num_tokens} tokens; pass the packed stream of this "
            "plan (pack(x, plan)), not the per-sample tokens."
        )
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same [T, Hkv, D].")
    if key.shape[0] != num_tokens:
        raise PlanError(f"key/value have {key.shape[0]} rows but the plan packs {num_tokens} tokens.")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"query head dim {query.shape[2]} differs from key/value head dim {key.shape[2]}.")
    if query.shape[2] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim must be one of {SUPPORTED_HEAD_DIMS}, got {query.shape[2]}.")
    num_q_heads, num_kv_heads = query.shape[1], key.shape[1]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"the number of query heads ({num_q_heads}) must be a multiple of the number of key/value heads "
            f"({num_kv_heads}) (grouped-query attention)."
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}.")
    plan_device = plan.kv_visible_until.device
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.device != plan_device:
            raise PlanError(f"{name} is on {tensor.device} but the plan is on {plan_device}; build the plan there.")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float or None, got {scale!r}.")
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 1):
        raise ValueError(
            f"sliding_window must be an int >= 1 (tokens, in logical positions) or None, got {sliding_window!r}."
        )
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite float or None, got {softcap!r}.")
    if backend not in get_args(TreeAttentionBackend):
        raise ValueError(f"backend must be one of {get_args(TreeAttentionBackend)}, got {backend!r}.")


def _require_triton(query: torch.Tensor) -> None:
    if not triton_available():
        raise RuntimeError("backend='triton' needs the `triton` package (pip install triton); use backend='flex'.")
    if not (query.is_cuda or (query.device.type == "cpu" and interpreting())):
        raise RuntimeError(
            f"backend='triton' runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1, set before triton is "
            f"imported, for tests); got a {query.device.type} tensor. Use backend='flex' or 'reference' there."
        )


def _sum_of_squared_tree_lengths(plan: Plan) -> int:
    lengths = plan.tree.cu_seqlens_trees[1:] - plan.tree.cu_seqlens_trees[:-1]
    return int((lengths.long() * lengths.long()).sum())


def _reference_tree_by_tree(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: Plan,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense reference, tree by tree: the same function as one dense mask over the whole stream (no query sees
    another tree's keys), with ``sum(tree_len^2)`` instead of ``T^2`` scores, so a non-deduplicated batch costs what
    per-sample attention costs."""
    if plan.tree.num_trees == 1:
        return tree_attention_reference(
            query,
            key,
            value,
            plan.kv_visible_until,
            position_ids=plan.position_ids,
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
        )
    total = query.shape[1] * _sum_of_squared_tree_lengths(plan)
    if total > MAX_REFERENCE_SCORES:
        raise ValueError(
            f"backend='reference' needs Hq * sum(tree length^2) = {total} scores even tree by tree, over its limit "
            f"of {MAX_REFERENCE_SCORES}; use backend='flex' or 'triton' on a GPU for this size."
        )
    bounds = plan.tree.cu_seqlens_trees.tolist()
    outputs, lses = [], []
    for start, end in itertools.pairwise(bounds):
        out, lse = tree_attention_reference(
            query[start:end],
            key[start:end],
            value[start:end],
            plan.kv_visible_until[start:end] - start,
            position_ids=plan.position_ids[start:end],
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
        )
        outputs.append(out)
        lses.append(lse)
    return torch.cat(outputs), torch.cat(lses)


def _run_backend(
    backend: ConcreteBackend,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: Plan,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    return_lse: bool,
    deterministic: bool,
    metadata: TreeAttentionMetadata | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if backend == "reference":
        return _reference_tree_by_tree(query, key, value, plan, scale, sliding_window, softcap)
    if backend == "varlen":
        from arctic_dedup.attention.varlen import varlen_tree_attention

        return varlen_tree_attention(
            query, key, value, plan, scale=scale, sliding_window=sliding_window, softcap=softcap
        )
    metadata = _metadata_for(backend, query, plan, sliding_window, metadata)
    if backend == "flex":
        from arctic_dedup.attention.flex import flex_tree_attention

        return flex_tree_attention(
            query,
            key,
            value,
            metadata,
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
            return_lse=return_lse,
        )
    if backend == "triton":
        from arctic_dedup.attention.function import triton_tree_attention

        _require_triton(query)
        return triton_tree_attention(
            query,
            key,
            value,
            metadata,
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
            deterministic=deterministic,
        )
    from arctic_dedup.attention.sdpa import sdpa_tree_attention

    return sdpa_tree_attention(
        query,
        key,
        value,
        metadata,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        deterministic=deterministic,
    )


def _metadata_for(
    backend: ConcreteBackend,
    query: torch.Tensor,
    plan: Plan,
    sliding_window: int | None,
    metadata: TreeAttentionMetadata | None,
) -> TreeAttentionMetadata:
    """The caller's metadata when it was prepared for ``backend``; without one, this call's own (dropped after)."""
    if metadata is None:
        return prepare_tree_attention(
            plan, backends=(backend,), head_dim=query.shape[2], dtype=query.dtype, sliding_windows=(sliding_window,)
        )
    if backend not in metadata.backends:
        raise PlanError(
            f"this call runs backend={backend!r} but the metadata was prepared for {sorted(metadata.backends)}; "
            f"prepare it with backends including {backend!r} (for backend='auto', choose_backend gives the pick), "
            "or pass one of the prepared backends."
        )
    return metadata


def _auto_pick(
    query: torch.Tensor,
    num_kv_heads: int,
    plan: Plan,
    sliding_window: int | None,
    softcap: float | None,
    needs_grad: bool,
    lse_needs_grad: bool,
) -> ConcreteBackend:
    """``choose_backend`` with what the plan says about the trees."""
    reference_scores = None if query.is_cuda else query.shape[1] * _sum_of_squared_tree_lengths(plan)
    return choose_backend(
        query,
        num_kv_heads,
        sliding_window=sliding_window,
        softcap=softcap,
        needs_grad=needs_grad,
        reference_scores=reference_scores,
        tree_levels=plan.tree.num_levels,
        lse_needs_grad=lse_needs_grad,
        tokens_per_tree=plan.num_packed_tokens / max(plan.tree.num_trees, 1),
    )


def auto_backends(
    plan: Plan,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    sliding_windows: Iterable[int | None] = (None,),
    softcap: float | None = None,
    needs_grad: Iterable[bool] = (False, True),
) -> frozenset[ConcreteBackend]:
    """Every backend ``backend='auto'`` picks for layer calls over ``plan`` with these head counts, head dim, input
    dtype, windows and softcap, with and/or without a gradient (both by default: gradient checkpointing runs a
    layer without one, then again with one): what ``prepare_tree_attention`` must prepare for a model's layers."""
    probe = torch.empty((0, num_q_heads, head_dim), dtype=dtype, device=plan.device)
    return frozenset(
        _auto_pick(probe, num_kv_heads, plan, window, softcap, grad, False)
        for window in sliding_windows
        for grad in needs_grad
    )


@overload
def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: Plan,
    *,
    scale: float | None = ...,
    backend: TreeAttentionBackend = ...,
    sliding_window: int | None = ...,
    softcap: float | None = ...,
    return_lse: Literal[False] = ...,
    deterministic: bool = ...,
    metadata: TreeAttentionMetadata | None = ...,
) -> torch.Tensor: ...


@overload
def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: Plan,
    *,
    scale: float | None = ...,
    backend: TreeAttentionBackend = ...,
    sliding_window: int | None = ...,
    softcap: float | None = ...,
    return_lse: Literal[True],
    deterministic: bool = ...,
    metadata: TreeAttentionMetadata | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: Plan,
    *,
    scale: float | None = ...,
    backend: TreeAttentionBackend = ...,
    sliding_window: int | None = ...,
    softcap: float | None = ...,
    return_lse: bool,
    deterministic: bool = ...,
    metadata: TreeAttentionMetadata | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: Plan,
    *,
    scale: float | None = None,
    backend: TreeAttentionBackend = "auto",
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    metadata: TreeAttentionMetadata | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over the plan's prefix tree: every packed token attends to its ancestors' tokens and,
    causally, to its own node's tokens; never to siblings, cousins or other trees.

    Query ``q`` sees key ``k`` iff ``k <= q < plan.kv_visible_until[k]`` (and, with a sliding window ``W``,
    ``plan.position_ids[q] - plan.position_ids[k] < W``). The result equals running causal attention over every
    sample separately and packing the outputs.

    Args:
        query: ``[T, Hq, D]`` packed queries (``T = plan.num_packed_tokens``).
        key: ``[T, Hkv, D]`` packed keys; ``Hq`` must be a multiple of ``Hkv`` (grouped-query attention).
        value: ``[T, Hkv, D]`` packed values.
        plan: the micro-batch's plan (``build_plan`` / ``build_plan_from_layout``), on the inputs' device.
        scale: score scale; default ``1 / sqrt(D)``.
        backend: ``"auto"`` (see ``choose_backend``), ``"reference"`` (dense fp32, or float64 for float64
            inputs; small inputs only),
            ``"flex"`` (FlexAttention with a block mask from the plan), ``"triton"`` (fused kernels over the plan's
            block lists), ``"varlen"`` (flash-attention varlen calls per tree level, merged by log-sum-exp),
            ``"sdpa"`` (prompt + responses trees as dense calls to torch's fused kernels: cuDNN on Hopper).
        sliding_window: attend only to keys whose logical position is less than this many tokens behind the query
            (Mistral/Qwen convention: ``q_pos - k_pos < sliding_window``); None for full attention.
        softcap: cap scores as ``softcap * tanh(score / softcap)`` after scaling (Gemma 2 style); None for none.
        return_lse: also return the log-sum-exp of the (scaled, capped) scores.
        deterministic: make the backward pass bitwise reproducible (``triton`` then reduces dQ without atomics;
            ``sdpa`` runs FlashAttention-2's deterministic backward instead of cuDNN's on CUDA; the reference is
            deterministic anyway; ``flex`` and ``varlen`` follow ``torch.use_deterministic_algorithms``).
        metadata: the plan's ``prepare_tree_attention(plan, ...)``, built once and passed to every layer (block
            tables, ``sdpa`` calls); None prepares what this one call needs and drops it afterwards.

    Returns:
        ``[T, Hq, D]`` in the input dtype, or ``(out, lse)`` with lse ``[T, Hq]`` float32 (float64 for float64
        inputs), natural log.

    Differentiable in query, key and value through the output, and through the lse with ``triton`` and
    ``reference`` (``flex``: as far as the installed torch supports it; ``varlen`` and ``sdpa``: not, they raise).

    Supported: D in {64, 128, 256} (and 16, 32); bfloat16, float16, float32, and float64 on ``reference`` only
    (computed in float64 end to end; ``auto`` gets there on CPU when the reference fits, any other backend raises
    ``TypeError``). ``varlen`` takes bf16/fp16 on CUDA only and neither a sliding window nor a softcap (it raises
    ``NotImplementedError``; ``auto`` never picks it). ``sdpa`` runs prompt trees only (``plan.tree.num_levels <=
    2``), bf16/fp16 on CUDA and any float dtype on CPU, without sliding window, softcap or lse gradient.
    ``triton`` runs on CUDA (or on CPU under ``TRITON_INTERPRET=1``, for tests); ``reference`` refuses inputs with
    more than ``MAX_REFERENCE_SCORES`` scores.
    """
    _check_inputs(query, key, value, plan, scale, sliding_window, softcap, backend)
    if metadata is not None and metadata.plan is not plan:
        raise PlanError(
            "metadata was prepared for another plan; prepare it from this call's plan: "
            "prepare_tree_attention(plan, ...)."
        )
    resolved_scale = 1.0 / math.sqrt(query.shape[2]) if scale is None else float(scale)
    chosen: ConcreteBackend
    if backend == "auto":
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        chosen = _auto_pick(query, key.shape[1], plan, sliding_window, softcap, needs_grad, needs_grad and return_lse)
    else:
        assert backend in BACKENDS
        chosen = backend
    if query.dtype in REFERENCE_ONLY_DTYPES and chosen != "reference":
        picked = f"backend='auto' picked {chosen!r}" if backend == "auto" else f"backend={chosen!r} was asked for"
        raise TypeError(
            f"{query.dtype} inputs run only on backend='reference' (dense scores, small inputs; 'auto' picks it on "
            f"CPU when Hq * sum(tree length^2) <= MAX_REFERENCE_SCORES), but {picked} for a {query.shape[0]}-token "
            f"{query.device.type} input. Pass backend='reference', or cast to float32/bfloat16 for the fused "
            "backends."
        )
    out, lse = _run_backend(
        chosen, query, key, value, plan, resolved_scale, sliding_window, softcap, return_lse, deterministic, metadata
    )
    if return_lse:
        assert lse is not None
        return out, lse
    return out
