"""Bytes saved for the backward, per element: transformers' RMSNorms and SwiGLU against the fused kernels, bf16.
Counted with saved-tensor hooks (each distinct tensor once), so the count is the same on any device; on CPU the
kernels run through Triton's interpreter.

    TRITON_INTERPRET=1 python benchmarks/lab/fused_norm_saved_bytes.py    (writes fused_norm_saved_bytes.json)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# The lab imports the shared harness from benchmarks/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import default_lab_out_dir, print_table, write_results


def saved_bytes(run: Callable[[], torch.Tensor]) -> int:
    seen: dict[tuple[int, torch.dtype, tuple[int, ...]], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        seen[(tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_lab_out_dir())
    args = parser.parse_args()
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    from arctic_zorro_train.kernels.norms import gated_rms_norm, zero_centered_rms_norm
    from arctic_zorro_train.kernels.reference import swiglu_reference
    from arctic_zorro_train.kernels.swiglu import swiglu

    tokens = 256
    x = torch.randn(tokens * 32, 128, dtype=torch.bfloat16, requires_grad=True)
    gate = torch.randn_like(x, requires_grad=True)
    gated = Qwen3_5RMSNormGated(128).bfloat16()
    hidden = torch.randn(tokens, 2560, dtype=torch.bfloat16, requires_grad=True)
    plain = Qwen3_5RMSNorm(2560).bfloat16()
    mlp_gate = torch.randn(tokens, 9216, dtype=torch.bfloat16, requires_grad=True)
    mlp_up = torch.randn_like(mlp_gate, requires_grad=True)
    cases = {
        "gated [T x 32, 128]": (
            lambda: gated(x, gate),
            lambda: gated_rms_norm(x, gate, gated.weight, 1e-6),
            x.numel(),
        ),
        "zero-centered [T, 2560]": (
            lambda: plain(hidden),
            lambda: zero_centered_rms_norm(hidden, plain.weight, 1e-6),
            hidden.numel(),
        ),
        "swiglu [T, 9216]": (
            lambda: swiglu_reference(mlp_gate, mlp_up),
            lambda: swiglu(mlp_gate, mlp_up),
            mlp_gate.numel(),
        ),
    }
    rows = [
        {
            "norm": name,
            "transformers_bytes_per_element": saved_bytes(module_run) / elements,
            "fused_bytes_per_element": saved_bytes(fused_run) / elements,
        }
        for name, (module_run, fused_run, elements) in cases.items()
    ]
    print_table(rows, ["norm", "transformers_bytes_per_element", "fused_bytes_per_element"])
    path = write_results(args.out, "fused_norm_saved_bytes", {"dtype": "bfloat16", "tokens": tokens}, rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
