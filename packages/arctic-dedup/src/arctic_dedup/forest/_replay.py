"""Plan once, layers only launch: a decode call's launches recorded on its plan and replayed by the next layers.

The first ``forest_decode`` call of a plan (per tensor layout) goes through Triton's launcher, which binds ~60
arguments, specialises them and looks the kernel up, and through the launch set-up of ``_launch`` (grids, chunk
sizes, modes, partial buffers): ~150 us of host time per call on an H200 host for ~150 us of GPU work. The
compiled kernels, grids and full argument lists it used are recorded on the plan (``ForestPlan.launches``); every
later call with the same layout (shapes, strides, dtypes, 16-byte alignment of the per-call tensors, scale, current
device) only swaps in its query, caches and outputs and calls the compiled kernels' launcher, exactly as Triton's
launcher does after its lookup. The key holds everything the launcher's specialisation reads from the per-call
tensors, so a replayed launch is the launch Triton would have made; anything else goes the first-call way.

Every tensor argument reaches the launcher as its device address (an int): Triton's launcher takes an int as the
address itself, where for a tensor it calls ``data_ptr()`` and asks the driver to check the address
(``cuPointerGetAttribute``), about 20 times per launch. The plan's own tensors and the partial buffers are
resolved once, when recorded, and kept alive by the recorded launch; a replay resolves only its five tensors, whose
devices the key has checked. While a launch hook is installed (a profiler), calls take Triton's launcher, so the
hook sees every launch with its usual arguments.

Replays reuse the first call's partial buffers (scratch that each call fully rewrites before reading) and run in
stream order, as the calls of one plan must (``ForestPlan``).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LaunchRecorder", "PreparedLaunch", "call_key", "replay"]

# Layouts one plan remembers (a model's layers share one; a few more cover out/lse views); past this it starts over.
MAX_LAYOUTS_PER_PLAN = 8


@dataclass(frozen=True)
class PreparedLaunch:
    """One kernel launch: the compiled kernel's launcher and handles, its grid, every bound argument (tensors as
    device addresses), where the per-call tensors go, and the tensors whose addresses it holds."""

    launcher: Any
    function: Any
    packed_metadata: Any
    grid: tuple[int, int, int]
    args: tuple[Any, ...]
    slots: tuple[tuple[int, int], ...]  # (argument position, index into the call's tensors)
    holds: tuple[torch.Tensor, ...]


@functools.cache
def _triton_runtime() -> tuple[Any, Any]:
    from triton import knobs
    from triton.runtime import driver

    return knobs, driver


def _hook_installed(hook: Any) -> bool:
    # Triton 3.6 keeps a chain of hooks that is never None (empty: nothing to call); older releases keep None or one.
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or bool(calls)


def call_key(tensors: tuple[torch.Tensor, ...], scale: float, device: int | None = None) -> tuple[Any, ...]:
    """Everything of one call that Triton's launcher specialises on or that the recorded launches depend on."""
    if device is None:
        device = _triton_runtime()[1].active.get_current_device()
    parts: list[Any] = [float(scale), device]
    for tensor in tensors:
        parts.append((tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.data_ptr() % 16 == 0))
    return tuple(parts)


class LaunchRecorder:
    """Collects the launches of one first call; ``launches`` once both kernels went through Triton's launcher."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self._tensors = tensors
        self.launches: list[PreparedLaunch] = []

    def launch(self, kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], options: dict[str, Any]) -> None:
        """Launch ``kernel[grid](*args, **options)`` through Triton and record what it launched."""
        compiled = kernel[grid](*args, **options)
        parameters = list(inspect.signature(kernel.fn).parameters.values())
        names = [parameter.name for parameter in parameters]
        given = dict(zip(names, args, strict=False))
        given.update({name: value for name, value in options.items() if name in names})
        bound = [given.get(parameter.name, parameter.default) for parameter in parameters]
        slots = tuple(
            (position, which)
            for position, value in enumerate(bound)
            for which, tensor in enumerate(self._tensors)
            if value is tensor
        )
        call_positions = {position for position, _ in slots}
        holds: list[torch.Tensor] = []
        for position, value in enumerate(bound):
            if position in call_positions:
                bound[position] = None  # filled by each replay; the plan must not keep this call's tensors alive
            elif isinstance(value, torch.Tensor):
                holds.append(value)
                bound[position] = value.data_ptr()
        padded = (*grid, 1, 1)[:3]
        self.launches.append(
            PreparedLaunch(
                compiled.run,
                compiled.function,
                compiled.packed_metadata,
                (int(padded[0]), int(padded[1]), int(padded[2])),
                tuple(bound),
                slots,
                tuple(holds),
            )
        )


def replay(
    recorded: dict[tuple[Any, ...], tuple[PreparedLaunch, ...]], tensors: tuple[torch.Tensor, ...], scale: float
) -> bool:
    """Launch the kernels recorded for this call's layout with its tensors on the current stream; False (nothing
    launched) when none are recorded or a launch hook is installed."""
    knobs, driver = _triton_runtime()
    runtime = knobs.runtime
    if _hook_installed(runtime.launch_enter_hook) or _hook_installed(runtime.launch_exit_hook):
        return False
    device = driver.active.get_current_device()
    launches = recorded.get(call_key(tensors, scale, device))
    if launches is None:
        return False
    stream = driver.active.get_current_stream(device)
    addresses = [tensor.data_ptr() for tensor in tensors]
    for launch in launches:
        args = list(launch.args)
        for position, which in launch.slots:
            args[position] = addresses[which]
        launch.launcher(*launch.grid, stream, launch.function, launch.packed_metadata, None, None, None, *args)
    return True
