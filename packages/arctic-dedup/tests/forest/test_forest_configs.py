"""Forest decode under the kernel configs a user can choose (``ForestKernelConfig``) and the default rule."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
import torch
from test_forest_decode import SMALL, _assert_close, _plan, _poisoned, _reference

from arctic_dedup.forest import ForestKernelConfig, forest_decode, plan_forest, plan_paged
from arctic_dedup.forest._launch import check_decode_inputs, dependent_launches, launch_forest_decode
from arctic_dedup.forest.plan import default_forest_config
from arctic_dedup.forest.testing import DecodeBatch, make_decode_batch

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


def _small(config: ForestKernelConfig) -> ForestKernelConfig:
    """Split lengths small enough that tiny forests still get several items per owner."""
    return replace(config, split_granularity=16, multiprocessors=4)


def _run(batch: DecodeBatch, queries_per_kv: int, config: ForestKernelConfig = SMALL) -> None:
    scale = batch.query.shape[2] ** -0.5
    plan = _plan(batch, queries_per_kv, config=config)
    out, lse = _poisoned(batch)
    check_decode_inputs(batch.query, batch.key_cache, batch.value_cache, plan, out, lse)
    launch_forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, scale, out, lse)
    _assert_close(out, lse, _reference(batch, scale), 1e-5)


# The default rule's two configs and the shapes a user may pick instead (tiles, waves, combine slices).
CONFIGS = {
    "default_one_wave": _small(default_forest_config(16, 8, 132)),
    "default_split": _small(default_forest_config(128, 8, 132)),
    "plain": SMALL,
    "split_p64_s64": _small(ForestKernelConfig(prefix_block_n=64, suffix_block_n=64, split_passes=True)),
    "split_deep_pipeline": _small(ForestKernelConfig(num_stages=5, split_passes=True)),
    "split_combine_slices": replace(SMALL, split_passes=True, combine_dim_block=32, combine_chunk_cap=4),
    "one_wave_combine32": _small(ForestKernelConfig(prefix_waves=1.0, waves=1.0, combine_dim_block=32)),
    "narrow_combine_programs": replace(SMALL, combine_chunk_cap=4, combine_num_warps=2),
    "one_warp_combine_slices": replace(SMALL, combine_dim_block=16, combine_num_warps=1, combine_chunk_cap=2),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(("block_size", "queries_per_kv", "head_dim"), LATIN[::2])
def test_configs_match_reference_on_random_forests(
    name: str, block_size: int, queries_per_kv: int, head_dim: int
) -> None:
    seed = 7 * block_size + queries_per_kv + head_dim + 3 * len(name)
    _run(_random_forest(seed, block_size, queries_per_kv, head_dim), queries_per_kv, CONFIGS[name])


@pytest.mark.parametrize("name", ["default_split", "split_p64_s64", "split_combine_slices"])
@pytest.mark.parametrize(("block_size", "queries_per_kv", "head_dim"), LATIN[1::2])
def test_split_configs_on_the_other_latin_cells(name: str, block_size: int, queries_per_kv: int, head_dim: int) -> None:
    seed = 11 * block_size + queries_per_kv + head_dim
    _run(_random_forest(seed, block_size, queries_per_kv, head_dim), queries_per_kv, CONFIGS[name])


def test_configs_with_query_lengths_up_to_the_maximum() -> None:
    # Every query length 1..4 in one batch, groups of one, empty suffixes, prompts ending mid-block.
    batch = make_decode_batch(
        [53, 40, 77],
        [[0, 9, 3, 0], [5], [0, 12]],
        query_lens=[[1, 2, 3, 4], [4], [2, 1]],
        queries_per_kv=4,
        seed=31,
    )
    for config in CONFIGS.values():
        _run(batch, 4, config)


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
        split_passes=True,
        combine_dim_block=16,
        combine_chunk_cap=2,
    )
    plan = _plan(batch, 4, config=config)
    assert int(plan.num_groups) >= 1
    _run(batch, 4, config)


def test_split_passes_on_a_plan_without_groups_run_one_launch() -> None:
    batch = make_decode_batch([40], [[3, 4]], seed=23)
    plan = plan_paged(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=16,
        max_query_len=1,
        queries_per_kv=2,
        num_kv_heads=2,
        config=replace(SMALL, split_passes=True),
    )
    out, lse = _poisoned(batch)
    launch_forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, 0.2, out, lse)
    _assert_close(out, lse, _reference(batch, 0.2), 1e-5)


def test_combine_shape_comes_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from arctic_dedup.forest import _kernels

    launches: list[tuple[int, int, int, int]] = []
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
    _run(batch, 4, narrow)
    _run(batch, 4, replace(narrow, combine_dim_block=32, combine_num_warps=2, combine_chunk_cap=4))
    _run(batch, 4, _small(ForestKernelConfig()))
    pairs = batch.seq_lens.shape[0] * batch.key_cache.shape[2]
    assert launches == [(pairs * 4, 16, 1, 2), (pairs * 2, 32, 2, 4), (pairs, 64, 4, 16)]


def test_default_config_is_a_rule_by_batch_size() -> None:
    one_wave = default_forest_config(16, 8, 132)
    assert (one_wave.prefix_waves, one_wave.waves, one_wave.split_passes) == (1.0, 1.0, False)
    assert one_wave.prefix_block_n == 64
    many = default_forest_config(128, 8, 132)
    assert (many.prefix_block_n, many.split_passes, many.prefix_waves) == (64, True, 2.0)
    assert default_forest_config(17, 8, 132) == many
    # One-warp combine programs over 64-dim slices, 8 partials at a time, dependent launches and the early combine.
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


def test_dependent_launches_need_a_cuda_device_of_compute_capability_9() -> None:
    assert not dependent_launches(ForestKernelConfig(dependent_launches=True), torch.device("cpu"))
    assert not dependent_launches(ForestKernelConfig(), torch.device("cpu"))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("combine_dim_block", 24, "combine_dim_block must be a power of two >= 16"),
        ("combine_dim_block", 8, "combine_dim_block must be a power of two >= 16"),
        ("combine_num_warps", 3, "combine_num_warps must be 1, 2, 4 or 8"),
        ("combine_chunk_cap", 6, "combine_chunk_cap must be a power of two >= 1"),
        ("prefix_block_n", 24, "prefix_block_n must be a power of two >= 16"),
        ("split_granularity", 0, "split_granularity must be >= 1"),
        ("waves", 0.0, "waves and prefix_waves must be > 0"),
    ],
)
def test_bad_configs_are_refused(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ForestKernelConfig(**{field: value})  # type: ignore[arg-type]
