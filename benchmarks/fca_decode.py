"""Forest cascade decode on the GPU: correctness in bf16, then speed against the per-request paged decode kernel.

Bytes counted per layer (performance.md): b = 2 * H_kv * d * 2 bytes per KV token (bf16 K and V). Forest decode's
useful bytes are the unique tokens (each group's prefix once, each request's own tokens once); the per-request
kernel's are every request's whole context. Ideal speedup = total tokens / unique tokens.

What is timed, per layer (CUDA graph replays of 8 calls cycling over enough copies of the batch to exceed the L2 cache,
median per call):
- ``forest_us``: the whole op with the plan rebuilt every layer (grouping on the device + attention + combine);
- ``forest_kernels_us``: attention + combine with a plan built beforehand; ``plan_us``: the plan alone;
- ``forest_amortized_us = forest_kernels_us + plan_us / LAYERS``: the plan is built once per step and read by every
  layer (the vLLM metadata builder does this), LAYERS = 36 (Qwen3-4B);
- the same three for the per-request kernel (``paged_*``; its plan is one small launch).
Speedups compare like with like: whole op with whole op, amortized with amortized. ``dram_bound_speedup`` is the
speedup forest decode would reach streaming its unique bytes at the measured copy rate: the per-request kernel gets
siblings' shared prefix blocks from L2, so on RL batches it runs above the copy rate and the ideal is out of reach.

Run on the H200:  python benchmarks/fca_decode.py            (about 3 minutes; --quick: about 1.5 minutes)
Plot elsewhere:   python benchmarks/fca_decode.py --plot-from benchmarks/results/fca_decode.json
CPU dry run:      python benchmarks/fca_decode.py --smoke    (every code path on tiny shapes, Triton interpreter)
Diagnosis:        python benchmarks/fca_decode.py --diagnose (under 4 minutes: copy ceiling, plan, prefix and suffix
                  passes alone, attention and combine alone, then version 3 candidates, each checked against the
                  reference first; writes fca_decode_diagnose.json; add --smoke for a CPU dry run)
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    # The interpreter must be chosen before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import json
import math
import random
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
try:
    import arctic_dedup  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "arctic-dedup" / "src"))

from common import copy_bandwidth_gbps, default_out_dir, print_table, write_results

from arctic_dedup.forest import (
    ForestKernelConfig,
    ForestPlan,
    ForestWorkspace,
    forest_decode,
    plan_forest,
    plan_paged,
    reference_paged_attention,
)
from arctic_dedup.forest._launch import (
    DecodeKnobs,
    Partials,
    allocate_partials,
    launch_attention,
    launch_combine,
    launch_forest_decode,
)
from arctic_dedup.forest.plan import default_forest_config
from arctic_dedup.forest.testing import DecodeBatch, make_decode_batch

LAYERS = 36
L2_BYTES = 50 * 2**20
CALLS_PER_GRAPH = 8  # calls of one case per CUDA graph replay, so replay latency is spread as in a decode step
# (num_warps, num_stages, prefix_block_n, suffix_block_n) of the forest kernel; 2 or 3 programs per SM (sm_90 report).
FOREST_CANDIDATES = [(4, 3, 32, 32), (4, 3, 32, 64), (4, 4, 32, 64), (4, 4, 32, 32), (4, 2, 32, 64)]
# (num_warps, num_stages, suffix_block_n) of the per-request kernel.
PAGED_CANDIDATES = [(4, 3, 64), (4, 4, 64), (4, 3, 32), (4, 4, 32), (4, 2, 64), (8, 3, 64)]
# (prefix_waves, waves)
WAVES = [(1.0, 1.0), (1.0, 2.0), (2.0, 2.0), (4.0, 2.0), (2.0, 4.0)]


@dataclass(frozen=True)
class Shape:
    heads_q: int
    heads_kv: int
    head_dim: int
    block: int
    device: str
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.heads_kv * self.head_dim * self.dtype.itemsize

    @property
    def queries_per_kv(self) -> int:
        return self.heads_q // self.heads_kv


H200 = Shape(32, 8, 128, 16, "cuda", torch.bfloat16)
SMOKE = Shape(4, 2, 32, 16, "cpu", torch.float32)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float().cpu() - ref.float().cpu()).norm() / ref.float().cpu().norm()).item()


def _forest_plan(
    batch: DecodeBatch, shape: Shape, config: ForestKernelConfig | None, workspace: ForestWorkspace | None
) -> ForestPlan:
    return plan_forest(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=batch.key_cache.shape[1],
        num_cache_blocks=batch.key_cache.shape[0],
        max_query_len=batch.max_query_len,
        queries_per_kv=batch.query.shape[1] // batch.key_cache.shape[2],
        num_kv_heads=batch.key_cache.shape[2],
        config=config,
        workspace=workspace,
        backend="triton",
    )


def _paged_plan(batch: DecodeBatch, config: ForestKernelConfig | None) -> ForestPlan:
    config = config or ForestKernelConfig()
    return plan_paged(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=batch.key_cache.shape[1],
        max_query_len=batch.max_query_len,
        queries_per_kv=batch.query.shape[1] // batch.key_cache.shape[2],
        num_kv_heads=batch.key_cache.shape[2],
        config=config,
        backend="triton",
    )


def _torch_groups(batch: DecodeBatch) -> tuple[list[int], list[int]]:
    plan = plan_forest(
        batch.block_table.cpu(),
        batch.seq_lens.cpu(),
        batch.query_start_loc.cpu(),
        block_size=batch.key_cache.shape[1],
        num_cache_blocks=batch.key_cache.shape[0],
        max_query_len=batch.max_query_len,
        queries_per_kv=batch.query.shape[1] // batch.key_cache.shape[2],
        num_kv_heads=batch.key_cache.shape[2],
        backend="torch",
    )
    return plan.group_leader.tolist(), plan.prefix_blocks.tolist()


# ---------------------------------------------------------------- correctness


def _check_correctness(shape: Shape, quick: bool, smoke: bool) -> list[dict[str, Any]]:
    """bf16 forest and paged decode against the fp32 reference over block sizes, GQA ratios and head dims."""
    combos = [((16, 32, 64)[i], (1, 4, 8)[j], (64, 128, 256)[(i + j) % 3]) for i in range(3) for j in range(3)]
    if quick or smoke:
        combos = combos[::4]
    rows: list[dict[str, Any]] = []
    for index, combo in enumerate(combos):
        try:
            rows.extend(_check_combo(shape, index, *combo, smoke))
        except Exception as error:  # one failing combination must not hide the others' results
            rows.append({"check": f"combo {combo}", "ok": False, "error": f"{type(error).__name__}: {error}"[:300]})
    return rows


def _check_combo(
    shape: Shape, index: int, block_size: int, queries_per_kv: int, head_dim: int, smoke: bool
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    rng = random.Random(index)
    max_query = 1 + index % 4
    root = index % 2
    longest = 120 if smoke else 900
    prefix_lens = [rng.randint(root * block_size + 1, longest) for _ in range(rng.randint(1, 5))]
    suffix_lens = [
        [rng.choice([0, rng.randint(1, longest // 2)]) for _ in range(rng.randint(1, 10))] for _ in prefix_lens
    ]
    query_lens = [[rng.randint(1, max_query) for _ in group] for group in suffix_lens]
    batch = make_decode_batch(
        prefix_lens,
        suffix_lens,
        query_lens=query_lens,
        root_blocks=root,
        block_size=block_size,
        num_kv_heads=2,
        queries_per_kv=queries_per_kv,
        head_dim=32 if smoke else head_dim,
        dtype=shape.dtype,
        device=shape.device,
        shuffle=True,
        seed=index,
    )
    scale = batch.query.shape[2] ** -0.5
    ref_out, ref_lse = reference_paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
    )
    config = ForestKernelConfig(split_granularity=64)
    workspace = ForestWorkspace(batch.key_cache.shape[0], shape.device)
    for name in ("forest", "paged"):
        plan = _forest_plan(batch, shape, config, workspace) if name == "forest" else _paged_plan(batch, config)
        out = torch.full_like(batch.query, float("nan"))
        lse = torch.full(batch.query.shape[:2], float("nan"), device=shape.device)
        forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, scale, out=out, lse=lse)
        error = _relative_error(out, ref_out)
        lse_error = (lse.cpu() - ref_lse).abs().max().item()
        groups_ok = name == "paged" or (plan.group_leader.tolist(), plan.prefix_blocks.tolist()) == _torch_groups(batch)
        ok = error < 1.5e-2 and lse_error < 5e-2 and not torch.isnan(out).any().item() and groups_ok
        rows.append(
            {
                "check": name,
                "block_size": block_size,
                "gqa": queries_per_kv,
                "head_dim": batch.query.shape[2],
                "max_query_len": batch.max_query_len,
                "groups": int(plan.num_groups.item()),
                "rel_error": error,
                "lse_max_error": lse_error,
                "groups_match_torch_twin": groups_ok,
                "ok": ok,
            }
        )
    clean = not workspace.counts.any().item() and not workspace.leader_slots.any().item()
    rows.append({"check": "workspace_zero_after_plan", "ok": clean and not workspace.ticket.any().item()})
    return rows


# ---------------------------------------------------------------- timing


def _graph_time_us(calls: list[Callable[[], Any]], repeats: int, device: str) -> float:
    """Median microseconds per call of a CUDA graph that runs every call once, in order."""
    for call in calls:
        call()
    if device != "cuda":
        # The CPU dry run only exercises the code paths; its times mean nothing.
        started = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - started) * 1e6 / len(calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(calls))
    del graph
    return statistics.median(times)


class Case:
    """One batch shape, with enough copies that one graph replay streams more than the L2 cache."""

    def __init__(
        self,
        name: str,
        prefix_lens: list[int],
        suffix_lens: list[list[int]],
        shuffle: bool,
        shape: Shape,
        copies: int | None = None,
    ) -> None:
        self.name = name
        self.shape = shape
        first = self._make(prefix_lens, suffix_lens, shuffle, 0)
        unique_bytes = first.unique_tokens * shape.bytes_per_token
        if copies is None:
            copies = max(1, min(4, math.ceil(4 * L2_BYTES / unique_bytes))) if shape.device == "cuda" else 1
        self.batches = [first] + [self._make(prefix_lens, suffix_lens, shuffle, i) for i in range(1, copies)]
        self.workspaces = [ForestWorkspace(batch.key_cache.shape[0], shape.device) for batch in self.batches]
        self.unique_bytes = unique_bytes
        self.total_bytes = first.total_tokens * shape.bytes_per_token
        self.requests = first.seq_lens.shape[0]

    def _make(self, prefix_lens: list[int], suffix_lens: list[list[int]], shuffle: bool, seed: int) -> DecodeBatch:
        return make_decode_batch(
            prefix_lens,
            suffix_lens,
            block_size=self.shape.block,
            num_kv_heads=self.shape.heads_kv,
            queries_per_kv=self.shape.queries_per_kv,
            head_dim=self.shape.head_dim,
            dtype=self.shape.dtype,
            device=self.shape.device,
            shuffle=shuffle,
            seed=seed,
            spare_blocks=0,
        )

    def time(self, what: str, config: ForestKernelConfig | None, repeats: int) -> float:
        """Per-layer microseconds of ``what``: forest, forest_kernels, plan, paged, paged_kernels or paged_plan."""
        scale = self.shape.head_dim**-0.5
        calls: list[Callable[[], Any]] = []
        for batch, workspace in zip(self.batches, self.workspaces, strict=True):
            out = torch.empty_like(batch.query)
            lse = torch.empty(batch.query.shape[:2], device=batch.query.device)
            forest = what.startswith("forest") or what == "plan"
            fixed = None
            if what.endswith("_kernels"):
                fixed = _forest_plan(batch, self.shape, config, workspace) if forest else _paged_plan(batch, config)

            def call(
                batch: DecodeBatch = batch,
                workspace: ForestWorkspace = workspace,
                out: torch.Tensor = out,
                lse: torch.Tensor = lse,
                fixed: ForestPlan | None = fixed,
                forest: bool = forest,
            ) -> None:
                if what == "plan":
                    _forest_plan(batch, self.shape, config, workspace)
                    return
                if what == "paged_plan":
                    _paged_plan(batch, config)
                    return
                plan = fixed
                if plan is None:
                    plan = _forest_plan(batch, self.shape, config, workspace) if forest else _paged_plan(batch, config)
                forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, scale, out=out, lse=lse)

            calls.append(call)
        # Several calls per replay (cycling over the copies), as the layers of one decode step share one graph:
        # a replay's launch latency (~19 us measured) is paid once per step, not once per layer.
        per_graph = CALLS_PER_GRAPH if self.shape.device == "cuda" else 1  # the CPU dry run times nothing
        cycled = [calls[i % len(calls)] for i in range(max(per_graph, len(calls)))]
        return _graph_time_us(cycled, repeats, self.shape.device)

    def check(self, config: ForestKernelConfig | None, paged_config: ForestKernelConfig) -> dict[str, Any]:
        """Device groups equal the torch twin's; forest output equals the per-request kernel's within bf16 noise."""
        batch, workspace = self.batches[0], self.workspaces[0]
        scale = self.shape.head_dim**-0.5
        plan = _forest_plan(batch, self.shape, config, workspace)
        groups_ok = (plan.group_leader.tolist(), plan.prefix_blocks.tolist()) == _torch_groups(batch)
        outputs = []
        for chosen in (plan, _paged_plan(batch, paged_config)):
            out = torch.full_like(batch.query, float("nan"))
            lse = torch.full(batch.query.shape[:2], float("nan"), device=batch.query.device)
            forest_decode(batch.query, batch.key_cache, batch.value_cache, chosen, scale, out=out, lse=lse)
            outputs.append((out, lse))
        (forest_out, forest_lse), (paged_out, paged_lse) = outputs
        error = _relative_error(forest_out, paged_out)
        lse_error = (forest_lse - paged_lse).abs().max().item()
        finite = not (torch.isnan(forest_out).any().item() or torch.isnan(paged_out).any().item())
        return {
            "check": f"{self.name}: forest vs per-request",
            "groups": int(plan.num_groups.item()),
            "rel_error": error,
            "lse_max_error": lse_error,
            "groups_match_torch_twin": groups_ok,
            "ok": groups_ok and finite and error < 1.5e-2 and lse_error < 5e-2,
        }

    def free(self) -> None:
        self.batches.clear()
        self.workspaces.clear()
        if self.shape.device == "cuda":
            torch.cuda.empty_cache()


def _forest_config(base: ForestKernelConfig, candidate: tuple[int, int, int, int]) -> ForestKernelConfig:
    warps, stages, prefix_n, suffix_n = candidate
    return replace(base, num_warps=warps, num_stages=stages, prefix_block_n=prefix_n, suffix_block_n=suffix_n)


def _paged_config(base: ForestKernelConfig, candidate: tuple[int, int, int]) -> ForestKernelConfig:
    warps, stages, suffix_n = candidate
    return replace(base, num_warps=warps, num_stages=stages, suffix_block_n=suffix_n)


def _safe_time(case: Case, what: str, config: ForestKernelConfig | None, repeats: int) -> float:
    try:
        return case.time(what, config, repeats)
    except Exception as error:  # a candidate that does not fit the chip (shared memory, registers) is skipped
        print(f"  skip {what} {config}: {type(error).__name__}: {str(error)[:200]}", flush=True)
        return math.inf


def _tune(
    rl: Case, single: Case, no_share: Case, tiny_suffix: Case, repeats: int, rows: list[dict[str, Any]]
) -> tuple[ForestKernelConfig | None, ForestKernelConfig]:
    """Pick the forest kernel's launch config and split sizes, then the per-request kernel's (kernels only).

    The forest score is the geometric mean over RL-8x16, one group, no sharing and S=0 (many one-token suffix
    items queued behind prefix items: the case that punishes too few free program slots). The library's own rule
    (``config=None``: ``default_forest_config`` by batch size, what users get) is the first candidate; a single
    config replaces it only where it scores better.
    """
    base = ForestKernelConfig()
    cases = (rl, single, no_share, tiny_suffix)

    def forest_score(config: ForestKernelConfig | None, label: str) -> float:
        times = [_safe_time(case, "forest_kernels", config, repeats) for case in cases]
        rows.append({"tune": label, "config": str(config), **{f"{c.name}_us": t for c, t in zip(cases, times)}})
        finite = all(math.isfinite(t) for t in times)
        return math.exp(sum(math.log(t) for t in times) / len(times)) if finite else math.inf

    best: ForestKernelConfig | None = None
    best_score = forest_score(None, "library default (rule by batch size)")
    for candidate in FOREST_CANDIDATES:
        config = _forest_config(base, candidate)
        score = forest_score(config, "forest launch")
        if score < best_score:
            best, best_score = config, score
    for prefix_waves, waves in WAVES:
        config = replace(best or base, prefix_waves=prefix_waves, waves=waves)
        score = forest_score(config, "forest waves")
        if score < best_score:
            best, best_score = config, score

    paged_best, paged_best_us = base, math.inf
    # The per-request kernel gets dependent launches too when they help it, so the comparison stays fair.
    for paged_candidate in PAGED_CANDIDATES:
        for waves, dependent in ((2.0, False), (4.0, False), (2.0, True), (4.0, True)):
            config = replace(_paged_config(base, paged_candidate), waves=waves, dependent_launches=dependent)
            us = _safe_time(no_share, "paged_kernels", config, repeats)
            rows.append({"tune": "paged on no_share", "config": str(config), "us": us})
            if us < paged_best_us:
                paged_best, paged_best_us = config, us
    print(f"tuned forest config: {best}\ntuned paged config: {paged_best}", flush=True)
    return best, paged_best


def _measure(
    case: Case, config: ForestKernelConfig | None, paged_config: ForestKernelConfig, repeats: int, copy_tbps: float
) -> dict[str, Any]:
    # The clocks, power and temperature before each timing (the no-sharing per-request rows once differed by 9-15%
    # between two timings of the same kernel in this sequence, though not when timed alone: --paged-order).
    states: dict[str, str] = {}

    def timed(what: str, chosen: ForestKernelConfig | None) -> float:
        states[what] = _gpu_state() if case.shape.device == "cuda" else ""
        return case.time(what, chosen, repeats)

    forest_us = timed("forest", config)
    kernels_us = timed("forest_kernels", config)
    plan_us = timed("plan", config)
    paged_us = timed("paged", paged_config)
    paged_kernels_us = timed("paged_kernels", paged_config)
    paged_plan_us = timed("paged_plan", paged_config)
    amortized_us = kernels_us + plan_us / LAYERS
    paged_amortized_us = paged_kernels_us + paged_plan_us / LAYERS
    ideal = case.total_bytes / case.unique_bytes
    dram_bound_us = case.unique_bytes / (copy_tbps * 1e6)
    return {
        "case": case.name,
        "requests": case.requests,
        "copies": len(case.batches),
        "unique_MB": case.unique_bytes / 1e6,
        "forest_us": forest_us,
        "forest_kernels_us": kernels_us,
        "plan_us": plan_us,
        "forest_amortized_us": amortized_us,
        "paged_us": paged_us,
        "paged_kernels_us": paged_kernels_us,
        "paged_plan_us": paged_plan_us,
        "paged_amortized_us": paged_amortized_us,
        "unique_tbps": case.unique_bytes / forest_us / 1e6,
        "unique_tbps_amortized": case.unique_bytes / amortized_us / 1e6,
        "unique_tbps_kernels": case.unique_bytes / kernels_us / 1e6,
        "paged_tbps": case.total_bytes / paged_kernels_us / 1e6,
        "speedup": paged_us / forest_us,
        "speedup_amortized": paged_amortized_us / amortized_us,
        "ideal": ideal,
        "dram_bound_speedup": paged_amortized_us / dram_bound_us,
        "of_ideal": paged_us / forest_us / ideal,
        "of_ideal_amortized": paged_amortized_us / amortized_us / ideal,
        "gpu_before": states,
    }


def _plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sweep = sorted((row for row in rows if str(row.get("case", "")).startswith("suffix_")), key=lambda r: r["suffix"])
    if not sweep:
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    suffixes = [row["suffix"] for row in sweep]
    left.plot(suffixes, [row["ideal"] for row in sweep], "k--o", label="ideal R(P+S)/(P+RS)")
    left.plot(suffixes, [0.85 * row["ideal"] for row in sweep], ":", color="gray", label="85% of ideal (goal)")
    if "dram_bound_speedup" in sweep[0]:
        left.plot(
            suffixes,
            [row["dram_bound_speedup"] for row in sweep],
            "-.",
            color="orange",
            label="unique bytes at copy rate",
        )
        left.plot(suffixes, [row["speedup_amortized"] for row in sweep], "g-s", label="forest, plan once per step")
    left.plot(suffixes, [row["speedup"] for row in sweep], "b-o", label="forest, plan every layer")
    left.set_xscale("symlog", linthresh=512)
    left.set_xlabel("response length S (P=8192, 8 groups x 16)")
    left.set_ylabel("speedup over per-request paged decode")
    left.legend(fontsize=7)
    right.plot(suffixes, [row["unique_tbps"] for row in sweep], "b-o", label="forest, plan every layer")
    if "unique_tbps_amortized" in sweep[0]:
        right.plot(suffixes, [row["unique_tbps_amortized"] for row in sweep], "g-s", label="forest, plan once per step")
    right.plot(suffixes, [row["paged_tbps"] for row in sweep], "r-o", label="per-request kernel, its bytes")
    right.axhline(3.8, color="gray", linestyle=":", label="3.8 TB/s goal")
    right.set_xscale("symlog", linthresh=512)
    right.set_xlabel("response length S")
    right.set_ylabel("TB/s (unique bytes for forest)")
    right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def _cases(shape: Shape, smoke: bool) -> dict[str, tuple[list[int], list[list[int]], bool]]:
    """name -> (prompt lengths, response lengths per group, shuffle siblings)."""
    if smoke:
        prompt, groups, samples, response = 64, 3, 4, 16
        no_share = ([prompt + response - 1] * 6, [[0]] * 6, False)
    else:
        prompt, groups, samples, response = 8192, 8, 16, 512
        no_share = ([8703] * 128, [[0]] * 128, False)
    cases = {
        "rl8x16_adjacent": ([prompt] * groups, [[response] * samples] * groups, False),
        "single_group_16x8704": ([prompt], [[response] * samples], False),
        "no_share_128x8704": no_share,
        "rl8x16_shuffled": ([prompt] * groups, [[response] * samples] * groups, True),
    }
    for suffix in (0, 4 * response, 16 * response):
        cases[f"suffix_{suffix}"] = ([prompt] * groups, [[suffix] * samples] * groups, False)
    return cases


# ---------------------------------------------------------------- diagnosis (--diagnose)


@dataclass(frozen=True)
class Variant:
    """One way to run forest decode's kernels: a kernel config (public; ``None``: ``plan_forest``'s default rule)
    plus internal launch knobs."""

    name: str
    about: str
    config: ForestKernelConfig | None
    knobs: DecodeKnobs = field(default_factory=DecodeKnobs)
    rule_changes: tuple[tuple[str, Any], ...] = ()

    def config_for(self, batch: DecodeBatch) -> ForestKernelConfig:
        if self.config is not None:
            return self.config
        device = batch.block_table.device
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        return replace(
            default_forest_config(batch.seq_lens.shape[0], batch.key_cache.shape[2], sms), **dict(self.rule_changes)
        )

    @property
    def split(self) -> bool:
        config = self.config
        return self.knobs.split_passes or (config is not None and (config.split_passes or config.fuse_combine))


def _variants() -> list[Variant]:
    """Version 3 round 2 candidates first (most informative first; a run cut short by ``--budget-s`` keeps the
    first ones), then the round 1 variants they are compared with. Predictions: ``forest/NOTES.md``."""
    base = ForestKernelConfig()
    p64 = replace(base, prefix_block_n=64)
    stream64 = DecodeKnobs(split_passes=True, prefix_num_warps=4, prefix_num_stages=3, side_stream=True)
    p64_s64 = replace(base, prefix_block_n=64, suffix_block_n=64, split_passes=True)
    deep = replace(base, num_stages=5, split_passes=True)
    fused = replace(p64_s64, split_passes=False, fuse_combine=True)
    w8 = (("num_warps", 8),)
    pw1 = (("prefix_waves", 1.0),)
    split_w2 = (("split_passes", True), ("waves", 2.0))
    # A fixed suffix grid of two programs per SM, capped at 128 registers (127 without a cap: 154) so that two fit
    # beside a 253-register prefix program: 64 K registers together.
    persistent2 = {"suffix_programs_per_sm": 2, "max_registers": 128, "prefix_max_registers": 255}
    w16 = (("waves", 16.0),)
    # Larger batches' rule chains its split passes (round 17); variants of the side stream say so.
    chain = (("chain_passes", True),)
    side = (("chain_passes", False),)
    # Round 20: one- and two-warp suffix programs (the prefix pass keeps 4 warps and 3 stages); split chained passes
    # for both cases (the large-batch rule already has them).
    chained_split = (("split_passes", True), ("chain_passes", True))
    four_warp_prefix = DecodeKnobs(prefix_num_warps=4, prefix_num_stages=3)
    return [
        # Round 24 (predictions in forest/NOTES.md): the other side of round 20, 8-warp suffix programs (the prefix
        # pass keeps 4 warps); round 6 timed 8 warps only for both kinds or for the prefix pass.
        Variant(
            "v24_sw8",
            "chained split passes, suffix programs of 8 warps (3 stages)",
            None,
            four_warp_prefix,
            rule_changes=(*chained_split, ("num_warps", 8)),
        ),
        Variant(
            "v24_sw8_s64",
            "v24_sw8 with 64-token suffix tiles",
            None,
            four_warp_prefix,
            rule_changes=(*chained_split, ("num_warps", 8), ("suffix_block_n", 64)),
        ),
        Variant(
            "v20_sw1",
            "chained split passes, suffix programs of 1 warp (3 stages)",
            None,
            four_warp_prefix,
            rule_changes=(*chained_split, ("num_warps", 1)),
        ),
        Variant(
            "v20_sw1_s4",
            "v20_sw1 with 4 stages in the suffix pass",
            None,
            four_warp_prefix,
            rule_changes=(*chained_split, ("num_warps", 1), ("num_stages", 4)),
        ),
        Variant(
            "v20_sw2",
            "chained split passes, suffix programs of 2 warps (3 stages)",
            None,
            four_warp_prefix,
            rule_changes=(*chained_split, ("num_warps", 2)),
        ),
        Variant(
            "v20_sw1_w2",
            "v20_sw1 with two suffix items per request for the single group (waves 2; the large-batch rule's already)",
            None,
            four_warp_prefix,
            rule_changes=(*chained_split, ("num_warps", 1), ("waves", 2.0)),
        ),
        # Round 18 (predictions in forest/NOTES.md): with chained passes RL-8x16's suffix items (one 256 KB item per
        # request and kv head, 35 us each at four per SM) end raggedly over the last ~16 us; waves 16 / 32 split
        # every suffix in two / four items (waves <= 8 still gives one 512-token item per request).
        Variant("v18_chain_w16", "chained passes, suffix items of 256 tokens", None, rule_changes=(*chain, *w16)),
        Variant(
            "v18_chain_w32",
            "chained passes, suffix items of 128 tokens",
            None,
            rule_changes=(*chain, ("waves", 32.0)),
        ),
        Variant(
            "v18_chain_w16_early",
            "v18_chain_w16 with the early combine",
            None,
            rule_changes=(*chain, *w16, ("early_combine", True)),
        ),
        Variant(
            "v18_side_w16",
            "the default rule with the side stream and suffix items of 256 tokens",
            None,
            rule_changes=(*side, *w16),
        ),
        # Round 17 (predictions in forest/NOTES.md): the combine waits per request on counts the attention items
        # release, not for the whole attention launch, so it runs under the attention's last programs.
        Variant("v17_early", "the default rule with the early combine", None, rule_changes=(("early_combine", True),)),
        # Round 17b: the early combine's merge after its count completes (three rounds of partial loads for the
        # single group's 17 partials at 8 per round) in one round, and 64-token suffix tiles.
        Variant(
            "v17_early_c32w4",
            "v17_early with 4-warp combine programs loading up to 32 partials at once",
            None,
            rule_changes=(("early_combine", True), ("combine_num_warps", 4), ("combine_chunk_cap", 32)),
        ),
        Variant(
            "v17_early_s64",
            "v17_early with 64-token suffix tiles",
            None,
            rule_changes=(("early_combine", True), ("suffix_block_n", 64)),
        ),
        Variant(
            "v17_early_s64_c32w4",
            "v17_early_s64 with 4-warp combine programs loading up to 32 partials at once",
            None,
            rule_changes=(
                ("early_combine", True),
                ("suffix_block_n", 64),
                ("combine_num_warps", 4),
                ("combine_chunk_cap", 32),
            ),
        ),
        Variant(
            "v17_early_chain",
            "v17_early with split passes chained on one stream (prefix pass first)",
            None,
            rule_changes=(*chain, ("early_combine", True)),
        ),
        # Round 15 (predictions in forest/NOTES.md): the timeline shows the single group's one launch placing its
        # programs in same-kind pairs (56 SMs with two suffix programs, the critical path); alternate the kinds.
        Variant(
            "v15_interleave",
            "the default rule with prefix and suffix items alternating over the one launch's programs",
            None,
            DecodeKnobs(interleave_items=True),
        ),
        # Round 14 (predictions in forest/NOTES.md): the launch timeline shows RL-8x16's suffix pass taking the GPU
        # first and the one-wave prefix pass (1 MB items, ~62 us each) starting as it drains, 51-82 us in, so its
        # last programs end 24 us after its first; shorter prefix items shorten that tail.
        Variant(
            "v14_pw3",
            "the default rule with prefix_waves 3 (384 RL-8x16 prefix programs)",
            None,
            rule_changes=(("prefix_waves", 3.0),),
        ),
        Variant(
            "v14_pw4",
            "the default rule with prefix_waves 4 (512 RL-8x16 prefix programs of 512 KB)",
            None,
            rule_changes=(("prefix_waves", 4.0),),
        ),
        Variant(
            "v14_pw8",
            "the default rule with prefix_waves 8 (1024 RL-8x16 prefix programs of 256 KB)",
            None,
            rule_changes=(("prefix_waves", 8.0),),
        ),
        # Round 13 (predictions in forest/NOTES.md): RL-8x16 with one 2 MB prefix program per SM and a persistent
        # suffix pass of two programs per SM beside it (round 10 let four one-item suffix programs per SM crowd it).
        Variant(
            "v13_pw1_ps2_chain",
            "prefix_waves 1 (one prefix program per SM), persistent suffix pass of 2 programs per SM chained after it",
            None,
            DecodeKnobs(**persistent2),
            rule_changes=(*chain, *pw1),
        ),
        Variant(
            "v13_pw1_ps2",
            "v13_pw1_ps2_chain with the prefix pass on the side stream",
            None,
            DecodeKnobs(**persistent2),
            rule_changes=(*side, *pw1),
        ),
        Variant(
            "v13_pw1_ps1_chain",
            "prefix_waves 1, persistent suffix pass of 1 program per SM (154 registers, uncapped), chained",
            None,
            DecodeKnobs(suffix_programs_per_sm=1),
            rule_changes=(*chain, *pw1),
        ),
        Variant(
            "v13_ps4",
            "the default rule with a persistent suffix pass of 4 programs per SM capped at 128 registers (the "
            "persistent loop's own cost)",
            None,
            DecodeKnobs(suffix_programs_per_sm=4, max_registers=128, prefix_max_registers=255),
        ),
        # Round 12 (predictions in forest/NOTES.md): the flat-loop probe found one-wave suffix work 20% faster at two
        # programs per SM than at one; the single group's rule gets its own prefix launch (one 64x64 program per SM)
        # and two suffix programs per SM beside it. RL-8x16's rule has both already: its rows are the control.
        Variant(
            "v12_split_w2",
            "the default rule with split passes (side stream) and waves 2 (single group: 256 suffix programs)",
            None,
            rule_changes=(*side, *split_w2),
        ),
        Variant(
            "v12_split_w2_chain",
            "v12_split_w2 with both passes on one stream, the suffix pass after every prefix program has started",
            None,
            rule_changes=(*chain, *split_w2),
        ),
        Variant(
            "v12_split_w4",
            "the default rule with split passes and waves 4 (single group: 512 suffix programs, 2 fit beside the "
            "prefix program by registers)",
            None,
            rule_changes=(("split_passes", True), ("waves", 4.0)),
        ),
        # Round 10 (predictions in forest/NOTES.md): one RL-8x16 prefix program per SM, suffix programs beside it.
        Variant(
            "v10_pw1",
            "the default rule with prefix_waves 1 (one prefix program per SM), side stream",
            None,
            rule_changes=(*side, *pw1),
        ),
        Variant(
            "v10_pw1_chain",
            "v10_pw1 with both passes on one stream, the suffix pass after every prefix program has started",
            None,
            rule_changes=(*chain, *pw1),
        ),
        Variant(
            "v10_pw1_ps4",
            "v10_pw1 with 4 stages for the prefix pass (144 KB)",
            None,
            DecodeKnobs(prefix_num_stages=4),
            rule_changes=(*side, *pw1),
        ),
        Variant(
            "v10_pw1_ps4_chain",
            "v10_pw1_ps4 with both passes on one stream",
            None,
            DecodeKnobs(prefix_num_stages=4),
            rule_changes=(*chain, *pw1),
        ),
        # Round 7 (predictions in forest/NOTES.md): combine programs sized to fit one wave (sm90_compile_report
        # registers: 1 warp, 8 partials at a time, 64 dims: 118 registers, 17 per SM, 2048 RL-8x16 programs).
        Variant(
            "v7_combine_c8_d64",
            "the default rule with 1-warp combine programs over 64-dim halves, 8 partials at a time",
            None,
            DecodeKnobs(combine_dim_block=64, combine_chunk_cap=8),
        ),
        Variant(
            "v7_combine_c8_d32",
            "the default rule with 1-warp combine programs over 32-dim slices, 8 partials at a time (83 registers)",
            None,
            DecodeKnobs(combine_chunk_cap=8),
        ),
        Variant(
            "v7_combine_c4_d32",
            "the default rule with 1-warp combine programs over 32-dim slices, 4 partials at a time (71 registers)",
            None,
            DecodeKnobs(combine_chunk_cap=4),
        ),
        # Round 6 (predictions in forest/NOTES.md): Nsight Compute found the single group issue-bound (2 programs
        # of 4 warps per SM, 62% of issue slots idle); 8-warp programs capped at 128 registers still fit 2 per SM.
        Variant(
            "v6_w8_r128",
            "the default rule with 8-warp attention programs capped at 128 registers (2 per SM: 16 warps)",
            None,
            DecodeKnobs(max_registers=128),
            w8,
        ),
        Variant(
            "v6_w8",
            "the default rule with 8-warp attention programs, registers uncapped (136-180: 1 prefix program per SM)",
            None,
            rule_changes=w8,
        ),
        Variant(
            "v6_prefix_w8_r128",
            "the default rule; split passes: an 8-warp prefix pass capped at 128 registers, the 4-warp suffix pass "
            "(the single group's one launch: as v6_w8_r128 with 4-warp programs, i.e. the default)",
            None,
            DecodeKnobs(prefix_num_warps=8, prefix_max_registers=128),
        ),
        Variant(
            "v6_w8_r128_s64",
            "v6_w8_r128 with 64-token suffix tiles",
            None,
            DecodeKnobs(max_registers=128),
            (*w8, ("suffix_block_n", 64)),
        ),
        # Round 5 (predictions in forest/NOTES.md): the single group's suffix programs stream 32-token tiles, a
        # quarter of the bytes in flight of the SM's other (prefix) program, and are its critical path.
        Variant(
            "v5_default",
            "plan_forest's default rule (default_forest_config: one wave for <= 1 (request, kv head) per SM, else "
            "chained split passes; 1-warp combine over 64-dim halves; dependent launches; early combine)",
            None,
        ),
        Variant(
            "v5_s64",
            "the default rule with 64-token suffix tiles (single group: one prefix and one suffix program per SM, "
            "64 KB in flight each)",
            None,
            rule_changes=(("suffix_block_n", 64),),
        ),
        Variant(
            "v4_pdl_chain",
            "the default rule; split passes chained on one stream (the suffix pass starts beside the prefix "
            "pass's last wave and waits for it at its end) instead of the side stream",
            None,
            rule_changes=chain,
        ),
        Variant(
            "v3_default",
            "the default rule without dependent launches (as of round 3)",
            None,
            rule_changes=(("dependent_launches", False),),
        ),
        # Round 3 (offline: sm90_compile_report; the combine is latency-bound, 17.7 us whatever its partial bytes):
        # fewer registers per combine program, so its 1024 RL-8x16 programs take ~1 wave instead of 2.6.
        Variant(
            "v3_combine_w2_c8",
            "v3_default with 2-warp combine programs loading 8 partials at a time (145 registers: 7/SM, ~1.1 waves)",
            None,
            DecodeKnobs(combine_chunk_cap=8, combine_num_warps=2),
        ),
        Variant(
            "v3_combine_w2_c4",
            "v3_default with 2-warp combine programs loading 4 partials at a time (96 registers: 10/SM, 1 wave)",
            None,
            DecodeKnobs(combine_chunk_cap=4, combine_num_warps=2),
        ),
        Variant(
            "v3_combine_w1_d32",
            "v3_default with 1-warp combine programs over 32-dim slices, 16 partials at a time (120 registers)",
            None,
            DecodeKnobs(combine_dim_block=32, combine_chunk_cap=16, combine_num_warps=1),
        ),
        Variant(
            "fused_p64_s64",
            "prefix pass (64x64, 2/SM), then the suffix pass (64-token tiles) merging the prefix partials of one-item "
            "suffixes itself: the combine only serves split suffixes (none in RL-8x16 or the single group)",
            fused,
        ),
        Variant(
            "fused_p64_s64_w1",
            "fused_p64_s64 with prefix_waves 2 and waves 1 (single group: 264 prefix programs, one suffix item per "
            "(request, kv head))",
            replace(fused, waves=1.0),
        ),
        Variant(
            "split_p64_s64",
            "prefix pass 64x64 tiles (2/SM) on a side stream, suffix pass 64-token tiles (3/SM, 70 KB)",
            p64_s64,
        ),
        Variant(
            "split_p32_deep",
            "prefix pass 64x32 tiles, 6 stages (112 KB, 2/SM, 5 tiles in flight); suffix pass 5 stages (69 KB, 3/SM)",
            deep,
            DecodeKnobs(split_passes=True, prefix_num_warps=4, prefix_num_stages=6, side_stream=True),
        ),
        Variant(
            "split_p64_s64_c8",
            "split_p64_s64 with combine chunks of 8 partials (half the registers: more combine programs per SM)",
            p64_s64,
            DecodeKnobs(combine_chunk_cap=8),
        ),
        Variant(
            "split_p64_s64_noside",
            "split_p64_s64 with the two passes one after the other (side stream off)",
            replace(p64_s64, split_passes=False),
            DecodeKnobs(split_passes=True),
        ),
        Variant(
            "w1_p64",
            "one launch, 64x64 prefix tiles, prefix_waves 1, waves 1",
            replace(p64, prefix_waves=1.0, waves=1.0),
        ),
        Variant(
            "split_p64_s64_w1",
            "split_p64_s64 with prefix_waves 1 and waves 1",
            replace(p64_s64, prefix_waves=1.0, waves=1.0),
        ),
        Variant(
            "w1_combine32",
            "v2_w1 with the combine in 32-dim slices, all partials loaded at once",
            replace(base, prefix_waves=1.0, waves=1.0),
            DecodeKnobs(combine_dim_block=32, combine_chunk_cap=64),
        ),
        Variant("v2", "version 2: one launch, prefix tiles 64x32, 4 warps, 3 stages, 2 prefix programs/SM", base),
        Variant(
            "stream_p64",
            "prefix pass (64x64 tiles, 4 warps, 3 stages) on a side stream beside the suffix pass",
            p64,
            stream64,
        ),
        Variant(
            "v2_w1",
            "v2 with prefix_waves 1 and waves 1: about one wave in all",
            replace(base, prefix_waves=1.0, waves=1.0),
        ),
        Variant("p64", "one launch with 64x64 prefix tiles (112 KB shared: 2 programs/SM for every item)", p64),
        Variant(
            "v2_combine32",
            "v2 with the combine in 32-dim slices, all partials loaded at once",
            base,
            DecodeKnobs(combine_dim_block=32, combine_chunk_cap=64),
        ),
    ]


def _compile_signature(case_name: str, variant: Variant) -> tuple[Any, ...]:
    config, knobs = variant.config, variant.knobs
    if config is None:
        return (case_name, variant.name)
    tiles = (config.prefix_block_m, config.prefix_block_n, config.suffix_block_n, config.num_warps, config.num_stages)
    return (
        case_name,
        tiles,
        variant.split,
        config.fuse_combine,
        knobs.prefix_num_warps,
        knobs.prefix_num_stages,
        knobs.combine_dim_block,
        knobs.combine_chunk_cap,
        knobs.combine_num_warps,
        config.chain_passes,
        config.early_combine,
        knobs.max_registers,
        knobs.prefix_max_registers,
        config.combine_dim_block,
        config.combine_num_warps,
        config.combine_chunk_cap,
        config.dependent_launches,
    )


def _precompile_job(job: tuple[str, str, bool]) -> str:
    """Worker process: run one variant once on the real shapes so its kernels land in Triton's on-disk cache."""
    case_name, variant_name, smoke = job
    shape = SMOKE if smoke else H200
    try:
        variant = {v.name: v for v in _variants()}[variant_name]
        case = Case(case_name, *_cases(shape, smoke)[case_name], shape=shape, copies=1)
        batch = case.batches[0]
        plan = _forest_plan(batch, shape, variant.config_for(batch), case.workspaces[0])
        partials = allocate_partials(plan, shape.head_dim, batch.query.device)
        out = torch.empty_like(batch.query)
        lse = torch.empty(batch.query.shape[:2], device=batch.query.device)
        scale = shape.head_dim**-0.5
        launch_attention(
            batch.query, batch.key_cache, batch.value_cache, plan, scale, out, lse, partials, variant.knobs
        )
        launch_combine(out, lse, plan, partials, shape.head_dim, variant.knobs)
        if variant.name == "v2" or variant.split:
            for passes in ((1,), (2,)):
                launch_attention(
                    batch.query,
                    batch.key_cache,
                    batch.value_cache,
                    plan,
                    scale,
                    out,
                    lse,
                    partials,
                    variant.knobs,
                    passes,
                )
        if batch.query.is_cuda:
            torch.cuda.synchronize()
        return f"{case_name}/{variant_name}: compiled"
    except Exception as error:  # reported by the parent, which compiles (or fails) again itself
        return f"{case_name}/{variant_name}: {type(error).__name__}: {str(error)[:200]}"


