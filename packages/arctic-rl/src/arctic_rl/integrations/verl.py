"""verl plugin: an Arctic training engine and rollout replica, both backed by the arctic-rl thin client.

Load it in verl's environment with ``VERL_USE_EXTERNAL_MODULES=arctic_rl.integrations.verl`` (verl imports it at
``import verl``); it registers

- ``ArcticTrainingEngine`` with verl's ``EngineRegistry`` as ``model_type='language_model'``, ``backend='arctic'``
  (verl's ``actor.strategy=arctic``): log-probs through the client's ``fwd_no_grad``, the policy update through
  ``fwd_bwd`` + ``step``, weight sync through ``sync_weights``, offload through ``sleep_training`` / ``wake_training``,
  checkpoints through ``save_checkpoint`` / ``load_checkpoint``;
- ``ArcticRolloutReplica`` with verl's ``RolloutReplicaRegistry`` as ``'arctic'`` (``rollout.name=arctic``): a Ray
  actor that answers verl's token-in/token-out ``generate`` through the client's ``generate``.

It also registers ``arctic_rl.integrations.verl_weights.ArcticRollout`` as verl's in-process rollout for
``rollout.name=arctic`` and the ``arctic_cpu`` platform (:mod:`arctic_rl.integrations.verl_platform`); verl's
``main_ppo`` trainer additionally takes ``actor_rollout_ref.rollout.checkpoint_manager_class=``
``arctic_rl.integrations.verl_weights.ArcticCheckpointEngineManager`` (see the package README).

The engines run in their own environment (``arctic-rl-serve``, or a Ray service): verl pins transformers<5.11,
which they cannot use. Every verl process connects its own client, configured by the ``ARCTIC_RL_*`` environment
variables (:class:`~arctic_rl.integrations.verl_mapping.ArcticConnection`). Tested with verl 0.9.1.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

try:
    # Before verl's engine modules: they resolve verl's platform at import, and VERL_PLATFORM may name this one.
    from arctic_rl.integrations.verl_platform import register_platform

    register_platform()
    from omegaconf import DictConfig
    from verl.utils.tensordict_utils import get_non_tensor_data
    from verl.workers.engine import BaseEngine, EngineRegistry
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput
except ImportError as error:
    raise ImportError(
        f"arctic_rl.integrations.verl is a plugin for verl and needs it ({error}); install it in the RL framework's "
        "environment beside the thin client: `pip install verl==0.9.1 arctic-rl` (arctic-rl without extras: the "
        "engines run in their own environment, started with `arctic-rl-serve`)."
    ) from error

from arctic_rl.client import SyncArcticRLClient
from arctic_rl.errors import EngineStateError
from arctic_rl.integrations.verl_mapping import (
    ArcticConnection,
    ppo_processing,
    to_client_batch,
    to_client_sampling_params,
    to_verl_token_values,
)

__all__ = ["BACKEND", "ArcticRolloutReplica", "ArcticRolloutServer", "ArcticTrainingEngine", "register"]

# The name verl's configs use for both: actor.strategy=arctic, rollout.name=arctic.
BACKEND = "arctic"
# verl picks a training engine by the device its worker runs on; the engine itself is remote, so any will do.
_DEVICES = ["cuda", "npu", "cpu"]


def _field(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping | DictConfig):
        return config.get(name, default)
    return getattr(config, name, default)


class ArcticTrainingEngine(BaseEngine):  # type: ignore[misc]
    """verl's training-engine interface over a remote arctic-rl trainer (one client per verl worker).

    The remote service does its own data parallelism, so verl sees one rank (``get_data_parallel_size() == 1``);
    run verl's actor with one worker. An engine whose ``engine_config.forward_only`` is set (verl's reference
    policy) answers from the server's reference engine (``fwd_no_grad(reference_model=True)``, which needs
    ``log_prob_gpus >= 1`` on the server).
    """

    def __init__(
        self,
        model_config: Any,
        engine_config: Any,
        optimizer_config: Any = None,
        checkpoint_config: Any = None,
        *,
        connection: ArcticConnection | None = None,
    ) -> None:
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.connection = connection or ArcticConnection.from_environment()
        self.mode: str | None = None
        self._client: SyncArcticRLClient | None = None
        self._gradients_pending = False
        self._last_lr: float | None = None

    @property
    def client(self) -> SyncArcticRLClient:
        if self._client is None:
            raise EngineStateError("the Arctic engine is not connected yet; verl calls initialize() first.")
        return self._client

    @property
    def reference(self) -> bool:
        return bool(_field(self.engine_config, "forward_only", False))

    def initialize(self) -> None:
        """Connect to the running engines (verl's ``reset``); the model, optimizer and schedule live there."""
        if self._client is None:
            self._client = self.connection.connect(str(_field(self.model_config, "path", "")) or BACKEND)

    @property
    def is_param_offload_enabled(self) -> bool:
        # The server owns device memory; verl's automatic offload around each call must not move anything.
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    @contextmanager
    def _mode(self, mode: str) -> Iterator[None]:
        self.mode = mode
        try:
            yield
        finally:
            self.mode = None

    def train_mode(self, **kwargs: Any) -> Any:
        return self._mode("train")

    def eval_mode(self, **kwargs: Any) -> Any:
        return self._mode("eval")

    def optimizer_zero_grad(self) -> None:
        """The server clears gradients at every ``step()``; gradients accumulated since then cannot be dropped."""
        if self._gradients_pending:
            raise NotImplementedError(
                "the arctic-rl trainer cannot discard gradients accumulated by fwd_bwd; call optimizer_step() "
                "(the client's step()) to apply them, or load_checkpoint() to start over."
            )

    def optimizer_step(self) -> float:
        """The client's ``step()``: apply the accumulated gradients; returns the gradient norm before clipping."""
        result = self.client.step()
        self._gradients_pending = False
        self._last_lr = float(result["lr"])
        return float(result["grad_norm"])

    def lr_scheduler_step(self) -> float:
        """The server's schedule advances inside ``step()``; returns the learning rate that step used."""
        if self._last_lr is None:
            raise EngineStateError("lr_scheduler_step() before any optimizer_step(): no learning rate to report.")
        return self._last_lr

    def _processing(self, loss_function: Callable[..., Any] | None) -> dict[str, Any]:
        function = loss_function.func if isinstance(loss_function, functools.partial) else loss_function
        if function is None or getattr(function, "__name__", "") != "ppo_loss":
            raise NotImplementedError(
                f"the arctic-rl trainer evaluates its loss remotely and maps only verl's ppo_loss onto it, got "
                f"{getattr(function, '__name__', function)!r}; register the loss on the server "
                "(arctic_rl.losses.register_loss_fn) and call the client's fwd_bwd(batch, processing={'loss_fn': "
                "name}) directly."
            )
        assert isinstance(loss_function, functools.partial)
        return ppo_processing(loss_function.keywords["config"])

    def forward_backward_batch(
        self, data: Any, loss_function: Callable[..., Any] | None, forward_only: bool = False
    ) -> dict[str, Any]:
        """``forward_only``: the client's ``fwd_no_grad`` (log-probs, and entropy when verl's batch asks for it).
        Else the client's ``fwd_bwd`` with verl's PPO settings mapped onto arctic-rl's loss (gradients accumulate
        on the server until ``optimizer_step``). Returns verl's ``{"model_output", "loss", "metrics"}``."""
        # verl scales the logits by the rollout temperature: the trainer scores at the same one.
        temperature = float(get_non_tensor_data(data, "temperature", 1.0))
        if forward_only:
            if loss_function is not None:
                raise NotImplementedError(
                    "a loss on a forward-only pass needs the logits locally; the arctic-rl trainer returns "
                    "log-probs only: call infer_batch with compute_loss=False."
                )
            batch = to_client_batch(data, training=False)
            calculate_entropy = bool(get_non_tensor_data(data, "calculate_entropy", False))
            output = self.client.fwd_no_grad(
                batch, reference_model=self.reference, calculate_entropy=calculate_entropy, temperature=temperature
            )
            model_output = {"log_probs": to_verl_token_values(output["logprobs"], data)}
            if calculate_entropy:
                model_output["entropy"] = to_verl_token_values(output["entropy"], data)
            return {"model_output": model_output, "loss": [], "metrics": {}}
        processing = self._processing(loss_function)
        reply = self.client.fwd_bwd(
            to_client_batch(data, training=True), processing=processing, temperature=temperature
        )
        self._gradients_pending = True
        return {"model_output": {}, "loss": [float(reply["loss"])], "metrics": dict(reply["metrics"])}

    def sync_weights(self) -> dict[str, float]:
        """Push the trainer's weights to the server's samplers (the client's ``sync_weights``)."""
        return self.client.sync_weights()

    def _weights_stay_remote(self, method: str) -> NotImplementedError:
        return NotImplementedError(
            f"{method}: the weights stay in the arctic-rl server and are never exported to verl's process; sync them "
            "to the samplers with ArcticTrainingEngine.sync_weights() (the client's sync_weights()); in verl's "
            "trainer set actor_rollout_ref.rollout.checkpoint_manager_class="
            "arctic_rl.integrations.verl_weights.ArcticCheckpointEngineManager and rollout.name=arctic."
        )

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Generator[Any, None, None], dict[str, Any] | None]:
        raise self._weights_stay_remote("get_per_tensor_param")

    def get_per_tensor_param_shard(self, **kwargs: Any) -> tuple[Generator[Any, None, None], dict[str, Any] | None]:
        raise self._weights_stay_remote("get_per_tensor_param_shard")

    def get_per_tensor_param_delta_shard(
        self, **kwargs: Any
    ) -> tuple[Generator[Any, None, None], dict[str, Any] | None]:
        raise self._weights_stay_remote("get_per_tensor_param_delta_shard")

    def prime_delta_snapshots(self) -> None:
        raise self._weights_stay_remote("prime_delta_snapshots")

    def get_data_parallel_size(self) -> int:
        return 1

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_group(self) -> None:
        return None

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Offload (``device='cpu'``): the client's ``sleep_training`` (``'all'``, ``'weights'`` or
        ``'optimizer'`` after ``model`` / ``optimizer``); any other device: ``wake_training``."""
        if not (model or optimizer):
            return
        if device == "cpu":
            self.client.sleep_training("all" if model and optimizer else "weights" if model else "optimizer")
        else:
            self.client.wake_training()

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        **kwargs: Any,
    ) -> None:
        """The client's ``save_checkpoint(local_path, global_step, keep_last=max_ckpt_to_keep)``: the path is on
        the server's machine."""
        if hdfs_path is not None:
            raise NotImplementedError("arctic-rl saves on the server's file system; copy it to HDFS from there.")
        self.client.save_checkpoint(local_path, global_step, keep_last=max_ckpt_to_keep)

    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True, **kwargs: Any
    ) -> None:
        """The client's ``load_checkpoint(local_path)`` (the newest step there), on the server's machine."""
        if hdfs_path is not None or del_local_after_load:
            raise NotImplementedError(
                "arctic-rl loads checkpoints from the server's file system and never deletes them; pass "
                "hdfs_path=None and del_local_after_load=False (verl's TrainingWorker does)."
            )
        self.client.load_checkpoint(local_path)

    def disable_adapter(self) -> Any:
        raise NotImplementedError(
            "arctic-rl's engines train full weights (no LoRA adapter to disable); use the server's reference "
            "engine (log_prob_gpus >= 1) for reference log-probs."
        )


