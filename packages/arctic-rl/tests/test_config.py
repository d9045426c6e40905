import json
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from arctic_rl.config import (
    ArcticRLClientConfig,
    FcaSection,
    HttpConfig,
    SamplingConfig,
    TrainingConfig,
    WeightSyncConfig,
    ZorroTrainSection,
)
from arctic_rl.errors import ConfigError

CUDA = torch.cuda.is_available()


def make(**overrides: Any) -> ArcticRLClientConfig:
    return ArcticRLClientConfig(model_name="tiny", **overrides)


def test_the_seed_snippet_runs_verbatim() -> None:
    config = ArcticRLClientConfig(
        model_name="Qwen/Qwen3-4B",
        comm_protocol="ray",
        training_gpus=1,
        sampling_gpus=1,
        log_prob_gpus=0,
        colocate=False,
    )
    assert config.model_name == "Qwen/Qwen3-4B"
    assert config.resolved_tokenizer_name() == "Qwen/Qwen3-4B"


def test_defaults_resolve_against_the_device() -> None:
    config = make()
    assert config.resolved_device() == ("cuda" if CUDA else "cpu")
    assert config.resolved_dtype() == ("bfloat16" if CUDA else "float32")
    assert config.resolved_weight_sync() == ("nccl" if CUDA else "object_store")
    cpu = make(device="cpu", dtype="bfloat16")
    assert cpu.resolved_device() == "cpu" and cpu.resolved_dtype() == "bfloat16"
    assert cpu.resolved_sampling_dtype() == "bfloat16"
    assert make(device="cpu", sampling={"dtype": "float32"}).resolved_sampling_dtype() == "float32"


def test_auto_weight_sync_on_gpus_follows_the_placement() -> None:
    assert make(device="cuda").resolved_weight_sync() == "nccl"
    assert make(device="cuda", colocate=True).resolved_weight_sync() == "cuda_ipc"
    assert make(device="cuda", weight_sync={"method": "object_store"}).resolved_weight_sync() == "object_store"


def test_gloo_weight_sync_is_allowed_on_any_device() -> None:
    for device in ("cpu", "cuda"):
        config = make(device=device, weight_sync={"method": "gloo", "timeout_s": 30})
        assert config.resolved_weight_sync() == "gloo" and config.weight_sync.timeout_s == 30
    with pytest.raises(ValidationError, match="timeout_s"):
        make(device="cpu", weight_sync={"method": "gloo", "timeout_s": 0})


def test_extra_fields_are_refused_everywhere_with_the_known_keys() -> None:
    with pytest.raises(ValidationError, match=r"unknown key 'trainign_gpus' \(did you mean 'training_gpus'\?\)"):
        make(trainign_gpus=2)
    with pytest.raises(ValidationError, match=r"unknown key 'learning_rate' .*the known keys are \['betas', "):
        make(training={"learning_rate": 1e-5})
    with pytest.raises(ValidationError, match=r"unknown key 'enabled' \(did you mean 'enable'\?\) in FcaSection"):
        make(fca={"enabled": True})
    for section in (TrainingConfig, ZorroTrainSection, SamplingConfig, FcaSection, WeightSyncConfig, HttpConfig):
        with pytest.raises(ValidationError, match=r"unknown key 'unknown' in .*the known keys are \["):
            section(unknown=1)
    # Nothing close: no guess, still the list.
    with pytest.raises(ValidationError, match=r"unknown key 'zzz' in ArcticRLClientConfig; the known keys are"):
        make(zzz=1)


@pytest.mark.parametrize(("field", "least"), [("training_gpus", 1), ("sampling_gpus", 1), ("log_prob_gpus", 0)])
def test_engine_counts_below_the_minimum_say_they_count_cpu_workers_on_a_cpu(field: str, least: int) -> None:
    with pytest.raises(ValidationError, match=rf"{field} must be >= {least}, got -1\. .*CPU workers"):
        make(**{field: -1})
    if least:
        with pytest.raises(ValidationError, match=rf"{field} must be >= 1, got 0\. .*use {field}=1"):
            make(**{field: 0})


