"""A CPU platform for verl's processes when every model runs in an arctic-rl server.

verl 0.9.1 resolves one platform per process (``verl.plugin.platform``) and, finding no accelerator, falls back to
NVIDIA's: its workers then ask torch.distributed for NCCL (``verl/utils/distributed.py``,
``initialize_global_process_group_ray``), which a CPU build of torch does not have. With the Arctic engine and
replica nothing of verl's touches a device, so its workers only need a process group for their bookkeeping: this
platform answers ``cpu`` and ``gloo``. Select it with ``VERL_PLATFORM=arctic_cpu`` (verl's override, read before
auto-detection), beside ``VERL_USE_EXTERNAL_MODULES=arctic_rl.integrations.verl``, which registers it.

Ray placement still goes through a ``GPU`` resource: verl's resource pools ask each worker for one and check that
the cluster has them (``verl/single_controller/ray/base.py``, ``_check_resource_available``), so on a CPU-only
machine declare logical ones with ``+ray_kwargs.ray_init.num_gpus=N`` (and leave ``CUDA_VISIBLE_DEVICES`` unset:
Ray refuses logical GPUs when it names none).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

__all__ = ["PLATFORM", "ArcticCPUPlatform", "register_platform"]

# The value of VERL_PLATFORM that selects this platform.
PLATFORM = "arctic_cpu"


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


class _CPUDeviceModule(ModuleType):
    """``torch.cpu`` with the ``torch.cuda`` calls verl's workers make around (not in) device work: memory statistics
    read 0 (the models' memory is the server's), cache and IPC clean-ups do nothing, the RNG state is torch's."""

    def __init__(self) -> None:
        super().__init__("arctic_cpu_device")
        for name in ("empty_cache", "ipc_collect", "set_per_process_memory_fraction", "reset_peak_memory_stats"):
            setattr(self, name, _nothing)
        for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
            setattr(self, name, _zero)
        self.get_rng_state = torch.get_rng_state
        self.set_rng_state = torch.set_rng_state
        self.manual_seed = torch.manual_seed
        self.manual_seed_all = torch.manual_seed

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        return 0, 0


_DEVICE_MODULE = _CPUDeviceModule()


class ArcticCPUPlatform:
    """verl's platform interface on the CPU: one device, ``gloo`` collectives, no memory to manage.

    verl's registry takes a subclass of its ``PlatformBase``; :func:`register_platform` registers one with this class
    first. This module imports nothing of verl's itself: verl imports the plugin (which registers the platform) at
    ``import verl``, and a module that imported verl at its top would import itself half-done, whichever comes first.
    """

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return PLATFORM

    @property
    def device_module(self) -> ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: a machine with an accelerator must not land here unless VERL_PLATFORM says so.
        return False

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        """One CPU device: nothing to select."""

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU work is synchronous."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        """The CPU allocator has no settings verl uses."""

    def empty_cache(self) -> None:
        """No device cache to empty."""

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray names the logical GPUs it hands out here; a CPU build of torch ignores it.
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        """No device profiler."""

    def profiler_stop(self) -> None:
        """No device profiler."""

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def _gloo_process_group(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def initialize(timeout_second: int | None = None, backend: str | None = None) -> None:
        original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    initialize.__arctic_cpu__ = True  # type: ignore[attr-defined]
    return initialize


def register_platform() -> None:
    """Register :class:`ArcticCPUPlatform` as ``arctic_cpu`` with verl's ``PlatformRegistry`` (idempotent); when
    ``VERL_PLATFORM=arctic_cpu`` selects it, also give verl's process groups the CPU backend alone.

    verl builds its default backend string as ``cpu:gloo,<device>:<collective>``
    (``verl/utils/distributed.py``, ``initialize_global_process_group_ray``), which names the CPU twice when the
    device is the CPU, and torch.distributed refuses that; its ``TrainingWorker`` calls it without a backend
    (``verl/workers/engine_workers.py``). Only with this platform selected, that default becomes ``cpu:gloo``: in
    ``verl.utils.distributed``, and in ``verl.workers.engine_workers`` when it already imported the function.
    """
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    registered = PlatformRegistry.get(PLATFORM)
    if registered is None or not issubclass(registered, ArcticCPUPlatform):
        platform = type("ArcticCPUPlatform", (ArcticCPUPlatform, PlatformBase), {"__module__": __name__})
        PlatformRegistry.register(platform=PLATFORM)(platform)
    if os.environ.get("VERL_PLATFORM", "").strip().lower() != PLATFORM:
        return
    modules = [importlib.import_module("verl.utils.distributed")]
    if "verl.workers.engine_workers" in sys.modules:
        modules.append(sys.modules["verl.workers.engine_workers"])
    for module in modules:
        current = getattr(module, "initialize_global_process_group_ray")  # noqa: B009
        if not getattr(current, "__arctic_cpu__", False):
            setattr(module, "initialize_global_process_group_ray", _gloo_process_group(current))  # noqa: B010
