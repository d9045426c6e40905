"""forest_decode and paged_decode on CUDA in bf16 against the fp32 reference (run by ``nox -s gpu_tests``)."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from arctic_dedup.forest import (
    ForestGrouping,
    ForestKernelConfig,
    ForestScratch,
    ForestWorkspace,
    StaticForestPlan,
    forest_decode,
    paged_decode,
    plan_forest,
    plan_paged,
    reference_paged_attention,
)
from arctic_dedup.forest.testing import DecodeBatch, make_decode_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _random_batch(seed: int, block_size: int, queries_per_kv: int, head_dim: int, max_query_len: int) -> DecodeBatch:
    rng = random.Random(seed)
    num_groups = rng.randint(1, 5)
    root = rng.choice([0, 1])
    prefix_lens = [rng.randint(root * block_size + 1, 700) for _ in range(num_groups)]
    suffix_lens = [[rng.choice([0, rng.randint(1, 300)]) for _ in range(rng.randint(1, 9))] for _ in prefix_lens]
    query_lens = [[rng.randint(1, max_query_len) for _ in group] for group in suffix_lens]
    return make_decode_batch(
        prefix_lens,
        suffix_lens,
        query_lens=query_lens,
        root_blocks=root,
        block_size=block_size,
        num_kv_heads=2,
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device="cuda",
        shuffle=True,
        seed=seed,
    )


def _captured(run: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``run``, after one eager call on a side stream (it compiles and records the launches)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def _check(out: torch.Tensor, lse: torch.Tensor, batch: DecodeBatch, scale: float) -> None:
    ref_out, ref_lse = reference_paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc, scale
    )
    out, lse = out.float().cpu(), lse.cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    error = ((out - ref_out).norm() / ref_out.norm()).item()
    assert error < 1.5e-2, f"relative error {error:.2e}"
    assert torch.allclose(lse, ref_lse, atol=5e-2, rtol=1e-2)


def _layers_of_one_step(
    seed: int, groups: int, prompt_tokens: tuple[int, int], response_tokens: int, max_samples: int, min_samples: int
) -> list[DecodeBatch]:
    """A decode step's batch and two more layers: every layer shares the step's block table; its query and caches
    hold values of its own."""
    from dataclasses import replace

    rng = random.Random(seed)
    prefix_lens = [rng.randint(*prompt_tokens) for _ in range(groups)]
    suffix_lens = [
        [rng.randint(0, response_tokens) for _ in range(rng.randint(min_samples, max_samples))] for _ in prefix_lens
    ]
    first = make_decode_batch(
        prefix_lens, suffix_lens, queries_per_kv=4, head_dim=128, dtype=torch.bfloat16, device="cuda", seed=seed
    )
    return [first] + [
        replace(
            first,
            query=torch.randn_like(first.query),
            key_cache=torch.randn_like(first.key_cache),
            value_cache=torch.randn_like(first.value_cache),
        )
        for _ in range(2)
    ]


# A Latin square over (block size, GQA ratio, head dim): every pair of values meets once, in 9 compiles not 27.
LATIN = [((16, 32, 64)[i], (1, 4, 8)[j], (64, 128, 256)[(i + j) % 3]) for i in range(3) for j in range(3)]


def _forest_decode_and_check(batch: DecodeBatch, queries_per_kv: int, config: ForestKernelConfig) -> None:
    """Plan with ``config``, decode into NaN-filled outputs, compare with the fp32 reference."""
    scale = batch.query.shape[2] ** -0.5
    plan = plan_forest(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=batch.key_cache.shape[1],
        num_cache_blocks=batch.key_cache.shape[0],
        max_query_len=batch.max_query_len,
        queries_per_kv=queries_per_kv,
        num_kv_heads=2,
        config=config,
    )
    out = torch.full_like(batch.query, float("nan"))
    lse = torch.full(batch.query.shape[:2], float("nan"), device="cuda")
    forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, scale, out=out, lse=lse)
    _check(out, lse, batch, scale)


@pytest.mark.parametrize(("block_size", "queries_per_kv", "head_dim"), LATIN)
def test_forest_decode_bf16_matches_reference(block_size: int, queries_per_kv: int, head_dim: int) -> None:
    seed = block_size * 1000 + queries_per_kv * 10 + head_dim
    batch = _random_batch(seed, block_size, queries_per_kv, head_dim, max_query_len=1 + seed % 4)
    scale = head_dim**-0.5
    _forest_decode_and_check(batch, queries_per_kv, ForestKernelConfig(split_granularity=64))
    paged_out, paged_lse = paged_decode(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
        max_query_len=batch.max_query_len,
    )
    _check(paged_out, paged_lse, batch, scale)


def test_head_major_cache_and_fp32() -> None:
    batch = make_decode_batch(
        [300, 129], [[0, 40, 7], [3, 90]], queries_per_kv=4, head_dim=128, device="cuda", head_major_cache=True, seed=5
    )
    plan = plan_forest(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=16,
        num_cache_blocks=batch.key_cache.shape[0],
        max_query_len=1,
        queries_per_kv=4,
        num_kv_heads=2,
    )
    out, lse = forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, 0.1)
    ref_out, ref_lse = reference_paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 0.1
    )
    assert ((out.cpu() - ref_out).norm() / ref_out.norm()).item() < 1e-4
    assert torch.allclose(lse.cpu(), ref_lse, atol=1e-4)


@pytest.mark.parametrize(
    ("block_size", "queries_per_kv", "head_dim", "max_query_len"), [(16, 4, 128, 1), (32, 8, 64, 3)]
)
def test_float32_decode_multiplies_in_exact_float32(
    block_size: int, queries_per_kv: int, head_dim: int, max_query_len: int
) -> None:
    # FCA inside vLLM in float32 must pick the same greedy tokens as vLLM's attention: its dots run in exact float32
    # ("ieee"), not Triton's default TF32 for float32 operands (10-bit mantissas: ~1e-3 relative error on these
    # inputs), so only the order of float32 sums differs from the reference (~4e-7 under the Triton interpreter).
    batch = make_decode_batch(
        [300, 129, 40],
        [[0, 40, 7], [3, 90], [5]],
        query_lens=[[max_query_len, 1, max_query_len], [1, max_query_len], [1]],
        block_size=block_size,
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        dtype=torch.float32,
        device="cuda",
        seed=block_size + head_dim,
    )
    plan = plan_forest(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=block_size,
        num_cache_blocks=batch.key_cache.shape[0],
        max_query_len=max_query_len,
        queries_per_kv=queries_per_kv,
        num_kv_heads=2,
        config=ForestKernelConfig(split_granularity=64),
    )
    assert int(plan.num_groups) > 0
    out = torch.full_like(batch.query, float("nan"))
    forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, head_dim**-0.5, out=out)
    ref_out, _ = reference_paged_attention(
        *(tensor.cpu() for tensor in (batch.query, batch.key_cache, batch.value_cache, batch.block_table)),
        batch.seq_lens.cpu(),
        batch.query_start_loc.cpu(),
        head_dim**-0.5,
    )
    error = ((out.cpu() - ref_out).norm() / ref_out.norm()).item()
    assert error < 2e-5, f"relative error {error:.2e}: float32 dot products are not exact"


def test_no_sharing_equals_paged_decode_bitwise() -> None:
    batch = make_decode_batch(
        [500, 333, 64], [[1], [70], [0]], queries_per_kv=4, head_dim=128, dtype=torch.bfloat16, device="cuda", seed=6
    )
    plan = plan_forest(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=16,
        num_cache_blocks=batch.key_cache.shape[0],
        max_query_len=1,
        queries_per_kv=4,
        num_kv_heads=2,
    )
    forest_out, forest_lse = forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, 0.1)
    paged = plan_paged(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=16,
        max_query_len=1,
        queries_per_kv=4,
        num_kv_heads=2,
    )
    paged_out, paged_lse = forest_decode(batch.query, batch.key_cache, batch.value_cache, paged, 0.1)
    assert torch.equal(forest_out, paged_out) and torch.equal(forest_lse, paged_lse)


def test_plan_and_decode_capture_in_a_cuda_graph() -> None:
    batch = make_decode_batch(
        [400, 250],
        [[5, 60, 0, 9], [30, 2]],
        queries_per_kv=4,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
        shuffle=True,
        seed=7,
    )
    table, seq_lens = batch.block_table.clone(), batch.seq_lens.clone()
    out = torch.empty_like(batch.query)
    lse = torch.empty(batch.query.shape[:2], device="cuda")

    def step() -> None:
        plan = plan_forest(
            table,
            seq_lens,
            batch.query_start_loc,
            block_size=16,
            num_cache_blocks=batch.key_cache.shape[0],
            max_query_len=1,
            queries_per_kv=4,
            num_kv_heads=2,
        )
        forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, 0.1, out=out, lse=lse)

    graph = _captured(step)
    # Replay with the requests reordered and fresh values: the plan is rebuilt inside the graph.
    order = torch.randperm(table.shape[0], device="cuda")
    table.copy_(batch.block_table[order])
    seq_lens.copy_(batch.seq_lens[order])
    batch.query.normal_()
    batch.key_cache.normal_()
    batch.value_cache.normal_()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, _ = reference_paged_attention(
        batch.query, batch.key_cache, batch.value_cache, table, seq_lens, batch.query_start_loc, 0.1
    )
    assert ((out.float().cpu() - ref_out).norm() / ref_out.norm()).item() < 1.5e-2


def _torch_twin(
    table: torch.Tensor, seq_lens: torch.Tensor, starts: torch.Tensor, num_blocks: int
) -> tuple[list, list]:
    plan = plan_forest(
        table.cpu(),
        seq_lens.cpu(),
        starts.cpu(),
        block_size=16,
        num_cache_blocks=num_blocks,
        max_query_len=1,
        queries_per_kv=4,
        num_kv_heads=2,
        backend="torch",
    )
    return plan.group_leader.tolist(), plan.prefix_blocks.tolist()


def test_reused_workspace_in_a_cuda_graph_matches_the_torch_twin() -> None:
    # Many concurrent programs race on the histogram, the leader slots and the ticket; every replay must leave the
    # workspace zero for the next one.
    rng = random.Random(9)
    prefix_lens = [rng.randint(17, 900) for _ in range(12)]
    suffix_lens = [[rng.randint(0, 200) for _ in range(rng.randint(1, 24))] for _ in prefix_lens]
    batch = make_decode_batch(prefix_lens, suffix_lens, root_blocks=1, device="cuda", shuffle=True, seed=9)
    num_blocks = batch.key_cache.shape[0]
    workspace = ForestWorkspace(num_blocks, "cuda")
    table, seq_lens = batch.block_table.clone(), batch.seq_lens.clone()
    plans = []

    def step() -> None:
        plans.append(
            plan_forest(
                table,
                seq_lens,
                batch.query_start_loc,
                block_size=16,
                num_cache_blocks=num_blocks,
                max_query_len=1,
                queries_per_kv=4,
                num_kv_heads=2,
                workspace=workspace,
            )
        )

    graph = _captured(step)
    captured = plans[-1]
    for seed in range(4):
        order = torch.randperm(table.shape[0], generator=torch.Generator().manual_seed(seed)).cuda()
        table.copy_(batch.block_table[order])
        seq_lens.copy_(batch.seq_lens[order])
        graph.replay()
        torch.cuda.synchronize()
        twin = _torch_twin(table, seq_lens, batch.query_start_loc, num_blocks)
        assert (captured.group_leader.tolist(), captured.prefix_blocks.tolist()) == twin
        assert not workspace.counts.any() and not workspace.leader_slots.any() and not workspace.ticket.any()


@pytest.mark.parametrize("variant", ["one_launch", "split_passes"])
def test_dependent_launches_match_reference_eagerly_and_in_a_cuda_graph(variant: str) -> None:
    # Programmatic dependent launch (sm_90+; elsewhere the config field is ignored and this is a plain run): plan and
    # three layers' decodes back to back on one stream, the plan and every layer reading the one before it.
    from dataclasses import replace

    from test_forest_decode import _plan

    from arctic_dedup.forest._launch import launch_forest_decode

    layers = _layers_of_one_step(21, 4, (300, 900), 200, max_samples=12, min_samples=2)
    first = layers[0]
    config = ForestKernelConfig(split_granularity=64, prefix_block_n=64, dependent_launches=True)
    config = replace(config, split_passes=variant == "split_passes")
    outs = [torch.empty_like(layer.query) for layer in layers]
    lses = [torch.empty(layer.query.shape[:2], device="cuda") for layer in layers]

    def step() -> None:
        plan = _plan(first, 4, config)
        for layer, out, lse in zip(layers, outs, lses, strict=True):
            launch_forest_decode(layer.query, layer.key_cache, layer.value_cache, plan, 0.1, out, lse)

    def check() -> None:
        torch.cuda.synchronize()
        for layer, out, lse in zip(layers, outs, lses, strict=True):
            _check(out, lse, layer, 0.1)

    step()
    check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for layer, out, lse in zip(layers, outs, lses, strict=True):
        layer.query.normal_()
        layer.key_cache.normal_()
        layer.value_cache.normal_()
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    graph.replay()
    check()


@pytest.mark.parametrize("variant", ["one_launch", "split_passes", "combine_slices", "paged", "default_rule"])
def test_early_combine_equals_the_plain_combine_under_dependent_launches(variant: str) -> None:
    # ForestKernelConfig.early_combine: combine programs wait on per-(request, kv head) counts and run beside the
    # attention launch. Plan and three layers in a CUDA graph, replayed again and again: every replay must give the
    # same bits as the first, the plain combine's bits (the same merge in the same order), and leave the counts 0.
    from dataclasses import replace

    from test_forest_decode import _paged_plan, _plan

    from arctic_dedup.forest._launch import launch_forest_decode

    # Enough requests for several waves of attention programs, so that combine programs wait beside them.
    layers = _layers_of_one_step(23, 6, (600, 2400), 400, max_samples=16, min_samples=1)
    first = layers[0]
    base = ForestKernelConfig(split_granularity=64, prefix_block_n=64, dependent_launches=True)
    base = replace(base, split_passes=variant == "split_passes")
    if variant == "combine_slices":
        base = replace(base, combine_dim_block=32, combine_num_warps=1, combine_chunk_cap=4)
    if variant == "default_rule":
        # plan_forest's rule for batches of more (request, kv head) pairs than multiprocessors (split passes;
        # 16 stands for the SM count so this batch gets it), with the plain combine beside it.
        from arctic_dedup.forest.plan import default_forest_config

        base = replace(default_forest_config(first.seq_lens.shape[0], 2, 16), early_combine=False)
        assert base.split_passes

    def run(config: ForestKernelConfig) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
        outs = [torch.full_like(layer.query, float("nan")) for layer in layers]
        lses = [torch.full(layer.query.shape[:2], float("nan"), device="cuda") for layer in layers]
        holder: list[Any] = []

        def step() -> None:
            plan = _paged_plan(first, 4, replace(config, waves=4.0)) if variant == "paged" else _plan(first, 4, config)
            holder[:] = [plan]
            for layer, out, lse in zip(layers, outs, lses, strict=True):
                launch_forest_decode(layer.query, layer.key_cache, layer.value_cache, plan, 0.1, out, lse)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return outs, lses, (graph, holder)

    plain_outs, plain_lses, (plain_graph, _) = run(base)
    early_outs, early_lses, (early_graph, holder) = run(replace(base, early_combine=True))
    for replay in range(20):
        # Fresh values every replay: a combine that merged a partial before it was written would read the last
        # replay's (different) values and miss the plain combine's bits.
        for layer in layers:
            layer.query.normal_()
            layer.key_cache.normal_()
            layer.value_cache.normal_()
        plain_graph.replay()
        torch.cuda.synchronize()
        expected = [(out.clone(), lse.clone()) for out, lse in zip(plain_outs, plain_lses, strict=True)]
        if replay == 0:
            for layer, (out, lse) in zip(layers, expected, strict=True):
                _check(out, lse, layer, 0.1)
        for out, lse in zip(early_outs, early_lses, strict=True):
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
        early_graph.replay()
        torch.cuda.synchronize()
        for (out, lse), (want_out, want_lse) in zip(zip(early_outs, early_lses, strict=True), expected, strict=True):
            assert torch.equal(out, want_out) and torch.equal(lse, want_lse), f"replay {replay}"
        assert not holder[0].combine_ready.any()


def test_layers_after_the_first_replay_the_recorded_launches_exactly() -> None:
    """The first call of a plan records its launches; the other layers replay them and write exactly what a first
    call over a fresh plan writes. Another layout (a query at another 16-byte alignment) is recorded anew."""
    from dataclasses import replace

    from test_forest_decode import _plan

    layers = _layers_of_one_step(31, 4, (300, 900), 200, max_samples=12, min_samples=2)
    plan = _plan(layers[0], 4, ForestKernelConfig())
    assert plan.launches == {}
    recorded = None
    for index, layer in enumerate(layers):
        out, lse = forest_decode(layer.query, layer.key_cache, layer.value_cache, plan, 0.1)
        assert len(plan.launches) == 1, index
        # Layers after the first replay the first call's launches (a first-call path would record them anew).
        recorded = recorded or next(iter(plan.launches.values()))
        assert next(iter(plan.launches.values())) is recorded, index
        fresh_out, fresh_lse = forest_decode(
            layer.query, layer.key_cache, layer.value_cache, _plan(layers[0], 4, ForestKernelConfig()), 0.1
        )
        assert torch.equal(out, fresh_out) and torch.equal(lse, fresh_lse), index
        _check(out, lse, layer, 0.1)
    first = layers[0]
    storage = torch.empty(first.query.numel() + 1, dtype=first.query.dtype, device="cuda")
    shifted = storage[1:].view_as(first.query)
    shifted.copy_(first.query)
    out, lse = forest_decode(shifted, first.key_cache, first.value_cache, plan, 0.1)
    assert len(plan.launches) == 2
    _check(out, lse, first, 0.1)
    assert replace(plan, block_table=plan.block_table.clone()).launches == {}


def _graph_steps() -> list[tuple[DecodeBatch, bool]]:
    """Decode steps of changing shape for one captured batch size (13 requests padded to 16): (batch, grouping on).
    Step 2 shares nothing (grouping finds no group); step 4 is planned with grouping off."""
    rng = random.Random(5)
    steps = []
    for seed, (groups, samples) in enumerate([(2, 6), (4, 3), (13, 1), (1, 13), (3, 4)]):
        prefix_lens = [rng.randint(40, 700) for _ in range(groups)]
        sizes = [samples] * groups
        sizes[-1] += 13 - sum(sizes)
        suffix_lens = [[rng.randint(0, 200) for _ in range(size)] for size in sizes]
        batch = make_decode_batch(
            prefix_lens,
            suffix_lens,
            queries_per_kv=4,
            head_dim=128,
            dtype=torch.bfloat16,
            device="cuda",
            shuffle=True,
            seed=seed,
        )
        steps.append((batch, seed != 4))
    return steps


def test_static_plan_decode_in_a_cuda_graph_replays_every_step_exactly() -> None:
    """vLLM's full decode graphs: the plan is refilled outside the graph every step into a StaticForestPlan's fixed
    buffers; the captured decode (two layers) replays exactly what eager calls write over the same plan, matches the
    per-request reference, and never writes the padded requests' rows."""
    steps = _graph_steps()
    padded, tokens = 16, 13
    width = max(batch.block_table.shape[1] for batch, _ in steps)
    blocks = max(batch.key_cache.shape[0] for batch, _ in steps)
    # The graph holds the caches' addresses: every step writes its KV into the same cache tensors (two layers).
    caches = [torch.zeros(blocks, 16, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    query = torch.empty(padded, 8, 128, dtype=torch.bfloat16, device="cuda")
    outs = [torch.empty_like(query) for _ in range(2)]
    lses = [torch.empty(padded, 8, device="cuda") for _ in range(2)]
    static = StaticForestPlan(
        padded,
        width,
        block_size=16,
        num_cache_blocks=blocks,
        max_query_len=1,
        queries_per_kv=4,
        num_kv_heads=2,
        device="cuda",
    )

    def load(batch: DecodeBatch, grouped: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        table = torch.zeros(tokens, width, dtype=torch.int32, device="cuda")
        table[:, : batch.block_table.shape[1]] = batch.block_table
        used = batch.key_cache.shape[0]
        for layer in range(2):
            # Layer 1 reads the step's caches the other way round, so the two layers differ.
            caches[2 * layer][:used].copy_(batch.key_cache if layer == 0 else batch.value_cache)
            caches[2 * layer + 1][:used].copy_(batch.value_cache if layer == 0 else batch.key_cache)
        query[:tokens].copy_(batch.query)
        query[tokens:].fill_(float("nan"))
        static.update(table, batch.seq_lens, batch.query_start_loc, grouping=ForestGrouping() if grouped else None)
        return table, batch.seq_lens, batch.query_start_loc

    def layers() -> None:
        for layer in range(2):
            key_cache, value_cache = caches[2 * layer], caches[2 * layer + 1]
            forest_decode(query, key_cache, value_cache, static.plan, 0.1, out=outs[layer], lse=lses[layer])

    load(*steps[0])
    graph = _captured(layers)
    for index, (batch, grouped) in enumerate(steps):
        table, seq_lens, starts = load(batch, grouped)
        for out, lse in zip(outs, lses, strict=True):
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
        graph.replay()
        replayed = [(out.clone(), lse.clone()) for out, lse in zip(outs, lses, strict=True)]
        assert (int(static.plan.num_groups) > 0) == (grouped and index != 2), index
        layers()
        for layer, (out, lse) in enumerate(replayed):
            assert torch.equal(out[:tokens], outs[layer][:tokens]), (index, layer)
            assert torch.equal(lse[:tokens], lses[layer][:tokens]), (index, layer)
            assert out[tokens:].isnan().all() and lse[tokens:].isnan().all(), (index, layer)
            key_cache, value_cache = caches[2 * layer], caches[2 * layer + 1]
            used = DecodeBatch(
                query=query[:tokens],
                key_cache=key_cache,
                value_cache=value_cache,
                block_table=table,
                seq_lens=seq_lens,
                query_start_loc=starts,
                max_query_len=1,
                unique_tokens=batch.unique_tokens,
                total_tokens=batch.total_tokens,
            )
            _check(out[:tokens], lse[:tokens], used, 0.1)


def test_static_plans_sharing_a_scratch_replay_their_graphs_in_turn_exactly() -> None:
    """Two captured batch sizes (16, then 8, largest first as vLLM captures) share one scratch for their partials;
    their graphs replay in turn, each exactly as eager calls over its plan and close to the reference."""
    scratch = ForestScratch()
    rng = random.Random(9)
    cases = []
    for padded, requests in ((16, 13), (8, 6)):
        batch = make_decode_batch(
            [rng.randint(40, 500) for _ in range(2)],
            [[rng.randint(0, 150) for _ in range(size)] for size in (requests // 2, requests - requests // 2)],
            queries_per_kv=4,
            head_dim=128,
            dtype=torch.bfloat16,
            device="cuda",
            shuffle=True,
            seed=padded,
        )
        static = StaticForestPlan(
            padded,
            batch.block_table.shape[1],
            block_size=16,
            num_cache_blocks=batch.key_cache.shape[0],
            max_query_len=1,
            queries_per_kv=4,
            num_kv_heads=2,
            device="cuda",
            scratch=scratch,
        )
        static.update(batch.block_table, batch.seq_lens, batch.query_start_loc, grouping=ForestGrouping())
        query = torch.full((padded, 8, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        query[:requests].copy_(batch.query)
        out = torch.empty_like(query)
        lse = torch.empty(padded, 8, device="cuda")

        layer = functools.partial(
            forest_decode, query, batch.key_cache, batch.value_cache, static.plan, 0.1, out=out, lse=lse
        )

        graph = _captured(layer)
        cases.append((graph, layer, batch, requests, out, lse))
    for graph, layer, batch, requests, out, lse in cases + cases:
        out.fill_(float("nan"))
        graph.replay()
        replayed = out.clone(), lse.clone()
        layer()
        assert torch.equal(replayed[0][:requests], out[:requests]), requests
        assert torch.equal(replayed[1][:requests], lse[:requests]), requests
        assert replayed[0][requests:].isnan().all(), requests
        _check(replayed[0][:requests], replayed[1][:requests], batch, 0.1)


def test_static_plan_update_captured_with_the_decode_plans_each_replay_from_the_input_buffers() -> None:
    """vLLM's full graphs capture the plan's update with the layers: one graph holding ``update`` (reading persistent
    input buffers) and a decode replays exactly for each new step written into those buffers, and its grouping
    follows the gate set after capture."""
    rng = random.Random(11)
    padded, width = 16, 64
    batches = []
    for seed in range(4):
        requests = rng.randint(9, padded)
        batch = make_decode_batch(
            [rng.randint(40, 500) for _ in range(2)],
            [[rng.randint(0, 150) for _ in range(size)] for size in (requests // 2, requests - requests // 2)],
            queries_per_kv=4,
            head_dim=128,
            dtype=torch.bfloat16,
            device="cuda",
            shuffle=True,
            spare_blocks=40,
            seed=seed,
        )
        batches.append((batch, requests))
    num_cache_blocks = max(batch.key_cache.shape[0] for batch, _ in batches)
    # Every step's cache: one cache of the largest size, each step's blocks written into it.
    key_cache = torch.zeros(num_cache_blocks, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    table = torch.zeros(padded, width, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(padded, dtype=torch.int32, device="cuda")
    starts = torch.zeros(padded + 1, dtype=torch.int32, device="cuda")
    query = torch.zeros(padded, 8, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(query)
    lse = torch.empty(padded, 8, device="cuda")
    gate = torch.ones(1, dtype=torch.int32, device="cuda")
    static = StaticForestPlan(
        padded,
        width,
        block_size=16,
        num_cache_blocks=num_cache_blocks,
        max_query_len=1,
        queries_per_kv=4,
        num_kv_heads=2,
        device="cuda",
        workspace=ForestWorkspace(num_cache_blocks, "cuda"),
        grouping_gate=gate,
    )

    def load(batch: DecodeBatch, requests: int) -> None:
        blocks = batch.key_cache.shape[0]
        key_cache[:blocks].copy_(batch.key_cache)
        value_cache[:blocks].copy_(batch.value_cache)
        table.zero_()
        table[:requests, : batch.block_table.shape[1]].copy_(batch.block_table)
        seq_lens.zero_()
        seq_lens[:requests].copy_(batch.seq_lens)
        starts.fill_(requests)
        starts[: requests + 1].copy_(batch.query_start_loc)
        query.zero_()
        query[:requests].copy_(batch.query)

    def step() -> None:
        static.update(table, seq_lens, starts, grouping=ForestGrouping())
        forest_decode(query, key_cache, value_cache, static.plan, 0.1, out=out, lse=lse)

    load(*batches[0])
    graph = _captured(step)
    for open_gate in (1, 0, 1):
        gate.fill_(open_gate)
        for batch, requests in batches[1:] + batches[:1]:
            load(batch, requests)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            groups = int(static.plan.num_groups)
            assert (groups > 0) == bool(open_gate), (groups, open_gate)
            assert static.plan.seq_lens[:requests].equal(batch.seq_lens)
            _check(out[:requests], lse[:requests], batch, 0.1)
