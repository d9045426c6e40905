"""``gloo`` weight sync: vLLM's transfer-API lifecycle over a gloo group between the trainer and the sampler workers.

The CPU (and any split-process) counterpart of vLLM's ``nccl`` engine. Rank 0 of the trainer and every sampler
worker form one gloo group with ``vllm.distributed.utils.stateless_init_torch_distributed_process_group``, which
leaves both sides' default process groups alone (the trainer's DeepSpeed group keeps working). The two halves:

- :class:`GlooTrainerWeightTransferEngine` (trainer side, registered with vLLM's ``WeightTransferTrainerFactory``
  under :data:`GLOO_BACKEND`): ``trainer_init`` opens the group as rank 0 while the samplers join it through the
  client's ``init_weight_transfer_engine`` (on a side thread: both block until the group forms). ``send_weights``
  drives ``start_weight_update``, then the samplers' ``update_weights`` on a side thread while rank 0 broadcasts the
  parameters, then ``finish_weight_update``.
- the worker engine (``WeightTransferEngineFactory``, same name): receives the broadcasts inside vLLM's layerwise
  reload, as the in-process engine does (``initialize_layerwise_reload`` -> ``model.load_weights`` per bucket ->
  ``finalize_layerwise_reload``).

Wire format: the parameters, in ``metadata()`` order, are cut into buckets of at most ``bucket_bytes`` (a larger
tensor goes alone) by :func:`bucket_spans`, which both sides run on the same metadata; a bucket travels as one flat
``uint8`` buffer, each tensor at an offset aligned to :data:`ALIGNMENT` bytes (so its bytes can be viewed in its own
dtype). One broadcast per bucket.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from arctic_rl.engines.weight_sync.buckets import _aligned, _nbytes, bucket_spans, pack_bucket, unpack_bucket
from arctic_rl.errors import EngineError

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.base import ParamMeta, VLLMWeightSyncClient, WeightSource

__all__ = ["GLOO_BACKEND", "gloo_trainer_init_info", "register_gloo_engines"]

GLOO_BACKEND = "arctic_gloo"
"""Name of our gloo engines in vLLM's ``WeightTransferEngineFactory`` and ``WeightTransferTrainerFactory``."""

# After the trainer's broadcast fails, how long to wait for the samplers' side to report its own error (a dead
# sampler is the usual cause, and naming it is more useful than gloo's "connection reset").
_PEER_ERROR_GRACE_S = 10.0

_register_lock = threading.Lock()


class _BroadcastFailed(Exception):
    """The group failed under a broadcast (its cause); a sampler's own error may explain it better."""


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    # The stateless group is not registered with torch.distributed, whose broadcast() maps global ranks; the
    # ProcessGroup's own broadcast takes the root's rank inside the group.
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    group.broadcast([tensor], options).wait()


def _open_group(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        address, port, rank, world_size, "gloo", timeout=timedelta(seconds=timeout_s)
    )


def _close_group(group: Any) -> None:
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    stateless_destroy_torch_distributed_process_group(group)


def _is_timeout(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {error}".lower()
    return "timeout" in text or "timed out" in text


@dataclass
class GlooWorkerInitInfo:
    """What a sampler worker needs to join the group (sent through ``init_weight_transfer_engine``)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float


@dataclass
class GlooUpdateInfo:
    """One round: the full parameter list (the receiver cuts the same buckets from it)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must have one entry per parameter, got {len(self.names)}, "
                f"{len(self.dtype_names)} and {len(self.shapes)}."
            )


