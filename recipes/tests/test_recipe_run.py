"""A two-step GSM8K run on the CPU with the real engines (Ray, DeepSpeed, vLLM's CPU build): a tiny random-init
Qwen3 with a chat template, GSM8K-format items from a JSONL file, the recipe's command line as a user types it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_user import cpu_user_environment
from recipe_fixtures import CHAT_TEMPLATE

pytest.importorskip("vllm")
pytest.importorskip("deepspeed")

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[1] / "gsm8k.py"
ITEMS = [
    {
        "question": f"Tom has {count} apples and buys {count + 1} more. How many apples?",
        "answer": f"#### {2 * count + 1}",
    }
    for count in range(1, 7)
]


def tiny_chat_model(directory: Path) -> Path:
    from transformers import AutoTokenizer

    from arctic_rl.testing import save_tiny_qwen3

    save_tiny_qwen3(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def test_two_gsm8k_steps_run_on_the_cpu(tmp_path: Path) -> None:
    model = tiny_chat_model(tmp_path / "tiny-qwen3")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    # fmt: off
    command = [
        sys.executable, str(RECIPE), "--model", str(model), "--data", str(data), "--eval-data", str(data),
        "--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--max-tokens", "8",
        "--max-prompt-tokens", "256", "--eval-every", "1", "--eval-prompts", "2", "--device", "cpu",
        "--lr", "1e-4", "--output", "run",
    ]
    # fmt: on
    result = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, env=cpu_user_environment(), timeout=900, check=False
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "training data: 6 prompts of 6 records" in result.stdout
    # The relative --output is the run directory under the working directory the command started in.
    document = json.loads((tmp_path / "run" / "metrics.json").read_text())
    steps = document["steps"]
    assert [step["step"] for step in steps] == [0, 1]
    for step in steps:
        assert step["trajectories"] == 8
        assert 0.0 <= step["reward_mean"] <= 1.0 and 0.0 <= step["eval_reward"] <= 1.0
        assert 1 <= step["response_tokens_mean"] <= 8
        # Four samples of each prompt: the trainer ran each prompt once instead of four times.
        assert step["dedup_savings"] > 0
        assert min(step["time_generate"], step["time_log_prob"], step["time_train"], step["time_sync"]) > 0
        # Equal rewards in every group (a random model's usual outcome) give zero advantages and no gradient.
        if step["reward_mean"] == 0:
            assert step["grad_norm"] == 0
        assert step["engine_metrics"]["time/generate"] > 0
    assert document["config"]["zorro_train"]["enable"] and document["config"]["training"]["lr"] == 1e-4
    assert document["summary"]["steps"] == 2 and document["summary"]["trajectories_per_s"] > 0
    assert "trajectories/s" in result.stdout and "generate / reward / log-prob / train / sync" in result.stdout
