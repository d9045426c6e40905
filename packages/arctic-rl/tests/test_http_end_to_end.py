"""The GRPO loop of test_end_to_end.py over HTTP, with the real engines on the CPU (Ray local, DeepSpeed on the CPU
accelerator, vLLM's CPU build with FCA): a server launched by the client (``launch_local_server=True``) on the same
Ray cluster gives the same samples, log-probs, losses, gradient norms and weight norms as the Ray transport with the
same seeds, bitwise. The server is then killed during a ``fwd_bwd``: the client raises ``TransportError``, and a new
server that loads the checkpoint takes the next step exactly as the uninterrupted run did.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")
pytest.importorskip("deepspeed")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from ray_helpers import retry_start  # noqa: E402
from test_end_to_end import CPU_SLOTS, PAD, PROMPTS, StepRecord, grpo_step, make_config  # noqa: E402

from arctic_rl import (  # noqa: E402
    ArcticRLClientConfig,
    SyncArcticRLClient,
    TransportError,
    build_grpo_batch,
    create_arctic_rl_client,
)
from arctic_rl.testing import save_tiny_qwen3  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def over_http(config: ArcticRLClientConfig, checkpoint_path: Path) -> ArcticRLClientConfig:
    fields = config.model_dump()
    fields.update(
        comm_protocol="http",
        launch_local_server=True,
        port=free_port(),
        ray_address=ray.get_runtime_context().gcs_address,
        checkpoint_path=str(checkpoint_path),
    )
    return ArcticRLClientConfig.model_validate(fields)


def connect(config: ArcticRLClientConfig) -> SyncArcticRLClient:
    client = create_arctic_rl_client(config, blocking_calls=True, placement_overrides=CPU_SLOTS)
    assert isinstance(client, SyncArcticRLClient)
    return client


def assert_same_step(got: StepRecord, expected: StepRecord) -> None:
    assert [[s["token_ids"] for s in group] for group in got.samples] == [
        [s["token_ids"] for s in group] for group in expected.samples
    ]
    assert [[s["logprobs"] for s in group] for group in got.samples] == [
        [s["logprobs"] for s in group] for group in expected.samples
    ]
    assert got.trainer_log_probs.dtype == expected.trainer_log_probs.dtype == torch.float32
    assert torch.equal(got.trainer_log_probs, expected.trainer_log_probs)
    assert (got.loss, got.grad_norm, got.lr, got.training_norm) == (
        expected.loss,
        expected.grad_norm,
        expected.lr,
        expected.training_norm,
    )


@pytest.fixture(scope="module")
def local_ray() -> Any:
    retry_start(lambda: ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="arctic_rl_http"))
    try:
        yield
    finally:
        ray.shutdown()


def test_grpo_over_http_equals_ray_and_resumes_after_a_killed_server(local_ray: None, tmp_path: Path) -> None:
    model_dir = save_tiny_qwen3(tmp_path / "tiny-qwen3", seed=3)
    ray_config = make_config(model_dir, colocate=False, zorro=True, checkpoint_path=tmp_path / "ray")
    with connect(ray_config) as client:
        expected = [grpo_step(client, step, colocated=False) for step in range(STEPS)]

    http_config = over_http(ray_config, tmp_path / "http")
    client = connect(http_config)
    try:
        records = [grpo_step(client, 0, colocated=False)]
        client.save_checkpoint()
        records.append(grpo_step(client, 1, colocated=False))
        for got, want in zip(records, expected, strict=True):
            assert_same_step(got, want)

        # Kill the server while it runs a fwd_bwd: the client names the server and says the call was not retried.
        rewards = [[0.0, 1.0, 0.5, 0.25]] * len(PROMPTS)
        batch = build_grpo_batch(PROMPTS, records[1].samples, rewards, pad_token_id=PAD)
        batch.pop("prompts")
        errors: list[BaseException] = []

        def train() -> None:
            try:
                client.fwd_bwd(batch)
            except BaseException as error:
                errors.append(error)

        worker = threading.Thread(target=train)
        worker.start()
        server = client._transport.server  # type: ignore[attr-defined]
        status_url = f"http://127.0.0.1:{http_config.port}/v1/status"
        deadline = time.monotonic() + 60
        while not any(job["operation"] == "fwd_bwd" for job in httpx.get(status_url, timeout=5).json()["running"]):
            assert time.monotonic() < deadline, "the server never showed the fwd_bwd running"
            time.sleep(0.01)
        os.killpg(server.process.pid, signal.SIGKILL)
        worker.join(timeout=60)
        assert len(errors) == 1 and isinstance(errors[0], TransportError), errors
        assert "not retried" in str(errors[0]) and str(http_config.port) in str(errors[0])
    finally:
        client.shutdown()

    # A new server on the same checkpoint directory resumes after the first step and repeats the second bitwise.
    restarted = over_http(ray_config, tmp_path / "http")
    with connect(restarted) as client:
        assert client.load_checkpoint() == 1
        assert_same_step(grpo_step(client, 1, colocated=False), records[1])
