"""DeduplicatedActor: loads from a local directory (text and VLM checkpoints), forwards verl batches, and takes
PPO steps whose loss and gradients equal the non-deduplicated actor's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from zorro_cases import TOLERANCE, float64_model, fresh_model, model_precision

from arctic_zorro_train import DeduplicatedActor, create_dummy_batch
from arctic_zorro_train.testing import collect_grads, relative_error


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_vlm"])
def test_loads_from_a_local_directory(tmp_path: Path, family: str) -> None:
    model = fresh_model(family)
    model.save_pretrained(tmp_path)
    actor = DeduplicatedActor(str(tmp_path), "cpu", dtype=torch.float32, attn_implementation="sdpa")
    assert type(actor.model) is type(model)
    batch = create_dummy_batch(4, 2, 8, 4, vocab_size=120, add_padding=True, seed=1)
    expected = DeduplicatedActor(model).forward(batch, calculate_entropy=True)
    output = actor.forward(batch, calculate_entropy=True)
    torch.testing.assert_close(output.logprobs, expected.logprobs)
    entropy, log_probs = actor._forward_micro_batch(batch, calculate_entropy=True)
    assert entropy is not None and log_probs.shape == batch["responses"].shape
    valid = batch["response_mask"].bool()
    torch.testing.assert_close(log_probs[valid], output.logprobs)
    assert torch.all(log_probs[~valid] == 0)


def test_policy_step_matches_the_non_deduplicated_actor() -> None:
    """In float64, like every exactness test (zorro_cases.py says why)."""
    batch = create_dummy_batch(8, 2, 12, 6, vocab_size=120, add_padding=True, include_training_fields=True, seed=4)
    results = {}
    for deduplicate in (True, False):
        model = float64_model("qwen3")
        actor = DeduplicatedActor(model, kl_coef=0.05, deduplicate=deduplicate, logits_optimization="memory")
        with model_precision(model):
            metrics = actor.compute_policy_loss_and_backward(batch, temperature=0.9, gradient_accumulation=2)
        results[deduplicate] = (metrics, collect_grads(model))
    (dedup_metrics, dedup_grads), (plain_metrics, plain_grads) = results[True], results[False]
    assert set(dedup_metrics) >= {"actor/policy_loss", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"}
    assert "actor/kl_loss" in dedup_metrics
    for name, value in plain_metrics.items():
        assert dedup_metrics[name] == pytest.approx(value, rel=TOLERANCE, abs=1e-7), name
    for name, grad in plain_grads.items():
        assert relative_error(dedup_grads[name], grad) <= TOLERANCE, name


def test_gradient_accumulation_divides_the_loss() -> None:
    batch = create_dummy_batch(4, 2, 6, 4, vocab_size=120, include_training_fields=True, seed=8)
    grads = {}
    for steps in (1, 4):
        model = fresh_model("qwen2")
        DeduplicatedActor(model).compute_policy_loss_and_backward(batch, gradient_accumulation=steps)
        grads[steps] = collect_grads(model)
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[4][name] * 4, grad, rtol=1e-5, atol=1e-8)


def test_loss_mask_excludes_masked_response_tokens() -> None:
    batch = create_dummy_batch(4, 2, 6, 5, vocab_size=120, include_training_fields=True, seed=9)
    masked = dict(batch)
    masked["response_mask"] = batch["response_mask"].clone()
    masked["response_mask"][:, 3:] = 0
    # Masked tokens' advantages no longer matter.
    changed = dict(masked)
    changed["advantages"] = batch["advantages"].clone()
    changed["advantages"][:, 3:] = 100.0
    values = [DeduplicatedActor(fresh_model("qwen3")).compute_policy_loss_and_backward(b) for b in (masked, changed)]
    assert values[0]["actor/policy_loss"] == pytest.approx(values[1]["actor/policy_loss"], rel=1e-6)
