import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arctic_dedup.plan import grouping as grouping_module
from arctic_dedup.plan.grouping import group_rows
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
