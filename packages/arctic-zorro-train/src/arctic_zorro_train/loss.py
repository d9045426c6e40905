"""The PPO clipped policy loss over packed response tokens (token mean), with an optional k1 KL penalty."""

from __future__ import annotations

import torch

__all__ = ["masked_mean", "ppo_policy_loss"]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean PPO clip loss over ``[M]`` packed tokens; ``loss_mask`` ``[M]`` (1 = counts).

    Returns (loss, metrics): metrics hold detached ``pg_loss``, ``pg_clipfrac``, ``ppo_kl`` and, with a KL term,
    ``kl_loss`` (k1 estimator ``logprob - ref_logprob``).
    """
    mask = loss_mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    pg_loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    metrics = {
        "pg_loss": pg_loss.detach(),
        "pg_clipfrac": masked_mean((clipped > unclipped).to(mask.dtype), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    loss = pg_loss
    if ref_logprobs is not None and kl_coef != 0.0:
        kl_loss = masked_mean(logprobs - ref_logprobs, mask)
        metrics["kl_loss"] = kl_loss.detach()
        loss = loss + kl_coef * kl_loss
    return loss, metrics
