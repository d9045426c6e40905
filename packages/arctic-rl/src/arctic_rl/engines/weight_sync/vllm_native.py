"""The trainer side of every cross-process path over vLLM's own weight-transfer API (``nccl``, ``cuda_ipc``,
``gloo``), the method -> vLLM backend map, and :class:`SamplerWeightSyncClient`: the trainer-side engine drives the
samplers itself through it, so the trainer process must be able to call every sampler. ``nccl`` and ``cuda_ipc``
use vLLM's shipped engines and need CUDA (untested on CPU machines); ``gloo`` is ours (:mod:`.gloo`) and runs
anywhere."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from arctic_rl.engines.weight_sync.gloo import GLOO_BACKEND, gloo_trainer_init_info
from arctic_rl.engines.weight_sync.in_process import IN_PROCESS_BACKEND

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.base import ParamMeta, TrainerWeightTransferEngine, VLLMWeightSyncClient

__all__ = [
    "CrossProcessMethod",
    "SamplerCall",
    "SamplerWeightSyncClient",
    "TransferMethod",
    "create_trainer_transfer",
    "vllm_transfer_backend",
]

TransferMethod = Literal["nccl", "cuda_ipc", "object_store", "gloo"]
CrossProcessMethod = Literal["nccl", "cuda_ipc", "gloo"]

_VLLM_BACKENDS: dict[str, str] = {
    "nccl": "nccl",
    "cuda_ipc": "ipc",
    "object_store": IN_PROCESS_BACKEND,
    "gloo": GLOO_BACKEND,
}


def vllm_transfer_backend(method: TransferMethod) -> str:
    """The ``weight_transfer_config["backend"]`` vLLM needs for a resolved ``WeightSyncConfig.method``."""
    try:
        return _VLLM_BACKENDS[method]
    except KeyError:
        raise ValueError(
            f"weight_sync.method must be one of {sorted(_VLLM_BACKENDS)} once resolved, got {method!r}; "
            "resolve 'auto' with ArcticRLClientConfig.resolved_weight_sync()."
        ) from None


SamplerCall = Callable[[str, tuple[Any, ...]], None]
"""``call(method_name, args)``: invoke ``SamplingEngine.<method_name>(*args)`` on every sampler replica and wait."""


class SamplerWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over our sampling engines (local objects or Ray actors).

    ``call`` fans a method out to every replica (the cluster layer implements it with ``ray.get``). The four protocol
    methods map onto ``SamplingEngine.transfer_init`` / ``transfer_start`` / ``transfer_update`` /
    ``transfer_finish``.
    """

    def __init__(self, call: SamplerCall) -> None:
        self._call = call

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("transfer_init", (init_info,))

    def start_weight_update(self) -> None:
        self._call("transfer_start", ())

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._call("transfer_update", (update_info,))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("transfer_finish", ())


def _parameter_stream_source(
    parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]], metadata: Sequence[ParamMeta]
) -> Any:
    from vllm.distributed.weight_transfer.base import WeightSource

    class ParameterStreamSource(WeightSource):
        """A re-iterable ``WeightSource`` over a function that yields the full parameters in a fixed order.

        ``parameters`` is called once per sync (e.g. ``TrainingEngine.iter_full_parameters``; with ZeRO-3 it gathers
        collectively, so every trainer rank iterates it); ``metadata`` declares the same names, dtypes and shapes
        without gathering.
        """

        def metadata(self) -> list[ParamMeta]:
            return list(metadata)

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(parameters())

    return ParameterStreamSource()


def create_trainer_transfer(
    method: CrossProcessMethod,
    *,
    client: VLLMWeightSyncClient,
    parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    metadata: Sequence[ParamMeta],
    rank: int,
    bucket_mb: int,
    low_memory: bool,
    master_address: str | None = None,
    master_port: int | None = None,
    sampler_world_size: int | None = None,
    timeout_s: float = 300.0,
) -> TrainerWeightTransferEngine[Any]:
    """Build (and rendezvous) vLLM's trainer-side engine for ``method``; call ``.send_weights()`` once per sync.

    Call on every trainer rank (rank 0 sends; the others only join the collective gathers of ``parameters``).

    - ``nccl``: one NCCL group of the sending trainer rank (rank 0) plus every sampler worker
      (``sampler_world_size`` = replicas x tensor-parallel size), at ``master_address:master_port``; packed
      ``bucket_mb`` buffers, double-buffered unless ``low_memory``.
    - ``cuda_ipc``: colocated; without ``low_memory`` each parameter is shared by IPC handle in one round (the
      sampler loads straight from the trainer's memory); with ``low_memory`` the parameters stream through one
      ``bucket_mb`` staging buffer, one bucket per round.
    - ``gloo``: like ``nccl`` (same rendezvous arguments) over a gloo group, one broadcast per ``bucket_mb`` bucket;
      the group waits ``timeout_s`` for its members at the rendezvous and for every broadcast.
    """
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    bucket_bytes = bucket_mb * 1024 * 1024
    source = _parameter_stream_source(parameters, metadata)
    init_info: Any
    rendezvous = (master_address, master_port, sampler_world_size)
    if method in ("nccl", "gloo") and None in rendezvous:
        raise ValueError(
            f"{method} weight transfer needs master_address, master_port and sampler_world_size (sampler replicas "
            f"x tensor_parallel_size), got {master_address!r}, {master_port!r}, {sampler_world_size!r}."
        )
    if method == "gloo":
        assert master_address is not None and master_port is not None and sampler_world_size is not None
        init_info = gloo_trainer_init_info(
            master_address=master_address,
            master_port=master_port,
            world_size=1 + sampler_world_size,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            rank=rank,
        )
    elif method == "nccl":
        assert master_address is not None and master_port is not None and sampler_world_size is not None
        init_info = NCCLTrainerInitInfo(
            master_address=master_address,
            master_port=master_port,
            world_size=1 + sampler_world_size,
            packed=True,
            packed_buffer_size_bytes=bucket_bytes,
            packed_num_buffers=1 if low_memory else 2,
            rank=rank,
        )
    elif method == "cuda_ipc":
        init_info = IPCTrainerInitInfo(packed=low_memory, packed_buffer_size_bytes=bucket_bytes, rank=rank)
    else:
        raise ValueError(f"create_trainer_transfer handles 'nccl', 'cuda_ipc' and 'gloo', got {method!r}.")
    return WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)
