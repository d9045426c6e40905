"""Run the Triton kernels of these tests through Triton's CPU interpreter (must be set before triton is imported)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
