"""The pieces verl's trainer needs around the Arctic engine and replica, without a server: the weight-update manager,
the hybrid worker's rollout, the replica's abort and KV-cache calls, and the CPU platform (registered in verl's
registries by the plugin, which verl imports itself)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import verl.utils.distributed
from verl.checkpoint_engine import CheckpointEngineManager
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry
from verl.workers.rollout.base import get_rollout_class

from arctic_rl.integrations.verl import ArcticRolloutServer
from arctic_rl.integrations.verl_platform import PLATFORM, ArcticCPUPlatform, register_platform
from arctic_rl.integrations.verl_weights import MANAGER_CLASS, ArcticCheckpointEngineManager, ArcticRollout


class RecordingClient:
    """The thin client's verbs these pieces call, recorded in order."""

    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls = calls

    def sync_weights(self) -> dict[str, float]:
        self.calls.append(("sync_weights", None))
        return {"time_s": 0.25}

    def sleep_inference(self, level: int = 1) -> None:
        self.calls.append(("sleep_inference", level))

    def wake_inference(self, tags: Any = None) -> None:
        self.calls.append(("wake_inference", tags))


class RecordingConnection:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def connect(self, model_name: str) -> RecordingClient:
        return RecordingClient(self.calls)


class RecordingReplica:
    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls = calls

    async def wake_up(self) -> None:
        self.calls.append(("replica.wake_up", None))

    async def sleep(self) -> None:
        self.calls.append(("replica.sleep", None))


def test_the_plugin_registers_the_rollout_manager_and_platform_with_verl() -> None:
    assert get_rollout_class("arctic", "async") is ArcticRollout
    platform = PlatformRegistry.get(PLATFORM)
    assert platform is not None and issubclass(platform, ArcticCPUPlatform) and issubclass(platform, PlatformBase)
    assert issubclass(ArcticCheckpointEngineManager, CheckpointEngineManager)
    module, _, name = MANAGER_CLASS.rpartition(".")
    assert (module, name) == (ArcticCheckpointEngineManager.__module__, ArcticCheckpointEngineManager.__name__)


def test_update_weights_wakes_the_samplers_then_syncs_inside_the_server() -> None:
    connection = RecordingConnection()
    replicas = [RecordingReplica(connection.calls), RecordingReplica(connection.calls)]
    manager = ArcticCheckpointEngineManager(
        config=None,
        actor_wg=None,
        replicas=replicas,
        connection=connection,  # type: ignore[arg-type]
    )
    # verl's trainer calls it synchronously (auto_await), after putting the samplers to sleep.
    manager.sleep_replicas()
    metrics = manager.update_weights(3)
    assert connection.calls == [
        ("replica.sleep", None),
        ("replica.sleep", None),
        ("replica.wake_up", None),
        ("replica.wake_up", None),
        ("sync_weights", None),
    ]
    assert metrics == {"arctic/sync_time_s": 0.25}
    with pytest.raises(NotImplementedError, match="sync_weights"):
        manager.build_process_group(None)


def test_the_hybrid_workers_rollout_refuses_the_weight_pull_and_names_the_manager() -> None:
    rollout = object.__new__(ArcticRollout)
    for call in (rollout.resume(["weights"]), rollout.release(), rollout.update_weights(iter([]))):
        with pytest.raises(NotImplementedError, match=MANAGER_CLASS.replace(".", r"\.")):
            asyncio.run(call)


def test_the_replica_aborts_nothing_idle_refuses_in_flight_and_frees_kv_by_sleeping() -> None:
    connection = RecordingConnection()
    server = ArcticRolloutServer(connection, "tiny", max_prompt_length=4, max_response_length=4)  # type: ignore[arg-type]
    asyncio.run(server.abort_all_requests())
    asyncio.run(server.resume_generation())
    server._in_flight = 2
    with pytest.raises(NotImplementedError, match="cannot abort the 2 in flight"):
        asyncio.run(server.abort_all_requests(reject_request=True))
    asyncio.run(server.release_kv_cache())
    asyncio.run(server.resume_kv_cache())
    assert connection.calls == [("sleep_inference", 1), ("wake_inference", None)]


def test_the_cpu_platform_answers_cpu_and_gloo_and_is_never_auto_detected() -> None:
    registered = PlatformRegistry.get(PLATFORM)
    assert registered is not None
    platform = registered()  # verl's PlatformBase refuses a class with any of its methods missing
    assert (platform.device_name, platform.communication_backend_name()) == ("cpu", "gloo")
    assert platform.is_available() and not platform.is_platform_available(use_smi_check=True)
    assert platform.ray_resource_name() == "GPU"
    device = platform.device_module
    assert device.memory_allocated() == 0 and device.max_memory_reserved() == 0
    assert device.empty_cache() is None and device.is_available()


def test_selected_it_gives_verls_default_process_group_the_cpu_backend_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Any, Any]] = []

    def initialize(timeout_second: Any = None, backend: Any = None) -> None:
        seen.append((timeout_second, backend))

    monkeypatch.setattr(verl.utils.distributed, "initialize_global_process_group_ray", initialize)
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    register_platform()
    assert verl.utils.distributed.initialize_global_process_group_ray is initialize

    monkeypatch.setenv("VERL_PLATFORM", PLATFORM)
    register_platform()
    register_platform()  # idempotent: wrapped once
    verl.utils.distributed.initialize_global_process_group_ray(timeout_second=None)
    verl.utils.distributed.initialize_global_process_group_ray(timeout_second=5, backend="cpu:gloo,cuda:nccl")
    assert seen == [(None, "cpu:gloo"), (5, "cpu:gloo,cuda:nccl")]
