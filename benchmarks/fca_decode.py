"""Forest cascade decode on the GPU: correctness in bf16, then speed against the per-request paged decode kernel.

Bytes counted per layer (performance.md): b = 2 * H_kv * d * 2 bytes per KV token (bf16 K and V). Forest decode's
useful bytes are the unique tokens (each group's prefix once, each request's own tokens once); the per-request
kernel's are every request's whole context. Ideal speedup = total tokens / unique tokens.

Timing: every op (plan built on the device + kernels) is captured in a CUDA graph that cycles over enough copies of
the batch to exceed the L2 cache; replays are timed with events after warm-up; the median per call is reported.

Run on the H200:  python benchmarks/fca_decode.py            (about 2-3 minutes; --quick: about 1 minute)
Plot elsewhere:   python benchmarks/fca_decode.py --plot-from benchmarks/results/fca_decode.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
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
    forest_decode,
    plan_forest,
    plan_paged,
    reference_paged_attention,
)
from arctic_dedup.forest.testing import DecodeBatch, make_decode_batch

HEADS_Q, HEADS_KV, HEAD_DIM, BLOCK = 32, 8, 128, 16
L2_BYTES = 50 * 2**20
PREFIX_CANDIDATES = [(64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3)]
SUFFIX_CANDIDATES = [(64, 4, 2), (32, 4, 3), (128, 4, 2), (64, 4, 4), (128, 8, 3), (32, 4, 4)]
WAVES = [1.0, 2.0, 4.0]


def _bytes_per_token() -> int:
    return 2 * HEADS_KV * HEAD_DIM * 2


# ---------------------------------------------------------------- correctness


def _check_correctness(quick: bool) -> list[dict[str, Any]]:
    combos = [((16, 32, 64)[i], (1, 4, 8)[j], (64, 128, 256)[(i + j) % 3]) for i in range(3) for j in range(3)]
    if quick:
        combos = combos[::4]
    rows = []
    for index, (block_size, queries_per_kv, head_dim) in enumerate(combos):
        rng = random.Random(index)
        max_query = 1 + index % 4
        root = index % 2
        prefix_lens = [rng.randint(root * block_size + 1, 900) for _ in range(rng.randint(1, 5))]
        suffix_lens = [[rng.choice([0, rng.randint(1, 400)]) for _ in range(rng.randint(1, 10))] for _ in prefix_lens]
        query_lens = [[rng.randint(1, max_query) for _ in group] for group in suffix_lens]
        batch = make_decode_batch(
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
            seed=index,
        )
        scale = head_dim**-0.5
        ref_out, ref_lse = reference_paged_attention(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.block_table,
            batch.seq_lens,
            batch.query_start_loc,
            scale,
        )
        for name in ("forest", "paged"):
            plan = _plan(batch, name, ForestKernelConfig(split_granularity=64), queries_per_kv, 2)
            out = torch.full_like(batch.query, float("nan"))
            lse = torch.full(batch.query.shape[:2], float("nan"), device="cuda")
            forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, scale, out=out, lse=lse)
            torch.cuda.synchronize()
            error = ((out.float().cpu() - ref_out).norm() / ref_out.norm()).item()
            lse_error = (lse.cpu() - ref_lse).abs().max().item()
            ok = error < 1.5e-2 and lse_error < 5e-2 and not torch.isnan(out).any().item()
            rows.append(
                {
                    "check": name,
                    "block_size": block_size,
                    "gqa": queries_per_kv,
                    "head_dim": head_dim,
                    "max_query_len": batch.max_query_len,
                    "groups": int(plan.num_groups.item()),
                    "rel_error": error,
                    "lse_max_error": lse_error,
                    "ok": ok,
                }
            )
    return rows


# ---------------------------------------------------------------- timing


def _plan(batch: DecodeBatch, mode: str, config: ForestKernelConfig, queries_per_kv: int, num_kv_heads: int):
    if mode == "paged":
        return plan_paged(
            batch.block_table,
            batch.seq_lens,
            batch.query_start_loc,
            block_size=batch.key_cache.shape[1],
            max_query_len=batch.max_query_len,
            queries_per_kv=queries_per_kv,
            num_kv_heads=num_kv_heads,
            config=config,
        )
    return plan_forest(
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        block_size=batch.key_cache.shape[1],
        num_cache_blocks=batch.key_cache.shape[0],
        max_query_len=batch.max_query_len,
        queries_per_kv=queries_per_kv,
        num_kv_heads=num_kv_heads,
        config=config,
    )


def _graph_time_us(calls: list[Callable[[], Any]], repeats: int) -> float:
    """Median microseconds per call of a CUDA graph that runs every call once, in order."""
    for call in calls:
        call()
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

    def __init__(self, name: str, prefix_lens: list[int], suffix_lens: list[list[int]], shuffle: bool) -> None:
        self.name = name
        first = self._make(prefix_lens, suffix_lens, shuffle, 0)
        copies = max(1, min(4, math.ceil(4 * L2_BYTES / (first.unique_tokens * _bytes_per_token()))))
        self.batches = [first] + [self._make(prefix_lens, suffix_lens, shuffle, i) for i in range(1, copies)]
        self.unique_bytes = first.unique_tokens * _bytes_per_token()
        self.total_bytes = first.total_tokens * _bytes_per_token()
        self.requests = first.seq_lens.shape[0]

    @staticmethod
    def _make(prefix_lens: list[int], suffix_lens: list[list[int]], shuffle: bool, seed: int) -> DecodeBatch:
        return make_decode_batch(
            prefix_lens,
            suffix_lens,
            block_size=BLOCK,
            num_kv_heads=HEADS_KV,
            queries_per_kv=HEADS_Q // HEADS_KV,
            head_dim=HEAD_DIM,
            dtype=torch.bfloat16,
            device="cuda",
            shuffle=shuffle,
            seed=seed,
            spare_blocks=0,
        )

    def time(self, mode: str, config: ForestKernelConfig, repeats: int, plan_inside: bool = True) -> float:
        scale = HEAD_DIM**-0.5
        calls: list[Callable[[], Any]] = []
        for batch in self.batches:
            out = torch.empty_like(batch.query)
            lse = torch.empty(batch.query.shape[:2], device=batch.query.device)
            fixed = None if plan_inside else _plan(batch, mode, config, HEADS_Q // HEADS_KV, HEADS_KV)

            def call(batch: DecodeBatch = batch, out: torch.Tensor = out, lse: torch.Tensor = lse, fixed=fixed) -> None:
                if mode == "plan":
                    _plan(batch, "forest", config, HEADS_Q // HEADS_KV, HEADS_KV)
                    return
                plan = fixed if fixed is not None else _plan(batch, mode, config, HEADS_Q // HEADS_KV, HEADS_KV)
                forest_decode(batch.query, batch.key_cache, batch.value_cache, plan, scale, out=out, lse=lse)

            calls.append(call)
        return _graph_time_us(calls, repeats)

    def free(self) -> None:
        self.batches.clear()
        torch.cuda.empty_cache()


def _config(
    base: ForestKernelConfig,
    prefix: tuple[int, ...] | None = None,
    suffix: tuple[int, ...] | None = None,
    waves: float | None = None,
) -> ForestKernelConfig:
    config = base
    if prefix is not None:
        config = replace(
            config,
            prefix_block_m=prefix[0],
            prefix_block_n=prefix[1],
            prefix_num_warps=prefix[2],
            prefix_num_stages=prefix[3],
        )
    if suffix is not None:
        config = replace(config, suffix_block_n=suffix[0], suffix_num_warps=suffix[1], suffix_num_stages=suffix[2])
    if waves is not None:
        config = replace(config, waves=waves)
    return config


def _safe_time(case: Case, mode: str, config: ForestKernelConfig, repeats: int) -> float:
    try:
        return case.time(mode, config, repeats)
    except Exception as error:  # a candidate that does not fit the chip (shared memory, registers) is skipped
        print(f"  skip {mode} {config}: {type(error).__name__}: {str(error)[:200]}", flush=True)
        return math.inf


def _tune(rl: Case, single: Case, no_share: Case, repeats: int, rows: list[dict[str, Any]]) -> ForestKernelConfig:
    base = ForestKernelConfig()
    best_suffix, best_suffix_us = (base.suffix_block_n, base.suffix_num_warps, base.suffix_num_stages), math.inf
    for suffix in SUFFIX_CANDIDATES:
        for waves in (2.0, 4.0):
            us = _safe_time(no_share, "paged", _config(base, suffix=suffix, waves=waves), repeats)
            rows.append({"tune": "suffix/paged on no_share", "config": f"{suffix} waves={waves}", "us": us})
            if us < best_suffix_us:
                best_suffix, best_suffix_us = suffix, us
    base = _config(base, suffix=best_suffix)
    best, best_score = base, math.inf
    for prefix in PREFIX_CANDIDATES:
        for waves in WAVES:
            config = _config(base, prefix=prefix, waves=waves)
            rl_us = _safe_time(rl, "forest", config, repeats)
            single_us = _safe_time(single, "forest", config, repeats)
            score = math.sqrt(rl_us * single_us)
            rows.append(
                {
                    "tune": "prefix/forest",
                    "config": f"{prefix} waves={waves}",
                    "rl8x16_us": rl_us,
                    "single_group_us": single_us,
                }
            )
            if score < best_score:
                best, best_score = config, score
    print(f"tuned config: {best}", flush=True)
    return best


def _measure(case: Case, config: ForestKernelConfig, paged_config: ForestKernelConfig, repeats: int) -> dict[str, Any]:
    forest_us = case.time("forest", config, repeats)
    kernels_us = case.time("forest", config, repeats, plan_inside=False)
    plan_us = case.time("plan", config, repeats)
    paged_us = case.time("paged", paged_config, repeats)
    ideal = case.total_bytes / case.unique_bytes
    return {
        "case": case.name,
        "requests": case.requests,
        "copies": len(case.batches),
        "unique_MB": case.unique_bytes / 1e6,
        "forest_us": forest_us,
        "forest_kernels_us": kernels_us,
        "plan_us": plan_us,
        "paged_us": paged_us,
        "unique_tbps": case.unique_bytes / forest_us / 1e6,
        "unique_tbps_kernels": case.unique_bytes / kernels_us / 1e6,
        "paged_tbps": case.total_bytes / paged_us / 1e6,
        "speedup": paged_us / forest_us,
        "ideal": ideal,
        "of_ideal": paged_us / forest_us / ideal,
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
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    suffixes = [row["suffix"] for row in sweep]
    left.plot(suffixes, [row["ideal"] for row in sweep], "k--o", label="ideal R(P+S)/(P+RS)")
    left.plot(suffixes, [0.85 * row["ideal"] for row in sweep], ":", color="gray", label="85% of ideal (goal)")
    left.plot(suffixes, [row["speedup"] for row in sweep], "b-o", label="forest decode (incl. grouping)")
    left.set_xscale("symlog", linthresh=512)
    left.set_xlabel("response length S (P=8192, 8 groups x 16)")
    left.set_ylabel("speedup over per-request paged decode")
    left.legend(fontsize=7)
    right.plot(suffixes, [row["unique_tbps"] for row in sweep], "b-o", label="forest decode, unique bytes")
    right.plot(suffixes, [row["paged_tbps"] for row in sweep], "r-o", label="per-request kernel, its bytes")
    right.axhline(3.8, color="gray", linestyle=":", label="3.8 TB/s goal")
    right.set_xscale("symlog", linthresh=512)
    right.set_xlabel("response length S")
    right.set_ylabel("TB/s")
    right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: $OUT or benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="fewer checks, no tuning sweep, fewer repeats")
    parser.add_argument("--plot-from", type=Path, default=None, help="only draw the PNG from an existing JSON")
    args = parser.parse_args()
    out_dir = args.out or default_out_dir()
    if args.plot_from is not None:
        rows = json.loads(args.plot_from.read_text())["rows"]
        target = args.plot_from.with_suffix(".png")
        print(f"wrote {target}" if _plot(rows, target) else "matplotlib missing or no sweep rows")
        return
    if not torch.cuda.is_available():
        sys.exit("fca_decode needs a CUDA GPU; the CPU tests cover correctness (pytest packages/arctic-dedup/tests).")
    started = time.time()
    repeats = 10 if args.quick else 25

    checks = _check_correctness(args.quick)
    failed = [row for row in checks if not row["ok"]]
    print(f"correctness: {len(checks) - len(failed)}/{len(checks)} ok ({time.time() - started:.0f} s)", flush=True)
    for row in failed:
        print("  FAILED", row, flush=True)

    copy_tbps = copy_bandwidth_gbps() / 1000.0
    rows: list[dict[str, Any]] = [*checks]
    rl = Case("rl8x16_adjacent", [8192] * 8, [[512] * 16] * 8, shuffle=False)
    single = Case("single_group_16x8704", [8192], [[512] * 16], shuffle=False)
    no_share = Case("no_share_128x8704", [8703] * 128, [[0]] * 128, shuffle=False)
    if args.quick:
        config = ForestKernelConfig()
    else:
        config = _tune(rl, single, no_share, max(5, repeats // 3), rows)
        print(f"tuning done ({time.time() - started:.0f} s)", flush=True)
    paged_config = config

    results = [_measure(rl, config, paged_config, repeats)]
    results.append(_measure(single, config, paged_config, repeats))
    single.free()
    no_share_row = _measure(no_share, config, paged_config, repeats)
    no_share.free()
    results.append(no_share_row)
    shuffled = Case("rl8x16_shuffled", [8192] * 8, [[512] * 16] * 8, shuffle=True)
    results.append(_measure(shuffled, config, paged_config, repeats))
    shuffled.free()
    for suffix in (0, 512, 2048, 8192):
        if suffix == 512:
            row = dict(results[0])
        else:
            case = Case(f"suffix_{suffix}", [8192] * 8, [[suffix] * 16] * 8, shuffle=False)
            row = _measure(case, config, paged_config, repeats)
            case.free()
        row["case"], row["suffix"] = f"suffix_{suffix}", suffix
        results.append(row)
    rl.free()
    rows.extend(results)

    by_case = {row["case"]: row for row in results}
    summary = {
        "rl8x16_unique_tbps": min(by_case["rl8x16_adjacent"]["unique_tbps"], by_case["rl8x16_shuffled"]["unique_tbps"]),
        "rl8x16_speedup": min(by_case["rl8x16_adjacent"]["speedup"], by_case["rl8x16_shuffled"]["speedup"]),
        "rl8x16_ideal": by_case["rl8x16_adjacent"]["ideal"],
        "rl8x16_unique_tbps_kernels_only": by_case["rl8x16_adjacent"]["unique_tbps_kernels"],
        "single_group_us": by_case["single_group_16x8704"]["forest_us"],
        "single_group_kernels_us": by_case["single_group_16x8704"]["forest_kernels_us"],
        "no_share_slowdown": no_share_row["forest_us"] / no_share_row["paged_us"] - 1.0,
        "paged_copy_fraction": no_share_row["paged_tbps"] / copy_tbps,
        "copy_tbps": copy_tbps,
        "suffix_sweep_of_ideal": {str(row["suffix"]): row["of_ideal"] for row in results if "suffix" in row},
        "correctness_ok": not failed,
        "config": str(config),
        "seconds": time.time() - started,
    }
    path = write_results(out_dir, "fca_decode", summary, rows)
    plotted = _plot(rows, out_dir / "fca_decode.png")
    print_table(
        results,
        [
            "case",
            "forest_us",
            "forest_kernels_us",
            "plan_us",
            "paged_us",
            "unique_tbps",
            "paged_tbps",
            "speedup",
            "ideal",
        ],
    )
    print(
        f"copy {copy_tbps:.2f} TB/s | RL-8x16 {summary['rl8x16_unique_tbps']:.2f} TB/s unique, "
        f"{summary['rl8x16_speedup']:.2f}x (ideal {summary['rl8x16_ideal']:.2f}x) | single group "
        f"{summary['single_group_us']:.1f} us | no-share {summary['no_share_slowdown']:+.1%} | per-request kernel "
        f"{summary['paged_copy_fraction']:.0%} of copy | correctness {'ok' if not failed else 'FAILED'} | "
        f"{summary['seconds']:.0f} s | wrote {path}{' + png' if plotted else ' (no matplotlib: use --plot-from)'}"
    )


if __name__ == "__main__":
    main()
