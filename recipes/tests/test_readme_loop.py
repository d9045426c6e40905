"""The root README's "drive it from your own loop" snippet runs as written on the CPU (real engines through Ray)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("deepspeed")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
MARKER = "<!-- snippet: readme-loop -->"


def readme_loop_snippet() -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(re.escape(MARKER) + r"\s*```python\n(.*?)```", text, flags=re.DOTALL)
    assert match is not None, f"README.md has no python block right after {MARKER}"
    return match.group(1)


def test_readme_loop_runs_as_written(tmp_path: Path) -> None:
    environment = dict(os.environ)
    # The root package (arctic_platform.rl) sits at the repository root; the test environment installs the packages.
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), environment.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", readme_loop_snippet()],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=environment,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    steps = re.findall(r"^step (\d): loss (-?[\d.]+), grad norm ([\d.]+), dedup saved (\d+)%", result.stdout, re.M)
    assert [int(step) for step, *_ in steps] == [0, 1, 2], result.stdout[-2000:]
    # Four samples of each prompt: the trainer ran each prompt once instead of four times.
    assert all(int(saved) > 0 for *_, saved in steps)
