"""``backend="auto"``: the one place that decides which tree-attention backend runs."""

from __future__ import annotations

from typing import Literal

import torch

from arctic_dedup._triton_support import triton_available
from arctic_dedup.attention.reference import MAX_REFERENCE_SCORES

__all__ = ["BACKENDS", "SDPA_MIN_TOKENS_PER_TREE", "ConcreteBackend", "TreeAttentionBackend", "choose_backend"]

# On CUDA, ``auto`` takes ``sdpa`` for prompt trees of at least this many packed tokens on average (see below).
SDPA_MIN_TOKENS_PER_TREE = 4096

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
    tree_levels: int | None = None,
    lse_needs_grad: bool = False,
    tokens_per_tree: float | None = None,
) -> ConcreteBackend:
    """Pick the fastest correct backend for the device and the shape.

    "Prompt trees" below means ``tree_levels <= 2`` (each tree is a prompt and its responses: the GRPO/PPO layout,
    ``sharing="prompt"``), with no sliding window, no softcap and no gradient through the returned lse; on CUDA also
    at least ``SDPA_MIN_TOKENS_PER_TREE`` packed tokens per tree on average (when the caller says).

    ============  =====================================================  ============
    device        condition                                              backend
    ============  =====================================================  ============
    CUDA          bf16/fp16, prompt trees of >= 4096 tokens on average   ``sdpa``
    CUDA          bf16/fp16, other trees, forward only, ``triton``       ``triton``
    CUDA          bf16/fp16, other trees, gradient needed                ``flex``
    CUDA          fp32; or other trees and no ``triton``                 ``flex``
    CPU           ``Hq * sum(tree_len^2) <= MAX_REFERENCE_SCORES``         ``reference`` (tree by tree if needed)
    CPU           larger, prompt trees                                   ``sdpa``
    CPU           larger, no gradient needed                             ``flex``
    CPU           larger, gradient needed                                ``reference`` (raises its size error)
    ============  =====================================================  ============

    Why: measured on the H200 (``benchmarks/results/tree_attention.json``, Qwen3-4B heads, bf16), ``sdpa`` (cuDNN's
    fused kernels over the prompt / responses-x-prompt / responses split, merged by log-sum-exp) runs forward +
    backward 1.35x FlexAttention's at P=8192 G=16 R=512, 1.26x on the ragged variant and 1.37x at P=32K, and its
    forward 1.40-1.51x; whole ZoRRO training steps measure the same (``zorro_train.json``). It cannot express deeper
    tries, windows or softcaps. There the fused backends, which skip invisible tiles and never copy shared K/V,
    decide: the Triton forward is 0.98-1.25x FlexAttention's but its backward 0.65-0.93x, so training goes to
    FlexAttention and forward-only calls (log-probs, reference models) to Triton. fp32 on CUDA goes to
    FlexAttention (cuDNN takes half precision only, and exact fp32 products leave the Triton kernels on small
    tiles). On CPU the Triton interpreter is far too slow to be chosen implicitly and FlexAttention's backward is
    refused by torch, so the exact reference wins whenever it fits, then torch's CPU flash kernel behind ``sdpa``.
    ``varlen`` is never chosen automatically: it gathers the queries of every tree level and loses to ``sdpa`` on
    prompt trees and to the fused backends on tries. ``sdpa`` issues three attention calls per tree (plus merges),
    so many small trees are launch-bound there: the 4096-token floor is an estimate (about 0.15 ms of launches per
    tree and layer against about 1 ms of cuDNN attention for a 4K-token tree), not a measurement yet; all measured
    cases have 8K-33K tokens per tree.

    The dtype does not change the choice otherwise: float64 inputs run only on ``reference``, so on CPU they work
    whenever the reference fits, and wherever another backend is picked ``tree_attention`` refuses them, saying so.
    """
    del num_kv_heads
    prompt_trees = (
        tree_levels is not None
        and tree_levels <= 2
        and sliding_window is None
        and softcap is None
        and not lse_needs_grad
    )
    if query.is_cuda:
        if query.dtype == torch.float32:
            return "flex"
        if prompt_trees and (tokens_per_tree is None or tokens_per_tree >= SDPA_MIN_TOKENS_PER_TREE):
            return "sdpa"
        return "triton" if triton_available() and not needs_grad else "flex"
    num_tokens, num_q_heads = int(query.shape[0]), int(query.shape[1])
    # The reference runs tree by tree when the whole stream does not fit (trees never see each other), so what
    # must fit is the sum over trees when the caller knows it.
    scores = num_q_heads * num_tokens * num_tokens if reference_scores is None else reference_scores
    if scores <= MAX_REFERENCE_SCORES:
        return "reference"
    if prompt_trees and query.dtype != torch.float64:
        return "sdpa"
    return "reference" if needs_grad else "flex"
