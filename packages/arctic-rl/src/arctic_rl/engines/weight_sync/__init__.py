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
  (:mod:`.gloo`), registered under :data:`GLOO_BACKEND` on both factories; the same
  cross-process lifecycle as ``nccl`` (a rendezvous, then broadcasts from trainer rank 0), over gloo.

Across processes (``nccl``, ``cuda_ipc``, ``gloo``) the trainer-side engine drives the samplers itself through a
``VLLMWeightSyncClient`` (:class:`SamplerWeightSyncClient`): the trainer process must be able to call every sampler.

Weights always travel in Hugging Face names and layouts (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``,
no ``lm_head`` when embeddings are tied); vLLM's ``load_weights`` fuses them. A fused vLLM parameter must receive all
its parts in one update (``q``, ``k`` and ``v`` together): the layerwise reload rebuilds a layer from what the update
delivered, so a lone ``q_proj`` would leave ``k``/``v`` undefined. Send the full model each sync.

The parts: :mod:`.buckets` (bucketing and flat buffers), :mod:`.in_process` (``object_store``'s worker engine),
:mod:`.gloo` (both gloo engines), :mod:`.vllm_native` (the trainer side over vLLM's API, the method -> backend map).
"""

from arctic_rl.engines.weight_sync.buckets import bucket_named_tensors
from arctic_rl.engines.weight_sync.gloo import GLOO_BACKEND, register_gloo_engines
from arctic_rl.engines.weight_sync.in_process import (
    IN_PROCESS_BACKEND,
    register_in_process_engine,
    worker_sum_of_squares,
)
from arctic_rl.engines.weight_sync.vllm_native import (
    CrossProcessMethod,
    SamplerCall,
    SamplerWeightSyncClient,
    TransferMethod,
    create_trainer_transfer,
    vllm_transfer_backend,
)

__all__ = [
    "GLOO_BACKEND",
    "IN_PROCESS_BACKEND",
    "CrossProcessMethod",
    "SamplerCall",
    "SamplerWeightSyncClient",
    "TransferMethod",
    "bucket_named_tensors",
    "create_trainer_transfer",
    "register_gloo_engines",
    "register_in_process_engine",
    "vllm_transfer_backend",
    "worker_sum_of_squares",
]
