"""Test setup: every test starts from the same random seed; tiny models run single-threaded. The summary names the
largest dedup-vs-reference difference seen per dtype (the margin under the 1e-5 bound)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from zorro_cases import LARGEST_DIFFERENCES, TOLERANCE

# The test models are tiny: intra-op threads only add synchronization (2-4x slower on a shared 2-core runner).
torch.set_num_threads(1)


# Warnings filters for this suite (issue #24: a warning from our own code is a bug, so it fails the test).
WARNING_FILTERS = [
    # Our code converting a tensor that still needs its gradient to a Python number (detach it first).
    "error:Converting a tensor with requires_grad=True to a scalar:UserWarning",
    # Anomaly mode belongs inside the one test that records forward call sites with it (test_overhead.py).
    "error:Anomaly Detection has been enabled:UserWarning",
    # torch itself: importing torch._inductor (the first torch.compile of a process) reaches a deprecated
    # torch.jit.script_method inside torch; nothing in our code calls it.
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
]


def pytest_configure(config: pytest.Config) -> None:
    for line in WARNING_FILTERS:
        config.addinivalue_line("filterwarnings", line)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for label, (difference, name, test) in sorted(LARGEST_DIFFERENCES.items()):
        terminalreporter.write_line(
            f"largest {label} dedup-vs-reference difference: {difference:.2e} (bound {TOLERANCE:g}), {name} in {test}"
        )
