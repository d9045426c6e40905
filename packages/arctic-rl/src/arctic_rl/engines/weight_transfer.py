"""Trainer -> vLLM weight transfer through vLLM's own RL weight-transfer API.

vLLM (0.32+) exposes ``LLM.init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``; a worker-side ``WeightTransferEngine`` chosen by the engine argument
``weight_transfer_config={"backend": ...}`` receives the weights, and a trainer-side ``TrainerWeightTransferEngine``
sends them. Four methods (``WeightSyncConfig.method``) map onto it:

- ``object_store`` (the CPU, and any single-process sampler): our :class:`InProcessWeightTransferEngine`, registered
  under :data:`IN_PROCESS_BACKEND` with ``WeightTransferEngineFactory.register_engine``. The sampler runs vLLM
  in-process with the ``uni`` executor, so ``collective_rpc`` hands the worker the very tensor objects the caller
  passed (from the Ray object store when the sampler is an actor): no copy, no pickling. vLLM's shipped engines (nccl,
  ipc, ...) all assume CUDA, which is why the CPU needs an engine of its own; it loads through the same layerwise
  reload lifecycle as vLLM's ipc/nccl engines (``initialize_layerwise_reload`` -> ``model.load_weights`` ->
  ``finalize_layerwise_reload``), the one path that restores the CPU build's packed GEMM weights (a bare
  ``model.load_weights`` fails there: the packed parameters have lost their ``weight_loader``).
- ``nccl`` (split GPUs) and ``cuda_ipc`` (colocated GPUs): vLLM's own ``nccl`` and ``ipc`` engines on the sampler;
  :func:`create_trainer_transfer` builds the matching trainer-side engine over a :class:`ParameterStreamSource`,
  bucketed by ``weight_sync.bucket_mb`` (``low_memory`` streams one bucket at a time). These run only on CUDA and are
  not exercised by the CPU tests.
- ``gloo`` (the CPU, or any trainer and sampler in separate processes): our gloo engines
  (:mod:`arctic_rl.engines.gloo_transfer`), registered under :data:`GLOO_BACKEND` on both factories; the same
  cross-process lifecycle as ``nccl`` (a rendezvous, then broadcasts from trainer rank 0), over gloo.

Across processes (``nccl``, ``cuda_ipc``, ``gloo``) the trainer-side engine drives the samplers itself through a
``VLLMWeightSyncClient`` (:class:`SamplerWeightSyncClient`): the trainer process must be able to call every sampler.

Weights always travel in Hugging Face names and layouts (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``,
no ``lm_head`` when embeddings are tied); vLLM's ``load_weights`` fuses them. A fused vLLM parameter must receive all
its parts in one update (``q``, ``k`` and ``v`` together): the layerwise reload rebuilds a layer from what the update
delivered, so a lone ``q_proj`` would leave ``k``/``v`` undefined. Send the full model each sync.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from arctic_rl.engines.gloo_transfer import GLOO_BACKEND, gloo_trainer_init_info

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.base import ParamMeta, TrainerWeightTransferEngine, VLLMWeightSyncClient

__all__ = [
    "GLOO_BACKEND",
    "IN_PROCESS_BACKEND",
    "SamplerCall",
    "SamplerWeightSyncClient",
    "bucket_named_tensors",
    "create_trainer_transfer",
    "register_in_process_engine",
    "vllm_transfer_backend",
    "worker_sum_of_squares",
]

IN_PROCESS_BACKEND = "arctic_in_process"
"""Name of our CPU / in-process worker engine in vLLM's ``WeightTransferEngineFactory``."""

TransferMethod = Literal["nccl", "cuda_ipc", "object_store", "gloo"]
CrossProcessMethod = Literal["nccl", "cuda_ipc", "gloo"]

_VLLM_BACKENDS: dict[str, str] = {
    "nccl": "nccl",
    "cuda_ipc": "ipc",
    "object_store": IN_PROCESS_BACKEND,
    "gloo": GLOO_BACKEND,
}

_register_lock = threading.Lock()


def vllm_transfer_backend(method: TransferMethod) -> str:
    """The ``weight_transfer_config["backend"]`` vLLM needs for a resolved ``WeightSyncConfig.method``."""
    try:
        return _VLLM_BACKENDS[method]
    except KeyError:
        raise ValueError(
            f"weight_sync.method must be one of {sorted(_VLLM_BACKENDS)} once resolved, got {method!r}; "
            "resolve 'auto' with ArcticRLClientConfig.resolved_weight_sync()."
        ) from None


def bucket_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of ``(name, tensor)`` into lists of at most ``bucket_bytes`` (a larger tensor goes alone).

    Lazy: a generator that gathers parameters one by one (ZeRO-3) is consumed one bucket at a time.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"weights must be (str, torch.Tensor) pairs, got ({type(name).__name__}, {type(tensor).__name__}); "
                "pass e.g. model.named_parameters() or TrainingEngine.iter_full_parameters()."
            )
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += nbytes
    if bucket:
        yield bucket


