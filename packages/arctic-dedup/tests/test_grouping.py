import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import PaddedBatch, padded_batches

from arctic_dedup import SampleLayout, ZoRRoTrain, prompt_groups
from arctic_dedup.plan import grouping as grouping_module
from arctic_dedup.plan.grouping import group_prompts, group_rows
from arctic_dedup.plan.reference import reference_group_rows


@st.composite
def row_matrices(draw: st.DrawFn) -> torch.Tensor:
    rows = draw(st.integers(1, 12))
    width = draw(st.integers(1, 5))
    distinct = draw(st.lists(st.lists(st.integers(-3, 3), min_size=width, max_size=width), min_size=1, max_size=4))
    picks = draw(st.lists(st.integers(0, len(distinct) - 1), min_size=rows, max_size=rows))
    return torch.tensor([distinct[p] for p in picks], dtype=torch.long)


@settings(max_examples=80, deadline=None)
@given(row_matrices())
def test_grouping_equals_brute_force(rows: torch.Tensor) -> None:
    groups = group_rows(rows)
    assert groups.members() == reference_group_rows(rows)
    assert groups.group_sizes.sum().item() == rows.shape[0]


def test_hash_collisions_fall_back_to_exact_grouping(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Every row hashes alike: the verification must notice and group exactly anyway.
    monkeypatch.setattr(grouping_module, "hash_int64", lambda values, seed=0: torch.zeros_like(values))
    rows = torch.tensor([[1, 2], [3, 4], [1, 2], [5, 6], [3, 4]])
    assert grouping_module.group_rows(rows).members() == [[0, 2], [1, 4], [3]]


def test_empty_matrix() -> None:
    assert group_rows(torch.empty(0, 3, dtype=torch.long)).num_groups == 0


@st.composite
def batches_with_any_padding_ids(draw: st.DrawFn) -> PaddedBatch:
    batch = draw(padded_batches())
    # Any id at padding, row by row: the prompt grouping must ignore them, the seed facade's must not.
    size = batch.input_ids.numel()
    noise = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=size, max_size=size)))
    padding = batch.attention_mask == 0
    batch.input_ids[padding] = noise.reshape(batch.input_ids.shape)[padding]
    return batch


def _first_appearance_groups(keys: list[tuple[int, ...]]) -> list[list[int]]:
    groups: dict[tuple[int, ...], list[int]] = {}
    for sample, key in enumerate(keys):
        groups.setdefault(key, []).append(sample)
    return list(groups.values())


@settings(max_examples=80, deadline=None)
@given(batches_with_any_padding_ids())
def test_prompt_groups_are_samples_with_the_same_valid_prompt_tokens(batch: PaddedBatch) -> None:
    ids, mask, response_length = batch.input_ids, batch.attention_mask, batch.response_length
    prompt_width = ids.shape[1] - response_length
    layout = SampleLayout.from_padded(ids, response_length, mask)
    valid_prompts = [
        tuple(ids[row, :prompt_width][mask[row, :prompt_width] == 1].tolist()) for row in range(ids.shape[0])
    ]
    assert group_prompts(layout).members() == _first_appearance_groups(valid_prompts)
    padded = [(*prompt, -1, *ids[row, :prompt_width].tolist()) for row, prompt in enumerate(valid_prompts)]
    assert group_prompts(layout, padded_prompts=ids[:, :prompt_width]).members() == _first_appearance_groups(padded)
    # The seed facade keeps its contract (equal ids and mask over the padded block) through the same function.
    groups, _ = ZoRRoTrain.find_prompt_groups(ids, response_length, mask)
    assert groups == reference_group_rows(torch.cat([ids[:, :prompt_width], mask[:, :prompt_width]], dim=1))
    assert [list(group.samples) for group in prompt_groups(layout)] == group_prompts(layout).members()
