"""RLService: the one implementation of every client operation (the table of :mod:`arctic_rl.operations`), over the
engine actors. Its parts live beside it: placement and start-up (:mod:`.lifecycle`), typed engine calls and dead
engines (:mod:`.engine_calls`), weight sync (:mod:`.weight_sync`), the sleep states (:mod:`.sleep`), the step's
metrics (:mod:`.step_metrics`) and the argument checks (:mod:`.requests`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from arctic_rl.batch import ValidatedBatch, check_batch
from arctic_rl.engines.protocols import LogProbEngineProtocol, SamplingEngineProtocol, TrainingEngineProtocol
from arctic_rl.errors import BatchValidationError, ConfigError, EngineStateError, InvalidRequestError
from arctic_rl.metrics import logprob_mismatch
from arctic_rl.request_checks import check_prompts_shape, check_sampling_params, requested_samples
from arctic_rl.service.engine_calls import EngineCalls
from arctic_rl.service.lifecycle import Engines, start_engines, stop_engines
from arctic_rl.service.requests import (
    check_checkpoint_arguments,
    check_flag,
    check_temperature,
    parse_processing,
    split_for_data_parallel,
)
from arctic_rl.service.sleep import SleepStates
from arctic_rl.service.step_metrics import StepMetrics
from arctic_rl.service.weight_sync import WeightSync

if TYPE_CHECKING:
    from arctic_rl.actors import EngineHandle
    from arctic_rl.config import ArcticRLClientConfig

__all__ = ["RLService"]


class RLService:
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

    # ------------------------------------------------------------------------------------------------ lifecycle
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

    def _require_open(self) -> None:
        if self._closed:
            raise EngineStateError("the service was shut down; create a new client.")

    # ------------------------------------------------------------------------------------------------- ops
    def run(self, op: str, arguments: Mapping[str, Any]) -> Any:
        """Serve one operation of the table (:data:`arctic_rl.operations.OPERATIONS`) with its keyword arguments:
        the one entry point of the clients' transports."""
        from arctic_rl.operations import OPERATIONS

        if op not in OPERATIONS:
            raise InvalidRequestError("op", f"{op!r} is not an arctic-rl operation; use one of {sorted(OPERATIONS)}.")
        return getattr(self, op)(**arguments)

    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], sampling_params: Mapping[str, Any]
    ) -> list[list[dict[str, Any]]]:
        self._require_open()
        check_prompts_shape(prompts)
        sampling_params = self._checked_sampling_params(len(prompts), sampling_params)
        self.states.require_awake("sampling", "generate()")
        replicas = self.engines.sampling
        # Contiguous chunks, one per replica, keep the output in prompt order when concatenated.
        bounds = [round(i * len(prompts) / len(replicas)) for i in range(len(replicas) + 1)]
        chunks = [
            (handle, prompts[bounds[i] : bounds[i + 1]])
            for i, handle in enumerate(replicas)
            if bounds[i + 1] > bounds[i]
        ]
        self.calls.require_alive([handle for handle, _ in chunks])
        with self.metrics.timer.phase("generate"):
            results = self.calls.gather(
                [
                    self.calls.start(handle, SamplingEngineProtocol.generate, chunk, dict(sampling_params))
                    for handle, chunk in chunks
                ]
            )
        outputs = [samples for chunk in results for samples in chunk]
        tokens = sum(len(sample["token_ids"]) for samples in outputs for sample in samples)
        self.metrics.add({"tokens/generated": tokens})
        return outputs

    def _checked_sampling_params(self, prompts: int, sampling_params: Mapping[str, Any]) -> Mapping[str, Any]:
        limits = self.engines.sampler_limits
        if limits is None:  # engines that report no limits (test fakes)
            if not isinstance(sampling_params, Mapping):
                raise InvalidRequestError(
                    "sampling_params",
                    f"must be a dict of vLLM SamplingParams fields, got {type(sampling_params).__name__}.",
                )
            return sampling_params
        checked = check_sampling_params(sampling_params, **limits)
        limit = self.config.sampling.max_sequences_per_request
        requested = requested_samples(prompts, checked)
        if requested > limit:
            raise InvalidRequestError(
                "sampling_params.n",
                f"{prompts} prompts x n = {requested} sequences; one generate may ask for at most {limit} "
                "(sampling.max_sequences_per_request). Split the request.",
            )
        return checked

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
        self.calls.require_alive(handles)
        with self.metrics.timer.phase("log_prob"):
            results = self.calls.gather(
                [
                    self.calls.start(
                        handle,
                        LogProbEngineProtocol.fwd_no_grad,
                        valid.select(share),
                        calculate_entropy=calculate_entropy,
                        temperature=temperature,
                    )
                    for handle, share in zip(handles, shares, strict=True)
                ]
            )
        output: dict[str, torch.Tensor] = {}
        for share, result in zip(shares, results, strict=True):
            index = torch.tensor(share, dtype=torch.long)
            for key, value in result.items():
                if key not in output:
                    output[key] = torch.zeros((valid["input_ids"].shape[0], *value.shape[1:]), dtype=value.dtype)
                output[key][index] = value
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
        require = needs.batch_keys(old_log_probs_from_forward=old_log_probs_from_forward)
        valid = self._validated(batch, require=require)
        if old_log_probs_from_forward:
            # Not used (build_grpo_batch fills them with the sampler's): the trainer's own forward provides them.
            valid = valid.without("old_log_probs")
        self.states.require_awake("training", "fwd_bwd()")
        shares = split_for_data_parallel(valid, len(self.engines.training))
        global_tokens, global_sequences = count_loss_denominators(valid["response_mask"])
        if global_tokens == 0:
            raise BatchValidationError("response_mask", "no response token is unmasked; the loss would be 0/0.")
        self.calls.require_alive(self.engines.training)
        with self.metrics.timer.phase("train"):
            results = self.calls.gather(
                [
                    self.calls.start(
                        handle,
                        TrainingEngineProtocol.fwd_bwd,
                        valid.select(share),
                        loss_name=loss_name,
                        loss_config=loss_config,
                        global_tokens=global_tokens,
                        global_sequences=global_sequences,
                        temperature=float(temperature),
                        old_log_probs_from_forward=old_log_probs_from_forward,
                    )
                    for handle, share in zip(self.engines.training, shares, strict=True)
                ]
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
            trainer_log_probs = torch.zeros(tuple(valid["responses"].shape), dtype=torch.float32)
            for share, result in zip(shares, results, strict=True):
                trainer_log_probs[torch.tensor(share, dtype=torch.long)] = result["logprobs"]
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
            self.states.require_awake("sampling", "train_step(sync_weights=True)")
        trained = self.fwd_bwd(
            batch, processing, old_log_probs_from_forward=old_log_probs_from_forward, temperature=temperature
        )
        stepped = self._optimizer_step()
        synced = self.sync_weights() if sync_weights else None
        stepped["metrics"] = self._finish_step_metrics()
        return {"fwd_bwd": trained, "step": stepped, "sync_weights": synced}

    def _finish_step_metrics(self) -> dict[str, float]:
        reads_fca = self.config.fca.enable and self.engines.sampling and not self.states.sleeping["sampling"]
        return self.metrics.finish(self._fca_stats if reads_fca else None)

    def _fca_stats(self) -> list[dict[str, float]]:
        return self.calls.call_all(self.engines.sampling, SamplingEngineProtocol.fca_stats)

    def last_step_metrics(self) -> dict[str, float]:
        """The metrics of the last finished step (times, tokens/s, dedup savings, FCA reads saved, mismatch)."""
        return self.metrics.last()

    def sync_weights(self) -> dict[str, float]:
        """Trainer -> every sampling replica, then the samplers' prefix caches are reset."""
        import time

        self._require_open()
        self.states.require_awake("training", "sync_weights()")
        self.states.require_awake("sampling", "sync_weights()")
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
        self.states.require_awake("sampling", "load_checkpoint()")
        check_checkpoint_arguments(path, step)
        loaded = self.calls.call_all(self.engines.training, TrainingEngineProtocol.load_checkpoint, path, step)
        self.engines.step_count = int(loaded[0])
        self.sync_weights()
        self.metrics.reset()
        return self.engines.step_count

    def log_probs(
        self, prompts: Sequence[str], completions: Sequence[str], *, temperature: float = 1.0
    ) -> list[list[float]]:
        """Per-token log-probs of each completion after its prompt (text pairs), from the sampling engine, at
        ``temperature``."""
        self._require_open()
        check_temperature(temperature)
        for field, texts in (("prompts", prompts), ("completions", completions)):
            if not isinstance(texts, Sequence) or isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError(field, "must be a list of strings.")
        if len(prompts) != len(completions):
            raise ConfigError(
                "log_probs takes two lists of strings of the same length (prompts[i] is scored with "
                f"completions[i]), got {type(prompts).__name__} of {len(prompts)} and "
                f"{type(completions).__name__} of {len(completions)}."
            )
        self.states.require_awake("sampling", "log_probs()")
        tokenizer = self._tokenizer()
        prompt_ids = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in prompts]
        completion_ids = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in completions]
        return list(
            self.calls.call(
                self.engines.sampling[0],
                SamplingEngineProtocol.score,
                prompt_ids,
                completion_ids,
                temperature=float(temperature),
            )
        )

    def _tokenizer(self) -> Any:
        if not hasattr(self, "_cached_tokenizer"):
            from arctic_rl.errors import import_optional

            transformers = import_optional("transformers", extra="engines", purpose="to tokenize log_probs() text")
            self._cached_tokenizer = transformers.AutoTokenizer.from_pretrained(self.config.resolved_tokenizer_name())
        return self._cached_tokenizer

    # ------------------------------------------------------------------------------------------- sleep / wake
    def sleep_inference(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ConfigError(f"sleep level must be 1 (offload weights, drop KV cache) or 2 (drop both), got {level}.")
        self._require_open()
        samplers = self.engines.sampling
        self.states.change(
            "sampling",
            len(samplers),
            "sleep",
            True,
            lambda: self.calls.call_all(samplers, SamplingEngineProtocol.sleep, level),
        )

    def wake_inference(self, tags: Sequence[str] | None = None) -> None:
        self._require_open()
        samplers = self.engines.sampling
        tags = None if tags is None else list(tags)
        self.states.change(
            "sampling",
            len(samplers),
            "wake",
            False,
            lambda: self.calls.call_all(samplers, SamplingEngineProtocol.wake, tags),
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

    def empty_training_cache(self) -> None:
        self._require_open()
        self.calls.call_all(self.engines.training, TrainingEngineProtocol.empty_cache)

    def reset_prefix_cache(self) -> None:
        self._require_open()
        self.states.require_awake("sampling", "reset_prefix_cache()")
        self.calls.call_all(self.engines.sampling, SamplingEngineProtocol.reset_prefix_cache)