def _worker_engine_class() -> type[Any]:
    """Build the worker-side engine class (vLLM imported here, never at module import)."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.platforms import current_platform

    from arctic_rl.engines.weight_sync.in_process import _repack_cpu_embedding_gemms

    @dataclass
    class InitInfo(GlooWorkerInitInfo, WeightTransferInitInfo):
        pass

    @dataclass
    class UpdateInfo(GlooUpdateInfo, WeightTransferUpdateInfo):
        pass

    class GlooWeightTransferEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
        """Receives the trainer's gloo broadcasts and loads them inside vLLM's layerwise reload."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.group: Any = None

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            if self.group is not None:
                raise RuntimeError("the gloo weight-transfer group is already open; shut it down before a new one.")
            rank = init_info.rank_offset + self.parallel_config.rank
            self.group = _open_group(
                init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
            )

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class synchronizes an accelerator after each chunk; the broadcasts land in CPU memory and
            # load_weights copies synchronously.
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info: UpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("gloo weight transfer not initialised; call init_weight_transfer_engine first.")
            dtypes = [getattr(torch, name) for name in update_info.dtype_names]
            sizes = [_nbytes(shape, dtype) for shape, dtype in zip(update_info.shapes, dtypes, strict=True)]
            for start, stop in bucket_spans(sizes, update_info.bucket_bytes):
                # A fresh buffer per bucket: the layerwise reload may hold the loaded views until a layer completes.
                buffer = torch.empty(sum(_aligned(size) for size in sizes[start:stop]), dtype=torch.uint8)
                _broadcast(self.group, buffer)
                tensors = unpack_bucket(buffer, update_info.shapes[start:stop], dtypes[start:stop])
                self.model.load_weights(list(zip(update_info.names[start:stop], tensors, strict=True)))

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)
            if current_platform.is_cpu():
                _repack_cpu_embedding_gemms(self.model)

        def shutdown(self) -> None:
            group, self.group = self.group, None
            if group is not None:
                _close_group(group)

    return GlooWeightTransferEngine


def _trainer_engine_class() -> type[Any]:
    """Build the trainer-side engine class (vLLM imported here, never at module import)."""
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

    @dataclass
    class GlooTrainerInitInfo(TrainerInitInfo):
        """Rendezvous of the group (trainer rank 0 hosts it) and the round's bucket size."""

        backend: ClassVar[str] = GLOO_BACKEND

        master_address: str
        master_port: int
        world_size: int
        bucket_bytes: int
        timeout_s: float

    class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
        """Trainer side: rank 0 broadcasts; every rank iterates the source (ZeRO-3 gathers are collective)."""

        init_info_cls = GlooTrainerInitInfo

        def __init__(self, *, init_info: GlooTrainerInitInfo, client: VLLMWeightSyncClient, source: WeightSource):
            super().__init__(client=client, source=source, is_sender=init_info.is_sender)
            self.init_info = init_info
            self.group: Any = None

        @classmethod
        def trainer_init(
            cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
        ) -> GlooTrainerWeightTransferEngine:
            if source is None:
                raise ValueError("the gloo trainer weight transfer needs a WeightSource.")
            engine = cls(init_info=init_info, client=client, source=source)
            if engine.is_sender:
                engine._rendezvous()
            return engine

        def _rendezvous(self) -> None:
            info = self.init_info
            worker_info = GlooWorkerInitInfo(
                master_address=info.master_address,
                master_port=info.master_port,
                rank_offset=1,
                world_size=info.world_size,
                timeout_s=info.timeout_s,
            )
            # The samplers block inside init_weight_transfer_engine until the group forms, and so does this rank
            # while it opens the group: their join runs on a side thread.
            executor = ThreadPoolExecutor(max_workers=1)
            joined = executor.submit(self.client.init_weight_transfer_engine, asdict(worker_info))
            try:
                self.group = _open_group(info.master_address, info.master_port, 0, info.world_size, info.timeout_s)
            except Exception as error:
                peer = _peer_error(joined, 0.0)
                if peer is not None:
                    raise peer from error
                if _is_timeout(error):
                    raise EngineError(
                        "sampling",
                        f"the sampler workers ({info.world_size - 1}) did not all join the gloo weight-transfer group "
                        f"that trainer rank 0 hosts at {info.master_address}:{info.master_port} within "
                        f"{info.timeout_s:.0f} s (the trainer did join); a sampler that is busy, dead or cannot reach "
                        "that address stalls it. Check the samplers' logs, or raise weight_sync.timeout_s.",
                    ) from error
                raise
            finally:
                executor.shutdown(wait=False)
            joined.result()

        def send_weights(self) -> None:
            assert self.source is not None
            meta = self.source.metadata()
            if not self.is_sender:
                # Only the collective gathers of the other ranks' parameters.
                for _ in self.source:
                    pass
                return
            update = GlooUpdateInfo(
                names=[m.name for m in meta],
                dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                shapes=[list(m.shape) for m in meta],
                bucket_bytes=self.init_info.bucket_bytes,
            )
            self.client.start_weight_update()
            executor = ThreadPoolExecutor(max_workers=1)
            received = executor.submit(self.client.update_weights, asdict(update))
            try:
                self._broadcast_all(self.source, meta)
            except _BroadcastFailed as failure:
                # Never wait on the samplers unboundedly here: a sampler stuck in a broadcast never returns.
                peer = _peer_error(received, _PEER_ERROR_GRACE_S)
                raise (peer or failure.__cause__ or failure) from failure.__cause__
            finally:
                executor.shutdown(wait=False)
            received.result()
            self.client.finish_weight_update()

        def _broadcast_all(self, source: Iterable[tuple[str, torch.Tensor]], meta: Sequence[ParamMeta]) -> None:
            spans = bucket_spans([_nbytes(m.shape, m.dtype) for m in meta], self.init_info.bucket_bytes)
            pairs = _checked(source, meta)
            for start, stop in spans:
                tensors = []
                for index in range(start, stop):
                    pair = next(pairs, None)
                    if pair is None:
                        raise ValueError(
                            f"the weight source yielded {index} parameters but its metadata declared {len(meta)}; the "
                            "samplers wait for the rest."
                        )
                    tensors.append(pair[1])
                try:
                    _broadcast(self.group, pack_bucket(tensors))
                except Exception as error:
                    raise _BroadcastFailed() from error
            for name, _ in pairs:
                raise ValueError(f"the weight source yielded {name!r} after the {len(meta)} parameters it declared.")

        def shutdown(self) -> None:
            group, self.group = self.group, None
            if group is not None:
                _close_group(group)

    return GlooTrainerWeightTransferEngine


