"""Multi-tensor gradient checks for DeepSpeed's ZeRO-1/2 optimizer step: the same answers in a few launches.

DeepSpeed's ZeRO-1/2 ``step()`` looks at every gradient tensor one at a time, twice: the overflow check (bf16 and
fp16) runs seven small kernels per tensor (``amax``, ``amin``, two ``isfinite``, ...), and the gradient norm copies
each tensor to fp64 before taking its norm. For a 4B-parameter model that is ~400 tensors, ~4,000 kernel launches
and a 32 GB fp64 copy per step: on an H200 the step took 155 ms of which the GPU was busy 105, for a 32 ms AdamW.

``install_multi_tensor_checks`` replaces both on one optimizer instance (nothing global) with
``torch._foreach_norm``: one pass over all gradients, accumulating in fp64 without materialising a copy.

- Overflow: a gradient holds a NaN or an infinity exactly when its fp64 2-norm is not finite (the square of the
  largest finite fp32 value times any possible element count stays far below fp64's range), so the answer is the
  one DeepSpeed's per-tensor ``amax`` / ``amin`` test gives, and the step is skipped in the same cases.
- Norm: DeepSpeed's formula (each kept tensor's fp64 norm, squares summed, all-reduced over the data-parallel
  group, square root, non-finite masked to -1) over the same tensors (zero padding, pipeline-replicated and
  other model-parallel ranks' parameters left out the same way); only the order of the fp64 summation inside a
  tensor differs.

Installed only where the replacement is known to be the same computation: a ZeRO-1/2 optimizer without CPU
offload, MoE layers or a model-parallel group, whose gradients are floating point of at most 32 bits; anything
else keeps DeepSpeed's own methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["install_multi_tensor_checks", "multi_tensor_checks_apply"]

_CHECKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def multi_tensor_checks_apply(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a DeepSpeed ZeRO-1/2 optimizer whose checks ``install_multi_tensor_checks`` replaces."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return False
    if getattr(optimizer, "cpu_offload", True) or getattr(optimizer, "has_moe_layers", True):
        return False
    if getattr(optimizer, "model_parallel_group", None) is not None:
        return False
    if getattr(optimizer, "gradient_accumulation_dtype", torch.float32) not in _CHECKED_DTYPES:
        return False
    return all(parameter.dtype in _CHECKED_DTYPES for group in optimizer.bit16_groups for parameter in group)


def _fp64_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch._foreach_norm(list(tensors), 2, dtype=torch.float64)) if tensors else []


def _has_overflow_partitioned_grads(optimizer: Any) -> torch.Tensor:
    gradients = [
        gradient
        for index in range(len(optimizer.bit16_groups))
        for gradient in optimizer.averaged_gradients[index]
        if gradient is not None and gradient.numel() > 0
    ]
    device = torch.device(optimizer.device) if gradients == [] else gradients[0].device
    norms = _fp64_norms(gradients)
    if not norms:
        return torch.zeros([1], dtype=torch.bool, device=device)
    return (~torch.isfinite(torch.stack(norms))).any().reshape(1)


def _grad_norm_direct(
    optimizer: Any, gradients: Sequence[torch.Tensor], params: Sequence[torch.Tensor], norm_type: float = 2
) -> torch.Tensor:
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace

    if float(norm_type) != 2.0:
        return type(optimizer).get_grad_norm_direct(optimizer, gradients, params, norm_type)
    kept = [
        gradient
        for gradient, parameter in zip(
            (gradient for gradient in gradients if not getattr(gradient, "_zero_padding", False)), params
        )
        if not getattr(parameter, "ds_pipe_replicated", False)
        and (is_model_parallel_parameter(parameter) or optimizer.model_parallel_rank == 0)
    ]
    norms = _fp64_norms(kept)
    if norms:
        total = torch.stack(norms).pow(2).sum().float()
    else:
        total = torch.tensor(0.0, dtype=torch.float32, device=optimizer.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
    total = total.pow(0.5)
    mask_nan_or_inf_with_val_inplace(total, device=optimizer.device)
    return total


def install_multi_tensor_checks(optimizer: Any) -> bool:
    """Replace ``optimizer``'s per-tensor overflow check and gradient norm by the multi-tensor ones (this instance
    only). Returns whether they were installed (``multi_tensor_checks_apply``)."""
    if not multi_tensor_checks_apply(optimizer):
        return False
    optimizer.has_overflow_partitioned_grads_serial = lambda: _has_overflow_partitioned_grads(optimizer)
    optimizer.get_grad_norm_direct = lambda gradients, params, norm_type=2: _grad_norm_direct(
        optimizer, gradients, params, norm_type
    )
    return True
