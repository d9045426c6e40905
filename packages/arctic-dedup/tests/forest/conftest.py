"""Run Triton kernels through the interpreter on machines without CUDA (must happen before triton is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
