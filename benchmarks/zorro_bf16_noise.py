"""Where the bf16 gradient noise of a ZoRRO training step comes from (a diagnostic for the GPU cosine tests).

For the model and batch of ``packages/arctic-zorro-train/tests/test_gpu.py``, every parameter's policy-loss gradient
is computed in several bf16 configurations and compared with the fp32 truth (the same bf16 weights upcast to fp32,
run without deduplication): ``1 - cosine`` per parameter. If the deduplicated run sits as close to the truth as the
non-deduplicated bf16 run does, their mutual cosine is set by two independent rounding noises, not by a dedup error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "packages" / "arctic-zorro-train" / "tests"))
sys.path.insert(0, str(Path(__file__).parent))

from common import default_out_dir, run_metadata  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=default_out_dir())
    parser.add_argument("--family", default="qwen3")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("zorro_bf16_noise: needs a CUDA GPU; nothing measured.")
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


if __name__ == "__main__":
    main()
