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


def pack(x: torch.Tensor, plan: Plan, *, backend: Backend = "auto") -> torch.Tensor:
    """Deduplicate per-sample tensors into the packed stream: ``[N, *]`` or ``[B, S, *]`` -> ``[T, *]``.

    Each shared token is taken from the first sample that contains it. The gradient flows back to that copy only
    (the exact derivative of the selection). ``unpack(pack(x))`` equals ``x`` when shared copies agree.
    """
    padded_shape = plan.layout.padded_shape
    if padded_shape is not None and x.dim() >= 2 and tuple(x.shape[:2]) == padded_shape and plan.pack_padded_map:
        flat = x.reshape(padded_shape[0] * padded_shape[1], *x.shape[2:])
        return gather_rows(flat, plan.pack_padded_map, backend=backend)
    if x.dim() < 1 or x.shape[0] != plan.num_sample_tokens:
        raise PlanError(
            f"pack expects [N={plan.num_sample_tokens}, *] (unpadded) or [B, S, *] = {padded_shape} (padded), got "
            f"{tuple(x.shape)}."
        )
    return gather_rows(x, plan.pack_map, backend=backend)
