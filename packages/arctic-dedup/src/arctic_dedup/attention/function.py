"""The ``triton`` backend as an ``autograd.Function``: fused forward, fused backward (dK/dV and dQ kernels)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import once_differentiable

from arctic_dedup.attention._launch import TritonConfig, default_triton_config, launch_backward, launch_forward

if TYPE_CHECKING:
    from arctic_dedup.plan import Plan

__all__ = ["TreeAttentionFunction", "triton_tree_attention"]


class TreeAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        plan: Plan,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
        config: TritonConfig,
        deterministic: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        out, lse = launch_forward(
            query, key, value, plan, scale=scale, sliding_window=sliding_window, softcap=softcap, config=config
        )
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan = plan
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
            ctx.plan,
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
    plan: Plan,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    config: TritonConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``triton`` backend: (out ``[T, Hq, D]``, lse ``[T, Hq]``), differentiable in q, k, v (and through lse).

    ``config`` overrides tile sizes and launch settings (``default_triton_config`` otherwise).
    """
    if config is None:
        config = default_triton_config(query.shape[2], query.device, query.dtype)
    result: tuple[torch.Tensor, torch.Tensor] = TreeAttentionFunction.apply(
        query, key, value, plan, scale, sliding_window, softcap, config, deterministic
    )
    return result
