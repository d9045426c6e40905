"""The recipes' loop with a scripted client (no engines): the calls of a step in order, rewards per sample, eval
cadence, the summary and metrics.json; the typed settings and the command line."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from gsm8k import GSM8K_LOOP, GSM8K_TASK, gsm8k_recipe
from recipe_data import Example, RecipeDataError
from recipe_loop import (
    EngineOptions,
    LoopSettings,
    engine_options,
    loop_overrides,
    prompt_batches,
    recipe_arguments,
    run_recipe,
)


class ScriptedClient:
    """Answers like the blocking client; the i-th sample of each group is right when i is even."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.generate_params: list[dict[str, Any]] = []

    def __enter__(self) -> ScriptedClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.calls.append("shutdown")

    def generate(self, prompts: Sequence[Sequence[int]], params: Mapping[str, Any]) -> list[list[dict[str, Any]]]:
        self.calls.append("generate")
        self.generate_params.append(dict(params))
        texts = ["\\boxed{4}", "\\boxed{5}"]
        return [
            [{"token_ids": [1, 2, 3], "logprobs": [-0.5] * 3, "text": texts[index % 2]} for index in range(params["n"])]
            for _ in prompts
        ]

    def fwd_no_grad(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        self.calls.append("fwd_no_grad")
        return {"logprobs": torch.zeros_like(batch["old_log_probs"])}

    def fwd_bwd(self, batch: Mapping[str, Any], processing: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append(f"fwd_bwd:{processing['loss_fn']}")
        assert torch.equal(batch["old_log_probs"], torch.zeros_like(batch["old_log_probs"]))
        return {"loss": 0.25, "metrics": {}}

    def step(self) -> dict[str, Any]:
        self.calls.append("step")
        metrics = {"time/generate": 1.0, "time/log_prob": 0.5, "time/train": 2.0, "zorro/savings": 0.75}
        return {"grad_norm": 0.5, "lr": 1e-6, "step": 1, "metrics": metrics}

    def sync_weights(self) -> dict[str, float]:
        self.calls.append("sync")
        return {}

    def sleep_inference(self) -> None:
        self.calls.append("sleep")

    def wake_inference(self) -> None:
        self.calls.append("wake")


def examples(count: int) -> list[Example[str]]:
    return [Example((10 + index, 11), f"prompt {index}", "4") for index in range(count)]


@pytest.mark.parametrize("colocate", [False, True])
def test_loop_runs_the_steps_and_writes_metrics(tmp_path: Path, colocate: bool) -> None:
    loop = LoopSettings(steps=3, prompts_per_step=2, group_size=4, max_tokens=8, eval_every=2, eval_prompts=3)
    recipe = gsm8k_recipe("tiny", engines=EngineOptions(colocate=colocate, device="cpu"), loop=loop)
    client = ScriptedClient()
    summary = run_recipe(
        recipe,
        GSM8K_TASK,
        examples(5),
        examples(4),
        pad_token_id=0,
        output_dir=tmp_path / "run",
        client_factory=lambda config, blocking_calls: client,
        show_progress=False,
    )
    train_step = ["generate", *(["sleep"] if colocate else []), "fwd_no_grad", "fwd_bwd:grpo", "step"]
    train_step += [*(["wake"] if colocate else []), "sync"]
    # Evaluation after steps 2 (every 2) and 3 (the last).
    assert client.calls == [*train_step, *train_step, "generate", *train_step, "generate", "shutdown"]
    assert client.generate_params[0] == {"n": 4, "max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "seed": 0}
    assert client.generate_params[2] == {"n": 1, "max_tokens": 8, "temperature": 0.0, "seed": 1}
    document = json.loads((tmp_path / "run" / "metrics.json").read_text())
    steps = document["steps"]
    assert [step["reward_mean"] for step in steps] == [0.5, 0.5, 0.5]
    # Evaluation takes the first sample of each of the first 3 evaluation prompts: all "\boxed{4}", all right.
    assert [step["eval_reward"] for step in steps] == [None, 1.0, 1.0]
    assert [step["trajectories"] for step in steps] == [8, 8, 8]
    assert steps[0]["dedup_savings"] == 0.75 and steps[0]["engine_metrics"]["time/train"] == 2.0
    phases = ("time_generate", "time_reward", "time_log_prob", "time_train", "time_sync")
    assert all(step["seconds"] == pytest.approx(sum(step[phase] for phase in phases)) for step in steps)
    assert document["config"]["colocate"] is colocate
    assert document["loop"]["group_size"] == 4
    assert summary.steps == 3 and summary.window == 1
    assert (summary.reward_first, summary.reward_last, summary.eval_reward_last) == (0.5, 0.5, 1.0)
    assert summary.time_generate == pytest.approx(sum(step["time_generate"] for step in steps))
    assert document["summary"]["trajectories_per_s"] == pytest.approx(summary.trajectories_per_s)
    assert "reward, last 1 steps" in summary.table()


def test_prompt_batches_cover_every_example_once_per_epoch() -> None:
    pool = examples(6)
    batches = prompt_batches(pool, 3, seed=7)
    epoch = [example.prompt_text for _ in range(2) for example in next(batches)]
    assert sorted(epoch) == sorted(example.prompt_text for example in pool)
    with pytest.raises(RecipeDataError, match="lower --prompts-per-step"):
        next(prompt_batches(pool, 7, seed=0))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"group_size": 1}, "group of one learns nothing"),
        ({"steps": 0}, "steps must be >= 1"),
        ({"temperature": 0.0}, "temperature > 0"),
        ({"eval_every": -1}, "eval_every"),
    ],
)
def test_loop_settings_refuse_settings_that_cannot_train(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoopSettings(**change)


def test_command_line_overrides_only_what_is_given() -> None:
    arguments = recipe_arguments("test").parse_args(
        ["--model", "m", "--data", "d.jsonl", "--steps", "5", "--temperature", "0.7", "--sampling-gpus", "8",
         "--ray-address", "auto", "--seed", "3"]
    )  # fmt: skip
    assert loop_overrides(arguments) == {"steps": 5, "temperature": 0.7, "seed": 3}
    engines = engine_options(arguments)
    assert engines == EngineOptions(sampling_gpus=8, ray_address="auto", seed=3)
    recipe = gsm8k_recipe("m", engines=engines)
    assert recipe.loop == GSM8K_LOOP
    assert (recipe.config.sampling_gpus, recipe.config.ray_address, recipe.config.seed) == (8, "auto", 3)