class ArcticRolloutServer:
    """The Ray actor behind ``ArcticRolloutReplica.server_handle``: verl's rollout-server calls over the client."""

    def __init__(
        self, connection: ArcticConnection, model_name: str, max_prompt_length: int, max_response_length: int
    ) -> None:
        self._client = connection.connect(model_name)
        self._max_prompt_length = max_prompt_length
        self._max_response_length = max_response_length
        self._in_flight = 0

    def _generate(self, prompt_ids: list[int], sampling_params: Mapping[str, Any]) -> TokenOutput:
        params, wants_log_probs = to_client_sampling_params(
            sampling_params,
            prompt_length=len(prompt_ids),
            max_prompt_length=self._max_prompt_length,
            max_response_length=self._max_response_length,
        )
        (sample,) = self._client.generate([list(prompt_ids)], params)[0]
        return TokenOutput(
            token_ids=list(sample["token_ids"]),
            log_probs=list(sample["logprobs"]) if wants_log_probs else None,
            stop_reason="completed",
        )

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """One sample of ``prompt_ids`` (the client's ``generate`` with ``n=1``); verl's request id is unused."""
        media = [name for name, value in (("image_data", image_data), ("video_data", video_data)) if value is not None]
        if media or kwargs:
            raise NotImplementedError(
                "the arctic-rl sampler takes text token ids and vLLM sampling parameters only, got "
                f"{[*media, *sorted(kwargs)]}."
            )
        # The blocking client runs in a thread so this async actor keeps taking verl's concurrent requests.
        self._in_flight += 1
        try:
            return await asyncio.to_thread(self._generate, prompt_ids, sampling_params)
        finally:
            self._in_flight -= 1

    async def wake_up(self) -> None:
        await asyncio.to_thread(self._client.wake_inference)

    async def sleep(self) -> None:
        await asyncio.to_thread(self._client.sleep_inference, 1)

    async def clear_kv_cache(self) -> None:
        await asyncio.to_thread(self._client.reset_prefix_cache)

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Nothing to abort when no ``generate`` is in flight (verl's synchronous trainer calls this between steps);
        a running request cannot be cut short, so that case is refused."""
        if self._in_flight:
            raise NotImplementedError(
                f"the arctic-rl sampler runs every generate() to completion and cannot abort the {self._in_flight} "
                "in flight (partial rollouts); use verl's synchronous trainer with rollout.name=arctic."
            )

    async def resume_generation(self) -> None:
        """Generation is never paused (``abort_all_requests`` only succeeds with nothing in flight)."""

    async def release_kv_cache(self) -> None:
        """The sampler's KV cache is freed by putting it to sleep (the client's ``sleep_inference(1)``)."""
        await asyncio.to_thread(self._client.sleep_inference, 1)

    async def resume_kv_cache(self) -> None:
        await asyncio.to_thread(self._client.wake_inference)

    async def start_profile(self, **kwargs: Any) -> None:
        raise NotImplementedError("profile the arctic-rl server's engines in their own process.")

    async def stop_profile(self) -> None:
        raise NotImplementedError("profile the arctic-rl server's engines in their own process.")

    def shutdown(self) -> None:
        """Close this actor's client (the engines keep running)."""
        self._client.shutdown()


