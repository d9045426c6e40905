"""``ArcticRLClientConfig``: the one typed configuration of an arctic-rl client and its engines.

The config is checked whole at construction: a combination that cannot be placed or run (colocation with a
tensor-parallel size that does not divide the GPUs, CUDA IPC without colocation, NCCL on the CPU, ...) is refused
with a message saying how to fix it, before any Ray actor or engine starts.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from arctic_rl.errors import ConfigError

__all__ = [
    "ArcticRLClientConfig",
    "FcaSection",
    "HttpConfig",
    "SamplingConfig",
    "TrainingConfig",
    "WeightSyncConfig",
    "ZorroTrainSection",
]

Device = Literal["cuda", "cpu"]
Dtype = Literal["float32", "bfloat16"]
WeightSyncMethod = Literal["nccl", "cuda_ipc", "object_store", "gloo"]

# Keys of `ds_config` that a typed field owns; accepting both would leave two sources of truth.
_DS_CONFIG_OWNED_KEYS: dict[str, str] = {
    "optimizer": "training.lr / betas / eps / weight_decay",
    "scheduler": "training.lr_schedule / warmup_steps / total_steps / min_lr_ratio",
    "gradient_clipping": "training.max_grad_norm",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "train_batch_size": "training.micro_batch_tokens (micro-batches are formed by token budget)",
    "train_micro_batch_size_per_gpu": "training.micro_batch_tokens (micro-batches are formed by token budget)",
    "bf16": "the top-level dtype",
    "fp16": "the top-level dtype (float16 is not supported; use dtype='bfloat16')",
    "seed": "the top-level seed",
}

# vLLM engine arguments that a typed field (or the client itself) owns.
_ENGINE_ARGS_OWNED_KEYS: dict[str, str] = {
    "model": "model_name",
    "tokenizer": "tokenizer_name",
    "seed": "the top-level seed",
    "dtype": "sampling.dtype (or the top-level dtype)",
    "tensor_parallel_size": "sampling.tensor_parallel_size",
    "gpu_memory_utilization": "sampling.gpu_memory_utilization",
    "max_model_len": "sampling.max_model_len",
    "max_num_seqs": "sampling.max_num_seqs",
    "enforce_eager": "sampling.enforce_eager",
}


def _refuse_unknown_keys(model: type[BaseModel], data: Any) -> Any:
    """Name each unknown key with the closest known one and list them all (pydantic's own message names neither)."""
    if not isinstance(data, dict):
        return data
    known = sorted(model.model_fields)
    unknown = [key for key in data if key not in model.model_fields]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), known, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"unknown key {', '.join(hints)} in {model.__name__}; the known keys are {known}.")
    return data


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any) -> Any:
        return _refuse_unknown_keys(cls, data)


