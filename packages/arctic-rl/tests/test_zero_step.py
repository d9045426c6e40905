"""The multi-tensor gradient checks installed on DeepSpeed's ZeRO-1/2 optimizer give DeepSpeed's own answers.

Each replaced method is compared with DeepSpeed's original (called through the class) on the same gradients:
finite ones, ones holding a NaN, +inf or -inf, huge finite bf16 values, zero padding; then through the engine, a
step whose gradients hold a NaN is skipped (weights unchanged, norm reported as inf) exactly as without them.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from engine_cases import full_parameters, fwd_bwd, make_batch, make_config

pytest.importorskip("deepspeed", reason="needs arctic-rl[engines]")
pytest.importorskip("transformers", reason="needs arctic-rl[engines]")

from arctic_rl.engines.training import TrainingEngine
from arctic_rl.engines.zero_step import multi_tensor_checks_apply
from arctic_rl.testing import save_tiny_qwen3

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="these tests drive DeepSpeed's CPU accelerator")

BAD_VALUES = (math.nan, math.inf, -math.inf)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.set_num_threads(1)
    return str(save_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3")))


@pytest.fixture(scope="module")
def zero2_engine(model_dir: str) -> TrainingEngine:
    return TrainingEngine(make_config(model_dir, training={"zero_stage": 2, "max_grad_norm": 1.0}))


def _gradients(optimizer: Any, *, seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    gradients = [
        torch.randn(parameter.shape, generator=generator).to(dtype) for parameter in optimizer.params_in_partition[0]
    ]
    padding = torch.zeros(7, dtype=dtype)
    padding._zero_padding = True  # type: ignore[attr-defined]
    return [*gradients, padding]


def _original(optimizer: Any, name: str) -> Any:
    return getattr(type(optimizer), name).__get__(optimizer)


def test_installed_only_on_zero_1_and_2(model_dir: str, zero2_engine: TrainingEngine) -> None:
    assert multi_tensor_checks_apply(zero2_engine._engine.optimizer)
    assert "get_grad_norm_direct" in vars(zero2_engine._engine.optimizer)
    for stage in (0, 3):
        engine = TrainingEngine(make_config(model_dir, training={"zero_stage": stage}))
        assert not multi_tensor_checks_apply(engine._engine.optimizer), stage
        assert "get_grad_norm_direct" not in vars(engine._engine.optimizer), stage


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norm_equals_deepspeeds(zero2_engine: TrainingEngine, dtype: torch.dtype) -> None:
    optimizer = zero2_engine._engine.optimizer
    params = optimizer.params_in_partition[0]
    gradients = _gradients(optimizer, seed=1, dtype=dtype)
    ours = optimizer.get_grad_norm_direct(gradients, params)
    theirs = _original(optimizer, "get_grad_norm_direct")(gradients, params)
    assert ours.dtype == theirs.dtype == torch.float32
    assert math.isclose(float(ours), float(theirs), rel_tol=1e-6)
    assert float(ours) > 0
    for bad in BAD_VALUES:
        broken = [gradient.clone() for gradient in gradients]
        broken[len(broken) // 2].view(-1)[3] = bad
        assert float(optimizer.get_grad_norm_direct(broken, params)) == -1.0, bad
        assert float(_original(optimizer, "get_grad_norm_direct")(broken, params)) == -1.0, bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_overflow_check_equals_deepspeeds(zero2_engine: TrainingEngine, dtype: torch.dtype) -> None:
    optimizer = zero2_engine._engine.optimizer
    saved = dict(optimizer.averaged_gradients)
    try:
        huge = _gradients(optimizer, seed=2, dtype=dtype)
        huge[0].view(-1)[0] = torch.finfo(dtype).max
        huge[1].view(-1)[:5] = -torch.finfo(dtype).max
        cases: list[tuple[str, list[torch.Tensor], bool]] = [
            ("finite", _gradients(optimizer, seed=2, dtype=dtype), False),
            ("huge finite", huge, False),
        ]
        for bad in BAD_VALUES:
            broken = _gradients(optimizer, seed=3, dtype=dtype)
            broken[-2].view(-1)[-1] = bad
            cases.append((str(bad), broken, True))
        for label, gradients, expected in cases:
            optimizer.averaged_gradients = {0: gradients}
            ours = bool(optimizer.has_overflow_partitioned_grads_serial())
            theirs = bool(_original(optimizer, "has_overflow_partitioned_grads_serial")())
            assert ours == theirs == expected, label
    finally:
        optimizer.averaged_gradients = saved


def test_a_step_with_a_nan_gradient_is_skipped(model_dir: str) -> None:
    engine = TrainingEngine(make_config(model_dir, training={"zero_stage": 2, "max_grad_norm": 1.0}))
    assert "get_grad_norm_direct" in vars(engine._engine.optimizer)
    batch = make_batch(seed=5)
    fwd_bwd(engine, batch)
    assert math.isfinite(engine.step()["grad_norm"])
    before = full_parameters(engine)
    first = next(parameter for parameter in engine.module.parameters() if parameter.requires_grad)
    handle = first.register_hook(lambda gradient: gradient * math.nan)
    try:
        fwd_bwd(engine, batch)
        reply = engine.step()
    finally:
        handle.remove()
    assert reply["grad_norm"] == math.inf
    after = full_parameters(engine)
    assert all(torch.equal(before[name], after[name]) for name in before)
    fwd_bwd(engine, batch)
    assert math.isfinite(engine.step()["grad_norm"])
    assert any(not torch.equal(before[name], tensor) for name, tensor in full_parameters(engine).items())
