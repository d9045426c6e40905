"""Every fused kernel (and the forest decode passes) compiles for the H200 (sm_90) with the installed Triton, on a
machine without a GPU.

Triton compiles ahead of time for a named target and its wheel carries ptxas, so a Triton release that cannot
compile a kernel for Hopper fails here, before anyone spends GPU time (``scripts/sm90_compile_report.py``, run in a
subprocess because these tests import triton under ``TRITON_INTERPRET=1``, whose kernels cannot be compiled).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "sm90_compile_report.py"


def _ptxas() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return path if path.exists() else None


@pytest.mark.slow
@pytest.mark.skipif(_ptxas() is None, reason="this Triton wheel carries no ptxas for sm_90")
def test_every_fused_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    sources = [str(ROOT / "packages" / name / "src") for name in ("arctic-dedup", "arctic-zorro-train")]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "TRITON_CACHE_DIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join(sources),
    }
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [line for line in result.stdout.splitlines() if "registers" in line]
    # 15 fused-kernel configurations in bf16 and fp32; arctic-dedup's forest decode attention launches (7: three
    # passes, the one launch, and the early combine's counting forms of three of them) and combines (8).
    assert len(reports) == 45, result.stdout
    assert all(line.split("registers")[0].split()[-1].isdigit() for line in reports), result.stdout
