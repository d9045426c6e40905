"""The verl plugin against real engines: run by ``nox -s verl_integration`` in an environment holding verl 0.9.1 and
the thin client only (verl pins transformers<5.11, which the engines cannot use).

The engines run in a second environment whose Python ``ARCTIC_RL_ENGINES_PYTHON`` names: the test builds a tiny
random-init model there and starts ``python -m arctic_rl.serve`` on the CPU. verl loads the plugin itself
(``VERL_USE_EXTERNAL_MODULES``); its registries find the Arctic engine and replica; a sample comes through verl's
rollout-server interface, and one PPO update through verl's training-engine interface changes the server's weights.
verl is imported without a skip: this file exists to fail where verl does not import.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

PLUGIN = "arctic_rl.integrations.verl"
os.environ["VERL_USE_EXTERNAL_MODULES"] = PLUGIN
import verl  # noqa: E402

PLUGIN_LOADED_BY_VERL = PLUGIN in sys.modules

import ray  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig, RolloutConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.rollout.replica import get_rollout_replica_class  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from arctic_rl.integrations.verl import ArcticRolloutReplica, ArcticTrainingEngine  # noqa: E402

PROMPTS = [[(5 * index + 11 * row) % 250 + 1 for index in range(length)] for row, length in enumerate((12, 7, 16))]
RESPONSE_LENGTH = 6
PROMPT_LENGTH = 16
PAD = 256  # the byte tokenizer's <|endoftext|>
EXACT = 1e-5  # fp32 log-prob agreement, the project's bound
SERVER_START_S = 420


@pytest.fixture
def connected(server: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The ARCTIC_RL_* variables a user sets for verl's processes."""
    monkeypatch.setenv("ARCTIC_RL_PROTOCOL", "http")
    monkeypatch.setenv("ARCTIC_RL_HOST", "127.0.0.1")
    monkeypatch.setenv("ARCTIC_RL_PORT", str(server["port"]))
    return server


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, namespace="arctic_rl_verl")
    try:
        yield
    finally:
        ray.shutdown()


# Started in the engines' environment on verl's Ray cluster: the engines' actors must run that environment's Python,
# not the cluster's default (verl's), which cannot import them.
RAY_SERVICE_SCRIPT = """
import sys
from pathlib import Path

import ray

from arctic_rl import ArcticRLClientConfig
from arctic_rl.client import create_arctic_rl_client

address, config_file, name = sys.argv[1:]
ray.init(address=address, include_dashboard=False, log_to_driver=False)
config = ArcticRLClientConfig.model_validate_json(Path(config_file).read_text())
config = config.model_copy(update={"comm_protocol": "ray"})
client = create_arctic_rl_client(
    config, blocking_calls=True, service_name=name, placement_overrides={"cpus_per_cpu_worker": 0.25}
)
print("READY", flush=True)
sys.stdin.read()  # until the test closes stdin
client.shutdown()
"""
RAY_SERVICE_NAME = "arctic_rl_verl_service"


