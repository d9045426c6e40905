"""ZoRRO through arctic-rl's DeepSpeed training engine: one RL step (fwd+bwd of the GRPO loss and the optimizer step),
ZoRRO on vs off, against the FLOP bound of the same batch.

The kernel-level benchmark (zorro_train.py) times the model's forward and backward alone; this one times what a user
runs: ``TrainingEngine.fwd_bwd`` (micro-batching by token budget, the loss, DeepSpeed's backward) plus
``TrainingEngine.step`` (ZeRO-2 reduction, clipping, AdamW). Goal: speedup >= 0.95 of the FLOP bound, i.e. the engine
loses nothing of the kernel-level result (``summary.engine_zorro_efficiency``).

Each variant runs in its own process (a fresh CUDA context and process group): the parent writes one random-init
bf16 model of the Qwen3-4B layer shape to disk, the children load it through the engine, warm up and time.

    python benchmarks/rl_engine.py                 # GPU: Qwen3-4B layer shape, P=8192 G=16 R=512
    python benchmarks/rl_engine.py --smoke         # CPU: a tiny model, checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import default_out_dir, print_table, write_results
from zorro_train import QWEN3_4B, TINY, group_batch

NAME = "rl_engine"
GOAL = 0.95


def build_model_dir(directory: Path, layers: int, smoke: bool) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    from arctic_rl.testing import build_byte_tokenizer

    shape = dict(TINY if smoke else QWEN3_4B, num_hidden_layers=layers)
    if smoke:
        shape["vocab_size"] = 320
    config = Qwen3Config(**shape)
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if smoke else torch.bfloat16)
    model.save_pretrained(directory)
    build_byte_tokenizer().save_pretrained(directory)
    return directory


def time_variant(model_dir: str, zorro: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Child process: one engine, warm-up, then ``args.repeats`` timed steps (fwd_bwd + step)."""
    from arctic_rl.config import ArcticRLClientConfig
    from arctic_rl.engines.training import TrainingEngine

    cuda = torch.cuda.is_available() and not args.smoke
    config = ArcticRLClientConfig(
        model_name=model_dir,
        device="cuda" if cuda else "cpu",
        dtype="bfloat16" if cuda else "float32",
        training={
            "lr": 1e-6,
            "zero_stage": 2,
            "max_grad_norm": 1.0,
            "micro_batch_tokens": args.micro_batch_tokens,
            "gradient_checkpointing": args.gradient_checkpointing,
        },
        zorro_train={"enable": zorro},
    )
    engine = TrainingEngine(config)
    batch = group_batch([args.prompt], [[args.response] * args.group], engine.vocab_size, torch.device("cpu"))
    mask = batch["response_mask"]
    denominators = {"global_tokens": float(mask.sum()), "global_sequences": float((mask.sum(1) > 0).sum())}

    split: dict[str, list[float]] = {"fwd_bwd": [], "optimizer": []}

    def one_step() -> dict[str, Any]:
        start = time.perf_counter()
        reply = engine.fwd_bwd(batch, loss_name="grpo", loss_config={}, **denominators)
        if cuda:
            torch.cuda.synchronize()
        middle = time.perf_counter()
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        split["fwd_bwd"].append(middle - start)
        split["optimizer"].append(time.perf_counter() - middle)
        return reply

    for _ in range(args.warmup):
        one_step()
    split = {"fwd_bwd": [], "optimizer": []}
    seconds = []
    reply: dict[str, Any] = {}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        reply = one_step()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return {
        "zorro": zorro,
        "seconds": statistics.median(seconds),
        "seconds_min": min(seconds),
        "seconds_max": max(seconds),
        "fwd_bwd_seconds": statistics.median(split["fwd_bwd"]),
        "optimizer_seconds": statistics.median(split["optimizer"]),
        "micro_batches": reply.get("micro_batches"),
        "base_tokens": reply.get("base_tokens"),
        "dedup_tokens": reply.get("dedup_tokens"),
        "loss": reply.get("loss"),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def flop_bound(model_dir: Path, args: argparse.Namespace) -> tuple[float, float, float]:
    from transformers import AutoConfig

    from arctic_dedup.cost import ModelShape, dedup_cost

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
    cost = dedup_cost([(args.prompt, [args.response] * args.group)], ModelShape.from_module(model, config))
    return cost.flop_bound, cost.flops_base, cost.flops_dedup


def plot(results: Path, png: Path) -> None:
    """Stacked bars of the step's time split (forward+backward, optimizer step), ZoRRO off vs on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results.read_text())
    rows = [row for row in data["rows"] if "seconds" in row]
    labels = ["ZoRRO on" if row["zorro"] else "ZoRRO off" for row in rows]
    fwd_bwd = [row["fwd_bwd_seconds"] for row in rows]
    optimizer = [row["optimizer_seconds"] for row in rows]
    figure, axis = plt.subplots(figsize=(6, 3.6))
    axis.barh(labels, fwd_bwd, label="fwd_bwd (micro-batches, loss, backward)")
    axis.barh(labels, optimizer, left=fwd_bwd, label="step (ZeRO-2, clip, AdamW)")
    summary = data["summary"]
    axis.set_xlabel("seconds per RL step")
    axis.set_title(
        f"{summary['model']}, P={summary['prompt']} G={summary['group']} R={summary['response']}\n"
        f"speedup {summary.get('engine_speedup', float('nan')):.2f}x of a {summary['flop_bound']:.2f}x FLOP bound "
        f"(efficiency {summary.get('engine_zorro_efficiency', float('nan')):.3f})",
        fontsize=9,
    )
    axis.legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    figure.savefig(png, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    parser.add_argument("--layers", type=int, default=36, help="decoder layers of the Qwen3-4B layer shape")
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in the backward, both runs (36 layers need it to fit one GPU)",
    )
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot-from", type=Path, default=None, help="only draw the PNG from a results JSON")
    parser.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "ZORRO"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke and not args.child:
        args.layers, args.prompt, args.response, args.group = 2, 64, 8, 4
        args.micro_batch_tokens, args.warmup, args.repeats = 128, 1, 2
    if args.plot_from is not None:
        plot(args.plot_from, args.plot_from.with_suffix(".png"))
        return
    if args.child:
        print(json.dumps(time_variant(args.child[0], args.child[1] == "on", args)), flush=True)
        return

    out_dir = args.out or default_out_dir()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = build_model_dir(Path(scratch) / "model", args.layers, args.smoke)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        bound, flops_base, flops_dedup = flop_bound(model_dir, args)
        passthrough = ["--smoke"] if args.smoke else []
        for option in ("layers", "prompt", "response", "group", "micro_batch_tokens", "warmup", "repeats"):
            passthrough += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
        if args.gradient_checkpointing:
            passthrough.append("--gradient-checkpointing")
        for zorro in ("off", "on"):
            environment = dict(os.environ, DS_ACCELERATOR="cpu" if args.smoke else os.environ.get("DS_ACCELERATOR", ""))
            if not environment["DS_ACCELERATOR"]:
                environment.pop("DS_ACCELERATOR")
            result = subprocess.run(
                [sys.executable, __file__, *passthrough, "--child", str(model_dir), zorro],
                capture_output=True,
                text=True,
                env=environment,
                check=False,
            )
            if result.returncode != 0:
                rows.append({"zorro": zorro == "on", "error": result.stderr[-3000:]})
                print(result.stderr[-3000:], file=sys.stderr)
                continue
            row = json.loads(result.stdout.strip().splitlines()[-1])
            row["tflops"] = (flops_dedup if row["zorro"] else flops_base) / row["seconds"] / 1e12
            rows.append(row)
    timed = {row["zorro"]: row for row in rows if "seconds" in row}
    summary: dict[str, Any] = {
        "model": f"Qwen3-4B layer shape, {args.layers} layers" if not args.smoke else "tiny",
        "prompt": args.prompt,
        "response": args.response,
        "group": args.group,
        "flop_bound": bound,
        "goal": GOAL,
        "gradient_checkpointing": args.gradient_checkpointing,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
    }
    if True in timed and False in timed:
        speedup = timed[False]["seconds"] / timed[True]["seconds"]
        summary.update(
            {
                "engine_speedup": speedup,
                "engine_zorro_efficiency": speedup / bound,
                "seconds_off": timed[False]["seconds"],
                "seconds_on": timed[True]["seconds"],
            }
        )
    columns = ["zorro", "seconds", "fwd_bwd_seconds", "optimizer_seconds", "micro_batches", "tflops", "peak_gib"]
    print_table(rows, columns)
    print(json.dumps(summary, indent=1))
    if not args.smoke or args.out is not None:
        path = write_results(out_dir, NAME, summary, rows)
        if "engine_speedup" in summary:
            plot(path, path.with_suffix(".png"))
    if "engine_speedup" not in summary:
        sys.exit(1)


if __name__ == "__main__":
    main()
