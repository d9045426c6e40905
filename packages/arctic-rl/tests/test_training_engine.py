"""TrainingEngine and LogProbEngine on DeepSpeed's CPU accelerator (gloo) over a tiny random-init Qwen3.

The engines are checked against plain transformers (per-sample runs), against each other (ZoRRO on/off, micro-batch
splits, one rank vs two), and for their state rules (bad batches, sleep, checkpoints).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_cases import (
    GRADIENT_PROPORTIONAL_ADAM,
    RESPONSE_WIDTH,
    data_parallel_rank,
    full_parameters,
    fwd_bwd,
    make_batch,
    make_config,
    relative_l2,
    select_rows,
    stage0_gradients,
    step_denominators,
)

pytest.importorskip("deepspeed", reason="needs arctic-rl[engines]")
pytest.importorskip("transformers", reason="needs arctic-rl[engines]")

from arctic_rl.engines.deepspeed_base import free_port
from arctic_rl.engines.log_prob import LogProbEngine
from arctic_rl.engines.training import TrainingEngine
from arctic_rl.errors import BatchValidationError, ConfigError, EngineError, EngineStateError, InvalidRequestError
from arctic_rl.testing import save_tiny_qwen3

TOLERANCE = 1e-5

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="these tests drive DeepSpeed's CPU accelerator")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.set_num_threads(1)
    return str(save_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3")))


def _plain_reference(model_dir: str, batch: dict[str, torch.Tensor], temperature: float) -> Any:
    from transformers import AutoModelForCausalLM

    from arctic_zorro_train.testing import per_sample_reference

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return per_sample_reference(model, batch, RESPONSE_WIDTH, temperature=temperature)


@pytest.mark.slow
@pytest.mark.parametrize("zorro", [True, False], ids=["zorro", "padded"])
def test_fwd_no_grad_equals_per_sample_transformers(model_dir: str, zorro: bool) -> None:
    batch = make_batch(seed=3)
    engine = TrainingEngine(make_config(model_dir, zorro_train={"enable": zorro}))
    assert engine.zorro_enabled is zorro
    output = engine.fwd_no_grad(batch, calculate_entropy=True, temperature=0.7)
    reference = _plain_reference(model_dir, batch, temperature=0.7)
    valid = batch["response_mask"].bool()
    assert output["logprobs"].shape == batch["responses"].shape
    assert torch.equal(output["logprobs"][~valid], torch.zeros(int((~valid).sum())))
    assert float((output["logprobs"][valid] - reference.logprobs).abs().max()) <= TOLERANCE
    assert float((output["entropy"][valid] - reference.entropy).abs().max()) <= TOLERANCE


@pytest.mark.slow
def test_zorro_on_and_off_give_the_same_logprobs_and_gradients(model_dir: str) -> None:
    batch = make_batch(seed=4)
    results = {}
    for zorro in (True, False):
        engine = TrainingEngine(make_config(model_dir, zorro_train={"enable": zorro}))
        reply = fwd_bwd(engine, batch, entropy_coef=0.01)
        results[zorro] = (engine.fwd_no_grad(batch)["logprobs"], reply["loss"], stage0_gradients(engine))
    (dedup_logprobs, dedup_loss, dedup_grads), (plain_logprobs, plain_loss, plain_grads) = results[True], results[False]
    assert float((dedup_logprobs - plain_logprobs).abs().max()) <= TOLERANCE
    assert math.isclose(dedup_loss, plain_loss, rel_tol=TOLERANCE)
    errors = {name: relative_l2(dedup_grads[name], plain_grads[name]) for name in plain_grads}
    assert all(float(grad.abs().max()) > 0 for grad in plain_grads.values())
    assert max(errors.values()) <= TOLERANCE, errors


def _save_tiny_hybrid(directory: Path) -> str:
    """A tiny random-init Qwen3.5 (Gated DeltaNet and attention layers) with the byte tokenizer, saved."""
    from arctic_rl.testing import build_byte_tokenizer
    from arctic_zorro_train.testing import build_model, tiny_config

    build_model(tiny_config("qwen3_5", vocab_size=VOCAB_OF_TINY_HYBRID)).save_pretrained(directory)
    build_byte_tokenizer().save_pretrained(directory)
    return str(directory)


# Above the byte tokenizer's ids and the test batches' token ids (< VOCAB).
VOCAB_OF_TINY_HYBRID = 320


@pytest.mark.slow
def test_zorro_gradients_of_a_hybrid_model_after_a_log_prob_pass(tmp_path: Path) -> None:
    """Issue #37 where users meet it: ``fwd_no_grad`` switches the policy to ``eval()`` and back to ``train()``
    (transformers 5.25 re-kernelizes a loaded model on both switches, which dropped the patched Gated DeltaNet
    forwards); the deduplicated ``fwd_bwd`` that follows must still give the padded engine's gradients."""
    model_dir = _save_tiny_hybrid(tmp_path)
    batch = make_batch(seed=37)
    results = {}
    for zorro in (True, False):
        engine = TrainingEngine(make_config(model_dir, zorro_train={"enable": zorro}))
        engine.fwd_no_grad(batch)
        reply = fwd_bwd(engine, batch)
        results[zorro] = (reply["loss"], stage0_gradients(engine))
    (dedup_loss, dedup_grads), (plain_loss, plain_grads) = results[True], results[False]
    assert math.isclose(dedup_loss, plain_loss, rel_tol=TOLERANCE), (dedup_loss, plain_loss)
    assert any("linear_attn" in name for name in plain_grads)
    errors = {name: relative_l2(dedup_grads[name], plain_grads[name]) for name in plain_grads}
    assert max(errors.values()) <= TOLERANCE, sorted(errors.items(), key=lambda item: -item[1])[:5]


