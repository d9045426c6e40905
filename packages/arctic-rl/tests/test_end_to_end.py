"""The GRPO loop end to end through the client, with the real engines on the CPU: Ray local, DeepSpeed on the CPU
accelerator, vLLM's CPU build in-process with the FCA backend, a tiny random-init Qwen3 and a byte tokenizer.

Five client runs share one local Ray (engine start-ups are most of this module's time, so each run serves every
check it can): split with ZoRRO on (checkpointing after the first step), colocated with ZoRRO off (same first step:
the same log-probs, loss and gradient norm as the ZoRRO run), a restart from the checkpoint whose next step equals
the uninterrupted run's bitwise (``full_determinism``), split with ``weight_sync.method='gloo'`` (the cross-process
transfer path, whose first steps equal the object-store run's), and the same loop over HTTP. The restarted client
then loses its training engine's process: the next call names the engine and shutdown leaves nothing behind.

Over HTTP, a server launched by the client (``launch_local_server=True``) on the same Ray cluster gives the same
samples, log-probs, losses, gradient norms and weight norms as the split Ray run with the same seeds, bitwise. The
server is then killed during a ``fwd_bwd``: the client raises ``TransportError``, and a new server that loads the
checkpoint takes the next step exactly as the uninterrupted run did.
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")
pytest.importorskip("deepspeed")

from ray_helpers import retry_start  # noqa: E402

from arctic_rl import (  # noqa: E402
    ArcticRLClientConfig,
    BatchValidationError,
    EngineError,
    SyncArcticRLClient,
    TransportError,
    build_grpo_batch,
    create_arctic_rl_client,
)
from arctic_rl.testing import save_tiny_qwen3  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 3
SAMPLES_PER_PROMPT = 4
MAX_TOKENS = 8
PAD = 256  # the byte tokenizer's <|endoftext|>
# Three prompts of 70-100 tokens: each spans full 32-token KV blocks that its samples share, so FCA groups them.
PROMPTS = [
    [(7 * index + 3 * prompt) % 250 + 1 for index in range(length)] for prompt, length in enumerate((70, 100, 85))
]
# Fixed text pairs the sampler and the trainer both score after every weight sync (byte tokenizer: id = byte).
FIXED_PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 2, "GRPO samples each prompt many times; "]
FIXED_COMPLETIONS = ["It sleeps.", "dedup removes the repeats."]
CPU_SLOTS = {"cpus_per_cpu_worker": 0.25}
EXACT = 1e-5  # fp32 logprob agreement, the project's bound


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def alive_actors() -> list[Any]:
    return [actor for actor in ray._private.state.actors().values() if actor["State"] != "DEAD"]


def wait_until_gone(pids: list[int], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (alive_actors() or any(process_alive(pid) for pid in pids)):
        time.sleep(0.5)
    assert alive_actors() == []
    assert not [pid for pid in pids if process_alive(pid)]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    retry_start(lambda: ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="arctic_rl_e2e"))
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("e2e") / "tiny-qwen3", seed=3)


def make_config(
    model_dir: Path, *, colocate: bool, zorro: bool, checkpoint_path: Path, weight_sync: str = "auto"
) -> ArcticRLClientConfig:
    return ArcticRLClientConfig(
        model_name=str(model_dir),
        device="cpu",
        dtype="float32",
        seed=0,
        full_determinism=True,
        colocate=colocate,
        checkpoint_path=str(checkpoint_path),
        training={"lr": 1e-2, "zero_stage": 2, "max_grad_norm": 1.0, "lr_schedule": "cosine", "total_steps": 10},
        zorro_train={"enable": zorro},
        fca={"enable": True, "log_interval": 1},
        sampling={"max_model_len": 256, "kv_cache_space_gib": 1, "engine_args": {"block_size": 32}},
        weight_sync={"method": weight_sync},
    )


def start(config: ArcticRLClientConfig) -> SyncArcticRLClient:
    client = create_arctic_rl_client(config, blocking_calls=True, placement_overrides=CPU_SLOTS)
    assert isinstance(client, SyncArcticRLClient)
    return client


def reward(token_ids: list[int]) -> float:
    """A verifiable toy reward: the share of even token ids."""
    return sum(token % 2 == 0 for token in token_ids) / max(len(token_ids), 1)


def fixed_pairs_batch() -> dict[str, torch.Tensor]:
    """The fixed text pairs as a padded batch the trainer scores (left-padded prompts, right-padded completions)."""
    prompts = [list(text.encode()) for text in FIXED_PROMPTS]
    completions = [
        [{"token_ids": list(text.encode()), "logprobs": [0.0] * len(text.encode())}] for text in FIXED_COMPLETIONS
    ]
    batch = build_grpo_batch(prompts, completions, [[0.0], [0.0]], pad_token_id=PAD)
    batch.pop("prompts")
    return batch


def assert_sampler_matches_trainer(client: SyncArcticRLClient) -> float:
    """After a sync: the sampler's log-probs of the fixed completions equal the trainer's; the weight norms agree."""
    sampler = client.log_probs(FIXED_PROMPTS, FIXED_COMPLETIONS)
    batch = fixed_pairs_batch()
    trainer = client.fwd_no_grad(batch)["logprobs"]
    largest = 0.0
    for row, values in enumerate(sampler):
        width = len(FIXED_COMPLETIONS[row].encode())
        assert len(values) == width
        difference = (torch.tensor(values, dtype=torch.float64) - trainer[row, :width].double()).abs().max()
        largest = max(largest, float(difference))
    assert largest <= EXACT, f"sampler vs trainer log-probs differ by {largest:.2e} after sync_weights"
    norms = client.weight_norm()
    assert math.isclose(norms["training_norm"], norms["sampling_norm"], rel_tol=1e-12), norms
    return largest


@dataclass
class StepRecord:
    samples: list[list[dict[str, Any]]]
    trainer_log_probs: torch.Tensor
    loss: float
    grad_norm: float
    lr: float
    training_norm: float
    metrics: dict[str, float] = field(default_factory=dict)


def grpo_step(client: SyncArcticRLClient, step: int, *, colocated: bool) -> StepRecord:
    """One GRPO step as a user writes it: sample, score, reward, train, sync (sleep/wake when colocated)."""
    samples = client.generate(
        PROMPTS, {"n": SAMPLES_PER_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 100 + step}
    )
    assert [len(group) for group in samples] == [SAMPLES_PER_PROMPT] * len(PROMPTS)
    rewards = [[reward(sample["token_ids"]) for sample in group] for group in samples]
    batch = build_grpo_batch(PROMPTS, samples, rewards, pad_token_id=PAD, max_response_length=MAX_TOKENS)
    batch.pop("prompts")
    if colocated:
        client.sleep_inference(1)
    trainer = client.fwd_no_grad(batch)["logprobs"]
    batch["old_log_probs"] = trainer
    processing = {
        "loss_fn": "grpo",
        "config": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean"},
    }
    reply = client.fwd_bwd(batch, processing=processing)
    stepped = client.step()
    if colocated:
        # vLLM's colocated order: the weights wake first and take the update, the KV cache after it (never beside
        # the trainer's state).
        client.wake_inference(["weights"])
        client.sync_weights()
        client.wake_inference(["kv_cache"])
    else:
        client.sync_weights()
    assert_sampler_matches_trainer(client)
    metrics = stepped["metrics"]
    # The trainer scored the sampler's own tokens with the sampler's weights: no train/inference mismatch in fp32.
    assert metrics["mismatch/abs_max"] <= EXACT
    return StepRecord(
        samples=samples,
        trainer_log_probs=trainer,
        loss=float(reply["loss"]),
        grad_norm=float(stepped["grad_norm"]),
        lr=float(stepped["lr"]),
        training_norm=client.weight_norm()["training_norm"],
        metrics=metrics,
    )


@pytest.fixture(scope="module")
def split_zorro_run(local_ray: None, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Split placement, ZoRRO on: STEPS steps, a checkpoint after the first, and the bad-batch check in between."""
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    config = make_config(model_dir, colocate=False, zorro=True, checkpoint_path=checkpoints)
    records: list[StepRecord] = []
    with start(config) as client:
        assert_sampler_matches_trainer(client)
        initial_norm = client.weight_norm()["training_norm"]
        for step in range(STEPS):
            records.append(grpo_step(client, step, colocated=False))
            if step == 0:
                saved = client.save_checkpoint()
                bad = _bad_batch(records[0])
                before = client.weight_norm()
                with pytest.raises(BatchValidationError, match="advantages"):
                    client.fwd_bwd(bad)
                assert client.weight_norm() == before
    return {"records": records, "initial_norm": initial_norm, "checkpoint": saved, "config": config}


