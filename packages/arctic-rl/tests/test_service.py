"""The cluster layer (placement, actors, service, client) on a local Ray with small fake engines (fake_engines.py):
ops forward correctly, the data-parallel split gives the single-process gradient, validation happens before any
state changes, engine failures name the engine, and shutdown leaves nothing behind."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

from ray_helpers import retry_start  # noqa: E402

from arctic_rl.batch import build_grpo_batch  # noqa: E402
from arctic_rl.client import SyncArcticRLClient, attach_arctic_rl_client, create_arctic_rl_client  # noqa: E402
from arctic_rl.config import ArcticRLClientConfig  # noqa: E402
from arctic_rl.errors import (  # noqa: E402
    BatchValidationError,
    ConfigError,
    EngineDiedError,
    EngineError,
    EngineStateError,
    InvalidRequestError,
)
from arctic_rl.service import attach_service  # noqa: E402

TESTS = Path(__file__).resolve().parent
FAKES = {
    "training": "fake_engines:FakeTrainingEngine",
    "log_prob": "fake_engines:FakeTrainingEngine",
    "sampling": "fake_engines:FakeSamplingEngine",
}
CPU_SLOTS = {"cpus_per_cpu_worker": 0.25}
LR = 0.5


def make_config(**overrides: Any) -> ArcticRLClientConfig:
    fields: dict[str, Any] = {
        "model_name": "fake-bigram",
        "device": "cpu",
        "training_gpus": 2,
        "sampling_gpus": 1,
        "training": {"lr": LR},
    }
    fields.update(overrides)
    return ArcticRLClientConfig(**fields)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # The engine actors import fake_engines from this folder: Ray workers inherit the driver's PYTHONPATH.
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), previous]))
    retry_start(lambda: ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="arctic_rl_tests"))
    try:
        yield
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous


def start(config: ArcticRLClientConfig, **kwargs: Any) -> SyncArcticRLClient:
    client = create_arctic_rl_client(
        config,
        blocking_calls=True,
        engine_classes=kwargs.pop("engine_classes", FAKES),
        placement_overrides=kwargs.pop("placement_overrides", CPU_SLOTS),
        **kwargs,
    )
    assert isinstance(client, SyncArcticRLClient)
    return client


def alive_actors() -> list[Any]:
    # The GCS's actor table (the state API needs the dashboard, which the tests do not start).
    return [actor for actor in ray._private.state.actors().values() if actor["State"] != "DEAD"]


def live_placement_groups() -> list[str]:
    return [pg_id for pg_id, entry in ray.util.placement_group_table().items() if entry["state"] != "REMOVED"]


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_nothing_left(pids: list[int]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (alive_actors() or any(process_alive(pid) for pid in pids)):
        time.sleep(0.5)
    assert alive_actors() == []
    assert [pid for pid in pids if process_alive(pid)] == []
    assert live_placement_groups() == []


def grpo_batch(prompts: list[list[int]], samples: list[list[dict[str, Any]]], rewards: torch.Tensor) -> dict[str, Any]:
    return build_grpo_batch(prompts, samples, rewards.tolist(), pad_token_id=0)


@pytest.mark.slow
def test_grpo_steps_match_a_single_process_reference(local_ray: None, tmp_path: Path) -> None:
    from fake_engines import initial_weights, response_log_probs

    config = make_config(checkpoint_path=str(tmp_path / "ckpt"))
    reference = initial_weights(config.seed)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]
    with start(config) as client:
        engines = client.describe()["engines"]
        assert sorted(engines) == ["sampling[0]", "training[0]", "training[1]"]
        for step in range(3):
            samples = client.generate(prompts, {"n": 3, "max_tokens": 4, "temperature": 1.0, "seed": step})
            assert [len(group) for group in samples] == [3] * len(prompts)
            rewards = torch.rand(len(prompts), 3, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
            batch = grpo_batch(prompts, samples, rewards)
            # After a sync the trainer scores the sampled tokens exactly as the sampler did.
            scored = client.fwd_no_grad(batch)["logprobs"]
            torch.testing.assert_close(scored.float(), batch["rollout_log_probs"], rtol=0, atol=1e-6)
            result = client.fwd_bwd(batch, {"loss_fn": "grpo", "config": {}})
            # The two ranks' shares add up to the loss of the whole batch computed in one process.
            weights = reference.clone().requires_grad_(True)
            mask = batch["response_mask"].double()
            expected = -(batch["advantages"].double() * response_log_probs(weights, batch) * mask).sum() / mask.sum()
            expected.backward()
            expected = expected.detach()
            assert result["loss"] == pytest.approx(float(expected), rel=1e-12, abs=1e-12)
            assert result["metrics"]["tokens_share"] == pytest.approx(1.0)
            stepped = client.step()
            reference = (reference - LR * weights.grad).detach()
            assert stepped["step"] == step + 1 and stepped["lr"] == LR
            assert stepped["grad_norm"] == pytest.approx(float(weights.grad.norm()), rel=1e-12)
            metrics = stepped["metrics"]
            assert metrics["time/generate"] > 0 and metrics["time/train"] > 0
            assert metrics["mismatch/abs_max"] < 1e-6 and metrics["mismatch/kl"] < 1e-10
            assert metrics["throughput/generate_tokens_per_s"] > 0
            norms = client.weight_norm()
            assert norms["training_norm"] == pytest.approx(float(reference.norm()), rel=1e-12)
            assert norms["sampling_norm"] != pytest.approx(norms["training_norm"], rel=1e-12)
            client.sync_weights()
            norms = client.weight_norm()
            assert norms["sampling_norm"] == pytest.approx(norms["training_norm"], rel=1e-15)
        path = client.save_checkpoint()
        assert path.endswith("step_3_rank_0.pt")
        # A step's worth of changes, then back to the checkpoint: the next step starts from the saved weights.
        client.fwd_bwd(batch)
        client.step()
        assert client.load_checkpoint() == 3
        norms = client.weight_norm()
        assert norms["training_norm"] == pytest.approx(float(reference.norm()), rel=1e-12)
        assert norms["sampling_norm"] == pytest.approx(norms["training_norm"], rel=1e-15)
        assert client.describe()["step"] == 3


@pytest.mark.slow
def test_train_step_is_fwd_bwd_step_and_sync_in_one_call(local_ray: None) -> None:
    from fake_engines import initial_weights, response_log_probs

    config = make_config()
    reference = initial_weights(config.seed)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]
    with start(config) as client:
        for step in range(2):
            samples = client.generate(prompts, {"n": 3, "max_tokens": 4, "temperature": 1.0, "seed": step})
            rewards = torch.rand(len(prompts), 3, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
            batch = grpo_batch(prompts, samples, rewards)
            # The sampler's old_log_probs stay out: the trainer's forward provides them (the fakes check what came).
            result = client.train_step(batch, {"loss_fn": "grpo"}, old_log_probs_from_forward=True, sync_weights=True)
            weights = reference.clone().requires_grad_(True)
            mask = batch["response_mask"].double()
            expected = -(batch["advantages"].double() * response_log_probs(weights, batch) * mask).sum() / mask.sum()
            expected.backward()
            reference = (reference - LR * weights.grad).detach()
            assert result["fwd_bwd"]["loss"] == pytest.approx(float(expected.detach()), rel=1e-12, abs=1e-12)
            assert result["step"]["step"] == step + 1 and result["step"]["lr"] == LR
            assert result["step"]["grad_norm"] == pytest.approx(float(weights.grad.norm()), rel=1e-12)
            metrics = result["step"]["metrics"]
            # The step's own sync is in its metrics, and the mismatch comes from the training forward's log-probs.
            assert metrics["time/sync"] > 0 and result["sync_weights"]["time_s"] > 0
            assert metrics["mismatch/abs_max"] < 1e-6 and metrics["mismatch/tokens"] == float(mask.sum())
            norms = client.weight_norm()
            assert norms["training_norm"] == pytest.approx(float(reference.norm()), rel=1e-12)
            assert norms["sampling_norm"] == pytest.approx(norms["training_norm"], rel=1e-15)
        # Without the sync, the sampler keeps the old weights; the caller's old_log_probs path works as before.
        batch["old_log_probs"] = client.fwd_no_grad(batch)["logprobs"]
        result = client.train_step(batch)
        assert result["sync_weights"] is None and result["step"]["step"] == 3
        norms = client.weight_norm()
        assert norms["sampling_norm"] != pytest.approx(norms["training_norm"], rel=1e-12)
        # Refused before any engine runs: a bad batch, a non-bool flag, a sleeping sampler to sync.
        with pytest.raises(BatchValidationError, match="advantages"):
            client.train_step({**batch, "advantages": None}, old_log_probs_from_forward=True)
        with pytest.raises(InvalidRequestError, match="sync_weights: must be true or false"):
            client.train_step(batch, sync_weights="yes")  # type: ignore[arg-type]
        client.sleep_inference()
        with pytest.raises(EngineStateError, match="wake_inference"):
            client.train_step(batch, sync_weights=True)
        client.wake_inference()
        assert client.weight_norm() == norms and client.describe()["step"] == 3
        # A sampling temperature reaches the trainer's log-prob computations: its forward and its loss.
        weights = reference.clone().requires_grad_(True)
        (-(batch["advantages"].double() * response_log_probs(weights, batch) * mask).sum() / mask.sum()).backward()
        trained = (reference - LR * weights.grad).detach()
        scored = client.fwd_no_grad(batch, temperature=0.7)["logprobs"]
        torch.testing.assert_close(scored, response_log_probs(trained, batch, 0.7), rtol=0, atol=1e-12)
        assert not torch.allclose(scored, client.fwd_no_grad(batch)["logprobs"])
        result = client.fwd_bwd(batch, temperature=0.7)
        expected = -(batch["advantages"].double() * response_log_probs(trained, batch, 0.7) * mask).sum() / mask.sum()
        assert result["loss"] == pytest.approx(float(expected), rel=1e-12, abs=1e-12)
        with pytest.raises(InvalidRequestError, match="temperature"):
            client.fwd_bwd(batch, temperature=0.0)


@pytest.mark.slow
def test_a_colocated_step_syncs_into_the_samplers_weights_before_their_kv_cache_wakes(local_ray: None) -> None:
    # vLLM's order for colocated training: wake the weights, update them, then wake the KV cache, so the KV cache
    # never takes its memory beside the trainer's state. The service must let the sync through in between and keep
    # sampling refused until the KV cache is back.
    with start(make_config()) as client:
        prompts = [[1, 2, 3], [4, 5]]
        samples = client.generate(prompts, {"n": 2, "max_tokens": 3, "seed": 1})
        batch = grpo_batch(prompts, samples, torch.rand(2, 2, dtype=torch.float64))
        client.sleep_inference(2)
        with pytest.raises(EngineStateError, match=r"wake_inference\(\['weights'\]\)"):
            client.sync_weights()
        assert client.describe()["sampling_tags_asleep"] == ["kv_cache", "weights"]
        client.wake_inference(["weights"])
        described = client.describe()
        assert described["sleeping"]["sampling"] and described["sampling_tags_asleep"] == ["kv_cache"]
        result = client.train_step(batch, old_log_probs_from_forward=True, sync_weights=True)
        assert result["sync_weights"] is not None and result["step"]["step"] == 1
        with pytest.raises(EngineStateError, match=r"kv_cache still sleep.*wake_inference\(\['kv_cache'\]\)"):
            client.generate(prompts, {"n": 1})
        client.wake_inference(["kv_cache"])
        described = client.describe()
        assert not described["sleeping"]["sampling"] and described["sampling_tags_asleep"] == []
        norms = client.weight_norm()
        assert norms["sampling_norm"] == pytest.approx(norms["training_norm"], rel=1e-15)
        assert len(client.generate(prompts, {"n": 1, "max_tokens": 2})) == 2
        with pytest.raises(ConfigError, match="tags must be a non-empty list"):
            client.wake_inference(["gpu"])


@pytest.mark.slow
def test_bad_batches_and_wrong_states_change_nothing(local_ray: None) -> None:
    with start(make_config(training_gpus=1)) as client:
        prompts = [[1, 2, 3], [4, 5]]
        samples = client.generate(prompts, {"n": 2, "max_tokens": 3, "seed": 1})
        batch = grpo_batch(prompts, samples, torch.rand(2, 2, dtype=torch.float64))
        before = client.weight_norm()
        bad = dict(batch, advantages=batch["advantages"].clone())
        bad["advantages"][0, 0] = float("nan")
        with pytest.raises(BatchValidationError, match="advantages"):
            client.fwd_bwd(bad)
        out_of_vocab = dict(batch, input_ids=batch["input_ids"].clone(), responses=batch["responses"].clone())
        out_of_vocab["responses"][0, 0] = 99
        out_of_vocab["input_ids"][0, -4] = 99
        with pytest.raises(BatchValidationError):
            client.fwd_bwd(out_of_vocab)
        with pytest.raises(ConfigError, match="no loss named"):
            client.fwd_bwd(batch, {"loss_fn": "no-such-loss"})
        client.sleep_training()
        with pytest.raises(EngineStateError, match="wake_training"):
            client.fwd_bwd(batch)
        with pytest.raises(EngineStateError, match="already asleep"):
            client.sleep_training()
        client.wake_training()
        client.sleep_inference(1)
        with pytest.raises(EngineStateError, match="wake_inference"):
            client.generate(prompts, {"n": 1})
        client.wake_inference()
        with pytest.raises(ConfigError, match="log_prob_gpus >= 1"):
            client.fwd_no_grad(batch, reference_model=True)
        assert client.weight_norm() == before
        assert client.describe()["step"] == 0
        client.fwd_bwd(batch)
        client.step()
        assert client.weight_norm()["training_norm"] != before["training_norm"]


@pytest.mark.slow
def test_too_few_prompt_groups_for_the_ranks_is_a_clear_error(local_ray: None) -> None:
    with start(make_config(training_gpus=2)) as client:
        samples = client.generate([[1, 2, 3]], {"n": 4, "max_tokens": 3})
        batch = grpo_batch([[1, 2, 3]], samples, torch.rand(1, 4, dtype=torch.float64))
        with pytest.raises(BatchValidationError, match=r"1 distinct prompts.*2 data-parallel ranks"):
            client.fwd_bwd(batch)
        assert client.describe()["step"] == 0


@pytest.mark.slow
def test_another_process_can_attach_to_the_named_service(local_ray: None) -> None:
    with start(make_config(training_gpus=1), service_name="shared_service") as owner:
        attached = attach_arctic_rl_client(service_name="shared_service", blocking_calls=True)
        assert isinstance(attached, SyncArcticRLClient)
        assert attached.weight_norm() == owner.weight_norm()
        attached.shutdown()
        # Detaching leaves the owner's engines running.
        assert owner.generate([[1, 2]], {"n": 1, "max_tokens": 2})[0][0]["token_ids"]


@pytest.mark.slow
def test_a_killed_engine_is_named_and_shutdown_leaves_nothing(local_ray: None) -> None:
    client = start(make_config(training_gpus=2))
    pids = [engine["pid"] for engine in client.describe()["engines"].values()]
    victim = client.describe()["engines"]["training[1]"]["pid"]
    try:
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(EngineDiedError, match=r"training\[1\]") as raised:
            client.step()
        assert raised.value.engine == "training[1]"
        assert list(ray.get(attach_service().dead_engines.remote())) == ["training[1]"]
    finally:
        client.shutdown()
    assert_nothing_left(pids)


@pytest.mark.slow
def test_a_trainer_killed_before_a_sync_is_the_engine_named_not_the_samplers_waiting_on_it(local_ray: None) -> None:
    # The samplers' updates take rank 0's parameters by reference: they fail with its gather, and the error is its.
    client = start(make_config(training_gpus=1))
    pids = [engine["pid"] for engine in client.describe()["engines"].values()]
    try:
        client.sync_weights()
        os.kill(client.describe()["engines"]["training[0]"]["pid"], signal.SIGKILL)
        with pytest.raises(EngineDiedError, match=r"training\[0\]") as raised:
            client.sync_weights()
        assert raised.value.engine == "training[0]"
        assert list(ray.get(attach_service().dead_engines.remote())) == ["training[0]"]
    finally:
        client.shutdown()
    assert_nothing_left(pids)


@pytest.mark.slow
def test_an_engine_past_its_call_time_limit_is_declared_failed_and_shutdown_ends(local_ray: None) -> None:
    client = start(make_config(training_gpus=1, engine_call_timeout_s=5.0))
    pids = [engine["pid"] for engine in client.describe()["engines"].values()]
    service = attach_service()
    try:
        started = time.monotonic()
        with pytest.raises(EngineDiedError, match=r"sampling\[0\].*time limit \(5 s") as raised:
            client.generate([[1, 2]], {"max_tokens": 2, "fake_hang_s": 600})
        assert time.monotonic() - started < 60
        assert raised.value.engine == "sampling[0]"
        assert list(ray.get(service.dead_engines.remote())) == ["sampling[0]"]
        # Refused at once from then on; the engines that live still answer.
        started = time.monotonic()
        with pytest.raises(EngineDiedError, match="declared failed earlier"):
            client.generate([[1, 2]], {"max_tokens": 2})
        assert time.monotonic() - started < 5
        assert client.describe()["step"] == 0
    finally:
        started = time.monotonic()
        client.shutdown()
        assert time.monotonic() - started < 20
    assert_nothing_left(pids)


@pytest.mark.slow
def test_an_engine_that_fails_to_start_is_named_and_nothing_is_left(local_ray: None) -> None:
    engines = dict(FAKES, sampling="fake_engines:EngineThatFailsToStart")
    with pytest.raises(EngineError, match=r"sampling\[0\].*missing-model") as raised:
        start(make_config(training_gpus=1), engine_classes=engines)
    assert raised.value.engine == "sampling[0]"
    assert_nothing_left([])


@pytest.fixture
def transfer_events(local_ray: None) -> Iterator[Any]:
    from fake_engines import EVENT_LOG, EVENT_NAMESPACE, EventLog

    log = ray.remote(EventLog).options(name=EVENT_LOG, namespace=EVENT_NAMESPACE, num_cpus=0).remote()
    ray.get(log.read.remote())
    try:
        yield log
    finally:
        ray.kill(log, no_restart=True)


def cuda_transfer_config(method: str, **overrides: Any) -> ArcticRLClientConfig:
    """A GPU config whose weight sync is ``method``; the fakes run it on CPU slots (placement device overridden)."""
    return make_config(device="cuda", weight_sync={"method": method}, **overrides)


# The fakes stand for engines on GPUs: the same service path, placed on CPU worker slots.
CUDA_ON_CPU_SLOTS = {**CPU_SLOTS, "device": "cpu"}
SYNC_CALLS = ["transfer_start", "transfer_update", "transfer_finish", "reset_prefix_cache"]


def train_one_step(client: SyncArcticRLClient, seed: int) -> None:
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]
    samples = client.generate(prompts, {"n": 2, "max_tokens": 3, "seed": seed})
    rewards = torch.rand(len(prompts), 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    client.fwd_bwd(grpo_batch(prompts, samples, rewards))
    client.step()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "overrides"),
    [("nccl", {"sampling_gpus": 2}), ("cuda_ipc", {"sampling_gpus": 2, "colocate": True})],
)
def test_cross_process_sync_sets_up_once_and_the_trainer_drives_the_samplers(
    transfer_events: Any, method: str, overrides: dict[str, Any]
) -> None:
    """The nccl / cuda_ipc orchestration of the service with recording fakes (the real NCCL / IPC transfer needs
    CUDA): the group forms at the first sync only, every training rank sends, rank 0 drives each sampler through
    start / update / finish (then its prefix cache is reset), and shutdown closes both sides."""
    config = cuda_transfer_config(method, **overrides)
    with start(config, placement_overrides=CUDA_ON_CPU_SLOTS) as client:
        for sync in range(2):
            train_one_step(client, seed=sync)
            norms = client.weight_norm()
            assert norms["sampling_norm"] != pytest.approx(norms["training_norm"], rel=1e-12)
            client.sync_weights()
            norms = client.weight_norm()
            assert norms["sampling_norm"] == pytest.approx(norms["training_norm"], rel=1e-15)
        assert client.describe()["weight_sync"] == {"method": method, "transfer_setups": 1}
    events: list[tuple[str, str]] = ray.get(transfer_events.read.remote())
    by_engine: dict[str, list[str]] = {}
    for engine, event in events:
        by_engine.setdefault(engine, []).append(event)
    for rank in range(2):
        assert by_engine[f"training[{rank}]"] == ["transfer_setup", "send_weights", "send_weights", "transfer_shutdown"]
    for replica in range(2):
        # Each replica's workers sit after the trainer and the replicas before it in the transfer group.
        assert by_engine[f"sampling[{replica}]"] == [
            f"transfer_init rank_offset={1 + replica}",
            *SYNC_CALLS,
            *SYNC_CALLS,
            "transfer_shutdown",
        ]
    positions = {engine: [i for i, (name, _) in enumerate(events) if name == engine] for engine in by_engine}
    sends = [i for i, (name, event) in enumerate(events) if name == "training[0]" and event == "send_weights"]
    setups = [i for i, (_, event) in enumerate(events) if event == "transfer_setup"]
    for replica in range(2):
        init, *sync_calls, _ = positions[f"sampling[{replica}]"]
        # Rank 0 makes the samplers join inside its own setup; they receive only inside rank 0's send_weights.
        assert events.index(("training[0]", "transfer_setup")) < init < sends[0]
        assert max(setups) < sends[0] < sync_calls[0] and sends[1] < sync_calls[len(SYNC_CALLS)]


@pytest.mark.slow
def test_a_sampler_that_dies_during_the_transfer_is_named(local_ray: None) -> None:
    client = start(cuda_transfer_config("nccl", training_gpus=1), placement_overrides=CUDA_ON_CPU_SLOTS)
    pids = [engine["pid"] for engine in client.describe()["engines"].values()]
    try:
        client.sync_weights()
        os.kill(client.describe()["engines"]["sampling[0]"]["pid"], signal.SIGKILL)
        with pytest.raises(EngineError, match=r"sampling\[0\].*died during the weight transfer") as raised:
            client.sync_weights()
        assert raised.value.engine == "sampling[0]"
    finally:
        client.shutdown()
    assert_nothing_left(pids)
