"""Test setup: Triton kernels run on CPU tensors through the interpreter unless a GPU run says otherwise."""

import os

# Must be set before triton is first imported (by the kernels under test).
os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("ARCTIC_GPU_TESTS") == "1" else "1")