@pytest.fixture(scope="module")
def ray_service(
    server: dict[str, Any], engines_python: str, local_ray: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The same engines as a Ray service on this test's Ray cluster, started from the engines' environment."""
    address = ray.get_runtime_context().gcs_address
    log_path = tmp_path_factory.mktemp("ray-service") / "service.log"
    command = [engines_python, "-c", RAY_SERVICE_SCRIPT, address, str(server["config_file"]), RAY_SERVICE_NAME]
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + SERVER_START_S
        while "READY" not in log_path.read_text():
            assert process.poll() is None, f"the service exited ({process.returncode}):\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"no service within {SERVER_START_S} s:\n{log_path.read_text()}"
            time.sleep(1)
        yield server
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture
def connected_over_ray(ray_service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The ARCTIC_RL_* variables for a service on verl's own Ray cluster (its processes are already attached)."""
    monkeypatch.setenv("ARCTIC_RL_PROTOCOL", "ray")
    monkeypatch.setenv("ARCTIC_RL_SERVICE_NAME", RAY_SERVICE_NAME)
    monkeypatch.delenv("ARCTIC_RL_RAY_ADDRESS", raising=False)
    return ray_service


def test_verl_loads_the_plugin_and_its_registries_find_our_classes() -> None:
    assert PLUGIN_LOADED_BY_VERL, f"import verl did not import {PLUGIN} (VERL_USE_EXTERNAL_MODULES)"
    assert verl.__version__ == "0.9.1"
    assert EngineRegistry.get_engine_cls("language_model", "arctic") is ArcticTrainingEngine
    assert get_rollout_replica_class("arctic") is ArcticRolloutReplica


def rollout_config() -> RolloutConfig:
    return RolloutConfig(
        name="arctic", prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH, tensor_model_parallel_size=1
    )


def sample_through_verl(replica: Any, prompt_ids: list[int], seed: int) -> Any:
    """One request as verl's LLMServerClient sends it to a replica's server handle."""
    sampling_params = {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "logprobs": True,
        "seed": seed,
        "ignore_eos": True,
    }
    return ray.get(
        replica.server_handle.generate.remote(
            request_id=f"request-{seed}", prompt_ids=prompt_ids, sampling_params=sampling_params
        )
    )


def padded_batch(outputs: list[Any]) -> dict[str, torch.Tensor]:
    """verl's DataProto layout: prompts left-padded to PROMPT_LENGTH, responses right-padded to RESPONSE_LENGTH."""
    rows = len(PROMPTS)
    input_ids = torch.full((rows, PROMPT_LENGTH + RESPONSE_LENGTH), PAD, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (prompt, output) in enumerate(zip(PROMPTS, outputs, strict=True)):
        response = output.token_ids
        input_ids[row, PROMPT_LENGTH - len(prompt) : PROMPT_LENGTH] = torch.tensor(prompt)
        input_ids[row, PROMPT_LENGTH : PROMPT_LENGTH + len(response)] = torch.tensor(response)
        attention_mask[row, PROMPT_LENGTH - len(prompt) : PROMPT_LENGTH + len(response)] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return {
        "prompts": input_ids[:, :PROMPT_LENGTH],
        "responses": input_ids[:, PROMPT_LENGTH:],
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": attention_mask[:, PROMPT_LENGTH:].clone(),
    }


def test_a_rollout_and_a_ppo_update_go_through_verls_interfaces(connected: dict[str, Any], local_ray: None) -> None:
    rollout_and_update_through_verl(connected)


def test_the_same_over_ray_with_the_engines_on_verls_cluster(connected_over_ray: dict[str, Any]) -> None:
    """``ARCTIC_RL_PROTOCOL=ray``: the engines run as a service on verl's Ray cluster, in their own environment."""
    rollout_and_update_through_verl(connected_over_ray)


def rollout_and_update_through_verl(connected: dict[str, Any]) -> None:
    """A rollout through verl's replica interface and one PPO update through its training-engine interface."""
    model = {"path": str(connected["model_dir"])}
    replica = get_rollout_replica_class("arctic")(
        replica_rank=0, config=rollout_config(), model_config=model, gpus_per_node=1
    )
    asyncio.run(replica.init_standalone())
    outputs = [sample_through_verl(replica, prompt, seed) for seed, prompt in enumerate(PROMPTS)]
    for output in outputs:
        assert len(output.token_ids) == RESPONSE_LENGTH == len(output.log_probs)
        assert all(0 <= token < 320 for token in output.token_ids)
        assert all(math.isfinite(value) and value <= 0.0 for value in output.log_probs)

    engine = EngineRegistry.new(
        model_type="language_model",
        backend="arctic",
        model_config=model,
        engine_config={"forward_only": False},
        optimizer_config=None,
        checkpoint_config=None,
    )
    engine.initialize()
    before = engine.client.weight_norm()["training_norm"]

    # Old log-probs as verl's trainer computes them (_compute_old_log_prob): no-padding layout in, padded out.
    padded = padded_batch(outputs)
    data = left_right_2_no_padding(tu.get_tensordict(dict(padded)))
    tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False)
    with engine.eval_mode():
        inferred = engine.infer_batch(data)
    old_log_probs = no_padding_2_padding(inferred["model_output"]["log_probs"], data)
    entropy = no_padding_2_padding(inferred["model_output"]["entropy"], data)
    sampler = torch.tensor([output.log_probs for output in outputs])
    assert old_log_probs.shape == entropy.shape == (len(PROMPTS), RESPONSE_LENGTH)
    assert (old_log_probs - sampler).abs().max() <= EXACT, "trainer and sampler disagree on the sampled tokens"
    assert bool((entropy > 0).all())

    # One PPO update as verl's TrainingWorker runs it: train_batch = zero_grad, forward_backward, optimizer step.
    training = dict(padded)
    training["old_log_probs"] = old_log_probs
    training["advantages"] = torch.tensor([[1.0], [-1.0], [0.5]]).expand(-1, RESPONSE_LENGTH).contiguous()
    data = left_right_2_no_padding(tu.get_tensordict(training))
    actor = ActorConfig(strategy="arctic", rollout_n=1, ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=3)
    with engine.train_mode():
        result = engine.train_batch(data, loss_function=functools.partial(ppo_loss, config=actor))
    (loss,) = result["loss"]
    assert math.isfinite(loss) and loss != 0.0
    assert math.isfinite(result["metrics"]["grad_norm"]) and result["metrics"]["grad_norm"] > 0.0
    assert engine.lr_scheduler_step() > 0.0
    after = engine.client.weight_norm()["training_norm"]
    assert math.isfinite(after) and after != before
    engine.client.shutdown()
    ray.get(replica.server_handle.shutdown.remote())
    ray.kill(replica.server_handle)  # its name is free again for the next replica of rank 0


def test_what_a_remote_engine_cannot_do_is_refused_with_the_alternative() -> None:
    # Refused before any call reaches a server: this engine is never connected.
    engine = ArcticTrainingEngine(model_config={"path": "unused"}, engine_config={})
    with pytest.raises(NotImplementedError, match="sync_weights"):
        engine.get_per_tensor_param()
    with pytest.raises(NotImplementedError, match="register the loss on the server"):
        engine._processing(functools.partial(print))
    with pytest.raises(NotImplementedError, match="del_local_after_load=False"):
        engine.load_checkpoint("/tmp/anywhere")
    with pytest.raises(NotImplementedError, match="LoRA"):
        engine.disable_adapter()


def test_verls_rollout_temperature_reaches_the_trainers_log_probs(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl scales the logits by its rollout temperature: the client's fwd_no_grad and fwd_bwd get the same one."""
    import arctic_rl.integrations.verl as plugin
    from arctic_rl.client import SyncArcticRLClient

    sent: list[tuple[str, dict[str, Any]]] = []

    class RecordingTransport:
        def call_sync(self, op: str, arguments: dict[str, Any]) -> Any:
            sent.append((op, arguments))
            return {"logprobs": torch.zeros(1, 2)} if op == "fwd_no_grad" else {"loss": 0.5, "metrics": {}}

    # The layout mapping is tested in test_verl_mapping.py; here only what reaches the client matters.
    monkeypatch.setattr(plugin, "to_client_batch", lambda data, training: {"input_ids": "mapped"})
    monkeypatch.setattr(plugin, "to_verl_token_values", lambda values, data: values)
    engine = ArcticTrainingEngine(model_config={"path": "unused"}, engine_config={})
    engine._client = SyncArcticRLClient(RecordingTransport())  # type: ignore[arg-type]
    data = tu.get_tensordict({"input_ids": torch.ones(1, 2, dtype=torch.long)})
    tu.assign_non_tensor(data, temperature=0.7)
    engine.forward_backward_batch(data, None, forward_only=True)
    actor = ActorConfig(strategy="arctic", rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1)
    engine.forward_backward_batch(data, functools.partial(ppo_loss, config=actor))
    assert [(op, arguments["temperature"]) for op, arguments in sent] == [("fwd_no_grad", 0.7), ("fwd_bwd", 0.7)]
