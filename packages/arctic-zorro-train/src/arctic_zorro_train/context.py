"""The per-micro-batch context every patched layer reads: the plan plus what the layers derive from it once.

It travels to the layers as a keyword argument of the backbone's forward (transformers passes unknown keyword
arguments down to the decoder layers and from there to the attention function and the linear-attention layers), so
gradient-checkpoint recomputation sees the same context. Immutable; built once per forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from arctic_dedup import Plan
from arctic_dedup.attention import TreeAttentionBackend, TreeAttentionMetadata, auto_backends, prepare_tree_attention
from arctic_dedup.plan.index_map import IndexMap
from arctic_zorro_train.gated_delta import GatedDeltaSchedule, build_gated_delta_schedule

__all__ = [
    "CONTEXT_KWARG",
    "LayerAttention",
    "ReconstructMaps",
    "ZorroContext",
    "build_context",
    "build_reconstruct_maps",
    "layer_attention",
]

CONTEXT_KWARG = "arctic_zorro_context"


@dataclass(frozen=True)
class ReconstructMaps:
    """For the reconstruct-then-attend mode: where every sample's tokens sit in a ``[B, W]`` grid.

    valid ``[B, W]`` marks real tokens (each sample's tokens are contiguous and in order in its row). For plans of
    padded batches the grid is the batch's own padded layout, reached with ``arctic_dedup.unpack(padded=True)`` and
    ``arctic_dedup.pack`` (``to_samples`` / ``to_packed`` are None); for unpadded plans the rows are right-padded
    and these two maps go packed -> ``[B * W]`` and back (each packed token from the first sample containing it).
    """

    valid: torch.Tensor
    to_samples: IndexMap | None
    to_packed: IndexMap | None


def build_reconstruct_maps(plan: Plan) -> ReconstructMaps:
    layout = plan.layout
    if plan.unpack_padded_map is not None and layout.padded_shape is not None:
        valid = (plan.unpack_padded_map.gather_index >= 0).view(*layout.padded_shape)
        return ReconstructMaps(valid=valid, to_samples=None, to_packed=None)
    lengths = layout.sample_lengths
    width = int(lengths.max())
    token_sample = layout.token_sample()
    slot = token_sample * width + layout.token_offset_in_sample()
    gather = torch.full((layout.num_samples * width,), -1, dtype=torch.long, device=plan.device)
    gather[slot] = plan.sample_packed_index
    return ReconstructMaps(
        valid=(gather >= 0).view(layout.num_samples, width),
        to_samples=IndexMap.build(gather, plan.num_packed_tokens),
        to_packed=IndexMap.build(slot[plan.pack_map.gather_index], layout.num_samples * width),
    )


@dataclass(frozen=True)
class LayerAttention:
    """What the model's attention layers will pass to ``tree_attention``: head counts, head dim, input dtype, the
    sliding windows of its layers (None: full attention), softcap, and whether calls may need a gradient."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_windows: tuple[int | None, ...]
    softcap: float | None
    needs_grad: tuple[bool, ...]


def layer_attention(config: Any, dtype: torch.dtype, grad_possible: bool) -> LayerAttention:
    """The attention calls of a transformers text config's layers, computing in ``dtype``. ``grad_possible``: both
    with and without a gradient (gradient checkpointing runs a layer both ways), else without."""
    num_q_heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
    window = getattr(config, "sliding_window", None)
    softcap = getattr(config, "attn_logit_softcapping", None)
    return LayerAttention(
        num_q_heads=num_q_heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_q_heads),
        head_dim=int(head_dim),
        dtype=dtype,
        sliding_windows=(None,) if window is None else (None, int(window)),
        softcap=None if softcap is None else float(softcap),
        needs_grad=(False, True) if grad_possible else (False,),
    )


def _prepare_attention(plan: Plan, backend: TreeAttentionBackend, attention: LayerAttention) -> TreeAttentionMetadata:
    backends = (
        auto_backends(
            plan,
            num_q_heads=attention.num_q_heads,
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_dim,
            dtype=attention.dtype,
            sliding_windows=attention.sliding_windows,
            softcap=attention.softcap,
            needs_grad=attention.needs_grad,
        )
        if backend == "auto"
        else frozenset((backend,))
    )
    return prepare_tree_attention(
        plan,
        backends=backends,
        head_dim=attention.head_dim,
        dtype=attention.dtype,
        sliding_windows=attention.sliding_windows,
    )


@dataclass(frozen=True)
class ZorroContext:
    """plan; attention_backend for ``tree_attention`` and its prepared metadata (block tables, ``sdpa`` calls),
    read by every attention layer; gated_delta (hybrid models only); reconstruct (only when some attention layer
    runs in reconstruct-then-attend mode)."""

    plan: Plan
    attention_backend: TreeAttentionBackend
    attention: TreeAttentionMetadata
    gated_delta: GatedDeltaSchedule | None
    reconstruct: ReconstructMaps | None


def build_context(
    plan: Plan,
    *,
    attention_backend: TreeAttentionBackend,
    attention: LayerAttention,
    conv_width: int | None,
    needs_reconstruct: bool,
) -> ZorroContext:
    return ZorroContext(
        plan=plan,
        attention_backend=attention_backend,
        attention=_prepare_attention(plan, attention_backend, attention),
        gated_delta=None if conv_width is None else build_gated_delta_schedule(plan, conv_width),
        reconstruct=build_reconstruct_maps(plan) if needs_reconstruct else None,
    )
