"""The engines the verl tests share: one tiny random-init Qwen3 served on the CPU from the engines' environment
(``ARCTIC_RL_ENGINES_PYTHON``) for the whole session."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

# Whichever test module imports verl first, verl loads the plugin itself, as in users' processes.
os.environ["VERL_USE_EXTERNAL_MODULES"] = "arctic_rl.integrations.verl"

from arctic_rl import ArcticRLClientConfig

SERVER_START_S = 420


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="session")
def engines_python() -> str:
    python = os.environ.get("ARCTIC_RL_ENGINES_PYTHON")
    if not python or not Path(python).exists():
        pytest.fail(
            "ARCTIC_RL_ENGINES_PYTHON must name the Python of an environment holding arctic-rl[engines] and vLLM "
            f"(got {python!r}); `nox -s verl_integration` builds one and sets it."
        )
    return python


@pytest.fixture(scope="session")
def server(engines_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A tiny random-init Qwen3 served by ``arctic_rl.serve`` from the engines' environment, on the CPU."""
    root = tmp_path_factory.mktemp("verl")
    model_dir = root / "tiny-qwen3"
    build = f"from arctic_rl.testing import save_tiny_qwen3; save_tiny_qwen3({str(model_dir)!r}, seed=3)"
    subprocess.run([engines_python, "-c", build], check=True)
    config = ArcticRLClientConfig(
        model_name=str(model_dir),
        device="cpu",
        dtype="float32",
        seed=0,
        full_determinism=True,
        colocate=False,
        log_prob_gpus=1,  # the reference policy's engine (verl's KL loss)
        checkpoint_path=str(root / "checkpoints"),
        training={"lr": 1e-2, "zero_stage": 2, "max_grad_norm": 1.0},
        sampling={"max_model_len": 64, "kv_cache_space_gib": 1, "engine_args": {"block_size": 32}},
    )
    config_file = root / "config.json"
    config_file.write_text(config.model_dump_json())
    port = free_port()
    command = [engines_python, "-m", "arctic_rl.serve", "--config", str(config_file), "--port", str(port)]
    command += ["--placement-override", "cpus_per_cpu_worker=0.25"]
    log_path = root / "server.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            assert process.poll() is None, f"the server exited ({process.returncode}):\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"no /health within {SERVER_START_S} s:\n{log_path.read_text()}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        yield {"port": port, "model_dir": model_dir, "config_file": config_file}
    finally:
        refused = None
        try:
            # A JSON body, as every client sends: the server refuses a body-less POST (415), as it would a web page's,
            # and this wait then ran out its 60 s before the kill.
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/shutdown", json={}, timeout=30)
            if answer.status_code != 200:
                refused = f"/v1/shutdown answered {answer.status_code}: {answer.text}"
            else:
                process.wait(timeout=60)
        except (httpx.HTTPError, subprocess.TimeoutExpired):
            pass  # a stop slower than these limits on a loaded machine: killed below
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        assert refused is None, refused
