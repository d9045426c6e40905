"""forest_decode and paged_decode (Triton through the interpreter on CPU, and the torch path) against the reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from arctic_dedup._triton_support import Backend
from arctic_dedup.errors import PlanError
from arctic_dedup.forest import (
    ForestGrouping,
    ForestKernelConfig,
    forest_decode,
    paged_decode,
    plan_forest,
    plan_paged,
    reference_paged_attention,
)
from arctic_dedup.forest.testing import DecodeBatch, make_decode_batch

# Small tiles and split lengths so tiny batches still exercise several tiles, splits and tile members.
SMALL = ForestKernelConfig(
    prefix_block_m=16, prefix_block_n=16, suffix_block_n=16, split_granularity=16, multiprocessors=2, waves=2.0
)


def _plan(
    batch: DecodeBatch,
    queries_per_kv: int,
    config: ForestKernelConfig = SMALL,
    backend: Backend = "auto",
    **grouping: int,
):
    return plan_forest(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=batch.key_cache.shape[1],
        num_cache_blocks=batch.key_cache.shape[0],
        max_query_len=batch.max_query_len,
        queries_per_kv=queries_per_kv,
        num_kv_heads=batch.key_cache.shape[2],
        grouping=ForestGrouping(**grouping),
        config=config,
        backend=backend,
    )


def _paged_plan(batch: DecodeBatch, queries_per_kv: int, config: ForestKernelConfig, backend: Backend = "auto"):
    return plan_paged(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=batch.key_cache.shape[1],
        max_query_len=batch.max_query_len,
        queries_per_kv=queries_per_kv,
        num_kv_heads=batch.key_cache.shape[2],
        config=config,
        backend=backend,
    )


def _reference(batch: DecodeBatch, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return reference_paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc, scale
    )


def _poisoned(batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full_like(batch.query, float("nan"))
    lse = torch.full(batch.query.shape[:2], float("nan"), dtype=torch.float32)
    return out, lse


def _assert_close(out: torch.Tensor, lse: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor], tol: float) -> None:
    ref_out, ref_lse = ref
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    error = (out.float() - ref_out).norm() / ref_out.norm()
    assert error < tol, f"relative output error {error:.2e} >= {tol:.0e}"
    assert torch.allclose(lse, ref_lse, atol=tol * 10, rtol=tol)


CASES = {
    # name: (prefix_lens, suffix_lens, query_lens, root_blocks, block_size, queries_per_kv, head_dim, shuffle)
    "rl_like": ([70, 45], [[5, 9, 0, 3], [12, 1, 7]], None, 0, 16, 2, 32, True),
    "prefix_mid_block_gqa4": ([53], [[0, 20, 31]], None, 0, 16, 4, 32, False),
    "group_of_one_and_mha": ([40, 33, 64], [[8], [3, 4], [0]], None, 0, 16, 1, 32, True),
    "spec_tokens": ([48, 29], [[2, 0], [6, 3, 1]], [[3, 1], [2, 3, 3]], 0, 16, 2, 32, False),
    "nested_root": ([100, 80], [[4, 6, 2], [7, 1]], None, 3, 16, 2, 32, True),
    "gqa8_block32": ([96], [[10, 40, 0]], [[2, 1, 1]], 0, 32, 8, 32, True),
    "head64_block64": ([130, 64], [[3, 9], [1, 2]], None, 0, 64, 4, 64, False),
    "head_dim_not_power_of_two": ([50], [[3, 5]], None, 0, 16, 2, 48, False),
    "head128": ([40], [[2, 3]], None, 0, 16, 2, 128, False),
    "head256_block32": ([70], [[0, 3]], None, 0, 32, 4, 256, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forest_decode_triton_matches_reference(name: str) -> None:
    prefix_lens, suffix_lens, query_lens, root, block_size, queries_per_kv, head_dim, shuffle = CASES[name]
    batch = make_decode_batch(
        prefix_lens,
        suffix_lens,
        query_lens=query_lens,
        root_blocks=root,
        block_size=block_size,
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        shuffle=shuffle,
        seed=len(name),
    )
    scale = head_dim**-0.5
    plan = _plan(batch, queries_per_kv)
    assert int(plan.num_groups) >= 1
    out, lse = _poisoned(batch)
    forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, scale, out=out, lse=lse, backend="triton")
    _assert_close(out, lse, _reference(batch, scale), 1e-5)


@pytest.mark.parametrize("name", ["rl_like", "spec_tokens", "nested_root"])
def test_torch_path_matches_reference(name: str) -> None:
    prefix_lens, suffix_lens, query_lens, root, block_size, queries_per_kv, head_dim, shuffle = CASES[name]
    batch = make_decode_batch(
        prefix_lens,
        suffix_lens,
        query_lens=query_lens,
        root_blocks=root,
        block_size=block_size,
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        shuffle=shuffle,
        seed=1,
    )
    plan = _plan(batch, queries_per_kv)
    out, lse = _poisoned(batch)
    forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, 0.2, out=out, lse=lse, backend="torch")
    _assert_close(out, lse, _reference(batch, 0.2), 1e-5)


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("query_len", [1, 3])
def test_paged_decode_matches_reference(head_major: bool, query_len: int) -> None:
    batch = make_decode_batch(
        [37, 90],
        [[0, 50], [3]],
        query_lens=[[query_len, 1], [query_len]],
        head_major_cache=head_major,
        queries_per_kv=4,
        seed=query_len,
    )
    out, lse = _poisoned(batch)
    paged_decode(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        0.25,
        max_query_len=batch.max_query_len,
        config=SMALL,
        out=out,
        lse=lse,
        backend="triton",
    )
    _assert_close(out, lse, _reference(batch, 0.25), 1e-5)


def test_no_sharing_is_exactly_the_per_request_kernel() -> None:
    batch = make_decode_batch([40, 61, 19], [[7], [0], [30]], queries_per_kv=2, seed=9)
    plan = _plan(batch, 2)
    assert int(plan.num_groups) == 0
    forest_out, forest_lse = forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, 0.3, backend="triton")
    paged_out, paged_lse = paged_decode(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        0.3,
        config=SMALL,
        backend="triton",
    )
    assert torch.equal(forest_out, paged_out) and torch.equal(forest_lse, paged_lse)


def test_ungrouped_batch_by_knob_matches_reference() -> None:
    batch = make_decode_batch([64, 64], [[3, 4], [5, 6]], seed=11)
    plan = _plan(batch, 2, max_non_singleton_groups=1)
    assert int(plan.num_groups) == 0
    out, lse = forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, 0.3, backend="triton")
    _assert_close(out, lse, _reference(batch, 0.3), 1e-5)


def test_bf16_in_interpreter_is_within_bf16_noise() -> None:
    batch = make_decode_batch([80], [[4, 9, 0]], queries_per_kv=4, dtype=torch.bfloat16, seed=12)
    plan = _plan(batch, 4)
    out, lse = forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, 0.2, backend="triton")
    assert out.dtype == torch.bfloat16
    _assert_close(out, lse, _reference(batch, 0.2), 1e-2)


def test_default_config_matches_reference() -> None:
    batch = make_decode_batch([70], [[3, 5, 8, 0, 2]], queries_per_kv=4, seed=13)
    plan = _plan(batch, 4, config=ForestKernelConfig())
    out, lse = forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, 0.2, backend="triton")
    _assert_close(out, lse, _reference(batch, 0.2), 1e-5)


def test_mismatched_plan_is_rejected() -> None:
    batch = make_decode_batch([32], [[1, 2]], seed=14)
    plan = _plan(batch, 2)
    with pytest.raises(PlanError, match="queries_per_kv"):
        forest_decode(batch.query[:, :2], batch.key_cache, batch.value_cache, plan, 0.2)
    with pytest.raises(PlanError, match="dtype"):
        forest_decode(batch.query.double(), batch.key_cache, batch.value_cache, plan, 0.2)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_many_splits_merge_in_chunks(backend: Backend) -> None:
    # Tiny splits give each request dozens of partials, more than one combine chunk holds.
    batch = make_decode_batch([900, 300], [[40, 0, 7], [300, 2]], queries_per_kv=2, seed=15)
    config = ForestKernelConfig(
        prefix_block_m=16,
        prefix_block_n=16,
        suffix_block_n=16,
        split_granularity=16,
        multiprocessors=64,
        prefix_waves=4.0,
        waves=4.0,
    )
    plan = _plan(batch, 2, config=config)
    work = plan.work_start.tolist()
    assert max(b - a for a, b in itertools.pairwise(work)) > 16
    out, lse = _poisoned(batch)
    forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, 0.2, out=out, lse=lse, backend=backend)
    _assert_close(out, lse, _reference(batch, 0.2), 1e-5)
