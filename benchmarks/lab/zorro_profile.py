"""Where the time of a ZoRRO training step goes on the GPU: kernels by category, the GPU's idle share, top kernels.

Profiles one warm step of the deduplicated run (Qwen3-4B shape, P=8192, G=16, R=512, the tree-attention backend
given) and of the plain transformers + SDPA baseline over a few of the same samples, so the two can be compared per
category (matrix multiplies, attention, fused elementwise, copies, pack/unpack, the rest) and per useful FLOP.

With ``--model hybrid`` it profiles the Qwen3.5-like hybrid instead (full recompute in both runs by default;
``--recompute none`` as zorro_train.py's hybrid rows now run, where the dedup stream fits with the fused kernels; the
baseline is the packed path without sharing, as in zorro_train.py), with the Gated DeltaNet kernels as a category
of their own.

Run on the H200:  python benchmarks/lab/zorro_profile.py --out "$OUT"   (about a minute)
                  python benchmarks/lab/zorro_profile.py --model hybrid --time-despite-fla-640 --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

# The lab imports the shared harness and the main benchmarks from benchmarks/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import default_lab_out_dir, run_metadata
from zorro_train import (
    FLA_640_NOTE,
    PEAK_TFLOPS,
    Options,
    _cost_row,
    baseline_step,
    build_model,
    dedup_step,
    group_batch,
    hf_sdpa_step,
    lift_fla_640_guard_if_asked,
    select_samples,
)

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("pack/unpack", ("gather_rows", "segment_sum_rows", "scatter_copies")),
    # fla's kernels (chunk_gated_delta_rule_*, chunk_fwd_kernel_o, wy/solve_tril, l2norm, cumsum) and the conv
    (
        "gated delta",
        (
            "gated_delta",
            "chunk_fwd_kernel",
            "chunk_bwd_kernel",
            "wy_repr",
            "recompute_w_u",
            "solve_tril",
            "l2norm",
            "chunk_local_cumsum",
            # torch's depthwise conv kernels ("conv" alone would catch inductor's *_convert_element_type_* kernels)
            "depthwise",
            "causal_conv1d",
        ),
    ),
    ("attention", ("flex", "triton_tem", "fmha", "flash", "attn", "tree_", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "wgmma")),
    ("inductor fused", ("triton_",)),
    ("copies", ("copy", "memcpy", "memset", "cat", "index", "gather", "scatter")),
    ("elementwise/reduce", ("elementwise", "vectorized", "reduce", "unrolled", "softmax", "norm")),
)


def category(name: str) -> str:
    lowered = name.lower()
    for label, needles in CATEGORIES:
        if any(needle in lowered for needle in needles):
            return label
    return "other"


def profile_step(step: Any, model: Any, top_kernels: int = 30) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    step()  # warm-up: compiles, caches
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    wall_ms = start.elapsed_time(end)
    model.zero_grad(set_to_none=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        step()
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in profiler.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        microseconds = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        entry = per_kernel[event.name]
        entry[0] += microseconds / 1000
        entry[1] += 1
    kernel_ms = sum(ms for ms, _ in per_kernel.values())
    by_category: dict[str, float] = defaultdict(float)
    for name, (ms, _) in per_kernel.items():
        by_category[category(name)] += ms
    top = sorted(per_kernel.items(), key=lambda item: -item[1][0])[:top_kernels]
    return {
        "wall_ms": wall_ms,
        "kernel_ms": kernel_ms,
        "gpu_idle_fraction": max(0.0, 1 - kernel_ms / wall_ms),
        "by_category_ms": dict(sorted(by_category.items(), key=lambda item: -item[1])),
        "top_kernels": [{"name": name[:160], "ms": ms, "count": count} for name, (ms, count) in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_lab_out_dir())
    parser.add_argument("--backend", default="flex")
    parser.add_argument("--baseline-samples", type=int, default=2)
    parser.add_argument("--model", choices=["dense", "hybrid"], default="dense")
    parser.add_argument(
        "--fused-kernels",
        default="auto",
        choices=["auto", "never"],
        help="fused norms, conv, SwiGLU, log-prob chunk (ZorroSettings.fused_kernels); 'never': the torch code",
    )
    parser.add_argument(
        "--recompute",
        default="full",
        choices=["full", "none"],
        help="hybrid: gradient checkpointing of every layer (full) or none, in both runs",
    )
    parser.add_argument("--top", type=int, default=30, help="how many of the longest kernels to keep per run")
    parser.add_argument(
        "--time-despite-fla-640",
        action="store_true",
        help="hybrid: profile fla's gated kernels even where fla refuses them as miscompiled (timing only)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("zorro_profile: needs a CUDA GPU; nothing measured.")
        return
    hybrid = args.model == "hybrid"
    options = Options(
        device=torch.device("cuda"), repeats=1, quick=True, smoke=False, time_despite_fla_640=args.time_despite_fla_640
    )
    timing_only = hybrid and lift_fla_640_guard_if_asked(options)
    model = build_model(args.model, options)
    if hybrid and args.recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompts, responses = [8192], [[512] * 16]
    batch = group_batch(prompts, responses, model.config.vocab_size, options.device)
    cost, _ = _cost_row(model, prompts, responses)
    dedup = profile_step(dedup_step(model, batch, args.backend, fused_kernels=args.fused_kernels), model, args.top)
    dedup["tflops"] = cost.flops_dedup / dedup["wall_ms"] / 1e9
    dedup["mfu"] = dedup["tflops"] / PEAK_TFLOPS
    few = args.baseline_samples
    samples = select_samples(batch, list(range(few)))
    if hybrid:
        baseline_run = baseline_step(model, samples, "sdpa", 1, args.fused_kernels)
    else:
        baseline_run = hf_sdpa_step(model, samples, args.fused_kernels)
    baseline = profile_step(baseline_run, model, args.top)
    baseline["scaled_to_samples"] = 16
    baseline["tflops"] = cost.flops_base * few / 16 / baseline["wall_ms"] / 1e9
    baseline["mfu"] = baseline["tflops"] / PEAK_TFLOPS
    results: dict[str, Any] = {
        "meta": run_metadata(),
        "model": args.model,
        "recompute": args.recompute if hybrid else "none",
        "backend": args.backend,
        "fused_kernels": args.fused_kernels,
        "dedup": dedup,
        f"baseline_{few}_samples": baseline,
    }
    if timing_only:
        results["timing_only"] = FLA_640_NOTE
    args.out.mkdir(parents=True, exist_ok=True)
    name = "zorro_profile_hybrid" if hybrid else "zorro_profile"
    if hybrid and args.fused_kernels != "auto":
        name += f"_fused_{args.fused_kernels}"
    if hybrid and args.recompute == "none":
        name += "_no_recompute"
    path = args.out / f"{name}.json"
    path.write_text(json.dumps(results, indent=1))
    baseline_label = f"packed baseline x{few}" if hybrid else f"hf sdpa x{few}"
    for label, result in (("dedup", dedup), (baseline_label, baseline)):
        print(
            f"{label}: wall {result['wall_ms']:.1f} ms, kernels {result['kernel_ms']:.1f} ms, "
            f"idle {result['gpu_idle_fraction']:.1%}, {result['tflops']:.0f} TFLOP/s ({result['mfu']:.1%})"
        )
        for name, ms in result["by_category_ms"].items():
            print(f"   {name:20s} {ms:9.2f} ms  {ms / result['kernel_ms']:6.1%}")
        for kernel in result["top_kernels"][:12]:
            print(f"   {kernel['ms']:9.2f} ms x{kernel['count']:<5d} {kernel['name'][:100]}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