def _bad_batch(record: StepRecord) -> dict[str, torch.Tensor]:
    rewards = [[reward(sample["token_ids"]) for sample in group] for group in record.samples]
    batch = build_grpo_batch(PROMPTS, record.samples, rewards, pad_token_id=PAD, max_response_length=MAX_TOKENS)
    batch.pop("prompts")
    batch["advantages"][0, 0] = float("nan")
    return batch


def test_grpo_loop_split_with_zorro_and_fca(split_zorro_run: dict[str, Any]) -> None:
    records: list[StepRecord] = split_zorro_run["records"]
    assert len(records) == STEPS
    norms = [split_zorro_run["initial_norm"], *[record.training_norm for record in records]]
    assert all(math.isfinite(record.loss) and math.isfinite(record.grad_norm) for record in records)
    assert all(record.grad_norm > 0 for record in records)
    assert all(before != after for before, after in itertools.pairwise(norms)), f"the weights did not change: {norms}"
    for record in records:
        metrics = record.metrics
        # Every prompt group was trained once: 3 prompts + 12 responses instead of 12 prompt copies.
        assert 0.0 < metrics["zorro/savings"] < 1.0 and metrics["zorro/dedup_tokens"] < metrics["zorro/base_tokens"]
        # FCA grouped the samples of each prompt in the sampler's decode steps.
        assert metrics["fca/enabled"] == 1.0 and metrics["fca/steps_grouped"] > 0 and metrics["fca/groups"] > 0
        assert metrics["fca/saved_bytes_per_layer"] > 0
        for key in ("time/generate", "time/log_prob", "time/train"):
            assert metrics[key] > 0, key
        assert metrics["throughput/generate_tokens_per_s"] > 0 and metrics["throughput/train_tokens_per_s"] > 0
    # A step's metrics cover the calls since the previous step(): the sync that followed step k is in step k+1's.
    assert all(record.metrics["time/sync"] > 0 for record in records[1:])


