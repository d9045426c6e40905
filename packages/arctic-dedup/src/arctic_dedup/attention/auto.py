"""``backend="auto"``: the one place that decides which tree-attention backend runs."""

from __future__ import annotations

from typing import Literal

import torch

from arctic_dedup._triton_support import triton_available
from arctic_dedup.attention.reference import MAX_REFERENCE_SCORES

__all__ = ["BACKENDS", "ConcreteBackend", "TreeAttentionBackend", "choose_backend"]

TreeAttentionBackend = Literal["auto", "reference", "flex", "triton", "varlen"]
ConcreteBackend = Literal["reference", "flex", "triton", "varlen"]
BACKENDS: tuple[ConcreteBackend, ...] = ("reference", "flex", "triton", "varlen")


def choose_backend(
    query: torch.Tensor,
    num_kv_heads: int,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    needs_grad: bool = False,
) -> ConcreteBackend:
    """Pick the fastest correct backend for the device and the shape.

    ============  ==============================================  ============
    device        condition                                       backend
    ============  ==============================================  ============
    CUDA          bf16/fp16 and ``triton`` importable             ``triton``
    CUDA          fp32, or no ``triton``                          ``flex``
    CPU           ``Hq * T * T <= MAX_REFERENCE_SCORES``          ``reference``
    CPU           larger, no gradient needed                      ``flex``
    CPU           larger, gradient needed                         ``reference`` (raises its size error)
    ============  ==============================================  ============

    Why: on CUDA both fused backends skip invisible tiles and never copy shared K/V; the Triton kernels avoid
    FlexAttention's per-element mask function on full tiles, share K/V across a GQA group in the backward, and
    handle sliding windows (tiles outside the window are dropped from the lists) and softcaps, so neither option
    changes the choice (``benchmarks/tree_attention.py`` measures both; its results file says where each wins).
    fp32 goes to FlexAttention because exact fp32 products leave the Triton kernels on small tiles. On CPU the
    Triton interpreter is far too slow to be chosen implicitly, FlexAttention's backward is refused by torch and
    its eager path materializes the same dense scores as the reference, so the reference wins whenever it fits
    and FlexAttention serves large inference-only calls. ``varlen`` is never chosen automatically: it launches one
    call per tree level and gathers the queries of every level, so it loses to both fused backends on trees.
    """
    del sliding_window, softcap, num_kv_heads
    if query.is_cuda:
        if query.dtype != torch.float32 and triton_available():
            return "triton"
        return "flex"
    num_tokens, num_q_heads = int(query.shape[0]), int(query.shape[1])
    fits_reference = num_q_heads * num_tokens * num_tokens <= MAX_REFERENCE_SCORES
    if fits_reference or needs_grad:
        return "reference"
    return "flex"
