"""The forest decode passes of RL-8x16 alone, for Nsight Compute: is the prefix pass latency- or pattern-bound?

Runs, after one warm-up round, ``--rounds`` rounds of: the prefix pass (``passes=(1,)``), the suffix pass
(``passes=(2,)``) and the per-request kernel over the same batch (8 groups x 16 requests, P=8192, S=512, 32 q / 8
kv heads, d=128, bf16, block 16), each synchronized, so a profiler sees them in that order. On the H200
(scripts/gpu_round.sh stage ``fca-ncu``):

    ncu --clock-control none -k regex:forest_attention_kernel --launch-skip 3 --launch-count 3 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        python benchmarks/fca_ncu.py

``--plans``: instead, the planner's three launches for RL-8x16 and for one group of 16 (the default rule's configs),
for ``ncu -k regex:plan_`` (each kernel's duration against the plan's time inside a CUDA graph, where the launch
gaps count too).

Without a profiler it prints each pass's bytes and the time of one synchronized call (launch overhead included:
for kernel times use Nsight Compute or ``fca_decode.py``, which replays CUDA graphs).
``--smoke``: tiny shapes through Triton's interpreter on CPU (checks the code path only).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    # The interpreter must be chosen before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from fca_decode import H200, SMOKE, Case, Shape, _forest_plan, _paged_plan, pass_bytes

from arctic_dedup.forest import ForestKernelConfig, forest_decode
from arctic_dedup.forest._launch import allocate_partials, launch_attention


def _timed(run: Callable[[], object], device: str) -> float:
    """Microseconds of one synchronized call (CUDA events on the GPU; 0 on CPU, where nothing is timed)."""
    if device != "cuda":
        run()
        return 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through the Triton interpreter")
    parser.add_argument("--plans", action="store_true", help="profile the planner's launches instead of the passes")
    parser.add_argument(
        "--single-group",
        action="store_true",
        help="one group of 16 x (8192 + 512) instead of RL-8x16: its one attention launch (the default rule's), "
        "then the per-request kernel",
    )
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("fca_ncu.py needs a CUDA GPU (or --smoke)")
    shape = SMOKE if args.smoke else H200
    if args.plans:
        _plans(shape, args.rounds, args.smoke)
        return
    prompt, groups, samples, response = (64, 2, 3, 16) if args.smoke else (8192, 8, 16, 512)
    if args.single_group:
        groups = 1
    case = Case("rl8x16", [prompt] * groups, [[response] * samples] * groups, False, shape, copies=1)
    batch, workspace = case.batches[0], case.workspaces[0]
    scale = shape.head_dim**-0.5
    # plan_forest's own rule picks the tiles (config None), as forest_decode's users get them
    forest = _forest_plan(batch, shape, None, workspace)
    print(f"forest plan config: {forest.config}", flush=True)
    paged = _paged_plan(batch, ForestKernelConfig())
    partials = allocate_partials(forest, batch.query.shape[2], batch.query.device)
    out = torch.empty_like(batch.query)
    lse = torch.empty(batch.query.shape[:2], device=batch.query.device)
    prefix_bytes, suffix_bytes = pass_bytes(forest, shape)
    total_bytes = int(batch.seq_lens.sum()) * shape.bytes_per_token

    def attention(passes: tuple[int, ...]) -> Callable[[], object]:
        return lambda: launch_attention(
            batch.query, batch.key_cache, batch.value_cache, forest, scale, out, lse, partials, passes=passes
        )

    def per_request() -> object:
        return forest_decode(batch.query, batch.key_cache, batch.value_cache, paged, scale, out=out, lse=lse)

    runs = {"prefix pass": attention((1,)), "suffix pass": attention((2,)), "per-request kernel": per_request}
    if args.single_group:
        runs = {"attention (one launch)": attention((0,)), "per-request kernel": per_request}
    for run in runs.values():  # warm-up: compiles every kernel before the profiled launches
        _timed(run, shape.device)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name].append(_timed(run, shape.device))
    measured = {"prefix pass": prefix_bytes, "suffix pass": suffix_bytes, "per-request kernel": total_bytes}
    measured["attention (one launch)"] = prefix_bytes + suffix_bytes
    for name, num_bytes in ((name, measured[name]) for name in runs):
        us = statistics.median(times[name])
        # One synchronized call from Python: the launch overhead is inside (on the H200 the prefix pass read 215 us
        # here against 75 us of kernel in Nsight Compute), so this is no bandwidth figure; fca_decode.py times graphs.
        print(f"{name}: {num_bytes / 1e6:.0f} MB, {us:.1f} us per synchronized call (launch overhead included)")


def _plans(shape: Shape, rounds: int, smoke: bool) -> None:
    """Plan RL-8x16 and the single group (each with its default-rule config), synchronized, ``rounds`` times."""
    prompt, groups, samples, response = (64, 2, 3, 16) if smoke else (8192, 8, 16, 512)
    for label, group_count in (("rl8x16", groups), ("single group", 1)):
        case = Case(label, [prompt] * group_count, [[response] * samples] * group_count, False, shape, copies=1)
        batch = case.batches[0]
        run = partial(_forest_plan, batch, shape, None, case.workspaces[0])
        times = [_timed(run, shape.device) for _ in range(rounds + 1)]
        plan = _forest_plan(batch, shape, None, case.workspaces[0])
        print(
            f"{label}: {batch.seq_lens.shape[0]} requests, {int(plan.num_groups[0])} groups, config {plan.config}; "
            f"{statistics.median(times[1:]):.1f} us per synchronized plan (launch overhead included)",
            flush=True,
        )


if __name__ == "__main__":
    main()
