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
