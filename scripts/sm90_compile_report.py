"""Compile the fused kernels for the H200 (sm_90) here, without a GPU, and print ptxas' registers and spills.

Triton compiles ahead of time for a named target, and its wheel carries ptxas, so a CPU machine can check that a
kernel compiles with the installed Triton and whether it spills, before spending device time:

    TRITON_INTERPRET=0 PYTHONPATH=packages/arctic-dedup/src:packages/arctic-zorro-train/src \
        python scripts/sm90_compile_report.py

The constexprs are the launchers' for the hybrid benchmark's shapes (bf16 and fp32). The report of the last run is
committed as benchmarks/results/sm90_compile_report.txt (``--out``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import arctic_zorro_train.kernels._conv_kernels as conv_kernels
import arctic_zorro_train.kernels._logprob_kernels as logprob_kernels
import arctic_zorro_train.kernels._norm_kernels as norm_kernels
import arctic_zorro_train.kernels._swiglu_kernels as swiglu_kernels

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _signature(kernel: Any, pointer_types: dict[str, str], floats: tuple[str, ...]) -> dict[str, str]:
    signature = {}
    for parameter in kernel.params:
        if parameter.is_constexpr:
            signature[parameter.name] = "constexpr"
        elif parameter.name.endswith("_ptr"):
            signature[parameter.name] = pointer_types.get(parameter.name, pointer_types["*"])
        else:
            signature[parameter.name] = "fp32" if parameter.name in floats else "i32"
    return signature


def report(
    label: str,
    kernel: Any,
    pointer_types: dict[str, str],
    constexprs: dict[str, Any],
    num_warps: int = 4,
    floats: tuple[str, ...] = (),
) -> None:
    source = ASTSource(fn=kernel, signature=_signature(kernel, pointer_types, floats), constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as handle:
        handle.write(compiled.asm["ptx"])
    result = subprocess.run(
        [PTXAS, "-v", "--gpu-name", "sm_90a", handle.name, "-o", os.devnull], capture_output=True, text=True
    )
    os.unlink(handle.name)
    text = result.stderr + result.stdout
    registers = ",".join(re.findall(r"Used (\d+) registers", text))
    spills = ",".join(f"{store}/{load}" for store, load in re.findall(r"(\d+) bytes spill stores, (\d+) bytes", text))
    _emit(f"{label:45s} {registers:>5s} registers, spill stores/loads (bytes) {spills}")


_LINES: list[str] = []


def _emit(line: str) -> None:
    print(line)
    _LINES.append(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args()
    commit = (
        os.environ.get("ARCTIC_COMMIT")
        or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    _emit(f"{stamp}, commit {commit}, triton {triton.__version__}, target sm_90a, compiled on a CPU machine")
    f32 = tl.float32
    for dtype, name in ((tl.bfloat16, "bf16"), (tl.float32, "fp32")):
        pointers = {"*": f"*{name}", "rstd_ptr": "*fp32", "grad_weight_partial_ptr": "*fp32"}
        gated = {"PRODUCT_DTYPE": dtype, "ROUND_PRODUCT": dtype == tl.bfloat16, "COMPUTE_DTYPE": f32}
        gated.update(BLOCK_ROWS=32, BLOCK_WIDTH=128)
        report(f"gated norm forward {name} D=128", norm_kernels._gated_forward_kernel, pointers, gated, 8, ("eps",))
        report(f"gated norm backward {name} D=128", norm_kernels._gated_backward_kernel, pointers, gated, 8)
        for width, rows, warps in ((2560, 1, 8), (256, 16, 8)):
            tiles = {"COMPUTE_DTYPE": f32, "BLOCK_ROWS": rows, "BLOCK_WIDTH": triton.next_power_of_2(width)}
            forward, backward = norm_kernels._zero_centered_forward_kernel, norm_kernels._zero_centered_backward_kernel
            report(f"zero-centered norm forward {name} D={width}", forward, pointers, tiles, warps, ("eps",))
            report(f"zero-centered norm backward {name} D={width}", backward, pointers, tiles, warps)
        conv_pointers = {"*": f"*{name}", "weight_ptr": "*fp32"}
        conv_pointers.update(grad_weight_partial_ptr="*fp32", grad_bias_partial_ptr="*fp32")
        conv = {"WIDTH": 4, "HAS_BIAS": False, "ACCUMULATOR_DTYPE": f32}
        report(
            f"conv forward {name} 16x512",
            conv_kernels._causal_conv_forward_kernel,
            conv_pointers,
            {**conv, "BLOCK_T": 16, "BLOCK_C": 512},
        )
        for block_t, block_c, warps in ((4, 1024, 4), (4, 1024, 8), (2, 1024, 4), (4, 512, 4)):
            report(
                f"conv backward {name} {block_t}x{block_c} {warps} warps",
                conv_kernels._causal_conv_backward_kernel,
                conv_pointers,
                {**conv, "BLOCK_T": block_t, "BLOCK_C": block_c, "TILES_PER_PROGRAM": 16},
                warps,
            )
        swiglu = {"COMPUTE_DTYPE": f32, "BLOCK": 2048}
        report(f"swiglu forward {name}", swiglu_kernels._swiglu_forward_kernel, {"*": f"*{name}"}, swiglu)
        report(f"swiglu backward {name}", swiglu_kernels._swiglu_backward_kernel, {"*": f"*{name}"}, swiglu)
        logprob_pointers = {"*": "*fp32", "logits_ptr": f"*{name}", "grad_logits_ptr": f"*{name}", "labels_ptr": "*i64"}
        logprob = {"COMPUTE_DTYPE": f32, "BLOCK": 4096}
        forward_flags = {**logprob, "WITH_ENTROPY": True}
        backward_flags = {**logprob, "HAS_LOGPROB_GRAD": True, "HAS_ENTROPY_GRAD": True}
        temperature = ("temperature",)
        report(f"logprob forward {name} 4096", logprob_kernels._logprob_forward_kernel, logprob_pointers,
               forward_flags, 8, temperature)  # fmt: skip
        report(f"logprob backward {name} 4096", logprob_kernels._logprob_backward_kernel, logprob_pointers,
               backward_flags, 8, temperature)  # fmt: skip
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(_LINES) + "\n")


if __name__ == "__main__":
    main()
