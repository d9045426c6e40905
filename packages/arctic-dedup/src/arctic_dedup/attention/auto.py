"""``backend="auto"``: the one place that decides which tree-attention backend runs."""

from __future__ import annotations

from typing import Literal

import torch

from arctic_dedup._triton_support import triton_available
from arctic_dedup.attention.reference import MAX_REFERENCE_SCORES

__all__ = ["BACKENDS", "ConcreteBackend", "TreeAttentionBackend", "choose_backend"]

TreeAttentionBackend = Literal["auto", "reference", "flex", "triton", "varlen", "sdpa"]
ConcreteBackend = Literal["reference", "flex", "triton", "varlen", "sdpa"]
BACKENDS: tuple[ConcreteBackend, ...] = ("reference", "flex", "triton", "varlen", "sdpa")


def choose_backend(
    query: torch.Tensor,
    num_kv_heads: int,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    needs_grad: bool = False,
    reference_scores: int | None = None,
) -> ConcreteBackend:
    """Pick the fastest correct backend for the device and the shape.

    ============  ==============================================  ============
    device        condition                                       backend
    ============  ==============================================  ============
    CUDA          bf16/fp16, forward only, ``triton`` importable  ``triton``
    CUDA          gradient needed                                 ``flex``
    CUDA          fp32, or no ``triton``                          ``flex``
    CPU           ``Hq * sum(tree_len^2) <= MAX_REFERENCE_SCORES``  ``reference`` (tree by tree if needed)
    CPU           larger, no gradient needed                      ``flex``
    CPU           larger, gradient needed                         ``reference`` (raises its size error)
    ============  ==============================================  ============

    Why: on CUDA both fused backends skip invisible tiles and never copy shared K/V. Measured on the H200
    (``benchmarks/results/tree_attention.json``, Qwen3-4B heads, bf16): the Triton forward is 1.07-1.14x
    FlexAttention's at P=8192 (0.99x at P=32K), but its backward is 0.75-0.81x, so forward+backward is 0.81-0.90x.
    The backward sweep (``tree_attention_bwd_sweep.json``) brought the default backward to 0.92x FlexAttention's
    (atomic dQ, 64x128 tiles; 0.86x deterministic), about 0.98x forward+backward at P=8192: still below parity, so
    training goes to FlexAttention, forward-only calls (log-probs, reference models) to Triton. Both handle sliding
    windows and softcaps, so neither option changes the choice. fp32 goes to FlexAttention because exact fp32
    products leave the Triton kernels on small tiles. On CPU the Triton interpreter is far too slow to be chosen
    implicitly, FlexAttention's backward is refused by torch and its eager path materializes the same dense scores
    as the reference, so the reference wins whenever it fits and FlexAttention serves large inference-only calls.
    ``varlen`` is never chosen automatically: it launches one call per tree level and gathers the queries of every
    level, so it loses to both fused backends on trees.

    The dtype does not change the choice: float64 inputs run only on ``reference``, so on CPU they work whenever the
    reference fits, and wherever another backend is picked ``tree_attention`` refuses them, saying so.
    """
    del sliding_window, softcap, num_kv_heads
    if query.is_cuda:
        if query.dtype != torch.float32 and triton_available() and not needs_grad:
            return "triton"
        return "flex"
    num_tokens, num_q_heads = int(query.shape[0]), int(query.shape[1])
    # The reference runs tree by tree when the whole stream does not fit (trees never see each other), so what
    # must fit is the sum over trees when the caller knows it.
    scores = num_q_heads * num_tokens * num_tokens if reference_scores is None else reference_scores
    fits_reference = scores <= MAX_REFERENCE_SCORES
    if fits_reference or needs_grad:
        return "reference"
    return "flex"
