"""Bytes saved for the backward, per element: transformers' RMSNorms against the fused kernels, bf16. Counted with
saved-tensor hooks (each distinct tensor once), so the count is the same on any device; on CPU the kernels run
through Triton's interpreter.

    TRITON_INTERPRET=1 python benchmarks/fused_norm_saved_bytes.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def saved_bytes(run: Callable[[], torch.Tensor]) -> int:
    seen: dict[tuple[int, torch.dtype, tuple[int, ...]], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        seen[(tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(seen.values())


def main() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    from arctic_zorro_train.kernels.norms import gated_rms_norm, zero_centered_rms_norm

    tokens = 256
    x = torch.randn(tokens * 32, 128, dtype=torch.bfloat16, requires_grad=True)
    gate = torch.randn_like(x, requires_grad=True)
    gated = Qwen3_5RMSNormGated(128).bfloat16()
    hidden = torch.randn(tokens, 2560, dtype=torch.bfloat16, requires_grad=True)
    plain = Qwen3_5RMSNorm(2560).bfloat16()
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
    }
    for name, (module_run, fused_run, elements) in cases.items():
        print(
            f"{name}: transformers saves {saved_bytes(module_run) / elements:.1f} B per element, the fused kernel "
            f"{saved_bytes(fused_run) / elements:.1f} (its inputs and the per-row rstd)"
        )


if __name__ == "__main__":
    main()
