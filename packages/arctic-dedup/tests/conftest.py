"""Test setup: Triton kernels run on CPU tensors through the interpreter unless CUDA is there to compile them.

``TRITON_INTERPRET`` must be decided before triton is first imported, so it is set here, at collection start.
``nox -s tests`` forces the interpreter (CPU tensors), ``nox -s gpu_tests`` forces compilation.
"""

import os

import torch

if os.environ.get("ARCTIC_GPU_TESTS") == "1":
    os.environ["TRITON_INTERPRET"] = "0"
else:
    os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
