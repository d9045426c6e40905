"""The launch recorder and replay of forest_decode (plan once, layers only launch), with a stand-in for Triton's
kernels: what is recorded, what the plan keeps, and what a replay passes to the compiled kernel's launcher. The real
kernels' replays are compared with first calls on the GPU (test_forest_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from arctic_dedup.forest import _replay


def _kernel_body(query, cache, out, scale, count, BLOCK, MODE=3):  # type: ignore[no-untyped-def]
    """Stands in for a @triton.jit function: only its signature is read."""


class FakeCompiled:
    function = "function-handle"
    packed_metadata = "metadata"

    def __init__(self) -> None:
        self.runs: list[tuple[Any, ...]] = []

    def launch_metadata(self, grid: tuple[int, int, int], stream: int, *args: Any) -> None:
        return None

    def run(self, *args: Any) -> None:
        self.runs.append(args)


class FakeKernel:
    fn = staticmethod(_kernel_body)

    def __init__(self) -> None:
        self.compiled = FakeCompiled()
        self.launched: list[tuple[Any, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **options: Any) -> FakeCompiled:
            self.launched.append((grid, args, options))
            return self.compiled

        return launch


@pytest.fixture
def fake_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 77))
    knobs = SimpleNamespace(runtime=SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    monkeypatch.setattr(_replay, "_triton_runtime", lambda: (knobs, driver))


def test_recorded_launch_binds_every_argument_and_keeps_no_call_tensor(fake_triton: None) -> None:
    query, cache, out, other = torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.ones(1)
    recorder = _replay.LaunchRecorder((query, cache, out))
    kernel = FakeKernel()
    recorder.launch(kernel, (5,), (query, cache, out, 0.5, 7), {"BLOCK": 16, "num_warps": 4})
    assert kernel.launched == [((5,), (query, cache, out, 0.5, 7), {"BLOCK": 16, "num_warps": 4})]
    (launch,) = recorder.launches
    assert launch.kernel is kernel.compiled and launch.grid == (5, 1, 1)
    # Positional values, then the constexpr given as an option, then the default; launch options are not arguments.
    assert launch.args == (None, None, None, 0.5, 7, 16, 3)
    assert launch.slots == ((0, 0), (1, 1), (2, 2))
    # A replay passes the new call's tensors where the first call's were, on the current stream.
    new = (torch.ones(2), other, torch.ones(2))
    _replay.replay((launch,), new)
    (run,) = kernel.compiled.runs
    assert run[:9] == (5, 1, 1, 77, "function-handle", "metadata", None, None, None)
    assert run[9:] == (new[0], new[1], new[2], 0.5, 7, 16, 3)


def test_call_key_separates_layouts_and_alignment(fake_triton: None) -> None:
    base = torch.zeros(33)
    aligned = (base[:16], torch.zeros(4, 2), torch.zeros(16))
    same_layout = (torch.ones(16), torch.ones(4, 2), torch.ones(16))
    shifted = (base[1:17], torch.zeros(4, 2), torch.zeros(16))
    transposed = (torch.ones(16), torch.ones(2, 4).t(), torch.ones(16))
    key = _replay.call_key(aligned, 0.1)
    assert _replay.call_key(same_layout, 0.1) == key
    assert _replay.call_key(aligned, 0.2) != key
    assert _replay.call_key(shifted, 0.1) != key  # 4 bytes off a 16-byte boundary
    assert _replay.call_key(transposed, 0.1) != key
