"""The reference twin of tree attention: a dense boolean mask and a plain fp32 softmax (small inputs only).

Obviously correct rather than fast: every other backend is tested against it, forward and backward. float64 inputs
are computed in float64 throughout, so callers can test whole models exactly (no fp32 rounding to argue about).
"""

from __future__ import annotations

import math

import torch

__all__ = ["MAX_REFERENCE_SCORES", "reference_mask", "tree_attention_reference"]

# Upper bound on Hq * T * T: the fp32 score tensor alone is 4 bytes per element and autograd keeps about three of
# them alive (scores, probabilities and their gradient), so 2**27 elements is about 1.5 GiB (3 GiB in float64).
MAX_REFERENCE_SCORES = 2**27


def reference_mask(
    kv_visible_until: torch.Tensor, position_ids: torch.Tensor | None = None, sliding_window: int | None = None
) -> torch.Tensor:
    """``[T, T]`` boolean mask, query rows and key columns: ``k <= q < kv_visible_until[k]`` and, with a sliding
    window ``W``, ``position_ids[q] - position_ids[k] < W`` (logical positions, not packed indices)."""
    positions = torch.arange(kv_visible_until.shape[0], device=kv_visible_until.device)
    query = positions[:, None]
    key = positions[None, :]
    mask = (key <= query) & (query < kv_visible_until.long()[None, :])
    if sliding_window is not None:
        if position_ids is None:
            raise ValueError("a sliding window needs position_ids (the logical positions of the packed tokens).")
        logical = position_ids.long()
        mask &= (logical[:, None] - logical[None, :]) < sliding_window
    return mask


def tree_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_visible_until: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_scores: int = MAX_REFERENCE_SCORES,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree attention with a dense mask in fp32: ``[T, Hq, D]`` x ``[T, Hkv, D]`` -> (out ``[T, Hq, D]`` in the
    input dtype, lse ``[T, Hq]`` fp32, natural log). Differentiable through plain torch autograd.

    float64 inputs run everything (products, softmax, lse) in float64 and return a float64 lse.
    ``compute_dtype=torch.bfloat16`` runs both matrix products in bf16 (softmax still fp32): not a reference but
    the yardstick for "within bf16 noise" (how far a plain bf16 implementation lands from the fp32 result)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    scores_size = num_q_heads * num_tokens * num_tokens
    if scores_size > max_scores:
        raise ValueError(
            f"backend='reference' materializes Hq*T*T = {num_q_heads}*{num_tokens}*{num_tokens} = {scores_size} "
            f"scores, over its limit of {max_scores}; it is meant for small inputs and tests. Use backend='flex' or "
            "'triton' (or 'auto') for this size"
            + (" (in float32 or bfloat16: only the reference takes float64)." if query.dtype == torch.float64 else ".")
        )
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = num_q_heads // num_kv_heads
    softmax_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    compute_dtype = softmax_dtype if compute_dtype is None else compute_dtype
    q = query.to(compute_dtype).transpose(0, 1)
    k = key.to(compute_dtype).transpose(0, 1).repeat_interleave(group, dim=0)
    v = value.to(compute_dtype).transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)).to(softmax_dtype) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    mask = reference_mask(kv_visible_until, position_ids, sliding_window)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    # Every query sees at least itself, so no row is empty and the softmax is finite.
    lse = torch.logsumexp(scores, dim=-1)
    probabilities = torch.exp(scores - lse[..., None])
    out = torch.matmul(probabilities.to(compute_dtype), v)
    return out.transpose(0, 1).to(query.dtype), lse.transpose(0, 1).contiguous()
