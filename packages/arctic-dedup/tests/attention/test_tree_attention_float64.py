"""float64 on the reference backend (and ``auto`` on CPU): computed in float64 end to end, so whole-model tests can
compare with no fp32 rounding in the way; every other backend refuses float64 and says where it runs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from tree_attention_cases import CPU_CASES, Case, make_inputs, prompt_groups_plan

from arctic_dedup import Plan, unpack
from arctic_dedup.attention import MAX_REFERENCE_SCORES, TreeAttentionBackend, tree_attention

OPTIONS = [{}, {"sliding_window": 4}, {"softcap": 2.0, "scale": 0.7}]
OPTION_IDS = ["plain", "window", "softcap"]


def per_sample_attention_float64(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: Plan,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain causal attention over every sample on its own, in float64: ``[N, Hq, D]`` in sample order."""
    scale = 1.0 / math.sqrt(query.shape[2]) if scale is None else scale
    group = query.shape[1] // key.shape[1]
    q_all, k_all, v_all = (unpack(t, plan, backend="torch") for t in (query, key, value))
    outputs = []
    for begin, end in itertools.pairwise(plan.layout.sample_offsets.tolist()):
        q = q_all[begin:end].transpose(0, 1)
        k = k_all[begin:end].transpose(0, 1).repeat_interleave(group, dim=0)
        v = v_all[begin:end].transpose(0, 1).repeat_interleave(group, dim=0)
        scores = q @ k.transpose(1, 2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        row = torch.arange(end - begin)[:, None]
        column = torch.arange(end - begin)[None, :]
        visible = column <= row
        if sliding_window is not None:
            visible &= row - column < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1))
    return torch.cat(outputs)


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_float64_forward_and_backward_are_float64(case: Case, options: dict, backend: TreeAttentionBackend) -> None:
    plan = case.build()
    q, k, v = make_inputs(plan, 4, 2, 16, torch.float64, seed=1, requires_grad=True)
    out, lse = tree_attention(q, k, v, plan, backend=backend, return_lse=True, **options)
    assert out.dtype == lse.dtype == torch.float64
    weight = torch.randn(plan.num_sample_tokens, 4, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (unpack(out, plan, backend="torch") * weight).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]  # type: ignore[union-attr]
    assert all(grad.dtype == torch.float64 for grad in grads)
    for t in (q, k, v):
        t.grad = None
    expected = per_sample_attention_float64(q, k, v, plan, **options)
    (expected * weight).sum().backward()
    # fp32 anywhere on the way would leave errors near 1e-7; float64 throughout leaves rounding near 1e-15.
    assert float((unpack(out.detach(), plan, backend="torch") - expected.detach()).abs().max()) <= 1e-12
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert float((got - want).abs().max()) <= 1e-12


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_float64_reference_passes_gradcheck(options: dict) -> None:
    """Finite differences need float64: the reference's analytic gradients (output and lse) against them."""
    plan = prompt_groups_plan([5, 3], [[2, 1, 0], [3]])
    inputs = make_inputs(plan, 2, 1, 16, torch.float64, seed=3, requires_grad=True)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tree_attention(q, k, v, plan, backend="reference", return_lse=True, **options)  # type: ignore[no-any-return]

    assert torch.autograd.gradcheck(attention, inputs)


@pytest.mark.parametrize("backend", ["flex", "triton", "varlen"])
def test_other_backends_refuse_float64(backend: TreeAttentionBackend) -> None:
    plan = CPU_CASES[2].build()
    q, k, v = make_inputs(plan, 4, 2, 16, torch.float64)
    with pytest.raises(TypeError, match=f"only on backend='reference'.*backend='{backend}'"):
        tree_attention(q, k, v, plan, backend=backend)


def test_auto_refuses_float64_where_it_picks_a_fused_backend() -> None:
    # Too many scores for the reference and no gradient: auto picks flex on CPU, which refuses float64.
    num_tokens = math.isqrt(MAX_REFERENCE_SCORES // 4) + 1
    plan = prompt_groups_plan([num_tokens - 1], [[1]])
    q, k, v = make_inputs(plan, 4, 2, 16, torch.float64)
    with pytest.raises(TypeError, match="backend='auto' picked 'flex'"):
        tree_attention(q, k, v, plan)


def test_float64_must_be_shared_by_query_key_and_value() -> None:
    plan = CPU_CASES[2].build()
    q, k, v = make_inputs(plan, 4, 2, 16)
    with pytest.raises(TypeError, match="share a dtype"):
        tree_attention(q.double(), k, v, plan, backend="reference")
