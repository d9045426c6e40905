"""The reference twin against an independent oracle: plain causal attention over every sample on its own."""

from __future__ import annotations

import pytest
import torch
from tree_attention_cases import CPU_CASES, Case, make_inputs, per_sample_attention

from arctic_dedup import unpack
from arctic_dedup.attention import tree_attention_reference


def _reference_unpacked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, **options) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out, _ = tree_attention_reference(q, k, v, plan.kv_visible_until, position_ids=plan.position_ids, **options)
    return unpack(out, plan, backend="torch")


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize(
    "options", [{}, {"sliding_window": 4}, {"softcap": 2.0, "scale": 0.7}], ids=["plain", "window", "softcap"]
)
def test_reference_matches_per_sample_attention(case: Case, options: dict) -> None:
    plan = case.build()
    q, k, v = make_inputs(plan, 4, 2, 16, torch.float64, seed=1)
    expected = per_sample_attention(q.double(), k.double(), v.double(), plan, **options)
    actual = _reference_unpacked(q, k, v, plan, **options)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CPU_CASES[:7], ids=lambda c: c.name)
def test_reference_gradients_match_per_sample_attention(case: Case) -> None:
    plan = case.build()
    q, k, v = make_inputs(plan, 4, 1, 16, torch.float32, seed=2, requires_grad=True)
    weight = torch.randn(plan.num_sample_tokens, 4, 16, generator=torch.Generator().manual_seed(3))
    (_reference_unpacked(q, k, v, plan) * weight).sum().backward()
    reference_grads = [t.grad.clone() for t in (q, k, v)]  # type: ignore[union-attr]
    for t in (q, k, v):
        t.grad = None
    (per_sample_attention(q, k, v, plan) * weight).sum().backward()
    for got, expected in zip(reference_grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_reference_lse_is_natural_log() -> None:
    plan = CPU_CASES[2].build()
    q, k, v = make_inputs(plan, 2, 2, 16, torch.float64)
    _, lse = tree_attention_reference(q, k, v, plan.kv_visible_until)
    # The first token sees only itself: lse = its own scaled score.
    expected = (q[0] * k[0]).sum(-1) / 4.0
    torch.testing.assert_close(lse[0].double(), expected.double())


def test_reference_refuses_large_inputs() -> None:
    plan = CPU_CASES[0].build()
    q, k, v = make_inputs(plan, 2, 2, 16)
    with pytest.raises(ValueError, match="backend='flex' or 'triton'"):
        tree_attention_reference(q, k, v, plan.kv_visible_until, max_scores=10)