class TrainingConfig(_Section):
    """Optimizer (AdamW), learning-rate schedule, gradient clipping and micro-batching of the training engine."""

    lr: float = Field(default=1e-6, gt=0.0, description="Peak learning rate of AdamW.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW (beta1, beta2), each in [0, 1).")
    eps: float = Field(default=1e-8, gt=0.0, description="AdamW epsilon.")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW decoupled weight decay.")
    warmup_steps: int = Field(default=0, ge=0, description="Optimizer steps of linear warmup from 0 to `lr`.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        default="constant",
        description="Decay after warmup: 'constant' keeps `lr`; 'linear' and 'cosine' decay to `lr * min_lr_ratio` "
        "at `total_steps`.",
    )
    total_steps: int | None = Field(
        default=None, ge=1, description="Horizon of the 'linear' / 'cosine' decay in optimizer steps (required there)."
    )
    min_lr_ratio: float = Field(
        default=0.0, ge=0.0, le=1.0, description="Final learning rate of a decaying schedule, as a fraction of `lr`."
    )
    max_grad_norm: float | None = Field(
        default=1.0, gt=0.0, description="Clip the global gradient norm to this value; None disables clipping."
    )
    gradient_accumulation_steps: int | None = Field(
        default=None,
        ge=1,
        description="Micro-batches per optimizer step; None: as many as the token budget `micro_batch_tokens` needs.",
    )
    micro_batch_tokens: int = Field(
        default=16384, ge=1, description="Token budget of one micro-batch (prompt plus response tokens, per rank)."
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(default=2, description="DeepSpeed ZeRO stage of the training engine.")
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute each decoder layer's activations in the backward (about a third more compute, a "
        "fraction of the activation memory); the same gradients.",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"training.betas must both be in [0, 1), got {betas}; the usual value is (0.9, 0.999).")
        return betas

    @model_validator(mode="after")
    def _schedule_has_a_horizon(self) -> TrainingConfig:
        if self.lr_schedule != "constant" and self.total_steps is None:
            raise ValueError(
                f"training.lr_schedule={self.lr_schedule!r} decays over a horizon: set training.total_steps to the "
                "number of optimizer steps of the run, or use lr_schedule='constant'."
            )
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(
                f"training.warmup_steps={self.warmup_steps} is longer than training.total_steps={self.total_steps}; "
                "lower warmup_steps or raise total_steps."
            )
        return self

    def lr_multiplier(self, step: int) -> float:
        """The schedule's factor on ``lr`` for the optimizer step ``step`` (0 = the first step).

        Warmup rises linearly over ``warmup_steps`` steps, ``(step + 1) / warmup_steps``, so the first step already
        moves the weights and the last warmup step uses the full ``lr``. After warmup, with ``progress`` running from
        0 to 1 over the remaining ``total_steps - warmup_steps`` steps (1 from then on): 'constant' gives 1,
        'linear' ``1 - (1 - min_lr_ratio) * progress``, 'cosine' ``min_lr_ratio + (1 - min_lr_ratio) *
        (1 + cos(pi * progress)) / 2``. Use it as ``torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier)``.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}.")
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant" or self.total_steps is None:
            return 1.0
        decay_steps = self.total_steps - self.warmup_steps
        progress = 1.0 if decay_steps <= 0 else min(1.0, (step - self.warmup_steps) / decay_steps)
        if self.lr_schedule == "linear":
            return 1.0 - (1.0 - self.min_lr_ratio) * progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ZorroTrainSection(_Section):
    """ZoRRO deduplicated training: shared prompt tokens run once per micro-batch in the training/log-prob engines."""

    enable: bool = Field(default=True, description="Run the training and log-prob engines deduplicated (exact).")
    logits_mode: Literal["none", "compute", "memory"] = Field(
        default="none",
        description="How response log-probs are computed: 'none' (plain), 'compute' (only response positions), "
        "'memory' (chunked, never materialising [tokens, vocab]).",
    )
    max_rollouts_per_micro_batch: int | None = Field(
        default=None,
        ge=1,
        description="Cap on the samples in one micro-batch on top of the token budget; None: no cap.",
    )


class SamplingConfig(_Section):
    """The vLLM sampling engines: the common engine arguments as fields, the rest through `engine_args`."""

    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per vLLM replica (tensor parallelism).")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="Fraction of each GPU's memory vLLM may use (weights + KV cache)."
    )
    max_model_len: int | None = Field(
        default=None, ge=1, description="Longest prompt + response in tokens; None: the model's own limit."
    )
    max_num_seqs: int | None = Field(default=None, ge=1, description="Most sequences per vLLM step; None: vLLM's.")
    max_sequences_per_request: int = Field(
        default=65536,
        ge=1,
        description="Most sequences (prompts x n) one generate may ask for; a larger request is refused before it "
        "reaches vLLM (InvalidRequestError).",
    )
    enforce_eager: bool = Field(default=False, description="Disable CUDA graphs (always eager on the CPU build).")
    dtype: Dtype | None = Field(default=None, description="vLLM's dtype; None: the top-level dtype.")
    kv_cache_space_gib: float | None = Field(
        default=None,
        gt=0.0,
        description="KV-cache size of vLLM's CPU build in GiB (VLLM_CPU_KVCACHE_SPACE); only valid on the CPU.",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Other vLLM engine arguments passed through as given (e.g. {'enable_prefix_caching': True}).",
    )

    @field_validator("engine_args")
    @classmethod
    def _engine_args_do_not_shadow_fields(cls, engine_args: dict[str, Any]) -> dict[str, Any]:
        for key, owner in _ENGINE_ARGS_OWNED_KEYS.items():
            if key in engine_args:
                raise ValueError(f"sampling.engine_args[{key!r}] is set by {owner}; set it there and remove the key.")
        _require_json(engine_args, "sampling.engine_args")
        return engine_args


class FcaSection(_Section):
    """Forest Cascade Attention in the vLLM sampler (the knobs of ``arctic_fca.FcaConfig``, same names)."""

    enable: bool = Field(default=False, description="Register the FCA attention backend in the sampling engines.")
    max_query_len: int = Field(
        default=1, ge=1, description="A step with more query tokens per request than this runs standard attention."
    )
    min_group_size: int = Field(
        default=2, ge=2, description="Fewest requests that must share a prefix for it to be read once for all."
    )
    min_additional_prefix_blocks: int = Field(
        default=1, ge=1, description="Fewest shared full KV blocks a group needs to be read once."
    )
    min_non_singleton_fraction: float = Field(
        default=0.0, ge=0.0, le=1.0, description="A step with a smaller fraction of grouped requests is not grouped."
    )
    max_non_singleton_groups: int = Field(
        default=0, ge=0, description="A step with more groups than this is not grouped; 0 means no limit."
    )
    log_interval: int = Field(default=100, ge=1, description="Log FCA stats every this many steps on GPUs.")

    def environment(self) -> dict[str, str]:
        """The ``ARCTIC_FCA*`` environment variables that make ``arctic_fca.FcaConfig.from_env()`` equal this."""
        variables = {"ARCTIC_FCA": "1" if self.enable else "0"}
        for name, value in self.model_dump().items():
            if name != "enable":
                variables[f"ARCTIC_FCA_{name.upper()}"] = str(value)
        return variables


class WeightSyncConfig(_Section):
    """How the trainer's weights reach the sampling engines after each step."""

    method: Literal["auto", "nccl", "cuda_ipc", "object_store", "gloo"] = Field(
        default="auto",
        description="'auto': CUDA IPC when colocated on GPUs, NCCL when split on GPUs, the Ray object store on CPUs. "
        "'gloo' is the cross-process path without CUDA: the trainer broadcasts to the samplers over a gloo group "
        "through vLLM's weight-transfer API, as 'nccl' does on GPUs (CPU machines, or split processes without NCCL).",
    )
    low_memory: bool = Field(
        default=False, description="Stream one bucket at a time instead of staging the full model (colocated GPUs)."
    )
    bucket_mb: int = Field(default=512, ge=1, description="Size of one transfer bucket in MiB.")
    timeout_s: float = Field(
        default=300.0,
        gt=0.0,
        description="Seconds a cross-process transfer group ('nccl', 'gloo') waits for its members to join, and a "
        "'gloo' broadcast for its peers.",
    )


