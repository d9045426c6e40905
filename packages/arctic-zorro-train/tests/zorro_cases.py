"""Shared helpers for the zorro-train tests: explicit batch layouts and the dedup-vs-reference comparison.

Exactness is tested in float64. The deduplicated model and the plain per-sample transformers run share the same
float64 weights and run inside ``float64_everywhere`` (transformers' internal fp32 casts keep float64), so the two
differ only by float64 rounding: at most 1.1e-14 over the whole suite (the session summary prints the largest),
gradients with heavy cancellation (q/k projections of 2-3 token sequences, the Gated DeltaNet decay parameters)
included. The bound is still 1e-5 for every value and every parameter, so any real mistake (a wrong mask, a missing
child gradient, a shifted conv tail) fails by orders of magnitude. fp32 could not carry that bound everywhere: on those
cancelling gradients fp32 rounding alone moves transformers' own results by more than 1e-5. A smaller fp32 suite
(``test_families.py``) keeps 1e-5 on cases where fp32 is well-conditioned.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from arctic_zorro_train import DeduplicatedActor, ppo_policy_loss
from arctic_zorro_train.testing import (
    build_model,
    collect_grads,
    float64_everywhere,
    gradient_errors,
    per_sample_reference,
    tiny_config,
)

TOLERANCE = 1e-5
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_vlm", "qwen3_5_moe_vlm")

# The largest dedup-vs-reference difference seen in this session, per dtype (and setup): (difference, what, test).
LARGEST_DIFFERENCES: dict[str, tuple[float, str, str]] = {}


@dataclass(frozen=True)
class Sample:
    prompt: Sequence[int]
    response: Sequence[int]


def make_batch(
    samples: Sequence[Sample],
    *,
    extra_prompt_padding: int = 0,
    extra_response_padding: int = 0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A verl batch (left-padded prompts, right-padded responses) with random training fields."""
    prompt_width = max(len(s.prompt) for s in samples) + extra_prompt_padding
    response_width = max(len(s.response) for s in samples) + extra_response_padding
    batch_size = len(samples)
    input_ids = torch.zeros(batch_size, prompt_width + response_width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, sample in enumerate(samples):
        start = prompt_width - len(sample.prompt)
        input_ids[row, start:prompt_width] = torch.tensor(sample.prompt)
        mask[row, start:prompt_width] = 1
        input_ids[row, prompt_width : prompt_width + len(sample.response)] = torch.tensor(sample.response)
        mask[row, prompt_width : prompt_width + len(sample.response)] = 1
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, response_width)
    old = -torch.rand(shape, generator=generator) * 5.0
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp_min(0),
        "responses": input_ids[:, prompt_width:],
        "response_mask": mask[:, prompt_width:],
        "old_log_probs": old,
        "advantages": torch.randn(shape, generator=generator),
        "ref_log_prob": old + 0.1 * torch.randn(shape, generator=generator),
    }


def long_samples() -> list[Sample]:
    """Groups of three, two and one (non-contiguous), every sequence 25-32 tokens long: the fp32 cases."""
    generator = torch.Generator().manual_seed(7)

    def tokens(length: int) -> list[int]:
        return torch.randint(1, 120, (length,), generator=generator).tolist()

    first, second, third = tokens(20), tokens(16), tokens(24)
    return [
        Sample(first, tokens(12)),
        Sample(second, tokens(9)),
        Sample(first, tokens(10)),
        Sample(third, tokens(8)),
        Sample(second, tokens(12)),
        Sample(first, tokens(11)),
    ]


def fresh_model(
    family: str, attn_implementation: str = "eager", *, dtype: torch.dtype = torch.float32, **overrides: object
) -> Any:
    return build_model(tiny_config(family, **overrides), dtype=dtype, attn_implementation=attn_implementation)


