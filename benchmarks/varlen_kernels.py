"""Tree attention through per-level varlen calls merged by log-sum-exp (``backend="varlen"``) on cuDNN's ragged
SDPA kernels vs torch's FlashAttention-2 kernels vs FlexAttention, forward and forward+backward, at the
tree-attention benchmark's shapes (32 q / 8 kv heads, d=128, bf16). Each backend is first compared with
FlexAttention (relative L2 of out, dq, dk, dv; bf16 noise is about 1e-2). Useful FLOPs as in tree_attention.py.

Run on the H200:  python benchmarks/varlen_kernels.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import cuda_time_ms, default_out_dir, print_table, write_results
from tree_attention import HEAD_DIM, HEADS_Q, _inputs, performance_layouts, useful_pairs

from arctic_dedup import build_plan_from_layout
from arctic_dedup.attention import tree_attention
from arctic_dedup.attention.varlen import KERNEL_SOURCE_VARIABLE

VARIANTS = {"flex": ("flex", None), "varlen_flash": ("varlen", "flash"), "varlen_cudnn": ("varlen", "cudnn")}


def _select(kernels: str | None) -> None:
    if kernels is None:
        os.environ.pop(KERNEL_SOURCE_VARIABLE, None)
    else:
        os.environ[KERNEL_SOURCE_VARIABLE] = kernels


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.float() - reference.float()).norm() / reference.float().norm().clamp_min(1e-30))


def _measure(
    plan: Any, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor, backend: str, forward_flops: int
) -> tuple[list[torch.Tensor], dict[str, float]]:
    leaves = [t.detach().requires_grad_(True) for t in inputs]

    def forward() -> torch.Tensor:
        return tree_attention(*leaves, plan, backend=backend)  # type: ignore[call-overload,no-any-return]

    def forward_backward() -> None:
        torch.autograd.grad(forward(), leaves, grad)

    out = forward()
    results = [out.detach(), *torch.autograd.grad(out, leaves, grad)]
    timings: dict[str, float] = {}
    with torch.no_grad():
        timings["fwd_ms"] = cuda_time_ms(forward, warmup=3, repeats=10)
    timings["fwd_bwd_ms"] = cuda_time_ms(forward_backward, warmup=2, repeats=8)
    timings["bwd_ms"] = timings["fwd_bwd_ms"] - timings["fwd_ms"]
    timings["fwd_tflops"] = forward_flops / timings["fwd_ms"] / 1e9
    timings["fwd_bwd_tflops"] = 3.5 * forward_flops / timings["fwd_bwd_ms"] / 1e9
    return results, timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_out_dir())
    parser.add_argument("--quick", action="store_true", help="only the P=8192, G=16, R=512 shape")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("varlen_kernels: needs a CUDA GPU; nothing measured.")
        return
    rows: list[dict[str, Any]] = []
    for shape, layout in performance_layouts(args.quick).items():
        plan = build_plan_from_layout(layout)
        q, k, v = _inputs(plan, seed=0)
        grad = torch.randn_like(q)
        pairs = useful_pairs(plan)
        forward_flops = 4 * HEAD_DIM * HEADS_Q * pairs
        reference: list[torch.Tensor] | None = None
        for name, (backend, kernels) in VARIANTS.items():
            _select(kernels)
            row: dict[str, Any] = {"shape": shape, "variant": name}
            try:
                results, timings = _measure(plan, (q, k, v), grad, backend, forward_flops)
                if reference is None:
                    reference = results
                for label, got, expected in zip(("out", "dq", "dk", "dv"), results, reference, strict=True):
                    row[f"rel_{label}_vs_flex"] = _relative(got, expected)
                row.update(timings)
            except Exception as error:  # one failing variant must not lose the others
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            rows.append(row)
            torch.cuda.empty_cache()
        _select(None)
        flex = next((r for r in rows if r["shape"] == shape and r["variant"] == "flex" and "fwd_bwd_ms" in r), None)
        for row in rows:
            if row["shape"] == shape and flex is not None and "fwd_bwd_ms" in row:
                row["speed_vs_flex"] = flex["fwd_bwd_ms"] / row["fwd_bwd_ms"]
    summary = {row["shape"]: row.get("speed_vs_flex") for row in rows if row["variant"] == "varlen_cudnn"}
    path = write_results(args.out, "varlen_kernels", {"cudnn_fwd_bwd_speed_vs_flex": summary}, rows)
    print_table(
        rows,
        ["shape", "variant", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops", "speed_vs_flex",
         "rel_out_vs_flex", "rel_dq_vs_flex", "rel_dk_vs_flex", "error"],
    )  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
