"""The environment variables each engine needs before vLLM, arctic-fca or DeepSpeed are imported: written here only.

The actors pass them in their ``runtime_env`` (so they exist before the engine module imports its libraries), and
the sampling engine writes them into its own process again (an engine built in-process, as tests and the verl
plugin's local mode do, gets the same values). Nothing here imports a heavy library.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from arctic_rl.config import ArcticRLClientConfig
    from arctic_rl.placement import Role, WorkerSlot

__all__ = ["DEFAULT_CPU_KV_CACHE_GIB", "cpu_kv_cache_space", "engine_environment"]

# vLLM's CPU build sizes its KV cache by VLLM_CPU_KVCACHE_SPACE (whole GiB); without a configured size one GiB.
DEFAULT_CPU_KV_CACHE_GIB = 1


def cpu_kv_cache_space(gib: float | None) -> str:
    """``VLLM_CPU_KVCACHE_SPACE`` for a KV cache of ``gib`` GiB (``sampling.kv_cache_space_gib``).

    vLLM reads whole GiB; a fractional size is rounded up, so the cache is never smaller than configured
    (1.5 -> 2, 0.25 -> 1). ``None``: :data:`DEFAULT_CPU_KV_CACHE_GIB`.
    """
    if gib is None:
        return str(DEFAULT_CPU_KV_CACHE_GIB)
    if not gib > 0:
        raise ValueError(f"the KV-cache size must be > 0 GiB, got {gib!r}; set sampling.kv_cache_space_gib > 0.")
    return str(math.ceil(gib))


def engine_environment(config: ArcticRLClientConfig, role: Role, slot: WorkerSlot | None = None) -> dict[str, str]:
    """Environment variables ``role``'s engine needs before its libraries are imported (``slot``: its placement)."""
    environment = {"TOKENIZERS_PARALLELISM": "false"}
    cpu = config.resolved_device() == "cpu"
    if role in ("training", "log_prob") and cpu:
        environment["DS_ACCELERATOR"] = "cpu"
    if role == "sampling":
        # The engine core stays in the engine's process: in-process weight loading, and FCA stats counted where they
        # are read; on the CPU the build cannot pass tensors to a separate engine process either.
        environment["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if cpu:
            environment["VLLM_CPU_KVCACHE_SPACE"] = cpu_kv_cache_space(config.sampling.kv_cache_space_gib)
        elif slot is not None and len(slot.bundle_indices) > 1:
            # A colocated tensor-parallel replica spreads its vLLM workers over the bundles of its devices.
            environment["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(index) for index in slot.bundle_indices)
        # Always written, FCA off included: a process that inherited ARCTIC_FCA=1 must not register the backend.
        environment.update(config.fca.environment())
    return environment
