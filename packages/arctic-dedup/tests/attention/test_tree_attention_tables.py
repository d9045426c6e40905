"""The Triton kernels' block tables against the dense mask: full tiles entirely visible and inside [0, T), skipped
tiles entirely invisible, lists ascending, work order a permutation; with and without a sliding window."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_attention_cases import CPU_CASES, random_tree_plan

from arctic_dedup.attention import reference_mask
from arctic_dedup.attention._tables import build_kernel_tables
from arctic_dedup.attention.metadata import FLEX_BLOCK_SIZE, prepare_tree_attention
from arctic_dedup.attention.triton_config import TritonConfig
from arctic_dedup.errors import PlanError


def _check(plan, block_m: int, block_n: int, window: int | None) -> None:  # type: ignore[no-untyped-def]
    tables = build_kernel_tables(plan.kv_visible_until, plan.position_ids, block_m, block_n, window)
    tokens = plan.num_packed_tokens
    padded = tables.num_q_blocks * block_m
    assert padded == tables.num_k_blocks * block_n and padded >= tokens
    mask = torch.zeros(padded, padded, dtype=torch.bool)
    mask[:tokens, :tokens] = reference_mask(plan.kv_visible_until, plan.position_ids, window)
    tiles = mask.view(tables.num_q_blocks, block_m, tables.num_k_blocks, block_n)
    tile_any = tiles.any(dim=3).any(dim=1)
    tile_all = tiles.all(dim=3).all(dim=1)
    full = torch.zeros_like(tile_any)
    part = torch.zeros_like(tile_any)
    for row in range(tables.num_q_blocks):
        full_list = tables.kv_full_indices[row, : tables.kv_full_num[row]].long()
        part_list = tables.kv_part_indices[row, : tables.kv_part_num[row]].long()
        assert torch.all(full_list[1:] > full_list[:-1]) and torch.all(part_list[1:] > part_list[:-1])
        full[row, full_list] = True
        part[row, part_list] = True
    assert not bool((full & part).any())
    assert bool(tile_all[full].all()), "a tile listed as full has an invisible element"
    assert not bool((tile_any & ~full & ~part).any()), "a tile with a visible element is skipped"
    # Full tiles lie inside [0, T): their loads are unmasked.
    rows, cols = torch.nonzero(full, as_tuple=True)
    assert bool(((rows + 1) * block_m <= tokens).all()) and bool(((cols + 1) * block_n <= tokens).all())
    # The transposed lists describe the same tiles.
    full_t = torch.zeros_like(full.t())
    part_t = torch.zeros_like(part.t())
    for col in range(tables.num_k_blocks):
        full_t[col, tables.q_full_indices[col, : tables.q_full_num[col]].long()] = True
        part_t[col, tables.q_part_indices[col, : tables.q_part_num[col]].long()] = True
    assert torch.equal(full_t, full.t()) and torch.equal(part_t, part.t())
    assert sorted(tables.q_block_order.tolist()) == list(range(tables.num_q_blocks))
    assert sorted(tables.k_block_order.tolist()) == list(range(tables.num_k_blocks))
    work = tables.kv_full_num + tables.kv_part_num
    assert torch.all(work[tables.q_block_order.long()][:-1] >= work[tables.q_block_order.long()][1:])


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (16, 32), (32, 16)])
@pytest.mark.parametrize("window", [None, 3, 17])
def test_tables_match_dense_mask(case, block_m: int, block_n: int, window: int | None) -> None:  # type: ignore[no-untyped-def]
    _check(case.build(), block_m, block_n, window)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 100_000), window=st.sampled_from([None, 1, 2, 5, 40]), blocks=st.sampled_from([16, 32, 64]))
def test_tables_on_random_trees(seed: int, window: int | None, blocks: int) -> None:
    _check(random_tree_plan(seed), blocks, 16, window)


def test_metadata_holds_every_prepared_table_and_names_what_is_missing() -> None:
    plan = CPU_CASES[3].build()
    config = TritonConfig(block_m=16, block_n=32, bwd_block_m=16, bwd_block_n=16, dq_block_m=32, dq_block_n=16)
    metadata = prepare_tree_attention(
        plan, backends=("triton", "flex"), head_dim=16, dtype=torch.float32, sliding_windows=(None, 4),
        triton_config=config,
    )  # fmt: skip
    tile_sizes = {(16, 32), (16, 16), (32, 16), (FLEX_BLOCK_SIZE, FLEX_BLOCK_SIZE)}
    assert set(metadata.block_tables) == {(m, n, w) for m, n in tile_sizes for w in (None, 4)}
    for (block_m, block_n, window), tables in metadata.block_tables.items():
        expected = build_kernel_tables(plan.kv_visible_until, plan.position_ids, block_m, block_n, window)
        assert torch.equal(tables.kv_full_indices, expected.kv_full_indices)
        assert torch.equal(tables.kv_part_num, expected.kv_part_num)
    assert metadata.tables(16, 16, 4) is metadata.block_tables[(16, 16, 4)]
    with pytest.raises(PlanError, match=r"not \(16, 16, 7\).*sliding_windows"):
        metadata.tables(16, 16, 7)
    with pytest.raises(PlanError, match="not 'sdpa'"):
        metadata.calls()
    with pytest.raises(TypeError):
        metadata.block_tables[(1, 1, None)] = metadata.tables(16, 16, None)  # type: ignore[index]
    with pytest.raises(ValueError, match="concrete backends"):
        prepare_tree_attention(plan, backends=("auto",), head_dim=16, dtype=torch.float32)  # type: ignore[arg-type]