@pytest.mark.slow
@pytest.mark.parametrize("zorro", [True, False], ids=["zorro", "padded"])
def test_old_log_probs_from_forward_equal_a_separate_fwd_no_grad(model_dir: str, zorro: bool) -> None:
    # One update per batch: fwd_no_grad's log-probs (eval mode, its own micro-batches) are the old ones, or the
    # training forward's own, detached. Same weights, so the same loss, metrics and gradients up to rounding.
    batch = make_batch(seed=9)
    # Big advantages and a clip range that would bind if the two paths' ratios differed by more than rounding.
    loss = {"clip_ratio_low": 1e-3, "clip_ratio_high": 1e-3, "entropy_coef": 0.01}
    two_calls = TrainingEngine(make_config(model_dir, zorro_train={"enable": zorro}))
    separate = two_calls.fwd_no_grad(batch)["logprobs"]
    reply = fwd_bwd(two_calls, {**batch, "old_log_probs": separate}, **loss)
    one_call = TrainingEngine(make_config(model_dir, zorro_train={"enable": zorro}))
    without_old = {key: value for key, value in batch.items() if key != "old_log_probs"}
    fused = one_call.fwd_bwd(
        without_old,
        loss_name="grpo",
        loss_config={"kl_coef": 0.1, "kl_estimator": "k3", **loss},
        old_log_probs_from_forward=True,
        **step_denominators(batch),
    )
    assert float((fused["logprobs"] - separate).abs().max()) <= TOLERANCE
    assert math.isclose(fused["loss"], reply["loss"], rel_tol=TOLERANCE)
    assert fused["metrics"].keys() == reply["metrics"].keys()
    for name, value in reply["metrics"].items():
        assert math.isclose(fused["metrics"][name], value, rel_tol=TOLERANCE, abs_tol=1e-7), name
    expected, got = stage0_gradients(two_calls), stage0_gradients(one_call)
    assert all(float(grad.abs().max()) > 0 for grad in expected.values())
    errors = {name: relative_l2(got[name], expected[name]) for name in expected}
    assert max(errors.values()) <= TOLERANCE, errors
    # The batch's own old_log_probs (here the sampler's stand-in) are not used on that path.
    one_call.step()
    again = TrainingEngine(make_config(model_dir, zorro_train={"enable": zorro}))
    ignored = {**batch, "old_log_probs": torch.full_like(batch["old_log_probs"], -50.0)}
    replay = again.fwd_bwd(
        ignored,
        loss_name="grpo",
        loss_config={"kl_coef": 0.1, "kl_estimator": "k3", **loss},
        old_log_probs_from_forward=True,
        **step_denominators(batch),
    )
    assert replay["loss"] == fused["loss"]


@pytest.mark.slow
def test_old_log_probs_from_forward_is_refused_with_active_dropout(tmp_path: Path) -> None:
    model_dir = str(save_tiny_qwen3(tmp_path / "dropout", attention_dropout=0.1))
    # ZoRRO's attention refuses dropout itself; the padded path runs it.
    engine = TrainingEngine(make_config(model_dir, zorro_train={"enable": False}))
    batch = make_batch(seed=2)
    with pytest.raises(ConfigError, match=r"active dropout: config.attention_dropout=0.1"):
        engine.fwd_bwd(
            batch, loss_name="grpo", loss_config={}, old_log_probs_from_forward=True, **step_denominators(batch)
        )
    # Refused before any forward: nothing to step.
    with pytest.raises(EngineStateError, match="fwd_bwd"):
        engine.step()
    # The separate-forward path is still open for such a model.
    fwd_bwd(engine, batch)
    engine.step()


