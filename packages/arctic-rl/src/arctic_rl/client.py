"""The thin client: ``create_arctic_rl_client(config)`` and the async / blocking clients, over Ray or HTTP.

The client imports only Ray, torch, pydantic and httpx: DeepSpeed, vLLM and transformers live in the engines'
processes, so an RL framework drives the engines from its own environment. Every operation is forwarded to the one
service (:mod:`arctic_rl.service`), which validates before it changes anything: directly as a Ray actor call
(``comm_protocol='ray'``, :mod:`arctic_rl.ray_transport`), or through the HTTP server that hosts it
(``comm_protocol='http'``, :mod:`arctic_rl.http_client`). Either way errors come back as arctic-rl's own exceptions
(``BatchValidationError``, ``EngineError`` naming the engine, ...), and the results have the same types. Both
transports derive from one base (:mod:`arctic_rl.transport`) that writes each call once: the async client calls its
async face, the blocking client its blocking face.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from arctic_rl.errors import ArcticRLError, ConfigError
from arctic_rl.operations import (
    DESCRIBE,
    EMPTY_TRAINING_CACHE,
    FWD_BWD,
    FWD_NO_GRAD,
    GENERATE,
    LAST_STEP_METRICS,
    LOAD_CHECKPOINT,
    LOG_PROBS,
    RESET_PREFIX_CACHE,
    SAVE_CHECKPOINT,
    SLEEP_INFERENCE,
    SLEEP_LOG_PROB,
    SLEEP_TRAINING,
    STEP,
    SYNC_WEIGHTS,
    TRAIN_STEP,
    WAKE_INFERENCE,
    WAKE_LOG_PROB,
    WAKE_TRAINING,
    WEIGHT_NORM,
    Operation,
)
from arctic_rl.ray_transport import RayTransport
from arctic_rl.transport import Transport

if TYPE_CHECKING:
    import torch

    from arctic_rl.config import ArcticRLClientConfig

__all__ = ["ArcticRLClient", "SyncArcticRLClient", "attach_arctic_rl_client", "create_arctic_rl_client"]

Result = TypeVar("Result")


class _ClientBase:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ArcticRLError("this client was shut down; create a new one with create_arctic_rl_client(config).")


class ArcticRLClient(_ClientBase):
    """Async client: every operation is a coroutine (``await client.generate(...)``); ``async with`` shuts down."""

    async def _run(self, op: Operation[Result], **arguments: Any) -> Result:
        self._check_open()
        return op.result(await self._transport.call(op.name, op.arguments(arguments)))

    async def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], sampling_params: Mapping[str, Any]
    ) -> list[list[dict[str, Any]]]:
        return await self._run(GENERATE, prompts=prompts, sampling_params=sampling_params)

    async def fwd_no_grad(
        self,
        batch: Mapping[str, Any],
        reference_model: bool = False,
        calculate_entropy: bool = False,
        *,
        temperature: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        return await self._run(
            FWD_NO_GRAD,
            batch=batch,
            reference_model=reference_model,
            calculate_entropy=calculate_entropy,
            temperature=temperature,
        )

    async def fwd_bwd(
        self,
        batch: Mapping[str, Any],
        processing: Mapping[str, Any] | None = None,
        *,
        old_log_probs_from_forward: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, Any]:
        return await self._run(
            FWD_BWD,
            batch=batch,
            processing=processing,
            old_log_probs_from_forward=old_log_probs_from_forward,
            temperature=temperature,
        )

    async def step(self) -> dict[str, Any]:
        return await self._run(STEP)

    async def train_step(
        self,
        batch: Mapping[str, Any],
        processing: Mapping[str, Any] | None = None,
        *,
        old_log_probs_from_forward: bool = False,
        sync_weights: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, Any]:
        return await self._run(
            TRAIN_STEP,
            batch=batch,
            processing=processing,
            old_log_probs_from_forward=old_log_probs_from_forward,
            sync_weights=sync_weights,
            temperature=temperature,
        )

    async def sync_weights(self) -> dict[str, float]:
        return await self._run(SYNC_WEIGHTS)

    async def sleep_inference(self, level: int = 1) -> None:
        await self._run(SLEEP_INFERENCE, level=level)

    async def wake_inference(self, tags: Sequence[str] | None = None) -> None:
        await self._run(WAKE_INFERENCE, tags=tags)

    async def sleep_training(self, mode: str = "all") -> None:
        await self._run(SLEEP_TRAINING, mode=mode)

    async def wake_training(self) -> None:
        await self._run(WAKE_TRAINING)

    async def sleep_log_prob(self) -> None:
        await self._run(SLEEP_LOG_PROB)

    async def wake_log_prob(self) -> None:
        await self._run(WAKE_LOG_PROB)

    async def empty_training_cache(self) -> None:
        await self._run(EMPTY_TRAINING_CACHE)

    async def reset_prefix_cache(self) -> None:
        await self._run(RESET_PREFIX_CACHE)

    async def save_checkpoint(
        self, path: str | None = None, step: int | None = None, *, keep_last: int | None = None, hf_export: bool = False
    ) -> str:
        return await self._run(SAVE_CHECKPOINT, path=path, step=step, keep_last=keep_last, hf_export=hf_export)

    async def load_checkpoint(self, path: str | None = None, step: int | None = None) -> int:
        return await self._run(LOAD_CHECKPOINT, path=path, step=step)

    async def weight_norm(self) -> dict[str, float]:
        return await self._run(WEIGHT_NORM)

    async def log_probs(
        self, prompts: Sequence[str], completions: Sequence[str], *, temperature: float = 1.0
    ) -> list[list[float]]:
        return await self._run(LOG_PROBS, prompts=prompts, completions=completions, temperature=temperature)

    async def last_step_metrics(self) -> dict[str, float]:
        return await self._run(LAST_STEP_METRICS)

    async def describe(self) -> dict[str, Any]:
        return await self._run(DESCRIBE)

    async def shutdown(self) -> None:
        """Stop every engine and remove their actors and placement groups; shut Ray down if the client started it
        (over HTTP: stop the server if the client launched it). A client that attached leaves the service up."""
        if self._closed:
            return
        self._closed = True
        await self._transport.close()

    async def __aenter__(self) -> ArcticRLClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()


class SyncArcticRLClient(_ClientBase):
    """Blocking client: the same operations as ``ArcticRLClient``, returning their results; ``with`` shuts down."""

    def _run(self, op: Operation[Result], **arguments: Any) -> Result:
        self._check_open()
        return op.result(self._transport.call_sync(op.name, op.arguments(arguments)))

    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], sampling_params: Mapping[str, Any]
    ) -> list[list[dict[str, Any]]]:
        return self._run(GENERATE, prompts=prompts, sampling_params=sampling_params)

    def fwd_no_grad(
        self,
        batch: Mapping[str, Any],
        reference_model: bool = False,
        calculate_entropy: bool = False,
        *,
        temperature: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        return self._run(
            FWD_NO_GRAD,
            batch=batch,
            reference_model=reference_model,
            calculate_entropy=calculate_entropy,
            temperature=temperature,
        )

    def fwd_bwd(
        self,
        batch: Mapping[str, Any],
        processing: Mapping[str, Any] | None = None,
        *,
        old_log_probs_from_forward: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, Any]:
        """Forward and backward of the step's batch; gradients accumulate until ``step()``.

        ``old_log_probs_from_forward=True``: skip ``fwd_no_grad``; the trainer uses its own forward's log-probs,
        detached, as the old ones (the batch's ``old_log_probs`` are not needed, and not used if present). The same loss
        and gradients (up to float rounding) when the batch gets one optimizer update, as in ``fwd_no_grad`` ->
        ``fwd_bwd`` -> ``step``; refused for a model with active dropout. ``temperature``: the log-probs are
        ``log_softmax(logits / temperature)``, the distribution the sampler drew from at that temperature.
        """
        return self._run(
            FWD_BWD,
            batch=batch,
            processing=processing,
            old_log_probs_from_forward=old_log_probs_from_forward,
            temperature=temperature,
        )

    def step(self) -> dict[str, Any]:
        return self._run(STEP)

    def train_step(
        self,
        batch: Mapping[str, Any],
        processing: Mapping[str, Any] | None = None,
        *,
        old_log_probs_from_forward: bool = False,
        sync_weights: bool = False,
        temperature: float = 1.0,
    ) -> dict[str, Any]:
        """``fwd_bwd`` + ``step`` (+ ``sync_weights`` when asked) in one round trip; returns ``{"fwd_bwd": ...,
        "step": ..., "sync_weights": ... or None}``, each what that call returns (the step's metrics include the
        sync time). Everything is checked before any engine changes state."""
        return self._run(
            TRAIN_STEP,
            batch=batch,
            processing=processing,
            old_log_probs_from_forward=old_log_probs_from_forward,
            sync_weights=sync_weights,
            temperature=temperature,
        )

    def sync_weights(self) -> dict[str, float]:
        return self._run(SYNC_WEIGHTS)

    def sleep_inference(self, level: int = 1) -> None:
        self._run(SLEEP_INFERENCE, level=level)

    def wake_inference(self, tags: Sequence[str] | None = None) -> None:
        self._run(WAKE_INFERENCE, tags=tags)

    def sleep_training(self, mode: str = "all") -> None:
        self._run(SLEEP_TRAINING, mode=mode)

    def wake_training(self) -> None:
        self._run(WAKE_TRAINING)

    def sleep_log_prob(self) -> None:
        self._run(SLEEP_LOG_PROB)

    def wake_log_prob(self) -> None:
        self._run(WAKE_LOG_PROB)

    def empty_training_cache(self) -> None:
        self._run(EMPTY_TRAINING_CACHE)

    def reset_prefix_cache(self) -> None:
        self._run(RESET_PREFIX_CACHE)

    def save_checkpoint(
        self, path: str | None = None, step: int | None = None, *, keep_last: int | None = None, hf_export: bool = False
    ) -> str:
        return self._run(SAVE_CHECKPOINT, path=path, step=step, keep_last=keep_last, hf_export=hf_export)

    def load_checkpoint(self, path: str | None = None, step: int | None = None) -> int:
        return self._run(LOAD_CHECKPOINT, path=path, step=step)

    def weight_norm(self) -> dict[str, float]:
        return self._run(WEIGHT_NORM)

    def log_probs(
        self, prompts: Sequence[str], completions: Sequence[str], *, temperature: float = 1.0
    ) -> list[list[float]]:
        return self._run(LOG_PROBS, prompts=prompts, completions=completions, temperature=temperature)

    def last_step_metrics(self) -> dict[str, float]:
        return self._run(LAST_STEP_METRICS)

    def describe(self) -> dict[str, Any]:
        return self._run(DESCRIBE)

    def shutdown(self) -> None:
        """Stop every engine and remove their actors and placement groups; shut Ray down if the client started it
        (over HTTP: stop the server if the client launched it). A client that attached leaves the service up."""
        if self._closed:
            return
        self._closed = True
        self._transport.close_sync()

    def __enter__(self) -> SyncArcticRLClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _drop_token_auth_notice(record: logging.LogRecord) -> bool:
    return "Token authentication is enabled for this Ray cluster" not in record.getMessage()


def _connect_ray(ray_address: str | None) -> bool:
    """Attach to Ray (``ray_address``, else ``RAY_ADDRESS`` or a new local instance); True if this call started it."""
    import os
    import time

    import ray

    from arctic_rl.progress import report

    if ray.is_initialized():
        return False
    address = ray_address or os.environ.get("RAY_ADDRESS")
    report(f"connecting to Ray at {address}" if address else "starting Ray (or attaching to this machine's)")
    # A new local instance turns token authentication on and says so on every run; the protection stays, the
    # notice goes (Ray's only other way to silence it, RAY_AUTH_MODE, must be set before ray is imported).
    token_notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    token_notice.addFilter(_drop_token_auth_notice)
    started = time.monotonic()
    try:
        ray.init(address=ray_address, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    finally:
        token_notice.removeFilter(_drop_token_auth_notice)
    report(f"Ray ready ({time.monotonic() - started:.0f} s)")
    return True


def create_arctic_rl_client(
    config: ArcticRLClientConfig,
    *,
    blocking_calls: bool = False,
    service_name: str = "arctic_rl_service",
    engine_classes: Mapping[str, str] | None = None,
    placement_overrides: Mapping[str, Any] | None = None,
) -> ArcticRLClient | SyncArcticRLClient:
    """Start (or attach to) Ray, place and start the engines, and return a client; with ``comm_protocol='http'``,
    connect to the server at ``host:port`` instead (or launch it, ``launch_local_server=True``).

    ``blocking_calls=False`` gives the async ``ArcticRLClient``; ``True`` the blocking ``SyncArcticRLClient``.
    ``service_name`` names the service actor (another process attaches with ``attach_arctic_rl_client``);
    ``engine_classes`` (``{"training": "module:Class", ...}``) and ``placement_overrides`` (``PlacementRequest``
    fields, e.g. ``cpus_per_cpu_worker``) are for tests and unusual clusters.
    """
    from arctic_rl.config import ArcticRLClientConfig
    from arctic_rl.service import start_service

    if not isinstance(config, ArcticRLClientConfig):
        raise ConfigError(f"create_arctic_rl_client takes an ArcticRLClientConfig, got {type(config).__name__}.")
    client_class = SyncArcticRLClient if blocking_calls else ArcticRLClient
    if config.comm_protocol == "http":
        from arctic_rl.http_client import connect_http

        return client_class(
            connect_http(config, engine_classes=engine_classes, placement_overrides=placement_overrides)
        )
    owns_ray = _connect_ray(config.ray_address)
    try:
        service = start_service(
            config, name=service_name, engine_classes=engine_classes, placement_overrides=placement_overrides
        )
    except BaseException:
        if owns_ray:
            import ray

            ray.shutdown()
        raise
    return client_class(RayTransport(service, owns_service=True, owns_ray=owns_ray))


def attach_arctic_rl_client(
    *, ray_address: str | None = None, service_name: str = "arctic_rl_service", blocking_calls: bool = False
) -> ArcticRLClient | SyncArcticRLClient:
    """A client on a service another process started (same Ray cluster); its ``shutdown`` leaves the service up."""
    from arctic_rl.service import attach_service

    owns_ray = _connect_ray(ray_address)
    service = attach_service(service_name)
    client_class = SyncArcticRLClient if blocking_calls else ArcticRLClient
    return client_class(RayTransport(service, owns_service=False, owns_ray=owns_ray))
