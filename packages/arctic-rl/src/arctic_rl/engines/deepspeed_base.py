"""What the training and log-prob engines share: a DeepSpeed-wrapped Hugging Face model, its process group, the
ZoRRO patch, the no-grad forward, weight norms, full-parameter iteration and the sleep/wake state machine.

DeepSpeed (and, through the model loader, transformers) is imported when an engine is built, never at import time.
"""

from __future__ import annotations

import gc
import math
import os
import socket
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from arctic_rl.engines.model import engine_device, engine_dtype, load_causal_lm, seed_everything
from arctic_rl.engines.policy_forward import (
    EngineMicroBatches,
    forward_responses,
    plan_engine_micro_batches,
    select_samples,
)
from arctic_rl.errors import EngineError, EngineStateError, import_optional

if TYPE_CHECKING:
    from arctic_rl.config import ArcticRLClientConfig

__all__ = ["DeepSpeedModelEngine", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for a single-rank process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _import_deepspeed(device: torch.device, engine: str) -> Any:
    # DeepSpeed picks its accelerator once, at import: the CPU one must be asked for before the first import.
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = import_optional("deepspeed", extra="engines", purpose="by the training and log-prob engines")
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    if accelerator != device.type:
        raise EngineError(
            engine,
            f"DeepSpeed runs on its {accelerator!r} accelerator but the config resolves the device to "
            f"{device.type!r}; set DS_ACCELERATOR={device.type} before deepspeed is first imported in this process, "
            "or set the config's device to match.",
        )
    return deepspeed


# DeepSpeed's CPU communication backend builds this C++ op when the process group starts. Only its tensor-parallel
# inference all-reduce uses it; the engines' collectives go through gloo.
SHARED_MEMORY_COMM_OP = "deepspeed_shm_comm"


def _skip_shared_memory_comm_op(deepspeed: Any) -> None:
    """Keep DeepSpeed from compiling ``deepspeed_shm_comm`` at ``init_distributed`` on the CPU.

    The build takes 1-6 minutes on a small machine, repeats in every fresh environment and fails without a C++
    compiler, for an op nothing here calls. DeepSpeed builds an op only when its table of compatible ops says it
    can; marking this one incompatible makes its backend fall back to torch.distributed (gloo) for that all-reduce.
    """
    compatible_ops: dict[str, bool] = deepspeed.ops.__compatible_ops__
    compatible_ops[SHARED_MEMORY_COMM_OP] = False


def _forget_stale_deepspeed_groups() -> None:
    """Drop the process groups DeepSpeed caches in module globals before this process's default group is created anew.

    DeepSpeed keeps the world group and the groups derived from it (``deepspeed.utils.groups``) across engines. When
    the default group they came from was destroyed since (an in-process vLLM engine's teardown destroys the default
    group it found), they name a group torch no longer knows, and the next engine fails with "Group ... is not
    registered"; DeepSpeed derives them again from the new group on first use.
    """
    from deepspeed.utils import groups

    for name in (
        "_WORLD_GROUP",
        "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
        "_DATA_PARALLEL_GROUP",
        "_MODEL_PARALLEL_GROUP",
        "_TENSOR_MODEL_PARALLEL_GROUP",
    ):
        if hasattr(groups, name):
            setattr(groups, name, None)
    for name in (
        "_EXPERT_PARALLEL_GROUP",
        "_EXPERT_PARALLEL_GROUP_RANKS",
        "_EXPERT_DATA_PARALLEL_GROUP",
        "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
    ):
        cached = getattr(groups, name, None)
        if isinstance(cached, dict):
            cached.clear()
    all_to_all = getattr(groups, "_ALL_TO_ALL_GROUP", None)
    if isinstance(all_to_all, dict):
        all_to_all.clear()


class DeepSpeedModelEngine:
    """Base of ``TrainingEngine`` and ``LogProbEngine``: subclasses choose the DeepSpeed config and optimizer."""

    def __init__(
        self,
        config: ArcticRLClientConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        role: str,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size) with world_size >= 1, got rank={rank}, {world_size=}.")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.role = role
        self.name = f"{role}[{rank}]"
        self.device = engine_device(config, rank)
        self.dtype = engine_dtype(config)
        self.is_sleeping = False
        self._sleep_mode: str | None = None
        seed_everything(config.seed, full_determinism=config.full_determinism)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._deepspeed = _import_deepspeed(self.device, self.name)
        self._init_process_group(master_addr, master_port)
        model = load_causal_lm(config, device=self.device, dtype=self.dtype)
        model_config: Any = model.config
        self.vocab_size = int(model_config.get_text_config().vocab_size)
        positions = getattr(model_config.get_text_config(), "max_position_embeddings", None)
        self.max_positions: int | None = int(positions) if positions else None
        self.zero_stage = self._zero_stage()
        self._engine = self._initialize(model, self._deepspeed_config())
        self._zorro = self._install_zorro()

    # ----------------------------------------------------------------------------------------------- construction
    def _zero_stage(self) -> int:
        raise NotImplementedError

    def _initialize(self, model: nn.Module, ds_config: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _deepspeed_config(self) -> dict[str, Any]:
        base: dict[str, Any] = {
            # Micro-batches are formed by token budget and accumulated by the engine itself; DeepSpeed's batch-size
            # bookkeeping only needs consistent numbers.
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 2**31 - 1,
            "zero_optimization": {"stage": self.zero_stage},
            "bf16": {"enabled": self.dtype == torch.bfloat16},
        }
        merged = _merge(base, self.config.ds_config)
        # The config pins ds_config's stage to training.zero_stage; the log-prob engine picks its own.
        merged["zero_optimization"]["stage"] = self.zero_stage
        return merged

    def _init_process_group(self, master_addr: str, master_port: int | None) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cpu":
            _skip_shared_memory_comm_op(self._deepspeed)
        if torch.distributed.is_initialized():
            if torch.distributed.get_world_size() != self.world_size or torch.distributed.get_rank() != self.rank:
                raise EngineError(
                    self.name,
                    f"this process already belongs to a process group of world size "
                    f"{torch.distributed.get_world_size()} as rank {torch.distributed.get_rank()}, but the engine "
                    f"was asked for rank {self.rank} of {self.world_size}; run one engine group per process.",
                )
            self._deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
            return
        _forget_stale_deepspeed_groups()
        if master_port is None:
            if self.world_size > 1:
                raise ValueError(
                    f"world_size={self.world_size} needs a master_port that every rank agrees on; pass master_port."
                )
            master_port = free_port(master_addr)
        os.environ.update(
            {
                "RANK": str(self.rank),
                "LOCAL_RANK": str(self.device.index or 0),
                "WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
            }
        )
        self._deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)

    def _install_zorro(self) -> bool:
        from arctic_zorro_train import ZorroTrainConfig, install_zorro_for_deepspeed

        section = self.config.zorro_train
        patch = install_zorro_for_deepspeed(
            self._engine, ZorroTrainConfig(enable=section.enable, logits_mode=section.logits_mode)
        )
        return patch is not None

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def module(self) -> nn.Module:
        """The Hugging Face model inside the DeepSpeed engine (ZeRO-3: its parameters are partitioned)."""
        module: nn.Module = self._engine.module
        return module

    @property
    def zorro_enabled(self) -> bool:
        return self._zorro

    # ----------------------------------------------------------------------------------------------- validation
    def _require_awake(self, operation: str) -> None:
        if self.is_sleeping:
            raise EngineStateError(
                f"{operation}() needs the engine awake, but it is sleeping (mode {self._sleep_mode!r}); call wake() "
                "first.",
                engine=self.name,
            )

    @staticmethod
    def _check_temperature(temperature: float) -> None:
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}.")

    def _validate(self, batch: Mapping[str, Any], require: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """The batch checked on the host, then moved to the engine's device in one copy: planning and micro-batch
        selection run on the device (on a GPU host, torch's multi-threaded CPU ops on [B, S] tensors cost 10-100 ms
        a step and varied run to run; on the device they take a few ms)."""
        from arctic_rl.batch import ValidatedBatch, validate_batch

        # A batch is checked once per request. Through the service, the check lives there: it sees the whole
        # batch (errors name the user's rows, and a refused batch reaches no rank, so no rank is left with half a
        # step), and each rank receives its rows as a ValidatedBatch, taken as is when its check was at least as
        # strict as this engine's limits. Any other batch (a direct caller's, or one checked for other limits) is
        # checked here, so an engine called directly is as safe as through the service. Outside input never
        # arrives pre-checked: the HTTP server and the clients decode plain dicts, and the service checks
        # whatever it receives.
        if isinstance(batch, ValidatedBatch) and batch.covers(
            vocab_size=self.vocab_size, max_length=self.max_positions, require=require
        ):
            checked: Mapping[str, torch.Tensor] = batch
        else:
            checked = validate_batch(batch, vocab_size=self.vocab_size, require=require, max_length=self.max_positions)
        return {name: value.to(self.device) for name, value in checked.items()}

    def _plan(self, batch: Mapping[str, torch.Tensor], *, for_training: bool) -> EngineMicroBatches:
        training = self.config.training
        return plan_engine_micro_batches(
            batch,
            token_budget=training.micro_batch_tokens,
            num_micro_batches=training.gradient_accumulation_steps if for_training else None,
            max_samples=self.config.zorro_train.max_rollouts_per_micro_batch,
            deduplicated=self._zorro,
        )

    def _micro_batches_to_pad(self, count: int) -> int:
        """How many extra (discarded) micro-batches this rank runs so every rank runs as many as the busiest one.

        Under ZeRO-3 every forward and backward gathers the parameters collectively, so ranks whose shares cut into
        different numbers of micro-batches would wait on each other forever. ZeRO 0-2 run no collective before
        ``step()``, so they need no padding."""
        if self.world_size == 1 or self.zero_stage != 3:
            return 0
        counts = torch.tensor([count], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
        return int(counts.item()) - count

    # ------------------------------------------------------------------------------------------------ forward
    def fwd_no_grad(
        self, batch: Mapping[str, Any], *, calculate_entropy: bool = False, temperature: float = 1.0
    ) -> dict[str, torch.Tensor]:
        """Per-response-token log-probs ``{"logprobs": [B, R]}`` (fp32, CPU, 0 where ``response_mask`` is 0) at
        ``temperature``, and ``"entropy"`` ``[B, R]`` when ``calculate_entropy``. Micro-batched by token budget."""
        self._require_awake("fwd_no_grad")
        self._check_temperature(temperature)
        checked = self._validate(batch, require=())
        plan = self._plan(checked, for_training=False)
        # Agree on the pass count before the first pass: the count's all-reduce must not meet a parameter gather.
        padding = self._micro_batches_to_pad(len(plan.samples))
        shape = tuple(checked["responses"].shape)
        log_probs = torch.zeros(shape, dtype=torch.float32)
        entropy = torch.zeros(shape, dtype=torch.float32) if calculate_entropy else None
        was_training = self.module.training
        self._engine.eval()
        try:
            with torch.no_grad():
                for samples in plan.samples:
                    micro = select_samples(checked, samples, self.device)
                    outputs = forward_responses(
                        self._engine,
                        micro,
                        zorro=self._zorro,
                        temperature=float(temperature),
                        calculate_entropy=calculate_entropy,
                    )
                    rows = torch.tensor(samples, dtype=torch.long)
                    log_probs[rows] = outputs.log_probs.float().cpu()
                    if entropy is not None and outputs.entropy is not None:
                        entropy[rows] = outputs.entropy.float().cpu()
                for _ in range(padding):
                    # Joins the other ranks' parameter gathers; the result is discarded.
                    micro = select_samples(checked, plan.samples[0], self.device)
                    forward_responses(
                        self._engine, micro, zorro=self._zorro, temperature=float(temperature), calculate_entropy=False
                    )
        finally:
            self._engine.train(was_training)
        result = {"logprobs": log_probs}
        if entropy is not None:
            result["entropy"] = entropy
        return result

    # -------------------------------------------------------------------------------------------------- weights
    def _partition_data(self, parameter: torch.Tensor) -> torch.Tensor:
        # ZeRO-3 keeps only this rank's flat slice (ds_tensor); the last slice is padded with uninitialized memory.
        partition = parameter.ds_tensor  # type: ignore[attr-defined]
        size = int(partition.numel())
        rank = torch.distributed.get_rank(group=parameter.ds_process_group)  # type: ignore[attr-defined]
        valid = max(0, min(size, int(parameter.ds_numel) - rank * size))  # type: ignore[attr-defined]
        return partition.reshape(-1).narrow(0, 0, valid)

    def weight_norm(self) -> float:
        """``sqrt(sum of squares)`` of every parameter in float64 (tied weights once). Under ZeRO-3 every rank
        must call it (an all-reduce of the partitions' sums)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        partitioned = False
        for parameter in self.module.parameters():
            if hasattr(parameter, "ds_tensor"):
                partitioned = True
                data = self._partition_data(parameter)
            else:
                data = parameter.data
            total += data.to(device=self.device, dtype=torch.float64).square().sum()
        if partitioned and self.world_size > 1:
            torch.distributed.all_reduce(total)
        return math.sqrt(float(total))

    def parameter_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(Hugging Face name, dtype, full shape)`` of what :meth:`iter_full_parameters` yields, in its order,
        without gathering (ZeRO-3 keeps the full shape in ``ds_shape``)."""
        return [
            (name, parameter.dtype, tuple(int(size) for size in getattr(parameter, "ds_shape", parameter.shape)))
            for name, parameter in self.module.named_parameters()
        ]

    def iter_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(Hugging Face name, full tensor)`` for every parameter (tied weights once), in ``named_parameters``
        order. Under ZeRO-3 each parameter is gathered collectively, so every rank must iterate to the end; the
        tensors are then copies. Under ZeRO 0-2 they are the live (detached) parameters: copy before changing."""
        self._require_awake("iter_full_parameters")
        zero = self._deepspeed.zero
        for name, parameter in self.module.named_parameters():
            if hasattr(parameter, "ds_tensor"):
                with zero.GatheredParameters([parameter], modifier_rank=None):
                    full = parameter.data.detach().clone()
                yield name, full
            else:
                yield name, parameter.detach()

    # ----------------------------------------------------------------------------------------------- memory
    def empty_cache(self) -> None:
        """Return cached, unused accelerator memory to the device (a no-op on the CPU)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _offload(self, mode: str) -> None:
        raise NotImplementedError

    def _reload(self, mode: str) -> None:
        raise NotImplementedError

    def _sleep_modes(self) -> tuple[str, ...]:
        raise NotImplementedError

    def sleep(self, mode: str = "all") -> None:
        """Move the engine's state (``mode``: see ``sleep_modes``) to host memory until ``wake()``; calls that
        need it (forward, training, checkpoints) are refused meanwhile. On the CPU the state already lives in host
        memory: the same offload runs (so it is tested there) but frees nothing."""
        modes = self._sleep_modes()
        if mode not in modes:
            raise ValueError(f"sleep mode must be one of {modes}, got {mode!r}.")
        self._require_awake("sleep")
        self._offload(mode)
        self.empty_cache()
        self.is_sleeping = True
        self._sleep_mode = mode

    def wake(self) -> None:
        """Bring back what ``sleep()`` moved; the engine is then usable again."""
        if not self.is_sleeping:
            raise EngineStateError("wake() called on an engine that is awake; call sleep() first.", engine=self.name)
        mode = self._sleep_mode
        assert mode is not None
        self._reload(mode)
        self.is_sleeping = False
        self._sleep_mode = None
