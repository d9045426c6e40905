"""The CPU engines build no C++ op: DeepSpeed's CPU backend would compile ``deepspeed_shm_comm`` when the process
group starts (1-6 minutes on a small machine, and a C++ compiler the README does not ask for).

The engine runs in a fresh process (DeepSpeed starts its communication backend once per process) with an empty
``TORCH_EXTENSIONS_DIR``, where torch writes every op it builds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed", reason="needs arctic-rl[engines]")
pytest.importorskip("transformers", reason="needs arctic-rl[engines]")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks DeepSpeed's CPU accelerator")

ENGINE_STEP = textwrap.dedent(
    """
    import json, sys
    import torch
    from engine_cases import fwd_bwd, make_batch, make_config
    from arctic_rl.engines.training import TrainingEngine
    from arctic_rl.testing import save_tiny_qwen3

    torch.set_num_threads(1)
    engine = TrainingEngine(make_config(str(save_tiny_qwen3(sys.argv[1]))))
    before = engine.weight_norm()
    fwd_bwd(engine, make_batch(seed=2))
    engine.step()
    from deepspeed.comm import comm
    print(json.dumps({"trained": engine.weight_norm() != before, "shm_op": comm.cdb.shm_comm_op is not None}))
    """
)


@pytest.mark.slow
def test_a_cpu_training_step_compiles_nothing(tmp_path: Path) -> None:
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    # A compiler that cannot run: were an op built, the engine would fail here rather than pass on a warm cache.
    no_compiler = tmp_path / "no-compiler"
    no_compiler.write_text("#!/bin/sh\necho 'the engines must not compile anything' >&2\nexit 1\n")
    no_compiler.chmod(0o755)
    tests = Path(__file__).parent
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(extensions),
        "CXX": str(no_compiler),
        "CC": str(no_compiler),
        "DS_ACCELERATOR": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")])),
    }
    run = subprocess.run(
        [sys.executable, "-c", ENGINE_STEP, str(tmp_path / "tiny_qwen3")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"trained": True, "shm_op": False}
    assert sorted(path.name for path in extensions.rglob("*")) == []
