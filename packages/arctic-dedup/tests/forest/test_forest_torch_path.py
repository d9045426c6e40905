"""The batched torch path of forest_decode against dense float64 attention, over random layouts and groupings."""

from __future__ import annotations

import dataclasses
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arctic_dedup.forest import ForestGrouping, ForestPlan, forest_decode, plan_forest, plan_paged


@dataclasses.dataclass(frozen=True)
class Layout:
    """Requests over a NaN-poisoned paged cache: each reads its prompt's shared full blocks, then blocks of its own."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    prompt_of: list[int]
    shared_blocks: list[int]
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor


def _layout(seed: int, block_size: int, num_kv_heads: int, queries_per_kv: int, spare_rows: int) -> Layout:
    rng = random.Random(seed)
    num_prompts = rng.randint(1, 3)
    prompt_lens = [rng.randint(0, 5 * block_size) for _ in range(num_prompts)]
    num_requests = rng.randint(1, 8)
    # Members of one prompt are interleaved with other prompts' requests (non-contiguous groups).
    prompt_of = [rng.randrange(num_prompts) for _ in range(num_requests)]
    query_lens = [rng.choice([0, 1, 1, 1, 2, 3]) for _ in range(num_requests)]
    own_lens = [rng.choice([0, rng.randint(0, 3 * block_size)]) for _ in range(num_requests)]
    next_block = 1  # block 0 is the null block, as in vLLM, poisoned like every slot outside a context
    prompt_blocks = []
    for length in prompt_lens:
        prompt_blocks.append(list(range(next_block, next_block + length // block_size)))
        next_block += length // block_size
    rows, seq_lens = [], []
    for request in range(num_requests):
        prompt = prompt_of[request]
        seq_len = prompt_lens[prompt] + own_lens[request] + query_lens[request]
        own = -(-seq_len // block_size) - len(prompt_blocks[prompt])
        rows.append(prompt_blocks[prompt] + list(range(next_block, next_block + own)))
        next_block += own
        seq_lens.append(seq_len)
    physical = list(range(1, next_block))
    rng.shuffle(physical)
    relabel = {block: physical[block - 1] for block in range(1, next_block)}
    table = torch.zeros(num_requests, max(len(row) for row in rows) + 1, dtype=torch.int32)
    for request, row in enumerate(rows):
        table[request, : len(row)] = torch.tensor([relabel[block] for block in row], dtype=torch.int32)
    query_start_loc = torch.zeros(num_requests + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)

    generator = torch.Generator().manual_seed(seed)
    head_dim = 16
    shape = (next_block + 2, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"))
    value_cache = torch.full(shape, float("nan"))
    for request, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len)
        blocks, offsets = table[request, positions // block_size].long(), positions % block_size
        key_cache[blocks, offsets] = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
        value_cache[blocks, offsets] = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator)
    num_tokens = int(query_start_loc[-1]) + spare_rows
    query = torch.randn(num_tokens, num_kv_heads * queries_per_kv, head_dim, generator=generator)
    return Layout(
        table,
        torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc,
        prompt_of,
        [len(blocks) for blocks in prompt_blocks],
        query,
        key_cache,
        value_cache,
    )


def _dense_reference(layout: Layout, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's query over its whole context, causal, float64."""
    block_size = layout.key_cache.shape[1]
    num_tokens, num_heads, head_dim = layout.query.shape
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float64)
    starts = layout.query_start_loc.tolist()
    for request, seq_len in enumerate(layout.seq_lens.tolist()):
        begin, end = starts[request], starts[request + 1]
        if begin == end:
            continue
        positions = torch.arange(seq_len)
        blocks, offsets = layout.block_table[request, positions // block_size].long(), positions % block_size
        group = num_heads // layout.key_cache.shape[2]
        keys = layout.key_cache[blocks, offsets].double().repeat_interleave(group, dim=1)
        values = layout.value_cache[blocks, offsets].double().repeat_interleave(group, dim=1)
        queries = layout.query[begin:end].double()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        query_positions = seq_len - (end - begin) + torch.arange(end - begin)
        scores = scores.masked_fill(positions[None, None, :] > query_positions[None, :, None], float("-inf"))
        lse[begin:end] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
        out[begin:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)
    return out, lse


def _hand_grouped(plan: ForestPlan, layout: Layout, rng: random.Random) -> ForestPlan:
    """The plan with random groups: per prompt a random subset of its requests (one request included), a random
    leader among them and a random number of the full blocks they all hold before their first query token."""
    block_size = plan.block_size
    starts = layout.query_start_loc.tolist()
    leaders = list(range(len(layout.prompt_of)))
    prefix_blocks = [0] * len(layout.prompt_of)
    for prompt, shared in enumerate(layout.shared_blocks):
        members = [request for request, owner in enumerate(layout.prompt_of) if owner == prompt]
        chosen = [request for request in members if rng.random() < 0.7]
        eligible = [min(shared, (int(layout.seq_lens[r]) - (starts[r + 1] - starts[r])) // block_size) for r in chosen]
        if not chosen or min(eligible) < 1:
            continue
        blocks = rng.randint(1, min(eligible))
        leader = rng.choice(chosen)
        for request in chosen:
            leaders[request], prefix_blocks[request] = leader, blocks
    return dataclasses.replace(
        plan,
        group_leader=torch.tensor(leaders, dtype=torch.int32),
        prefix_blocks=torch.tensor(prefix_blocks, dtype=torch.int32),
    )


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    block_size=st.sampled_from([4, 8]),
    num_kv_heads=st.sampled_from([1, 2]),
    queries_per_kv=st.sampled_from([1, 2, 4]),
    spare_rows=st.integers(0, 2),
    planner=st.sampled_from(["hand", "plan_forest"]),
)
def test_torch_path_matches_dense_float64_attention(
    seed: int, block_size: int, num_kv_heads: int, queries_per_kv: int, spare_rows: int, planner: str
) -> None:
    layout = _layout(seed, block_size, num_kv_heads, queries_per_kv, spare_rows)
    max_query_len = max(1, int((layout.query_start_loc[1:] - layout.query_start_loc[:-1]).max()))
    sizes = {
        "block_size": block_size,
        "max_query_len": max_query_len,
        "queries_per_kv": queries_per_kv,
        "num_kv_heads": num_kv_heads,
    }
    if planner == "hand":
        paged = plan_paged(layout.block_table, layout.seq_lens, layout.query_start_loc, backend="torch", **sizes)
        plan = _hand_grouped(paged, layout, random.Random(seed))
    else:
        plan = plan_forest(
            layout.block_table,
            layout.seq_lens,
            layout.query_start_loc,
            num_cache_blocks=layout.key_cache.shape[0],
            grouping=ForestGrouping(),
            backend="torch",
            **sizes,
        )
    scale = 0.25
    out = torch.full_like(layout.query, float("nan"))
    lse = torch.full(layout.query.shape[:2], float("nan"))
    # Twice with one plan, as the model's layers call it: the second call reuses the first call's indices.
    caches = (layout.key_cache, layout.value_cache)
    for _ in range(2):
        forest_decode(layout.query, *caches, plan, scale, out=out, lse=lse, backend="torch")
    ref_out, ref_lse = _dense_reference(layout, scale)
    written = int(layout.query_start_loc[-1])
    torch.testing.assert_close(out[:written].double(), ref_out[:written], atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse[:written].double(), ref_lse[:written], atol=2e-6, rtol=2e-6)
    assert torch.isnan(out[written:]).all() and torch.isnan(lse[written:]).all()


def test_rows_that_see_no_key_get_zero_and_minus_infinity() -> None:
    """A request whose query token sees no key (length 0, its row all null blocks): out 0, lse -inf, no NaN from the
    null block's bits; the group beside it is unaffected."""
    table = torch.tensor([[1, 2, 3], [1, 2, 4], [0, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 9, 0], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    generator = torch.Generator().manual_seed(0)
    key_cache = torch.randn(6, 4, 1, 8, generator=generator)
    value_cache = torch.randn(6, 4, 1, 8, generator=generator)
    key_cache[0] = value_cache[0] = float("nan")
    query = torch.randn(3, 2, 8, generator=generator)
    plan = plan_paged(table, seq_lens, query_start_loc, block_size=4, max_query_len=1, queries_per_kv=2, num_kv_heads=1)
    plan = dataclasses.replace(
        plan,
        group_leader=torch.tensor([0, 0, 2], dtype=torch.int32),
        prefix_blocks=torch.tensor([2, 2, 0], dtype=torch.int32),
    )
    out, lse = forest_decode(query, key_cache, value_cache, plan, 0.3, backend="torch")
    assert torch.equal(out[2], torch.zeros(2, 8)) and torch.equal(lse[2], torch.full((2,), float("-inf")))
    layout = Layout(table, seq_lens, query_start_loc, [0, 0, 1], [2, 0], query, key_cache, value_cache)
    ref_out, ref_lse = _dense_reference(layout, 0.3)
    torch.testing.assert_close(out[:2].double(), ref_out[:2], atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse[:2].double(), ref_lse[:2], atol=2e-6, rtol=2e-6)
