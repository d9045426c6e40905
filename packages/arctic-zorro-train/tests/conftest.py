"""Test setup: every test starts from the same random seed; tiny models run single-threaded. The summary names the
largest dedup-vs-reference difference seen per dtype (the margin under the 1e-5 bound)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from zorro_cases import LARGEST_DIFFERENCES, TOLERANCE

# The test models are tiny: intra-op threads only add synchronization (2-4x slower on a shared 2-core runner).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for label, (difference, name, test) in sorted(LARGEST_DIFFERENCES.items()):
        terminalreporter.write_line(
            f"largest {label} dedup-vs-reference difference: {difference:.2e} (bound {TOLERANCE:g}), {name} in {test}"
        )