@pytest.mark.slow
@pytest.mark.parametrize("zorro", [True, False], ids=["zorro", "padded"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(model_dir: str, zorro: bool) -> None:
    batch = make_batch(seed=6)
    results = {}
    for recompute in (True, False):
        engine = TrainingEngine(
            make_config(model_dir, training={"gradient_checkpointing": recompute}, zorro_train={"enable": zorro})
        )
        assert engine.module.is_gradient_checkpointing is recompute
        reply = fwd_bwd(engine, batch, entropy_coef=0.01)
        results[recompute] = (reply["loss"], stage0_gradients(engine))
    (loss, grads), (plain_loss, plain_grads) = results[True], results[False]
    assert math.isclose(loss, plain_loss, rel_tol=TOLERANCE)
    assert all(float(grad.abs().max()) > 0 for grad in plain_grads.values())
    errors = {name: relative_l2(grads[name], plain_grads[name]) for name in plain_grads}
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_every_logits_mode_gives_the_same_zero_step(model_dir: str, stage: int) -> None:
    """'memory' recomputes the LM head in the backward; under ZeRO every gradient must still be reduced once."""
    batch = make_batch(seed=7)
    initial = _initial_weights(model_dir)
    outcomes = {}
    for mode in ("none", "compute", "memory"):
        engine = TrainingEngine(
            make_config(
                model_dir,
                training={"zero_stage": stage, **GRADIENT_PROPORTIONAL_ADAM},
                zorro_train={"logits_mode": mode},
            )
        )
        reply, stepped = _train(engine, batch)
        outcomes[mode] = (reply["loss"], stepped["grad_norm"], full_parameters(engine))
    loss, grad_norm, weights = outcomes["none"]
    for mode in ("compute", "memory"):
        assert math.isclose(outcomes[mode][0], loss, rel_tol=TOLERANCE), mode
        assert math.isclose(outcomes[mode][1], grad_norm, rel_tol=TOLERANCE), mode
        errors = {
            name: relative_l2(outcomes[mode][2][name] - initial[name], weights[name] - initial[name])
            for name in weights
        }
        assert max(errors.values()) <= TOLERANCE, (mode, errors)


@pytest.mark.slow
def test_micro_batch_split_does_not_change_the_step(model_dir: str) -> None:
    """One micro-batch, a small token budget, a fixed accumulation count, and a step fed by two fwd_bwd calls all
    give the gradient of the same global loss."""
    batch = make_batch(12, 4, seed=5)
    denominators = step_denominators(batch)

    def gradients(training: dict[str, Any], calls: list[list[int]]) -> tuple[dict[str, torch.Tensor], float, int]:
        engine = TrainingEngine(make_config(model_dir, training=training))
        loss, micro_batches = 0.0, 0
        for rows in calls:
            reply = fwd_bwd(engine, select_rows(batch, rows), denominators)
            loss += reply["loss"]
            micro_batches += reply["micro_batches"]
        return stage0_gradients(engine), loss, micro_batches

    everything = list(range(12))
    expected, expected_loss, count = gradients({"micro_batch_tokens": 10_000}, [everything])
    assert count == 1
    variants = {
        "token budget": ({"micro_batch_tokens": 30}, [everything]),
        "accumulation steps": ({"gradient_accumulation_steps": 3}, [everything]),
        "two calls": ({"micro_batch_tokens": 10_000}, [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]),
    }
    for label, (training, calls) in variants.items():
        grads, loss, count = gradients(training, calls)
        assert count > 1, label
        assert math.isclose(loss, expected_loss, rel_tol=TOLERANCE), label
        errors = {name: relative_l2(grads[name], expected[name]) for name in expected}
        assert max(errors.values()) <= TOLERANCE, (label, errors)


@pytest.mark.slow
def test_bad_batches_and_wrong_order_change_nothing(model_dir: str) -> None:
    engine = TrainingEngine(make_config(model_dir, training={"zero_stage": 2}))
    batch = make_batch(seed=6)
    fwd_bwd(engine, batch)
    engine.step()
    norm, steps = engine.weight_norm(), engine.step_count
    nan_advantages = {**batch, "advantages": batch["advantages"].clone()}
    nan_advantages["advantages"][0, 0] = math.nan
    out_of_vocabulary = {**batch, "input_ids": batch["input_ids"].clone()}
    out_of_vocabulary["input_ids"][0, -1] = engine.vocab_size
    for bad in (nan_advantages, out_of_vocabulary):
        with pytest.raises(BatchValidationError):
            fwd_bwd(engine, bad)
    with pytest.raises(ConfigError, match="nope"):
        engine.fwd_bwd(batch, loss_name="nope", loss_config={}, **step_denominators(batch))
    with pytest.raises(ValueError, match="global_tokens"):
        engine.fwd_bwd(batch, loss_name="grpo", loss_config={}, global_tokens=0.0, global_sequences=1.0)
    with pytest.raises(EngineStateError, match="fwd_bwd"):
        engine.step()
    engine.sleep()
    with pytest.raises(EngineStateError, match="wake"):
        fwd_bwd(engine, batch)
    with pytest.raises(EngineStateError):
        engine.sleep()
    engine.wake()
    with pytest.raises(EngineStateError):
        engine.wake()
    assert engine.weight_norm() == norm
    assert engine.step_count == steps


def _train(engine: TrainingEngine, batch: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, float]]:
    reply = fwd_bwd(engine, batch)
    return reply, engine.step()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_sleep_and_wake_keep_weights_and_optimizer_state(model_dir: str, stage: int) -> None:
    config = make_config(model_dir, training={"zero_stage": stage})
    first, second = make_batch(seed=7), make_batch(seed=8)
    awake, napping = TrainingEngine(config), TrainingEngine(config)
    for engine in (awake, napping):
        _train(engine, first)
    for mode in ("optimizer", "weights", "all", "moments"):
        napping.sleep(mode)
        assert napping.is_sleeping
        with pytest.raises(EngineStateError):
            napping.fwd_no_grad(first)
        napping.wake()
    expected, got = _train(awake, second), _train(napping, second)
    assert got == expected
    assert napping.weight_norm() == awake.weight_norm()


@pytest.mark.slow
def test_checkpoint_round_trip_gives_the_same_next_step_bitwise(model_dir: str, tmp_path: Path) -> None:
    config = make_config(
        model_dir,
        full_determinism=True,
        training={"zero_stage": 2, "warmup_steps": 2, "lr_schedule": "cosine", "total_steps": 6, "max_grad_norm": 0.5},
    )
    batches = [make_batch(seed=seed) for seed in (10, 11, 12)]
    try:
        original = TrainingEngine(config)
        lrs = []
        for step, batch in enumerate(batches[:2], start=1):
            lrs.append(_train(original, batch)[1]["lr"])
            directory = original.save_checkpoint(str(tmp_path), step, keep_last=1, hf_export=step == 2)
        assert lrs == [config.training.lr / 2, config.training.lr]
        # DeepSpeed also writes its conversion scripts (zero_to_fp32.py, ...) beside the checkpoints.
        assert sorted(entry for entry in os.listdir(tmp_path) if entry.startswith("global_step")) == ["global_step2"]
        assert (tmp_path / "latest").read_text().strip() == "global_step2"
        assert directory == str(tmp_path / "global_step2")
        expected = _train(original, batches[2])
        expected_weights = full_parameters(original)

        resumed = TrainingEngine(config)
        assert resumed.load_checkpoint(str(tmp_path)) == 2
        assert resumed.step_count == 2
        assert _train(resumed, batches[2]) == expected
        weights = full_parameters(resumed)
        assert all(torch.equal(weights[name], expected_weights[name]) for name in expected_weights)
        with pytest.raises(InvalidRequestError, match="global_step1"):
            resumed.load_checkpoint(str(tmp_path), step=1)
    finally:
        torch.use_deterministic_algorithms(False)

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "global_step2" / "hf"), dtype=torch.float32)
    reloaded = TrainingEngine(config)
    reloaded.load_checkpoint(str(tmp_path), step=2)
    saved = full_parameters(reloaded)
    assert all(torch.equal(parameter, saved[name]) for name, parameter in exported.named_parameters())


