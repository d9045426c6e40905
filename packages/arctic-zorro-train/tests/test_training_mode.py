"""Deduplicated gradients in training mode on models loaded as users load them (issue #37).

transformers 5.25 depends on ``kernels`` and kernelizes a model loaded with ``from_pretrained``, again on every
``train()`` / ``eval()`` switch; kernelize drops a forward set on a module instance for the classes transformers
decorates with ``use_kernel_forward_from_hub`` (Qwen3.5's Gated DeltaNet layers among them). Patched before the
switch to ``train()``, the Gated DeltaNet layers then ran their own forward over the packed stream as one sequence:
gradients 16% off, silently. These tests load models from disk, patch them, switch modes, and compare every
parameter gradient with plain per-sample runs. Marked ``parity``: rerun on the oldest and newest tested transformers.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from zorro_cases import TOLERANCE, Sample, make_batch

from arctic_zorro_train import DeduplicatedActor, apply_zorro, load_model, zorro_forward
from arctic_zorro_train.actor import response_token_values
from arctic_zorro_train.gated_delta import _torch_chunk_rule_for
from arctic_zorro_train.parity import measure_parity
from arctic_zorro_train.plans import plan_batch
from arctic_zorro_train.testing import build_model, collect_grads, long_samples, relative_error, tiny_config

pytestmark = pytest.mark.parity


def issue_batch() -> dict[str, torch.Tensor]:
    """The issue's batch: 6 left-padded prompt rows from 3 distinct prompts of 2-12 tokens (rows of one prompt not
    contiguous), right-padded responses of 1-9 tokens, random advantages."""
    generator = torch.Generator().manual_seed(37)

    def tokens(length: int) -> list[int]:
        return torch.randint(1, 120, (length,), generator=generator).tolist()

    prompts = [tokens(2), tokens(7), tokens(12)]
    responses = [tokens(length) for length in (3, 9, 1, 5, 2, 7)]
    return make_batch([Sample(prompts[row % 3], response) for row, response in enumerate(responses)], seed=37)


def per_sample_policy_gradient(model_dir: Path, batch: dict[str, torch.Tensor], attn_implementation: str) -> Any:
    """The gradient of ``-(A * logp).sum() / N`` (the on-policy PPO loss) of a plain model loaded from
    ``model_dir`` and trained (``train()``), each sample run alone without padding."""
    model = load_model(model_dir, dtype=torch.float32, attn_implementation=attn_implementation)
    model.train()
    width = batch["responses"].shape[1]
    mask = batch["attention_mask"].bool()
    loss = torch.zeros(())
    for row in range(mask.shape[0]):
        ids = batch["input_ids"][row][mask[row]].unsqueeze(0)
        prompt = int(mask[row][:-width].sum())
        logits = model(input_ids=ids, use_cache=False).logits[0, prompt - 1 : -1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, prompt:, None]).squeeze(-1)
        loss = loss - (batch["advantages"][row, : logprobs.shape[0]] * logprobs).sum()
    (loss / batch["response_mask"].sum()).backward()
    return collect_grads(model)


def save_tiny_qwen3_5(directory: Path, attn_implementation: str) -> None:
    build_model(tiny_config("qwen3_5"), attn_implementation=attn_implementation).save_pretrained(directory)


def assert_every_gradient_matches(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    errors = {name: relative_error(grad, expected[name]) for name, grad in collect_grads(model).items()}
    assert errors.keys() == expected.keys()
    worst = sorted(errors.items(), key=lambda item: -item[1])[:5]
    assert max(errors.values()) <= TOLERANCE, f"worst gradient rel-L2: {worst}"


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_issue_37_policy_loss_in_training_mode_matches_per_sample_gradients(
    attn_implementation: str, tmp_path: Path
) -> None:
    """The issue's reproduction: load, log-probs in eval mode (as loaded), ``model.train()``, policy loss and
    backward on-policy; every parameter's gradient within 1e-5 of the per-sample run (fp32)."""
    save_tiny_qwen3_5(tmp_path, attn_implementation)
    actor = DeduplicatedActor(
        model_name_or_path=tmp_path,
        device="cpu",
        use_split_attention=True,
        attn_implementation=attn_implementation,
        dtype=torch.float32,
    )
    batch = issue_batch()
    assert not actor.model.training
    with torch.no_grad():
        current = actor.forward(batch)
    batch["old_log_probs"] = current.padded(current.logprobs, batch["responses"].shape[1])
    actor.model.train()
    actor.compute_policy_loss_and_backward(batch, temperature=1.0, gradient_accumulation=1)
    assert_every_gradient_matches(actor.model, per_sample_policy_gradient(tmp_path, batch, attn_implementation))


def test_issue_37_zorro_forward_in_training_mode_matches_per_sample_gradients(tmp_path: Path) -> None:
    """The same through ``zorro_forward`` on a model patched with ``apply_zorro`` and switched eval -> train."""
    save_tiny_qwen3_5(tmp_path, "sdpa")
    model = load_model(tmp_path, dtype=torch.float32, attn_implementation="sdpa")
    apply_zorro(model)
    model.eval()
    model.train()
    batch = issue_batch()
    plan = plan_batch(batch["input_ids"], batch["responses"].shape[1], batch["attention_mask"], batch["position_ids"])
    output = zorro_forward(model, plan)
    advantages = response_token_values(batch, "advantages")
    (-(advantages * output.logprobs).sum() / batch["response_mask"].sum()).backward()
    assert_every_gradient_matches(model, per_sample_policy_gradient(tmp_path, batch, "sdpa"))


def drop_patched_forwards(model: torch.nn.Module) -> int:
    """What kernels' ``kernelize`` does to a layer of a decorated class without a hub kernel for the device: it
    removes the forward set on the instance. Returns how many layers lost one."""
    dropped = 0
    for module in model.modules():
        if module.__dict__.pop("forward", None) is not None:
            dropped += 1
    return dropped


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_patched_layers_survive_what_kernelize_does(family: str) -> None:
    """Every transformers version: patched layer forwards removed after patching (as kernelize does on a
    ``train()`` / ``eval()`` switch) are back for the next deduplicated forward, and parity holds in both modes."""
    model = build_model(tiny_config(family))
    actor = DeduplicatedActor(model, kl_coef=0.1)
    assert drop_patched_forwards(model) > 0
    report = measure_parity(model, make_batch(long_samples(), extra_prompt_padding=1), actor=actor)
    assert report.passed, report.failures()
    assert report.modes == ("eval", "train")


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "qwen3_5_moe_vlm"])
def test_gradient_checkpointing_on_a_loaded_model_in_both_modes(family: str) -> None:
    model = build_model(tiny_config(family), from_pretrained=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    report = measure_parity(model, make_batch(long_samples(), extra_prompt_padding=1))
    assert report.passed, report.failures()


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_the_torch_kernel_is_transformers_own_function(family: str) -> None:
    """Where fla cannot train, the tree path runs transformers' torch kernel: the plain function, not the wrapper
    that calls fla when fla is importable (transformers 5.25 with `kernels` makes that wrapper a module)."""
    model = build_model(tiny_config(family))
    layer = next(module for module in model.modules() if type(module).__name__.endswith("GatedDeltaNet"))
    kernel = _torch_chunk_rule_for(layer)
    assert inspect.isfunction(kernel) and not hasattr(kernel, "__wrapped__")
    assert kernel.__name__ == "torch_chunk_gated_delta_rule"
    assert kernel.__module__ == type(layer).__module__
