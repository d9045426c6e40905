"""RLService: the one implementation of every client operation (the table of :mod:`arctic_rl.operations`), over the
engine actors. It combines one class of operations per concern (:mod:`.generation`, :mod:`.training`,
:mod:`.weights`, :mod:`.sleep_wake`, over the shared state of :mod:`.base`) and adds the lifecycle (placement and
start-up in :mod:`.lifecycle`), the dispatch of an operation by name, ``train_step`` (which spans training and weight
sync) and the last step's metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from arctic_rl.errors import InvalidRequestError
from arctic_rl.service.engine_calls import EngineCalls
from arctic_rl.service.generation import GenerationOperations
from arctic_rl.service.lifecycle import Engines, start_engines, stop_engines
from arctic_rl.service.requests import check_flag
from arctic_rl.service.sleep import SleepStates
from arctic_rl.service.sleep_wake import SleepOperations
from arctic_rl.service.step_metrics import StepMetrics
from arctic_rl.service.training import TrainingOperations
from arctic_rl.service.weight_sync import WeightSync
from arctic_rl.service.weights import WeightOperations

if TYPE_CHECKING:
    from arctic_rl.config import ArcticRLClientConfig

__all__ = ["RLService"]


class RLService(GenerationOperations, TrainingOperations, WeightOperations, SleepOperations):
    """Places the engines, starts them, and implements every client operation. Use through
    :func:`arctic_rl.service.start_service`.

    ``engine_classes`` overrides the ``"module:Class"`` of a role's engine (tests use small fakes);
    ``placement_overrides`` sets ``PlacementRequest`` fields such as the CPU claim per worker.
    """

    def __init__(
        self,
        config: ArcticRLClientConfig,
        *,
        engine_classes: Mapping[str, str] | None = None,
        placement_overrides: Mapping[str, Any] | None = None,
        start_timeout_s: float = 600.0,
    ) -> None:
        from arctic_rl.actors import DEFAULT_ENGINE_CLASSES

        self.config = config
        self.engine_classes = {**DEFAULT_ENGINE_CLASSES, **(engine_classes or {})}
        self.placement_overrides = dict(placement_overrides or {})
        self.start_timeout_s = start_timeout_s
        self.engines = Engines()
        self.calls = EngineCalls(config.engine_call_timeout_s)
        self.states = SleepStates()
        self.metrics = StepMetrics()
        self.weight_sync = WeightSync(self.calls, config.resolved_weight_sync(), config.sampling.tensor_parallel_size)
        self._closed = False

    def start(self) -> dict[str, Any]:
        """Place and start every engine; on any failure everything started so far is torn down."""
        try:
            start_engines(
                self.engines,
                self.config,
                self.calls,
                engine_classes=self.engine_classes,
                placement_overrides=self.placement_overrides,
                timeout_s=self.start_timeout_s,
            )
        except BaseException:
            self.shutdown()
            raise
        return self.describe()

    def describe(self) -> dict[str, Any]:
        """Engines, their ranks, pids and nodes (for tests and logs)."""
        return {
            "engines": {
                handle.name: {"pid": handle.pid, "node_id": self.engines.node_of(handle)}
                for handle in self.engines.all()
            },
            "vocab_size": self.engines.vocab_size,
            "step": self.engines.step_count,
            "sleeping": dict(self.states.sleeping),
            # A sampler woken tag by tag sleeps ("sleeping") until its last tag wakes: these are the ones left.
            "sampling_tags_asleep": sorted(self.states.sampler_tags_asleep),
            "weight_sync": {"method": self.weight_sync.method, "transfer_setups": self.weight_sync.setups},
        }

    def shutdown(self) -> None:
        """Stop every engine, kill its actor and remove the placement groups (idempotent)."""
        stop_engines(self.engines, self.calls.dead)
        self._closed = True

    def dead_engines(self) -> dict[str, str]:
        """Engines declared failed (their process died, or a call missed ``engine_call_timeout_s``), each with the
        reason. Such an engine stays failed: only a restart of the service brings it back."""
        return dict(self.calls.dead)

    def run(self, op: str, arguments: Mapping[str, Any]) -> Any:
        """Serve one operation of the table (:data:`arctic_rl.operations.OPERATIONS`) with its keyword arguments:
        the one entry point of the clients' transports."""
        from arctic_rl.operations import OPERATIONS

        if op not in OPERATIONS:
            raise InvalidRequestError("op", f"{op!r} is not an arctic-rl operation; use one of {sorted(OPERATIONS)}.")
        return getattr(self, op)(**arguments)

    def train_step(
        self,
        batch: Mapping[str, Any],
        processing: Mapping[str, Any] | None = None,
        *,
        old_log_probs_from_forward: bool = False,
        sync_weights: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, Any]:
        """``fwd_bwd`` + ``step`` (+ ``sync_weights`` when asked) in one call: one round trip for the client.

        Returns ``{"fwd_bwd": fwd_bwd's result, "step": step's result, "sync_weights": sync_weights's result or
        None}``; with ``sync_weights=True`` the step's metrics include the sync time (the separate calls count it in
        the next step's). Every check of the three calls runs before the first engine call, so a refused batch or
        state changes nothing.
        """
        self._require_open()
        check_flag("sync_weights", sync_weights)
        self.states.require_awake("training", "train_step()")
        if sync_weights:
            self.states.require_sampler_weights_awake("train_step(sync_weights=True)")
        trained = self.fwd_bwd(
            batch, processing, old_log_probs_from_forward=old_log_probs_from_forward, temperature=temperature
        )
        stepped = self._optimizer_step()
        synced = self.sync_weights() if sync_weights else None
        stepped["metrics"] = self._finish_step_metrics()
        return {"fwd_bwd": trained, "step": stepped, "sync_weights": synced}

    def last_step_metrics(self) -> dict[str, float]:
        """The metrics of the last finished step (times, tokens/s, dedup savings, FCA reads saved, mismatch)."""
        return self.metrics.last()
