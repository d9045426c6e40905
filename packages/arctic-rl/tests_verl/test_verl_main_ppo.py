"""verl's own trainer, ``python -m verl.trainer.main_ppo``, runs GRPO steps with the Arctic engine and replica against
the running arctic-rl server, on the CPU: a tiny parquet dataset and a rule reward made here, two steps with GRPO's
KL loss to the reference policy (the server's reference engine), and after each update the samplers hold the
trainer's weights (synced inside the server by ``ArcticCheckpointEngineManager``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from arctic_rl import ArcticRLClientConfig
from arctic_rl.client import SyncArcticRLClient, create_arctic_rl_client
from arctic_rl.integrations.verl_platform import PLATFORM
from arctic_rl.integrations.verl_weights import MANAGER_CLASS

EXACT = 1e-5  # fp32 agreement, the project's bound
MAIN_PPO_S = 420
STEPS = 2
# verl's RLHF dataset renders prompts with the tokenizer's chat template; the byte tokenizer has none.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
# A rule reward with spread inside every group of samples, so GRPO's advantages (and the update) are not zero.
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return sum(ord(character) % 2 for character in solution_str) / max(len(solution_str), 1)
"""


def write_task(root: Path, model_dir: Path) -> dict[str, Path]:
    """The model's config and tokenizer with a chat template, a parquet of prompts and the reward's file."""
    model = root / "model"
    shutil.copytree(model_dir, model)
    tokenizer_config = model / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(json.dumps({**settings, "chat_template": CHAT_TEMPLATE}))
    rows = [
        {
            "data_source": "arctic_parity",
            "prompt": [{"role": "user", "content": f"sample {index}:"}],
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {"index": index},
        }
        for index in range(8)
    ]
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    pd.DataFrame(rows[:2]).to_parquet(root / "val.parquet")
    (root / "reward.py").write_text(REWARD)
    return {"model": model, "train": root / "train.parquet", "val": root / "val.parquet", "reward": root / "reward.py"}


def main_ppo_command(task: dict[str, Path], output: Path) -> list[str]:
    """The launch command of the README's verl section: GRPO, batch 2 x 2 samples, two steps, no validation."""
    return [
        sys.executable, "-m", "verl.trainer.main_ppo",
        "trainer.use_v1=False", "trainer.device=cpu", "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={STEPS}", "trainer.logger=[console]", "trainer.val_before_train=False",
        "trainer.test_freq=-1", "trainer.save_freq=-1", f"trainer.default_local_dir={output}",
        f"data.train_files={task['train']}", f"data.val_files={task['val']}", "data.train_batch_size=2",
        "data.max_prompt_length=16", "data.max_response_length=6",
        f"actor_rollout_ref.model.path={task['model']}",
        "actor_rollout_ref.actor.strategy=arctic", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        # GRPO's usual KL loss to the reference policy: the server's reference engine (log_prob_gpus=1).
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.name=arctic", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        f"+actor_rollout_ref.rollout.checkpoint_manager_class={MANAGER_CLASS}",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        f"reward.custom_reward_function.path={task['reward']}", "reward.custom_reward_function.name=compute_score",
        "ray_kwargs.ray_init.num_cpus=4", "+ray_kwargs.ray_init.num_gpus=1",
    ]  # fmt: skip


def step_metrics(log: str) -> list[dict[str, float]]:
    """verl's console logger prints ``step:N - name:value - ...`` once per step."""
    steps = []
    for line in re.findall(r"step:\d+ - .*", log):
        metrics: dict[str, float] = {}
        for item in line.split(" - "):
            name, _, value = item.rpartition(":")
            number = re.fullmatch(r"(?:np\.\w+\()?([-+0-9.e]+|nan|inf)\)?", value.strip())
            if number:
                metrics[name] = float(number.group(1))
        steps.append(metrics)
    return steps


def connect(port: int, model_dir: Path) -> SyncArcticRLClient:
    config = ArcticRLClientConfig(model_name=str(model_dir), comm_protocol="http", host="127.0.0.1", port=port)
    client = create_arctic_rl_client(config, blocking_calls=True)
    assert isinstance(client, SyncArcticRLClient)
    return client


def test_main_ppo_runs_grpo_steps_on_the_arctic_engines(server: dict[str, Any], tmp_path: Path) -> None:
    task = write_task(tmp_path, server["model_dir"])
    client = connect(server["port"], server["model_dir"])
    before = client.weight_norm()["training_norm"]
    environment = {
        name: value for name, value in os.environ.items() if name not in ("CUDA_VISIBLE_DEVICES", "RAY_ADDRESS")
    }
    # verl's processes: the plugin, the CPU platform, and the server's address; Ray's logical GPUs need
    # CUDA_VISIBLE_DEVICES unset (Ray refuses GPUs when it names none).
    environment |= {
        "VERL_USE_EXTERNAL_MODULES": "arctic_rl.integrations.verl",
        "VERL_PLATFORM": PLATFORM,
        "ARCTIC_RL_PROTOCOL": "http",
        "ARCTIC_RL_HOST": "127.0.0.1",
        "ARCTIC_RL_PORT": str(server["port"]),
        "HYDRA_FULL_ERROR": "1",
    }
    try:
        run = subprocess.run(
            main_ppo_command(task, tmp_path / "checkpoints"),
            env=environment,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=MAIN_PPO_S,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"main_ppo did not finish within {MAIN_PPO_S} s:\n{str(error.stdout)[-6000:]}")
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"main_ppo exited {run.returncode}:\n{log[-12000:]}"

    steps = step_metrics(log)
    assert len(steps) == STEPS, f"expected {STEPS} step lines, got {len(steps)}:\n{log[-6000:]}"
    for number, metrics in enumerate(steps, start=1):
        assert metrics["training/global_step"] == number
        # Sampler and trainer agree on the sampled tokens at every step: the samplers hold the weights of the last
        # update (step 2 samples after step 1's sync).
        assert metrics["training/rollout_probs_diff_max"] <= EXACT, (number, metrics)
        assert math.isfinite(metrics["actor/grad_norm"])
        assert metrics["response_length/mean"] == 6
    assert any(metrics["actor/grad_norm"] > 0 for metrics in steps), "no step moved the weights"
    # The KL loss reads the server's reference engine, which keeps the initial weights: zero before the first
    # update (policy == reference), positive after it (only the policy moved).
    assert all("timing_s/ref" in metrics for metrics in steps), "verl computed no reference log-probs"
    assert steps[0]["actor/kl"] <= EXACT, steps[0]["actor/kl"]
    assert steps[1]["actor/kl"] > 1e-4, steps[1]["actor/kl"]

    norms = client.weight_norm()
    assert norms["training_norm"] != pytest.approx(before, rel=1e-12), "the trainer's weights did not change"
    assert norms["sampling_norm"] == pytest.approx(norms["training_norm"], rel=1e-15), "the last update was not synced"
    client.shutdown()