@pytest.mark.slow
def test_log_prob_engine_follows_the_trainer(model_dir: str) -> None:
    config = make_config(model_dir, training={"zero_stage": 2})
    trainer, scorer = TrainingEngine(config), LogProbEngine(config)
    batch = make_batch(seed=13)
    assert scorer.weight_norm() == trainer.weight_norm()
    _train(trainer, batch)
    assert scorer.weight_norm() != trainer.weight_norm()
    assert scorer.load_weights(trainer.iter_full_parameters()) == len(list(trainer.module.parameters()))
    assert scorer.weight_norm() == trainer.weight_norm()
    assert torch.equal(scorer.fwd_no_grad(batch)["logprobs"], trainer.fwd_no_grad(batch)["logprobs"])
    with pytest.raises(EngineError, match="shape"):
        scorer.load_weights([("lm_head.weight", torch.zeros(3, 3))])
    scorer.sleep("weights")
    with pytest.raises(EngineStateError):
        scorer.load_weights([])
    scorer.wake()
    assert scorer.weight_norm() == trainer.weight_norm()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_step_like_one_rank_on_the_same_global_batch(model_dir: str, stage: int, tmp_path: Path) -> None:
    from arctic_dedup.balance import partition_for_data_parallel, prompt_groups
    from arctic_dedup.plan.layout import SampleLayout

    batch = make_batch(10, 4, seed=14)
    layout = SampleLayout.from_padded(
        batch["input_ids"], RESPONSE_WIDTH, batch["attention_mask"], batch["position_ids"]
    )
    shares = partition_for_data_parallel(prompt_groups(layout), 2)
    _compare_two_ranks_with_one(model_dir, stage, batch, shares, tmp_path)


