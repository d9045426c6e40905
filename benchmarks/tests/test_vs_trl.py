"""The pieces of ``vs_trl.py`` that need no TRL: the settings TRL gets, the prompts, the summary, and the reward
that ``vs_trl_peer.py`` restates for TRL's environment (it must score exactly as the main job's does)."""

from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

import vs_trl
import vs_trl_peer
from grpo_parity import RunSettings, make_prompts, parity_reward

pytest.importorskip("arctic_rl")

# Byte tokens of both parities, the special tokens (256-258), ids past the tokenizer (259-319), empty, one token.
COMPLETIONS: list[list[int]] = [
    [],
    [2],
    [3],
    [2, 4, 7, 9],
    [1, 3, 5, 256],
    [65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76],
    [258, 257, 256],
    [300, 319, 259, 10, 11],
    [255, 254, 0, 1],
]


@pytest.mark.parametrize("parity", ["even", "odd"])
def test_the_peer_reward_scores_exactly_as_the_main_jobs(parity: str) -> None:
    for completion in COMPLETIONS:
        assert vs_trl_peer.parity_reward(parity, completion) == parity_reward(parity, completion), completion
    with pytest.raises(ValueError, match="parity must be"):
        vs_trl_peer.parity_reward("prime", [2])


def test_the_reward_function_trl_gets_scores_its_batch_and_logs_each_step() -> None:
    ticks = iter([10.0, 10.2])
    log = vs_trl_peer.StepLog(clock=lambda: next(ticks))
    reward = log.reward_function()
    parities = ["even", "odd"] * (len(COMPLETIONS) // 2) + ["even"]
    # As GRPOTrainer calls it: prompts, decoded completions, ids (up to the first end of text), dataset columns.
    got = reward(
        prompts=["p"] * len(COMPLETIONS),
        completions=["text"] * len(COMPLETIONS),
        completion_ids=COMPLETIONS,
        parity=parities,
        trainer_state=None,
    )
    assert got == [parity_reward(parity, ids) for parity, ids in zip(parities, COMPLETIONS, strict=True)]
    assert reward.__name__ == "parity"
    log.seconds.append(0.5)
    (row,) = log.rows()
    # The step began at 10.0 and the reward call came at 10.2: 0.2 s of generation, the rest training.
    assert row == {
        "step": 0,
        "reward": pytest.approx(sum(got) / len(got)),
        "seconds": 0.5,
        "trajectories": len(COMPLETIONS),
        "response_tokens": sum(map(len, COMPLETIONS)),
        "phases": {"generate": pytest.approx(0.2), "train": pytest.approx(0.3)},
    }
    # A second reward call in the same optimizer step means TRL regenerated mid-step: the rows would not pair up.
    log.clock = lambda: 11.0
    reward(completions=[], completion_ids=[[2]], parity=["even"])
    with pytest.raises(RuntimeError, match="one generation batch per step"):
        log.rows()


def test_trl_gets_the_main_jobs_settings() -> None:
    settings = replace(RunSettings(), steps=7, prompts_per_step=3, group=5, max_tokens=9, lr=3e-3, seed=4)
    config = vs_trl.trl_config(settings)
    # One optimizer step per step's batch: prompts_per_step prompts x group completions, generated once, used once.
    assert config["per_device_train_batch_size"] == 15 and config["num_generations"] == 5
    assert config["gradient_accumulation_steps"] == config["steps_per_generation"] == config["num_iterations"] == 1
    assert (config["max_steps"], config["max_completion_length"], config["seed"]) == (7, 9, 4)
    assert config["temperature"] == settings.temperature and (config["top_p"], config["top_k"]) == (1.0, 0)
    # The engines' AdamW and clipping as the main job configures them, at a constant learning rate.
    assert config["learning_rate"] == 3e-3 and config["lr_scheduler_type"] == "constant"
    assert config["optim"] == "adamw_torch" and config["max_grad_norm"] == 1.0
    assert (config["adam_beta1"], config["adam_beta2"], config["adam_epsilon"]) == (0.9, 0.999, 1e-8)
    assert config["weight_decay"] == 0.0 and config["warmup_steps"] == 0
    # The grpo loss: token-mean over the step's tokens, clip 0.2 both ways, group-std advantages, no KL.
    assert (config["loss_type"], config["scale_rewards"], config["importance_sampling_level"]) == (
        "dapo",
        "group",
        "token",
    )
    assert (config["epsilon"], config["epsilon_high"], config["beta"]) == (0.2, 0.2, 0.0)
    # The prompts in the order the main job draws them, on the CPU in fp32.
    assert config["shuffle_dataset"] is False and config["use_cpu"] is True and config["bf16"] is False
    assert config["model_init_kwargs"] == {"dtype": "float32"}


def test_the_prompts_are_every_step_of_the_main_job_in_order() -> None:
    settings = replace(RunSettings(), steps=3, prompts_per_step=4, seed=2)
    prompts = vs_trl.step_prompts(settings)
    rng = random.Random(2)
    assert prompts == [prompt for _ in range(3) for prompt in make_prompts(rng, 4)]
    # Each step's four prompts are distinct draws (TRL groups num_generations completions per dataset row).
    assert len(prompts) == 12 and len({text for text, _ in prompts}) == 12


def test_the_shared_prompt_regime_shares_long_prompts_on_a_wider_model() -> None:
    tiny, tiny_shape = vs_trl.regime_settings("tiny")
    settings, shape = vs_trl.regime_settings("shared_prompts")
    assert tiny == RunSettings() and tiny_shape == {}
    # As many trajectories a step as the tiny regime, in groups of 16 that share a prompt of 512+ tokens.
    assert settings.prompts_per_step * settings.group == tiny.prompts_per_step * tiny.group
    assert settings.group == 16 and settings.prompt_padding >= 512
    assert shape["hidden_size"] >= 256 and shape["num_hidden_layers"] >= 4
    # The wider model trains at the learning rate the main job gives it (it collapses at the tiny model's);
    # everything else (optimizer, loss, response length, steps' seeds) stays the main job's.
    assert settings.lr == vs_trl.GPU_MODEL_LR < tiny.lr
    assert replace(settings, prompts_per_step=4, group=8, prompt_padding=0, steps=tiny.steps, lr=tiny.lr) == tiny
    prompts = vs_trl.step_prompts(replace(settings, steps=2))
    assert len(prompts) == 2 * settings.prompts_per_step
    # One byte is one token of the byte tokenizer: each prompt is padding + its ~35-byte question.
    assert all(len(text.encode()) > settings.prompt_padding for text, _ in prompts)
    assert vs_trl.regime_settings("shared_prompts", steps=3)[0].steps == 3
    # --no-fca: the same settings, sampled without FCA.
    for regime, with_fca in (("tiny", tiny), ("shared_prompts", settings)):
        without, same_shape = vs_trl.regime_settings(regime, fca=False)
        assert with_fca.fca and not without.fca and replace(without, fca=True) == with_fca
        assert same_shape == (tiny_shape if regime == "tiny" else shape)
    with pytest.raises(ValueError, match="regime must be one of"):
        vs_trl.regime_settings("huge")


def _rows(side: str, rewards: list[float], seconds: float, trajectories: int = 32) -> list[dict[str, Any]]:
    return [
        {
            "side": side,
            "step": step,
            "reward": reward,
            "seconds": seconds,
            "trajectories": trajectories,
            "response_tokens": 12 * trajectories,
        }
        for step, reward in enumerate(rewards)
    ]


def test_summary_compares_throughput_and_the_last_steps_reward() -> None:
    rows = _rows("ours", [0.4, 0.5, 0.6, 0.9, 1.0], 0.25) + _rows("trl", [0.4, 0.4, 0.5, 0.5, 0.7], 1.0)
    summary = vs_trl.summarize(rows, window=2)
    assert summary["trajectories_per_s_ours"] == pytest.approx(128.0)
    assert summary["trajectories_per_s_trl"] == pytest.approx(32.0)
    assert summary["vs_trl_speedup"] == pytest.approx(4.0)
    assert summary["response_tokens_per_s_ours"] == pytest.approx(12 * 128.0)
    assert summary["reward_ours"] == pytest.approx(0.95) and summary["reward_trl"] == pytest.approx(0.6)
    assert summary["reward_first_ours"] == pytest.approx(0.45) and summary["reward_first_trl"] == pytest.approx(0.4)
    assert summary["steps_ours"] == summary["steps_trl"] == 5.0
    # A slower side gives a ratio below 1; the steps' seconds are summed, not averaged per step.
    uneven = _rows("ours", [0.5] * 2, 2.0) + _rows("trl", [0.5], 1.0) + _rows("trl", [0.5], 3.0)
    uneven_summary = vs_trl.summarize(uneven, window=1)
    assert uneven_summary["vs_trl_speedup"] == pytest.approx(1.0)
    # Without the first step (warm-up): ours 32 / 2 s, TRL 32 / 3 s.
    assert uneven_summary["vs_trl_speedup_after_first"] == pytest.approx(1.5)
    assert summary["vs_trl_speedup_after_first"] == pytest.approx(4.0)
    with pytest.raises(ValueError, match="fewer than the window"):
        vs_trl.summarize(rows, window=6)


def test_the_results_file_keeps_each_regimes_block() -> None:
    tiny_rows = _rows("ours", [0.4, 0.9], 0.5) + _rows("trl", [0.4, 0.8], 0.25)
    shared_rows = _rows("ours", [0.4, 0.6], 1.0) + _rows("trl", [0.4, 0.5], 4.0)
    blocks = {
        regime: {"settings": {"regime": regime}, "load": {}, "ran": {"date": "d", "commit": "c"}, "rows": rows,
                 "summary": vs_trl.summarize(rows, window=1)}
        for regime, rows in (("tiny", tiny_rows), ("shared_prompts", shared_rows))
    }  # fmt: skip
    result = vs_trl.file_from_blocks({"date": "d", "commit": "c"}, blocks)
    # The tiny regime where the file always had it; the shared one beside it, its headline in the summary.
    assert result["rows"] == tiny_rows and result["summary"]["vs_trl_speedup"] == pytest.approx(0.5)
    assert result["summary"]["vs_trl_speedup_shared_prompts"] == pytest.approx(4.0)
    assert result["shared_prompts"]["rows"] == shared_rows
    assert vs_trl.blocks_from_file(json.loads(json.dumps(result))) == blocks
    alone = vs_trl.file_from_blocks({}, {"shared_prompts": blocks["shared_prompts"]})
    assert "rows" not in alone and set(alone["summary"]) == {
        f"{key}_shared_prompts" for key in vs_trl.SHARED_SUMMARY_KEYS
    }


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("ARCTIC_TRL_PYTHON"), reason="needs ARCTIC_TRL_PYTHON (nox -s vs_trl)")
def test_smoke_run_of_both_sides(tmp_path: Path) -> None:
    assert vs_trl.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "vs_trl.json").read_text())
    assert [row["side"] for row in result["rows"]] == ["ours"] * 3 + ["trl"] * 3
    assert [row["side"] for row in result["shared_prompts"]["rows"]] == ["ours"] * 3 + ["trl"] * 3
    assert result["summary"]["vs_trl_speedup"] > 0 and result["meta"]["versions"]["trl"]
    assert result["summary"]["vs_trl_speedup_shared_prompts"] > 0
    assert (tmp_path / "vs_trl.png").stat().st_size > 10_000
