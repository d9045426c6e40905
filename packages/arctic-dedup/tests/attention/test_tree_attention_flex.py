"""FlexAttention backend against the reference: forward on CPU (eager), forward and backward on the GPU."""

from __future__ import annotations

import pytest
import torch
from tree_attention_cases import CPU_CASES, Case, make_inputs, prompt_groups_plan

from arctic_dedup.attention import tree_attention
from arctic_dedup.attention.flex import flex_padded_length, flex_tree_attention
from arctic_dedup.attention.metadata import prepare_tree_attention

OPTIONS = [{}, {"sliding_window": 5}, {"softcap": 3.0, "scale": 0.5}]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "window", "softcap"])
def test_flex_forward_matches_reference_on_cpu(case: Case, options: dict) -> None:
    plan = case.build()
    q, k, v = make_inputs(plan, 4, 2, 16, seed=5)
    out, lse = tree_attention(q, k, v, plan, backend="flex", return_lse=True, **options)
    ref, ref_lse = tree_attention(q, k, v, plan, backend="reference", return_lse=True, **options)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:2] and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_flex_refuses_gradients_on_cpu() -> None:
    plan = CPU_CASES[0].build()
    q, k, v = make_inputs(plan, 2, 2, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backend='reference'"):
        tree_attention(q, k, v, plan, backend="flex")


def test_padded_length_buckets() -> None:
    assert flex_padded_length(1) == 128
    assert flex_padded_length(1000) == 1024
    assert flex_padded_length(16384) == 16384
    assert flex_padded_length(16385) == 20480
    lengths = range(1, 70000, 97)
    assert all(flex_padded_length(n) >= n and flex_padded_length(n) % 128 == 0 for n in lengths)
    assert all(flex_padded_length(n) <= max(1.25 * n, n + 127) for n in lengths)
    # Four shape classes per octave above 1024 tokens.
    assert len({flex_padded_length(n) for n in range(8193, 16385)}) == 4


@pytest.mark.slow
def test_compiled_flex_never_treats_padding_as_visible() -> None:
    """T = 128k + 1: the last key block holds one real key. Compiled FlexAttention skips the mask function on blocks
    listed as full, so a full-listed last block would let the padded keys in (eager FlexAttention masks anyway and
    cannot catch this). CPU compile: inference only, no lse."""
    plan = prompt_groups_plan([126], [[3]])
    assert plan.num_packed_tokens == 129
    q, k, v = make_inputs(plan, 2, 1, 16, seed=3)
    # Large keys make any leaked padded (zero) key visible in the output.
    metadata = prepare_tree_attention(plan, backends=("flex",), head_dim=16, dtype=q.dtype)
    out, _ = flex_tree_attention(q, k * 4, v, metadata, scale=0.25, return_lse=False, compile=True)
    ref = tree_attention(q, k * 4, v, plan, backend="reference", scale=0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
