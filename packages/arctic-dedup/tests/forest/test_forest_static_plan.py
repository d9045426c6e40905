"""StaticForestPlan: a plan refilled in place every step (CUDA graphs) equals a fresh plan and decodes exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from arctic_dedup._triton_support import Backend
from arctic_dedup.errors import PlanError
from arctic_dedup.forest import (
    ForestGrouping,
    ForestKernelConfig,
    ForestScratch,
    StaticForestPlan,
    forest_decode,
    plan_forest,
    reference_paged_attention,
)
from arctic_dedup.forest.testing import DecodeBatch, make_decode_batch

SMALL = ForestKernelConfig(
    prefix_block_m=16, prefix_block_n=16, suffix_block_n=16, split_granularity=16, multiprocessors=2, waves=2.0
)
WIDTH = 40
PLAN_FIELDS = ("prefix_blocks", "group_leader", "tile_of", "work_start", "split_tokens", "stats")


def _batch(seed: int, prefix_lens: list[int], suffix_lens: list[list[int]], shuffle: bool = True) -> DecodeBatch:
    batch = make_decode_batch(prefix_lens, suffix_lens, queries_per_kv=2, shuffle=shuffle, seed=seed)
    table = torch.zeros(batch.block_table.shape[0], WIDTH, dtype=torch.int32)
    table[:, : batch.block_table.shape[1]] = batch.block_table
    return DecodeBatch(**{**vars(batch), "block_table": table})


def _static(
    num_requests: int,
    num_cache_blocks: int = 200,
    config: ForestKernelConfig = SMALL,
    scratch: ForestScratch | None = None,
    grouping_gate: torch.Tensor | None = None,
) -> StaticForestPlan:
    return StaticForestPlan(
        num_requests,
        WIDTH,
        block_size=16,
        num_cache_blocks=num_cache_blocks,
        max_query_len=1,
        queries_per_kv=2,
        num_kv_heads=2,
        device="cpu",
        config=config,
        scratch=scratch,
        grouping_gate=grouping_gate,
    )


def _fresh(batch: DecodeBatch, backend: Backend, grouping: ForestGrouping | None = None) -> object:
    return plan_forest(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=16,
        num_cache_blocks=200,
        max_query_len=1,
        queries_per_kv=2,
        num_kv_heads=2,
        grouping=grouping,
        config=SMALL,
        backend=backend,
    )


def _decode(batch: DecodeBatch, plan: object, backend: Backend, rows: int | None = None) -> torch.Tensor:
    """Decode into a NaN-poisoned output of ``rows`` query rows (padding rows beyond the batch's tokens)."""
    tokens = batch.query.shape[0]
    rows = tokens if rows is None else rows
    query = torch.full((rows, *batch.query.shape[1:]), float("nan"))
    query[:tokens] = batch.query
    out = torch.full_like(query, float("nan"))
    lse = torch.full(query.shape[:2], float("nan"))
    forest_decode(query, batch.key_cache, batch.value_cache, plan, 0.2, out=out, lse=lse, backend=backend)  # type: ignore[arg-type]
    return out


def _reference(batch: DecodeBatch) -> torch.Tensor:
    out, _ = reference_paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 0.2
    )
    return out


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_static_plan_equals_a_fresh_plan_and_keeps_its_buffers(backend: Backend) -> None:
    first = _batch(1, [70, 45], [[5, 9, 0, 3], [12, 1, 7]])
    second = _batch(2, [100, 33, 20], [[2, 2], [40, 1, 0], [3, 8, 8]])
    static = _static(first.block_table.shape[0])
    addresses = {name: getattr(static.plan, name).data_ptr() for name in (*PLAN_FIELDS, "block_table", "seq_lens")}
    grouping = ForestGrouping()
    for batch in (first, second, first):
        rows = batch.block_table.shape[0]
        if rows != static.num_requests:
            static = _static(rows)
            addresses = {name: getattr(static.plan, name).data_ptr() for name in addresses}
        plan = static.update(
            batch.block_table, batch.seq_lens, batch.query_start_loc, grouping=grouping, backend=backend
        )
        assert plan is static.plan
        fresh = _fresh(batch, backend)
        for name in PLAN_FIELDS:
            assert torch.equal(getattr(plan, name), getattr(fresh, name)), name
        assert (plan.max_prefix_work, plan.max_suffix_work) == (fresh.max_prefix_work, fresh.max_suffix_work)  # type: ignore[attr-defined]
        assert {name: getattr(plan, name).data_ptr() for name in addresses} == addresses


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_reused_static_plan_decodes_every_step_exactly(backend: Backend) -> None:
    steps = [
        _batch(3, [70, 45], [[5, 9, 0], [12, 1, 7]]),
        _batch(4, [38, 90], [[30, 2, 2], [0, 6, 11]]),
        _batch(5, [20, 20, 20, 20, 20, 20], [[1]] * 6, shuffle=False),
    ]
    static = _static(6)
    for batch in steps:
        plan = static.update(
            batch.block_table, batch.seq_lens, batch.query_start_loc, grouping=ForestGrouping(), backend=backend
        )
        out = _decode(batch, plan, backend)
        assert _relative_error(out, _reference(batch)) < 1e-5
        assert torch.equal(out, _decode(batch, _fresh(batch, backend), backend))
    assert int(static.plan.num_groups) == 0