def test_a_model_path_that_is_no_directory_fails_at_config_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValidationError, match=r"model_name='/no/such/model': directory not found\. "):
        make_with_model("/no/such/model")
    with pytest.raises(ValidationError, match=r"directory not found \(relative to the working directory"):
        make_with_model("./tiny-qwen3")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValidationError, match="is a file, not a model directory"):
        make_with_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValidationError, match=r"tokenizer_name='tok/a/b': directory not found"):
        ArcticRLClientConfig(model_name="Qwen/Qwen3-4B", tokenizer_name="tok/a/b")
    (tmp_path / "tiny-qwen3").mkdir()
    # Existing directories and hub ids pass; so do paths meant for a remote cluster or an already running server.
    assert make_with_model("./tiny-qwen3").model_name == "./tiny-qwen3"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert make_with_model("~/tiny-qwen3").model_name == "~/tiny-qwen3"
    assert make_with_model("Qwen/Qwen3-4B").model_name == "Qwen/Qwen3-4B"
    assert make_with_model("/models/tiny", ray_address="ray://head:10001").model_name == "/models/tiny"
    assert make_with_model("/models/tiny", comm_protocol="http").model_name == "/models/tiny"
    with pytest.raises(ValidationError, match="directory not found"):
        make_with_model("/models/tiny", comm_protocol="http", launch_local_server=True)


def make_with_model(model_name: str, **overrides: Any) -> ArcticRLClientConfig:
    return ArcticRLClientConfig(model_name=model_name, **overrides)


def test_config_is_frozen() -> None:
    config = make()
    with pytest.raises(ValidationError):
        config.training_gpus = 3  # type: ignore[misc]


def test_every_field_is_documented() -> None:
    for model in (
        ArcticRLClientConfig,
        TrainingConfig,
        ZorroTrainSection,
        SamplingConfig,
        FcaSection,
        WeightSyncConfig,
    ):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            assert field.annotation is not None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sampling_gpus": 2, "sampling": {"tensor_parallel_size": 4}}, "larger than sampling_gpus"),
        ({"sampling_gpus": 6, "sampling": {"tensor_parallel_size": 4}}, "not a multiple"),
        (
            {
                "training_gpus": 8,
                "sampling_gpus": 8,
                "colocate": True,
                "gpus_per_node": 6,
                "sampling": {"tensor_parallel_size": 4},
            },
            r"does not divide the 6 GPUs per node; use a tensor_parallel_size in \[1, 2, 3, 6\]",
        ),
        ({"sampling_gpus": 8, "gpus_per_node": 2, "sampling": {"tensor_parallel_size": 4}}, "fit on one node"),
        ({"device": "cuda", "weight_sync": {"method": "cuda_ipc"}}, "needs colocate=True"),
        ({"device": "cpu", "weight_sync": {"method": "nccl"}}, "needs CUDA"),
        ({"device": "cpu", "colocate": True, "weight_sync": {"method": "cuda_ipc"}}, "needs CUDA"),
        ({"log_prob_engine": "vllm", "log_prob_gpus": 1}, "set log_prob_gpus=0"),
        ({"colocate": True, "training_gpus": 2, "sampling_gpus": 1}, "set them equal"),
        ({"colocate": True, "training_gpus": 2, "sampling_gpus": 2, "log_prob_gpus": 1}, "log_prob_gpus must be 0"),
        ({"device": "cuda", "sampling": {"kv_cache_space_gib": 4}}, "remove kv_cache_space_gib"),
        ({"ds_config": {"optimizer": {"type": "AdamW"}}}, "training.lr"),
        ({"ds_config": {"zero_optimization": {"stage": 3}}}, "set it to 3"),
        ({"ds_config": {"zero_optimization": 3}}, "must be a dict"),
        ({"ds_config": {"x": object()}}, "JSON values"),
        ({"sampling": {"engine_args": {"tensor_parallel_size": 2}}}, "sampling.tensor_parallel_size"),
        ({"sampling": {"engine_args": {"seed": 2}}}, "top-level seed"),
        ({"training": {"lr_schedule": "cosine"}}, "set training.total_steps"),
        ({"training": {"lr_schedule": "linear", "total_steps": 10, "warmup_steps": 11}}, "lower warmup_steps"),
        ({"training": {"betas": (0.9, 1.0)}}, r"\[0, 1\)"),
        ({"training": {"zero_stage": 4}}, "zero_stage"),
        ({"training_gpus": 0}, "training_gpus"),
        ({"sampling_gpus": 0}, "sampling_gpus"),
        ({"log_prob_gpus": -1}, "log_prob_gpus"),
        ({"port": 70000}, "port"),
        ({"fca": {"min_group_size": 1}}, "min_group_size"),
        ({"sampling": {"gpu_memory_utilization": 1.5}}, "gpu_memory_utilization"),
        ({"comm_protocol": "grpc"}, "comm_protocol"),
        ({"launch_local_server": True}, "needs comm_protocol='http'"),
        ({"http": {"retries": -1}}, "retries"),
        ({"http": {"request_timeout_s": 0}}, "request_timeout_s"),
    ],
)
def test_invalid_combinations_are_refused_with_a_fix(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        make(**overrides)


def test_valid_layouts_are_accepted() -> None:
    make(training_gpus=8, sampling_gpus=8, colocate=True, gpus_per_node=8, sampling={"tensor_parallel_size": 4})
    make(training_gpus=2, sampling_gpus=4, log_prob_gpus=2, gpus_per_node=4, sampling={"tensor_parallel_size": 2})
    make(colocate=True, training_gpus=2, sampling_gpus=2, log_prob_gpus=2)
    make(log_prob_engine="vllm")
    make(ds_config={"zero_optimization": {"stage": 2, "overlap_comm": True}})
    make(device="cpu", sampling={"kv_cache_space_gib": 1})
    make(comm_protocol="http", port=8000)
    make(comm_protocol="http", launch_local_server=True, token_file="/tmp/token", http={"max_request_mb": 16})


def test_check_gpus_per_node_raises_config_error() -> None:
    config = make(device="cuda", training_gpus=4, sampling_gpus=4, colocate=True, sampling={"tensor_parallel_size": 4})
    config.check_gpus_per_node(8)
    with pytest.raises(ConfigError, match="does not divide the 6 GPUs per node"):
        config.check_gpus_per_node(6)
    with pytest.raises(ConfigError, match="fit on one node"):
        config.check_gpus_per_node(2)


def test_fca_section_mirrors_fca_config_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    section = FcaSection(
        enable=True,
        max_query_len=3,
        min_group_size=4,
        min_non_singleton_fraction=0.5,
        max_non_singleton_groups=7,
        min_additional_prefix_blocks=2,
        log_interval=9,
    )
    for name, value in section.environment().items():
        monkeypatch.setenv(name, value)
    fca_config = pytest.importorskip("arctic_fca.config")
    parsed = fca_config.FcaConfig.from_env()
    assert parsed.enable
    for name in FcaSection.model_fields:
        if name != "enable":
            assert getattr(parsed, name) == getattr(section, name)
    from dataclasses import fields

    # One schema: the same knobs under the same names with the same defaults.
    assert {field.name: field.default for field in fields(fca_config.FcaConfig)} == {
        name: field.default for name, field in FcaSection.model_fields.items()
    }


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)