def _precompile(case_names: list[str], variants: list[Variant], workers: int, smoke: bool) -> None:
    import concurrent.futures
    import multiprocessing

    jobs: dict[tuple[Any, ...], tuple[str, str, bool]] = {}
    for case_name in case_names:
        for variant in variants:
            jobs.setdefault(_compile_signature(case_name, variant), (case_name, variant.name, smoke))
    started = time.time()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        for message in pool.map(_precompile_job, list(jobs.values())):
            if not message.endswith("compiled"):
                print(f"  precompile {message}", flush=True)
    print(f"precompiled {len(jobs)} kernel sets in {workers} processes ({time.time() - started:.0f} s)", flush=True)


def _occupancy(compiled: list[Any]) -> str:
    """Programs per multiprocessor of each launch from its compiled kernel (Hopper limits), e.g. ``2/SM(112K,250r)``."""
    parts = []
    for kernel in compiled:
        regs = getattr(kernel, "n_regs", None)
        if not regs:
            return "-"
        shared = int(kernel.metadata.shared)
        warps = int(kernel.metadata.num_warps)
        regs_per_warp = -(-regs * 32 // 256) * 256
        programs = min((228 * 1024) // (shared + 1024), 65536 // (regs_per_warp * warps), 64 // warps, 32)
        spills = ",spills" if getattr(kernel, "n_spills", 0) else ""
        parts.append(f"{programs}/SM({shared // 1024}K,{regs}r{spills})")
    return "+".join(parts)


def pass_bytes(plan: ForestPlan, shape: Shape) -> tuple[int, int]:
    """(bytes the prefix pass reads: each group's shared prefix once, bytes the suffix pass reads)."""
    prefix = plan.prefix_blocks.cpu().to(torch.int64)
    leaders = plan.group_leader.cpu()
    own = (leaders == torch.arange(leaders.shape[0])) & (prefix > 0)
    block = plan.block_size
    prefix_tokens = int(prefix[own].sum()) * block
    suffix_tokens = int((plan.seq_lens.cpu().to(torch.int64) - prefix * block).clamp_min(0).sum())
    return prefix_tokens * shape.bytes_per_token, suffix_tokens * shape.bytes_per_token


@dataclass
class _Setup:
    batch: DecodeBatch
    workspace: ForestWorkspace
    plan: ForestPlan
    partials: Partials
    out: torch.Tensor
    lse: torch.Tensor


class Diagnosis:
    """Times one case's pieces (copy ceiling, plan, passes, combine) and every variant's kernels, checked first."""

    def __init__(self, case: Case, repeats: int, per_graph: int) -> None:
        self.case = case
        self.repeats = repeats
        self.per_graph = per_graph
        self.scale = case.shape.head_dim**-0.5
        batch = case.batches[0]
        self.head_dim = batch.query.shape[2]
        count = batch.seq_lens.shape[0]
        # Every request of small batches; an even spread (each group's first and last among them) of large ones.
        self.sample = list(range(count)) if count <= 32 else sorted(set(range(0, count, 5)) | {count - 1})
        self.reference = self._sampled_reference(batch)
        paged = _paged_plan(batch, replace(ForestKernelConfig(), suffix_block_n=64))
        self.paged_out, self.paged_lse = forest_decode(
            batch.query, batch.key_cache, batch.value_cache, paged, self.scale
        )
        self.prefix_bytes, self.suffix_bytes = pass_bytes(
            _forest_plan(batch, case.shape, ForestKernelConfig(), case.workspaces[0]), case.shape
        )

    def _sampled_reference(self, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        starts = batch.query_start_loc.cpu()
        index = torch.tensor(self.sample)
        rows = torch.cat([torch.arange(int(starts[r]), int(starts[r + 1])) for r in self.sample])
        lengths = (starts[1:] - starts[:-1])[index]
        sub_starts = torch.zeros(len(self.sample) + 1, dtype=torch.int32)
        sub_starts[1:] = torch.cumsum(lengths, 0)
        device_index = index.to(batch.query.device)
        ref_out, ref_lse = reference_paged_attention(
            batch.query[rows.to(batch.query.device)],
            batch.key_cache,
            batch.value_cache,
            batch.block_table[device_index],
            batch.seq_lens[device_index],
            sub_starts,
            self.scale,
        )
        return rows, ref_out, ref_lse

    def setups(self, variant: Variant) -> list[_Setup]:
        result = []
        for batch, workspace in zip(self.case.batches, self.case.workspaces, strict=True):
            plan = _forest_plan(batch, self.case.shape, variant.config_for(batch), workspace)
            result.append(
                _Setup(
                    batch=batch,
                    workspace=workspace,
                    plan=plan,
                    partials=allocate_partials(plan, self.head_dim, batch.query.device),
                    out=torch.full_like(batch.query, float("nan")),
                    lse=torch.full(batch.query.shape[:2], float("nan"), device=batch.query.device),
                )
            )
        return result

    def attention(self, setup: _Setup, knobs: DecodeKnobs, passes: tuple[int, ...] | None = None) -> list[Any]:
        batch = setup.batch
        return launch_attention(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            setup.plan,
            self.scale,
            setup.out,
            setup.lse,
            setup.partials,
            knobs,
            passes,
        )

    def combine(self, setup: _Setup, knobs: DecodeKnobs) -> None:
        launch_combine(setup.out, setup.lse, setup.plan, setup.partials, self.head_dim, knobs)

    def kernels(self, setup: _Setup, knobs: DecodeKnobs) -> None:
        self.attention(setup, knobs)
        self.combine(setup, knobs)

    def verify(self, setup: _Setup) -> dict[str, Any]:
        """bf16 tolerances of the GPU tests: the sampled requests against the fp32 reference, every row against the
        per-request kernel, no row left unwritten (outputs start as NaN)."""
        rows, ref_out, ref_lse = self.reference
        device_rows = rows.to(setup.out.device)
        out, lse = setup.out[device_rows].float().cpu(), setup.lse[device_rows].cpu()
        finite = not (torch.isnan(setup.out).any().item() or torch.isnan(setup.lse).any().item())
        error = _relative_error(out, ref_out) if finite else math.inf
        lse_ok = finite and torch.allclose(lse, ref_lse, atol=5e-2, rtol=1e-2)
        paged_error = _relative_error(setup.out, self.paged_out) if finite else math.inf
        paged_lse_error = (setup.lse - self.paged_lse).abs().max().item() if finite else math.inf
        ok = finite and error < 1.5e-2 and lse_ok and paged_error < 1.5e-2 and paged_lse_error < 5e-2
        return {"ok": ok, "rel_error_vs_reference": error, "rel_error_vs_per_request": paged_error}

    def time(self, calls: Sequence[Callable[[], Any]]) -> float:
        cycled = [calls[i % len(calls)] for i in range(max(self.per_graph, len(calls)))]
        return _graph_time_us(cycled, self.repeats, self.case.shape.device)

    def row(self, label: str, us: float, num_bytes: int, copy_tbps: float, **extra: Any) -> dict[str, Any]:
        tbps = num_bytes / us / 1e6
        return {
            "case": self.case.name,
            "variant": label,
            "us": us,
            "MB": num_bytes / 1e6,
            "TB/s": tbps,
            "of_copy": tbps / copy_tbps,
            **extra,
        }

    def variant(self, variant: Variant, copy_tbps: float) -> dict[str, Any]:
        setups = self.setups(variant)
        knobs = variant.knobs
        compiled = self.attention(setups[0], knobs)
        self.combine(setups[0], knobs)
        check = self.verify(setups[0])
        base = {
            "case": self.case.name,
            "variant": variant.name,
            "occupancy": _occupancy(compiled),
            **check,
            "about": variant.about,
            "config": str(variant.config_for(self.case.batches[0])),
            "knobs": str(knobs),
        }
        if not check["ok"]:
            return base
        attention_us = self.time([partial(self.attention, s, knobs) for s in setups])
        combine_us = self.time([partial(self.combine, s, knobs) for s in setups])
        # An early combine's counts (ForestPlan.combine_ready) are left behind by the two timings above, which run
        # one launch without the other: the calls below start from zero, as every call after a plan does, and are
        # checked again once timed.
        for setup in setups:
            setup.plan.combine_ready.zero_()
        kernels_us = self.time([partial(self.kernels, s, knobs) for s in setups])
        if setups[0].plan.config.early_combine:
            base["ok_after_timing"] = self.verify(setups[0])["ok"]
            base["counts_zero_after_timing"] = not bool(setups[0].plan.combine_ready.any())
        unique = self.case.unique_bytes
        tbps = unique / kernels_us / 1e6
        if variant.split:
            # Each pass alone (same binaries): the prefix pass's rate is the number version 3 is after.
            prefix_us = self.time([partial(self.attention, s, knobs, (1,)) for s in setups])
            suffix_us = self.time([partial(self.attention, s, knobs, (2,)) for s in setups])
            base["prefix_pass_us"] = prefix_us
            base["prefix_pass_TB/s"] = self.prefix_bytes / prefix_us / 1e6
            base["suffix_pass_us"] = suffix_us
            base["suffix_pass_TB/s"] = self.suffix_bytes / suffix_us / 1e6
        return {
            **base,
            "attention_us": attention_us,
            "combine_us": combine_us,
            "kernels_us": kernels_us,
            "TB/s": tbps,
            "of_copy": tbps / copy_tbps,
        }

    def whole_op_us(self, variant: Variant) -> float:
        """Plan + attention + combine per call (the plan rebuilt every layer)."""
        calls = []
        for batch, workspace in zip(self.case.batches, self.case.workspaces, strict=True):
            out = torch.empty_like(batch.query)
            lse = torch.empty(batch.query.shape[:2], device=batch.query.device)

            def call(
                batch: DecodeBatch = batch,
                workspace: ForestWorkspace = workspace,
                out: torch.Tensor = out,
                lse: torch.Tensor = lse,
            ) -> None:
                plan = _forest_plan(batch, self.case.shape, variant.config_for(batch), workspace)
                launch_forest_decode(
                    batch.query, batch.key_cache, batch.value_cache, plan, self.scale, out, lse, variant.knobs
                )

            calls.append(call)
        return self.time(calls)


def _copy_us(num_bytes: int, copies: int, diagnosis: Diagnosis) -> float:
    """A plain device copy moving ``num_bytes`` (half read, half written) per call, over rotating buffers."""
    device = diagnosis.case.shape.device
    pairs = []
    for _ in range(copies):
        source = torch.empty(num_bytes // 4, dtype=torch.bfloat16, device=device).normal_()
        pairs.append((source, torch.empty_like(source)))
    return diagnosis.time([partial(target.copy_, source) for source, target in pairs])


def _diagnose_pieces(diagnosis: Diagnosis, copy_tbps: float) -> list[dict[str, Any]]:
    """Copy ceiling, plan, plan without groups, and version 2's prefix and suffix items alone (same binary)."""
    case = diagnosis.case
    shape = case.shape
    base = ForestKernelConfig()
    unique = case.unique_bytes
    pieces = [
        diagnosis.row("copy of the unique bytes", _copy_us(unique, len(case.batches), diagnosis), unique, copy_tbps)
    ]
    setups = diagnosis.setups(Variant("v2", "", base))
    plan_us = diagnosis.time([partial(_forest_plan, s.batch, shape, base, s.workspace) for s in setups])
    pieces.append({"case": case.name, "variant": "plan (3 launches)", "us": plan_us})
    paged_us = diagnosis.time([partial(_paged_plan, s.batch, base) for s in setups])
    pieces.append({"case": case.name, "variant": "plan without groups (1 launch)", "us": paged_us})
    dependent = replace(base, dependent_launches=True)
    pdl_plan_us = diagnosis.time([partial(_forest_plan, s.batch, shape, dependent, s.workspace) for s in setups])
    pieces.append({"case": case.name, "variant": "plan (3 dependent launches)", "us": pdl_plan_us})
    knobs = DecodeKnobs()
    for passes, label, num_bytes in (
        ((1,), "v2 prefix items only", diagnosis.prefix_bytes),
        ((2,), "v2 suffix items only", diagnosis.suffix_bytes),
    ):
        us = diagnosis.time([partial(diagnosis.attention, s, knobs, passes) for s in setups])
        pieces.append(diagnosis.row(label, us, num_bytes, copy_tbps))
    for piece in pieces:
        rate = f" ({piece['TB/s']:.2f} TB/s on {piece['MB']:.0f} MB)" if "TB/s" in piece else ""
        print(f"{case.name}: {piece['variant']}: {piece['us']:.1f} us{rate}", flush=True)
    return pieces


def _diagnose(args: argparse.Namespace, out_dir: Path) -> None:
    """Explain the version 2 misses: time the pieces separately, then each version 3 candidate (checked first)."""
    started = time.time()
    shape = SMOKE if args.smoke else H200
    specs = _cases(shape, args.smoke)
    case_names = [name for name in args.cases.split(",") if name]
    unknown = sorted(set(case_names) - set(specs))
    if unknown or not case_names:
        raise SystemExit(f"--cases: unknown or no case names {unknown}; choose from {sorted(specs)}")
    variants = _variants()
    if args.only:
        variants = [v for v in variants if v.name in args.only.split(",")]
    if args.jobs > 0:
        try:
            _precompile(case_names, variants, args.jobs, args.smoke)
        except Exception as error:  # compiling in this process instead is slower, not wrong
            print(f"precompile failed ({type(error).__name__}: {error}); compiling here", flush=True)
    repeats = 2 if args.smoke else 15
    per_graph = 2 if args.smoke else 8
    copy_tbps = 1.0 if args.smoke else copy_bandwidth_gbps() / 1000.0
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"copy_tbps": copy_tbps, "per_graph": per_graph, "repeats": repeats}

    tiny = torch.zeros(1, device=shape.device)
    floor_us = _graph_time_us([partial(tiny.add_, 1)] * per_graph, repeats, shape.device)
    replay_us = _graph_time_us([partial(tiny.add_, 1)], repeats, shape.device)
    summary.update({"tiny_kernel_in_graph_us": floor_us, "one_kernel_graph_replay_us": replay_us})
    print(
        f"copy {copy_tbps:.2f} TB/s | tiny kernel in a graph {floor_us:.2f} us | one-kernel graph replay "
        f"{replay_us:.2f} us (version 2's benchmark timed one call per replay for RL-8x16)",
        flush=True,
    )

    diagnoses: list[Diagnosis] = []
    pieces: dict[str, list[dict[str, Any]]] = {}
    for case_name in case_names:
        copies = 4 if case_name.startswith("single") and not args.smoke else 1
        diagnosis = Diagnosis(Case(case_name, *specs[case_name], shape=shape, copies=copies), repeats, per_graph)
        diagnoses.append(diagnosis)
        pieces[case_name] = _diagnose_pieces(diagnosis, copy_tbps)
        rows.extend(pieces[case_name])

    # Variant by variant over both cases, so a run cut short keeps both cases' numbers for the first variants.
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in case_names}
    # --rounds > 1 runs the whole variant list again, so variants alternate (A/B/A/B) under the same machine state.
    for round_index, variant in [(r, v) for r in range(args.rounds) for v in variants]:
        for diagnosis in diagnoses:
            name = diagnosis.case.name
            if time.time() - started > args.budget_s:
                print(f"{name}: {variant.name}: skipped (budget of {args.budget_s:.0f} s spent)", flush=True)
                continue
            try:
                result = diagnosis.variant(variant, copy_tbps)
            except Exception as error:  # a variant that does not fit the chip must not hide the others
                result = {
                    "case": name,
                    "variant": variant.name,
                    "ok": False,
                    "error": f"{type(error).__name__}: {str(error)[:300]}",
                }
            result["round"] = round_index
            results[name].append(result)
            timing = (
                f"attention {result['attention_us']:.1f} + combine {result['combine_us']:.1f} -> kernels "
                f"{result['kernels_us']:.1f} us ({result['of_copy']:.0%} of copy)"
                if "kernels_us" in result
                else f"FAILED {result.get('error', result)}"
            )
            print(f"{name}: {variant.name} [{result.get('occupancy', '-')}]: {timing}", flush=True)

    by_name = {v.name: v for v in variants}
    for diagnosis in diagnoses:
        name = diagnosis.case.name
        timed = sorted((r for r in results[name] if "kernels_us" in r), key=lambda r: r["kernels_us"])
        always = ("v2", "v5_default")
        for result in [r for r in timed if r["variant"] in always] + [
            r for r in timed[:2] if r["variant"] not in always
        ]:
            if time.time() - started > args.budget_s + 20:
                break
            result["whole_op_us"] = diagnosis.whole_op_us(by_name[result["variant"]])
            print(
                f"{name}: {result['variant']}: whole op (plan every layer) {result['whole_op_us']:.1f} us", flush=True
            )
        rows.extend(results[name])
        plan_us = pieces[name][1]["us"]
        timed_in_order = sorted((r for r in results[name] if "kernels_us" in r), key=lambda r: r["round"])
        summary[name] = {
            "unique_MB": diagnosis.case.unique_bytes / 1e6,
            "copy_us": pieces[name][0]["us"],
            "plan_us": plan_us,
            "v2_kernels_us": next((r["kernels_us"] for r in timed if r["variant"] == "v2"), math.nan),
            "best_variant": timed[0]["variant"] if timed else None,
            "best_kernels_us": timed[0]["kernels_us"] if timed else math.nan,
            "best_amortized_us": timed[0]["kernels_us"] + plan_us / LAYERS if timed else math.nan,
            "failed": [r["variant"] for r in results[name] if not r.get("ok")],
            # Each variant's kernels over the rounds (one value per round), for A/B reading.
            "kernels_us_by_variant": {
                variant.name: [r["kernels_us"] for r in timed_in_order if r["variant"] == variant.name]
                for variant in variants
            },
        }
    for diagnosis in diagnoses:
        name = diagnosis.case.name
        print(f"\n{name} ({diagnosis.case.unique_bytes / 1e6:.0f} MB unique)")
        print_table(pieces[name], ["variant", "us", "MB", "TB/s", "of_copy"])
        columns = ["variant", "ok", "occupancy", "attention_us", "combine_us", "kernels_us", "TB/s", "of_copy"]
        print_table(results[name], [*columns, "whole_op_us"])
        diagnosis.case.free()
    summary["seconds"] = time.time() - started
    path = write_results(out_dir, "fca_decode_diagnose", summary, rows)
    print(f"diagnosis done in {summary['seconds']:.0f} s | wrote {path}", flush=True)


def _gpu_state() -> str:
    """The SM and memory clocks, power and temperature nvidia-smi reports now (empty where it is missing)."""
    query = "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu"
    try:
        done = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def _paged_order(args: argparse.Namespace, out_dir: Path) -> None:
    """The open question of the main runs: on no sharing, the per-request kernel with one fixed plan
    ("paged_kernels") came out 9-15% slower than with its plan rebuilt before every call ("paged"), though the
    tuning had timed the same config at the paged rate. Both, alternating, three rounds each, with and without
    dependent launches, with the clocks and power read before every timing."""
    shape = SMOKE if args.smoke else H200
    specs = _cases(shape, args.smoke)
    name = "no_share_128x8704"
    case = Case(name, *specs[name], shape=shape)
    repeats = 2 if args.smoke else 15
    # The main benchmark's tuned per-request config (fca_decode.json at f8d3556), then the same without PDL.
    tuned = replace(ForestKernelConfig(), waves=4.0, dependent_launches=True)
    rows: list[dict[str, Any]] = []
    started = time.time()
    for dependent in (True, False):
        config = replace(tuned, dependent_launches=dependent)
        for round_index in range(3):
            for what in ("paged_kernels", "paged", "forest_kernels", "forest"):
                state = _gpu_state()
                us = case.time(what, config if what.startswith("paged") else None, repeats)
                rows.append(
                    {
                        "case": name,
                        "what": what,
                        "dependent_launches": dependent,
                        "round": round_index,
                        "us": us,
                        "gpu_before": state,
                    }
                )
                print(f"{name} {what} dependent={dependent} round {round_index}: {us:.1f} us [{state}]", flush=True)
    case.free()
    summary = {"seconds": time.time() - started, "repeats": repeats, "per_graph": CALLS_PER_GRAPH}
    for what in ("paged_kernels", "paged", "forest_kernels", "forest"):
        for dependent in (True, False):
            times = [r["us"] for r in rows if r["what"] == what and r["dependent_launches"] == dependent]
            summary[f"{what}_{'pdl' if dependent else 'plain'}_us"] = times
    path = write_results(out_dir, "fca_decode_paged_order", summary, rows)
    print(f"paged order done in {summary['seconds']:.0f} s | wrote {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: $OUT or benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="fewer checks, no tuning sweep, fewer repeats")
    parser.add_argument("--smoke", action="store_true", help="CPU dry run of every code path on tiny shapes")
    parser.add_argument("--plot-from", type=Path, default=None, help="only draw the PNG from an existing JSON")
    parser.add_argument("--diagnose", action="store_true", help="time the pieces and the version 3 candidates")
    parser.add_argument("--only", default="", help="--diagnose: comma-separated variant names (default: all)")
    parser.add_argument(
        "--jobs", type=int, default=None, help="--diagnose: precompiling processes (default 16; 0 none)"
    )
    parser.add_argument("--budget-s", type=float, default=170.0, help="--diagnose: skip variants after this")
    parser.add_argument("--rounds", type=int, default=1, help="--diagnose: run the variant list this many times")
    parser.add_argument(
        "--cases",
        default="single_group_16x8704,rl8x16_adjacent",
        help="--diagnose: comma-separated case names (e.g. add no_share_128x8704 for the per-request kernel)",
    )
    parser.add_argument(
        "--paged-order", action="store_true", help="no sharing: fixed vs rebuilt per-request plan, alternating"
    )
    args = parser.parse_args()
    if args.jobs is None:
        args.jobs = 0 if args.smoke else 16
    out_dir = args.out or default_out_dir()
    if args.paged_order:
        if not args.smoke and not torch.cuda.is_available():
            sys.exit("--paged-order needs a CUDA GPU (or --smoke)")
        _paged_order(args, out_dir)
        return
    if args.diagnose:
        if not args.smoke and not torch.cuda.is_available():
            sys.exit("--diagnose needs a CUDA GPU (or --smoke)")
        _diagnose(args, out_dir)
        return
    if args.plot_from is not None:
        saved = json.loads(args.plot_from.read_text())["rows"]
        target = args.plot_from.with_suffix(".png")
        print(f"wrote {target}" if _plot(saved, target) else "matplotlib missing or no sweep rows")
        return
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("fca_decode needs a CUDA GPU (or --smoke); the CPU tests cover correctness (pytest packages/...).")
    shape = SMOKE if args.smoke else H200
    started = time.time()
    repeats = 2 if args.smoke else (10 if args.quick else 25)

    checks = _check_correctness(shape, args.quick, args.smoke)
    copy_tbps = 1.0 if args.smoke else copy_bandwidth_gbps() / 1000.0
    rows: list[dict[str, Any]] = [*checks]
    specs = _cases(shape, args.smoke)
    names = list(specs)
    rl = Case(names[0], *specs[names[0]], shape=shape)
    single = Case(names[1], *specs[names[1]], shape=shape)
    no_share = Case(names[2], *specs[names[2]], shape=shape)
    tiny_suffix = Case(names[4], *specs[names[4]], shape=shape)
    if args.quick:
        config, paged_config = None, replace(ForestKernelConfig(), suffix_block_n=64)
    else:
        config, paged_config = _tune(rl, single, no_share, tiny_suffix, max(5, repeats // 3), rows)
        print(f"tuning done ({time.time() - started:.0f} s)", flush=True)

    results: list[dict[str, Any]] = []
    case_checks: list[dict[str, Any]] = []
    for name in names:
        kept = {names[0]: rl, names[1]: single, names[2]: no_share, names[4]: tiny_suffix}
        try:
            case = kept[name] if name in kept else Case(name, *specs[name], shape=shape)
            case_checks.append(case.check(config, paged_config))
            row = _measure(case, config, paged_config, repeats, copy_tbps)
            case.free()
        except Exception as error:  # one failing case must not hide the others' results
            print(f"{name}: FAILED {type(error).__name__}: {str(error)[:300]}", flush=True)
            case_checks.append({"check": f"{name}: measured", "ok": False, "error": str(error)[:300]})
            continue
        if name.startswith("suffix_"):
            row["suffix"] = int(name.split("_")[1])
        results.append(row)
        print(f"{name}: {row['forest_us']:.1f} us whole op, {row['forest_amortized_us']:.1f} amortized", flush=True)
    measured = list(results)
    if results and results[0]["case"] == names[0]:
        # The RL case is also the sweep's middle point.
        middle = dict(results[0])
        middle["case"], middle["suffix"] = f"suffix_{specs[names[0]][1][0][0]}", specs[names[0]][1][0][0]
        results.append(middle)
    checks.extend(case_checks)
    rows.extend(case_checks)
    rows.extend(results)
    failed = [row for row in checks if not row["ok"]]

    by_case = {row["case"]: row for row in results}

    def value(case: str, key: str) -> float:
        return float(by_case.get(case, {}).get(key, math.nan))

    adjacent, single_name, no_share_name, shuffled = names[0], names[1], names[2], names[3]
    summary = {
        "rl8x16_unique_tbps": min(value(adjacent, "unique_tbps"), value(shuffled, "unique_tbps")),
        "rl8x16_speedup": min(value(adjacent, "speedup"), value(shuffled, "speedup")),
        "rl8x16_ideal": value(adjacent, "ideal"),
        "rl8x16_unique_tbps_amortized": min(
            value(adjacent, "unique_tbps_amortized"), value(shuffled, "unique_tbps_amortized")
        ),
        "rl8x16_speedup_amortized": min(value(adjacent, "speedup_amortized"), value(shuffled, "speedup_amortized")),
        "rl8x16_dram_bound_speedup": value(adjacent, "dram_bound_speedup"),
        "rl8x16_unique_tbps_kernels_only": min(
            value(adjacent, "unique_tbps_kernels"), value(shuffled, "unique_tbps_kernels")
        ),
        "rl8x16_plan_us": max(value(adjacent, "plan_us"), value(shuffled, "plan_us")),
        "single_group_us": value(single_name, "forest_us"),
        "single_group_us_amortized": value(single_name, "forest_amortized_us"),
        "single_group_kernels_us": value(single_name, "forest_kernels_us"),
        "no_share_slowdown": value(no_share_name, "forest_us") / value(no_share_name, "paged_us") - 1.0,
        "no_share_slowdown_amortized": value(no_share_name, "forest_amortized_us")
        / value(no_share_name, "paged_amortized_us")
        - 1.0,
        "paged_copy_fraction": value(no_share_name, "paged_tbps") / copy_tbps,
        "copy_tbps": copy_tbps,
        "layers_per_step": LAYERS,
        "suffix_sweep_of_ideal": {str(row["suffix"]): row["of_ideal"] for row in results if "suffix" in row},
        "suffix_sweep_of_ideal_amortized": {
            str(row["suffix"]): row["of_ideal_amortized"] for row in results if "suffix" in row
        },
        "correctness_ok": not failed,
        "config": str(config) if config is not None else "library default (default_forest_config by batch size)",
        "paged_config": str(paged_config),
        "seconds": time.time() - started,
    }
    path = write_results(out_dir, "fca_decode", summary, rows)
    plotted = _plot(rows, out_dir / "fca_decode.png")
    print(f"correctness: {len(checks) - len(failed)}/{len(checks)} ok", flush=True)
    for row in failed:
        print("  FAILED", row, flush=True)
    print_table(
        measured,
        [
            "case",
            "forest_us",
            "forest_kernels_us",
            "plan_us",
            "forest_amortized_us",
            "paged_us",
            "paged_kernels_us",
            "unique_tbps",
            "unique_tbps_amortized",
            "speedup",
            "speedup_amortized",
            "ideal",
        ],
    )
    print(
        f"copy {copy_tbps:.2f} TB/s | RL-8x16 {summary['rl8x16_unique_tbps']:.2f} TB/s unique "
        f"({summary['rl8x16_unique_tbps_amortized']:.2f} plan once per step), {summary['rl8x16_speedup']:.2f}x "
        f"({summary['rl8x16_speedup_amortized']:.2f}x; ideal {summary['rl8x16_ideal']:.2f}x, at copy rate "
        f"{summary['rl8x16_dram_bound_speedup']:.2f}x) | plan {summary['rl8x16_plan_us']:.1f} us | single group "
        f"{summary['single_group_us']:.1f} us ({summary['single_group_us_amortized']:.1f}) | no-share "
        f"{summary['no_share_slowdown']:+.1%} ({summary['no_share_slowdown_amortized']:+.1%}) | per-request kernel "
        f"{summary['paged_copy_fraction']:.0%} of copy | correctness {'ok' if not failed else 'FAILED'} | "
        f"{summary['seconds']:.0f} s | wrote {path}{' + png' if plotted else ' (no matplotlib: use --plot-from)'}"
    )


if __name__ == "__main__":
    main()
