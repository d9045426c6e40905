"""What the fused kernels' launchers share: the compute dtype and new buffers (poisoned in tests)."""

from __future__ import annotations

import torch


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in: float64 for float64 inputs (as transformers does inside
    ``arctic_zorro_train.testing.float64_everywhere``, where the exactness tests run), fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def new_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, poison: bool) -> torch.Tensor:
    """An uninitialized buffer, or one full of NaN when ``poison`` (tests: an element a kernel skips then fails)."""
    if poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
