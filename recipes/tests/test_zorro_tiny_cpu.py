"""The main job (``recipes/zorro_tiny_cpu.py``): its timing summary flags a speedup above the FLOP bound as noise,
and the job runs end to end on a small batch, printing the summary and an exactness check within the bounds."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

RECIPE = Path(__file__).resolve().parents[1] / "zorro_tiny_cpu.py"


def _load_recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("zorro_tiny_cpu", RECIPE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the class body runs.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


recipe = _load_recipe()


def test_spread_gives_median_quartiles_and_extremes() -> None:
    spread = recipe.Spread.of([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (spread.median, spread.lower_quartile, spread.upper_quartile) == (3.0, 2.0, 4.0)
    assert (spread.minimum, spread.maximum) == (1.0, 5.0)
    with pytest.raises(ValueError, match="at least 2 measurements"):
        recipe.Spread.of([1.0])


def test_a_speedup_within_the_bound_is_reported_as_a_fraction_of_it() -> None:
    report = recipe.speedup_report([0.10, 0.12, 0.11], [0.30, 0.33, 0.32], flop_bound=3.38)
    assert report.speedup == pytest.approx(0.32 / 0.11)
    assert report.step_ratios.median == pytest.approx(0.32 / 0.11)
    assert not report.above_bound
    assert report.verdict() == "86% of the bound"


def test_a_speedup_above_the_bound_is_flagged_as_noise() -> None:
    # The case that once printed "12.50x (370% of the bound)": a loaded machine slowed the baseline steps.
    report = recipe.speedup_report([0.10, 0.10, 0.10], [1.25, 1.30, 1.20], flop_bound=3.38)
    assert report.above_bound
    assert report.verdict() == "above the FLOP bound: noise, rerun on a quiet machine"
    assert "%" not in report.verdict()
    # Exactly at the bound is still a result.
    assert not recipe.speedup_report([1.0, 1.0], [2.0, 2.0], flop_bound=2.0).above_bound


def test_speedup_report_rejects_unpaired_or_non_positive_times() -> None:
    with pytest.raises(ValueError, match="same number of interleaved steps"):
        recipe.speedup_report([0.1, 0.1], [0.3, 0.3, 0.3], flop_bound=3.0)
    with pytest.raises(ValueError, match="positive"):
        recipe.speedup_report([0.1, 0.0], [0.3, 0.3], flop_bound=3.0)


def test_the_job_runs_and_reports_medians_spreads_and_exactness() -> None:
    args = ["--check-batches", "2", "--warmup", "1", "--timed-steps", "3", "--batch-size", "4", "--prompt-len", "32"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(RECIPE), *args, "--response-len", "8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    out = done.stdout
    assert "median of 3 interleaved (after 1 warm-up)" in out
    assert re.search(r"dedup [\d.]+ ms \(IQR [\d.]+-[\d.]+, min-max [\d.]+-[\d.]+\)", out), out
    assert re.search(
        r"speedup [\d.]+x \(per-step ratios IQR .*\): (\d+% of the bound|above the FLOP bound: noise)", out
    )
    gaps = re.search(r"max \|logprob dedup - baseline\| = (\S+), max gradient rel-L2 = (\S+),", out)
    assert gaps is not None, out
    assert float(gaps[1]) <= 1e-5 and float(gaps[2]) <= 1e-5, gaps.group(0)
