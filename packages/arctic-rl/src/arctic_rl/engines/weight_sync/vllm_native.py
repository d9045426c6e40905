"""The trainer side of every cross-process path over vLLM's own weight-transfer API (``nccl``, ``cuda_ipc``,
``gloo``), the method -> vLLM backend map, and :class:`SamplerWeightSyncClient`: the trainer-side engine drives the
samplers itself through it, so the trainer process must be able to call every sampler. ``nccl`` and ``cuda_ipc``
use vLLM's shipped engines and need CUDA (untested on CPU machines); ``gloo`` is ours (:mod:`.gloo`) and runs
anywhere."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from arctic_rl.engines.weight_sync.gloo import GLOO_BACKEND, gloo_trainer_init_info
from arctic_rl.engines.weight_sync.in_process import IN_PROCESS_BACKEND

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.base import ParamMeta, VLLMWeightSyncClient

__all__ = [
    "CrossProcessMethod",
    "SamplerCall",
    "SamplerWeightSyncClient",
    "TrainerTransfer",
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


class TrainerTransfer(Protocol):
    """The trainer side of a cross-process weight transfer, as :func:`create_trainer_transfer` returns it (vLLM's
    ``TrainerWeightTransferEngine``, or the same rounds on vLLM releases that have none for the method)."""

    def send_weights(self) -> None: ...

    def shutdown(self) -> None: ...


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
) -> TrainerTransfer:
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
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory, ipc_engine, nccl_engine

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
        if not hasattr(nccl_engine, "NCCLTrainerInitInfo"):
            raise RuntimeError(
                "weight_sync.method='nccl' needs vLLM's trainer-side NCCL engine, which this vLLM "
                f"({_vllm_version()}) does not have (vLLM 0.32 has it, 0.26 does not): upgrade vLLM, or colocate the "
                "engines on one GPU (weight_sync.method='cuda_ipc')."
            )
        init_info = nccl_engine.NCCLTrainerInitInfo(
            master_address=master_address,
            master_port=master_port,
            world_size=1 + sampler_world_size,
            packed=True,
            packed_buffer_size_bytes=bucket_bytes,
            packed_num_buffers=1 if low_memory else 2,
            rank=rank,
        )
    elif method == "cuda_ipc":
        if not hasattr(ipc_engine, "IPCTrainerInitInfo"):
            return _StaticCallIpcTransfer(
                ipc_engine, client, source, rank=rank, packed=low_memory, bucket_bytes=bucket_bytes
            )
        init_info = ipc_engine.IPCTrainerInitInfo(packed=low_memory, packed_buffer_size_bytes=bucket_bytes, rank=rank)
    else:
        raise ValueError(f"create_trainer_transfer handles 'nccl', 'cuda_ipc' and 'gloo', got {method!r}.")
    return WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown version"))


class _StaticCallIpcTransfer:
    """CUDA IPC on vLLM releases whose IPC engine has no trainer-side engine object and sends through the static
    ``IPCWeightTransferEngine.trainer_send_weights`` (vLLM 0.26, the GPU machines' build): the same rounds as later
    releases' ``IPCTrainerWeightTransferEngine`` (rank 0 drives start / update / finish on the samplers; every rank
    iterates the parameters). The tensors shared by handle are kept until the samplers finished loading, as the
    later engine does: the sampler may read them until then."""

    def __init__(
        self, ipc_engine: Any, client: VLLMWeightSyncClient, source: Any, *, rank: int, packed: bool, bucket_bytes: int
    ):
        self._engine = ipc_engine.IPCWeightTransferEngine
        self._client = client
        self._source = source
        self._is_sender = rank == 0
        self._arguments = ipc_engine.IPCTrainerSendWeightsArgs(
            send_mode=self._update, packed=packed, packed_buffer_size_bytes=bucket_bytes
        )
        if self._is_sender:
            # This release's IPC receiver takes no initialisation fields (packing is said with each update).
            client.init_weight_transfer_engine({})

    def _update(self, update_info: Any) -> None:
        self._client.update_weights(asdict(update_info))

    def send_weights(self) -> None:
        shared: list[torch.Tensor] = []

        def kept(parameters: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in parameters:
                tensor = tensor.detach().contiguous()
                shared.append(tensor)
                yield name, tensor

        if self._is_sender:
            self._client.start_weight_update()
        self._engine.trainer_send_weights(kept(self._source), self._arguments)
        if self._is_sender:
            self._client.finish_weight_update()
        shared.clear()

    def shutdown(self) -> None:
        """Nothing to release: the IPC path holds no group."""
