"""Internal launch variants of forest decode (split prefix/suffix passes, combine slices) against the reference."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from test_forest_decode import SMALL, _assert_close, _plan, _poisoned, _reference

from arctic_dedup.errors import PlanError
from arctic_dedup.forest import ForestKernelConfig, plan_paged
from arctic_dedup.forest._launch import (
    DecodeKnobs,
    allocate_partials,
    check_decode_inputs,
    launch_attention,
    launch_combine,
    launch_forest_decode,
)
from arctic_dedup.forest.testing import DecodeBatch, make_decode_batch

KNOBS = {
    "split": DecodeKnobs(split_passes=True),
    "split_side_stream_prefix_options": DecodeKnobs(
        split_passes=True, side_stream=True, prefix_num_warps=8, prefix_num_stages=2
    ),
    "combine_slices": DecodeKnobs(combine_dim_block=16, combine_chunk_cap=64),
    "split_combine_slices_small_chunks": DecodeKnobs(split_passes=True, combine_dim_block=32, combine_chunk_cap=2),
}
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
    _run(_random_forest(seed, block_size, queries_per_kv, head_dim), queries_per_kv, KNOBS[knobs_name])


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
    ],
)
def test_knobs_are_validated(field: str, value: int, message: str) -> None:
    arguments: dict[str, Any] = {field: value}
    with pytest.raises(ValueError, match=message):
        DecodeKnobs(**arguments)
