"""RLService: the one implementation of every client operation, over the engine actors.

Every operation validates its inputs (and the engines' sleep state) before it touches an engine, so a refused call
leaves weights, optimizer state and step counter as they were. A step's batch is split across the data-parallel
training ranks by arctic-dedup's group-aware balancing (a prompt group is never split: splitting it would make two
ranks recompute its prompt), the loss denominators are counted once over the whole batch, and each rank receives its
share. An engine that fails to start or fails a call surfaces as ``EngineError`` naming it.

Request values are checked before any engine sees them (``InvalidRequestError`` naming the field). Every engine call
has a time limit (``engine_call_timeout_s``): an engine that misses it, or whose process dies (recognised by Ray's
exception types, never by message text), is declared failed with ``EngineDiedError``; :meth:`RLService.dead_engines`
lists those, and later calls that need them are refused at once.

The service runs as a named Ray actor (:func:`start_service`), so another process can attach to it by name
(:func:`attach_service`); nothing else in the package holds engine state.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from arctic_rl.batch import select_rows
from arctic_rl.errors import (
    ArcticRLError,
    BatchValidationError,
    ConfigError,
    EngineDiedError,
    EngineError,
    EngineStateError,
    InvalidRequestError,
)
from arctic_rl.metrics import StepTimer, logprob_mismatch, tokens_per_second
from arctic_rl.request_checks import check_prompts_shape, check_sampling_params, requested_samples

if TYPE_CHECKING:
    from arctic_rl.actors import EngineHandle
    from arctic_rl.config import ArcticRLClientConfig
    from arctic_rl.placement import Placement

__all__ = [
    "SERVICE_NAMESPACE",
    "RLService",
    "attach_service",
    "split_for_data_parallel",
    "start_service",
]

SERVICE_NAMESPACE = "arctic_rl"
DEFAULT_SERVICE_NAME = "arctic_rl_service"
DEFAULT_LOSS = "grpo"
_RESTART_ADVICE = "Shut the client down and start it again (from a checkpoint)."


def split_for_data_parallel(batch: Mapping[str, torch.Tensor], num_ranks: int) -> list[list[int]]:
    """Each data-parallel rank's sample indices (ascending), whole prompt groups balanced by deduplicated tokens."""
    from arctic_dedup.balance import partition_for_data_parallel, prompt_groups
    from arctic_dedup.plan.layout import SampleLayout

    if num_ranks == 1:
        return [list(range(int(batch["input_ids"].shape[0])))]
    layout = SampleLayout.from_padded(
        batch["input_ids"],
        int(batch["responses"].shape[1]),
        batch["attention_mask"],
        batch.get("position_ids"),
    )
    groups = prompt_groups(layout)
    if len(groups) < num_ranks:
        raise BatchValidationError(
            "input_ids",
            f"the batch has {len(groups)} distinct prompts and training runs {num_ranks} data-parallel ranks; every "
            f"rank needs at least one whole prompt group. Send at least {num_ranks} prompts per step.",
        )
    return partition_for_data_parallel(groups, num_ranks)


def _parse_processing(processing: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
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
    # Refuse an unknown loss or a bad loss config before any engine runs.
    get_loss_fn(name).parse_config(config)
    return name, config


def _check_temperature(temperature: Any) -> None:
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)) or not (
        math.isfinite(temperature) and temperature > 0
    ):
        raise InvalidRequestError("temperature", f"must be a finite number > 0, got {temperature!r}.")


def _check_checkpoint_arguments(path: Any, step: Any) -> None:
    if not isinstance(path, str) or not path or "\x00" in path:
        raise InvalidRequestError("path", f"must be a directory path (a non-empty string), got {path!r}.")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise InvalidRequestError("step", f"must be an integer >= 0 (a step number) or None, got {step!r}.")