class HttpConfig(_Section):
    """The HTTP transport (``comm_protocol='http'``): timeouts, retries and the request-size limit."""

    connect_timeout_s: float = Field(default=10.0, gt=0.0, description="Seconds to open a connection to the server.")
    request_timeout_s: float = Field(
        default=3600.0,
        gt=0.0,
        description="Seconds one operation may take, from sending the request to the last byte of the answer "
        "(a step on a large model takes minutes).",
    )
    retries: int = Field(
        default=3,
        ge=0,
        description="Retries of an idempotent operation (weight_norm, describe, fwd_no_grad, log_probs, ...) after a "
        "connection failure or a timeout; an operation that changes state is never retried.",
    )
    backoff_s: float = Field(
        default=0.5, ge=0.0, description="Wait before the first retry; doubled before each further one."
    )
    max_request_mb: int = Field(
        default=2048,
        ge=1,
        description="Largest request or response body in MiB; the server refuses larger requests with 413 (its "
        "own --max-request-mb) and the client refuses to send or read larger ones.",
    )
    shared_memory: bool = Field(
        default=True,
        description="When the server runs on this machine (a loopback host), send batches of at least "
        "shared_memory_min_bytes through shared-memory upload slots instead of the request body (written once, read "
        "in place; see arctic_rl.wire_slots); False: always the body. A server on another host, or one run with "
        "--no-shared-memory, gets the body anyway.",
    )
    shared_memory_min_bytes: int = Field(
        default=1024**2,
        ge=0,
        description="Smallest encoded batch sent through shared memory: below it the two extra round trips of a "
        "slot cost more than the body.",
    )
    server_start_timeout_s: float = Field(
        default=900.0,
        gt=0.0,
        description="With launch_local_server: seconds to wait for the server's engines to start and /health to "
        "answer.",
    )


