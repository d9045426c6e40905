"""Where a forest decode call's time goes, program by program: a timeline of every launch on the H200.

The diagnoses time whole launches, and Nsight Compute averages over a launch; neither shows when each program
starts, how long it streams and how long the launch waits for its last one. With ``DecodeKnobs(timeline=...)``
every attention and combine program writes its entry time, its start (after waiting for the launch before it),
its end and the multiprocessor it ran on (the device's nanosecond clock). This runs the library's default rule on
the single group, RL-8x16 and the no-sharing batch (the per-request kernel's plan), inside a CUDA graph of 8 calls
over 4 cache copies as ``fca_decode.py`` times them, and reports per launch and per item kind: when programs start
(spread of starts), how long they run (median / max), when the launch's last program ends, and the gaps between
launches; ``fca_timeline.png`` draws each program as a bar on its multiprocessor.

    python benchmarks/fca_timeline.py            (H200, about 30 s; writes fca_timeline.json and .png)
    python benchmarks/fca_timeline.py --smoke    (CPU: the summary and plot on a synthetic timeline)
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_out_dir, print_table, write_results
from fca_decode import H200, Case, _cases, _forest_plan, _graph_time_us, _paged_plan

from arctic_dedup.forest import ForestKernelConfig, ForestPlan
from arctic_dedup.forest._launch import DecodeKnobs, LaunchTimeline, launch_forest_decode
from arctic_dedup.forest.plan import default_forest_config

# (case, variant): the library's default rule everywhere, and beside it the rule before round 17 (the combine waits
# for the whole attention launch; larger batches run their prefix pass on a side stream).
CASES = (
    ("single_group_16x8704", "default"),
    ("single_group_16x8704", "plain_combine"),
    ("rl8x16_adjacent", "default"),
    ("rl8x16_adjacent", "plain_combine_side_stream"),
    ("no_share_128x8704", "default"),
)
# variant -> (changes to the default rule's config, launch knobs)
VARIANTS: dict[str, tuple[dict[str, Any], DecodeKnobs]] = {
    "default": ({}, DecodeKnobs()),
    "plain_combine": ({"early_combine": False}, DecodeKnobs()),
    "plain_combine_side_stream": ({"early_combine": False, "chain_passes": False}, DecodeKnobs()),
    "prefix_waves_4": ({"prefix_waves": 4.0}, DecodeKnobs()),
    "interleaved_items": ({}, DecodeKnobs(interleave_items=True)),
    "chained_w16": ({"waves": 16.0}, DecodeKnobs()),
    "early_s64_c32w4": ({"suffix_block_n": 64, "combine_num_warps": 4, "combine_chunk_cap": 32}, DecodeKnobs()),
}
LAUNCH_ORDER = ("one launch", "prefix pass", "suffix pass", "combine")


def summarize(
    launches: dict[str, list[list[int]]], prefix_items: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per (launch, item kind) statistics in microseconds from the call's first program entry, and the programs
    as (launch, kind, sm, start_us, end_us, entry_us) for the plot. Rows with end < 0 never ran (unused grid)."""
    origin = min(row[0] for rows in launches.values() for row in rows if row[2] >= 0)
    stats: list[dict[str, Any]] = []
    programs: list[dict[str, Any]] = []
    for name in LAUNCH_ORDER:
        rows = [row for row in launches.get(name, []) if row[2] >= 0]
        if not rows:
            continue
        kinds: dict[str, list[list[int]]] = {}
        for row in rows:
            tag = row[4]
            if name == "combine":
                kind = "combine"
            elif tag < 0:
                kind = "no item"
            else:
                kind = "prefix item" if tag < prefix_items else "suffix item"
            kinds.setdefault(kind, []).append(row)
            programs.append(
                {
                    "launch": name,
                    "kind": kind,
                    "sm": row[3],
                    "entry_us": round((row[0] - origin) / 1e3, 3),
                    "start_us": round((row[1] - origin) / 1e3, 3),
                    "end_us": round((row[2] - origin) / 1e3, 3),
                }
            )
        for kind, members in kinds.items():
            starts = [(row[1] - origin) / 1e3 for row in members]
            ends = [(row[2] - origin) / 1e3 for row in members]
            durations = [(row[2] - row[1]) / 1e3 for row in members]
            stats.append(
                {
                    "launch": name,
                    "kind": kind,
                    "programs": len(members),
                    "sms": len({row[3] for row in members}),
                    "first_entry_us": min((row[0] - origin) / 1e3 for row in members),
                    "first_start_us": min(starts),
                    "last_start_us": max(starts),
                    "median_us": statistics.median(durations),
                    "max_us": max(durations),
                    "first_end_us": min(ends),
                    "last_end_us": max(ends),
                }
            )
    return stats, programs


def _lanes(programs: list[dict[str, Any]]) -> list[int]:
    """A lane per program so that programs overlapping in time on one SM get separate rows (greedy)."""
    free_at: dict[tuple[int, int], float] = {}
    lanes = []
    for program in programs:
        lane = 0
        while free_at.get((program["sm"], lane), float("-inf")) > program["start_us"]:
            lane += 1
        free_at[(program["sm"], lane)] = program["end_us"]
        lanes.append(lane)
    return lanes


