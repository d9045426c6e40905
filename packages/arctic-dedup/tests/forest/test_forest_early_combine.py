"""The early combine (``ForestKernelConfig.early_combine``): attention items count themselves done per (request, kv
head) and each combine program merges its request once that count is complete. On the CPU (interpreter) every
launch ends before the next starts, so these tests check the results, the counts and their clearing; the GPU tests
check the same under dependent launches, where the combine runs beside the attention launch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_forest_configs import LATIN, _random_forest, _small
from test_forest_decode import SMALL, _assert_close, _paged_plan, _plan, _poisoned, _reference

from arctic_dedup._triton_support import Backend
from arctic_dedup.forest import ForestKernelConfig, ForestPlan
from arctic_dedup.forest import plan as plan_module
from arctic_dedup.forest._launch import allocate_partials, launch_attention, launch_combine, launch_forest_decode
from arctic_dedup.forest.plan import default_forest_config
from arctic_dedup.forest.testing import DecodeBatch, make_decode_batch

EARLY = replace(SMALL, early_combine=True)
# Every launch layout the early combine must work with.
LAYOUTS = {
    "one_launch": EARLY,
    "split": replace(EARLY, split_passes=True),
    "split_dependent_launches_asked": replace(EARLY, split_passes=True, dependent_launches=True),
    # Two or four combine programs per (request, kv head): the last slice to arrive clears the count.
    "combine_slices": replace(EARLY, combine_dim_block=16, combine_num_warps=1, combine_chunk_cap=2),
    "default_rule_one_wave": _small(default_forest_config(16, 8, 132)),
    "default_rule_split": _small(default_forest_config(128, 8, 132)),
}


def _expected_counts(plan: ForestPlan) -> torch.Tensor:
    """Per (request, kv head): its tile's prefix items plus its own suffix items, for requests the combine merges."""
    requests = plan.num_requests
    work = plan.work_start.long()
    tile = plan.tile_of.long()
    suffix_items = work[requests + 1 :] - work[requests:-1]
    prefix_items = torch.where(tile >= 0, work[tile.clamp_min(0) + 1] - work[tile.clamp_min(0)], 0)
    merged = (tile >= 0) | (suffix_items != 1)
    counts = torch.where(merged, prefix_items + suffix_items, 0)
    return counts.repeat_interleave(plan.num_kv_heads).to(torch.int32)


def _decode(batch: DecodeBatch, plan: ForestPlan) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _poisoned(batch)
    scale = batch.query.shape[2] ** -0.5
    launch_forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, scale, out, lse)
    return out, lse


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("block_size", "queries_per_kv", "head_dim"), LATIN[::2])
def test_early_combine_matches_reference_and_leaves_counts_zero(
    layout: str, block_size: int, queries_per_kv: int, head_dim: int
) -> None:
    config = LAYOUTS[layout]
    batch = _random_forest(
        13 * block_size + queries_per_kv + head_dim + len(layout), block_size, queries_per_kv, head_dim
    )
    plan = _plan(batch, queries_per_kv, config=config)
    assert plan.config.early_combine
    scale = batch.query.shape[2] ** -0.5
    # Two calls with one plan: the second starts from the counts the first left behind.
    for _ in range(2):
        out, lse = _decode(batch, plan)
        _assert_close(out, lse, _reference(batch, scale), 1e-5)
        assert not plan.combine_ready.any()


@pytest.mark.parametrize("split_passes", [False, True])
def test_attention_counts_every_item_per_request_and_the_combine_clears_them(split_passes: bool) -> None:
    # Groups of one and of several, tiles of several members, split prefixes and suffixes, a request read whole.
    batch = make_decode_batch(
        [70, 45, 33], [[40, 9, 0, 3], [12, 1, 7], [2]], query_lens=[[1, 2, 1, 1], [3, 1, 1], [1]], queries_per_kv=2
    )
    config = replace(EARLY, combine_dim_block=16, combine_num_warps=1, waves=8.0, split_passes=split_passes)
    plan = _plan(batch, 2, config=config)
    expected = _expected_counts(plan)
    assert expected.max() > 1 and (expected == 0).any(), "the batch must hold merged and directly written requests"
    out, lse = _poisoned(batch)
    scale = batch.query.shape[2] ** -0.5
    partials = allocate_partials(plan, batch.query.shape[2], batch.query.device)
    launch_attention(batch.query, batch.key_cache, batch.value_cache, plan, scale, out, lse, partials)
    assert torch.equal(plan.combine_ready, expected)
    launch_combine(out, lse, plan, partials, batch.query.shape[2])
    assert not plan.combine_ready.any()
    _assert_close(out, lse, _reference(batch, scale), 1e-5)


def test_per_request_plan_counts_split_requests() -> None:
    # No groups: only requests read in several suffix items are merged (and counted).
    batch = make_decode_batch([200, 9], [[0], [0]], queries_per_kv=2)
    plan = _paged_plan(batch, 2, replace(EARLY, waves=4.0))
    expected = _expected_counts(plan)
    assert expected.max() > 1 and (expected == 0).any()
    scale = batch.query.shape[2] ** -0.5
    out, lse = _decode(batch, plan)
    _assert_close(out, lse, _reference(batch, scale), 1e-5)
    assert not plan.combine_ready.any()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_planning_zeroes_the_counts_of_a_poisoned_buffer(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    original = plan_module._plan_buffers

    def poisoned(*args: object) -> dict[str, torch.Tensor]:
        views = original(*args)  # type: ignore[arg-type]
        for view in views.values():
            view.fill_(-7)
        return views

    monkeypatch.setattr(plan_module, "_plan_buffers", poisoned)
    batch = make_decode_batch([70, 45], [[5, 9, 0, 3], [12, 1, 7]], queries_per_kv=2)
    for plan in (_plan(batch, 2, EARLY, backend), _paged_plan(batch, 2, EARLY, backend)):
        assert plan.combine_ready.numel() == plan.num_requests * plan.num_kv_heads
        assert not plan.combine_ready.any()


def test_early_combine_defaults_off_in_an_explicit_config() -> None:
    assert ForestKernelConfig().early_combine is False