def _in_process_engine_class() -> type[Any]:
    """Build the worker-side engine class (vLLM imported here, never at module import)."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.platforms import current_platform

    @dataclass
    class InProcessInitInfo(WeightTransferInitInfo):
        """No rendezvous: the trainer's tensors arrive as call arguments."""

    @dataclass
    class InProcessUpdateInfo(WeightTransferUpdateInfo):
        """One bucket of ``(Hugging Face name, tensor)`` pairs, passed by reference."""

        named_tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    class InProcessWeightTransferEngine(WeightTransferEngine[InProcessInitInfo, InProcessUpdateInfo]):
        """Loads tensors handed over in-process, inside vLLM's layerwise reload (see the module docstring)."""

        init_info_cls = InProcessInitInfo
        update_info_cls = InProcessUpdateInfo

        def init_transfer_engine(self, init_info: InProcessInitInfo) -> None:
            return None

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class synchronizes an accelerator after each chunk; CPU copies are already complete.
            self.receive_weights(self.parse_update_info(update_info))
            if torch.cuda.is_available() and not current_platform.is_cpu():
                torch.cuda.synchronize()

        def receive_weights(self, update_info: InProcessUpdateInfo) -> None:
            self.model.load_weights(update_info.named_tensors)

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)
            if current_platform.is_cpu():
                _repack_cpu_embedding_gemms(self.model)

        def shutdown(self) -> None:
            return None

    return InProcessWeightTransferEngine


def _repack_cpu_embedding_gemms(model: torch.nn.Module) -> None:
    """Rebuild the CPU build's packed GEMM of every (unquantized) vocabulary layer from its current weight.

    On the CPU, ``lm_head`` multiplies by a packed copy of its weight taken when the model loaded. With tied
    embeddings the reload writes the new values into the shared ``embed_tokens`` parameter, but the layerwise reload
    never revisits ``lm_head`` (it owns no parameter of its own), so its packed copy stays stale and the logits come
    from the old embedding (checked: log-probs off by ~0.5 after an embedding update). Re-running the method's
    post-processing repacks it.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and isinstance(module.quant_method, UnquantizedEmbeddingMethod):
            module.quant_method.process_weights_after_loading(module)


def register_in_process_engine() -> None:
    """Register :data:`IN_PROCESS_BACKEND` with vLLM's ``WeightTransferEngineFactory`` (idempotent)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    with _register_lock:
        if IN_PROCESS_BACKEND in WeightTransferEngineFactory._registry:
            return
        WeightTransferEngineFactory.register_engine(IN_PROCESS_BACKEND, _in_process_engine_class())


def _is_sharded(parameter: torch.Tensor) -> bool:
    # vLLM marks tensor-parallel shards with the dimension they are split along; the rest is replicated per rank.
    return getattr(parameter, "output_dim", None) is not None or getattr(parameter, "input_dim", None) is not None


def _probe_cpu_linear(module: torch.nn.Module, parameter: torch.Tensor, rows_per_probe: int = 1024) -> torch.Tensor:
    """Read back the weight ``[N, K]`` a CPU-packed linear layer multiplies by (identity rows through its GEMM).

    The CPU build moves linear weights into an opaque packed form and leaves an empty parameter behind; ``x @ W^T``
    with ``x`` the identity is exact in any float format (one product per output, the rest are zeros).
    """
    in_features = int(cast(int, module.input_size_per_partition))
    columns = []
    for start in range(0, in_features, rows_per_probe):
        stop = min(start + rows_per_probe, in_features)
        probe = torch.zeros(stop - start, in_features, dtype=parameter.dtype)
        probe[:, start:stop].fill_diagonal_(1.0)
        columns.append(module.cpu_linear(probe, parameter, None))  # type: ignore[operator]
    return torch.cat(columns, dim=0).t()


def worker_sum_of_squares(worker: Any) -> tuple[float, float]:
    """Runs on each vLLM worker (``collective_rpc``): fp64 sums of squares of (sharded, replicated) parameters.

    Counts every parameter object once (a tied ``lm_head`` is the embedding). On the CPU build, packed linear weights
    are read back through their GEMM (see :func:`_probe_cpu_linear`). Vocabulary padding rows are zero in vLLM, so they
    add nothing.
    """
    model = worker.model_runner.get_model()
    seen: set[int] = set()
    sharded = 0.0
    replicated = 0.0
    with torch.no_grad():
        for module in model.modules():
            for parameter in module.parameters(recurse=False):
                if id(parameter) in seen:
                    continue
                seen.add(id(parameter))
                values = parameter
                if parameter.numel() == 0 and callable(getattr(module, "cpu_linear", None)):
                    values = _probe_cpu_linear(module, parameter)
                square_sum = float(values.detach().to(torch.float64).square().sum())
                if _is_sharded(parameter):
                    sharded += square_sum
                else:
                    replicated += square_sum
    return sharded, replicated


# ---------------------------------------------------------------------------------------------------------------
# Cross-process paths (nccl, cuda_ipc, gloo): the trainer-side half, over vLLM's trainer engines. nccl and cuda_ipc
# need CUDA and are untested on CPU machines; gloo runs anywhere.
# ---------------------------------------------------------------------------------------------------------------

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
