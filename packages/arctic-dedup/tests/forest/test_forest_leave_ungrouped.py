"""Plans that leave the ungrouped requests to the caller: the decode writes exactly the grouped requests' rows (equal
to the reference), never another row, and ``standard_seq_lens`` gives the caller the others' lengths (0 where
grouped), on random batch layouts, in fresh and static plans, through the Triton kernels and the torch path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arctic_dedup._triton_support import Backend
from arctic_dedup.forest import (
    ForestGrouping,
    ForestKernelConfig,
    StaticForestPlan,
    forest_decode,
    plan_forest,
    reference_paged_attention,
)
from arctic_dedup.forest.testing import DecodeBatch, make_decode_batch

SMALL = ForestKernelConfig(
    prefix_block_m=16, prefix_block_n=16, suffix_block_n=16, split_granularity=16, multiprocessors=2, waves=2.0
)
EARLY = ForestKernelConfig(
    prefix_block_m=16,
    prefix_block_n=16,
    suffix_block_n=16,
    split_granularity=16,
    multiprocessors=2,
    early_combine=True,
    split_passes=True,
    combine_dim_block=16,
    combine_num_warps=1,
    combine_chunk_cap=2,
)
SCALE = 32**-0.5


def _plan(batch: DecodeBatch, backend: Backend, config: ForestKernelConfig, grouping: ForestGrouping) -> object:
    return plan_forest(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=16,
        num_cache_blocks=batch.key_cache.shape[0],
        max_query_len=batch.max_query_len,
        queries_per_kv=2,
        num_kv_heads=2,
        grouping=grouping,
        config=config,
        backend=backend,
        leave_ungrouped=True,
    )


def _request_rows(batch: DecodeBatch, requests: torch.Tensor) -> torch.Tensor:
    starts = batch.query_start_loc.long()
    rows = [torch.arange(int(starts[r]), int(starts[r + 1])) for r in requests.tolist()]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)


def _check_left_out(batch: DecodeBatch, plan: object, backend: Backend) -> int:
    """Decode into NaN-poisoned buffers; returns the number of grouped requests."""
    grouped = plan.prefix_blocks > 0  # type: ignore[attr-defined]
    assert plan.leaves_ungrouped  # type: ignore[attr-defined]
    standard = plan.standard_seq_lens  # type: ignore[attr-defined]
    assert torch.equal(standard.long(), torch.where(grouped, 0, batch.seq_lens.long()))
    out = torch.full_like(batch.query, float("nan"))
    lse = torch.full(batch.query.shape[:2], float("nan"), dtype=torch.float32)
    forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, SCALE, out=out, lse=lse, backend=backend)
    ref_out, ref_lse = reference_paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc, SCALE
    )
    written = _request_rows(batch, torch.nonzero(grouped).flatten())
    untouched = _request_rows(batch, torch.nonzero(~grouped).flatten())
    assert out[untouched].isnan().all() and lse[untouched].isnan().all()
    if len(written):
        error = (out[written] - ref_out[written]).norm() / ref_out[written].norm()
        assert error < 1e-5, f"grouped rows: relative error {error:.2e}"
        assert torch.allclose(lse[written], ref_lse[written], atol=1e-4, rtol=1e-5)
    return int(grouped.sum())


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[list[int], list[list[int]], list[list[int]], int, bool]:
    groups = draw(st.integers(1, 4))
    prefix_lens = [draw(st.integers(1, 70)) for _ in range(groups)]
    suffix_lens = [draw(st.lists(st.integers(0, 20), min_size=1, max_size=4)) for _ in range(groups)]
    query_lens = [[draw(st.integers(1, 2)) for _ in group] for group in suffix_lens]
    return prefix_lens, suffix_lens, query_lens, draw(st.integers(0, 10_000)), draw(st.booleans())


@pytest.mark.parametrize("backend", ["triton", "torch"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=_layouts(), early=st.booleans())
def test_decode_writes_exactly_the_grouped_rows(
    backend: Backend, layout: tuple[list[int], list[list[int]], list[list[int]], int, bool], early: bool
) -> None:
    prefix_lens, suffix_lens, query_lens, seed, shuffle = layout
    batch = make_decode_batch(prefix_lens, suffix_lens, query_lens=query_lens, shuffle=shuffle, seed=seed)
    plan = _plan(batch, backend, EARLY if early else SMALL, ForestGrouping())
    _check_left_out(batch, plan, backend)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_mixed_batch_leaves_singletons_and_a_batch_with_no_groups_writes_nothing(backend: Backend) -> None:
    # Two groups of samples beside two prompts sampled once (groups of size 1: ungrouped).
    batch = make_decode_batch([70, 45, 60, 33], [[5, 9, 0], [12], [3, 7], [2]], shuffle=True, seed=11)
    assert _check_left_out(batch, _plan(batch, backend, SMALL, ForestGrouping()), backend) == 5
    # A rule no group meets: every request is the caller's, with its whole length.
    strict = ForestGrouping(min_non_singleton_fraction=1.0)
    assert _check_left_out(batch, _plan(batch, backend, SMALL, strict), backend) == 0


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_static_plan_leaves_the_same_requests_as_a_fresh_plan_and_pads_with_zero_lengths(backend: Backend) -> None:
    static = StaticForestPlan(
        8,
        12,
        block_size=16,
        num_cache_blocks=200,
        max_query_len=1,
        queries_per_kv=2,
        num_kv_heads=2,
        device="cpu",
        config=SMALL,
        leave_ungrouped=True,
    )
    assert static.plan.leaves_ungrouped and static.plan.standard_seq_lens is not None
    for seed, (prefix_lens, suffix_lens) in enumerate([([70, 20], [[5, 9, 0], [3]]), ([40, 55], [[1], [2, 3, 4]])]):
        batch = make_decode_batch(prefix_lens, suffix_lens, shuffle=True, spare_blocks=50, seed=seed)
        table = torch.zeros(batch.block_table.shape[0], 12, dtype=torch.int32)
        table[:, : batch.block_table.shape[1]] = batch.block_table
        batch = DecodeBatch(**{**vars(batch), "block_table": table})
        plan = static.update(batch.block_table, batch.seq_lens, batch.query_start_loc, grouping=ForestGrouping())
        rows = batch.seq_lens.shape[0]
        fresh = _plan(batch, backend, SMALL, ForestGrouping())
        assert torch.equal(plan.standard_seq_lens[:rows], fresh.standard_seq_lens)  # type: ignore[attr-defined]
        assert (plan.standard_seq_lens[rows:] == 0).all()
        padded = DecodeBatch(
            **{
                **vars(batch),
                "block_table": plan.block_table,
                "seq_lens": plan.seq_lens,
                "query_start_loc": plan.query_start_loc,
            }
        )
        _check_left_out(padded, plan, backend)


def test_plans_that_leave_nothing_out_have_no_standard_lengths() -> None:
    batch = make_decode_batch([40], [[1, 2]], seed=1)
    plan = plan_forest(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=16,
        num_cache_blocks=batch.key_cache.shape[0],
        max_query_len=1,
        queries_per_kv=2,
        num_kv_heads=2,
        config=SMALL,
    )
    assert not plan.leaves_ungrouped and plan.standard_seq_lens is None