def plot(cases: dict[str, list[dict[str, Any]]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    colors = {"prefix item": "tab:blue", "suffix item": "tab:orange", "combine": "tab:green", "no item": "0.7"}
    figure, axes = plt.subplots(len(cases), 1, figsize=(12, 4 * len(cases)), squeeze=False)
    for axis, (name, programs) in zip(axes[:, 0], cases.items(), strict=True):
        ordered = sorted(programs, key=lambda program: program["start_us"])
        lanes = _lanes(ordered)
        depth = max(lanes) + 1
        for program, lane in zip(ordered, lanes, strict=True):
            y = program["sm"] + lane / depth
            axis.hlines(y, program["entry_us"], program["start_us"], colors="0.85", linewidth=0.6)
            axis.hlines(y, program["start_us"], program["end_us"], colors=colors[program["kind"]], linewidth=1.2)
        for kind, color in colors.items():
            if any(program["kind"] == kind for program in programs):
                axis.plot([], [], color=color, label=kind)
        axis.plot([], [], color="0.85", label="resident, waiting for the launch before")
        axis.set_title(name, fontsize=9)
        axis.set_xlabel("us from the call's first program")
        axis.set_ylabel("multiprocessor (lanes: programs side by side)")
        axis.legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _synthetic() -> tuple[dict[str, list[list[int]]], int]:
    """Two SMs: a prefix and a suffix program each, then combine programs (for --smoke)."""
    one = [[0, 1000, 20000, 0, 0], [0, 1000, 18000, 0, 2], [0, 1200, 21000, 1, 1], [0, 1200, 17000, 1, 3]]
    one.append([0, 0, -1, -1, -1])  # a grid slot that never ran
    combine = [[15000, 21500, 24000, sm, request] for sm, request in ((0, 0), (1, 1))]
    return {"one launch": one, "combine": combine}, 2


def _config(batch: Any, variant: str) -> ForestKernelConfig:
    sms = torch.cuda.get_device_properties(batch.query.device).multi_processor_count
    rule = default_forest_config(batch.seq_lens.shape[0], batch.key_cache.shape[2], sms)
    return replace(rule, **VARIANTS[variant][0])


def _measure(
    name: str, variant: str, repeats: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    prompts, responses, shuffle = _cases(H200, False)[name]
    case = Case(name, prompts, responses, shuffle, H200)
    grouped = not name.startswith("no_share")
    plans: list[ForestPlan] = [
        _forest_plan(batch, H200, _config(batch, variant), workspace) if grouped else _paged_plan(batch, None)
        for batch, workspace in zip(case.batches, case.workspaces, strict=True)
    ]
    timelines = [LaunchTimeline() for _ in case.batches]
    outs = [torch.empty_like(batch.query) for batch in case.batches]
    lses = [torch.empty(batch.query.shape[:2], device="cuda") for batch in case.batches]
    scale = H200.head_dim**-0.5

    def call(index: int, timed: bool) -> None:
        batch = case.batches[index]
        knobs = replace(VARIANTS[variant][1], timeline=timelines[index] if timed else None)
        launch_forest_decode(
            batch.query, batch.key_cache, batch.value_cache, plans[index], scale, outs[index], lses[index], knobs
        )

    copies = range(len(case.batches))
    plain_us = _graph_time_us([partial(call, i, False) for i in copies] * (8 // len(case.batches)), repeats, "cuda")
    timed_us = _graph_time_us([partial(call, i, True) for i in copies] * (8 // len(case.batches)), repeats, "cuda")
    torch.cuda.synchronize()
    # The last copy's call of the last replay: its buffers hold that call's programs.
    last = len(case.batches) - 1
    launches = {key: value.tolist() for key, value in timelines[last].launches.items()}
    prefix_items = int(plans[last].work_start[plans[last].num_requests])
    stats, programs = summarize(launches, prefix_items)
    for row in stats:
        row["case"] = name
        row["variant"] = variant
    meta = {
        "case": name,
        "variant": variant,
        "call_us_graph": plain_us,
        "call_us_graph_with_timeline": timed_us,
        "copies": len(copies),
    }
    meta["programs"] = programs
    case.free()
    return stats, programs, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: $OUT or benchmarks/results)")
    parser.add_argument("--smoke", action="store_true", help="CPU: summary and plot of a synthetic timeline")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    started = time.time()
    out_dir = args.out or default_out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    drawn: dict[str, list[dict[str, Any]]] = {}
    calls: list[dict[str, Any]] = []
    program_rows: list[dict[str, Any]] = []
    if args.smoke:
        launches, prefix_items = _synthetic()
        stats, programs = summarize(launches, prefix_items)
        rows += [{"case": "synthetic", "variant": "default", **row} for row in stats]
        drawn["synthetic"] = programs
    else:
        if not torch.cuda.is_available():
            sys.exit("fca_timeline needs a CUDA GPU (or --smoke)")
        for name, variant in CASES:
            stats, programs, meta = _measure(name, variant, args.repeats)
            rows += stats
            program_rows += [{"case": name, "variant": variant, **program} for program in meta.pop("programs")]
            calls.append(meta)
            drawn[f"{name}, {variant}: {meta['call_us_graph']:.1f} us per call in a graph"] = programs
            print(meta, flush=True)
    columns = ["case", "variant", "launch", "kind", "programs", "sms", "first_start_us", "last_start_us", "median_us"]
    print_table(rows, [*columns, "max_us", "first_end_us", "last_end_us"])
    plotted = plot(drawn, out_dir / "fca_timeline.png")
    summary = {"seconds": time.time() - started, "calls": calls, "plotted": plotted}
    path = write_results(out_dir, "fca_timeline", summary, rows)
    if program_rows:
        # Every program (times in us from its call's first program entry), for analyses the summary does not make.
        with (out_dir / "fca_timeline_programs.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(program_rows[0]))
            writer.writeheader()
            writer.writerows(program_rows)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