# What every engine reads: the model, where and how it runs, the seed, and how weights reach the samplers.
_SHARED_ENGINE_FIELDS: tuple[str, ...] = (
    "model_name",
    "tokenizer_name",
    "device",
    "dtype",
    "seed",
    "full_determinism",
    "colocate",
    "training_gpus",
    "sampling_gpus",
    "log_prob_gpus",
    "weight_sync",
)
# Each engine role's own sections (the log-prob engine shards like the trainer, so it reads `training` too).
ENGINE_SECTIONS: dict[str, tuple[str, ...]] = {
    "training": ("training", "zorro_train", "ds_config"),
    "log_prob": ("training", "zorro_train", "ds_config"),
    "sampling": ("sampling", "fca"),
}


class ArcticRLClientConfig(BaseModel):
    """Everything an arctic-rl client needs: model, GPU counts, placement, and the engines' sections.

    On a machine without CUDA the same GPU counts place that many CPU workers, so a GPU config runs unchanged on a
    laptop (``device="cpu"`` forces this).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_name: str = Field(min_length=1, description="Hugging Face hub id or local directory of the policy model.")
    tokenizer_name: str | None = Field(default=None, description="Tokenizer hub id or directory; None: model_name.")
    comm_protocol: Literal["ray", "http"] = Field(
        default="ray", description="Transport between client and engines: 'ray' (actor calls) or 'http'."
    )
    training_gpus: int = Field(default=1, ge=1, description="Data-parallel DeepSpeed training ranks (one GPU each).")
    sampling_gpus: int = Field(default=1, ge=1, description="GPUs of the vLLM sampling engines, all replicas together.")
    log_prob_gpus: int = Field(
        default=0, ge=0, description="GPUs of a separate DeepSpeed log-prob/reference engine; 0: none."
    )
    colocate: bool = Field(
        default=False,
        description="Share the same GPUs between training and sampling (time-shared with sleep/wake) instead of "
        "giving each engine its own.",
    )
    gpus_per_node: int | None = Field(
        default=None,
        ge=1,
        description="GPUs per node of the cluster, to check the placement at construction; None: read from Ray "
        "when the engines are placed.",
    )
    device: Literal["auto", "cuda", "cpu"] = Field(
        default="auto", description="'auto': CUDA when this process sees a GPU, else the CPU; 'cpu' forces the CPU."
    )
    seed: int = Field(default=0, ge=0, description="Seed of every engine (model init, sampling, data order).")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="One dtype for every engine; 'auto': bfloat16 on GPUs, float32 on the CPU."
    )
    full_determinism: bool = Field(
        default=False, description="Deterministic algorithms everywhere (bitwise-reproducible steps, slower)."
    )
    engine_call_timeout_s: float = Field(
        default=1800.0,
        gt=0.0,
        description="Seconds one engine call (a generate, a fwd_bwd, a checkpoint, ...) may take; an engine that "
        "misses it is declared failed (EngineDiedError) and reported by the server's /health.",
    )
    checkpoint_path: str | None = Field(
        default=None, description="Directory of DeepSpeed checkpoints; None: save_checkpoint needs a path."
    )
    log_prob_engine: Literal["deepspeed", "vllm"] = Field(
        default="deepspeed",
        description="Who computes old/reference log-probs: a DeepSpeed engine (the log-prob engine when "
        "log_prob_gpus > 0, else the training engine) or the vLLM sampling engines.",
    )
    ds_config: dict[str, Any] = Field(
        default_factory=dict,
        description="DeepSpeed JSON config passed through as DeepSpeed users write it (e.g. zero_optimization "
        "sub-keys); keys a typed field owns are refused.",
    )
    ray_address: str | None = Field(
        default=None, description="Address of a running Ray cluster; None: attach to a local Ray or start one."
    )
    host: str = Field(default="127.0.0.1", min_length=1, description="Host of the HTTP server (comm_protocol='http').")
    port: int = Field(default=7000, ge=1, le=65535, description="Port of the HTTP server (comm_protocol='http').")
    launch_local_server: bool = Field(
        default=False,
        description="comm_protocol='http': start `arctic-rl-serve` with this config as a subprocess on host:port, "
        "wait for /health, and stop it at shutdown(); False: connect to a server that is already running.",
    )
    token_file: str | None = Field(
        default=None,
        description="File holding the bearer token the HTTP server requires (needed when it binds to an address "
        "other than loopback); the client sends it, and a launched local server checks it.",
    )
    http: HttpConfig = Field(default_factory=HttpConfig, description="HTTP timeouts, retries and size limit.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Optimizer and micro-batching.")
    zorro_train: ZorroTrainSection = Field(default_factory=ZorroTrainSection, description="Deduplicated training.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="The vLLM sampling engines.")
    fca: FcaSection = Field(default_factory=FcaSection, description="Forest Cascade Attention in the sampler.")
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig, description="Trainer -> sampler sync.")

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any) -> Any:
        return _refuse_unknown_keys(cls, data)

    @field_validator("training_gpus", "sampling_gpus", "log_prob_gpus", mode="before")
    @classmethod
    def _engine_counts_say_what_they_count(cls, value: Any, info: ValidationInfo) -> Any:
        # Runs before the `ge` bound, whose bare message does not say that on a CPU these count workers.
        least = 0 if info.field_name == "log_prob_gpus" else 1
        if isinstance(value, int) and not isinstance(value, bool) and value < least:
            raise ValueError(
                f"{info.field_name} must be >= {least}, got {value}. It counts GPUs, or, on a machine without CUDA "
                f"(or with device='cpu'), CPU workers of that engine (each runs one engine process): use "
                f"{info.field_name}={max(least, 1)} for one worker."
            )
        return value

    @field_validator("ds_config")
    @classmethod
    def _ds_config_passes_through(cls, ds_config: dict[str, Any]) -> dict[str, Any]:
        for key, owner in _DS_CONFIG_OWNED_KEYS.items():
            if key in ds_config:
                raise ValueError(f"ds_config[{key!r}] is set by {owner}; set it there and remove the key.")
        zero = ds_config.get("zero_optimization", {})
        if not isinstance(zero, dict):
            raise ValueError(f"ds_config['zero_optimization'] must be a dict, got {type(zero).__name__}.")
        _require_json(ds_config, "ds_config")
        return ds_config

    @model_validator(mode="after")
    def _combination_is_runnable(self) -> ArcticRLClientConfig:
        self._check_tensor_parallel()
        self._check_colocation()
        self._check_devices()
        self._check_log_prob_engine()
        self._check_ds_config_stage()
        self._check_http()
        self._check_model_paths()
        return self

    def _check_model_paths(self) -> None:
        # Engines this process starts on this machine (a local Ray, or a launched local server) read the model
        # here; a value that cannot be a hub id must then be a local directory. Said now, not minutes later by the
        # hub client refusing it as a repo id. A remote cluster or server may hold paths this machine does not.
        starts_here = self.launch_local_server if self.comm_protocol == "http" else self.ray_address is None
        if not starts_here:
            return
        for name in ("model_name", "tokenizer_name"):
            value = getattr(self, name)
            if value is None or _HUB_ID.fullmatch(value) or Path(value).expanduser().is_dir():
                continue
            path = Path(value).expanduser()
            where = "" if path.is_absolute() else f" (relative to the working directory {Path.cwd()})"
            problem = "is a file, not a model directory" if path.exists() else "not found"
            raise ValueError(
                f"{name}={value!r}: directory {problem}{where}. Give a local model directory (holding config.json) "
                "or a Hugging Face hub id such as 'Qwen/Qwen3-4B'."
            )

    def _check_http(self) -> None:
        if self.launch_local_server and self.comm_protocol != "http":
            raise ValueError(
                "launch_local_server=True starts an HTTP server, which needs comm_protocol='http'; set "
                "comm_protocol='http', or launch_local_server=False for the Ray transport."
            )

    def _check_tensor_parallel(self) -> None:
        tp = self.sampling.tensor_parallel_size
        if tp > self.sampling_gpus:
            raise ValueError(
                f"sampling.tensor_parallel_size={tp} is larger than sampling_gpus={self.sampling_gpus}; one vLLM "
                f"replica needs {tp} GPUs: raise sampling_gpus to a multiple of {tp} or lower tensor_parallel_size."
            )
        if self.sampling_gpus % tp:
            raise ValueError(
                f"sampling_gpus={self.sampling_gpus} is not a multiple of sampling.tensor_parallel_size={tp}; every "
                "vLLM replica uses tensor_parallel_size GPUs: make sampling_gpus a multiple of it."
            )
        if self.gpus_per_node is not None:
            self.check_gpus_per_node(self.gpus_per_node)

    def _check_colocation(self) -> None:
        if not self.colocate:
            return
        if self.sampling_gpus != self.training_gpus:
            raise ValueError(
                f"colocate=True runs training and sampling on the same GPUs, but training_gpus={self.training_gpus} "
                f"and sampling_gpus={self.sampling_gpus}; set them equal, or set colocate=False to give each engine "
                "its own GPUs."
            )
        if self.log_prob_gpus not in (0, self.training_gpus):
            raise ValueError(
                f"colocate=True shares the training GPUs, so log_prob_gpus must be 0 (no separate log-prob engine) "
                f"or {self.training_gpus} (one colocated with each training rank), got {self.log_prob_gpus}."
            )

    def _check_devices(self) -> None:
        device = self.resolved_device()
        method = self.weight_sync.method
        if device == "cpu" and method in ("nccl", "cuda_ipc"):
            raise ValueError(
                f"weight_sync.method={method!r} needs CUDA but the engines run on the CPU (device={self.device!r}"
                f"{', and this process sees no GPU' if self.device == 'auto' else ''}); use method='object_store' or "
                "'auto', or set device='cuda' if the Ray cluster has GPUs this process cannot see."
            )
        if method == "cuda_ipc" and not self.colocate:
            raise ValueError(
                "weight_sync.method='cuda_ipc' shares GPU memory between processes on the same GPU, which needs "
                "colocate=True; use method='nccl' (or 'auto') for split GPUs."
            )
        if device == "cuda" and self.sampling.kv_cache_space_gib is not None:
            raise ValueError(
                "sampling.kv_cache_space_gib sizes the KV cache of vLLM's CPU build; on GPUs the KV cache is sized by "
                "sampling.gpu_memory_utilization: remove kv_cache_space_gib or set device='cpu'."
            )

    def _check_log_prob_engine(self) -> None:
        if self.log_prob_engine == "vllm" and self.log_prob_gpus > 0:
            raise ValueError(
                f"log_prob_engine='vllm' computes log-probs on the sampling engines, so log_prob_gpus="
                f"{self.log_prob_gpus} GPUs would sit idle; set log_prob_gpus=0, or log_prob_engine='deepspeed' to "
                "run a separate DeepSpeed log-prob engine on them."
            )

    def _check_ds_config_stage(self) -> None:
        stage = self.ds_config.get("zero_optimization", {}).get("stage")
        if stage is not None and stage != self.training.zero_stage:
            raise ValueError(
                f"ds_config['zero_optimization']['stage']={stage!r} disagrees with training.zero_stage="
                f"{self.training.zero_stage}; the ZeRO stage is set by training.zero_stage: set it to {stage!r} and "
                "remove 'stage' from ds_config."
            )

    def check_gpus_per_node(self, gpus_per_node: int) -> None:
        """Refuse a placement that cannot fit nodes of ``gpus_per_node`` GPUs (``ConfigError`` saying how to fix).

        A vLLM replica (``tensor_parallel_size`` GPUs) must sit on one node, and a colocated layout packs each node
        with whole replicas, so the tensor-parallel size must divide the GPUs per node.
        """
        if gpus_per_node < 1:
            raise ConfigError(f"gpus_per_node must be >= 1, got {gpus_per_node}.")
        tp = self.sampling.tensor_parallel_size
        if tp > gpus_per_node:
            raise ConfigError(
                f"sampling.tensor_parallel_size={tp} is larger than the {gpus_per_node} GPUs of a node; a vLLM "
                f"replica must fit on one node: lower tensor_parallel_size to at most {gpus_per_node}."
            )
        if self.colocate and gpus_per_node % tp:
            divisors = [size for size in range(1, gpus_per_node + 1) if gpus_per_node % size == 0]
            raise ConfigError(
                f"colocate=True packs each node with whole vLLM replicas, but sampling.tensor_parallel_size={tp} does "
                f"not divide the {gpus_per_node} GPUs per node; use a tensor_parallel_size in {divisors}, or "
                "colocate=False."
            )

    def for_engine(self, role: str) -> ArcticRLClientConfig:
        """The config ``role``'s engines receive: the client's transport (HTTP host, port, token file, timeouts, the
        Ray address) and the other engines' sections are reset to their defaults, so an engine reads only what is
        its own (:data:`ENGINE_SECTIONS`) and nothing of the client's reaches its process. ``role``: ``"training"``,
        ``"log_prob"`` or ``"sampling"``."""
        if role not in ENGINE_SECTIONS:
            raise ValueError(f"role must be one of {sorted(ENGINE_SECTIONS)}, got {role!r}.")
        kept = {*ENGINE_SECTIONS[role], *_SHARED_ENGINE_FIELDS}
        defaults = {
            name: field.get_default(call_default_factory=True)
            for name, field in type(self).model_fields.items()
            if name not in kept and not field.is_required()
        }
        return self.model_copy(update=defaults)

    def resolved_device(self) -> Device:
        """The device every engine runs on: ``device``, with 'auto' resolved against this process's CUDA."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_dtype(self) -> Dtype:
        """The parameter dtype of every engine: ``dtype``, with 'auto' as bfloat16 on GPUs and float32 on the CPU."""
        if self.dtype == "auto":
            return "bfloat16" if self.resolved_device() == "cuda" else "float32"
        return self.dtype

    def resolved_sampling_dtype(self) -> Dtype:
        """The vLLM dtype: ``sampling.dtype`` if set, else ``resolved_dtype()``."""
        return self.sampling.dtype or self.resolved_dtype()

    def resolved_weight_sync(self) -> WeightSyncMethod:
        """The weight-sync method: ``weight_sync.method``, with 'auto' resolved from the device and the placement."""
        if self.weight_sync.method != "auto":
            return self.weight_sync.method
        if self.resolved_device() == "cpu":
            return "object_store"
        return "cuda_ipc" if self.colocate else "nccl"

    def resolved_tokenizer_name(self) -> str:
        """``tokenizer_name``, or ``model_name`` when it is not set."""
        return self.tokenizer_name or self.model_name


# What the Hugging Face hub accepts as a repo id: a name, optionally after an owner and one slash.
_HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}", re.ASCII)


def _require_json(value: dict[str, Any], where: str) -> None:
    # model_dump_json() must round-trip, so pass-through dicts may hold only JSON values.
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where} must hold only JSON values (str, number, bool, None, list, dict): {error}") from None