def test_colocated_without_zorro_takes_the_same_first_step(
    split_zorro_run: dict[str, Any], model_dir: Path, tmp_path: Path
) -> None:
    reference: StepRecord = split_zorro_run["records"][0]
    config = make_config(model_dir, colocate=True, zorro=False, checkpoint_path=tmp_path)
    with start(config) as client:
        records = [grpo_step(client, step, colocated=True) for step in range(STEPS)]
    first = records[0]
    # The same weights and seeds sample the same tokens; ZoRRO on/off then agree on log-probs, loss and gradient.
    assert [[s["token_ids"] for s in group] for group in first.samples] == [
        [s["token_ids"] for s in group] for group in reference.samples
    ]
    assert float((first.trainer_log_probs - reference.trainer_log_probs).abs().max()) <= EXACT
    assert math.isclose(first.loss, reference.loss, rel_tol=1e-5, abs_tol=1e-7)
    assert math.isclose(first.grad_norm, reference.grad_norm, rel_tol=1e-5)
    assert math.isclose(first.training_norm, reference.training_norm, rel_tol=1e-6)
    assert all(math.isfinite(record.loss) for record in records)
    assert all("zorro/savings" not in record.metrics or record.metrics["zorro/savings"] == 0.0 for record in records)


def test_restart_from_checkpoint_continues_bitwise_then_a_dead_engine_is_named(
    split_zorro_run: dict[str, Any],
) -> None:
    records: list[StepRecord] = split_zorro_run["records"]
    config: ArcticRLClientConfig = split_zorro_run["config"]
    client = start(config)
    try:
        assert client.load_checkpoint() == 1
        resumed = grpo_step(client, 1, colocated=False)
        uninterrupted = records[1]
        assert [[s["token_ids"] for s in group] for group in resumed.samples] == [
            [s["token_ids"] for s in group] for group in uninterrupted.samples
        ]
        assert resumed.loss == uninterrupted.loss
        assert resumed.grad_norm == uninterrupted.grad_norm and resumed.lr == uninterrupted.lr
        assert resumed.training_norm == uninterrupted.training_norm
        assert torch.equal(resumed.trainer_log_probs, uninterrupted.trainer_log_probs)

        engines = client.describe()["engines"]
        pids = [engine["pid"] for engine in engines.values()]
        victim = engines["training[0]"]["pid"]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(EngineError, match=r"training\[0\]"):
            client.weight_norm()
    finally:
        client.shutdown()
    wait_until_gone(pids)


