"""The ``triton`` backend as an ``autograd.Function``: fused forward, fused backward (dK/dV and dQ kernels)."""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from arctic_dedup.attention._launch import launch_backward, launch_forward
from arctic_dedup.attention.metadata import TreeAttentionMetadata
from arctic_dedup.attention.triton_config import TritonConfig, default_triton_config

__all__ = ["TreeAttentionFunction", "triton_tree_attention"]


class TreeAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: TreeAttentionMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
        config: TritonConfig,
        deterministic: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        out, lse = launch_forward(
            query, key, value, metadata, scale=scale, sliding_window=sliding_window, softcap=softcap, config=config
        )
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.prepared = metadata
        ctx.options = (scale, sliding_window, softcap, config, deterministic)
        ctx.set_materialize_grads(False)
        # lse is kept [Hq, T] for the kernels; callers get [T, Hq].
        return out, lse.t().contiguous()

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        scale, sliding_window, softcap, config, deterministic = ctx.options
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = launch_backward(
            grad_out,
            query,
            key,
            value,
            out,
            lse,
            grad_lse,
            ctx.prepared,
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
            config=config,
            deterministic=deterministic,
        )
        return dq, dk, dv, None, None, None, None, None, None


def triton_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    metadata: TreeAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    config: TritonConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``triton`` backend: (out ``[T, Hq, D]``, lse ``[T, Hq]``), differentiable in q, k, v (and through lse).

    ``metadata``: ``prepare_tree_attention(plan, backends=("triton",), ...)`` with the same ``config`` (tile sizes
    and launch settings; ``default_triton_config`` when None) and ``sliding_window``.
    """
    if config is None:
        config = default_triton_config(query.shape[2], query.device, query.dtype)
    result: tuple[torch.Tensor, torch.Tensor] = TreeAttentionFunction.apply(
        query, key, value, metadata, scale, sliding_window, softcap, config, deterministic
    )
    return result
