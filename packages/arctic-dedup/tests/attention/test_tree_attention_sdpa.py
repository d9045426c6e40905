"""The ``sdpa`` backend (prompt + responses trees as dense fused-kernel calls merged by log-sum-exp) against the
reference, in fp32 on CPU through torch's CPU flash kernel: equal and ragged responses, empty and one-token
responses, groups of one, several trees, GQA; and what it refuses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import PaddedBatch, padded_batches
from tree_attention_cases import deep_trie_plan, make_inputs, prompt_groups_plan, random_tree_plan

from arctic_dedup import Plan, build_plan
from arctic_dedup.attention import tree_attention
from arctic_dedup.attention.sdpa import sdpa_kernel_name

PLANS = {
    "equal_responses": lambda: prompt_groups_plan([37], [[9, 9, 9, 9]]),
    "ragged_with_empty": lambda: prompt_groups_plan([40, 13], [[0, 1, 17, 5, 17], [6, 1]]),
    "single_samples": lambda: prompt_groups_plan([5, 8, 3], [[4], [1], [7]]),
    "many_trees_mixed": lambda: prompt_groups_plan([21, 2, 30], [[8, 8], [3, 11, 1, 1], [16]]),
}


def _check_against_reference(plan: Plan, heads_q: int, heads_kv: int, head_dim: int, seed: int) -> None:
    q, k, v = make_inputs(plan, heads_q, heads_kv, head_dim, requires_grad=True, seed=seed)
    out, lse = tree_attention(q, k, v, plan, backend="sdpa", scale=0.3, return_lse=True)
    ref, ref_lse = tree_attention(q, k, v, plan, backend="reference", scale=0.3, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    expected = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for name, got, want in zip("qkv", grads, expected):
        # A query that sees one key has dq = 0 exactly (softmax of one score is constant): then compare absolutely.
        scale = float(want.norm()) or 1.0
        error = float((got - want).norm()) / scale
        assert error < 1e-5, f"d{name}: relative L2 error {error:.2e}"


@pytest.mark.parametrize("name", list(PLANS))
@pytest.mark.parametrize(("heads_q", "heads_kv"), [(4, 4), (4, 1), (8, 2)])
def test_sdpa_matches_reference_fp32(name: str, heads_q: int, heads_kv: int) -> None:
    assert sdpa_kernel_name(torch.device("cpu")) == "cpu_flash"
    _check_against_reference(PLANS[name](), heads_q, heads_kv, 16, seed=3)


def test_sdpa_head_dim_64_and_reused_plan() -> None:
    plan = PLANS["ragged_with_empty"]()
    for seed in (1, 2):  # the second call takes the per-plan cache
        _check_against_reference(plan, 4, 2, 64, seed=seed)


def test_sdpa_refuses_what_it_cannot_run() -> None:
    plan = PLANS["equal_responses"]()
    q, k, v = make_inputs(plan, 2, 2, 16)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        tree_attention(q, k, v, plan, backend="sdpa", sliding_window=4)
    with pytest.raises(NotImplementedError, match="softcap"):
        tree_attention(q, k, v, plan, backend="sdpa", softcap=2.0)


@pytest.mark.parametrize("scale", [1, 2])
def test_sdpa_runs_deep_tries(scale: int) -> None:
    """A 4-level trie (shared system prompt, questions, partial responses, branches): rows merge three times."""
    plan = deep_trie_plan("cpu", scale=scale)
    assert plan.tree.num_levels > 2
    _check_against_reference(plan, 4, 2, 16, seed=scale)


@pytest.mark.parametrize("seed", range(8))
def test_sdpa_runs_random_trees(seed: int) -> None:
    plan = random_tree_plan(seed)
    _check_against_reference(plan, 4, 2, 16, seed=seed)


def test_sdpa_lse_gradient_is_refused() -> None:
    plan = PLANS["equal_responses"]()
    q, k, v = make_inputs(plan, 2, 2, 16, requires_grad=True)
    _, lse = tree_attention(q, k, v, plan, backend="sdpa", return_lse=True)
    with pytest.raises(NotImplementedError, match="lse"):
        lse.sum().backward()


@pytest.mark.parametrize("name", ["equal_responses", "ragged_with_empty", "many_trees_mixed"])
def test_sdpa_branch_isolation_is_bit_exact(name: str) -> None:
    """Changing every token outside one sample (its prompt and response) leaves that sample's outputs bit-identical:
    siblings share the batched calls (B and C) but never each other's rows."""
    plan = PLANS[name]()
    q, k, v = make_inputs(plan, 4, 2, 16, seed=7)
    base = tree_attention(q, k, v, plan, backend="sdpa")
    generator = torch.Generator().manual_seed(8)
    for sample in range(plan.num_samples):
        begin, end = plan.layout.sample_offsets[sample : sample + 2].tolist()
        inside = torch.zeros(plan.num_packed_tokens, dtype=torch.bool)
        inside[plan.unpack_map.gather_index[begin:end]] = True
        outside = ~inside
        if not bool(outside.any()):
            continue
        changed = [t.clone() for t in (q, k, v)]
        for tensor in changed:
            tensor[outside] = torch.randn(tensor[outside].shape, generator=generator) * 10
        out = tree_attention(changed[0], changed[1], changed[2], plan, backend="sdpa")
        assert torch.equal(out[inside], base[inside]), f"sample {sample}"
        assert not torch.equal(out[outside], base[outside])


