"""Checks of the benchmark scripts themselves (``nox -s bench_checks``), kept out of the package test suites.

Every script still imports against the library (``--help`` imports it), the lab probes' CPU dry runs check their
kernels against torch under the Triton interpreter, and the committed headline files hold what the README cites.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1]
RESULTS = BENCHMARKS / "results"
LAB = BENCHMARKS / "lab"
# Modules the scripts import (fca_vllm_worker.py is loaded by vLLM's engine process), not scripts themselves.
HELPERS = {"common.py", "fca_vllm_worker.py"}
SCRIPTS = sorted(path for path in [*BENCHMARKS.glob("*.py"), *LAB.glob("*.py")] if path.name not in HELPERS)
# The headline benchmarks: each keeps its latest result (JSON + PNG) under results/.
HEADLINE = ["pack_unpack", "tree_attention", "zorro_train", "fca_decode", "fca_bounds", "fused_kernels"]


def _run(script: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        timeout=timeout,
    )


def _smoke(script: Path, out: Path) -> dict[str, Any]:
    """Run ``<script> --smoke`` under the Triton interpreter; returns the results file it wrote."""
    done = _run(script, "--smoke", "--out", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result: dict[str, Any] = json.loads((out / script.name.replace(".py", ".json")).read_text())
    return result


# Runs every script's ``--help`` in one interpreter (one torch import instead of one per script): argparse prints
# the usage after the module-level imports, so a script using a name the packages no longer have fails here.
USAGE_OF_EVERY_SCRIPT = """
import json, runpy, sys
outcome = {}
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
        outcome[script] = "no exit"
    except SystemExit as done:
        outcome[script] = "ok" if done.code in (0, None) else f"exit {done.code}"
    except Exception as error:
        outcome[script] = f"{type(error).__name__}: {error}"