def test_gloo_weight_sync_moves_the_weights_across_processes(
    split_zorro_run: dict[str, Any], model_dir: Path, tmp_path: Path
) -> None:
    """weight_sync.method='gloo': trainer rank 0 broadcasts to the sampler actor over a gloo group through vLLM's
    transfer API. After every sync the sampler scores like the trainer (checked inside grpo_step) and the group set
    up at the first sync serves the second."""
    reference: list[StepRecord] = split_zorro_run["records"]
    config = make_config(model_dir, colocate=False, zorro=True, checkpoint_path=tmp_path, weight_sync="gloo")
    with start(config) as client:
        records = [grpo_step(client, step, colocated=False) for step in range(2)]
        assert client.describe()["weight_sync"] == {"method": "gloo", "transfer_setups": 1}
    # The second step sampled with the weights the first sync moved: the same tokens as the object-store run.
    for record, expected in zip(records, reference, strict=False):
        assert [[s["token_ids"] for s in group] for group in record.samples] == [
            [s["token_ids"] for s in group] for group in expected.samples
        ]
        assert float((record.trainer_log_probs - expected.trainer_log_probs).abs().max()) <= EXACT


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def over_http(config: ArcticRLClientConfig, checkpoint_path: Path) -> ArcticRLClientConfig:
    """``config`` served by a server the client launches on this module's Ray cluster."""
    fields = config.model_dump()
    fields.update(
        comm_protocol="http",
        launch_local_server=True,
        port=free_port(),
        ray_address=ray.get_runtime_context().gcs_address,
        checkpoint_path=str(checkpoint_path),
    )
    return ArcticRLClientConfig.model_validate(fields)


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


def test_grpo_over_http_equals_ray_and_resumes_after_a_killed_server(
    split_zorro_run: dict[str, Any], tmp_path: Path
) -> None:
    pytest.importorskip("fastapi")
    # The split Ray run's first two steps (same model, config and seeds) are the reference, bitwise.
    expected: list[StepRecord] = split_zorro_run["records"][:2]
    http_config = over_http(split_zorro_run["config"], tmp_path / "http")
    client = start(http_config)
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
    restarted = over_http(split_zorro_run["config"], tmp_path / "http")
    with start(restarted) as client:
        assert client.load_checkpoint() == 1
        assert_same_step(grpo_step(client, 1, colocated=False), records[1])
