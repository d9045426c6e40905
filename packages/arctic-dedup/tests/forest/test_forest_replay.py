"""The launch recorder and replay of forest_decode (plan once, layers only launch), with a stand-in for Triton's
kernels: what is recorded, what the plan keeps, and what a replay passes to the compiled kernel's launcher. The real
kernels' replays are compared with first calls on the GPU (test_forest_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from arctic_dedup.forest import _replay


def _kernel_body(query, cache, table, out, scale, count, BLOCK, MODE=3):  # type: ignore[no-untyped-def]
    """Stands in for a @triton.jit function: only its signature is read."""


class FakeCompiled:
    function = "function-handle"
    packed_metadata = "metadata"

    def __init__(self) -> None:
        self.runs: list[tuple[Any, ...]] = []

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


class HookChain:
    """Triton 3.6's chain of launch hooks: never None, empty unless a profiler adds one."""

    def __init__(self) -> None:
        self.calls: list[Any] = []


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    driver = SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 77))
    hooks = SimpleNamespace(launch_enter_hook=HookChain(), launch_exit_hook=HookChain())
    monkeypatch.setattr(_replay, "_triton_runtime", lambda: (SimpleNamespace(runtime=hooks), driver))
    return hooks


def _record(kernel: FakeKernel, call: tuple[torch.Tensor, ...], table: torch.Tensor) -> _replay.PreparedLaunch:
    query, cache, out = call
    recorder = _replay.LaunchRecorder(call)
    recorder.launch(kernel, (5,), (query, cache, table, out, 0.5, 7), {"BLOCK": 16, "num_warps": 4})
    (launch,) = recorder.launches
    return launch


def test_recorded_launch_binds_every_argument_as_addresses_and_keeps_no_call_tensor(runtime: SimpleNamespace) -> None:
    query, cache, out, table = torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.arange(4)
    kernel = FakeKernel()
    launch = _record(kernel, (query, cache, out), table)
    assert kernel.launched == [((5,), (query, cache, table, out, 0.5, 7), {"BLOCK": 16, "num_warps": 4})]
    assert launch.launcher == kernel.compiled.run and launch.grid == (5, 1, 1)
    assert (launch.function, launch.packed_metadata) == ("function-handle", "metadata")
    # Positional values, then the constexpr given as an option, then the default; launch options are not arguments.
    # The plan's own tensor goes as its address and is held by the launch; the call's tensors are not kept.
    assert launch.args == (None, None, table.data_ptr(), None, 0.5, 7, 16, 3)
    assert launch.slots == ((0, 0), (1, 1), (3, 2))
    assert len(launch.holds) == 1 and launch.holds[0] is table


def test_replay_passes_the_new_call_addresses_on_the_current_stream_without_hooks(runtime: SimpleNamespace) -> None:
    first = (torch.zeros(2), torch.zeros(3), torch.zeros(2))
    table = torch.arange(4)
    kernel = FakeKernel()
    launch = _record(kernel, first, table)
    recorded = {_replay.call_key(first, 0.1): (launch, launch)}
    new = (torch.ones(2), torch.ones(3), torch.ones(2))
    assert _replay.replay(recorded, new, 0.1)
    assert len(kernel.compiled.runs) == 2
    for run in kernel.compiled.runs:
        # grid, stream, handles, then no launch metadata and no hooks (the chains are empty), then the arguments.
        assert run[:9] == (5, 1, 1, 77, "function-handle", "metadata", None, None, None)
        assert run[9:] == (new[0].data_ptr(), new[1].data_ptr(), table.data_ptr(), new[2].data_ptr(), 0.5, 7, 16, 3)


def test_replay_declines_other_layouts_and_installed_hooks(runtime: SimpleNamespace) -> None:
    first = (torch.zeros(2), torch.zeros(3), torch.zeros(2))
    kernel = FakeKernel()
    recorded = {_replay.call_key(first, 0.1): (_record(kernel, first, torch.arange(4)),)}
    assert not _replay.replay(recorded, (torch.zeros(3), torch.zeros(3), torch.zeros(2)), 0.1)  # another shape
    assert not _replay.replay(recorded, first, 0.2)  # another scale
    runtime.launch_exit_hook.calls.append(print)  # a profiler's hook: Triton's launcher must see the launch
    assert not _replay.replay(recorded, first, 0.1)
    runtime.launch_exit_hook.calls.clear()
    runtime.launch_enter_hook = None  # releases before Triton 3.6 keep None when no hook is set
    assert _replay.replay(recorded, first, 0.1)
    assert len(kernel.compiled.runs) == 1


def test_call_key_separates_layouts_and_alignment(runtime: SimpleNamespace) -> None:
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
    assert _replay.call_key(aligned, 0.1, device=1) != key  # another current device
