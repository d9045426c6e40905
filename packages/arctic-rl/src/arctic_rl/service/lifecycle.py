"""The engines' lifecycle: place the workers, create their actors, start every engine (data-parallel ranks
together, since their process group forms only when all join), and stop them all again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from arctic_rl.actors import EngineHandle
    from arctic_rl.config import ArcticRLClientConfig
    from arctic_rl.engines.protocols import LogProbEngineProtocol, SamplingEngineProtocol, TrainingEngineProtocol
    from arctic_rl.placement import Placement
    from arctic_rl.service.engine_calls import EngineCalls

__all__ = ["Engines", "start_engines", "stop_engines"]


@dataclass
class Engines:
    """The started engines by role, where they were placed, and the request limits they reported."""

    placement: Placement | None = None
    training: list[EngineHandle[TrainingEngineProtocol]] = field(default_factory=list)
    log_prob: list[EngineHandle[LogProbEngineProtocol]] = field(default_factory=list)
    sampling: list[EngineHandle[SamplingEngineProtocol]] = field(default_factory=list)
    vocab_size: int | None = None
    max_positions: int | None = None
    # The sampler's request limits (test fakes report none).
    sampler_limits: dict[str, int] | None = None
    step_count: int = 0

    def all(self) -> list[EngineHandle[Any]]:
        return [*self.training, *self.log_prob, *self.sampling]

    def node_of(self, handle: EngineHandle[Any]) -> str | None:
        if self.placement is None:
            return None
        for slot in self.placement.plan.workers:
            if slot.role == handle.role and slot.rank == handle.rank:
                return slot.node_id
        return None


def start_engines(
    engines: Engines,
    config: ArcticRLClientConfig,
    calls: EngineCalls,
    *,
    engine_classes: Mapping[str, str],
    placement_overrides: Mapping[str, Any],
    timeout_s: float,
) -> None:
    """Place and start every engine into ``engines`` (the caller stops them on failure)."""
    from arctic_rl.actors import launch_engine_actor
    from arctic_rl.placement import PlacementRequest, place

    request = PlacementRequest.from_config(config, **placement_overrides)
    engines.placement = place(request, timeout_s=min(timeout_s, 300.0))
    by_role: dict[str, list[EngineHandle[Any]]] = {
        "training": engines.training,
        "log_prob": engines.log_prob,
        "sampling": engines.sampling,
    }
    for slot in engines.placement.plan.workers:
        by_role[slot.role].append(launch_engine_actor(engines.placement, slot, config))
    pending: list[tuple[EngineHandle[Any], Any]] = []
    for role in ("training", "log_prob"):
        handles = by_role[role]
        if not handles:
            continue
        master_addr, master_port = calls.get(
            handles[0], [handles[0].actor.node_ip.remote(), handles[0].actor.free_port.remote()], timeout=timeout_s
        )
        for handle in handles:
            kwargs = {
                "rank": handle.rank,
                "world_size": len(handles),
                "master_addr": master_addr,
                "master_port": master_port,
                "role": role,
            }
            # Each engine gets its own sections of the config, nothing of the client's (HTTP, token file, Ray).
            role_config = config.for_engine(role)
            pending.append((handle, handle.actor.start.remote(engine_classes[role], role_config, kwargs)))
    sampling_config = config.for_engine("sampling")
    for handle in engines.sampling:
        kwargs = {"replica": handle.rank}
        pending.append((handle, handle.actor.start.remote(engine_classes["sampling"], sampling_config, kwargs)))
    for handle, reference in pending:
        info = calls.get(handle, reference, timeout=timeout_s)
        handle.pid = info["pid"]
        if handle.role == "training" and handle.rank == 0:
            engines.vocab_size = info["vocab_size"]
            engines.max_positions = info.get("max_positions")
        if handle.role == "sampling" and handle.rank == 0 and info.get("max_model_len"):
            engines.sampler_limits = {"vocab_size": info["vocab_size"], "max_model_len": info["max_model_len"]}
    if engines.training:
        rank0 = engines.training[0]
        engines.step_count = int(calls.get(rank0, rank0.actor.get.remote("step_count"), timeout=timeout_s))


def stop_engines(engines: Engines, dead: Mapping[str, str]) -> None:
    """Stop every engine, kill its actor and remove the placement groups (idempotent). An engine in ``dead`` (a
    stuck one would not answer) is only killed."""
    import ray

    handles = engines.all()
    engines.training, engines.log_prob, engines.sampling = [], [], []
    stops = []
    for handle in handles:
        if handle.name in dead:
            continue
        try:
            stops.append(handle.actor.stop.remote())
        except Exception:  # an actor that is already gone has nothing to stop
            continue
    if stops:
        ray.wait(stops, num_returns=len(stops), timeout=30)
    for handle in handles:
        try:
            ray.kill(handle.actor, no_restart=True)
        except Exception:  # already dead
            continue
    if engines.placement is not None:
        engines.placement.remove()
        engines.placement = None
