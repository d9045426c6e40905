"""Forest cascade decode: each group's shared KV prefix is read once for all its requests, merged by log-sum-exp."""

from __future__ import annotations

import torch

from arctic_dedup._triton_support import Backend, resolve_backend
from arctic_dedup.forest._launch import check_decode_inputs, launch_forest_decode, replay_forest_decode
from arctic_dedup.forest._torch_decode import forest_decode_torch
from arctic_dedup.forest.plan import ForestKernelConfig, ForestPlan, plan_paged

__all__ = ["forest_decode", "paged_decode"]


def forest_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: ForestPlan,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a paged KV cache that reads each group's shared prefix once (forest cascade attention).

    Two launches, sized on the device so the call never synchronizes and can be captured in a CUDA graph. The
    attention launch runs one program per (work item, kv head): prefix items first (a split of a group tile's shared
    prefix; the GQA query heads of up to ``plan.members_per_tile`` requests form the rows of one tensor-core matrix),
    then suffix items (a split of one request's own tokens after its group's prefix, causal within its query tokens).
    A request whose whole context is one suffix item writes its output directly; the combine launch merges every
    other request's partials by log-sum-exp. With no groups every request reads its whole context in suffix items,
    which is exactly ``paged_decode``. The first call of a plan (per tensor layout) sets the launches up and records
    them on the plan; later calls, such as the model's other layers, only launch them (no set-up, no argument
    binding). With ``plan.config.early_combine`` (``plan_forest``'s default rule) each
    combine program merges its request as soon as that request's own items are done, counting them in the plan
    (``ForestPlan.combine_ready``), so the calls that share one plan must run in stream order, as a model's layers do.

    Args:
        query: ``[T, H_q, D]`` query tokens of the step, packed by ``plan.query_start_loc``.
        key_cache: ``[num_blocks, block_size, H_kv, D]`` (any strides; permute head-major caches as a view).
        value_cache: same shape, dtype and device as ``key_cache`` (and as ``query``).
        plan: from ``plan_forest`` (or ``plan_paged``) for this step's block table, lengths and cache shape.
        scale: softmax scale, usually ``D ** -0.5``.
        out: optional ``[T, H_q, D]`` output buffer (the query's dtype); allocated when ``None``.
        lse: optional ``[T, H_q]`` float32 buffer for the log-sum-exp (natural log) of each query row.
        backend: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"torch"`` (batched torch ops, for CPU
            builds), or ``"auto"``.

    Returns:
        (out ``[T, H_q, D]``, lse ``[T, H_q]`` float32). Rows of query tokens beyond a request's query length are
        not written.
    """
    if out is None:
        out = torch.empty_like(query)
    if lse is None:
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    # The model's layers after the first: the plan holds this layout's launches, so the call only launches.
    if backend != "torch" and replay_forest_decode(query, key_cache, value_cache, plan, scale, out, lse):
        return out, lse
    check_decode_inputs(query, key_cache, value_cache, plan, out, lse)
    if resolve_backend(backend, query) == "triton":
        launch_forest_decode(query, key_cache, value_cache, plan, scale, out, lse)
    else:
        forest_decode_torch(query, key_cache, value_cache, plan, scale, out, lse)
    return out, lse


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int = 1,
    config: ForestKernelConfig | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request paged decode attention (split along the context so long sequences fill the device).

    Args:
        query: ``[T, H_q, D]``; key_cache, value_cache: ``[num_blocks, block_size, H_kv, D]`` (any strides).
        block_table: ``[N, max_blocks]`` int32; seq_lens: ``[N]`` (including query tokens);
        query_start_loc: ``[N + 1]``; scale: softmax scale; max_query_len: bound on query tokens per request.
        config, out, lse, backend: as in ``forest_decode``.

    Returns:
        (out ``[T, H_q, D]``, lse ``[T, H_q]`` float32, natural log).
    """
    plan = plan_paged(
        block_table,
        seq_lens,
        query_start_loc,
        block_size=key_cache.shape[1],
        max_query_len=max_query_len,
        queries_per_kv=query.shape[1] // max(1, key_cache.shape[2]),
        num_kv_heads=key_cache.shape[2],
        config=config,
    )
    return forest_decode(query, key_cache, value_cache, plan, scale, out=out, lse=lse, backend=backend)