class ArcticRolloutReplica(RolloutReplica):  # type: ignore[misc]
    """verl's rollout replica over the arctic-rl sampler: no GPU of verl's is used, whatever the rollout mode."""

    def __init__(self, *args: Any, connection: ArcticConnection | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection = connection or ArcticConnection.from_environment()

    async def init_hybrid(self, worker_group: Any) -> None:
        self.rollout_mode = RolloutMode.HYBRID
        await self.launch_servers()

    async def init_hybrid_colocated(self, worker_group: Any, resource_pool: Any) -> None:
        self.rollout_mode = RolloutMode.HYBRID
        await self.launch_servers()

    async def init_colocated(self, resource_pool: Any) -> None:
        self.rollout_mode = RolloutMode.COLOCATED
        await self.launch_servers()

    async def init_standalone(self) -> None:
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        """Start this replica's client actor (no GPU, no CPU slot: it only forwards requests)."""
        import ray

        server_class = ray.remote(num_cpus=0)(ArcticRolloutServer)
        server = server_class.options(
            name=f"arctic_rollout_server_{self.replica_rank}{self.name_suffix}", max_concurrency=self.max_concurrency
        ).remote(
            self.connection,
            str(_field(self.model_config, "path", "")) or BACKEND,
            int(self.config.prompt_length),
            int(self.config.response_length),
        )
        self.servers = [server]
        self._server_handle = server
        where = (
            f"http://{self.connection.host}:{self.connection.port}"
            if self.connection.protocol == "http"
            else f"ray://{self.connection.service_name}"
        )
        self._server_address = f"{where}#replica-{self.replica_rank}{self.name_suffix}"


def register() -> None:
    """Register the engine and the replica with verl (done on import; idempotent)."""
    backends = EngineRegistry._engines.get("language_model", {})
    if BACKEND not in backends:
        EngineRegistry.register(model_type="language_model", backend=BACKEND, device=_DEVICES)(ArcticTrainingEngine)
    RolloutReplicaRegistry.register(BACKEND, lambda: ArcticRolloutReplica)
    # verl's hybrid worker builds an in-process rollout by (name, mode), imported by dotted path when first used.
    _ROLLOUT_REGISTRY[(BACKEND, "async")] = "arctic_rl.integrations.verl_weights.ArcticRollout"
    register_platform()


register()