@pytest.mark.slow
def test_zero3_ranks_with_different_micro_batch_counts_step_like_one_rank(model_dir: str, tmp_path: Path) -> None:
    """Rank 0 holds three prompt groups, rank 1 one; a budget of one group per micro-batch gives them 3 and 1
    micro-batches. ZeRO-3 gathers parameters collectively in every pass: rank 1 must pad, or both hang."""
    from arctic_dedup.balance import prompt_groups
    from arctic_dedup.plan.layout import SampleLayout

    batch = make_batch(10, 4, seed=14)
    layout = SampleLayout.from_padded(
        batch["input_ids"], RESPONSE_WIDTH, batch["attention_mask"], batch["position_ids"]
    )
    groups = prompt_groups(layout)
    shares = [sorted(s for group in groups[:3] for s in group.samples), sorted(groups[3].samples)]
    budget = max(group.dedup_tokens for group in groups)
    ranks = _compare_two_ranks_with_one(model_dir, 3, batch, shares, tmp_path, training={"micro_batch_tokens": budget})
    assert [outcome["micro_batches"] for outcome in ranks] == [3, 1]


def _compare_two_ranks_with_one(
    model_dir: str,
    stage: int,
    batch: dict[str, torch.Tensor],
    shares: list[list[int]],
    tmp_path: Path,
    training: dict[str, Any] | None = None,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    # The ranks are fresh processes, so DeepSpeed starts its CPU communication backend there: nothing may be
    # compiled (its deepspeed_shm_comm op took minutes and a C++ compiler). torch writes every op it builds under
    # TORCH_EXTENSIONS_DIR, and a compiler that cannot run makes an attempted build fail the ranks.
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    no_compiler = tmp_path / "no-compiler"
    no_compiler.write_text("#!/bin/sh\necho 'the engines must not compile anything' >&2\nexit 1\n")
    no_compiler.chmod(0o755)
    build_environment = {"TORCH_EXTENSIONS_DIR": str(extensions), "CXX": str(no_compiler), "CC": str(no_compiler)}
    saved = {name: os.environ.get(name) for name in build_environment}
    os.environ.update(build_environment)
    try:
        context = torch.multiprocessing.start_processes(
            data_parallel_rank,
            args=(2, free_port(), model_dir, stage, batch, shares, str(tmp_path), training),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError(f"the two ranks did not finish within {timeout_s:.0f} s (a collective mismatch?)")
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    assert sorted(path.name for path in extensions.rglob("*")) == []

    single_training = {"zero_stage": stage, **GRADIENT_PROPORTIONAL_ADAM, **(training or {})}
    single = TrainingEngine(make_config(model_dir, training=single_training))
    single_log_probs = single.fwd_no_grad(batch)["logprobs"]
    for outcome, share in zip(ranks, shares, strict=True):
        assert float((outcome["log_probs"] - single_log_probs[share]).abs().max()) <= TOLERANCE
    reply, stepped = _train(single, batch)
    expected_weights = full_parameters(single)
    assert math.isclose(ranks[0]["loss"] + ranks[1]["loss"], reply["loss"], rel_tol=TOLERANCE)
    for outcome in ranks:
        assert math.isclose(outcome["step"]["grad_norm"], stepped["grad_norm"], rel_tol=TOLERANCE)
        assert outcome["step"]["lr"] == stepped["lr"]
        assert math.isclose(outcome["weight_norm"], single.weight_norm(), rel_tol=TOLERANCE)
    initial = dict(_initial_weights(model_dir))
    errors = {
        name: relative_l2(ranks[0]["weights"][name] - initial[name], expected_weights[name] - initial[name])
        for name in expected_weights
    }
    assert max(errors.values()) <= TOLERANCE, errors
    return ranks


def _initial_weights(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))