def float64_model(family: str, attn_implementation: str = "eager", **overrides: object) -> Any:
    """The exactness tests' model: a tiny random-init ``family`` model in float64."""
    return fresh_model(family, attn_implementation, dtype=torch.float64, **overrides)


def model_precision(model: nn.Module) -> Any:
    """``float64_everywhere`` for a float64 model (a float64 run with no fp32 step), nothing otherwise."""
    return float64_everywhere() if next(model.parameters()).dtype == torch.float64 else nullcontext()


def reference_loss(
    model: Any, batch: dict[str, torch.Tensor], *, temperature: float = 1.0, kl_coef: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, logprobs, entropy) of the plain model run per sample, with the same loss as DeduplicatedActor."""
    width = batch["responses"].shape[1]
    reference = per_sample_reference(model, batch, width, temperature)
    valid = batch["attention_mask"][:, -width:].bool()
    loss, _ = ppo_policy_loss(
        reference.logprobs,
        batch["old_log_probs"][valid],
        batch["advantages"][valid],
        batch["response_mask"][valid].float(),
        ref_logprobs=batch["ref_log_prob"][valid],
        kl_coef=kl_coef,
    )
    config = model.config.get_text_config()
    if reference.router_logits and getattr(config, "output_router_logits", False):
        modeling = sys.modules[type(model).__module__]
        aux = modeling.load_balancing_loss_func(reference.router_logits, config.num_experts, config.num_experts_per_tok)
        loss = loss + config.router_aux_loss_coef * aux
    return loss, reference.logprobs.detach(), reference.entropy.detach()


def compare_with_reference(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    actor: DeduplicatedActor | None = None,
    temperature: float = 1.0,
    kl_coef: float = 0.1,
    check_grads: bool = True,
    **actor_options: object,
) -> dict[str, float]:
    """Assert dedup logprobs/entropy (max abs), the loss and every parameter gradient (relative L2) are within
    ``TOLERANCE`` of the per-sample run of the same model; return the differences."""
    dtype = next(model.parameters()).dtype
    with model_precision(model):
        model.zero_grad(set_to_none=True)
        loss, logprobs, entropy = reference_loss(model, batch, temperature=temperature, kl_coef=kl_coef)
        if check_grads:
            loss.backward()
        expected_grads = collect_grads(model)
        model.zero_grad(set_to_none=True)
        actor = actor or DeduplicatedActor(model, kl_coef=kl_coef, **actor_options)  # type: ignore[arg-type]
        with torch.no_grad():
            output = actor.forward(batch, temperature=temperature, calculate_entropy=True)
        assert output.entropy is not None
        assert output.logprobs.shape == logprobs.shape
        # fp32 softmax math, float64 for a float64 model: no step of the float64 run rounds to fp32.
        expected_dtype = torch.promote_types(dtype, torch.float32)
        assert output.logprobs.dtype == output.entropy.dtype == logprobs.dtype == expected_dtype
        errors = {
            "logprobs": float((output.logprobs - logprobs).abs().max()),
            "entropy": float((output.entropy - entropy).abs().max()),
        }
        if check_grads:
            metrics = actor.compute_policy_loss_and_backward(batch, temperature=temperature)
            errors["loss"] = abs(metrics["actor/policy_loss"] - float(loss.detach()))
            errors.update(gradient_errors(model, expected_grads))
    record_differences(str(dtype).removeprefix("torch."), errors)
    above = {name: error for name, error in errors.items() if error > TOLERANCE}
    assert not above, f"{dtype}: {above} differ by more than {TOLERANCE}"
    return errors


def record_differences(label: str, errors: dict[str, float]) -> None:
    """Note the largest of ``errors`` under ``label`` for the session summary (conftest.py)."""
    name = max(errors, key=errors.__getitem__)
    if errors[name] > LARGEST_DIFFERENCES.get(label, (-1.0, "", ""))[0]:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").removesuffix(" (call)")
        LARGEST_DIFFERENCES[label] = (errors[name], name, test)
