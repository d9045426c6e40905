"""The hybrid families' fused kernels against the transformers code they replace, on the shapes of the hybrid
benchmark (``zorro_train.py``'s ``HYBRID``: one 8704-token sample; ``--tokens`` for the dedup stream's 16384), and
the "memory" logits mode's chunk math (2048 tokens x 151936 logits) against its torch twins.

Per kernel: forward, and forward + backward (a random upstream gradient), torch module vs fused, median of CUDA
events; bytes counted as the fewest a fused pass must move (forward: inputs read once + output written once;
backward: inputs + upstream gradient read once, input gradients written once), so ``fused_tbps`` compares with the
copy rate printed first. Rows go to ``fused_kernels.json`` and a bar plot ``fused_kernels.png``.

    python benchmarks/fused_kernels.py            (H200: ~1 min)
    python benchmarks/fused_kernels.py --smoke    (CPU: tiny shapes through TRITON_INTERPRET=1, no timing)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import copy_bandwidth_gbps, cuda_time_ms, default_out_dir, print_table, write_results


@dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]  # x's shape
    build: Callable[[torch.device, torch.dtype], tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], int]]
    inputs: int  # differentiable activation inputs (x, or x and gate)


def _norm_case(kind: str, width: int) -> Callable[..., Any]:
    def build(device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, int]:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

        from arctic_zorro_train.kernels.norms import gated_rms_norm, zero_centered_rms_norm

        if kind == "gated":
            module: Any = Qwen3_5RMSNormGated(width, eps=1e-6).to(device, dtype)
            module.weight.data.normal_(1.0, 0.1)
            return module, lambda x, gate: gated_rms_norm(x, gate, module.weight, 1e-6), 2
        module = Qwen3_5RMSNorm(width, eps=1e-6).to(device, dtype)
        module.weight.data.normal_(0.0, 0.1)
        return module, lambda x: zero_centered_rms_norm(x, module.weight, 1e-6), 1

    return build


def _conv_case(channels: int, width: int) -> Callable[..., Any]:
    def build(device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, int]:
        from arctic_zorro_train.kernels.causal_conv import causal_depthwise_conv
        from arctic_zorro_train.kernels.reference import causal_depthwise_conv_reference

        weight = torch.randn(channels, width, device=device, dtype=dtype, requires_grad=True)

        def reference(x: torch.Tensor) -> torch.Tensor:  # what gated_delta.tree_causal_conv ran before
            return causal_depthwise_conv_reference(x, weight, None)

        return reference, lambda x: causal_depthwise_conv(x, weight, None), 1

    return build


def _swiglu_case(width: int) -> Callable[..., Any]:
    def build(device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, int]:
        from arctic_zorro_train.kernels.reference import swiglu_reference
        from arctic_zorro_train.kernels.swiglu import swiglu

        return swiglu_reference, swiglu, 2

    return build


def cases(tokens: int) -> list[Case]:
    """The hybrid's shapes: 32 value heads x 128 (gated norm), hidden 2560, q/k norms over 16/4 heads x 256, the
    conv over 2 x 16 x 128 + 32 x 128 = 8192 channels, width 4, the MLP's SwiGLU over 9216."""
    return [
        Case("gated_rms_norm", (tokens * 32, 128), _norm_case("gated", 128), 2),
        Case("zero_centered_rms_norm hidden", (tokens, 2560), _norm_case("zero_centered", 2560), 1),
        Case("zero_centered_rms_norm q heads", (tokens, 16, 256), _norm_case("zero_centered", 256), 1),
        Case("zero_centered_rms_norm k heads", (tokens, 4, 256), _norm_case("zero_centered", 256), 1),
        Case("causal_depthwise_conv", (tokens, 8192), _conv_case(8192, 4), 1),
        Case("swiglu", (tokens, 9216), _swiglu_case(9216), 2),
    ]


