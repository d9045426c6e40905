"""Awkward batch layouts: padding on both sides, ragged lengths, non-contiguous groups, groups of one, identical
ids under different masks, one-token responses and prompts, partial prompt overlap (trie), nodes shorter than the
Gated DeltaNet conv width, and one patched model reused over many batches. Dense (qwen3) and hybrid (qwen3_5), in
float64 (zorro_cases.py says why), every value and every parameter gradient within 1e-5 of the per-sample run."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zorro_cases import TOLERANCE, Sample, compare_with_reference, float64_model, make_batch

from arctic_dedup import SampleLayout, build_plan_from_layout
from arctic_zorro_train import DeduplicatedActor, apply_zorro, plan_batch, zorro_forward
from arctic_zorro_train.testing import float64_everywhere, per_sample_reference

SYSTEM = [5, 6, 7, 8]

LAYOUTS: dict[str, list[Sample]] = {
    "non_contiguous_groups": [
        Sample([1, 2, 3], [9, 10]),
        Sample([4, 5], [11]),
        Sample([1, 2, 3], [12, 13, 14]),
        Sample([6, 7, 8, 9], [15, 16]),
        Sample([4, 5], [17, 18, 19]),
        Sample([1, 2, 3], [20]),
    ],
    "groups_of_one": [Sample([1, 2], [3, 4]), Sample([5, 6, 7], [8]), Sample([9], [10, 11, 12])],
    "one_token_responses_and_prompts": [
        Sample([3], [4]),
        Sample([3], [5]),
        Sample([7, 8], [9]),
        Sample([3], [6]),
    ],
    "empty_responses": [Sample([1, 2, 3], [4, 5]), Sample([1, 2, 3], []), Sample([6], []), Sample([6], [7])],
    "ragged_long_short": [
        Sample(list(range(1, 20)), [30]),
        Sample(list(range(1, 20)), list(range(40, 52))),
        Sample([2], list(range(60, 63))),
    ],
}

TRIE_LAYOUTS: dict[str, list[Sample]] = {
    "shared_system_prompt": [
        Sample([*SYSTEM, 20, 21], [30, 31]),
        Sample([*SYSTEM, 22], [32]),
        Sample([*SYSTEM, 20, 21], [33, 34, 35]),
        Sample([*SYSTEM, 23, 24, 25], [36]),
    ],
    "shared_response_prefixes": [
        Sample([1, 2, 3], [10, 11, 12, 13]),
        Sample([1, 2, 3], [10, 11, 14]),
        Sample([1, 2, 3], [10, 15]),
        Sample([1, 2], [16]),
    ],
    "nodes_shorter_than_conv": [
        Sample([9, 1], [2]),
        Sample([9, 3], [4, 5]),
        Sample([9, 1], [6]),
        Sample([9], [7]),
        Sample([9, 1], [2, 8]),
    ],
}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_prompt_sharing_layouts(family: str, layout: str) -> None:
    batch = make_batch(LAYOUTS[layout], extra_prompt_padding=2, extra_response_padding=1)
    compare_with_reference(float64_model(family), batch)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("layout", sorted(TRIE_LAYOUTS))
def test_trie_layouts(family: str, layout: str) -> None:
    batch = make_batch(TRIE_LAYOUTS[layout], extra_prompt_padding=1)
    plan = plan_batch(batch["input_ids"], batch["responses"].shape[1], batch["attention_mask"], sharing="trie")
    assert plan.tree.num_levels >= 3, "the layout should give a deeper tree than prompt/response"
    compare_with_reference(float64_model(family), batch, sharing="trie")


def test_identical_ids_with_different_masks_are_not_shared() -> None:
    samples = [Sample([1, 2, 3, 4], [5, 6]), Sample([1, 2, 3, 4], [5, 6])]
    batch = make_batch(samples)
    # Same ids, but the second sample's first prompt token is padding (a different, shorter prompt).
    batch["attention_mask"][1, 0] = 0
    batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp_min(0)
    plan = plan_batch(batch["input_ids"], 2, batch["attention_mask"], batch["position_ids"])
    assert plan.num_packed_tokens == plan.num_sample_tokens
    compare_with_reference(float64_model("qwen3"), batch)


def test_patched_model_reused_over_many_batches() -> None:
    model = float64_model("qwen3_5")
    actor = DeduplicatedActor(model, kl_coef=0.1)
    for seed, layout in enumerate([*LAYOUTS.values(), *LAYOUTS.values()]):
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(layout), generator=generator).tolist()
        batch = make_batch([layout[i] for i in order], extra_prompt_padding=seed % 3, seed=seed)
        compare_with_reference(model, batch, actor=actor, check_grads=seed % 2 == 0)


@st.composite
def random_layouts(draw: st.DrawFn) -> tuple[list[Sample], int, int]:
    vocab = draw(st.integers(2, 6))
    num_prompts = draw(st.integers(1, 3))
    prompts = [draw(st.lists(st.integers(1, vocab), min_size=1, max_size=7)) for _ in range(num_prompts)]
    samples = []
    for prompt in prompts:
        for _ in range(draw(st.integers(1, 4))):
            samples.append(Sample(prompt, draw(st.lists(st.integers(1, vocab), min_size=1, max_size=6))))
    order = draw(st.permutations(range(len(samples))))
    return [samples[i] for i in order], draw(st.integers(0, 2)), draw(st.integers(0, 2))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("sharing", ["prompt", "trie"])
@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(layout=random_layouts())
def test_random_layouts(family: str, sharing: str, layout: tuple[list[Sample], int, int]) -> None:
    samples, prompt_padding, response_padding = layout
    batch = make_batch(samples, extra_prompt_padding=prompt_padding, extra_response_padding=response_padding)
    compare_with_reference(float64_model(family), batch, sharing=sharing)


@pytest.mark.parametrize("use_split_attention", [True, False])
def test_plan_of_an_unpadded_batch(use_split_attention: bool) -> None:
    samples = LAYOUTS["non_contiguous_groups"]
    batch = make_batch(samples)
    ids = torch.tensor([token for s in samples for token in [*s.prompt, *s.response]])
    layout = SampleLayout.from_unpadded(
        ids, torch.tensor([len(s.prompt) for s in samples]), torch.tensor([len(s.response) for s in samples])
    )
    plan = build_plan_from_layout(layout, sharing="trie")
    model = float64_model("qwen3")
    with torch.no_grad(), float64_everywhere():
        expected = per_sample_reference(model, batch, batch["responses"].shape[1])
        apply_zorro(model, patch_forward=False, use_split_attention=use_split_attention)
        output = zorro_forward(model, plan, calculate_entropy=True)
    assert output.entropy is not None
    assert float((output.logprobs - expected.logprobs).abs().max()) <= TOLERANCE
    assert float((output.entropy - expected.entropy).abs().max()) <= TOLERANCE
