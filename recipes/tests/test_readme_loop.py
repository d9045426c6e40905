"""The root README's "drive it from your own loop" snippet runs as written, as a user runs it: ``python`` of the
main job's environment (``nox -s bench_checks`` installs the same requirements, root package included), started in
an empty directory, with real engines through Ray on the CPU. It leaves nothing in that directory."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_user import cpu_user_environment

pytest.importorskip("vllm")
pytest.importorskip("deepspeed")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MARKER = "<!-- snippet: readme-loop -->"


def readme_loop_snippet() -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(re.escape(MARKER) + r"\s*```python\n(.*?)```", text, flags=re.DOTALL)
    assert match is not None, f"README.md has no python block right after {MARKER}"
    return match.group(1)


def test_readme_loop_runs_as_written(tmp_path: Path) -> None:
    working_directory = tmp_path / "user"
    working_directory.mkdir()
    script = tmp_path / "loop.py"
    script.write_text(readme_loop_snippet())
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=working_directory,
        env=cpu_user_environment(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    steps = re.findall(r"^step (\d): loss (-?[\d.]+), grad norm ([\d.]+), dedup saved (\d+)%", result.stdout, re.M)
    assert [int(step) for step, *_ in steps] == [0, 1, 2], result.stdout[-2000:]
    # Four samples of each prompt: the trainer ran each prompt once instead of four times.
    assert all(int(saved) > 0 for *_, saved in steps)
    assert sorted(path.name for path in working_directory.iterdir()) == []
