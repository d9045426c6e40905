"""The sleep and wake operations of each engine role, through the state machine of :mod:`.sleep` (a role's engines
change state together; a change that changes nothing, or of a role without engines, is refused)."""

from __future__ import annotations

from collections.abc import Sequence

from arctic_rl.engines.protocols import LogProbEngineProtocol, SamplingEngineProtocol, TrainingEngineProtocol
from arctic_rl.errors import ConfigError
from arctic_rl.service.base import ServiceBase

__all__ = ["SleepOperations"]


class SleepOperations(ServiceBase):
    def sleep_inference(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ConfigError(f"sleep level must be 1 (offload weights, drop KV cache) or 2 (drop both), got {level}.")
        self._require_open()
        samplers = self.engines.sampling
        self.states.sleep_sampling(
            len(samplers), lambda: self.calls.call_all(samplers, SamplingEngineProtocol.sleep, level)
        )

    def wake_inference(self, tags: Sequence[str] | None = None) -> None:
        self._require_open()
        samplers = self.engines.sampling
        tags = None if tags is None else list(tags)
        self.states.wake_sampling(
            len(samplers), tags, lambda: self.calls.call_all(samplers, SamplingEngineProtocol.wake, tags)
        )

    def sleep_training(self, mode: str = "all") -> None:
        self._require_open()
        trainers = self.engines.training
        self.states.change(
            "training",
            len(trainers),
            "sleep",
            True,
            lambda: self.calls.call_all(trainers, TrainingEngineProtocol.sleep, mode),
        )

    def wake_training(self) -> None:
        self._require_open()
        trainers = self.engines.training
        self.states.change(
            "training", len(trainers), "wake", False, lambda: self.calls.call_all(trainers, TrainingEngineProtocol.wake)
        )

    def sleep_log_prob(self) -> None:
        self._require_open()
        engines = self.engines.log_prob
        self.states.change(
            "log_prob", len(engines), "sleep", True, lambda: self.calls.call_all(engines, LogProbEngineProtocol.sleep)
        )

    def wake_log_prob(self) -> None:
        self._require_open()
        engines = self.engines.log_prob
        self.states.change(
            "log_prob", len(engines), "wake", False, lambda: self.calls.call_all(engines, LogProbEngineProtocol.wake)
        )
