"""Test setup: every test starts from the same random seed; tiny models run single-threaded."""

from __future__ import annotations

import pytest
import torch

# The test models are tiny: intra-op threads only add synchronization (2-4x slower on a shared 2-core runner).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
