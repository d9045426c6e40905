"""Internal launch variants of forest decode (split prefix/suffix passes, combine slices) against the reference."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
import torch
from test_forest_decode import SMALL, _assert_close, _plan, _poisoned, _reference

from arctic_dedup.errors import PlanError
from arctic_dedup.forest import ForestKernelConfig, forest_decode, plan_forest, plan_paged
from arctic_dedup.forest._launch import (
    DecodeKnobs,
    allocate_partials,
    check_decode_inputs,
    launch_attention,
    launch_combine,
    launch_forest_decode,
)
from arctic_dedup.forest.plan import default_forest_config
from arctic_dedup.forest.testing import DecodeBatch, make_decode_batch

KNOBS = {
    "split": DecodeKnobs(split_passes=True),
    "chained_passes": DecodeKnobs(split_passes=True),
    "split_side_stream_prefix_options": DecodeKnobs(
        split_passes=True, side_stream=True, prefix_num_warps=8, prefix_num_stages=2
    ),
    "combine_slices": DecodeKnobs(combine_dim_block=16, combine_chunk_cap=64),
    "split_combine_slices_small_chunks": DecodeKnobs(split_passes=True, combine_dim_block=32, combine_chunk_cap=2),
    "narrow_combine_programs": DecodeKnobs(combine_chunk_cap=4, combine_num_warps=2),
    "one_warp_combine_slices": DecodeKnobs(combine_dim_block=32, combine_num_warps=1),
    # Register caps are a compile option the interpreter ignores.
    "register_caps": DecodeKnobs(split_passes=True, prefix_num_warps=8, max_registers=128, prefix_max_registers=96),
    # A fixed suffix grid (SMALL has 2 multiprocessors and 2 kv heads: one slot of programs loops over every item).
    "persistent_suffix": DecodeKnobs(split_passes=True, suffix_programs_per_sm=1),
    "persistent_suffix_chained": DecodeKnobs(split_passes=True, suffix_programs_per_sm=3),
    "interleaved_items": DecodeKnobs(interleave_items=True),
}
# Programmatic dependent launch is a CUDA (sm_90+) feature: without it a chain is the split launch on one stream.
CHAINED = {"chained_passes", "persistent_suffix_chained"}
# Every pair of (block size, GQA ratio, head dim) values meets once.
LATIN = [((16, 32, 64)[i], (1, 4, 8)[j], (64, 128, 256)[(i + j) % 3]) for i in range(3) for j in range(3)]


def _random_forest(seed: int, block_size: int, queries_per_kv: int, head_dim: int) -> DecodeBatch:
    """Groups of 1..5 requests, prompts ending mid-block, empty suffixes, 1..3 query tokens, an optional root."""
    rng = random.Random(seed)
    root = rng.choice([0, 1])
    prefix_lens = [rng.randint(root * block_size + 1, 4 * block_size + 7) for _ in range(rng.randint(1, 3))]
    suffix_lens = [
        [rng.choice([0, rng.randint(1, 2 * block_size)]) for _ in range(rng.randint(1, 5))] for _ in prefix_lens
    ]
    query_lens = [[rng.randint(1, 3) for _ in group] for group in suffix_lens]
    return make_decode_batch(
        prefix_lens,
        suffix_lens,
        query_lens=query_lens,
        root_blocks=root,
        block_size=block_size,
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        shuffle=True,
        seed=seed,
    )


def _run(batch: DecodeBatch, queries_per_kv: int, knobs: DecodeKnobs, config: ForestKernelConfig = SMALL) -> None:
    scale = batch.query.shape[2] ** -0.5
    plan = _plan(batch, queries_per_kv, config=config)
    out, lse = _poisoned(batch)
    check_decode_inputs(batch.query, batch.key_cache, batch.value_cache, plan, out, lse)
    launch_forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, scale, out, lse, knobs)
    _assert_close(out, lse, _reference(batch, scale), 1e-5)


@pytest.mark.parametrize("knobs_name", list(KNOBS))
@pytest.mark.parametrize(("block_size", "queries_per_kv", "head_dim"), LATIN[::2])
def test_knobs_match_reference_on_random_forests(
    knobs_name: str, block_size: int, queries_per_kv: int, head_dim: int
) -> None:
    seed = block_size + 10 * queries_per_kv + head_dim + len(knobs_name)
    config = replace(SMALL, chain_passes=knobs_name in CHAINED)
    _run(_random_forest(seed, block_size, queries_per_kv, head_dim), queries_per_kv, KNOBS[knobs_name], config)


@pytest.mark.parametrize(("block_size", "queries_per_kv", "head_dim"), LATIN[1::2])
def test_split_passes_with_combine_slices_on_the_other_latin_cells(
    block_size: int, queries_per_kv: int, head_dim: int
) -> None:
    knobs = DecodeKnobs(split_passes=True, combine_dim_block=32, combine_chunk_cap=4)
    _run(
        _random_forest(block_size * queries_per_kv + head_dim, block_size, queries_per_kv, head_dim),
        queries_per_kv,
        knobs,
    )


def test_split_passes_with_wide_prefix_tiles_and_many_splits() -> None:
    # Prefix tiles wider than a split and than a block; many prefix splits per tile, a group of one.
    batch = make_decode_batch([300, 53, 40], [[4, 0, 9, 2], [7], [0, 1]], query_lens=None, queries_per_kv=4, seed=21)
    config = ForestKernelConfig(
        prefix_block_m=16,
        prefix_block_n=64,
        suffix_block_n=16,
        split_granularity=16,
        multiprocessors=16,
        prefix_waves=4.0,
    )
    plan = _plan(batch, 4, config=config)
    assert int(plan.num_groups) >= 1
    _run(batch, 4, DecodeKnobs(split_passes=True, combine_dim_block=16, combine_chunk_cap=2), config)


def test_passes_run_alone_cover_disjoint_items() -> None:
    # The prefix pass writes only prefix partials, the suffix pass the rest; both together equal one launch.
    batch = make_decode_batch([70, 45], [[5, 9, 0, 3], [12, 1, 7]], queries_per_kv=2, seed=22)
    scale = batch.query.shape[2] ** -0.5
    plan = _plan(batch, 2)
    outputs = []
    for passes in ((0,), (1, 2), (2, 1)):
        out, lse = _poisoned(batch)
        partials = allocate_partials(plan, batch.query.shape[2], batch.query.device)
        partials.out.fill_(float("nan"))
        launch_attention(
            batch.query, batch.key_cache, batch.value_cache, plan, scale, out, lse, partials, passes=passes
        )
        launch_combine(out, lse, plan, partials, batch.query.shape[2])
        outputs.append((out, lse))
    for out, lse in outputs[1:]:
        assert torch.equal(out, outputs[0][0]) and torch.equal(lse, outputs[0][1])


def test_persistent_suffix_pass_runs_every_item_of_its_slots() -> None:
    # Many suffix items (long suffixes, small splits) on one slot of programs, and on as many slots as items.
    batch = make_decode_batch([70, 45], [[40, 9, 0, 33], [52, 1, 70]], queries_per_kv=2, seed=23)
    config = replace(SMALL, waves=32.0)
    plan = _plan(batch, 2, config=config)
    items = int(plan.work_start[-1] - plan.work_start[plan.num_requests])
    assert items > plan.num_requests + 4
    for per_sm in (1, items):
        _run(batch, 2, DecodeKnobs(split_passes=True, suffix_programs_per_sm=per_sm), config)


def test_timelines_need_a_cuda_device() -> None:
    from arctic_dedup.forest._launch import LaunchTimeline

    batch = make_decode_batch([40], [[3, 5]], queries_per_kv=2, seed=24)
    plan = _plan(batch, 2)
    out, lse = _poisoned(batch)
    knobs = DecodeKnobs(timeline=LaunchTimeline())
    with pytest.raises(PlanError, match="CUDA device"):
        launch_forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, 0.2, out, lse, knobs)


def test_prefix_pass_needs_groups() -> None:
    batch = make_decode_batch([40], [[3, 4]], seed=23)
    plan = plan_paged(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=16,
        max_query_len=1,
        queries_per_kv=2,
        num_kv_heads=2,
        config=SMALL,
    )
    out, lse = _poisoned(batch)
    partials = allocate_partials(plan, batch.query.shape[2], batch.query.device)
    with pytest.raises(PlanError, match="prefix pass"):
        launch_attention(batch.query, batch.key_cache, batch.value_cache, plan, 0.2, out, lse, partials, passes=(1,))
    # Split knobs on a plan without groups fall back to one launch.
    launch_forest_decode(
        batch.query, batch.key_cache, batch.value_cache, plan, 0.2, out, lse, DecodeKnobs(split_passes=True)
    )
    _assert_close(out, lse, _reference(batch, 0.2), 1e-5)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("combine_dim_block", 24, "combine_dim_block"),
        ("combine_dim_block", 8, "combine_dim_block"),
        ("combine_chunk_cap", 3, "chunk_cap"),
        ("combine_num_warps", 3, "combine_num_warps"),
        ("max_registers", 8, "max_registers"),
        ("prefix_max_registers", 300, "prefix_max_registers"),
        ("suffix_programs_per_sm", 0, "suffix_programs_per_sm"),
    ],
)
def test_knobs_are_validated(field: str, value: int, message: str) -> None:
    arguments: dict[str, Any] = {field: value}
    with pytest.raises(ValueError, match=message):
        DecodeKnobs(**arguments)
    if field in ("combine_dim_block", "combine_num_warps", "combine_chunk_cap"):
        with pytest.raises(ValueError, match=message):
            ForestKernelConfig(**arguments)


def test_combine_shape_comes_from_the_config_unless_a_knob_overrides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from arctic_dedup.forest import _kernels

    launches: list[tuple[int, int, int]] = []
    real = _kernels.forest_combine_kernel

    class Recorder:
        def __getitem__(self, grid: tuple[int]) -> Any:
            def launch(*args: Any, **kwargs: Any) -> Any:
                launches.append((grid[0], kwargs["DIM_BLOCK"], kwargs["num_warps"], kwargs["CHUNK"]))
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(_kernels, "forest_combine_kernel", Recorder())
    batch = make_decode_batch([53, 40, 77], [[0, 9, 3, 0], [5], [0, 12]], queries_per_kv=4, head_dim=64, seed=34)
    narrow = replace(_small(ForestKernelConfig()), combine_dim_block=16, combine_num_warps=1, combine_chunk_cap=2)
    _run(batch, 4, DecodeKnobs(), narrow)
    _run(batch, 4, DecodeKnobs(combine_dim_block=32, combine_num_warps=2, combine_chunk_cap=4), narrow)
    _run(batch, 4, DecodeKnobs(), _small(ForestKernelConfig()))
    pairs = batch.seq_lens.shape[0] * batch.key_cache.shape[2]
    assert launches == [(pairs * 4, 16, 1, 2), (pairs * 2, 32, 2, 4), (pairs, 64, 4, 16)]


# Version 3 round 2 (``benchmarks/fca_decode.py --diagnose``): the default rule's two configs and the new split
# variants, with split lengths small enough that tiny forests still get several items per owner.
def _small(config: ForestKernelConfig) -> ForestKernelConfig:
    return replace(config, split_granularity=16, multiprocessors=4)


V3 = {
    "default_one_wave": (_small(default_forest_config(16, 8, 132)), DecodeKnobs()),
    "default_split_p64": (_small(default_forest_config(128, 8, 132)), DecodeKnobs()),
    "split_p64_s64": (
        _small(ForestKernelConfig(prefix_block_n=64, suffix_block_n=64, split_passes=True)),
        DecodeKnobs(),
    ),
    "split_p32_deep": (
        _small(ForestKernelConfig(num_stages=5, split_passes=True)),
        DecodeKnobs(split_passes=True, prefix_num_warps=4, prefix_num_stages=6, side_stream=True),
    ),
    "split_p64_s64_c8_w1": (
        _small(
            ForestKernelConfig(prefix_block_n=64, suffix_block_n=64, split_passes=True, prefix_waves=1.0, waves=1.0)
        ),
        DecodeKnobs(combine_chunk_cap=8),
    ),
    "w1_combine32": (
        _small(ForestKernelConfig(prefix_waves=1.0, waves=1.0)),
        DecodeKnobs(combine_dim_block=32, combine_chunk_cap=64),
    ),
    "fused_p64_s64": (
        _small(ForestKernelConfig(prefix_block_n=64, suffix_block_n=64, fuse_combine=True)),
        DecodeKnobs(),
    ),
    "dependent_launches_chained": (
        _small(replace(default_forest_config(128, 8, 132), dependent_launches=True, chain_passes=True)),
        DecodeKnobs(),
    ),
    "fused_w1_side_stream_asked": (
        _small(ForestKernelConfig(prefix_block_n=64, prefix_waves=1.0, waves=1.0, fuse_combine=True)),
        DecodeKnobs(side_stream=True, combine_chunk_cap=2),
    ),
}


@pytest.mark.parametrize("name", list(V3))
@pytest.mark.parametrize(("block_size", "queries_per_kv", "head_dim"), LATIN[::2])
def test_v3_variants_match_reference_on_random_forests(
    name: str, block_size: int, queries_per_kv: int, head_dim: int
) -> None:
    config, knobs = V3[name]
    seed = 7 * block_size + queries_per_kv + head_dim + 3 * len(name)
    _run(_random_forest(seed, block_size, queries_per_kv, head_dim), queries_per_kv, knobs, config)


@pytest.mark.parametrize("name", ["split_p64_s64", "split_p32_deep", "fused_p64_s64"])
@pytest.mark.parametrize(("block_size", "queries_per_kv", "head_dim"), LATIN[1::2])
def test_v3_split_variants_on_the_other_latin_cells(
    name: str, block_size: int, queries_per_kv: int, head_dim: int
) -> None:
    config, knobs = V3[name]
    seed = 11 * block_size + queries_per_kv + head_dim
    _run(_random_forest(seed, block_size, queries_per_kv, head_dim), queries_per_kv, knobs, config)


def test_v3_query_lengths_up_to_the_maximum() -> None:
    # Every query length 1..4 in one batch, groups of one, empty suffixes, prompts ending mid-block.
    batch = make_decode_batch(
        [53, 40, 77],
        [[0, 9, 3, 0], [5], [0, 12]],
        query_lens=[[1, 2, 3, 4], [4], [2, 1]],
        queries_per_kv=4,
        seed=31,
    )
    for config, knobs in V3.values():
        _run(batch, 4, knobs, config)


def test_default_config_is_a_rule_by_batch_size() -> None:
    one_wave = default_forest_config(16, 8, 132)
    assert (one_wave.prefix_waves, one_wave.waves, one_wave.split_passes) == (1.0, 1.0, False)
    assert one_wave.prefix_block_n == 64
    many = default_forest_config(128, 8, 132)
    assert (many.prefix_block_n, many.split_passes, many.prefix_waves, many.chain_passes) == (64, True, 2.0, True)
    assert not one_wave.chain_passes
    assert default_forest_config(17, 8, 132) == many
    # Rounds 3, 4, 7 and 17 (2026-12-01/02): one-warp combine programs over 64-dim halves, 8 partials at a time,
    # dependent launches and the early combine, in both cases.
    for config in (one_wave, many):
        combine = (config.combine_dim_block, config.combine_num_warps, config.combine_chunk_cap)
        assert (*combine, config.dependent_launches, config.early_combine) == (64, 1, 8, True, True)
    # plan_forest without a config applies the rule (8 multiprocessors on CPU).
    small = make_decode_batch([40], [[3, 4]], seed=32)
    large = make_decode_batch([40, 50], [[3, 4, 5], [1, 2]], seed=33)
    for batch, expected in ((small, default_forest_config(2, 2, 8)), (large, default_forest_config(5, 2, 8))):
        plan = plan_forest(
            batch.block_table,
            batch.seq_lens,
            batch.query_start_loc,
            block_size=16,
            num_cache_blocks=batch.key_cache.shape[0],
            max_query_len=1,
            queries_per_kv=2,
            num_kv_heads=2,
        )
        assert plan.config == expected
        out, lse = forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, 0.2)
        _assert_close(out, lse, _reference(batch, 0.2), 1e-5)
    assert plan.config.split_passes


def _fused_plan_and_batch(seed: int) -> tuple[Any, DecodeBatch]:
    # Suffixes short enough to be one item each, and one long one split into several (it still needs the combine).
    batch = make_decode_batch(
        [70, 45, 33],
        [[5, 9, 0, 3], [12, 1, 150], [2]],
        query_lens=[[1, 2, 1, 3], [1, 1, 2], [1]],
        queries_per_kv=2,
        seed=seed,
    )
    config = ForestKernelConfig(split_granularity=16, multiprocessors=8, waves=4.0, fuse_combine=True)
    return _plan(batch, 2, config=config), batch


def test_fused_combine_merges_in_the_suffix_pass_and_the_combine_skips_those_requests() -> None:
    plan, batch = _fused_plan_and_batch(41)
    scale = batch.query.shape[2] ** -0.5
    assert int(plan.num_groups) >= 2
    suffix_items = plan.work_start[plan.num_requests + 1 :] - plan.work_start[plan.num_requests : -1]
    assert bool((suffix_items > 1).any()) and bool((suffix_items == 1).any())
    assert bool(((suffix_items == 1) & (plan.tile_of >= 0)).any()), "no grouped request with one suffix item"
    out, lse = _poisoned(batch)
    partials = allocate_partials(plan, batch.query.shape[2], batch.query.device)
    launch_attention(batch.query, batch.key_cache, batch.value_cache, plan, scale, out, lse, partials)
    reference_out, reference_lse = _reference(batch, scale)
    # Before the combine: every request with one suffix item is already final, grouped or not.
    starts = batch.query_start_loc.tolist()
    for request, count in enumerate(suffix_items.tolist()):
        rows = slice(starts[request], starts[request + 1])
        if count == 1:
            torch.testing.assert_close(out[rows], reference_out[rows], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[rows], reference_lse[rows], atol=1e-5, rtol=1e-5)
    launch_combine(out, lse, plan, partials, batch.query.shape[2])
    _assert_close(out, lse, (reference_out, reference_lse), 1e-5)


def test_fused_combine_needs_both_passes_in_order() -> None:
    plan, batch = _fused_plan_and_batch(42)
    out, lse = _poisoned(batch)
    partials = allocate_partials(plan, batch.query.shape[2], batch.query.device)
    for passes in ((0,), (2, 1), (1, 2, 1)):
        with pytest.raises(PlanError, match="fuse_combine"):
            launch_attention(
                batch.query, batch.key_cache, batch.value_cache, plan, 0.2, out, lse, partials, passes=passes
            )


def test_dependent_launches_need_a_cuda_device_of_compute_capability_9() -> None:
    from arctic_dedup.forest._launch import dependent_launches

    asked = ForestKernelConfig(dependent_launches=True)
    assert not dependent_launches(asked, torch.device("cpu"))
    assert not dependent_launches(ForestKernelConfig(), torch.device("cpu"))


@pytest.mark.parametrize("cls", [DecodeKnobs, ForestKernelConfig])
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("combine_dim_block", 24, "combine_dim_block must be a power of two >= 16"),
        ("combine_num_warps", 3, "combine_num_warps must be 1, 2, 4 or 8"),
        ("combine_chunk_cap", 6, "combine_chunk_cap must be a power of two >= 1"),
    ],
)
def test_bad_combine_shapes_are_refused_by_knobs_and_config(cls: type, field: str, value: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(**{field: value})
