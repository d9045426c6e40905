"""The DeepSpeed training engine on a CUDA GPU (run by ``nox -s gpu_tests``): ZoRRO on/off agree in fp32, a bf16
ZeRO-2 step is finite, and sleep really frees the GPU memory and wake restores the state bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_cases import fwd_bwd, make_batch, make_config, relative_l2, stage0_gradients

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("deepspeed", reason="needs arctic-rl[engines]")
pytest.importorskip("transformers", reason="needs arctic-rl[engines]")

from arctic_rl.engines.training import TrainingEngine  # noqa: E402
from arctic_rl.testing import save_tiny_qwen3  # noqa: E402

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("gpu") / "tiny-qwen3", seed=2)


@pytest.fixture(scope="module")
def wider_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # ~8M parameters: the engine's state (~14 bytes a parameter) is well above DeepSpeed's fixed CUDA buffers.
    return save_tiny_qwen3(
        tmp_path_factory.mktemp("gpu-wide") / "qwen3",
        seed=2,
        hidden_size=512,
        intermediate_size=2048,
        num_attention_heads=16,
        num_key_value_heads=8,
    )


@pytest.fixture(autouse=True)
def exact_matmuls() -> Iterator[None]:
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous
        torch.cuda.empty_cache()


def _engine(model_dir: Path, **overrides: object) -> TrainingEngine:
    return TrainingEngine(make_config(str(model_dir), device="cuda", **overrides))  # type: ignore[arg-type]


def test_zorro_on_and_off_agree_in_fp32_on_cuda(model_dir: Path) -> None:
    batch = make_batch(batch_size=8, prompts=3, seed=5)
    results = {}
    for zorro in (True, False):
        engine = _engine(model_dir, zorro_train={"enable": zorro})
        log_probs = engine.fwd_no_grad(batch)["logprobs"]
        reply = fwd_bwd(engine, batch)
        results[zorro] = (log_probs, reply["loss"], stage0_gradients(engine))
        del engine
        torch.cuda.empty_cache()
    (on_lp, on_loss, on_grads), (off_lp, off_loss, off_grads) = results[True], results[False]
    mask = batch["response_mask"].bool()
    assert float((on_lp - off_lp)[mask].abs().max()) <= TOLERANCE
    assert abs(on_loss - off_loss) <= TOLERANCE
    worst = max(relative_l2(on_grads[name].cpu(), off_grads[name].cpu()) for name in off_grads)
    assert worst <= TOLERANCE, f"largest per-parameter gradient rel-L2 {worst:.2e}"


def test_bf16_zero2_step_then_sleep_frees_memory_and_wake_restores(wider_model_dir: Path) -> None:
    engine = _engine(wider_model_dir, dtype="bfloat16", training={"zero_stage": 2, "max_grad_norm": 1.0})
    parameters = sum(parameter.numel() for parameter in engine.module.parameters())
    batch = make_batch(batch_size=8, prompts=3, seed=6)
    reply = fwd_bwd(engine, batch)
    stepped = engine.step()
    assert torch.isfinite(torch.tensor([reply["loss"], stepped["grad_norm"]])).all()
    norm = engine.weight_norm()
    torch.cuda.synchronize()
    awake_bytes = torch.cuda.memory_allocated()
    engine.sleep("all")
    torch.cuda.synchronize()
    asleep_bytes = torch.cuda.memory_allocated()
    # Weights (bf16: 2 bytes a parameter), fp32 master weights (4) and both AdamW moments (8) leave the GPU.
    assert awake_bytes - asleep_bytes >= 0.9 * 14 * parameters, (awake_bytes, asleep_bytes, parameters)
    engine.wake()
    assert engine.weight_norm() == norm
    reply = fwd_bwd(engine, batch)
    engine.step()
    assert torch.isfinite(torch.tensor(reply["loss"]))


def test_moments_sleep_frees_only_the_adamw_moments(wider_model_dir: Path) -> None:
    engine = _engine(wider_model_dir, dtype="bfloat16", training={"zero_stage": 2, "max_grad_norm": 1.0})
    parameters = sum(parameter.numel() for parameter in engine.module.parameters())
    batch = make_batch(batch_size=8, prompts=3, seed=7)
    fwd_bwd(engine, batch)
    engine.step()
    norm = engine.weight_norm()
    torch.cuda.synchronize()
    awake_bytes = torch.cuda.memory_allocated()
    engine.sleep("moments")
    torch.cuda.synchronize()
    freed = awake_bytes - torch.cuda.memory_allocated()
    # Both AdamW moments in fp32 (8 bytes a parameter) leave the GPU; the weights and master weights stay.
    assert 0.9 * 8 * parameters <= freed <= 1.1 * 8 * parameters, (freed, parameters)
    engine.wake()
    assert engine.weight_norm() == norm
    reply = fwd_bwd(engine, batch)
    engine.step()
    assert torch.isfinite(torch.tensor(reply["loss"]))
