"""Micro-batch planning of the DeepSpeed engines: with ZoRRO a prompt group stays whole and its prompt counts once;
without ZoRRO every sample runs its own prompt copy, and budgets and token counts say so."""

from __future__ import annotations

import pytest

pytest.importorskip("arctic_dedup")

from engine_cases import make_batch

from arctic_dedup.balance import prompt_groups
from arctic_dedup.plan.layout import SampleLayout
from arctic_rl.engines.policy_forward import plan_engine_micro_batches


def _groups(batch: dict) -> list:
    width = int(batch["responses"].shape[1])
    layout = SampleLayout.from_padded(batch["input_ids"], width, batch["attention_mask"], batch.get("position_ids"))
    return prompt_groups(layout)


def _cost(samples: tuple[int, ...], groups: list, deduplicated: bool) -> int:
    total = 0
    for group in groups:
        members = [i for i, sample in enumerate(group.samples) if sample in samples]
        if members:
            prompt = group.prompt_length if deduplicated else group.prompt_length * len(members)
            total += prompt + sum(group.response_lengths[i] for i in members)
    return total


@pytest.mark.parametrize("deduplicated", [True, False])
def test_every_sample_once_and_the_budget_counts_the_tokens_the_model_runs(deduplicated: bool) -> None:
    batch = make_batch(batch_size=12, prompts=3, prompt_len=20, seed=4)
    groups = _groups(batch)
    base = sum(group.base_tokens for group in groups)
    dedup = sum(group.dedup_tokens for group in groups)
    budget = max(_cost(tuple(group.samples), groups, deduplicated=True) for group in groups)
    plan = plan_engine_micro_batches(batch, token_budget=budget, deduplicated=deduplicated)
    assert sorted(sample for micro in plan.samples for sample in micro) == list(range(12))
    assert plan.base_tokens == base
    assert plan.dedup_tokens == (dedup if deduplicated else base)
    assert all(_cost(micro, groups, deduplicated) <= budget for micro in plan.samples)
    if deduplicated:
        # A prompt group is never split: each micro-batch holds whole groups.
        for micro in plan.samples:
            for group in groups:
                assert set(group.samples) <= set(micro) or not set(group.samples) & set(micro)
    else:
        # Without ZoRRO a group's samples cost their prompt copies: the same budget needs more micro-batches.
        assert len(plan.samples) > len(plan_engine_micro_batches(batch, token_budget=budget).samples)


def test_the_service_split_and_the_micro_batches_keep_the_same_prompt_groups_whole() -> None:
    from arctic_rl.engines.policy_forward import batch_prompt_groups
    from arctic_rl.service import split_for_data_parallel

    batch = make_batch(batch_size=12, prompts=4, prompt_len=20, seed=6)
    groups = batch_prompt_groups(batch)
    assert groups == _groups(batch) and len(groups) == 4
    members = [set(group.samples) for group in groups]
    shares = split_for_data_parallel(batch, 2)
    assert sorted(sample for share in shares for sample in share) == list(range(12))
    plan = plan_engine_micro_batches(batch, token_budget=10_000, num_micro_batches=3)
    for part in [*shares, *plan.samples]:
        assert all(group <= set(part) or not group & set(part) for group in members)
