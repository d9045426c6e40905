import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arctic_dedup import SampleLayout, partition_for_data_parallel, plan_micro_batches, prompt_groups
from arctic_dedup.balance import GroupSplitWarning, PromptGroup, format_micro_batch_report, partition_items
from arctic_dedup.testing import create_dummy_batch


@st.composite
def group_lists(draw: st.DrawFn) -> list[PromptGroup]:
    groups, next_sample = [], 0
    for _ in range(draw(st.integers(1, 8))):
        size = draw(st.integers(1, 6))
        responses = tuple(draw(st.lists(st.integers(0, 40), min_size=size, max_size=size)))
        groups.append(PromptGroup(tuple(range(next_sample, next_sample + size)), draw(st.integers(1, 60)), responses))
        next_sample += size
    return groups


@settings(max_examples=80, deadline=None)
@given(group_lists(), st.integers(100, 300))
def test_micro_batches_respect_the_budget_and_keep_groups_whole(groups: list[PromptGroup], budget: int) -> None:
    with _allow_split_warnings():
        batches = plan_micro_batches(groups, budget)
    seen = sorted(sample for batch in batches for sample in batch.samples)
    assert seen == sorted(sample for group in groups for sample in group.samples)
    for batch in batches:
        assert batch.dedup_tokens <= budget
    for group in groups:
        holders = [batch for batch in batches if set(group.samples) & set(batch.samples)]
        if group.dedup_tokens <= budget:
            assert len(holders) == 1, "a group that fits was split"
        else:
            assert all(batch.split_group for batch in holders)
    assert sum(batch.base_tokens for batch in batches) == sum(group.base_tokens for group in groups)


class _allow_split_warnings:
    def __enter__(self) -> None:
        import warnings

        self._context = warnings.catch_warnings()
        self._context.__enter__()
        warnings.simplefilter("ignore", GroupSplitWarning)

    def __exit__(self, *args: object) -> None:
        self._context.__exit__(*args)


def test_oversized_group_is_split_evenly_with_a_warning() -> None:
    group = PromptGroup(tuple(range(8)), 100, (50,) * 8)
    with pytest.warns(GroupSplitWarning, match="split into 4"):
        batches = plan_micro_batches([group], 220)
    assert [len(batch.samples) for batch in batches] == [2, 2, 2, 2]
    assert "split group" in format_micro_batch_report(batches)


def test_unfittable_sample_is_an_error() -> None:
    with pytest.raises(ValueError, match="raise the budget"):
        plan_micro_batches([PromptGroup((0,), 100, (200,))], 250)


def test_savings_are_reported_per_micro_batch() -> None:
    batch = create_dummy_batch(16, 4, 30, 10)
    layout = SampleLayout.from_padded(batch["input_ids"], 10, batch["attention_mask"])
    batches = plan_micro_batches(prompt_groups(layout), 140)
    assert len(batches) == 2
    for micro in batches:
        assert micro.base_tokens == 8 * 40 and micro.dedup_tokens == 2 * (30 + 40)
        assert micro.savings == pytest.approx(1 - 140 / 320)


def _best_spread(costs: list[int], parts: int) -> int:
    best = None
    for assignment in itertools.product(range(parts), repeat=len(costs)):
        loads = [0] * parts
        for cost, part in zip(costs, assignment, strict=True):
            loads[part] += cost
        spread = max(loads) - min(loads)
        best = spread if best is None else min(best, spread)
    assert best is not None
    return best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=2, max_size=7), st.integers(2, 3))
def test_partitions_cover_items_and_are_near_optimal(costs: list[int], parts: int) -> None:
    for method in ("karmarkar_karp", "greedy"):
        partition = partition_items(costs, parts, method)  # type: ignore[arg-type]
        assert sorted(i for part in partition for i in part) == list(range(len(costs)))
        loads = [sum(costs[i] for i in part) for part in partition]
        # Both heuristics stay within the largest item of the optimum.
        assert max(loads) - min(loads) <= _best_spread(costs, parts) + max(costs)


def test_karmarkar_karp_finds_the_perfect_split() -> None:
    costs = [10, 7, 5, 4, 3, 1]
    partition = partition_items(costs, 2, "karmarkar_karp")
    assert sorted(sum(costs[i] for i in part) for part in partition) == [15, 15]


def test_data_parallel_partition_keeps_groups_and_needs_enough_groups() -> None:
    batch = create_dummy_batch(12, 4, 20, 5, add_padding=True)
    layout = SampleLayout.from_padded(batch["input_ids"], 5, batch["attention_mask"])
    groups = prompt_groups(layout)
    ranks = partition_for_data_parallel(groups, 2)
    assert sorted(s for rank in ranks for s in rank) == list(range(12))
    for group in groups:
        assert sum(1 for rank in ranks if set(group.samples) & set(rank)) == 1
    with pytest.raises(ValueError, match="cannot fill 5"):
        partition_for_data_parallel(groups, 5)
