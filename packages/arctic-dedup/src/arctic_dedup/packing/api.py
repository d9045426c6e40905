"""``pack`` and ``unpack`` over a plan: the packed stream <-> each sample's tokens (padded or unpadded)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from arctic_dedup._triton_support import Backend
from arctic_dedup.errors import PlanError
from arctic_dedup.packing.rows import gather_rows

if TYPE_CHECKING:
    from arctic_dedup.plan import Plan

__all__ = ["pack", "unpack"]


def unpack(
    packed: torch.Tensor,
    plan: Plan,
    *,
    padded: bool = False,
    fill_value: float = 0.0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Reconstruct per-sample tensors from the packed stream.

    Args:
        packed: ``[T, *]`` one row per packed token (any trailing dims).
        plan: the micro-batch's plan.
        padded: False -> ``[N, *]``, every sample's valid tokens in sample order; True -> ``[B, S, *]`` in the
            original padded layout, ``fill_value`` at padding (padded inputs only).
        backend: ``auto`` (Triton on CUDA), ``triton`` or ``torch``.

    Differentiable: the gradient of a shared packed token is the sum over its copies.
    """
    if padded:
        if plan.unpack_padded_map is None or plan.layout.padded_shape is None:
            raise PlanError("unpack(padded=True) needs a plan built from a padded batch; use padded=False.")
        batch, seq = plan.layout.padded_shape
        out = gather_rows(packed, plan.unpack_padded_map, fill_value=fill_value, backend=backend)
        return out.reshape(batch, seq, *packed.shape[1:])
    return gather_rows(packed, plan.unpack_map, fill_value=fill_value, backend=backend)


def pack(x: torch.Tensor, plan: Plan, *, padded: bool = False, backend: Backend = "auto") -> torch.Tensor:
    """Deduplicate per-sample tensors into the packed stream: ``[N, *]`` (or ``[B, S, *]`` with ``padded=True``)
    -> ``[T, *]``.

    Each shared token is taken from the first sample that contains it. The gradient flows back to that copy only
    (the exact derivative of the selection). ``pack(unpack(y))`` equals ``y``.
    """
    if padded:
        padded_shape = plan.layout.padded_shape
        if plan.pack_padded_map is None or padded_shape is None:
            raise PlanError("pack(padded=True) needs a plan built from a padded batch; use padded=False.")
        if x.dim() < 2 or tuple(x.shape[:2]) != padded_shape:
            raise PlanError(f"pack(padded=True) expects [B, S, *] = {padded_shape}, got {tuple(x.shape)}.")
        flat = x.reshape(padded_shape[0] * padded_shape[1], *x.shape[2:])
        return gather_rows(flat, plan.pack_padded_map, backend=backend)
    if x.dim() < 1 or x.shape[0] != plan.num_sample_tokens:
        raise PlanError(
            f"pack expects [N={plan.num_sample_tokens}, *] (every sample's valid tokens), got {tuple(x.shape)}; "
            "pass padded=True for a [B, S, *] tensor."
        )
    return gather_rows(x, plan.pack_map, backend=backend)
