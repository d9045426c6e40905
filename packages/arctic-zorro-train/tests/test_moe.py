"""MoE: the router aux loss and expert-load statistics of a deduplicated forward equal the non-deduplicated
batch's (packed tokens weighted by their multiplicity). Compared in float64 (zorro_cases.py says why)."""

from __future__ import annotations

import sys

import pytest
import torch
from zorro_cases import float64_model, fresh_model

from arctic_zorro_train import DeduplicatedActor, create_dummy_batch, plan_batch, zorro_forward
from arctic_zorro_train.testing import float64_everywhere, per_sample_reference

MOE_FAMILIES = ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_vlm"]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_aux_loss_and_expert_load_match_the_padded_batch(family: str) -> None:
    model = float64_model(family)
    batch = create_dummy_batch(8, 2, 10, 6, vocab_size=120, add_padding=True, seed=7)
    width = 6
    config = model.config.get_text_config()
    with float64_everywhere(), torch.no_grad():
        padded = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            output_router_logits=True,
            use_cache=False,
        )
        reference = per_sample_reference(model, batch, width)
        DeduplicatedActor(model)
        plan = plan_batch(batch["input_ids"], width, batch["attention_mask"], batch["position_ids"])
        output = zorro_forward(model, plan)
    assert plan.num_packed_tokens < plan.num_sample_tokens
    assert output.aux_loss is not None and output.expert_load is not None and output.router_probability is not None
    # transformers' own aux loss of the padded batch (its attention mask drops the padding).
    expected = getattr(padded, "aux_loss", None)
    if expected is None:
        modeling = sys.modules[type(model).__module__]
        expected = modeling.load_balancing_loss_func(
            padded.router_logits, config.num_experts, config.num_experts_per_tok, batch["attention_mask"]
        )
    assert output.aux_loss.dtype == expected.dtype == torch.float64
    torch.testing.assert_close(output.aux_loss, expected, rtol=1e-5, atol=1e-7)
    # Expert load: top-k assignments over every sample's valid tokens.
    expected_load = torch.stack(
        [
            torch.bincount(
                torch.topk(torch.softmax(logits, -1), config.num_experts_per_tok, dim=-1).indices.reshape(-1),
                minlength=config.num_experts,
            ).to(output.expert_load.dtype)
            for logits in reference.router_logits
        ]
    )
    torch.testing.assert_close(output.expert_load, expected_load)
    assert float(output.expert_load.sum()) == plan.num_sample_tokens * config.num_experts_per_tok * len(
        reference.router_logits
    )
    expected_probability = torch.stack([torch.softmax(x, -1).mean(0) for x in reference.router_logits])
    torch.testing.assert_close(output.router_probability, expected_probability, rtol=1e-5, atol=1e-6)


def test_aux_loss_enters_the_policy_loss_only_when_configured() -> None:
    batch = create_dummy_batch(4, 1, 6, 4, vocab_size=120, include_training_fields=True, seed=2)
    losses = {}
    for enabled in (False, True):
        model = fresh_model("qwen3_moe", output_router_logits=enabled)
        metrics = DeduplicatedActor(model).compute_policy_loss_and_backward(batch)
        losses[enabled] = metrics
    coefficient = fresh_model("qwen3_moe").config.router_aux_loss_coef
    assert losses[True]["actor/policy_loss"] == pytest.approx(
        losses[False]["actor/policy_loss"] + coefficient * losses[True]["actor/moe_aux_loss"], rel=1e-5
    )
