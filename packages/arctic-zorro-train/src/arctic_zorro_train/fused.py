"""Where a patched model runs fused Triton kernels instead of transformers' torch code (``fused_kernels`` setting).

The SwiGLU of the MLPs (``silu(gate) * up``: two elementwise kernels forward, three backward) is fused too, and so
is the ``"memory"`` logits mode's per-chunk log-softmax math (``arctic_zorro_train.kernels.logprobs``, all
families; ``token_logprobs(fused=...)``).
On the H200 the hybrid families' torch glue around the big matrix multiplies costs more than the Gated DeltaNet
kernels themselves (``benchmarks/lab/results/zorro_profile_hybrid.json``): every RMSNorm is ~6 fp32 elementwise passes
forward and more backward, the gated RMSNorm of every Gated DeltaNet layer the same over ``[tokens * heads, 128]``,
and the depthwise causal conv runs cuDNN-less ``conv_depthwise2d`` over a transposed copy. The kernels in
``arctic_zorro_train.kernels`` compute the same formulas (casts included) in one pass each way; they serve the
deduplicated run and the non-deduplicated baseline alike, so they change no speedup, only how fast both run.

Modes: ``"auto"`` (default) uses them on CUDA tensors; ``"always"`` also on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, for tests); ``"never"`` keeps transformers' code everywhere.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from arctic_dedup._triton_support import interpreting, triton_available
from arctic_zorro_train.errors import ZorroPatchError
from arctic_zorro_train.kernels._launch_support import kernels_usable

__all__ = [
    "FUSED_KERNEL_MODES",
    "FusedKernels",
    "fused_gated_norm_forward",
    "fused_mlp_forward",
    "fused_zero_centered_norm_forward",
    "use_fused_kernels",
]

FusedKernels = Literal["auto", "always", "never"]
FUSED_KERNEL_MODES: tuple[str, ...] = ("auto", "always", "never")


def use_fused_kernels(mode: FusedKernels, tensor: torch.Tensor) -> bool:
    """Whether a fused kernel runs on ``tensor`` under ``mode`` (see the module docstring)."""
    if mode == "never":
        return False
    if mode == "auto":
        return tensor.is_cuda and triton_available()
    if kernels_usable(tensor):
        return True
    raise ZorroPatchError(
        f"fused_kernels='always' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before triton "
        f"is imported; got a {tensor.device.type} tensor (interpreter: {interpreting()}). Use "
        "fused_kernels='auto' (CUDA only) or 'never'."
    )


def fused_zero_centered_norm_forward(
    module: nn.Module, mode: FusedKernels, hidden_states: torch.Tensor
) -> torch.Tensor:
    """A ``Qwen3_5RMSNorm``-like module's forward (``x_hat * (1 + weight)``): the fused kernel where ``mode`` allows
    it, the module's own code otherwise. Kernels are imported at first use, so triton is imported only where it runs
    (after TRITON_INTERPRET is set)."""
    attributes: Any = module
    if use_fused_kernels(mode, hidden_states):
        from arctic_zorro_train.kernels.norms import zero_centered_rms_norm

        return zero_centered_rms_norm(hidden_states, attributes.weight, float(attributes.eps))
    return type(module).forward(module, hidden_states)  # type: ignore[no-any-return]


def fused_gated_norm_forward(
    module: nn.Module, mode: FusedKernels, hidden_states: torch.Tensor, gate: torch.Tensor
) -> torch.Tensor:
    """A ``Qwen3_5RMSNormGated``-like module's forward (``weight * x_hat * silu(gate)``), like
    ``fused_zero_centered_norm_forward``."""
    attributes: Any = module
    if use_fused_kernels(mode, hidden_states):
        from arctic_zorro_train.kernels.norms import gated_rms_norm

        return gated_rms_norm(hidden_states, gate, attributes.weight, float(attributes.variance_epsilon))
    return type(module).forward(module, hidden_states, gate)  # type: ignore[no-any-return]


def fused_mlp_forward(module: nn.Module, mode: FusedKernels, hidden_states: torch.Tensor) -> torch.Tensor:
    """A transformers SwiGLU MLP's forward (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) with the product
    fused where ``mode`` allows it and the activation is silu; the module's own code otherwise."""
    layers: Any = module
    if getattr(layers.config, "hidden_act", None) == "silu" and use_fused_kernels(mode, hidden_states):
        from arctic_zorro_train.kernels.swiglu import swiglu

        return layers.down_proj(swiglu(layers.gate_proj(hidden_states), layers.up_proj(hidden_states)))  # type: ignore[no-any-return]
    return type(module).forward(module, hidden_states)  # type: ignore[no-any-return]
