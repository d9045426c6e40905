"""``TrainingEngine``: the policy on DeepSpeed (ZeRO 0-3), trained with a named loss from the registry.

Gradient accumulation is owned by the engine: ``fwd_bwd`` may be called any number of times (each call cuts its
batch into micro-batches) and ``step()`` is the accumulation boundary. DeepSpeed runs with
``managed_gradient_accumulation: false`` for that (its caller-owned boundary: ``backward`` accumulates, ``step``
reduces and updates), because a boundary set before the last micro-batch of a ``fwd_bwd`` call cannot know whether
another call follows before ``step()``. Each micro-batch's loss is already its share of the step's global loss (the
losses divide by the whole step's token and sequence counts), so backward runs it unscaled by gradient accumulation
and multiplied by the data-parallel world size, which DeepSpeed's gradient averaging divides out again: the step's
gradient is the gradient of the global loss, whatever the micro-batching and the split over ranks.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from arctic_rl.engines.checkpoint_files import VerifiedFiles, verify_checkpoint, write_manifest
from arctic_rl.engines.deepspeed_base import DeepSpeedModelEngine
from arctic_rl.engines.model import load_tokenizer
from arctic_rl.engines.policy_forward import forward_responses, select_samples
from arctic_rl.engines.zero_step import install_multi_tensor_checks
from arctic_rl.errors import ConfigError, EngineError, EngineStateError, InvalidRequestError, import_optional

if TYPE_CHECKING:
    from arctic_rl.config import ArcticRLClientConfig
    from arctic_rl.engines.weight_sync import CrossProcessMethod, SamplerCall

__all__ = ["CHECKPOINT_TAG_PREFIX", "SLEEP_MODES", "TrainingEngine"]

# sleep(mode): "optimizer" moves the fp32 master weights, optimizer moments and gradient buffers; "weights" the
# model's own (low-precision) parameters; "all" both; "moments" only the optimizer's moments (AdamW's two running
# averages, 8 bytes a parameter in fp32: the largest single part of the state), for a colocated sampler that needs
# less room than the whole state frees, at a fraction of the host copies.
SLEEP_MODES: tuple[str, ...] = ("all", "optimizer", "weights", "moments")
CHECKPOINT_TAG_PREFIX = "global_step"
_TAG_PATTERN = re.compile(rf"^{CHECKPOINT_TAG_PREFIX}(\d+)$")


def _checkpoint_tag(step: int) -> str:
    return f"{CHECKPOINT_TAG_PREFIX}{step}"


def _saved_steps(path: str) -> list[int]:
    if not os.path.isdir(path):
        return []
    steps = []
    for entry in os.listdir(path):
        match = _TAG_PATTERN.match(entry)
        if match and os.path.isdir(os.path.join(path, entry)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_step(step: Any, field: str) -> None:
    if not _is_int(step) or step < 0:
        raise InvalidRequestError(field, f"must be an integer >= 0 (a step number), got {step!r}.")


def _prepare_save_directory(path: Any) -> None:
    """``path`` is (or becomes) a writable directory; refused with the reason otherwise, before DeepSpeed writes."""
    if not isinstance(path, str) or not path:
        raise InvalidRequestError("path", f"must be a directory path (a non-empty string), got {path!r}.")
    if os.path.exists(path) and not os.path.isdir(path):
        raise InvalidRequestError("path", f"{path} exists and is not a directory; checkpoints are directories.")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise InvalidRequestError("path", f"cannot create checkpoint directory {path}: {error.strerror}.") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InvalidRequestError("path", f"checkpoint directory {path} is not writable by the server.")


def _write_latest(path: str, tag: str) -> None:
    temporary = os.path.join(path, ".latest.tmp")
    with open(temporary, "w") as handle:
        handle.write(tag)
    os.replace(temporary, os.path.join(path, "latest"))


def _checkpoint_directory(path: Any, step: Any) -> str:
    """The checkpoint directory to load: ``path/global_step{step}``, or the tag ``path/latest`` names, which must
    be such a name (no other path, so a ``latest`` of ``.`` or ``../other/global_step0`` is refused), resolved
    inside ``path``."""
    if not isinstance(path, str) or not path:
        raise InvalidRequestError("path", f"must be a directory path (a non-empty string), got {path!r}.")
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise InvalidRequestError("path", f"{path} {what}; pass the directory given to save_checkpoint().")
    if step is None:
        latest = os.path.join(path, "latest")
        if not os.path.isfile(latest):
            raise InvalidRequestError(
                "path",
                f"no checkpoint to resume: {latest} does not exist; pass the directory given to save_checkpoint() "
                f"(saved steps there: {_saved_steps(path)}).",
            )
        with open(latest, "rb") as handle:
            raw = handle.read(256)
        tag = raw.decode("ascii", errors="replace").strip()
        if not _TAG_PATTERN.match(tag):
            raise InvalidRequestError(
                "path",
                f"{latest} names {tag[:80]!r}, not a checkpoint of this directory ({CHECKPOINT_TAG_PREFIX}<step>); "
                "pass step= explicitly.",
            )
    else:
        _require_step(step, "step")
        tag = _checkpoint_tag(step)
    root = os.path.realpath(path)
    directory = os.path.realpath(os.path.join(path, tag))
    if os.path.dirname(directory) != root or not os.path.isdir(directory):
        raise InvalidRequestError(
            "step", f"no checkpoint {tag!r} under {path}; saved steps there: {_saved_steps(path)}."
        )
    return directory


class TrainingEngine(DeepSpeedModelEngine):
    """The policy under DeepSpeed: ``fwd_no_grad``, ``fwd_bwd``, ``step``, checkpoints, weights, sleep/wake.

    ``rank`` / ``world_size`` make it one data-parallel rank (every rank builds its own engine; ``master_addr`` and
    ``master_port`` are the rendezvous, a free port for a single rank). Operations that are collective under
    ZeRO (``fwd_bwd`` under ZeRO-3, ``step``, ``weight_norm`` under ZeRO-3, ``iter_full_parameters`` under
    ZeRO-3, checkpoints) must be called on every rank.
    """

    def __init__(
        self,
        config: ArcticRLClientConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        role: str = "training",
    ) -> None:
        self.step_count = 0
        self._pending_micro_batches = 0
        self._last_grad_norm: float | None = None
        self._transfer: Any = None
        self._dropout_found: list[str] | None = None
        super().__init__(
            config, rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port, role=role
        )

    # ----------------------------------------------------------------------------------------------- construction
    def _zero_stage(self) -> int:
        return int(self.config.training.zero_stage)

    def _clips_itself(self) -> bool:
        # DeepSpeed clips (and reports the norm) inside its ZeRO and bf16 optimizers; a plain fp32 engine at stage 0
        # steps the torch optimizer directly, so the engine clips there, after DeepSpeed's gradient all-reduce.
        return self.zero_stage == 0 and self.dtype != torch.bfloat16

    def _initialize(self, model: nn.Module, ds_config: dict[str, Any]) -> Any:
        training = self.config.training
        ds_config["managed_gradient_accumulation"] = False
        if training.max_grad_norm is not None and not self._clips_itself():
            ds_config["gradient_clipping"] = training.max_grad_norm
        if self.zero_stage > 0:
            ds_config["zero_allow_untested_optimizer"] = True
        if training.gradient_checkpointing:
            hf_model: Any = model  # a transformers PreTrainedModel
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # On CUDA the fused kernel: one pass over the (ZeRO-flattened) fp32 state instead of a dozen elementwise
        # kernels, the same update up to rounding.
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=training.lr,
            betas=training.betas,
            eps=training.eps,
            weight_decay=training.weight_decay,
            fused=self.device.type == "cuda",
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, training.lr_multiplier)
        if self._clips_itself():
            optimizer.register_step_pre_hook(self._clip_before_update)
        engine, _, _, engine_scheduler = self._deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        self._scheduler = engine_scheduler
        # ZeRO-1/2 checks gradients one tensor at a time (thousands of launches a step); same answers, few launches.
        install_multi_tensor_checks(engine.optimizer)
        return engine

    def _clip_before_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        gradients = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(gradients)
        max_norm = self.config.training.max_grad_norm
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(
                [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None], max_norm, norm
            )
        self._last_grad_norm = float(norm)

    def _sleep_modes(self) -> tuple[str, ...]:
        return SLEEP_MODES

    # ------------------------------------------------------------------------------------------------- training
    @property
    def lr(self) -> float:
        """The learning rate the next ``step()`` applies."""
        return float(self._scheduler.get_last_lr()[0])

    def fwd_bwd(
        self,
        batch: Mapping[str, Any],
        *,
        loss_name: str,
        loss_config: Mapping[str, Any] | None = None,
        global_tokens: float,
        global_sequences: float,
        temperature: float = 1.0,
        old_log_probs_from_forward: bool = False,
    ) -> dict[str, Any]:
        """Forward and backward of this rank's share of a step with the registered loss ``loss_name``.

        ``global_tokens`` / ``global_sequences`` are the whole step's response tokens and non-empty sequences (all
        ``fwd_bwd`` calls of the step, all ranks). Gradients accumulate until ``step()``. Returns ``{"loss": float,
        "metrics": {name: float}, "tokens": int, "micro_batches": int, "base_tokens": int, "dedup_tokens": int}``:
        loss and metrics are this call's shares of the step's global values (sum them over calls and ranks).
        Everything is validated before the first forward.

        ``old_log_probs_from_forward``: this forward's own log-probs (detached) are used as the old ones (the batch's
        ``old_log_probs`` are not needed, and not used if present), and come back as ``"logprobs"`` ``[B, R]`` (fp32,
        CPU, 0 where ``response_mask`` is 0). That equals a ``fwd_no_grad`` on the same weights followed by ``fwd_bwd``
        (up to float rounding: the two forwards may cut micro-batches differently) when the batch gets exactly one
        optimizer update and the forward is the same in training and evaluation mode (no dropout), which is checked
        here.
        """
        from arctic_rl.losses import LossInputs, get_loss_fn

        self._require_awake("fwd_bwd")
        self._check_temperature(temperature)
        registered = get_loss_fn(loss_name)
        options = registered.parse_config(loss_config or {})
        needs = registered.needs(options)  # parsed once: a parsed config is taken as is
        for name, value in (("global_tokens", global_tokens), ("global_sequences", global_sequences)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"{name} must be a finite number > 0 (the whole step's count over every call and rank), got "
                    f"{value!r}."
                )
        if old_log_probs_from_forward:
            self._check_old_log_probs_from_forward()
        checked = self._validate(batch, require=needs.batch_keys(old_log_probs_from_forward=old_log_probs_from_forward))
        width = int(checked["responses"].shape[1])
        plan = self._plan(checked, for_training=True)
        # Agree on the pass count before the first pass: the count's all-reduce must not meet a parameter gather.
        padding = self._micro_batches_to_pad(len(plan.samples))

        loss_total = torch.zeros((), dtype=torch.float64)
        metric_totals: dict[str, torch.Tensor] = {}
        forward_log_probs = torch.zeros(tuple(checked["responses"].shape), dtype=torch.float32)
        for samples in plan.samples:
            micro = select_samples(checked, samples, self.device)
            outputs = forward_responses(
                self._engine, micro, zorro=self._zorro, temperature=float(temperature), calculate_entropy=needs.entropy
            )
            dtype = outputs.log_probs.dtype
            if old_log_probs_from_forward:
                old_log_probs = outputs.log_probs.detach()
                forward_log_probs[torch.tensor(samples, dtype=torch.long)] = old_log_probs.float().cpu()
            else:
                old_log_probs = micro["old_log_probs"].to(dtype)
            inputs = LossInputs(
                log_probs=outputs.log_probs,
                old_log_probs=old_log_probs,
                advantages=micro["advantages"].to(dtype),
                response_mask=micro["response_mask"].to(dtype),
                ref_log_probs=micro["ref_log_prob"].to(dtype) if needs.ref_log_probs else None,
                rollout_log_probs=micro["rollout_log_probs"].to(dtype) if needs.rollout_log_probs else None,
                entropy=outputs.entropy,
                global_tokens=float(global_tokens),
                global_sequences=float(global_sequences),
                max_response_length=width,
            )
            output = registered.fn(inputs, options)
            self._engine.backward(output.loss * self.world_size, scale_wrt_gas=False)
            self._pending_micro_batches += 1
            loss_total += output.loss.detach().double().cpu()
            for name, metric in output.metrics.items():
                share = metric.detach().double().cpu()
                metric_totals[name] = metric_totals[name] + share if name in metric_totals else share
        for _ in range(padding):
            # ZeRO-3: join the other ranks' parameter gathers with a pass whose gradient is exactly zero.
            micro = select_samples(checked, plan.samples[0], self.device)
            outputs = forward_responses(
                self._engine, micro, zorro=self._zorro, temperature=float(temperature), calculate_entropy=False
            )
            self._engine.backward(outputs.log_probs.sum() * 0.0, scale_wrt_gas=False)
        result: dict[str, Any] = {
            "loss": float(loss_total),
            "metrics": {name: float(value) for name, value in metric_totals.items()},
            "tokens": int(checked["response_mask"].sum()),
            "micro_batches": len(plan.samples),
            "base_tokens": plan.base_tokens,
            "dedup_tokens": plan.dedup_tokens,
        }
        if old_log_probs_from_forward:
            result["logprobs"] = forward_log_probs
        return result

    def _check_old_log_probs_from_forward(self) -> None:
        """Refuse ``old_log_probs_from_forward`` where it would not equal a separate ``fwd_no_grad``: a model whose
        training-mode forward differs from the evaluation-mode one that ``fwd_no_grad`` runs (active dropout)."""
        dropouts = self._active_dropout()
        if dropouts:
            raise ConfigError(
                "old_log_probs_from_forward=True needs a training forward equal to the evaluation forward, but the "
                f"model has active dropout: {', '.join(dropouts[:4])}. Set the model's dropout to 0 or compute "
                "old_log_probs with fwd_no_grad() instead."
            )

    def _active_dropout(self) -> list[str]:
        """Dropout modules with p > 0 and ``*dropout*`` model-config values > 0 (the model never changes: cached)."""
        if self._dropout_found is None:
            config: Any = getattr(self.module, "config", None)
            settings = config.to_dict() if hasattr(config, "to_dict") else {}
            self._dropout_found = sorted(
                {
                    f"{name or 'model'} (p={module.p})"
                    for name, module in self.module.named_modules()
                    if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0
                }
                | {
                    f"config.{key}={value}"
                    for key, value in settings.items()
                    if "dropout" in key
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                    and value > 0
                }
            )
        return self._dropout_found

    def step(self) -> dict[str, float]:
        """Reduce the accumulated gradients over ranks, clip them to ``training.max_grad_norm`` and apply AdamW at
        the scheduled learning rate. Returns ``{"grad_norm": norm before clipping, "lr": rate applied}``."""
        self._require_awake("step")
        if self._pending_micro_batches == 0:
            raise EngineStateError(
                "step() has no gradients to apply: call fwd_bwd() on this step's batch first.", engine=self.name
            )
        lr = self.lr
        self._last_grad_norm = None
        self._engine.step()
        if not self._clips_itself():
            norm = self._engine.get_global_grad_norm()
            self._last_grad_norm = None if norm is None else float(norm)
        self._pending_micro_batches = 0
        self.step_count += 1
        grad_norm = self._last_grad_norm
        return {"grad_norm": math.nan if grad_norm is None else grad_norm, "lr": lr}

    # ------------------------------------------------------------------------------------------------- memory
    def _offload_states(self, mode: str) -> list[Any]:
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

        weights = [OffloadStateTypeEnum.lp_params]
        optimizer = [
            OffloadStateTypeEnum.optim_states,
            OffloadStateTypeEnum.hp_params,
            OffloadStateTypeEnum.lp_grads,
            OffloadStateTypeEnum.contiguous_grad_buffer,
        ]
        moments = [OffloadStateTypeEnum.optim_states]
        return {"weights": weights, "optimizer": optimizer, "all": weights + optimizer, "moments": moments}[mode]

    def _uses_deepspeed_offload(self) -> bool:
        return hasattr(self._engine.optimizer, "offload_states")

    def _move_torch_state(self, mode: str, device: torch.device) -> None:
        # Stage 0 steps torch's AdamW directly: move its moments and the module (parameters and gradients).
        if mode in ("all", "optimizer", "moments"):
            for state in self._engine.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = value.to(device)
        if mode in ("all", "weights"):
            self.module.to(device)

    def _zero3_keeps_torch_optimizer(self) -> bool:
        # ZeRO-3's offload_states moves only DeepSpeed's own FusedAdam state; this engine steps torch's AdamW.
        return int(self._engine.zero_optimization_stage()) == 3

    def _offload(self, mode: str) -> None:
        if self._zero3_keeps_torch_optimizer():
            if self.device.type == "cuda":
                raise EngineStateError(
                    "sleep() under ZeRO-3 cannot offload the optimizer: DeepSpeed offloads ZeRO-3 state only for its "
                    "own FusedAdam, and this engine steps torch's AdamW. Use training.zero_stage 2 (or 0) with "
                    "colocation, or keep the trainer awake.",
                    engine=self.name,
                )
            # On the CPU the state already lives in host memory: nothing to move, the state machine still applies.
            return
        if self._uses_deepspeed_offload():
            from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

            self._engine.offload_states(
                include=self._offload_states(mode),
                device=OffloadDeviceEnum.cpu,
                pin_memory=self.device.type == "cuda",
            )
        else:
            self._move_torch_state(mode, torch.device("cpu"))

    def _reload(self, mode: str) -> None:
        if self._zero3_keeps_torch_optimizer():
            return
        if self._uses_deepspeed_offload():
            self._engine.reload_states()
        else:
            self._move_torch_state(mode, self.device)

    # --------------------------------------------------------------------------------------------- checkpoints
    def _require_no_pending_gradients(self, operation: str) -> None:
        if self._pending_micro_batches:
            raise EngineStateError(
                f"{operation}() with gradients of {self._pending_micro_batches} micro-batch(es) not yet applied: "
                "DeepSpeed checkpoints do not hold gradients; call step() first.",
                engine=self.name,
            )

    def _barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def save_checkpoint(self, path: str, step: int, *, keep_last: int | None = None, hf_export: bool = False) -> str:
        """Save a DeepSpeed checkpoint (weights, optimizer, scheduler, step counter, RNG) as ``path/global_step
        {step}`` and point ``path/latest`` at it; every rank must call it. ``keep_last`` keeps only the newest
        ``keep_last`` checkpoints (never the one just saved); ``hf_export`` also writes a Hugging Face model (and
        tokenizer) to ``path/global_step{step}/hf``. The directory's manifest (every file's size and SHA-256) is
        written last, then ``latest``: :meth:`load_checkpoint` verifies against it. Returns the checkpoint
        directory."""
        self._require_awake("save_checkpoint")
        self._require_no_pending_gradients("save_checkpoint")
        _require_step(step, "step")
        if keep_last is not None and (not _is_int(keep_last) or keep_last < 1):
            raise InvalidRequestError("keep_last", f"must be None (keep all) or an integer >= 1, got {keep_last!r}.")
        if not isinstance(hf_export, bool):
            raise InvalidRequestError("hf_export", f"must be true or false, got {hf_export!r}.")
        _prepare_save_directory(path)
        tag = _checkpoint_tag(step)
        client_state = {"arctic_rl_step": step, "step_count": self.step_count, "torch_rng": torch.get_rng_state()}
        self._engine.save_checkpoint(path, tag=tag, client_state=client_state, save_latest=False)
        directory = os.path.join(path, tag)
        if hf_export:
            self._export_hugging_face(os.path.join(directory, "hf"))
        self._barrier()
        if self.rank == 0:
            write_manifest(directory)
            _write_latest(path, tag)
        self._barrier()
        if keep_last is not None and self.rank == 0:
            for old in _saved_steps(path)[:-keep_last]:
                if old != step:
                    shutil.rmtree(os.path.join(path, _checkpoint_tag(old)))
        self._barrier()
        return directory

    def _export_hugging_face(self, directory: str) -> None:
        # Collective under ZeRO-3 (every rank gathers); only rank 0 keeps the tensors and writes.
        state_dict = {
            name: tensor.detach().to("cpu", copy=True) for name, tensor in self.iter_full_parameters() if self.rank == 0
        }
        if self.rank != 0:
            return
        model: Any = self.module
        model.save_pretrained(directory, state_dict=state_dict)
        load_tokenizer(self.config).save_pretrained(directory)

    def load_checkpoint(self, path: str, step: int | None = None) -> int:
        """Restore ``path/global_step{step}`` (``step=None``: the one ``path/latest`` names) on every rank:
        weights, optimizer, scheduler, step counter and RNG. Returns the restored step.

        Nothing changes unless the whole checkpoint verifies first (:mod:`arctic_rl.engines.checkpoint_files`: the
        manifest's sizes and hashes, files that load as plain tensors without running code, finite values, this
        model's shapes, this data-parallel size): a refused checkpoint raises ``InvalidRequestError`` with the
        reason and leaves weights, optimizer, scheduler, step and RNG as they were. DeepSpeed then reads only the
        verified objects."""
        self._require_awake("load_checkpoint")
        self._require_no_pending_gradients("load_checkpoint")
        failure: InvalidRequestError | None = None
        try:
            directory = _checkpoint_directory(path, step)
            verified = verify_checkpoint(directory, model_shapes=self._model_shapes(), keep=self._reads_file)
            client_state = self._checked_client_state(verified, directory)
        except InvalidRequestError as error:
            failure = error
        # Every rank verifies; all must agree before any of them enters DeepSpeed's (collective) load.
        if self._any_rank_failed(failure is not None):
            raise failure or InvalidRequestError("path", "another training rank refused the checkpoint.")
        tag = os.path.basename(directory)
        reader, self._engine.checkpoint_engine = self._engine.checkpoint_engine, verified
        try:
            load_path, _ = self._engine.load_checkpoint(
                os.path.dirname(directory), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        finally:
            self._engine.checkpoint_engine = reader
        if load_path is None:
            raise EngineError(self.name, f"DeepSpeed could not load checkpoint {tag!r} from {path}.")
        self.step_count = int(client_state["step_count"])
        torch.set_rng_state(client_state["torch_rng"])
        return int(client_state["arctic_rl_step"])

    def _model_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.zero_stage == 3:
            return {
                name: tuple(int(size) for size in parameter.ds_shape)  # type: ignore[attr-defined]
                for name, parameter in self.module.named_parameters()
            }
        return {name: tuple(value.shape) for name, value in self.module.state_dict().items()}

    def _reads_file(self, relative: str) -> bool:
        """The files DeepSpeed's load reads on this rank: the model file(s) and this rank's ZeRO partition."""
        return relative == "mp_rank_00_model_states.pt" or f"zero_pp_rank_{self.rank}_" in relative

    def _checked_client_state(self, verified: VerifiedFiles, directory: str) -> dict[str, Any]:
        state = next((value for name, value in verified.kept.items() if name.endswith("model_states.pt")), None)
        where = f"checkpoint {directory}"
        if not isinstance(state, Mapping):
            raise InvalidRequestError("path", f"{where} holds no model states for rank {self.rank}.")
        for key in ("arctic_rl_step", "step_count"):
            if not _is_int(state.get(key)) or state[key] < 0:
                raise InvalidRequestError("path", f"{where}: {key} is {state.get(key)!r}, not a step number.")
        rng = state.get("torch_rng")
        expected_rng = torch.get_rng_state()
        if not (isinstance(rng, torch.Tensor) and rng.dtype == expected_rng.dtype and rng.shape == expected_rng.shape):
            raise InvalidRequestError("path", f"{where}: torch_rng is not a torch RNG state.")
        saved_ranks = state.get("dp_world_size")
        if self.zero_stage > 0 and saved_ranks != self.world_size:
            raise InvalidRequestError(
                "path",
                f"{where} was saved by {saved_ranks!r} data-parallel ranks and this trainer runs {self.world_size}; "
                "ZeRO's optimizer partitions load only into the same number of ranks.",
            )
        return dict(state)

    def _any_rank_failed(self, failed: bool) -> bool:
        if self.world_size == 1:
            return failed
        flag = torch.tensor([int(failed)], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    # ------------------------------------------------------------------------------------------ weight transfer
    def transfer_setup(
        self,
        method: CrossProcessMethod,
        samplers: SamplerCall,
        *,
        master_address: str | None = None,
        master_port: int | None = None,
        sampler_world_size: int | None = None,
    ) -> None:
        """Set up the cross-process weight transfer (``nccl``, ``cuda_ipc``, ``gloo``) once; every rank calls it.

        ``samplers(method, args)`` runs a ``SamplingEngine`` method on every sampler replica and waits (over their
        Ray actors in a cluster): rank 0's vLLM trainer engine drives the samplers' ``transfer_*`` methods through
        it, so this process must be able to reach them. For ``nccl`` and ``gloo`` rank 0 hosts the group's
        rendezvous at ``master_address:master_port`` (this node's address and a free port) and the
        ``sampler_world_size`` sampler workers join it; this call returns when the group has formed. The transfer
        then serves every :meth:`send_weights` until :meth:`transfer_shutdown`.
        """
        from arctic_rl.engines.weight_sync import SamplerWeightSyncClient, create_trainer_transfer

        self._require_awake("transfer_setup")
        if self._transfer is not None:
            raise EngineStateError(
                "the weight transfer is already set up and serves every send_weights(); call transfer_shutdown() "
                "before setting up another.",
                engine=self.name,
            )
        base = import_optional(
            "vllm.distributed.weight_transfer.base", extra="vllm", purpose=f"by weight_sync.method={method!r}"
        )
        metadata = [base.ParamMeta(name, dtype, shape) for name, dtype, shape in self.parameter_metadata()]
        sync = self.config.weight_sync
        self._transfer = create_trainer_transfer(
            method,
            client=SamplerWeightSyncClient(samplers),
            parameters=self.iter_full_parameters,
            metadata=metadata,
            rank=self.rank,
            bucket_mb=sync.bucket_mb,
            low_memory=sync.low_memory,
            master_address=master_address,
            master_port=master_port,
            sampler_world_size=sampler_world_size,
            timeout_s=sync.timeout_s,
        )

    def send_weights(self) -> None:
        """Send the full weights to every sampler over the transfer :meth:`transfer_setup` built; every rank calls
        it (under ZeRO-3 each parameter is gathered collectively). Rank 0 drives the samplers' start / update /
        finish, and finishing resets their prefix caches."""
        self._require_awake("send_weights")
        if self._transfer is None:
            raise EngineStateError(
                "send_weights() needs the weight transfer: call transfer_setup(...) first.", engine=self.name
            )
        self._transfer.send_weights()

    def transfer_shutdown(self) -> None:
        """Close this rank's side of the weight transfer (idempotent)."""
        transfer, self._transfer = self._transfer, None
        if transfer is not None:
            transfer.shutdown()

    def shutdown(self) -> None:
        """Release what outlives a call: the weight-transfer group (the process keeps running)."""
        self.transfer_shutdown()