# Names a local-path check leaves alone (no such directory exists here): Hugging Face hub ids.
hub_ids = st.from_regex(r"([A-Za-z0-9][A-Za-z0-9_.-]{0,8}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,8}", fullmatch=True)


@st.composite
def configs(draw: st.DrawFn) -> ArcticRLClientConfig:
    tp = draw(st.sampled_from([1, 2, 4]))
    colocate = draw(st.booleans())
    training_gpus = draw(st.integers(1, 4)) * tp if colocate else draw(st.integers(1, 8))
    sampling_gpus = training_gpus if colocate else tp * draw(st.integers(1, 3))
    device = draw(st.sampled_from(["cpu", "cuda"]))
    methods = ["auto", "object_store"] + (["nccl"] if device == "cuda" else [])
    if device == "cuda" and colocate:
        methods.append("cuda_ipc")
    schedule = draw(st.sampled_from(["constant", "linear", "cosine"]))
    total = draw(st.integers(1, 1000)) if schedule != "constant" else draw(st.none() | st.integers(1, 1000))
    return ArcticRLClientConfig(
        model_name=draw(hub_ids),
        tokenizer_name=draw(st.none() | hub_ids),
        comm_protocol=draw(st.sampled_from(["ray", "http"])),
        training_gpus=training_gpus,
        sampling_gpus=sampling_gpus,
        log_prob_gpus=draw(st.sampled_from([0, training_gpus])) if colocate else draw(st.integers(0, 4)),
        colocate=colocate,
        device=device,
        seed=draw(st.integers(0, 2**31)),
        dtype=draw(st.sampled_from(["auto", "float32", "bfloat16"])),
        full_determinism=draw(st.booleans()),
        checkpoint_path=draw(st.none() | st.text(max_size=10)),
        ds_config={"zero_optimization": {"offload": draw(json_values)}, "extra": draw(json_values)},
        training={
            "lr": draw(st.floats(1e-9, 1.0)),
            "betas": (draw(st.floats(0, 0.99)), draw(st.floats(0, 0.9999))),
            "lr_schedule": schedule,
            "total_steps": total,
            "warmup_steps": draw(st.integers(0, total or 1000)),
            "max_grad_norm": draw(st.none() | st.floats(0.01, 10)),
            "gradient_accumulation_steps": draw(st.none() | st.integers(1, 8)),
            "zero_stage": draw(st.sampled_from([0, 1, 2, 3])),
        },
        zorro_train={
            "enable": draw(st.booleans()),
            "logits_mode": draw(st.sampled_from(["none", "compute", "memory"])),
        },
        sampling={
            "tensor_parallel_size": tp,
            "max_model_len": draw(st.none() | st.integers(1, 10**5)),
            "dtype": draw(st.sampled_from([None, "float32", "bfloat16"])),
            "engine_args": {"enable_prefix_caching": draw(st.booleans()), "other": draw(json_values)},
        },
        fca={"enable": draw(st.booleans()), "min_non_singleton_fraction": draw(st.floats(0, 1))},
        weight_sync={"method": draw(st.sampled_from(methods)), "bucket_mb": draw(st.integers(1, 4096))},
    )


