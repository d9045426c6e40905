"""One patch table per supported architecture, and the lookup that picks a model's table.

A table names the Hugging Face classes that zorro-train touches in that architecture: the attention modules (they
get a config view that routes them to tree attention), the Gated DeltaNet modules (their forward gains a tree path
that passes recurrent and conv state from parent to child nodes), and the MoE routers (their logits are collected
for the multiplicity-weighted aux loss). Everything else (embeddings, norms, MLPs, experts, RoPE) is token-wise
and runs unchanged on the packed stream. Nothing here patches anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from arctic_zorro_train.errors import UnsupportedModelError

__all__ = [
    "ARCHITECTURES",
    "ArchitectureTable",
    "GatedDeltaInputs",
    "LinearAttentionTable",
    "architecture_for_model_type",
    "resolve_architecture",
    "supported_model_types",
]


@dataclass(frozen=True)
class GatedDeltaInputs:
    """A Gated DeltaNet layer's token-wise projections over the packed stream (``T`` tokens, batch dim dropped).

    The batch dim is dropped with ``squeeze(0)``, whose backward is a view (``x[0]``'s would zero-fill ``[1, T, ...]``
    and copy the gradient into it).

    mixed_qkv ``[T, 2*key_dim + value_dim]`` (the conv input), z ``[T, Hv, Dv]`` (output gate), b and a ``[T, Hv]``.
    """

    mixed_qkv: torch.Tensor
    z: torch.Tensor
    b: torch.Tensor
    a: torch.Tensor


def _qwen3_next_projections(module: Any, hidden_states: torch.Tensor) -> GatedDeltaInputs:
    """Qwen3-Next packs q, k, v, z per key-head group in one projection and b, a in another."""
    query, key, value, z, b, a = module.fix_query_key_value_ordering(
        module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states)
    )
    num_tokens = hidden_states.shape[1]
    mixed_qkv = torch.cat([x.reshape(num_tokens, -1) for x in (query, key, value)], dim=-1)
    return GatedDeltaInputs(mixed_qkv=mixed_qkv, z=z.squeeze(0), b=b.squeeze(0), a=a.squeeze(0))


def _qwen3_5_projections(module: Any, hidden_states: torch.Tensor) -> GatedDeltaInputs:
    """Qwen3.5 (and Qwen3.6) use four separate projections."""
    num_tokens = hidden_states.shape[1]
    z = module.in_proj_z(hidden_states).reshape(num_tokens, -1, module.head_v_dim)
    return GatedDeltaInputs(
        mixed_qkv=module.in_proj_qkv(hidden_states).squeeze(0),
        z=z,
        b=module.in_proj_b(hidden_states).squeeze(0),
        a=module.in_proj_a(hidden_states).squeeze(0),
    )


@dataclass(frozen=True)
class LinearAttentionTable:
    """Gated DeltaNet classes of an architecture and how to read their input projections."""

    class_names: tuple[str, ...]
    projections: Callable[[Any, torch.Tensor], GatedDeltaInputs]


@dataclass(frozen=True)
class ArchitectureTable:
    """What zorro-train patches in one architecture (class names as in transformers' modeling files)."""

    name: str
    model_types: tuple[str, ...]
    attention_classes: tuple[str, ...]
    linear_attention: LinearAttentionTable | None = None
    router_classes: tuple[str, ...] = ()
    # Classes with fused kernels (``arctic_zorro_train.fused``; the hybrid families only, whose baseline is the same
    # patched packed path): RMSNorms ``x_hat * (1 + weight)``, the Gated DeltaNet layers' gated ones
    # (``weight * x_hat * silu(gate)``).
    zero_centered_norm_classes: tuple[str, ...] = ()
    gated_norm_classes: tuple[str, ...] = ()
    # MLP classes (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) whose SwiGLU runs fused when the act is silu.
    mlp_classes: tuple[str, ...] = ()


QWEN3 = ArchitectureTable(name="qwen3", model_types=("qwen3",), attention_classes=("Qwen3Attention",))

QWEN3_MOE = ArchitectureTable(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    attention_classes=("Qwen3MoeAttention",),
    router_classes=("Qwen3MoeTopKRouter",),
)

QWEN3_NEXT = ArchitectureTable(
    name="qwen3_next",
    model_types=("qwen3_next",),
    attention_classes=("Qwen3NextAttention",),
    linear_attention=LinearAttentionTable(("Qwen3NextGatedDeltaNet",), _qwen3_next_projections),
    router_classes=("Qwen3NextTopKRouter",),
    zero_centered_norm_classes=("Qwen3NextRMSNorm",),
    gated_norm_classes=("Qwen3NextRMSNormGated",),
    mlp_classes=("Qwen3NextMLP",),
)

# Qwen3.5 / Qwen3.6 checkpoints: the VLM wrapper has model_type "qwen3_5", its text config "qwen3_5_text".
QWEN3_5 = ArchitectureTable(
    name="qwen3_5",
    model_types=("qwen3_5", "qwen3_5_text"),
    attention_classes=("Qwen3_5Attention",),
    linear_attention=LinearAttentionTable(("Qwen3_5GatedDeltaNet",), _qwen3_5_projections),
    zero_centered_norm_classes=("Qwen3_5RMSNorm",),
    gated_norm_classes=("Qwen3_5RMSNormGated",),
    mlp_classes=("Qwen3_5MLP",),
)

QWEN3_5_MOE = ArchitectureTable(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    attention_classes=("Qwen3_5MoeAttention",),
    linear_attention=LinearAttentionTable(("Qwen3_5MoeGatedDeltaNet",), _qwen3_5_projections),
    router_classes=("Qwen3_5MoeTopKRouter",),
    zero_centered_norm_classes=("Qwen3_5MoeRMSNorm",),
    gated_norm_classes=("Qwen3_5MoeRMSNormGated",),
    mlp_classes=("Qwen3_5MoeMLP",),
)

# The generic path: Llama-like models whose attention is the stock transformers attention (projections, RoPE, then
# the attention interface), so the same config view routes them to tree attention.
LLAMA_LIKE = ArchitectureTable(
    name="llama_like",
    model_types=("llama", "mistral", "qwen2"),
    attention_classes=("LlamaAttention", "MistralAttention", "Qwen2Attention"),
)

ARCHITECTURES: tuple[ArchitectureTable, ...] = (QWEN3, QWEN3_MOE, QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE, LLAMA_LIKE)


def supported_model_types() -> tuple[str, ...]:
    return tuple(model_type for table in ARCHITECTURES for model_type in table.model_types)


def architecture_for_model_type(model_type: str | None, owner: str) -> ArchitectureTable:
    """The table for ``model_type`` (``owner`` names the model or config it came from, for the error)."""
    for table in ARCHITECTURES:
        if model_type in table.model_types:
            return table
    raise UnsupportedModelError(
        f"arctic-zorro-train has no patch table for model_type={model_type!r} ({owner}). "
        f"Supported model types: {', '.join(supported_model_types())}. Use one of these architectures, or run "
        "the model without zorro-train."
    )


def resolve_architecture(model: nn.Module) -> ArchitectureTable:
    """The table for ``model`` (a causal LM, a VLM wrapper, or a bare backbone), by ``config.model_type``."""
    config = getattr(model, "config", None)
    return architecture_for_model_type(getattr(config, "model_type", None), type(model).__name__)
