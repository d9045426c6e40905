"""Plain-torch twins of the fused kernels: the formulas the kernels compute, obviously correct, any device.

The norms are transformers' own formulas (``Qwen3_5RMSNorm``, ``Qwen3_5RMSNormGated``, casts included); the conv
is ``F.conv1d`` on the transposed stream, as ``gated_delta.tree_causal_conv`` ran it before the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "causal_depthwise_conv_reference",
    "gated_rms_norm_reference",
    "logprob_logits_gradient_reference",
    "logprob_statistics_reference",
    "swiglu_reference",
    "zero_centered_rms_norm_reference",
]


def zero_centered_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., D]``, ``weight [D]`` -> ``(x_hat * (1 + weight)).type_as(x)``, computed in fp32."""
    hidden = x.float()
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).type_as(x)


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x, gate [..., D]``, ``weight [D]`` -> ``weight * x_hat.to(x.dtype) * silu(gate.float())`` in ``x``'s dtype
    (the weight product in ``promote_types(weight, x)``, as torch multiplies them)."""
    hidden = x.float()
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    product = weight * normed.to(x.dtype)
    return (product * F.silu(gate.float())).to(x.dtype)


def causal_depthwise_conv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, C]``, ``weight [C, K]``, ``bias [C]`` -> ``[T, C]``: ``out[t] = bias + sum_j weight[:, j] *
    x[t - (K - 1) + j]``, zeros before the first token."""
    tokens, channels = x.shape
    width = weight.shape[1]
    out = F.conv1d(x.t().unsqueeze(0), weight.unsqueeze(1), bias, padding=width - 1, groups=channels)
    # squeeze, not [0]: [0]'s backward would zero-fill [1, C, T + K - 1] and copy.
    return out.squeeze(0)[:, :tokens].t()


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, as transformers' MLPs compute it (``act_fn(gate_proj(x)) * up_proj(x)``)."""
    return F.silu(gate) * up


def _scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return scaled if temperature == 1.0 else scaled / temperature


def logprob_statistics_reference(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logprobs, log-normalizers, entropies or None) ``[n]`` of ``logits [n, V] / temperature`` at ``labels [n]``,
    in fp32 (float64 for float64 logits): ``z[label] - logsumexp(z)`` and ``logsumexp(z) - sum(softmax(z) * z)``."""
    scaled = _scaled_logits(logits, temperature)
    log_normalizer = torch.logsumexp(scaled, dim=-1)
    logprobs = scaled.gather(-1, labels[:, None]).squeeze(-1) - log_normalizer
    if not with_entropy:
        return logprobs, log_normalizer, None
    probabilities = torch.softmax(scaled, dim=-1)
    # A -inf logit (a masked token) has p = 0 and adds nothing; 0 * -inf would be NaN.
    entropy = log_normalizer - torch.where(probabilities > 0, probabilities * scaled, 0.0).sum(dim=-1)
    return logprobs, log_normalizer, entropy


def logprob_logits_gradient_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    log_normalizer: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """d/d logits of ``sum(grad_logprobs * logprobs + grad_entropy * entropies)``, in ``logits``' dtype: with
    ``z = logits / temperature`` and ``log p = z - log_normalizer``, ``(onehot(label) - p) * g`` and
    ``-p (log p + H) * g_H``, divided by the temperature."""
    scaled = _scaled_logits(logits, temperature)
    log_p = scaled - log_normalizer[:, None]
    p = log_p.exp()
    grad = torch.zeros_like(scaled)
    if grad_logprobs is not None:
        grad -= grad_logprobs[:, None] * p
        grad.scatter_add_(-1, labels[:, None], grad_logprobs[:, None].to(grad.dtype))
    if grad_entropy is not None:
        if entropy is None:
            raise ValueError("grad_entropy needs the entropies (with_entropy=True).")
        grad -= grad_entropy[:, None] * torch.where(p > 0, p * (log_p + entropy[:, None]), 0.0)
    return (grad / temperature).to(logits.dtype)
