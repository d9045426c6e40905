"""The main job: its task (prompts and reward, checked by hand), its summary, and a short run through the whole
stack on the CPU in which the reward must rise by at least 0.3 (on a 0-1 reward)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_user import cpu_user_environment
from grpo_parity import StepRecord, make_prompts, parity_reward, summarize

MAIN_JOB = Path(__file__).resolve().parents[1] / "grpo_parity.py"


def test_parity_reward_counts_bytes_of_the_asked_parity() -> None:
    assert parity_reward("even", [2, 4, 7, 9]) == 0.5
    assert parity_reward("odd", [1, 3, 5]) == 1.0
    assert parity_reward("odd", [2, 4, 6, 8]) == 0.0
    # Special tokens (ids >= 256, e.g. the end of text) are never a byte of either parity.
    assert parity_reward("even", [256, 258, 4]) == pytest.approx(1 / 3)
    assert parity_reward("even", []) == 0.0
    with pytest.raises(ValueError, match="parity must be one of"):
        parity_reward("prime", [2])


def test_prompts_alternate_parities_and_end_with_the_cue() -> None:
    prompts = make_prompts(random.Random(0), 6)
    assert [parity for _, parity in prompts] == ["even", "odd"] * 3
    for text, parity in prompts:
        assert text.endswith(f"bytes: {parity}")
    assert make_prompts(random.Random(0), 6) == prompts
    # Padding puts random letters first; the question and its cue stay at the end.
    padded = make_prompts(random.Random(0), 6, padding=40)
    for (text, parity), (short, _) in zip(padded, prompts, strict=True):
        filler, question = text.split(" ", 1)
        assert len(filler) == 40 and filler.isalpha() and question.endswith(f"bytes: {parity}")
        assert len(text) > len(short)


def _record(step: int, reward: float) -> StepRecord:
    seconds = {"generate": 2.0, "log_prob": 0.5, "train": 1.0, "sync": 0.5}
    return StepRecord(
        step=step,
        reward=reward,
        seconds=seconds,
        trajectories=8,
        response_tokens=40,
        zorro_savings=0.5,
        loss=0.0,
        grad_norm=1.0,
    )


def test_summary_compares_the_first_and_last_window() -> None:
    records = [_record(step, reward) for step, reward in enumerate([0.1, 0.3, 0.5, 0.5, 0.9, 0.7])]
    summary = summarize(records, window=2)
    assert summary["reward_first"] == pytest.approx(0.2)
    assert summary["reward_last"] == pytest.approx(0.8)
    assert summary["reward_gain"] == pytest.approx(0.6)
    assert summary["trajectories_per_s"] == pytest.approx(8 / 4.0)
    assert summary["response_tokens_per_s"] == pytest.approx(40 / 4.0)
    assert summary["seconds_generate"] == pytest.approx(2.0)
    # A window longer than half the run shrinks to half of it.
    assert summarize(records, window=10)["window"] == 3


@pytest.mark.slow
def test_the_main_job_learns_on_the_cpu(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(MAIN_JOB), "--steps", "30", "--expect-gain", "0.3", "--out", str(out)],
        capture_output=True,
        text=True,
        env=cpu_user_environment(),
        timeout=1200,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    summary = metrics["zorro_on"]["summary"]
    assert summary["steps"] == 30
    assert summary["reward_last"] - summary["reward_first"] >= 0.3
    assert summary["zorro_savings"] > 0.3  # 8 samples share each prompt: the trainer runs each prompt once
    # The samples of a prompt share its first full KV block: FCA reads it once for the group at most decode steps.
    assert summary["fca_steps_grouped_share"] > 0.5 and summary["fca_requests_grouped_share"] > 0.5
    assert "FCA: decode steps grouped" in result.stdout
    assert (out / "grpo_parity.png").stat().st_size > 10_000
    assert "reward gain" in result.stdout


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_the_main_job_places_the_engines_for_the_machine(gpus: int) -> None:
    # The GPU branches cannot run here (vLLM's CUDA build is not on the test machines): their configs must at least
    # be valid and place the engines as the docstring says (colocated on one GPU, split on two, CPU workers on none).
    pytest.importorskip("arctic_rl")
    from grpo_parity import RunSettings, client_config

    config = client_config("model-dir", RunSettings(), gpus)
    assert (config.training_gpus, config.sampling_gpus, config.log_prob_gpus) == (1, 1, 0)
    assert config.colocate is (gpus == 1)
    assert config.comm_protocol == "ray" and config.zorro_train.enable and config.fca.enable
    if gpus:
        assert config.sampling.gpu_memory_utilization == 0.3
    assert type(config).model_validate_json(config.model_dump_json()) == config


def test_no_gpus_means_the_cpu_also_where_a_gpu_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    # vs_trl and rl_step_gpu read the CPU config's training settings on GPU machines: 'auto' would resolve to cuda
    # there and refuse the CPU build's KV-cache size.
    pytest.importorskip("arctic_rl")
    import torch
    from grpo_parity import RunSettings, client_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = client_config("model-dir", RunSettings(), 0)
    assert config.resolved_device() == "cpu" and config.sampling.kv_cache_space_gib == 1


@pytest.mark.parametrize("matplotlib", [True, False], ids=["with-matplotlib", "without-matplotlib"])
def test_results_are_written_first_and_the_plot_is_optional(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], matplotlib: bool
) -> None:
    pytest.importorskip("transformers")
    if matplotlib:
        pytest.importorskip("matplotlib")
    else:
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: find_spec and import fail
    import grpo_parity

    # Step 0 is the slow one (the engines' warm-up), as in real runs.
    rewards = [0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9]
    records = [_record(step, reward) for step, reward in enumerate(rewards)]
    records[0].seconds["generate"] = 60.0
    monkeypatch.setattr(grpo_parity, "run", lambda settings, model_dir, **_: records)
    out = tmp_path / "run"
    assert grpo_parity.main(["--steps", str(len(records)), "--out", str(out), "--expect-gain", "0.3"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "metrics.json").read_text())["zorro_on"]["summary"]
    assert summary["reward_gain"] == pytest.approx(0.875 - 0.425)  # windows of 2 steps
    # Throughput with and without step 0: 8 trajectories a step, 4 s a step after step 0.
    assert summary["trajectories_per_s_after_step_0"] == pytest.approx(2.0)
    assert summary["trajectories_per_s"] == pytest.approx(64 / (62.0 + 7 * 4.0))
    assert (out / "grpo_parity.png").exists() is matplotlib
    assert ("matplotlib is not installed" in printed) is not matplotlib
    if matplotlib:
        assert (out / "grpo_parity.png").stat().st_size > 10_000


def test_the_summary_reports_fcas_share_of_the_decode_steps() -> None:
    records = [_record(step, 0.5) for step in range(4)]
    # Each step's counters are what it added: the run's shares come from their sums.
    records[1].extra = {
        "fca/steps": 10.0,
        "fca/steps_grouped": 10.0,
        "fca/requests": 100.0,
        "fca/grouped_requests": 0.0,
    }
    records[-1].extra = {
        "fca/steps": 30.0,
        "fca/steps_grouped": 20.0,
        "fca/requests": 300.0,
        "fca/grouped_requests": 100.0,
    }
    summary = summarize(records, window=1)
    assert summary["fca_decode_steps"] == 40.0
    assert summary["fca_steps_grouped_share"] == pytest.approx(0.75)
    assert summary["fca_requests_grouped_share"] == pytest.approx(0.25)
    assert "fca_decode_steps" not in summarize(records[:1], window=1)


@pytest.mark.parametrize(
    ("argv", "gpu_visible", "layers", "lr"),
    [
        ([], False, 2, 1e-2),
        ([], True, 4, 3e-3),
        (["--model", "gpu"], False, 4, 3e-3),
        (["--model", "tiny"], True, 2, 1e-2),
        (["--model", "gpu", "--lr", "5e-4"], False, 4, 5e-4),
    ],
    ids=["cpu-default", "gpu-default", "gpu-model-on-cpu", "tiny-model-on-gpu", "explicit-lr"],
)
def test_the_model_shape_brings_its_learning_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], gpu_visible: bool, layers: int, lr: float
) -> None:
    # The wider model collapses at the tiny model's learning rate (GPU_MODEL_LR's comment): the run must get the
    # learning rate that goes with the model it trains, and the written results must say which model that was.
    pytest.importorskip("transformers")
    import grpo_parity
    from transformers import AutoConfig

    seen: dict[str, object] = {}

    def fake_run(settings: object, model_dir: str, **_: object) -> list[StepRecord]:
        seen["settings"], seen["layers"] = settings, AutoConfig.from_pretrained(model_dir).num_hidden_layers
        return [_record(step, 0.5) for step in range(4)]

    monkeypatch.setattr(grpo_parity, "run", fake_run)
    monkeypatch.setattr(grpo_parity, "visible_gpus", lambda: 1 if gpu_visible else 0)
    monkeypatch.setattr(grpo_parity, "_gpu_name", lambda: "a GPU" if gpu_visible else None)
    out = tmp_path / "run"
    assert grpo_parity.main([*argv, "--steps", "4", "--out", str(out)]) == 0
    assert seen["layers"] == layers
    assert seen["settings"].lr == pytest.approx(lr)  # type: ignore[attr-defined]
    written = json.loads((out / "metrics.json").read_text())
    assert written["settings"]["lr"] == pytest.approx(lr)
    assert written["model"]["num_hidden_layers"] == layers
    assert written["model"]["shape"] == ("gpu" if layers == 4 else "tiny")