def _checked(
    source: Iterable[tuple[str, torch.Tensor]], meta: Sequence[ParamMeta]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's pairs, each checked against what the samplers were told (they size their buffers from it)."""
    for index, (name, tensor) in enumerate(source):
        if index >= len(meta):
            yield name, tensor
            return
        expected = meta[index]
        if name != expected.name or tensor.dtype != expected.dtype or tuple(tensor.shape) != tuple(expected.shape):
            raise ValueError(
                f"parameter {index} is {name!r} {tensor.dtype} {tuple(tensor.shape)} but the metadata declared "
                f"{expected.name!r} {expected.dtype} {tuple(expected.shape)}; iteration and metadata must agree."
            )
        yield name, tensor


def _peer_error(future: Future[Any], wait_s: float) -> BaseException | None:
    """The exception the samplers' side raised, if it finishes within ``wait_s`` with one."""
    try:
        future.result(timeout=wait_s)
    except FutureTimeoutError:
        return None
    except BaseException as error:
        return error
    return None


def register_gloo_engines() -> None:
    """Register :data:`GLOO_BACKEND` with vLLM's worker and trainer factories (idempotent)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    with _register_lock:
        if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(GLOO_BACKEND, _worker_engine_class())
        if GLOO_BACKEND not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(GLOO_BACKEND, _trainer_engine_class())


def gloo_trainer_init_info(
    *, master_address: str, master_port: int, world_size: int, bucket_bytes: int, timeout_s: float, rank: int
) -> Any:
    """The trainer-side init info of :data:`GLOO_BACKEND` for ``WeightTransferTrainerFactory.trainer_init`` (the
    engines are registered first). ``world_size`` counts trainer rank 0 and every sampler worker."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    register_gloo_engines()
    engine_class = WeightTransferTrainerFactory._registry[GLOO_BACKEND]()
    return engine_class.init_info_cls(
        master_address=master_address,
        master_port=master_port,
        world_size=world_size,
        bucket_bytes=bucket_bytes,
        timeout_s=timeout_s,
        rank=rank,
    )
