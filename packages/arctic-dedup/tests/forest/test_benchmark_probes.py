"""The forest decode probes in ``benchmarks/`` run their CPU dry runs (Triton interpreter) and check themselves
against torch, so a probe whose numbers are committed keeps computing what it claims to time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[4] / "benchmarks"


def _smoke(script: str, out: Path) -> dict[str, Any]:
    """Run ``benchmarks/<script> --smoke`` under the Triton interpreter; returns the results file it wrote."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result: dict[str, Any] = json.loads((out / script.replace(".py", ".json")).read_text())
    return result


@pytest.mark.skipif(not (BENCHMARKS / "fca_loop_probe.py").exists(), reason="needs the repository's benchmarks/")
def test_loop_probe_smoke_matches_torch(tmp_path: Path) -> None:
    result = _smoke("fca_loop_probe.py", tmp_path)
    rows = result["rows"]
    # Every id source on every smoke shape, each within fp32 rounding of plain torch attention.
    assert {row["ids"] for row in rows} == {"table_ahead", "table_chunk", "hashed", "contiguous"}
    assert len(rows) == 8
    assert all(row["max_abs_error"] < 1e-4 for row in rows), rows
    assert result["summary"]["ok"]


@pytest.mark.skipif(not (BENCHMARKS / "fca_flat_probe.py").exists(), reason="needs the repository's benchmarks/")
def test_flat_probe_smoke_merges_to_torch(tmp_path: Path) -> None:
    rows = _smoke("fca_flat_probe.py", tmp_path)["rows"]
    # The per-item launch and flat grids that split owners across programs (uneven runs included), each merged
    # back to plain torch attention within fp32 rounding.
    flat = [row for row in rows if row["form"].startswith("flat")]
    assert (
        len(flat) == 12
        and {row["form"] for row in flat} == {"flat, masked", "flat, branch"}
        and {row["programs"] for row in flat} >= {1, 5, 7, 16}
    )
    assert all(row["max_abs_error"] < 1e-4 for row in rows), rows


@pytest.mark.skipif(not (BENCHMARKS / "fca_timeline.py").exists(), reason="needs the repository's benchmarks/")
def test_timeline_summary_of_a_synthetic_timeline(tmp_path: Path) -> None:
    rows = {row["kind"]: row for row in _smoke("fca_timeline.py", tmp_path)["rows"]}
    # Times from the first entry; the grid slot that never ran is left out; tags split prefix from suffix items.
    assert set(rows) == {"prefix item", "suffix item", "combine"}
    assert rows["prefix item"]["median_us"] == pytest.approx(19.4) and rows["prefix item"]["last_end_us"] == 21.0
    assert rows["suffix item"]["programs"] == 2 and rows["suffix item"]["max_us"] == pytest.approx(17.0)
    assert rows["combine"]["first_start_us"] == pytest.approx(21.5) and rows["combine"]["first_entry_us"] == 15.0


@pytest.mark.skipif(not (BENCHMARKS / "fca_bounds.py").exists(), reason="needs the repository's benchmarks/")
def test_goal_bounds_from_the_committed_main_benchmark(tmp_path: Path) -> None:
    # The bounds are derived, not timed: recompute them from the committed fca_decode.json and check the reading
    # the README and the notes give (best read rate, which goals are beyond it, which are met).
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "fca_bounds.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "fca_bounds.json").read_text())
    source = json.loads((BENCHMARKS / "results" / "fca_decode.json").read_text())
    no_share = next(row for row in source["rows"] if row.get("case") == "no_share_128x8704")
    fastest_us = min(no_share[key] for key in ("paged_us", "paged_kernels_us", "forest_kernels_us"))
    assert result["summary"]["best_read_tbps"] == pytest.approx(no_share["unique_MB"] / fastest_us)
    for row in result["rows"]:
        # A verdict of "met" is exactly a measured time within the goal's.
        assert (row["verdict"] == "met") == (row["measured_us"] <= row["goal_us"]), row
        assert row["of_best_read_rate_plan_every_call"] >= row["of_best_read_rate_plan_once_per_step"]
    suffix_512 = next(row for row in result["rows"] if row["case"] == "suffix_512")
    assert suffix_512["bound_of_ideal"] < 0.85 and suffix_512["verdict"] == "beyond the best read rate"
    seven = next(row for row in result["rows"] if row["case"] == "rl8x16_adjacent" and "7x" in row["goal"])
    assert 7.0 < seven["bound_speedup"] < 7.5
