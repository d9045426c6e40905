"""Where the bf16 gradient noise of a ZoRRO training step comes from (a diagnostic for the GPU cosine tests).

For the model and batch of ``packages/arctic-zorro-train/tests/test_gpu.py``, every parameter's policy-loss gradient
is computed in several bf16 configurations and compared with the fp32 truth (the same bf16 weights upcast to fp32,
run without deduplication): ``1 - cosine`` per parameter. If the deduplicated run sits as close to the truth as the
non-deduplicated bf16 run does, their mutual cosine is set by two independent rounding noises, not by a dedup error.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "packages" / "arctic-zorro-train" / "tests"))
sys.path.insert(0, str(Path(__file__).parent))

from common import default_out_dir, run_metadata  # noqa: E402


def _gradients(model: Any, batch: dict[str, torch.Tensor], **options: Any) -> dict[str, torch.Tensor]:
    from arctic_zorro_train import DeduplicatedActor
    from arctic_zorro_train.testing import collect_grads

    model.zero_grad(set_to_none=True)
    DeduplicatedActor(model, "cuda", **options).compute_policy_loss_and_backward(batch)
    return {name: grad.double() for name, grad in collect_grads(model).items()}


def _one_minus_cosines(actual: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> dict[str, float]:
    out = {}
    for name, reference in truth.items():
        if float(reference.norm()) == 0.0:
            continue
        cosine = torch.nn.functional.cosine_similarity(actual[name].flatten(), reference.flatten(), dim=0)
        out[name] = 1.0 - float(cosine)
    return out


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
    truth_model = copy.deepcopy(model).float()
    truth = _gradients(truth_model, batch, deduplicate=False, attention_backend="flex", fp32_logits=True)
    del truth_model
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
    gradients = {label: _gradients(model, batch, **options) for label, options in runs.items()}
    results: dict[str, Any] = {"vs_fp32_truth": {}, "pairs": {}}
    for label, grads in gradients.items():
        results["vs_fp32_truth"][label] = _one_minus_cosines(grads, truth)
    pairs = [
        ("dedup flex", "baseline bf16"),
        ("dedup triton", "baseline bf16"),
        ("dedup flex, fp32 logits", "baseline bf16, fp32 logits"),
        ("dedup triton, fp32 logits", "baseline bf16, fp32 logits"),
        ("baseline bf16", "baseline bf16, fp32 logits"),
    ]
    for actual, expected in pairs:
        results["pairs"][f"{actual} | {expected}"] = _one_minus_cosines(gradients[actual], gradients[expected])
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
