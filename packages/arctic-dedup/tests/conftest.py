"""Test setup: Triton kernels run on CPU tensors through the interpreter unless CUDA is there to compile them.

``TRITON_INTERPRET`` must be decided before triton is first imported, so it is set here, at collection start.
``nox -s tests`` forces the interpreter (CPU tensors), ``nox -s gpu_tests`` forces compilation.
"""

import os

import pytest
import torch

if os.environ.get("ARCTIC_GPU_TESTS") == "1":
    os.environ["TRITON_INTERPRET"] = "0"
else:
    os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")


# Warnings filters for this suite (issue #24: a warning from our own code is a bug, so it fails the test).
WARNING_FILTERS = [
    # Our code converting a tensor that still needs its gradient to a Python number (detach it first).
    "error:Converting a tensor with requires_grad=True to a scalar:UserWarning",
    # Anomaly mode slows every op down; it is a debugging aid, not a test setting.
    "error:Anomaly Detection has been enabled:UserWarning",
    # torch itself: importing torch._inductor (the first torch.compile of a process) reaches a deprecated
    # torch.jit.script_method inside torch; nothing in our code calls it.
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
]


def pytest_configure(config: pytest.Config) -> None:
    for line in WARNING_FILTERS:
        config.addinivalue_line("filterwarnings", line)
