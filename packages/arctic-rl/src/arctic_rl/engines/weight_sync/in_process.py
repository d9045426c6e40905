"""The ``object_store`` path's worker side: :class:`InProcessWeightTransferEngine`, registered with vLLM's
``WeightTransferEngineFactory`` under :data:`IN_PROCESS_BACKEND`. The sampler runs vLLM in-process with the ``uni``
executor, so ``collective_rpc`` hands the worker the very tensor objects the caller passed (from the Ray object store
when the sampler is an actor): no copy, no pickling. vLLM's shipped engines all assume CUDA, which is why the CPU
needs an engine of its own; it loads through the same layerwise reload lifecycle as vLLM's ipc/nccl engines
(``initialize_layerwise_reload`` -> ``model.load_weights`` -> ``finalize_layerwise_reload``), the one path that
restores the CPU build's packed GEMM weights. Also :func:`worker_sum_of_squares`, the workers' weight norm."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, cast

import torch

__all__ = ["IN_PROCESS_BACKEND", "register_in_process_engine", "worker_sum_of_squares"]

IN_PROCESS_BACKEND = "arctic_in_process"
"""Name of our CPU / in-process worker engine in vLLM's ``WeightTransferEngineFactory``."""

_register_lock = threading.Lock()


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
