"""DeepSpeed: the engines' install hook patches the model under ZeRO stages 0-3 (float64, fp32 and bf16), and a
deduplicated step through the engine gives the per-sample run's gradients within 1e-5. CPU accelerator, gloo,
world size 1."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
from zorro_cases import (
    TOLERANCE,
    float64_model,
    fresh_model,
    long_samples,
    make_batch,
    model_precision,
    record_differences,
    reference_loss,
)

from arctic_zorro_train import ZorroOutput, create_dummy_batch, install_zorro_for_deepspeed, ppo_policy_loss
from arctic_zorro_train.testing import collect_grads, relative_error

deepspeed = pytest.importorskip("deepspeed", reason="needs arctic-zorro-train[deepspeed]")

# ZeRO-3 partitions parameters and gradients through torch.distributed collectives that torch 2.13 deprecated
# (all_gather_into_tensor, reduce_scatter_tensor); DeepSpeed calls them, not our code.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.distributed.all_gather_into_tensor` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_scatter_tensor` is deprecated:FutureWarning"),
]

RESPONSE_WIDTH = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module", autouse=True)
def _distributed() -> None:
    if torch.cuda.is_available():
        pytest.skip("this test drives DeepSpeed's CPU accelerator")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    deepspeed.init_distributed(dist_backend="gloo")


def _engine(model: torch.nn.Module, stage: int, bf16: bool) -> Any:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _step(engine: Any, batch: dict[str, torch.Tensor]) -> tuple[ZorroOutput, torch.Tensor]:
    output = engine(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    )
    valid = batch["response_mask"].bool()
    loss, _ = ppo_policy_loss(
        output.logprobs,
        batch["old_log_probs"][valid],
        batch["advantages"][valid],
        batch["response_mask"][valid].float(),
        ref_logprobs=batch["ref_log_prob"][valid],
        kl_coef=0.1,
    )
    engine.backward(loss)
    return output, loss


def _assert_engine_matches_the_per_sample_run(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], stage: int
) -> None:
    width = batch["responses"].shape[1]
    with model_precision(model):
        loss, logprobs, _ = reference_loss(model, batch, kl_coef=0.1)
        loss.backward()
    expected = collect_grads(model)
    model.zero_grad(set_to_none=True)
    # Set up outside model_precision: DeepSpeed allocates its fp32 gradient partitions here.
    engine = _engine(model, stage, bf16=False)
    patch = install_zorro_for_deepspeed(engine, {"zorro_train": {"enable": True, "response_length": width}})
    assert patch is not None
    with model_precision(model):
        output, dedup_loss = _step(engine, batch)
    assert isinstance(output, ZorroOutput)
    errors = {
        "logprobs": float((output.logprobs - logprobs).detach().abs().max()),
        "loss": abs(float(dedup_loss.detach()) - float(loss.detach())),
    }
    for name, parameter in engine.module.named_parameters():
        grad = deepspeed.utils.safe_get_full_grad(parameter)
        assert grad is not None, name
        errors[name] = relative_error(grad, expected[name])
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    record_differences(f"{dtype} through DeepSpeed", errors)
    above = {name: error for name, error in errors.items() if error > TOLERANCE}
    assert not above, f"ZeRO-{stage}: {above} differ by more than {TOLERANCE}"
    engine.step()


# ZeRO-1/2 keep gradients in fp32 partitions, so a float64 model's gradients come back rounded once to fp32
# (3e-8 to 6e-8 relative); every step before that is float64. ZeRO-3 partitions the parameters themselves and takes
# only half, bf16 or fp32 ones (its zero.Init asserts so; a float64 model got through only where DeepSpeed's CPU
# accelerator reports no oneDNN fp16 support, by an operator-precedence accident), so it runs in fp32 below.
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_zero_stages_float64_match_the_per_sample_run(stage: int, family: str) -> None:
    batch = create_dummy_batch(
        4, 2, 7, RESPONSE_WIDTH, vocab_size=120, add_padding=True, include_training_fields=True, seed=stage
    )
    _assert_engine_matches_the_per_sample_run(float64_model(family), batch, stage)


@pytest.mark.parametrize("stage", [0, 3])
def test_zero_stages_fp32_match_the_per_sample_run(stage: int) -> None:
    """Stage 0 all-reduces gradients in their own dtype and DeepSpeed's CPU accelerator refuses float64 there, and
    stage 3 partitions only half, bf16 or fp32 parameters, so these run in fp32, on the well-conditioned fp32 cases
    of test_families.py (long sequences, no Gated DeltaNet decay parameters)."""
    batch = make_batch(long_samples(), extra_prompt_padding=2, extra_response_padding=1)
    _assert_engine_matches_the_per_sample_run(fresh_model("qwen3"), batch, stage=stage)


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_engine_trains(stage: int) -> None:
    batch = create_dummy_batch(4, 2, 7, RESPONSE_WIDTH, vocab_size=120, include_training_fields=True, seed=1)
    model = fresh_model("qwen3_5")
    engine = _engine(model, stage, bf16=True)
    install_zorro_for_deepspeed(engine, {"enable": True, "response_length": RESPONSE_WIDTH, "logits_mode": "memory"})
    for _ in range(2):
        output, loss = _step(engine, batch)
        assert torch.isfinite(loss) and torch.isfinite(output.logprobs).all()
        engine.step()


def test_disabled_config_leaves_the_model_alone() -> None:
    model = fresh_model("qwen3")
    assert install_zorro_for_deepspeed(model, {"zorro_train": {"enable": False}}) is None
    assert install_zorro_for_deepspeed(model, None) is None
    with pytest.raises(ValueError, match="unknown zorro_train option"):
        install_zorro_for_deepspeed(model, {"zorro_train": {"enable": True, "speed": "max"}})
