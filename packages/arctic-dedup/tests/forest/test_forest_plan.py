"""Group discovery on the device against the loop reference, and the plan's invariants."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arctic_dedup._triton_support import Backend
from arctic_dedup.errors import PlanError
from arctic_dedup.forest import (
    ForestGrouping,
    ForestKernelConfig,
    ForestWorkspace,
    plan_forest,
    plan_paged,
    reference_forest_groups,
)
from arctic_dedup.forest.plan import ForestPlan
from arctic_dedup.forest.testing import DecodeBatch, make_decode_batch


def _plan(
    batch: DecodeBatch,
    grouping: ForestGrouping | None = None,
    block_size: int = 16,
    backend: Backend = "auto",
    workspace: ForestWorkspace | None = None,
    **config: int,
):
    return plan_forest(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=block_size,
        num_cache_blocks=batch.key_cache.shape[0],
        max_query_len=batch.max_query_len,
        queries_per_kv=2,
        num_kv_heads=2,
        grouping=grouping,
        config=ForestKernelConfig(**config),
        workspace=workspace,
        backend=backend,
    )


def _reference(batch: DecodeBatch, grouping: ForestGrouping, block_size: int = 16) -> tuple[list[int], list[int]]:
    return reference_forest_groups(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size,
        min_group_size=grouping.min_group_size,
        min_additional_prefix_blocks=grouping.min_additional_prefix_blocks,
        min_non_singleton_fraction=grouping.min_non_singleton_fraction,
        max_non_singleton_groups=grouping.max_non_singleton_groups,
    )


def _random_batch(seed: int) -> DecodeBatch:
    rng = random.Random(seed)
    num_groups = rng.randint(1, 4)
    root = rng.choice([0, 0, 1, 2])
    prefix_lens = [rng.randint(max(root * 16, 1), 90) for _ in range(num_groups)]
    suffix_lens = [[rng.randint(0, 40) for _ in range(rng.randint(1, 5))] for _ in range(num_groups)]
    query_lens = [[rng.randint(1, 3) for _ in group] for group in suffix_lens]
    return make_decode_batch(
        prefix_lens, suffix_lens, query_lens=query_lens, root_blocks=root, shuffle=rng.random() < 0.5, seed=seed
    )


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    min_group_size=st.integers(2, 4),
    min_additional_prefix_blocks=st.integers(1, 3),
    min_non_singleton_fraction=st.sampled_from([0.0, 0.5, 0.9]),
    max_non_singleton_groups=st.sampled_from([0, 1, 3]),
    backend=st.sampled_from(["triton", "torch"]),
)
def test_groups_match_reference(
    seed: int,
    min_group_size: int,
    min_additional_prefix_blocks: int,
    min_non_singleton_fraction: float,
    max_non_singleton_groups: int,
    backend: Backend,
) -> None:
    batch = _random_batch(seed)
    grouping = ForestGrouping(
        min_group_size, min_additional_prefix_blocks, min_non_singleton_fraction, max_non_singleton_groups
    )
    plan = _plan(batch, grouping, backend=backend)
    leader, prefix = _reference(batch, grouping)
    assert plan.group_leader.tolist() == leader
    assert plan.prefix_blocks.tolist() == prefix
    assert int(plan.num_groups) == sum(1 for i, p in enumerate(prefix) if p > 0 and leader[i] == i)
    assert int(plan.num_grouped_requests) == sum(1 for p in prefix if p > 0)


def _check_invariants(plan: ForestPlan, batch: DecodeBatch) -> None:
    table = batch.block_table.tolist()
    starts = batch.query_start_loc.tolist()
    seq = batch.seq_lens.tolist()
    num_requests = len(seq)
    leaders = plan.group_leader.tolist()
    prefix = plan.prefix_blocks.tolist()
    tiles = plan.tile_of.tolist()
    slots = plan.slot_in_tile.tolist()
    members = plan.member_list.tolist()
    num_tiles = max(tiles) + 1
    tile_start = plan.tile_member_start.tolist()
    tile_count = plan.tile_member_count.tolist()
    for request, blocks in enumerate(prefix):
        # Every member holds the leader's prefix blocks, all before its first query token.
        assert table[request][:blocks] == table[leaders[request]][:blocks]
        assert blocks * 16 <= seq[request] - (starts[request + 1] - starts[request])
        if blocks:
            tile = tiles[request]
            assert 0 <= slots[request] < min(tile_count[tile], plan.members_per_tile)
            assert members[tile_start[tile] + slots[request]] == request
            assert plan.tile_leader[tile] == leaders[request]
            assert plan.tile_prefix_blocks[tile] == blocks
        else:
            assert tiles[request] == -1
    listed = sorted(m for t in range(num_tiles) for m in members[tile_start[t] : tile_start[t] + tile_count[t]])
    assert listed == sorted(i for i, p in enumerate(prefix) if p > 0)
    # Work lists cover each tile's prefix and each request's suffix once, in items of about one split.
    work = plan.work_start.tolist()
    prefix_split, suffix_split = plan.split_tokens.tolist()

    def items(length: int, split: int) -> int:
        return 0 if length <= 0 else max(1, -(-(length - split // 8) // split))

    for tile in range(num_requests):
        length = plan.tile_prefix_blocks[tile].item() * 16 if tile < num_tiles else 0
        assert work[tile + 1] - work[tile] == items(length, prefix_split)
    assert work[num_requests] <= plan.max_prefix_work
    for request, blocks in enumerate(prefix):
        owner = num_requests + request
        assert work[owner + 1] - work[owner] == items(seq[request] - blocks * 16, suffix_split)
    assert work[-1] - work[num_requests] <= plan.max_suffix_work
    assert int(plan.num_groups) == sum(1 for i, p in enumerate(prefix) if p > 0 and leaders[i] == i)


@pytest.mark.parametrize("seed", range(12))
def test_plan_invariants(seed: int) -> None:
    batch = _random_batch(seed)
    for backend in ("triton", "torch"):
        _check_invariants(_plan(batch, backend=backend, split_granularity=16, multiprocessors=3), batch)  # type: ignore[arg-type]


@pytest.mark.parametrize("members", [16, 32])
def test_triton_plan_equals_torch_plan(members: int) -> None:
    # Members of a group may sit in any slot order on the device; every other field is the same as the torch twin.
    batch = make_decode_batch([70, 45, 300], [[5, 9, 0, 3], [12, 1, 7], [2] * 9], root_blocks=1, shuffle=True, seed=4)
    device = _plan(batch, backend="triton", prefix_block_m=members, split_granularity=16)
    host = _plan(batch, backend="torch", prefix_block_m=members, split_granularity=16)
    for name in ("prefix_blocks", "group_leader", "work_start", "split_tokens", "num_groups", "saved_block_reads"):
        assert torch.equal(getattr(device, name), getattr(host, name)), name
    num_tiles = int(host.tile_of.max()) + 1
    for name in ("tile_leader", "tile_prefix_blocks", "tile_member_start", "tile_member_count"):
        assert torch.equal(getattr(device, name)[:num_tiles], getattr(host, name)[:num_tiles]), name
    _check_invariants(device, batch)


def test_workspace_is_zero_again_after_each_plan() -> None:
    workspace = ForestWorkspace(200, "cpu")
    for seed in range(3):
        batch = _random_batch(seed)
        plan = _plan(batch, backend="triton", workspace=workspace)
        assert plan.group_leader.tolist() == _reference(batch, ForestGrouping())[0]
        assert not workspace.counts.any() and not workspace.leader_slots.any() and not workspace.ticket.any()
    with pytest.raises(PlanError, match="ForestWorkspace"):
        _plan(_random_batch(0), backend="triton", workspace=ForestWorkspace(2, "cpu"))


def test_ids_outside_the_cache_are_never_grouped() -> None:
    batch = make_decode_batch([64], [[3, 4, 5]], seed=8)
    table = batch.block_table.clone()
    table[:, 1] = -5
    odd = DecodeBatch(**{**vars(batch), "block_table": table})
    plan = _plan(odd, backend="triton")
    # The common run stops at the bad id: the first block is the only verified shared prefix.
    assert plan.prefix_blocks.tolist() == [1, 1, 1]


def test_siblings_share_prompt_blocks_under_a_common_root() -> None:
    batch = make_decode_batch([200, 130], [[5] * 4, [9] * 3], root_blocks=2, shuffle=True, seed=3)
    plan = _plan(batch)
    groups: dict[int, list[int]] = {}
    for request, leader in enumerate(plan.group_leader.tolist()):
        groups.setdefault(leader, []).append(request)
    assert sorted(len(g) for g in groups.values()) == [3, 4]
    assert sorted(set(plan.prefix_blocks.tolist())) == [130 // 16, 200 // 16]
    assert int(plan.saved_block_reads) == 3 * (200 // 16) + 2 * (130 // 16)


def test_nothing_shared_gives_no_groups() -> None:
    batch = make_decode_batch([50, 60, 70], [[4], [0], [9]], seed=1)
    plan = _plan(batch)
    assert plan.prefix_blocks.tolist() == [0, 0, 0]
    assert plan.tile_of.tolist() == [-1, -1, -1]
    assert int(plan.num_groups) == 0


def test_padding_block_zero_is_not_shared() -> None:
    # Every table row ends in block 0 (vLLM's null block); it must never form a group.
    batch = make_decode_batch([10, 12], [[3], [4]], spare_blocks=0, seed=2)
    assert (batch.block_table[:, -1] == 0).all()
    assert _plan(batch).prefix_blocks.tolist() == [0, 0]


def test_paged_plan_has_no_groups() -> None:
    batch = make_decode_batch([64], [[3, 4, 5]], seed=4)
    plan = plan_paged(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=16,
        max_query_len=1,
        queries_per_kv=2,
        num_kv_heads=2,
    )
    assert not plan.shares
    assert plan.prefix_blocks.tolist() == [0, 0, 0]


def test_bad_inputs_say_what_to_fix() -> None:
    batch = make_decode_batch([32], [[1, 2]], seed=5)
    with pytest.raises(PlanError, match="seq_lens"):
        plan_forest(
            batch.block_table,
            batch.seq_lens[:1],
            batch.query_start_loc,
            block_size=16,
            num_cache_blocks=99,
            max_query_len=1,
            queries_per_kv=2,
            num_kv_heads=2,
        )
    with pytest.raises(PlanError, match="int32"):
        plan_forest(
            batch.block_table.float(),
            batch.seq_lens,
            batch.query_start_loc,
            block_size=16,
            num_cache_blocks=99,
            max_query_len=1,
            queries_per_kv=2,
            num_kv_heads=2,
        )
    with pytest.raises(ValueError, match="min_group_size"):
        ForestGrouping(min_group_size=1)
    with pytest.raises(ValueError, match="power of two"):
        ForestKernelConfig(prefix_block_m=48)


def test_plan_builds_without_host_reads_under_inference_mode() -> None:
    batch = _random_batch(7)
    with torch.inference_mode():
        plan = _plan(batch)
    assert plan.prefix_blocks.device == batch.block_table.device


def test_int64_tables_and_lengths_plan_the_same() -> None:
    batch = _random_batch(21)
    wide = DecodeBatch(
        **{
            **vars(batch),
            "block_table": batch.block_table.long(),
            "seq_lens": batch.seq_lens.long(),
            "query_start_loc": batch.query_start_loc.long(),
        }
    )
    narrow_plan, wide_plan = _plan(batch, backend="triton"), _plan(wide, backend="triton")
    for name in ("group_leader", "prefix_blocks", "work_start", "split_tokens"):
        assert torch.equal(getattr(narrow_plan, name), getattr(wide_plan, name)), name


def test_batches_past_the_register_gather_limit_plan_like_the_torch_twin() -> None:
    # Batches padded past 128 requests finish the plan through memory gathers instead of register ones.
    rng = random.Random(5)
    prefix_lens = [rng.randint(20, 60) for _ in range(56)]
    suffix_lens = [[rng.randint(0, 9) for _ in range(rng.choice([1, 1, 3, 7]))] for _ in prefix_lens]
    batch = make_decode_batch(prefix_lens, suffix_lens, root_blocks=1, shuffle=True, seed=5)
    assert batch.seq_lens.shape[0] > 128
    device = _plan(batch, backend="triton", split_granularity=16)
    host = _plan(batch, backend="torch", split_granularity=16)
    for name in ("prefix_blocks", "group_leader", "work_start", "split_tokens", "num_groups", "saved_block_reads"):
        assert torch.equal(getattr(device, name), getattr(host, name)), name
    _check_invariants(device, batch)