def test_sdpa_deterministic_picks_flash_and_repeats() -> None:
    from arctic_dedup.attention import sdpa

    # On CUDA, determinism means FlashAttention-2's backward (decided before the device is queried).
    assert sdpa._kernel_for(torch.device("cuda"), deterministic=True) is sdpa._CudaFlash
    plan = PLANS["ragged_with_empty"]()
    grads = []
    for _ in range(2):
        q, k, v = make_inputs(plan, 4, 2, 16, requires_grad=True, seed=11)
        out = tree_attention(q, k, v, plan, backend="sdpa", deterministic=True)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert not torch.are_deterministic_algorithms_enabled()  # the flag is restored after the backward


@pytest.mark.parametrize("name", ["ragged_with_empty", "many_trees_mixed"])
def test_sdpa_ragged_varlen_path_matches_reference(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, ragged responses run part C as one FlashAttention-2 varlen call over their own rows; here the same
    integration (lse layout [H, rows], merge, backward with the merged output and lse) through a dense stand-in for
    the varlen kernels. The real kernels run in the GPU tests."""
    from test_tree_attention_varlen import DenseVarlenKernels

    from arctic_dedup.attention import sdpa, sdpa_calls

    monkeypatch.setattr(sdpa_calls, "_ragged_runs_use_varlen", lambda device: True)
    monkeypatch.setattr(sdpa, "_TorchFlash", DenseVarlenKernels)
    for heads in ((4, 4), (8, 2)):
        _check_against_reference(PLANS[name](), *heads, 16, seed=5)
    _check_against_reference(deep_trie_plan("cpu"), 4, 2, 16, seed=6)


def test_compiled_merge_equals_eager() -> None:
    """The merge that CUDA runs compiled (one fused kernel), compiled here on CPU, against the eager merge, with the
    strided lse views the backend passes and two row counts (dynamic shapes, one compilation)."""
    from arctic_dedup.attention.sdpa import _merge_eager

    compiled = torch.compile(_merge_eager, dynamic=True, fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    for rows in (37, 100):
        out_a, out_b = (torch.randn(rows, 4, 16, generator=generator) for _ in range(2))
        lse_a, lse_b = (torch.randn(4, rows, generator=generator).t() for _ in range(2))
        for got, want in zip(compiled(out_a, lse_a, out_b, lse_b), _merge_eager(out_a, lse_a, out_b, lse_b)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    padded_batches(max_samples=10, max_prompt=9, max_response=6),
    st.sampled_from([(2, 2), (4, 1), (4, 2)]),
    st.sampled_from(["prompt", "trie"]),
)
def test_sdpa_matches_reference_on_random_batches(batch: PaddedBatch, heads: tuple[int, int], sharing: str) -> None:
    """Random verl batches planned with prompt or trie sharing (left/right padding, ragged and empty responses,
    groups of one, non-contiguous group members, identical ids with different masks, partial prompt overlap): fp32
    outputs, lse and gradients within 1e-5 of the reference."""
    plan = build_plan(batch.input_ids, batch.response_length, batch.attention_mask, sharing=sharing)  # type: ignore[arg-type]
    _check_against_reference(plan, *heads, 16, seed=1)


def test_sdpa_takes_strided_inputs() -> None:
    """q/k/v as ``[H, T, D]`` storage seen as ``[T, H, D]`` (how a layer may hand them over): same results."""
    plan = PLANS["ragged_with_empty"]()
    q, k, v = make_inputs(plan, 4, 2, 16, seed=9)
    strided = [x.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(True) for x in (q, k, v)]
    assert not strided[0].is_contiguous()
    dense = [x.clone().requires_grad_(True) for x in (q, k, v)]
    outputs = [tree_attention(*inputs, plan, backend="sdpa") for inputs in (strided, dense)]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-6, atol=1e-6)
    weight = torch.randn(outputs[0].shape, generator=torch.Generator().manual_seed(3))
    for got, want in zip(
        torch.autograd.grad((outputs[0] * weight).sum(), strided),
        torch.autograd.grad((outputs[1] * weight).sum(), dense),
    ):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
