"""The operations on the weights: ``sync_weights`` (trainer -> samplers, by :class:`.weight_sync.WeightSync`),
``weight_norm``, and the training engines' checkpoints (a load syncs the samplers to the loaded weights)."""

from __future__ import annotations

import time

from arctic_rl.engines.protocols import LogProbEngineProtocol, SamplingEngineProtocol, TrainingEngineProtocol
from arctic_rl.errors import ConfigError
from arctic_rl.service.base import ServiceBase
from arctic_rl.service.requests import check_checkpoint_arguments

__all__ = ["WeightOperations"]


class WeightOperations(ServiceBase):
    def sync_weights(self) -> dict[str, float]:
        """Trainer -> every sampling replica, then the samplers' prefix caches are reset. The samplers' KV cache may
        sleep (``wake_inference(["weights"])`` before, ``wake_inference(["kv_cache"])`` after: the colocated order
        that never holds the KV cache beside the trainer's state)."""
        self._require_open()
        self.states.require_awake("training", "sync_weights()")
        self.states.require_sampler_weights_awake("sync_weights()")
        start = time.perf_counter()
        with self.metrics.timer.phase("sync"):
            self.weight_sync.sync(self.engines.training, self.engines.sampling)
        return {"time_s": time.perf_counter() - start}

    def weight_norm(self) -> dict[str, float]:
        self._require_open()
        norms: dict[str, float] = {}
        if self.engines.training:
            self.states.require_awake("training", "weight_norm()")
            norms["training_norm"] = float(
                self.calls.call_all(self.engines.training, TrainingEngineProtocol.weight_norm)[0]
            )
        if self.engines.sampling:
            self.states.require_awake("sampling", "weight_norm()")
            norms["sampling_norm"] = float(
                self.calls.call(self.engines.sampling[0], SamplingEngineProtocol.weight_norm)
            )
        if self.engines.log_prob and not self.states.sleeping["log_prob"]:
            norms["log_prob_norm"] = float(
                self.calls.call_all(self.engines.log_prob, LogProbEngineProtocol.weight_norm)[0]
            )
        return norms

    def save_checkpoint(
        self, path: str | None = None, step: int | None = None, *, keep_last: int | None = None, hf_export: bool = False
    ) -> str:
        self._require_open()
        path = path or self.config.checkpoint_path
        if not path:
            raise ConfigError("save_checkpoint needs a path: pass one or set checkpoint_path in the config.")
        self.states.require_awake("training", "save_checkpoint()")
        check_checkpoint_arguments(path, step)
        step = self.engines.step_count if step is None else step
        results = self.calls.call_all(
            self.engines.training,
            TrainingEngineProtocol.save_checkpoint,
            path,
            step,
            keep_last=keep_last,
            hf_export=hf_export,
        )
        return str(results[0])

    def load_checkpoint(self, path: str | None = None, step: int | None = None) -> int:
        """Load the training engines' checkpoint (the ``latest`` one when ``step`` is None), then sync the sampler."""
        self._require_open()
        path = path or self.config.checkpoint_path
        if not path:
            raise ConfigError("load_checkpoint needs a path: pass one or set checkpoint_path in the config.")
        self.states.require_awake("training", "load_checkpoint()")
        self.states.require_sampler_weights_awake("load_checkpoint()")
        check_checkpoint_arguments(path, step)
        loaded = self.calls.call_all(self.engines.training, TrainingEngineProtocol.load_checkpoint, path, step)
        self.engines.step_count = int(loaded[0])
        self.sync_weights()
        self.metrics.reset()
        return self.engines.step_count
