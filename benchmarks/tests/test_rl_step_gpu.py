"""``rl_step_gpu.py`` without a GPU: its ideal step against docs/performance.md's numbers, the TRL settings it
translates, and its ``--cpu-smoke`` run through the real engines (the path the GPU run takes, minus sleep / wake,
which vLLM's CPU build refuses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_user import cpu_user_environment

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))
sys.path.insert(0, str(BENCHMARKS.parent / "recipes"))

pytest.importorskip("arctic_rl")

import rl_step_gpu  # noqa: E402
from zorro_train import QWEN3_4B  # noqa: E402


def test_the_ideal_training_phase_is_zorros_flop_bound() -> None:
    # docs/performance.md: Qwen3-4B shape, P=8192 G=16 R=512: S_FLOP = 7.32 (non-deduplicated over deduplicated F).
    shape = rl_step_gpu.StepShape(prompts=8, group=16, prompt_tokens=8192, response_tokens=512, model=dict(QWEN3_4B))
    ideal = rl_step_gpu.ideal_phases(shape, matmul_flops_per_s=1.0, copy_bytes_per_s=1.0)
    counts = rl_step_gpu.model_parameters(shape.model)
    attention = 4 * 32 * 128 * 36
    samples, length = 8 * 16, 8192 + 512
    baseline = samples * (length * 6 * counts["layers"] + length**2 / 2 * attention * 3.5 + 512 * 6 * counts["logits"])
    assert baseline / ideal["train"] == pytest.approx(7.32, abs=0.005)
    # Sync: the bf16 weights once (tied embeddings counted once); no sleep / wake or log-prob pass in the ideal.
    assert ideal["sync"] == pytest.approx(2 * counts["total"]) and counts["total"] < 4.1e9
    assert ideal["log_prob"] == ideal["sleep_wake"] == 0.0
    # Generation reads at least the weights once per decode step and the prompts' KV once per group.
    assert ideal["generate"] > 512 * 2 * counts["layers"]
    faster = rl_step_gpu.ideal_phases(shape, matmul_flops_per_s=2.0, copy_bytes_per_s=2.0)
    assert all(faster[name] == pytest.approx(ideal[name] / 2) for name in ideal)


def test_trl_runs_the_same_step_with_vllm_colocated() -> None:
    shape = rl_step_gpu.gpu_shape()
    settings = rl_step_gpu.run_settings(shape, steps=4, lr=1e-5)
    assert (settings.prompts_per_step, settings.group, settings.max_tokens) == (8, 16, 512)
    assert settings.prompt_padding + rl_step_gpu.QUESTION_BYTES == 8192
    config = rl_step_gpu.trl_gpu_config(settings, shape)
    # One generation of 8 x 16 completions per optimizer step, 16 (one group) per micro-batch.
    assert config["per_device_train_batch_size"] * config["steps_per_generation"] == 128
    assert config["gradient_accumulation_steps"] == config["steps_per_generation"] == 8
    assert config["num_generations"] == 16 and config["num_iterations"] == 1
    assert config["use_vllm"] and config["vllm_mode"] == "colocate" and config["vllm_enable_sleep_mode"]
    assert config["bf16"] and not config["use_cpu"] and config["learning_rate"] == 1e-5
    assert config["generation_kwargs"] == {"min_tokens": 512} and config["max_completion_length"] == 512
    # Every transformer layer has the 4B shape; only the vocabulary is the byte tokenizer's.
    layer_keys = set(QWEN3_4B) - {"vocab_size", "tie_word_embeddings", "max_position_embeddings"}
    assert {key: shape.model[key] for key in layer_keys} == {key: QWEN3_4B[key] for key in layer_keys}
    assert shape.model["vocab_size"] == rl_step_gpu.BYTE_VOCABULARY


@pytest.mark.slow
def test_cpu_smoke_runs_each_phase_through_the_engines(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "rl_step_gpu.py"), "--cpu-smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=cpu_user_environment(),
        timeout=1200,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "rl_step_gpu.json").read_text())
    assert result["meta"]["note"].startswith("CPU smoke run")
    assert result["runs"].keys() == {"split", "split_no_dedup", "colocated"}, result["runs"]
    assert all("error" not in run for run in result["runs"].values()), result["runs"]
    for side in ("split", "split_no_dedup", "colocated"):
        rows = [row for row in result["rows"] if row["side"] == side]
        assert [row["step"] for row in rows] == [0, 1], result["runs"]
        for row in rows:
            assert set(row["phases"]) == set(rl_step_gpu.PHASES)
            assert row["phases"]["generate"] > 0 and row["phases"]["train"] > 0 and row["phases"]["sync"] > 0
            assert row["trajectories"] == 8 and row["response_tokens"] == 8 * 8
    # ZoRRO ran each prompt once for its 4 samples in the dedup run, never in the other.
    assert all(row["zorro_savings"] > 0.5 for row in result["rows"] if row["side"] in ("split", "colocated"))
    # The colocated order's sleeps and wakes ran (and are counted as such), the split runs have none.
    assert all(row["phases"]["sleep_wake"] > 0 for row in result["rows"] if row["side"] == "colocated")
    assert all(row["phases"]["sleep_wake"] == 0 for row in result["rows"] if row["side"] != "colocated")
    assert all(row["zorro_savings"] == 0 for row in result["rows"] if row["side"] == "split_no_dedup")
    summary = result["summary"]
    assert summary["headline_variant"] == "colocated" and 0 < summary["sync_and_sleep_share"] < 1
    assert summary["ideal_fraction"] > 0 and "vs_trl_speedup" not in summary
    assert (tmp_path / "rl_step_gpu.png").stat().st_size > 10_000


def _run(side: str, rewards: list[float], model: dict[str, int]) -> dict[str, object]:
    phases = dict.fromkeys(rl_step_gpu.PHASES, 1.0)
    rows = [
        {"side": side, "step": step, "reward": reward, "trajectories": 128, "seconds": 5.0, "phases": phases}
        for step, reward in enumerate(rewards)
    ]
    return {
        "meta": {"commit": side},
        "settings": {"shape": {"model": model}},
        "ideal_phases": dict.fromkeys(rl_step_gpu.PHASES, 0.5),
        "runs": {side: {"setup_seconds": 1.0}},
        "rows": rows,
    }


def test_merge_joins_ours_and_trls_runs_from_separate_calls(tmp_path: Path) -> None:
    ours, trl = tmp_path / "ours.json", tmp_path / "trl.json"
    ours.write_text(json.dumps(_run("colocated", [0.4, 0.5, 0.6], {"hidden_size": 2048})))
    trl.write_text(json.dumps(_run("trl", [0.4, 0.45], {"hidden_size": 2048})))
    assert rl_step_gpu.main(["--merge", str(ours), str(trl), "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "rl_step_gpu.json").read_text())
    assert [row["side"] for row in merged["rows"]] == ["colocated"] * 3 + ["trl"] * 2
    assert merged["runs"].keys() == {"colocated", "trl"}
    # Both sides: 128 trajectories in 5 s per step after the first.
    assert merged["summary"]["vs_trl_speedup"] == pytest.approx(1.0)
    assert merged["sides"]["colocated"]["reward_last"] == 0.6
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_run("trl", [0.4, 0.45], {"hidden_size": 2560})))
    with pytest.raises(SystemExit, match="different shapes"):
        rl_step_gpu.main(["--merge", str(ours), str(other), "--out", str(tmp_path / "bad")])