class RLService:
    """Places the engines, starts them, and implements every client operation. Use through :func:`start_service`.

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
        self.placement: Placement | None = None
        self.training: list[EngineHandle] = []
        self.log_prob: list[EngineHandle] = []
        self.sampling: list[EngineHandle] = []
        self.vocab_size: int | None = None
        self.max_positions: int | None = None
        self.sampler_limits: dict[str, int] | None = None
        self.call_timeout_s = config.engine_call_timeout_s
        # Engines declared failed (process gone, or a call past its time limit): name -> reason.
        self._dead: dict[str, str] = {}
        self.step_count = 0
        self.sleeping = {"training": False, "log_prob": False, "sampling": False}
        self._timer = StepTimer()
        self._step_metrics: dict[str, float] = {}
        self._last_step_metrics: dict[str, float] = {}
        self._closed = False
        # Cross-process weight sync (nccl, cuda_ipc, gloo): the transfer group is set up at the first sync and
        # serves every later one; the engines leave it when they stop.
        self._transfer_ready = False
        self._transfer_setups = 0

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> dict[str, Any]:
        """Place and start every engine; on any failure everything started so far is torn down."""
        from arctic_rl.actors import launch_engine_actor
        from arctic_rl.placement import PlacementRequest, place

        try:
            request = PlacementRequest.from_config(self.config, **self.placement_overrides)
            self.placement = place(request, timeout_s=min(self.start_timeout_s, 300.0))
            plan = self.placement.plan
            for slot in plan.workers:
                handle = launch_engine_actor(self.placement, slot, self.config)
                {"training": self.training, "log_prob": self.log_prob, "sampling": self.sampling}[slot.role].append(
                    handle
                )
            pending: list[tuple[EngineHandle, Any]] = []
            for role, handles in (("training", self.training), ("log_prob", self.log_prob)):
                if not handles:
                    continue
                master_addr, master_port = self._get(
                    handles[0],
                    [handles[0].actor.node_ip.remote(), handles[0].actor.free_port.remote()],
                    timeout=self.start_timeout_s,
                )
                for handle in handles:
                    kwargs = {
                        "rank": handle.rank,
                        "world_size": len(handles),
                        "master_addr": master_addr,
                        "master_port": master_port,
                        "role": role,
                    }
                    pending.append((handle, handle.actor.start.remote(self.engine_classes[role], self.config, kwargs)))
            for handle in self.sampling:
                kwargs = {"replica": handle.rank}
                pending.append(
                    (handle, handle.actor.start.remote(self.engine_classes["sampling"], self.config, kwargs))
                )
            for handle, reference in pending:
                info = self._get(handle, reference, timeout=self.start_timeout_s)
                handle.pid = info["pid"]
                if handle.role == "training" and handle.rank == 0:
                    self.vocab_size = info["vocab_size"]
                    self.max_positions = info.get("max_positions")
                if handle.role == "sampling" and handle.rank == 0 and info.get("max_model_len"):
                    self.sampler_limits = {"vocab_size": info["vocab_size"], "max_model_len": info["max_model_len"]}
            if self.training:
                rank0 = self.training[0]
                self.step_count = int(
                    self._get(rank0, rank0.actor.get.remote("step_count"), timeout=self.start_timeout_s)
                )
        except BaseException:
            self.shutdown()
            raise
        return self.describe()

    def describe(self) -> dict[str, Any]:
        """Engines, their ranks, pids and nodes (for tests and logs)."""
        return {
            "engines": {
                handle.name: {"pid": handle.pid, "node_id": self._slot_node(handle)} for handle in self._all_handles()
            },
            "vocab_size": self.vocab_size,
            "step": self.step_count,
            "sleeping": dict(self.sleeping),
            "weight_sync": {"method": self.config.resolved_weight_sync(), "transfer_setups": self._transfer_setups},
        }

    def _slot_node(self, handle: EngineHandle) -> str | None:
        if self.placement is None:
            return None
        for slot in self.placement.plan.workers:
            if slot.role == handle.role and slot.rank == handle.rank:
                return slot.node_id
        return None

    def _all_handles(self) -> list[EngineHandle]:
        return [*self.training, *self.log_prob, *self.sampling]

    def shutdown(self) -> None:
        """Stop every engine, kill its actor and remove the placement groups (idempotent)."""
        import ray

        handles, self.training, self.log_prob, self.sampling = self._all_handles(), [], [], []
        stops = []
        for handle in handles:
            if handle.name in self._dead:  # a stuck engine would not answer: it is only killed
                continue
            try:
                stops.append(handle.actor.stop.remote())
            except Exception:  # an actor that is already gone has nothing to stop
                continue
        if stops:
            # A stuck engine (one declared failed) does not answer: it is killed below either way.
            ray.wait(stops, num_returns=len(stops), timeout=30)
        for handle in handles:
            try:
                ray.kill(handle.actor, no_restart=True)
            except Exception:  # already dead
                continue
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        self._closed = True

    # -------------------------------------------------------------------------------------------- engine calls
    def dead_engines(self) -> dict[str, str]:
        """Engines declared failed (their process died, or a call missed ``engine_call_timeout_s``), each with the
        reason. Such an engine stays failed: only a restart of the service brings it back."""
        return dict(self._dead)

    def _declare_dead(self, handle: EngineHandle, reason: str) -> EngineDiedError:
        self._dead.setdefault(handle.name, reason)
        return EngineDiedError(handle.name, f"{reason}; the run cannot continue. {_RESTART_ADVICE}")

    def _require_alive(self, handles: Sequence[EngineHandle]) -> None:
        for handle in handles:
            if handle.name in self._dead:
                raise EngineDiedError(
                    handle.name, f"was declared failed earlier ({self._dead[handle.name]}). {_RESTART_ADVICE}"
                )

    def _get(self, handle: EngineHandle, reference: Any, timeout: float | None = None) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        limit = self.call_timeout_s if timeout is None else timeout
        try:
            return ray.get(reference, timeout=limit)
        except RayTaskError as error:
            cause = error.cause
            if isinstance(cause, EngineDiedError):
                # An engine this one drives (a sampler during a weight transfer) died.
                self._dead.setdefault(cause.engine, cause.message)
            if isinstance(cause, ArcticRLError):
                raise cause from None
            raise EngineError(handle.name, f"failed: {error}") from None
        except RayActorError as error:
            # ActorDiedError and ActorUnavailableError (engines never restart) both derive from RayActorError.
            raise self._declare_dead(handle, f"its actor process died ({type(error).__name__})") from None
        except GetTimeoutError:
            budget = self.call_timeout_s if timeout is None or timeout < self.call_timeout_s else timeout
            raise self._declare_dead(
                handle, f"a call did not finish within its time limit ({budget:g} s, engine_call_timeout_s)"
            ) from None

    def _attribute(self, handle: EngineHandle, name: str) -> Any:
        self._require_alive([handle])
        return self._get(handle, handle.actor.get.remote(name))

    def _call(self, handle: EngineHandle, method: str, *args: Any, **kwargs: Any) -> Any:
        self._require_alive([handle])
        return self._get(handle, handle.actor.call.remote(method, *args, **kwargs))

    def _call_all(self, handles: Sequence[EngineHandle], method: str, *args: Any, **kwargs: Any) -> list[Any]:
        self._require_alive(handles)
        # Launch on every rank before waiting on any: collective operations need all ranks inside them.
        references = [(handle, handle.actor.call.remote(method, *args, **kwargs)) for handle in handles]
        return self._gather(references)

    def _call_each(self, calls: Sequence[tuple[EngineHandle, str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        self._require_alive([handle for handle, _, _, _ in calls])
        references = [
            (handle, handle.actor.call.remote(method, *args, **kwargs)) for handle, method, args, kwargs in calls
        ]
        return self._gather(references)

    def _gather(self, references: Sequence[tuple[EngineHandle, Any]]) -> list[Any]:
        """Results of calls on several engines, all within the call time limit. When one engine dies, its peers in
        a collective fail too (their connection resets): wait for every call and report the dead engine rather
        than the first peer to fail."""
        import ray

        deadline = time.monotonic() + self.call_timeout_s
        ray.wait([reference for _, reference in references], num_returns=len(references), timeout=self.call_timeout_s)
        results: list[Any] = []
        errors: list[ArcticRLError] = []
        for handle, reference in references:
            try:
                results.append(self._get(handle, reference, timeout=max(0.0, deadline - time.monotonic())))
            except ArcticRLError as error:
                errors.append(error)
        if errors:
            dead = [error for error in errors if isinstance(error, EngineDiedError)]
            raise (dead or errors)[0]
        return results

    def _require_awake(self, role: str, operation: str) -> None:
        if self.sleeping[role]:
            wake = {"training": "wake_training()", "log_prob": "wake_log_prob()", "sampling": "wake_inference()"}[role]
            raise EngineStateError(f"{operation} needs the {role} engine awake; call {wake} first.", engine=role)

    def _require_open(self) -> None:
        if self._closed:
            raise EngineStateError("the service was shut down; create a new client.")

    def _add_metrics(self, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self._step_metrics[key] = self._step_metrics.get(key, 0.0) + float(value)

    # ------------------------------------------------------------------------------------------------- ops
    def run(self, op: str, arguments: Mapping[str, Any]) -> Any:
        """Serve one operation of the table (:data:`arctic_rl.operations.OPERATIONS`) with its keyword arguments:
        the one entry point of the clients' transports."""
        from arctic_rl.operations import OPERATIONS

        if op not in OPERATIONS:
            raise InvalidRequestError("op", f"{op!r} is not an arctic-rl operation; use one of {sorted(OPERATIONS)}.")
        return getattr(self, op)(**arguments)

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], sampling_params: Mapping[str, Any]) -> Any:
        self._require_open()
        check_prompts_shape(prompts)
        if self.sampler_limits is None:  # engines that report no limits (test fakes)
            if not isinstance(sampling_params, Mapping):
                raise InvalidRequestError(
                    "sampling_params",
                    f"must be a dict of vLLM SamplingParams fields, got {type(sampling_params).__name__}.",
                )
        else:
            sampling_params = check_sampling_params(sampling_params, **self.sampler_limits)
            limit = self.config.sampling.max_sequences_per_request
            requested = requested_samples(len(prompts), sampling_params)
            if requested > limit:
                raise InvalidRequestError(
                    "sampling_params.n",
                    f"{len(prompts)} prompts x n = {requested} sequences; one generate may ask for at most {limit} "
                    "(sampling.max_sequences_per_request). Split the request.",
                )
        self._require_awake("sampling", "generate()")
        replicas = len(self.sampling)
        # Contiguous chunks, one per replica, keep the output in prompt order when concatenated.
        bounds = [round(i * len(prompts) / replicas) for i in range(replicas + 1)]
        calls: list[tuple[EngineHandle, str, tuple[Any, ...], dict[str, Any]]] = [
            (handle, "generate", (list(prompts[bounds[i] : bounds[i + 1]]), dict(sampling_params)), {})
            for i, handle in enumerate(self.sampling)
            if bounds[i + 1] > bounds[i]
        ]
        with self._timer.phase("generate"):
            results = self._call_each(calls)
        outputs = [samples for chunk in results for samples in chunk]
        tokens = sum(len(sample["token_ids"]) for samples in outputs for sample in samples)
        self._add_metrics({"tokens/generated": tokens})
        return outputs

    def _validated(self, batch: Mapping[str, Any], require: Sequence[str]) -> dict[str, torch.Tensor]:
        from arctic_rl.batch import validate_batch

        return validate_batch(batch, vocab_size=self.vocab_size, require=tuple(require), max_length=self.max_positions)

    def fwd_no_grad(
        self,
        batch: Mapping[str, Any],
        reference_model: bool = False,
        calculate_entropy: bool = False,
        *,
        temperature: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        self._require_open()
        for name, flag in (("reference_model", reference_model), ("calculate_entropy", calculate_entropy)):
            if not isinstance(flag, bool):
                raise InvalidRequestError(name, f"must be true or false, got {flag!r}.")
        _check_temperature(temperature)
        if reference_model and not self.log_prob:
            raise ConfigError(
                "fwd_no_grad(reference_model=True) needs the reference (log-prob) engine; set log_prob_gpus >= 1."
            )
        role = "log_prob" if reference_model else "training"
        handles = self.log_prob if reference_model else self.training
        valid = self._validated(batch, require=())
        self._require_awake(role, "fwd_no_grad()")
        shares = split_for_data_parallel(valid, len(handles))
        with self._timer.phase("log_prob"):
            results = self._call_each(
                [
                    (
                        handle,
                        "fwd_no_grad",
                        (select_rows(valid, share),),
                        {"calculate_entropy": calculate_entropy, "temperature": temperature},
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
            self._step_metrics.update(
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
        if not isinstance(old_log_probs_from_forward, bool):
            raise InvalidRequestError(
                "old_log_probs_from_forward", f"must be true or false, got {old_log_probs_from_forward!r}."
            )
        _check_temperature(temperature)
        loss_name, loss_config = _parse_processing(processing)
        require = ("advantages",) if old_log_probs_from_forward else ("old_log_probs", "advantages")
        valid = self._validated(batch, require=require)
        if old_log_probs_from_forward:
            # Not used (build_grpo_batch fills them with the sampler's): the trainer's own forward provides them.
            valid.pop("old_log_probs", None)
        self._require_awake("training", "fwd_bwd()")
        shares = split_for_data_parallel(valid, len(self.training))
        global_tokens, global_sequences = count_loss_denominators(valid["response_mask"])
        if global_tokens == 0:
            raise BatchValidationError("response_mask", "no response token is unmasked; the loss would be 0/0.")
        kwargs: dict[str, Any] = {
            "loss_name": loss_name,
            "loss_config": loss_config,
            "global_tokens": global_tokens,
            "global_sequences": global_sequences,
        }
        if old_log_probs_from_forward:
            kwargs["old_log_probs_from_forward"] = True
        if temperature != 1.0:
            kwargs["temperature"] = float(temperature)
        with self._timer.phase("train"):
            results = self._call_each(
                [
                    (handle, "fwd_bwd", (select_rows(valid, share),), kwargs)
                    for handle, share in zip(self.training, shares, strict=True)
                ]
            )
        # Every rank's loss and metrics are its share of the global mean: the step's values are their sums.
        loss = sum(float(result["loss"]) for result in results)
        metrics: dict[str, float] = {}
        for result in results:
            for key, value in result.get("metrics", {}).items():
                metrics[key] = metrics.get(key, 0.0) + float(value)
        extra: dict[str, float] = {"tokens/trained": global_tokens}
        for key in ("base_tokens", "dedup_tokens"):
            values = [float(result[key]) for result in results if key in result]
            if values:
                extra[f"zorro/{key}"] = sum(values)
        self._add_metrics(extra)
        if old_log_probs_from_forward and "rollout_log_probs" in valid:
            # The trainer's log-probs came back with the gradients: the same mismatch metrics fwd_no_grad reports.
            trainer_log_probs = torch.zeros(tuple(valid["responses"].shape), dtype=torch.float32)
            for share, result in zip(shares, results, strict=True):
                trainer_log_probs[torch.tensor(share, dtype=torch.long)] = result["logprobs"]
            self._step_metrics.update(
                logprob_mismatch(valid["rollout_log_probs"], trainer_log_probs, valid["response_mask"])
            )
        return {"loss": loss, "metrics": metrics}

    def step(self) -> dict[str, Any]:
        self._require_open()
        self._require_awake("training", "step()")
        result = self._optimizer_step()
        result["metrics"] = self._finish_step_metrics()
        return result

    def _optimizer_step(self) -> dict[str, Any]:
        with self._timer.phase("train"):
            results = self._call_all(self.training, "step")
        self.step_count += 1
        return {"grad_norm": float(results[0]["grad_norm"]), "lr": float(results[0]["lr"]), "step": self.step_count}

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
        if not isinstance(sync_weights, bool):
            raise InvalidRequestError("sync_weights", f"must be true or false, got {sync_weights!r}.")
        self._require_awake("training", "train_step()")
        if sync_weights:
            self._require_awake("sampling", "train_step(sync_weights=True)")
        trained = self.fwd_bwd(
            batch, processing, old_log_probs_from_forward=old_log_probs_from_forward, temperature=temperature
        )
        stepped = self._optimizer_step()
        synced = self.sync_weights() if sync_weights else None
        stepped["metrics"] = self._finish_step_metrics()
        return {"fwd_bwd": trained, "step": stepped, "sync_weights": synced}

    def _finish_step_metrics(self) -> dict[str, float]:
        metrics = {**self._step_metrics, **self._timer.metrics()}
        metrics["throughput/generate_tokens_per_s"] = tokens_per_second(
            metrics.get("tokens/generated", 0.0), self._timer.seconds("generate")
        )
        metrics["throughput/train_tokens_per_s"] = tokens_per_second(
            metrics.get("tokens/trained", 0.0), self._timer.seconds("train")
        )
        base, dedup = metrics.get("zorro/base_tokens"), metrics.get("zorro/dedup_tokens")
        if base:
            metrics["zorro/savings"] = 1.0 - (dedup or 0.0) / base
        if self.config.fca.enable and self.sampling and not self.sleeping["sampling"]:
            stats = self._call_all(self.sampling, "fca_stats")
            for key in stats[0]:
                metrics[f"fca/{key}"] = sum(float(s.get(key, 0.0)) for s in stats)
        self._last_step_metrics = metrics
        self._step_metrics = {}
        self._timer.reset()
        return metrics

    def last_step_metrics(self) -> dict[str, float]:
        """The metrics of the last finished step (times, tokens/s, dedup savings, FCA reads saved, mismatch)."""
        return dict(self._last_step_metrics)

    def sync_weights(self) -> dict[str, float]:
        """Trainer -> every sampling replica, then the samplers' prefix caches are reset."""
        import ray

        self._require_open()
        self._require_awake("training", "sync_weights()")
        self._require_awake("sampling", "sync_weights()")
        method = self.config.resolved_weight_sync()
        start = time.perf_counter()
        with self._timer.phase("sync"):
            if method == "object_store":
                # Every training rank gathers (collective under ZeRO-3); rank 0's full tensors go to the object store
                # once and each replica reads them from there.
                gathered = self._call_all(self.training, "iter_full_parameters")
                reference = ray.put(gathered[0])
                del gathered
                self._call_each([(handle, "update_weights", (reference,), {}) for handle in self.sampling])
            else:
                if not self._transfer_ready:
                    self._set_up_transfer(method)
                # Every rank iterates its parameters (ZeRO-3 gathers are collective); rank 0 drives the samplers'
                # start / update / finish through the fan-out it was given, and finishing resets their prefix caches.
                self._call_all(self.training, "send_weights")
        return {"time_s": time.perf_counter() - start}

    def _set_up_transfer(self, method: str) -> None:
        """Form the trainer -> samplers transfer group once: every training rank builds vLLM's trainer-side engine,
        and rank 0 makes the samplers join while it opens its end (the rendezvous blocks both sides until the group
        forms). On failure both sides are closed, so the next sync starts the setup afresh."""
        from arctic_rl.actors import SamplerFanout

        fanout = SamplerFanout([(handle.name, handle.actor) for handle in self.sampling])
        kwargs: dict[str, Any] = {}
        if method in ("nccl", "gloo"):
            # Trainer rank 0 hosts the rendezvous on its own node.
            rank0 = self.training[0]
            address, port = self._get(rank0, [rank0.actor.node_ip.remote(), rank0.actor.free_port.remote()])
            kwargs = {
                "master_address": address,
                "master_port": port,
                "sampler_world_size": len(self.sampling) * self.config.sampling.tensor_parallel_size,
            }
        try:
            self._call_all(self.training, "transfer_setup", method, fanout, **kwargs)
        except BaseException:
            self._close_transfer()
            raise
        self._transfer_ready = True
        self._transfer_setups += 1

    def _close_transfer(self) -> None:
        """Best effort: every training and sampling engine leaves the transfer group (one that is gone has nothing
        to close)."""
        import ray

        closes = [handle.actor.call.remote("transfer_shutdown") for handle in [*self.training, *self.sampling]]
        if closes:
            ray.wait(closes, num_returns=len(closes), timeout=30)
        self._transfer_ready = False

    def weight_norm(self) -> dict[str, float]:
        self._require_open()
        norms: dict[str, float] = {}
        if self.training:
            self._require_awake("training", "weight_norm()")
            norms["training_norm"] = float(self._call_all(self.training, "weight_norm")[0])
        if self.sampling:
            self._require_awake("sampling", "weight_norm()")
            norms["sampling_norm"] = float(self._call(self.sampling[0], "weight_norm"))
        if self.log_prob and not self.sleeping["log_prob"]:
            norms["log_prob_norm"] = float(self._call_all(self.log_prob, "weight_norm")[0])
        return norms

    def save_checkpoint(
        self, path: str | None = None, step: int | None = None, *, keep_last: int | None = None, hf_export: bool = False
    ) -> str:
        self._require_open()
        path = path or self.config.checkpoint_path
        if not path:
            raise ConfigError("save_checkpoint needs a path: pass one or set checkpoint_path in the config.")
        self._require_awake("training", "save_checkpoint()")
        _check_checkpoint_arguments(path, step)
        step = self.step_count if step is None else step
        results = self._call_all(self.training, "save_checkpoint", path, step, keep_last=keep_last, hf_export=hf_export)
        return str(results[0])

    def load_checkpoint(self, path: str | None = None, step: int | None = None) -> int:
        """Load the training engines' checkpoint (the ``latest`` one when ``step`` is None), then sync the sampler."""
        self._require_open()
        path = path or self.config.checkpoint_path
        if not path:
            raise ConfigError("load_checkpoint needs a path: pass one or set checkpoint_path in the config.")
        self._require_awake("training", "load_checkpoint()")
        self._require_awake("sampling", "load_checkpoint()")
        _check_checkpoint_arguments(path, step)
        loaded = self._call_all(self.training, "load_checkpoint", path, step)
        self.step_count = int(loaded[0])
        self.sync_weights()
        self._step_metrics = {}
        self._timer.reset()
        return self.step_count

    def log_probs(
        self, prompts: Sequence[str], completions: Sequence[str], *, temperature: float = 1.0
    ) -> list[list[float]]:
        """Per-token log-probs of each completion after its prompt (text pairs), from the sampling engine, at
        ``temperature``."""
        self._require_open()
        _check_temperature(temperature)
        for field, texts in (("prompts", prompts), ("completions", completions)):
            if not isinstance(texts, Sequence) or isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError(field, "must be a list of strings.")
        if isinstance(prompts, str) or isinstance(completions, str) or len(prompts) != len(completions):
            raise ConfigError(
                "log_probs takes two lists of strings of the same length (prompts[i] is scored with "
                f"completions[i]), got {type(prompts).__name__} of {len(prompts)} and "
                f"{type(completions).__name__} of {len(completions)}."
            )
        self._require_awake("sampling", "log_probs()")
        tokenizer = self._tokenizer()
        prompt_ids = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in prompts]
        completion_ids = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in completions]
        return list(self._call(self.sampling[0], "score", prompt_ids, completion_ids, temperature=float(temperature)))

    def _tokenizer(self) -> Any:
        if not hasattr(self, "_cached_tokenizer"):
            from arctic_rl.errors import import_optional

            transformers = import_optional("transformers", extra="engines", purpose="to tokenize log_probs() text")
            self._cached_tokenizer = transformers.AutoTokenizer.from_pretrained(self.config.resolved_tokenizer_name())
        return self._cached_tokenizer

    # ------------------------------------------------------------------------------------------- sleep / wake
    def _set_sleep(self, role: str, handles: Sequence[EngineHandle], method: str, asleep: bool, *args: Any) -> None:
        self._require_open()
        if not handles:
            raise ConfigError(f"there is no {role} engine to {method} (its GPU count is 0).")
        if self.sleeping[role] == asleep:
            state = "asleep" if asleep else "awake"
            raise EngineStateError(f"the {role} engine is already {state}; {method}() changes nothing.", engine=role)
        self._call_all(handles, method, *args)
        self.sleeping[role] = asleep

    def sleep_inference(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ConfigError(f"sleep level must be 1 (offload weights, drop KV cache) or 2 (drop both), got {level}.")
        self._set_sleep("sampling", self.sampling, "sleep", True, level)

    def wake_inference(self, tags: Sequence[str] | None = None) -> None:
        self._set_sleep("sampling", self.sampling, "wake", False, None if tags is None else list(tags))

    def sleep_training(self, mode: str = "all") -> None:
        self._set_sleep("training", self.training, "sleep", True, mode)

    def wake_training(self) -> None:
        self._set_sleep("training", self.training, "wake", False)

    def sleep_log_prob(self) -> None:
        self._set_sleep("log_prob", self.log_prob, "sleep", True)

    def wake_log_prob(self) -> None:
        self._set_sleep("log_prob", self.log_prob, "wake", False)

    def empty_training_cache(self) -> None:
        self._require_open()
        self._call_all(self.training, "empty_cache")

    def reset_prefix_cache(self) -> None:
        self._require_open()
        self._require_awake("sampling", "reset_prefix_cache()")
        self._call_all(self.sampling, "reset_prefix_cache")


def start_service(
    config: ArcticRLClientConfig,
    *,
    name: str = DEFAULT_SERVICE_NAME,
    engine_classes: Mapping[str, str] | None = None,
    placement_overrides: Mapping[str, Any] | None = None,
    start_timeout_s: float = 600.0,
) -> Any:
    """Create the named service actor, start every engine through it, and return its handle.

    A failure while starting kills the service actor too and raises the error (``EngineError`` naming the engine).
    """
    import ray

    from arctic_rl.actors import engines_runtime_env

    actor_class = ray.remote(RLService)
    handle = actor_class.options(
        name=name,
        namespace=SERVICE_NAMESPACE,
        num_cpus=0,
        max_restarts=0,
        max_concurrency=1,
        runtime_env=engines_runtime_env(),
    ).remote(
        config, engine_classes=engine_classes, placement_overrides=placement_overrides, start_timeout_s=start_timeout_s
    )
    from arctic_rl.progress import report, wait_with_heartbeat

    counts = {"training": config.training_gpus, "log_prob": config.log_prob_gpus, "sampling": config.sampling_gpus}
    units = "GPU" if config.resolved_device() == "cuda" else "CPU worker"
    report(
        "starting the engines ("
        + ", ".join(f"{role} x{count} {units}{'s' if count > 1 else ''}" for role, count in counts.items() if count)
        + "): each loads the model, DeepSpeed and vLLM set up (a minute or more on a small CPU)"
    )
    try:
        started = handle.start.remote()
        seconds = wait_with_heartbeat(
            lambda timeout_s: bool(ray.wait([started], timeout=timeout_s)[0]), "starting the engines"
        )
        ray.get(started)
        report(f"engines ready ({seconds:.0f} s)")
    except BaseException as error:
        ray.kill(handle, no_restart=True)
        from ray.exceptions import RayTaskError

        if isinstance(error, RayTaskError) and isinstance(error.cause, ArcticRLError):
            raise error.cause from None
        raise
    return handle


def attach_service(name: str = DEFAULT_SERVICE_NAME) -> Any:
    """The handle of a running service started by another process on the same Ray cluster."""
    import ray

    try:
        return ray.get_actor(name, namespace=SERVICE_NAMESPACE)
    except ValueError:
        raise EngineStateError(
            f"no arctic-rl service named {name!r} runs in Ray namespace {SERVICE_NAMESPACE!r}; start one with "
            "create_arctic_rl_client(config) first, on the same ray_address."
        ) from None
