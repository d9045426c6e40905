"""Test setup: every test starts from the same random seed."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
