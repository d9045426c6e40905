"""Where the bf16 gradient noise of a ZoRRO training step comes from (a diagnostic for the GPU cosine tests).

For the model and batch of ``packages/arctic-zorro-train/tests/test_gpu.py``, every parameter's policy-loss gradient
is computed in several bf16 configurations and compared with the fp32 truth (the same bf16 weights upcast to fp32,
run without deduplication): ``1 - cosine`` per parameter. If the deduplicated run sits as close to the truth as the
non-deduplicated bf16 run does, their mutual cosine is set by two independent rounding noises, not by a dedup error.

``--family qwen3_5`` (the hybrid GPU test's model and batches; fla's kernels need Triton >= 3.7.1 on Hopper) runs
every seed of ``--seeds`` with the fused kernels on and off, and adds two non-deduplicated controls: plain
transformers run on each sample, and the packed baseline with the other kernel setting. Their spread is what two
equally valid bf16 runs differ by; the report gives, per parameter, ``(1 - cos(run, truth)) / (1 - cos(packed
baseline, truth))`` for the dedup run and for each control, so a dedup-specific error shows as a ratio the
controls do not reach.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "packages" / "arctic-zorro-train" / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import default_lab_out_dir, run_metadata  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=default_lab_out_dir())
    parser.add_argument("--family", default="qwen3", choices=["qwen3", "qwen3_5"])
    parser.add_argument("--seeds", type=int, nargs="*", default=[2], help="qwen3_5: the batch seeds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("zorro_bf16_noise: needs a CUDA GPU; nothing measured.")
        return
    if args.family == "qwen3_5":
        hybrid_noise(args.out, args.seeds)
        return
    import test_gpu

    batch = test_gpu._batch()
    model = test_gpu._model(args.family)
    truth = test_gpu._truth(model, batch)  # the yardstick the GPU tests use

    def one_minus_cosines(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
        return {
            name: test_gpu._one_minus_cosine(actual[name], reference)
            for name, reference in expected.items()
            if float(reference.norm()) != 0.0
        }

    runs: dict[str, dict[str, Any]] = {
        "baseline bf16": {"deduplicate": False, "attention_backend": "flex"},
        "baseline bf16, fp32 logits": {"deduplicate": False, "attention_backend": "flex", "fp32_logits": True},
        "dedup flex": {"attention_backend": "flex", "logits_optimization": "memory"},
        "dedup flex, fp32 logits": {"attention_backend": "flex", "logits_optimization": "memory", "fp32_logits": True},
        "dedup triton": {"attention_backend": "triton", "logits_optimization": "memory"},
        "dedup triton, fp32 logits": {
            "attention_backend": "triton",
            "logits_optimization": "memory",
            "fp32_logits": True,
        },
    }
    gradients = {label: test_gpu._grads(model, batch, **options) for label, options in runs.items()}
    results: dict[str, Any] = {"vs_fp32_truth": {}, "pairs": {}}
    for label, grads in gradients.items():
        results["vs_fp32_truth"][label] = one_minus_cosines(grads, truth)
    pairs = [
        ("dedup flex", "baseline bf16"),
        ("dedup triton", "baseline bf16"),
        ("dedup flex, fp32 logits", "baseline bf16, fp32 logits"),
        ("dedup triton, fp32 logits", "baseline bf16, fp32 logits"),
        ("baseline bf16", "baseline bf16, fp32 logits"),
    ]
    for actual, expected in pairs:
        results["pairs"][f"{actual} | {expected}"] = one_minus_cosines(gradients[actual], gradients[expected])
    print(f"{'comparison':58s} {'worst 1-cos':>12s} {'median':>10s}  worst parameter")
    for section in ("vs_fp32_truth", "pairs"):
        for label, values in results[section].items():
            ordered = sorted(values.items(), key=lambda item: item[1])
            worst_name, worst = ordered[-1]
            median = ordered[len(ordered) // 2][1]
            tag = f"{label} | fp32 truth" if section == "vs_fp32_truth" else label
            print(f"{tag:58s} {worst:12.3e} {median:10.3e}  {worst_name}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"zorro_bf16_noise_{args.family}.json"
    path.write_text(json.dumps({"meta": run_metadata(), **results}, indent=1))
    print(f"wrote {path}")


def hybrid_noise(out_dir: Path, seeds: list[int]) -> None:
    """Ratios to the packed baseline's distance from the truth, per parameter, for dedup and the controls."""
    import test_gpu

    from arctic_zorro_train.gated_delta import fla_unusable_reason

    kernel = "torch" if fla_unusable_reason(torch.device("cuda"), torch.bfloat16) else "fla"
    model = test_gpu._model("qwen3_5")
    baseline_backend = test_gpu._baseline_backend()
    results: dict[str, Any] = {"gated_delta_kernel": kernel, "baseline_backend": baseline_backend, "seeds": {}}
    worst: dict[str, tuple[float, str]] = {}
    for seed in seeds:
        batch = test_gpu._batch(seed=seed)
        truth = test_gpu._truth(model, batch, attention_backend="reference")
        runs: dict[str, dict[str, torch.Tensor]] = {}
        for fused in ("auto", "never"):
            runs[f"baseline, fused {fused}"] = test_gpu._grads(
                model, batch, deduplicate=False, attention_backend=baseline_backend, fused_kernels=fused
            )
            runs[f"dedup sdpa, fused {fused}"] = test_gpu._grads(
                model, batch, attention_backend="sdpa", fused_kernels=fused
            )
        runs["plain transformers"] = test_gpu.plain_transformers_grads(model, batch)
        distances = {
            label: {
                name: test_gpu._one_minus_cosine(grads[name], exact)
                for name, exact in truth.items()
                if float(exact.norm()) != 0.0
            }
            for label, grads in runs.items()
        }
        ratios: dict[str, dict[str, float]] = {}
        for fused in ("auto", "never"):
            other = "never" if fused == "auto" else "auto"
            reference = distances[f"baseline, fused {fused}"]
            for label in (f"dedup sdpa, fused {fused}", f"baseline, fused {other}", "plain transformers"):
                key = f"{label} / baseline, fused {fused}"
                ratios[key] = {
                    name: distances[label][name] / max(reference[name], test_gpu.NOISE_FLOOR) for name in reference
                }
                name, value = max(ratios[key].items(), key=lambda item: item[1])
                if value > worst.get(key, (0.0, ""))[0]:
                    worst[key] = (value, f"{name} (seed {seed})")
        dedup, packed = runs["dedup sdpa, fused auto"], runs["baseline, fused auto"]
        pairs = {
            "dedup sdpa, fused auto | baseline, fused auto": {
                name: test_gpu._one_minus_cosine(dedup[name], packed[name]) for name in distances["plain transformers"]
            }
        }
        results["seeds"][str(seed)] = {"vs_fp32_truth": distances, "ratios": ratios, "pairs": pairs}
        for label, values in pairs.items():
            name, value = max(values.items(), key=lambda item: item[1])
            print(f"seed {seed}: worst 1-cos {label}: {value:.3e} ({name})")
    results["worst_ratio"] = {key: {"ratio": value, "where": where} for key, (value, where) in worst.items()}
    print(f"{'ratio of 1-cos to the fp32 truth':70s} {'worst':>7s}  where")
    for key, (value, where) in sorted(worst.items()):
        print(f"{key:70s} {value:7.2f}  {where}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "zorro_bf16_noise_qwen3_5.json"
    path.write_text(json.dumps({"meta": run_metadata(), **results}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
