"""Tile sizes and launch settings of the tree-attention Triton kernels, and the defaults per device and shape."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TritonConfig", "default_triton_config"]


@dataclass(frozen=True)
class TritonConfig:
    """Tile sizes and launch settings of the three kernels (forward, dK/dV, dQ); powers of two, >= 16.

    ``atomic_dq``: the dK/dV kernel also adds dQ with fp32 atomics (5 matmuls per tile instead of 7 across two
    kernels) when the call is not ``deterministic``.
    ``fold_statistics``: the backward kernels start the score and ``dP`` products from ``-lse / scale`` and
    ``-delta`` instead of subtracting per-query vectors afterwards (fewer registers in the dK/dV kernel, where each
    thread holds ``bwd_block_m / 4`` values of each vector; one multiply less per score).
    ``dp_first``: the dK/dV kernel computes both ``K Q^T`` and ``V dO^T`` before the exponentials (flash-attention 2
    order) instead of issuing the dV product in between.
    ``split_atomic_dq``: with ``atomic_dq``, each tile's dQ share is two ``[bwd_block_m, D/2]`` products and atomic
    adds (half the fp32 tile live at a time; K's halves take another ``bwd_block_n * D`` elements of shared memory);
    head dims below 32 ignore it (a product needs 16 columns).
    """

    # Defaults: the H200 measurements (bf16, d=128; benchmarks/results/tree_attention.json and
    # tree_attention_bwd_sweep.json). Forward 128x128, 2 stages: 4.35 ms against 5.48 ms at 128x64, 3 stages.
    # Backward: 64x128 dK/dV tiles with folded statistics; atomic dQ when not deterministic ("atomic_m64",
    # 12.77 ms), the dK/dV + dQ kernels when deterministic ("det_m64", 13.67 ms; 14.61 ms at the old 32x128).
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    bwd_block_m: int = 64
    bwd_block_n: int = 128
    bwd_num_warps: int = 8
    bwd_num_stages: int = 2
    dq_block_m: int = 128
    dq_block_n: int = 64
    dq_num_warps: int = 8
    dq_num_stages: int = 2
    atomic_dq: bool = True
    fold_statistics: bool = True
    dp_first: bool = True
    split_atomic_dq: bool = True

    def validate(self) -> None:
        for name in ("block_m", "block_n", "bwd_block_m", "bwd_block_n", "dq_block_m", "dq_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TritonConfig.{name} must be a power of two >= 16, got {value}.")


# The interpreter runs each program in numpy: small tiles keep CPU tests fast and still cover several blocks.
_INTERPRETER_CONFIG = TritonConfig(
    block_m=16, block_n=16, bwd_block_m=16, bwd_block_n=32, dq_block_m=32, dq_block_n=16, num_warps=1
)


# fp32 and d=256 keep the backward options they were compiled and checked with (none measured on a GPU there).
_UNMEASURED_OPTIONS: dict[str, bool] = {"atomic_dq": False, "fold_statistics": False, "dp_first": False,
                                        "split_atomic_dq": False}  # fmt: skip


def default_triton_config(head_dim: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> TritonConfig:
    """Settings used when the caller gives none. Chosen from sm_90 compiles (registers, spills, shared memory) and
    the benchmark's sweep (``benchmarks/tree_attention.py`` prints the best settings it measured)."""
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    if dtype == torch.float32:
        # Exact fp32 products run on the FMA units and need many registers: small tiles (a correctness path).
        return TritonConfig(
            block_m=32, block_n=32, num_warps=4, num_stages=1, bwd_block_m=32, bwd_block_n=32, bwd_num_warps=4,
            bwd_num_stages=1, dq_block_m=32, dq_block_n=32, dq_num_warps=4, dq_num_stages=1, **_UNMEASURED_OPTIONS,
        )  # fmt: skip
    if head_dim >= 256:
        # Register pressure: [block, 256] fp32 accumulators; these tiles compile without spills for sm_90.
        return TritonConfig(
            block_m=64, block_n=32, num_stages=2, bwd_block_m=16, bwd_block_n=64, dq_block_m=64, dq_block_n=32,
            **_UNMEASURED_OPTIONS,
        )  # fmt: skip
    return TritonConfig()