@settings(max_examples=60, deadline=None)
@given(configs())
def test_model_dump_json_round_trips(config: ArcticRLClientConfig) -> None:
    dumped = config.model_dump_json()
    restored = ArcticRLClientConfig.model_validate_json(dumped)
    assert restored == config
    assert restored.model_dump_json() == dumped
    assert ArcticRLClientConfig.model_validate(json.loads(dumped)) == config
    assert pickle.loads(pickle.dumps(config)) == config


def test_lr_schedules_by_hand() -> None:
    constant = TrainingConfig(lr=1.0, warmup_steps=4)
    assert [constant.lr_multiplier(step) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = TrainingConfig(lr_schedule="linear", warmup_steps=2, total_steps=6, min_lr_ratio=0.2)
    # After warmup, progress = (step - 2) / 4.
    assert [linear.lr_multiplier(step) for step in range(8)] == pytest.approx([0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    cosine = TrainingConfig(lr_schedule="cosine", total_steps=4, min_lr_ratio=0.1)
    expected = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / 4)) for step in range(4)] + [0.1, 0.1]
    assert [cosine.lr_multiplier(step) for step in range(6)] == pytest.approx(expected)
    assert TrainingConfig(lr_schedule="linear", warmup_steps=3, total_steps=3).lr_multiplier(3) == 0.0
    with pytest.raises(ValueError, match="step must be >= 0"):
        constant.lr_multiplier(-1)
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear.lr_multiplier)
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.25, 0.5, 0.5, 0.4])


# The fields only the client and the service read (transport, placement checks, time limits, checkpoint directory).
CLIENT_ONLY_FIELDS = {
    "comm_protocol",
    "gpus_per_node",
    "engine_call_timeout_s",
    "checkpoint_path",
    "log_prob_engine",
    "ray_address",
    "host",
    "port",
    "launch_local_server",
    "token_file",
    "http",
}


def test_each_engine_receives_only_its_own_sections(tmp_path: Path) -> None:
    from arctic_rl.config import _SHARED_ENGINE_FIELDS, ENGINE_SECTIONS

    engine_fields = {*_SHARED_ENGINE_FIELDS, *(name for names in ENGINE_SECTIONS.values() for name in names)}
    # Every field is classified: a new one must be added to an engine's sections or to the client's.
    assert engine_fields | CLIENT_ONLY_FIELDS == set(ArcticRLClientConfig.model_fields)
    assert not engine_fields & CLIENT_ONLY_FIELDS
    token = tmp_path / "token"
    token.write_text("x" * 32)
    config = ArcticRLClientConfig(
        model_name="models/tiny",
        comm_protocol="http",
        host="10.1.2.3",
        port=7443,
        token_file=str(token),
        http={"retries": 9},
        training={"lr": 3e-6},
        zorro_train={"enable": True},
        sampling={"max_model_len": 64},
        fca={"enable": True, "min_group_size": 3},
        ds_config={"zero_optimization": {"reduce_bucket_size": 1000}},
        seed=5,
    )
    default = ArcticRLClientConfig(model_name="models/tiny")
    for role, sections in ENGINE_SECTIONS.items():
        engine = config.for_engine(role)
        for name in ArcticRLClientConfig.model_fields:
            source = config if name in {*sections, *_SHARED_ENGINE_FIELDS} else default
            assert getattr(engine, name) == getattr(source, name), (role, name)
        assert (engine.host, engine.port, engine.token_file, engine.http.retries) == ("127.0.0.1", 7000, None, 3)
    assert config.for_engine("sampling").training == default.training
    assert config.for_engine("training").fca == default.fca
    assert config.for_engine("log_prob").training == config.training
    with pytest.raises(ValueError, match="role must be one of"):
        config.for_engine("client")
