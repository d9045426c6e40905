"""The training and log-prob engines' operations: ``fwd_no_grad``, ``fwd_bwd`` and ``step``, and the parsing of
``fwd_bwd``'s loss (``processing``). A batch is checked once, split over the data-parallel ranks by whole prompt
groups, and the loss denominators are counted once over the whole batch; the step's metrics are finished when the
optimizer steps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from arctic_rl.batch import ValidatedBatch, check_batch
from arctic_rl.engines.protocols import LogProbEngineProtocol, SamplingEngineProtocol, TrainingEngineProtocol
from arctic_rl.errors import BatchValidationError, ConfigError, InvalidRequestError
from arctic_rl.metrics import logprob_mismatch
from arctic_rl.service.base import ServiceBase
from arctic_rl.service.dispatch import merge_rows, split_for_data_parallel
from arctic_rl.service.requests import check_flag, check_temperature

if TYPE_CHECKING:
    from arctic_rl.actors import EngineHandle
    from arctic_rl.losses import LossNeeds

__all__ = ["TrainingOperations", "parse_processing"]

DEFAULT_LOSS = "grpo"


def parse_processing(processing: Mapping[str, Any] | None) -> tuple[str, dict[str, Any], LossNeeds]:
    """The loss's registered name, its options and what it needs of the batch; an unknown loss or a bad option is
    refused here."""
    from arctic_rl.losses import get_loss_fn

    processing = {} if processing is None else processing
    if not isinstance(processing, Mapping):
        raise ConfigError(
            f"processing must be a dict like {{'loss_fn': 'grpo', 'config': {{...}}}}, got {type(processing).__name__}."
        )
    unknown = set(processing) - {"loss_fn", "config"}
    if unknown:
        raise ConfigError(f"processing accepts the keys 'loss_fn' and 'config', got also {sorted(unknown)}.")
    name = processing.get("loss_fn", DEFAULT_LOSS)
    if not isinstance(name, str):
        raise InvalidRequestError(
            "processing.loss_fn", f"must be the name of a registered loss (a string), got {type(name).__name__}."
        )
    raw_config = processing.get("config")
    if raw_config is not None and not isinstance(raw_config, Mapping):
        raise InvalidRequestError(
            "processing.config", f"must be a dict of the loss's options, got {type(raw_config).__name__}."
        )
    if raw_config is not None and not all(isinstance(key, str) for key in raw_config):
        raise InvalidRequestError("processing.config", "keys must be option names (strings).")
    config = dict(raw_config or {})
    return name, config, get_loss_fn(name).needs(config)


class TrainingOperations(ServiceBase):
    def _validated(self, batch: Mapping[str, Any], require: Sequence[str]) -> ValidatedBatch:
        # The request's one check of its batch; the engines take the rows they get as checked (see
        # DeepSpeedModelEngine._validate for why the check lives here).
        return check_batch(
            batch, vocab_size=self.engines.vocab_size, require=tuple(require), max_length=self.engines.max_positions
        )

    def fwd_no_grad(
        self,
        batch: Mapping[str, Any],
        reference_model: bool = False,
        calculate_entropy: bool = False,
        *,
        temperature: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        self._require_open()
        check_flag("reference_model", reference_model)
        check_flag("calculate_entropy", calculate_entropy)
        check_temperature(temperature)
        if reference_model and not self.engines.log_prob:
            raise ConfigError(
                "fwd_no_grad(reference_model=True) needs the reference (log-prob) engine; set log_prob_gpus >= 1."
            )
        handles: Sequence[EngineHandle[LogProbEngineProtocol]] = (
            self.engines.log_prob if reference_model else self.engines.training
        )
        valid = self._validated(batch, require=())
        self.states.require_awake("log_prob" if reference_model else "training", "fwd_no_grad()")
        shares = split_for_data_parallel(valid, len(handles))
        with self.metrics.timer.phase("log_prob"):
            results = self.calls.call_on_shares(
                handles,
                LogProbEngineProtocol.fwd_no_grad,
                valid,
                shares,
                calculate_entropy=calculate_entropy,
                temperature=temperature,
            )
        output = merge_rows(int(valid["input_ids"].shape[0]), shares, results)
        if not reference_model and "rollout_log_probs" in valid and "logprobs" in output:
            self.metrics.update(
                logprob_mismatch(valid["rollout_log_probs"], output["logprobs"], valid["response_mask"])
            )
        return output

    def fwd_bwd(
        self,
        batch: Mapping[str, Any],
        processing: Mapping[str, Any] | None = None,
        *,
        old_log_probs_from_forward: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, Any]:
        """Forward and backward of the step's batch with the loss named in ``processing``, on log-probs at
        ``temperature``.

        ``old_log_probs_from_forward=True``: the trainer uses its own forward's log-probs (detached) as the old ones,
        saving the ``fwd_no_grad`` call; the batch's ``old_log_probs`` are not needed, and not used if present. Exact
        when the batch gets one optimizer update on the weights that computed them, as in ``fwd_no_grad`` -> ``fwd_bwd``
        -> ``step`` (the engine refuses a model with active dropout, whose training forward differs from
        ``fwd_no_grad``'s).
        """
        from arctic_rl.losses import count_loss_denominators

        self._require_open()
        check_flag("old_log_probs_from_forward", old_log_probs_from_forward)
        check_temperature(temperature)
        loss_name, loss_config, needs = parse_processing(processing)
        valid = self._validated(batch, needs.batch_keys(old_log_probs_from_forward=old_log_probs_from_forward))
        if old_log_probs_from_forward:
            # Not used (build_grpo_batch fills them with the sampler's): the trainer's own forward provides them.
            valid = valid.without("old_log_probs")
        self.states.require_awake("training", "fwd_bwd()")
        shares = split_for_data_parallel(valid, len(self.engines.training))
        global_tokens, global_sequences = count_loss_denominators(valid["response_mask"])
        if global_tokens == 0:
            raise BatchValidationError("response_mask", "no response token is unmasked; the loss would be 0/0.")
        with self.metrics.timer.phase("train"):
            results = self.calls.call_on_shares(
                self.engines.training,
                TrainingEngineProtocol.fwd_bwd,
                valid,
                shares,
                loss_name=loss_name,
                loss_config=loss_config,
                global_tokens=global_tokens,
                global_sequences=global_sequences,
                temperature=float(temperature),
                old_log_probs_from_forward=old_log_probs_from_forward,
            )
        self._add_training_metrics(valid, shares, results, global_tokens, old_log_probs_from_forward)
        # Every rank's loss and metrics are its share of the global mean: the step's values are their sums.
        metrics: dict[str, float] = {}
        for result in results:
            for key, value in result.get("metrics", {}).items():
                metrics[key] = metrics.get(key, 0.0) + float(value)
        return {"loss": sum(float(result["loss"]) for result in results), "metrics": metrics}

    def _add_training_metrics(
        self,
        valid: Mapping[str, torch.Tensor],
        shares: Sequence[Sequence[int]],
        results: Sequence[Mapping[str, Any]],
        global_tokens: float,
        old_log_probs_from_forward: bool,
    ) -> None:
        extra: dict[str, float] = {"tokens/trained": global_tokens}
        for key in ("base_tokens", "dedup_tokens"):
            values = [float(result[key]) for result in results if key in result]
            if values:
                extra[f"zorro/{key}"] = sum(values)
        self.metrics.add(extra)
        if old_log_probs_from_forward and "rollout_log_probs" in valid:
            # The trainer's log-probs came back with the gradients: the same mismatch metrics fwd_no_grad reports.
            rows = int(valid["responses"].shape[0])
            returned = [{"logprobs": result["logprobs"]} for result in results]
            trainer_log_probs = merge_rows(rows, shares, returned)["logprobs"].to(torch.float32)
            self.metrics.update(logprob_mismatch(valid["rollout_log_probs"], trainer_log_probs, valid["response_mask"]))

    def step(self) -> dict[str, Any]:
        self._require_open()
        self.states.require_awake("training", "step()")
        result = self._optimizer_step()
        result["metrics"] = self._finish_step_metrics()
        return result

    def _optimizer_step(self) -> dict[str, Any]:
        with self.metrics.timer.phase("train"):
            results = self.calls.call_all(self.engines.training, TrainingEngineProtocol.step)
        self.engines.step_count += 1
        return {
            "grad_norm": float(results[0]["grad_norm"]),
            "lr": float(results[0]["lr"]),
            "step": self.engines.step_count,
        }

    def _finish_step_metrics(self) -> dict[str, float]:
        # FCA's counters are host totals plus a small device sum outside vLLM's sleeping memory: readable while the
        # samplers sleep, which is where a colocated step ends.
        reads_fca = self.config.fca.enable and bool(self.engines.sampling)
        return self.metrics.finish(self._fca_stats if reads_fca else None)

    def _fca_stats(self) -> list[dict[str, float]]:
        return self.calls.call_all(self.engines.sampling, SamplingEngineProtocol.fca_stats)

    def empty_training_cache(self) -> None:
        self._require_open()
        self.calls.call_all(self.engines.training, TrainingEngineProtocol.empty_cache)