def _run_case(case: Case, device: torch.device, dtype: torch.dtype, smoke: bool) -> dict[str, Any]:
    reference, fused, num_inputs = case.build(device, dtype)
    inputs = [torch.randn(case.shape, device=device, dtype=dtype, requires_grad=True) for _ in range(num_inputs)]
    upstream = torch.randn(case.shape, device=device, dtype=dtype)

    def forward(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                fn(*inputs)

        return run

    def forward_backward(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            out = fn(*inputs)
            torch.autograd.grad(out, inputs, upstream)

        return run

    element_bytes = torch.finfo(dtype).bits // 8
    elements = inputs[0].numel()
    forward_bytes = (num_inputs + 1) * elements * element_bytes
    backward_bytes = (2 * num_inputs + 1) * elements * element_bytes
    # The difference of the two runs must stay within bf16 rounding of the output (a wrong kernel fails here).
    with torch.no_grad():
        difference = float((reference(*inputs) - fused(*inputs)).abs().max())
    shape = "x".join(map(str, case.shape))
    row: dict[str, Any] = {"kernel": case.name, "shape": shape, "max_abs_difference": difference}
    if smoke:
        forward_backward(fused)()
        return row
    timings = {
        "torch_forward_ms": cuda_time_ms(forward(reference)),
        "fused_forward_ms": cuda_time_ms(forward(fused)),
        "torch_forward_backward_ms": cuda_time_ms(forward_backward(reference)),
        "fused_forward_backward_ms": cuda_time_ms(forward_backward(fused)),
    }
    row.update(timings)
    row["forward_speedup"] = timings["torch_forward_ms"] / timings["fused_forward_ms"]
    row["forward_backward_speedup"] = timings["torch_forward_backward_ms"] / timings["fused_forward_backward_ms"]
    row["fused_forward_tbps"] = forward_bytes / timings["fused_forward_ms"] / 1e9
    row["fused_forward_backward_tbps"] = (forward_bytes + backward_bytes) / timings["fused_forward_backward_ms"] / 1e9
    return row


# Backward tiles of the conv (block_t, block_c, warps): the default (swept on the H200 with Triton 3.6) spills 260
# bytes per thread when Triton 3.7.1 compiles it for sm_90 (ptxas -v); these do not.
CONV_BACKWARD_TILES = ((4, 1024, 4), (4, 1024, 8), (2, 1024, 4), (4, 512, 4))


def conv_backward_tile_rows(tokens: int, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Forward + backward of the conv over [tokens, 8192] for each backward tile shape."""
    from arctic_zorro_train.kernels.causal_conv import CausalConvTiles, causal_depthwise_conv

    x = torch.randn(tokens, 8192, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(8192, 4, device=device, dtype=dtype, requires_grad=True)
    upstream = torch.randn(tokens, 8192, device=device, dtype=dtype)
    rows = []
    for block_t, block_c, warps in CONV_BACKWARD_TILES:
        tiles = CausalConvTiles(backward_block_t=block_t, backward_block_c=block_c, backward_num_warps=warps)

        def run(tiles: CausalConvTiles = tiles) -> None:
            torch.autograd.grad(causal_depthwise_conv(x, weight, None, tiles=tiles), (x, weight), upstream)

        rows.append(
            {
                "kernel": "causal_depthwise_conv backward tiles",
                "tiles": f"{block_t}x{block_c}, {warps} warps",
                "fused_forward_backward_ms": cuda_time_ms(run),
            }
        )
    return rows


def logprob_chunk_row(rows: int, vocab: int, device: torch.device, dtype: torch.dtype, smoke: bool) -> dict[str, Any]:
    """The "memory" logits mode's math on one chunk of ``[rows, vocab]`` logits: statistics (forward) and the
    logits' gradient (backward, from the saved log-normalizers), torch twins vs the fused kernels; the LM head's
    matrix multiplies are not part of it. Bytes: the fewest a fused pass moves (logits read twice, gradient
    written once)."""
    from arctic_zorro_train.kernels.logprobs import logprob_logits_gradient, logprob_statistics
    from arctic_zorro_train.kernels.reference import logprob_logits_gradient_reference, logprob_statistics_reference

    logits = 4 * torch.randn(rows, vocab, device=device).to(dtype)
    labels = torch.randint(0, vocab, (rows,), device=device)
    grads = torch.randn(rows, device=device)

    def chunk(statistics: Callable[..., Any], gradient: Callable[..., Any], backward: bool) -> Callable[[], None]:
        def run() -> None:
            _, log_normalizer, _ = statistics(logits, labels, 1.0, False)
            if backward:
                gradient(logits, labels, log_normalizer, None, grads, None, 1.0)

        return run

    ours = logprob_statistics(logits, labels, 1.0, False)
    theirs = logprob_statistics_reference(logits, labels, 1.0, False)
    row: dict[str, Any] = {
        "kernel": "logprob chunk (memory mode)",
        "shape": f"{rows}x{vocab}",
        "max_abs_difference": float((ours[0] - theirs[0]).abs().max()),
    }
    if smoke:
        chunk(logprob_statistics, logprob_logits_gradient, True)()
        return row
    timings = {
        "torch_forward_ms": cuda_time_ms(chunk(logprob_statistics_reference, logprob_logits_gradient_reference, False)),
        "fused_forward_ms": cuda_time_ms(chunk(logprob_statistics, logprob_logits_gradient, False)),
        "torch_forward_backward_ms": cuda_time_ms(
            chunk(logprob_statistics_reference, logprob_logits_gradient_reference, True)
        ),
        "fused_forward_backward_ms": cuda_time_ms(chunk(logprob_statistics, logprob_logits_gradient, True)),
    }
    row.update(timings)
    row["forward_speedup"] = timings["torch_forward_ms"] / timings["fused_forward_ms"]
    row["forward_backward_speedup"] = timings["torch_forward_backward_ms"] / timings["fused_forward_backward_ms"]
    element_bytes = torch.finfo(dtype).bits // 8
    row["fused_forward_tbps"] = rows * vocab * element_bytes / timings["fused_forward_ms"] / 1e9
    row["fused_forward_backward_tbps"] = 3 * rows * vocab * element_bytes / timings["fused_forward_backward_ms"] / 1e9
    return row


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [row["kernel"].replace("zero_centered_rms_norm", "zc norm") for row in rows]
    positions = range(len(rows))
    figure, axis = plt.subplots(figsize=(9, 4))
    axis.bar([p - 0.2 for p in positions], [row["torch_forward_backward_ms"] for row in rows], 0.4, label="torch")
    axis.bar([p + 0.2 for p in positions], [row["fused_forward_backward_ms"] for row in rows], 0.4, label="fused")
    axis.set_xticks(list(positions), labels, rotation=15)
    axis.set_ylabel("forward + backward, ms")
    axis.set_title("Norms, conv, SwiGLU, log-prob chunk: torch code vs the fused kernels (H200, bf16)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_out_dir())
    parser.add_argument("--tokens", type=int, default=8704)
    parser.add_argument("--smoke", action="store_true", help="CPU dry run through the Triton interpreter")
    args = parser.parse_args()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke needs TRITON_INTERPRET=1 (set before triton is imported)")
        device, dtype, tokens = torch.device("cpu"), torch.float32, 8
    elif not torch.cuda.is_available():
        sys.exit("fused_kernels.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    else:
        device, dtype, tokens = torch.device("cuda"), torch.bfloat16, args.tokens
    torch.manual_seed(0)
    rows = [_run_case(case, device, dtype, args.smoke) for case in cases(tokens)]
    # zorro_train.py's logits_chunk_size and Qwen3's vocabulary (the smoke run: tiny)
    rows.append(logprob_chunk_row(4 if args.smoke else 2048, 300 if args.smoke else 151936, device, dtype, args.smoke))
    if args.smoke:
        print_table(rows, ["kernel", "shape", "max_abs_difference"])
        return
    copy_tbps = copy_bandwidth_gbps() / 1e3
    print(f"copy {copy_tbps:.2f} TB/s")
    columns = ["kernel", "shape", "torch_forward_backward_ms", "fused_forward_backward_ms", "forward_backward_speedup"]
    print_table(rows, [*columns, "fused_forward_tbps", "fused_forward_backward_tbps", "max_abs_difference"])
    tile_rows = conv_backward_tile_rows(tokens, device, dtype)
    print_table(tile_rows, ["kernel", "tiles", "fused_forward_backward_ms"])
    summary = {"tokens": tokens, "dtype": str(dtype), "copy_tbps": copy_tbps, "conv_backward_tiles": tile_rows}
    path = write_results(args.out, "fused_kernels", summary, rows)
    _plot(rows, args.out / "fused_kernels.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
