"""``readme_loop_gpu.py`` without a GPU: its one-GPU edits apply to the README's loop snippet as it reads now (each
exactly once, the result still Python), a README that drifts stops it with the line it looked for, and its parser
reads the snippet's step lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))

import readme_loop_gpu  # noqa: E402


def _snippet() -> str:
    return readme_loop_gpu.readme_loop_snippet((readme_loop_gpu.REPO / "README.md").read_text())


def test_the_one_gpu_edits_apply_to_the_readme_snippet() -> None:
    snippet = _snippet()
    edited, edits = readme_loop_gpu.one_gpu_snippet(snippet, "/tmp/model")
    compile(edited, "loop.py", "exec")
    assert "model_dir = '/tmp/model'" in edited and "save_tiny_qwen3(tempfile" not in edited
    assert "colocate=True," in edited and "colocate=False" not in edited
    assert "kv_cache_space_gib" not in edited and '"gpu_memory_utilization": 0.3' in edited
    assert len(edits) == 3 and all(edit["from"] in snippet and edit["to"] in edited for edit in edits)
    # Everything else is the README's text: the loop itself is untouched.
    loop = snippet[snippet.index("with create_arctic_rl_client") :]
    assert loop in edited


def test_a_snippet_that_drifted_stops_the_run_with_the_line_it_looked_for() -> None:
    drifted = _snippet().replace("colocate=False,", "colocate=False,  # split")
    with pytest.raises(SystemExit, match="colocate=False"):
        readme_loop_gpu.one_gpu_snippet(drifted, "/tmp/model")


def test_step_lines_are_parsed() -> None:
    stdout = (
        "arctic-rl: engines ready\n"
        "step 0: loss 0.0123, grad norm 1.250, dedup saved 75% of the tokens, generate 3.4 s\n"
        "step 1: loss -0.0040, grad norm 0.980, dedup saved 74% of the tokens, generate 1.1 s\n"
    )
    assert readme_loop_gpu.parse_steps(stdout) == [
        {"step": 0, "loss": 0.0123, "grad_norm": 1.25, "zorro_savings": 0.75, "generate_seconds": 3.4},
        {"step": 1, "loss": -0.004, "grad_norm": 0.98, "zorro_savings": 0.74, "generate_seconds": 1.1},
    ]


def test_without_a_gpu_it_refuses_and_prints_the_edited_snippet() -> None:
    script = str(BENCHMARKS / "readme_loop_gpu.py")
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    refused = subprocess.run([sys.executable, script], capture_output=True, text=True, env=environment, timeout=300)
    assert refused.returncode == 2 and "no GPU is visible" in refused.stderr
    printed = subprocess.run(
        [sys.executable, script, "--print-snippet"], capture_output=True, text=True, env=environment, timeout=300
    )
    assert printed.returncode == 0 and "model_dir = 'MODEL_DIR'" in printed.stdout
