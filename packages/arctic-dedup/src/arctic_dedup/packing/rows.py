"""Differentiable row gathers over an ``IndexMap``: the forward copies rows, the backward sums the copies.

``gather_rows`` and ``segment_sum_rows`` are each other's adjoint, so both directions are differentiable any
number of times. The backward sums run without atomics, in ascending output order (deterministic).
"""

from __future__ import annotations

from typing import Any

import torch

from arctic_dedup._triton_support import Backend, resolve_backend
from arctic_dedup.errors import PlanError
from arctic_dedup.packing._launch import launch_scatter_copies, launch_segment_sum_rows
from arctic_dedup.plan.index_map import IndexMap

__all__ = ["gather_rows", "segment_sum_rows"]


def _gather_torch(src: torch.Tensor, index_map: IndexMap, fill_value: float) -> torch.Tensor:
    index = index_map.gather_index
    has_source = index >= 0
    out = src[index.clamp_min(0)]
    if not bool(has_source.all()):
        out = torch.where(has_source[:, None], out, torch.full_like(out, fill_value))
    return out


def _segment_sum_torch(src: torch.Tensor, index_map: IndexMap) -> torch.Tensor:
    index = index_map.gather_index
    has_source = index >= 0
    out = torch.zeros((index_map.num_sources, src.shape[1]), dtype=src.dtype, device=src.device)
    return out.index_add_(0, index[has_source], src[has_source])


def _gather(src: torch.Tensor, index_map: IndexMap, fill_value: float, backend: Backend) -> torch.Tensor:
    if resolve_backend(backend, src) == "triton":
        return launch_scatter_copies(src, index_map, fill_value)
    return _gather_torch(src, index_map, fill_value)


def _segment_sum(src: torch.Tensor, index_map: IndexMap, backend: Backend) -> torch.Tensor:
    if resolve_backend(backend, src) == "triton":
        return launch_segment_sum_rows(src, index_map)
    return _segment_sum_torch(src, index_map)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, index_map: IndexMap, fill_value: float, backend: Backend) -> torch.Tensor:
        ctx.index_map = index_map
        ctx.backend = backend
        return _gather(src, index_map, fill_value, backend)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        grad_src = _SegmentSumRows.apply(grad.contiguous(), ctx.index_map, ctx.backend)
        return grad_src, None, None, None


class _SegmentSumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, index_map: IndexMap, backend: Backend) -> torch.Tensor:
        ctx.index_map = index_map
        ctx.backend = backend
        return _segment_sum(src, index_map, backend)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        return _GatherRows.apply(grad.contiguous(), ctx.index_map, 0.0, ctx.backend), None, None


def _check_rows(x: torch.Tensor, expected_rows: int, what: str) -> None:
    if x.dim() < 1 or x.shape[0] != expected_rows:
        raise PlanError(
            f"{what} expects a tensor with {expected_rows} rows in dim 0, got shape {tuple(x.shape)}; "
            "the tensor does not belong to the plan (or index map) it was applied with."
        )


def gather_rows(
    src: torch.Tensor, index_map: IndexMap, *, fill_value: float = 0.0, backend: Backend = "auto"
) -> torch.Tensor:
    """Copy rows: ``src [num_sources, *]`` -> ``[num_outputs, *]``, ``out[i] = src[index_map.gather_index[i]]``.

    Output rows whose index is -1 get ``fill_value``. Differentiable: the gradient of a source row is the sum of
    the gradients of its copies. ``backend``: ``auto`` (Triton on CUDA, torch elsewhere), ``triton`` or ``torch``.
    """
    _check_rows(src, index_map.num_sources, "gather_rows")
    trailing = src.shape[1:]
    flat = src.reshape(src.shape[0], -1)
    out = _GatherRows.apply(flat, index_map, fill_value, backend)
    return out.reshape(index_map.num_outputs, *trailing)


def segment_sum_rows(src: torch.Tensor, index_map: IndexMap, *, backend: Backend = "auto") -> torch.Tensor:
    """The adjoint of ``gather_rows``: ``src [num_outputs, *]`` -> ``[num_sources, *]`` summing each row's copies."""
    _check_rows(src, index_map.num_outputs, "segment_sum_rows")
    trailing = src.shape[1:]
    flat = src.reshape(src.shape[0], -1)
    out = _SegmentSumRows.apply(flat, index_map, backend)
    return out.reshape(index_map.num_sources, *trailing)
