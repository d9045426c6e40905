"""What the fused kernels' launchers share: where they can run, the compute dtype, new buffers (poisoned in tests)."""

from __future__ import annotations

from typing import Any

import torch

from arctic_dedup._triton_support import interpreting, triton_available


def kernels_usable(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``tensor``: a CUDA tensor, or a CPU tensor under Triton's interpreter
    (``TRITON_INTERPRET=1``, which must be set before ``triton`` is first imported); both need ``triton``."""
    if not triton_available():
        return False
    return tensor.is_cuda or (tensor.device.type == "cpu" and interpreting())


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in: float64 for float64 inputs (as transformers does inside
    ``arctic_zorro_train.testing.float64_everywhere``, where the exactness tests run), fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def triton_compute_dtype(dtype: torch.dtype) -> Any:
    """``accumulator_dtype`` as a Triton dtype (for a kernel's ``COMPUTE_DTYPE`` constexpr)."""
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def new_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, poison: bool) -> torch.Tensor:
    """An uninitialized buffer, or one full of NaN when ``poison`` (tests: an element a kernel skips then fails)."""
    if poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
