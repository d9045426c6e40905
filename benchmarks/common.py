"""Shared benchmark plumbing: run metadata, event timing (median), result files and plots."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).parent / "results"
# Probe outputs and one-off measurements (benchmarks/lab): kept for the record, apart from the headline results.
LAB_RESULTS_DIR = Path(__file__).parent / "lab" / "results"


def default_out_dir() -> Path:
    return Path(os.environ.get("OUT") or RESULTS_DIR)


def default_lab_out_dir() -> Path:
    return Path(os.environ.get("OUT") or LAB_RESULTS_DIR)


def run_metadata() -> dict[str, Any]:
    """Date, commit, device and versions, written next to every number."""
    commit = os.environ.get("ARCTIC_COMMIT")
    if not commit:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, check=False
        )
        commit = result.stdout.strip() if result.returncode == 0 else "unknown"
    versions = {"torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = "not installed"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit, "device": device, "versions": versions}


def cuda_time_ms(fn: Callable[[], Any], *, warmup: int = 5, repeats: int = 30) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs, each timed with CUDA events after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_issue_us(calls: list[Callable[[], Any]], *, rounds: int = 3) -> dict[str, float]:
    """Host microseconds to issue each of ``calls`` eagerly (no graph), and the wall microseconds per call.

    After one warm-up pass, each call is issued on an idle device (synchronised before it) and timed until it
    returns, so a call's own host work is measured, not a full launch queue; median over the calls of ``rounds``
    passes. ``wall_us_per_call`` is the same calls back to back, synchronised once at the end. On a CPU both are
    plain wall time.
    """
    cuda = torch.cuda.is_available()

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    for call in calls:
        call()
    synchronize()
    host: list[float] = []
    for _ in range(rounds):
        for call in calls:
            synchronize()
            began = time.perf_counter()
            call()
            host.append((time.perf_counter() - began) * 1e6)
    synchronize()
    began = time.perf_counter()
    for call in calls:
        call()
    synchronize()
    wall = (time.perf_counter() - began) * 1e6 / len(calls)
    return {"host_issue_us_per_call": statistics.median(host), "wall_us_per_call": wall}


def copy_bandwidth_gbps(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    milliseconds = cuda_time_ms(lambda: dst.copy_(src), warmup=3, repeats=20)
    return 2 * src.numel() * src.element_size() / milliseconds / 1e6


def fill_bandwidth_gbps(num_bytes: int = 2 << 30) -> float:
    """Device write-only rate (``fill_``), counting bytes written."""
    dst = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    milliseconds = cuda_time_ms(lambda: dst.fill_(1.5), warmup=3, repeats=20)
    return dst.numel() * dst.element_size() / milliseconds / 1e6


def write_results(out_dir: Path, name: str, summary: dict[str, Any], rows: list[dict[str, Any]]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"meta": run_metadata(), "summary": summary, "rows": rows}, indent=2) + "\n")
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = [max([len(column), *(len(_cell(row.get(column))) for row in rows)]) for column in columns]
    print("  ".join(column.rjust(width) for column, width in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(_cell(row.get(column)).rjust(width) for column, width in zip(columns, widths, strict=True)))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return "" if value is None else str(value)
