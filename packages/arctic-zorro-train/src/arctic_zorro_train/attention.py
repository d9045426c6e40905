"""Attention over the packed stream, reached through transformers' attention interface.

A patched attention module gets a config *view*: the module's own config with ``_attn_implementation`` answering
``"arctic_zorro"``, so the stock module code (projections, q/k norms, RoPE, the Qwen3.5 output gate, o_proj) runs
unchanged and only the attention product goes through ``zorro_attention``. Without a zorro context in the call
(a plain ``model(...)`` call), ``zorro_attention`` hands over to the implementation the model was loaded with.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from arctic_dedup import pack, unpack
from arctic_dedup.packing import gather_rows
from arctic_zorro_train.context import CONTEXT_KWARG, ZorroContext

__all__ = [
    "ZORRO_ATTENTION",
    "AttentionConfigView",
    "reconstruct_attention",
    "register_zorro_attention",
    "zorro_attention",
]

ZORRO_ATTENTION = "arctic_zorro"


class AttentionConfigView:
    """A read-through view of a module's config whose ``_attn_implementation`` is ``"arctic_zorro"``.

    Every other attribute reads (and writes) the wrapped config, so the view never goes stale. It remembers the
    implementation to fall back to without a zorro context, and whether the layer uses split (tree) attention.
    """

    def __init__(self, base: Any, fallback_implementation: str, use_split_attention: bool) -> None:
        object.__setattr__(self, "zorro_base_config", base)
        object.__setattr__(self, "zorro_fallback_implementation", fallback_implementation)
        object.__setattr__(self, "zorro_use_split_attention", use_split_attention)

    @property
    def _attn_implementation(self) -> str:
        return ZORRO_ATTENTION

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "zorro_base_config"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("zorro_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.zorro_base_config, name, value)

    def __repr__(self) -> str:
        base = type(self.zorro_base_config).__name__
        return f"AttentionConfigView({base}, fallback={self.zorro_fallback_implementation!r})"


def _fallback_attention(module: nn.Module, implementation: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling = sys.modules[type(module).__module__]
    eager: Callable[..., tuple[torch.Tensor, Any]] = modeling.eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)  # type: ignore[no-any-return]


def _tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context: ZorroContext,
    *,
    scale: float | None,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    from arctic_dedup.attention import tree_attention

    out = tree_attention(
        query,
        key,
        value,
        context.plan,
        scale=scale,
        backend=context.attention_backend,
        sliding_window=sliding_window,
        softcap=softcap,
        metadata=context.attention,
    )
    return out  # type: ignore[no-any-return]


def reconstruct_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context: ZorroContext,
    *,
    scale: float | None,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """The slower exact alternative: unpack q/k/v per sample, causal attention per sample, pack back.

    ``[T, H, D]`` in and out. Padding query rows attend to themselves only, so nothing is NaN anywhere.
    """
    maps = context.reconstruct
    if maps is None:
        raise RuntimeError("this layer runs reconstruct-then-attend but the context has no reconstruct maps.")
    num_tokens, num_q_heads, head_dim = query.shape
    batch, width = maps.valid.shape

    def per_sample(x: torch.Tensor) -> torch.Tensor:
        if maps.to_samples is None:
            rows = unpack(x, context.plan, padded=True)
        else:
            rows = gather_rows(x.reshape(num_tokens, -1), maps.to_samples).view(batch, width, *x.shape[1:])
        return rows.transpose(1, 2)

    q, k, v = per_sample(query), per_sample(key), per_sample(value)
    position = torch.arange(width, device=query.device)
    visible = (position[None, :] <= position[:, None]) & maps.valid[:, None, :]
    if sliding_window is not None:
        visible = visible & (position[:, None] - position[None, :] < sliding_window)
    visible = visible | torch.eye(width, dtype=torch.bool, device=query.device)
    scale = head_dim**-0.5 if scale is None else scale
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scale, enable_gqa=True)
    else:
        group = num_q_heads // key.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        dtype = torch.promote_types(q.dtype, torch.float32)
        scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v.to(dtype)).to(q.dtype)
    out = out.transpose(1, 2)
    if maps.to_packed is None:
        return pack(out, context.plan, padded=True)
    return gather_rows(out.reshape(batch * width, -1), maps.to_packed).view(num_tokens, num_q_heads, head_dim)


def zorro_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: ``[1, H, T, D]`` q/k/v -> ``([1, T, Hq, D], None)``."""
    context: ZorroContext | None = kwargs.pop(CONTEXT_KWARG, None)
    view = module.config
    if context is None:
        fallback = _fallback_attention(module, getattr(view, "zorro_fallback_implementation", "eager"))
        return fallback(module, query, key, value, attention_mask, **kwargs)  # type: ignore[return-value]
    if query.shape[0] != 1:
        raise ValueError(
            f"zorro attention expects the packed stream as one row [1, H, T, D], got query {tuple(query.shape)}."
        )
    if kwargs.get("dropout", 0.0):
        raise ValueError(
            f"attention dropout {kwargs['dropout']} is not supported by zorro attention; set "
            "config.attention_dropout = 0 (the Qwen, Llama and Mistral defaults)."
        )
    # squeeze, not x[0]: select's backward would allocate a zeroed [1, H, T, D] gradient and copy into it (a fill and
    # a strided copy per tensor and layer); squeeze's backward is a view, so dq/dk/dv keep the kernel's layout.
    q, k, v = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))
    options: dict[str, Any] = {
        "scale": kwargs.get("scaling"),
        "sliding_window": kwargs.get("sliding_window"),
        "softcap": kwargs.get("softcap"),
    }
    if getattr(view, "zorro_use_split_attention", True):
        out = _tree_attention(q, k, v, context, **options)
    else:
        out = reconstruct_attention(q, k, v, context, **options)
    return out.unsqueeze(0), None


def register_zorro_attention() -> None:
    """Register ``"arctic_zorro"`` with transformers' attention interface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ZORRO_ATTENTION, zorro_attention)