@pytest.mark.parametrize(("backend", "early"), [("triton", False), ("triton", True), ("torch", False)])
def test_padded_batch_is_exact_and_padding_is_a_no_op(backend: Backend, early: bool) -> None:
    batch = _batch(6, [70, 45], [[5, 9, 0], [12, 1]])
    rows = batch.block_table.shape[0]
    static = _static(rows + 3, config=replace(SMALL, early_combine=early))
    # Stale rows from an earlier, larger step must not leak into the padded step.
    big = _batch(7, [60, 60], [[1, 2, 3, 4], [5]])
    static.update(big.block_table, big.seq_lens, big.query_start_loc, grouping=ForestGrouping(), backend=backend)
    plan = static.update(
        batch.block_table, batch.seq_lens, batch.query_start_loc, grouping=ForestGrouping(), backend=backend
    )
    assert plan.seq_lens[rows:].eq(0).all() and plan.query_start_loc[rows:].eq(rows).all()
    assert int(plan.num_groups) == 2 and int(plan.num_grouped_requests) == rows
    # As in vLLM's padded decode graphs: one query row per padded request, never written.
    out = _decode(batch, plan, backend, rows=rows + 3)
    assert out[rows:].isnan().all()
    assert _relative_error(out[:rows], _reference(batch)) < 1e-5
    # The early combine's per-request counts are back to zero for the next call (padded requests included).
    assert plan.combine_ready.eq(0).all()
    if not early:
        assert torch.equal(out[:rows], _decode(batch, _fresh(batch, backend), backend))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_step_without_grouping_runs_the_same_plan_per_request(backend: Backend) -> None:
    batch = _batch(8, [70, 45], [[5, 9, 0], [12, 1, 7]])
    static = _static(batch.block_table.shape[0])
    static.update(batch.block_table, batch.seq_lens, batch.query_start_loc, grouping=ForestGrouping(), backend=backend)
    assert int(static.plan.num_groups) == 2
    plan = static.update(batch.block_table, batch.seq_lens, batch.query_start_loc, grouping=None, backend=backend)
    assert int(plan.num_groups) == 0 and plan.prefix_blocks.eq(0).all() and plan.shares
    out = _decode(batch, plan, backend)
    assert _relative_error(out, _reference(batch)) < 1e-5
    ungrouped = _fresh(batch, backend, ForestGrouping(min_group_size=2**31 - 1))
    assert torch.equal(out, _decode(batch, ungrouped, backend))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_grouping_gate_switches_grouping_off_and_on_with_the_same_launches(backend: Backend) -> None:
    batch = _batch(8, [70, 45], [[5, 9, 0], [12, 1, 7]])
    gate = torch.ones(1, dtype=torch.int32)
    static = _static(batch.block_table.shape[0], grouping_gate=gate)
    assert static.grouping_gate is gate
    ungrouped = _fresh(batch, backend, ForestGrouping(min_group_size=2**31 - 1))
    for open_gate, groups in ((0, 0), (1, 2), (0, 0)):
        gate.fill_(open_gate)
        plan = static.update(
            batch.block_table, batch.seq_lens, batch.query_start_loc, grouping=ForestGrouping(), backend=backend
        )
        assert int(plan.num_groups) == groups and int(plan.saved_block_reads > 0) == open_gate
        out = _decode(batch, plan, backend)
        assert _relative_error(out, _reference(batch)) < 1e-5
        if not open_gate:
            # Gated off, the step is per-request decode: the same plan and output as planning with no groups.
            for name in PLAN_FIELDS:
                assert torch.equal(getattr(plan, name), getattr(ungrouped, name)), name
            assert torch.equal(out, _decode(batch, ungrouped, backend))


def test_static_plan_rejects_a_gate_of_the_wrong_kind() -> None:
    for gate in (torch.ones(1), torch.ones(2, dtype=torch.int32), torch.ones((), dtype=torch.int32)):
        with pytest.raises(PlanError, match="grouping_gate must be an int32 tensor of shape"):
            _static(4, grouping_gate=gate)


def test_static_plan_rejects_a_batch_it_cannot_hold() -> None:
    batch = _batch(9, [70], [[5, 9, 0]])
    with pytest.raises(PlanError, match="static plan holds up to 2 requests"):
        _static(2).update(batch.block_table, batch.seq_lens, batch.query_start_loc, grouping=None)
    narrow = batch.block_table[:, :20]
    with pytest.raises(PlanError, match="40 blocks"):
        _static(3).update(narrow, batch.seq_lens, batch.query_start_loc, grouping=None)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_static_plans_sharing_one_scratch_decode_in_turn_exactly(backend: Backend) -> None:
    scratch = ForestScratch()
    small = _batch(10, [70, 45], [[5, 9, 0], [12, 1, 7]])
    large = _batch(11, [38, 90, 64], [[30, 2, 2], [0, 6, 11], [1, 1]])
    plans = [_static(8, scratch=scratch), _static(6, scratch=scratch)]
    for static, batch in ((plans[0], large), (plans[1], small), (plans[0], large), (plans[1], small)):
        plan = static.update(
            batch.block_table, batch.seq_lens, batch.query_start_loc, grouping=ForestGrouping(), backend=backend
        )
        assert plan.scratch is scratch
        out = _decode(batch, plan, backend)
        assert _relative_error(out, _reference(batch)) < 1e-5
        assert torch.equal(out, _decode(batch, _fresh(batch, backend), backend))


def test_scratch_keeps_one_buffer_when_the_largest_request_comes_first() -> None:
    scratch = ForestScratch()
    first = scratch.take(1000, torch.device("cpu"))
    assert scratch.take(10, torch.device("cpu")).data_ptr() == first.data_ptr()
    grown = scratch.take(2000, torch.device("cpu"))
    assert grown.numel() == 2000 and grown.data_ptr() != first.data_ptr()
    # The first buffer stays valid for whoever holds it (a recorded launch); later requests use the larger one.
    assert first.numel() == 1000 and scratch.take(1500, torch.device("cpu")).data_ptr() == grown.data_ptr()
