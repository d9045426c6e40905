"""Whether Triton kernels can run on a tensor: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch

__all__ = ["Backend", "interpreting", "resolve_backend", "triton_available"]

Backend = Literal["auto", "triton", "torch"]


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` is installed (looked up once: a lookup costs ~50 us and layers ask on every call)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (set ``TRITON_INTERPRET=1`` before import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: Backend, tensor: torch.Tensor) -> Literal["triton", "torch"]:
    """``auto`` picks Triton on CUDA tensors (and on CPU tensors when interpreting), torch otherwise."""
    if backend == "torch":
        return "torch"
    usable = triton_available() and (tensor.is_cuda or (tensor.device.type == "cpu" and interpreting()))
    if backend == "triton":
        if not usable:
            raise RuntimeError(
                f"backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 for CPU tensors) and the `triton` "
                f"package; got a {tensor.device.type} tensor, triton installed: {triton_available()}. "
                "Use backend='auto' or 'torch'."
            )
        return "triton"
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    return "triton" if usable else "torch"
