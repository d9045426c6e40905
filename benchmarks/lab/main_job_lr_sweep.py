"""Does the main job's GPU model learn at a learning rate, for several seeds, with and without FCA, in float32 and
bfloat16? The question behind ``grpo_parity.GPU_MODEL_LR``: on the H100 (2026-12-07) the main job with FCA ended at
reward 0.5 with every sample of a group giving the same answer; a CPU rerun of the same model tells the recipe's
learning rate apart from FCA and from the GPU.

Each run is the main job's loop (``grpo_parity.run``) on the wider model (``--model gpu``), on the CPU, in its own
process (its own Ray and engines, ~1 minute on 2 cores):

    python benchmarks/lab/main_job_lr_sweep.py --seeds 0 1 2 3 --lrs 1e-2 3e-3 --fca on off --dtypes float32
    python benchmarks/lab/main_job_lr_sweep.py --smoke     # one 3-step run: checks the script

Writes ``results/main_job_gpu_model_lr_sweep_cpu.json`` (``--out``): every run's settings, rewards and gradient
norms, and a verdict per run: ``learned`` (last 5 steps' mean reward >= 0.8), ``collapsed`` (its last 5 steps all
had a gradient norm of 0: every group's samples earned the same reward) or ``neither``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

LAB = Path(__file__).resolve().parent
sys.path.insert(0, str(LAB.parents[1] / "recipes"))

import grpo_parity  # noqa: E402

WINDOW = 5
LEARNED_REWARD = 0.8


def run_one(seed: int, lr: float, fca: bool, dtype: str, steps: int) -> dict[str, Any]:
    """One main-job run of the GPU model on this machine's CPU; its rewards, gradient norms and verdict."""
    from arctic_rl.testing import save_tiny_qwen3

    build_config = grpo_parity.client_config

    def with_dtype(model_dir: str, settings: grpo_parity.RunSettings, gpus: int) -> Any:
        return build_config(model_dir, settings, gpus).model_copy(update={"dtype": dtype})

    grpo_parity.client_config = with_dtype
    settings = replace(grpo_parity.RunSettings(), steps=steps, seed=seed, lr=lr, fca=fca)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = str(save_tiny_qwen3(Path(scratch) / "model", seed=seed, **grpo_parity.GPU_MODEL))
        records = grpo_parity.run(settings, model_dir, progress=False)
    rewards = [record.reward for record in records]
    grad_norms = [record.grad_norm for record in records]
    last = rewards[-WINDOW:]
    verdict = (
        "learned"
        if sum(last) / len(last) >= LEARNED_REWARD
        else "collapsed"
        if all(norm == 0.0 for norm in grad_norms[-WINDOW:])
        else "neither"
    )
    return {
        "settings": asdict(settings),
        "dtype": dtype,
        "summary": grpo_parity.summarize(records, WINDOW),
        "verdict": verdict,
        "rewards": rewards,
        "grad_norms": grad_norms,
        "zero_gradient_steps": sum(norm == 0.0 for norm in grad_norms),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument(
        "--lrs", type=float, nargs="+", default=[grpo_parity.RunSettings().lr, grpo_parity.GPU_MODEL_LR]
    )
    parser.add_argument("--fca", choices=("on", "off"), nargs="+", default=["on", "off"])
    parser.add_argument("--dtypes", choices=("float32", "bfloat16"), nargs="+", default=["float32"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None, help="default: results/main_job_gpu_model_lr_sweep_cpu.json")
    parser.add_argument("--smoke", action="store_true", help="one 3-step run, written to a temporary file")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process's run, as JSON
    args = parser.parse_args(argv)
    if args.one:
        spec = json.loads(args.one)
        print(json.dumps(run_one(**spec)))
        return 0
    if args.smoke:
        args.seeds, args.lrs, args.fca, args.dtypes, args.steps = (
            [0],
            [grpo_parity.GPU_MODEL_LR],
            ["on"],
            ["float32"],
            3,
        )
        args.out = args.out or Path(tempfile.mkdtemp()) / "smoke.json"
    args.out = args.out or LAB / "results" / "main_job_gpu_model_lr_sweep_cpu.json"
    runs = []
    for lr, dtype, seed, fca in itertools.product(args.lrs, args.dtypes, args.seeds, args.fca):
        spec = {"seed": seed, "lr": lr, "fca": fca == "on", "dtype": dtype, "steps": args.steps}
        child = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True, check=False
        )
        if child.returncode != 0:
            print(child.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"the run {spec} failed (exit {child.returncode}); its stderr is above.")
        result = json.loads(child.stdout.strip().splitlines()[-1])
        runs.append(result)
        print(
            f"lr {lr:g} {dtype} seed {seed} FCA {fca}: reward {result['summary']['reward_first']:.3f} -> "
            f"{result['summary']['reward_last']:.3f}, {result['zero_gradient_steps']} steps with gradient norm 0: "
            f"{result['verdict']}",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": grpo_parity.run_metadata(), "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