print(json.dumps(outcome))
"""


def test_every_script_imports_and_prints_its_usage() -> None:
    done = subprocess.run(
        [sys.executable, "-c", USAGE_OF_EVERY_SCRIPT, *map(str, SCRIPTS)],
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome == {str(script): "ok" for script in SCRIPTS}, outcome
    assert len(SCRIPTS) >= 10 and done.stdout.count("usage:") == len(SCRIPTS)


def test_harness_lists_only_scripts_that_exist() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import run
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert [benchmark.name for benchmark in run.BENCHMARKS] == [
        "pack_unpack",
        "tree_attention",
        "fca_decode",
        "zorro_train",
        "fused_kernels",
    ]
    assert all((BENCHMARKS / benchmark.script).exists() for benchmark in run.BENCHMARKS)


@pytest.mark.parametrize("name", HEADLINE)
def test_each_headline_benchmark_keeps_its_latest_result(name: str) -> None:
    result = json.loads((RESULTS / f"{name}.json").read_text())
    assert set(result) >= {"meta", "summary", "rows"}, sorted(result)
    # fca_bounds is derived from fca_decode.json (no device of its own); every timed result names its device.
    needed = {"date", "commit"} if "derived_from" in result["meta"] else {"date", "commit", "device"}
    assert needed <= set(result["meta"]), result["meta"]
    assert (RESULTS / f"{name}.png").exists()


def test_results_folder_holds_only_latest_results_and_notes() -> None:
    # results/ keeps each benchmark's latest JSON (+ PNG) and its notes; probe outputs, logs and one-off
    # measurements belong in lab/results/.
    assert all(path.is_file() for path in RESULTS.iterdir()), "results/ holds no A/B or Nsight folders"
    # The benchmark scripts' results, plus what nox's gpu_tests and the recipes (main job on the CPU and on a GPU, ZoRRO
    # alone) record.
    benchmarks = {path.stem for path in BENCHMARKS.glob("*.py")} | {
        "gpu_tests",
        "rl_step",
        "main_job_gpu",
        "zorro_tiny_cpu",
    }
    strays = [
        path.name
        for path in RESULTS.iterdir()
        if not (
            path.name.endswith("_notes.md") or (path.suffix in (".json", ".png", ".txt") and path.stem in benchmarks)
        )
    ]
    assert not strays, f"move these to benchmarks/lab/results/: {strays}"


def test_rl_engine_smoke_times_both_runs(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    pytest.importorskip("arctic_rl")
    summary = _smoke(BENCHMARKS / "rl_engine.py", tmp_path)["summary"]
    assert summary["seconds_on"] > 0 and summary["seconds_off"] > 0
    assert summary["engine_zorro_efficiency"] == pytest.approx(summary["engine_speedup"] / summary["flop_bound"])


@pytest.mark.slow
def test_loop_probe_smoke_matches_torch(tmp_path: Path) -> None:
    result = _smoke(LAB / "fca_loop_probe.py", tmp_path)
    rows = result["rows"]
    # Every id source on every smoke shape, each within fp32 rounding of plain torch attention.
    assert {row["ids"] for row in rows} == {"table_ahead", "table_chunk", "hashed", "contiguous"}
    assert len(rows) == 8
    assert all(row["max_abs_error"] < 1e-4 for row in rows), rows
    assert result["summary"]["ok"]


@pytest.mark.slow
def test_flat_probe_smoke_merges_to_torch(tmp_path: Path) -> None:
    rows = _smoke(LAB / "fca_flat_probe.py", tmp_path)["rows"]
    # The per-item launch and flat grids that split owners across programs (uneven runs included), each merged
    # back to plain torch attention within fp32 rounding.
    flat = [row for row in rows if row["form"].startswith("flat")]
    assert (
        len(flat) == 12
        and {row["form"] for row in flat} == {"flat, masked", "flat, branch"}
        and {row["programs"] for row in flat} >= {1, 5, 7, 16}
    )
    assert all(row["max_abs_error"] < 1e-4 for row in rows), rows


def test_goal_bounds_from_the_committed_main_benchmark(tmp_path: Path) -> None:
    # The bounds are derived, not timed: recompute them from the committed fca_decode.json and check the reading
    # the README and the notes give (best read rate, which goals are beyond it, which are met).
    done = _run(BENCHMARKS / "fca_bounds.py", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "fca_bounds.json").read_text())
    source = json.loads((RESULTS / "fca_decode.json").read_text())
    no_share = next(row for row in source["rows"] if row.get("case") == "no_share_128x8704")
    fastest_us = min(no_share[key] for key in ("paged_us", "paged_kernels_us", "forest_kernels_us"))
    assert result["summary"]["best_read_tbps"] == pytest.approx(no_share["unique_MB"] / fastest_us)
    # The kernel goal's key (>= 0.90 of the read-rate bound at RL-8x16, plan once per step) against the same bound.
    rl_rates = [row["unique_tbps_amortized"] for row in source["rows"] if row.get("case", "").startswith("rl8x16_")]
    assert len(rl_rates) == 2 and source["summary"]["best_read_tbps"] == pytest.approx(
        result["summary"]["best_read_tbps"]
    )
    assert source["summary"]["rl8x16_bound_fraction"] == pytest.approx(
        min(rl_rates) / result["summary"]["best_read_tbps"]
    )
    for row in result["rows"]:
        # A verdict of "met" is exactly a measured time within the goal's.
        assert (row["verdict"] == "met") == (row["measured_us"] <= row["goal_us"]), row
        assert row["of_best_read_rate_plan_every_call"] >= row["of_best_read_rate_plan_once_per_step"]
    suffix_512 = next(row for row in result["rows"] if row["case"] == "suffix_512")
    assert suffix_512["bound_of_ideal"] < 0.85 and suffix_512["verdict"] == "beyond the best read rate"
    seven = next(row for row in result["rows"] if row["case"] == "rl8x16_adjacent" and "7x" in row["goal"])
    assert 7.0 < seven["bound_speedup"] < 7.5


def test_every_results_and_docs_link_of_the_readmes_exists() -> None:
    # A README row must stay backed by a kept file (deleted results live only in git history).
    root = BENCHMARKS.parent
    readmes = [root / "README.md", *sorted(root.glob("packages/*/README.md")), *sorted(root.glob("docs/*.md"))]
    missing, checked = [], 0
    for readme in readmes:
        for target in re.findall(r"\]\(([^)#\s]+)\)", readme.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            if "benchmarks/" in target or target.endswith(".md") or "docs/" in target:
                resolved = (readme.parent / target).resolve()
                checked += 1
                # The forest notes move out of the package into lab/ in a change of their own.
                if not resolved.exists() and resolved != LAB / "forest_NOTES.md":
                    missing.append(f"{readme.relative_to(root)} -> {target}")
    assert not missing, missing
    assert checked >= 20, checked


def test_ci_runs_the_readme_test_command() -> None:
    """`.ci/run` runs exactly the test command the README shows a new user; the README's other command runs the
    main job through a nox session that exists."""
    root = BENCHMARKS.parent
    readme = (root / "README.md").read_text()
    nox_lines = [line for line in readme.splitlines() if line.startswith("uvx nox")]
    main_job = [line for line in nox_lines if line.endswith("-s main_job")]
    commands = [line for line in nox_lines if line not in main_job]
    ci_lines = [line for line in (root / ".ci" / "run").read_text().splitlines() if line.startswith("uvx nox")]
    assert len(commands) == 1 and ci_lines == commands, (commands, ci_lines)
    assert len(main_job) == 1, nox_lines
    noxfile = (root / "noxfile.py").read_text()
    assert "def main_job(session" in noxfile
    # The nox that bench_checks installs (for the main job's set-up tests) is the one the commands run.
    (pinned,) = re.findall(r'NOX_REQUIREMENT = "nox==([^"]+)"', noxfile)
    assert all(line.startswith(f"uvx nox@{pinned} ") for line in nox_lines + ci_lines), (pinned, nox_lines)
