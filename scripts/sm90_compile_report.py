"""Compile the fused kernels for the H200 (sm_90) here, without a GPU, and print ptxas' registers, spills and the
shared memory each kernel takes.

Triton compiles ahead of time for a named target, and its wheel carries ptxas, so a CPU machine can check that a
kernel compiles with the installed Triton and whether it spills, before spending device time:

    TRITON_INTERPRET=0 PYTHONPATH=packages/arctic-dedup/src:packages/arctic-zorro-train/src \
        python scripts/sm90_compile_report.py

The constexprs are the launchers' for the hybrid benchmark's shapes (bf16 and fp32), and RL-8x16's for arctic-dedup's
forest decode passes, specialized as Triton's launcher would (alignment and divisibility hints): with them the forest
passes report what the H200 runs measured (tuning-round diagnosis in git history: prefix pass 64x64 tiles 112 KB / ~254
registers, suffix pass 37 KB / 112 and 70 KB / 162 with Triton 3.6). The reports of the last runs are committed as
benchmarks/lab/results/sm90_compile_report.txt (Triton 3.7.1) and sm90_compile_report_triton36.txt (``--out``; put
Triton 3.6 first on PYTHONPATH, e.g. ``uv pip install --target /tmp/t36 --no-deps triton==3.6.0``).
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

import arctic_dedup.forest._kernels as forest_kernels
import arctic_zorro_train.kernels._conv_kernels as conv_kernels
import arctic_zorro_train.kernels._logprob_kernels as logprob_kernels
import arctic_zorro_train.kernels._norm_kernels as norm_kernels
import arctic_zorro_train.kernels._swiglu_kernels as swiglu_kernels

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _specialized(
    kernel: Any, pointer_types: dict[str, str], floats: tuple[str, ...], int_values: dict[str, int]
) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int, ...], Any]]:
    """(signature, extra constexprs, attributes) as Triton's launcher specializes a call: pointers 16-byte aligned
    (torch's allocations are), integers equal to 1 become constants and multiples of 16 get a divisibility hint
    (for the integers whose launch values are given). The hints decide vector widths and whether the pipeliner can
    multi-buffer a load (async copies need 16-byte alignment), so leaving them out misreports shared memory."""
    signature, constants, attrs = {}, {}, {}
    divisible = [["tt.divisibility", 16]]
    for index, parameter in enumerate(kernel.params):
        name = parameter.name
        if parameter.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, pointer_types["*"])
            attrs[(index,)] = divisible
        elif name in floats:
            signature[name] = "fp32"
        elif int_values.get(name) == 1:
            signature[name] = "constexpr"
            constants[name] = 1
        else:
            signature[name] = "i32"
            if name in int_values and int_values[name] % 16 == 0:
                attrs[(index,)] = divisible
    return signature, constants, attrs


def report(
    label: str,
    kernel: Any,
    pointer_types: dict[str, str],
    constexprs: dict[str, Any],
    num_warps: int = 4,
    floats: tuple[str, ...] = (),
    num_stages: int = 3,
    int_values: dict[str, int] | None = None,
) -> None:
    signature, constants, attrs = _specialized(kernel, pointer_types, floats, int_values or {})
    source = ASTSource(fn=kernel, signature=signature, constexprs={**constexprs, **constants}, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as handle:
        handle.write(compiled.asm["ptx"])
    result = subprocess.run(
        [PTXAS, "-v", "--gpu-name", "sm_90a", handle.name, "-o", os.devnull], capture_output=True, text=True
    )
    os.unlink(handle.name)
    text = result.stderr + result.stdout
    registers = ",".join(re.findall(r"Used (\d+) registers", text))
    spills = ",".join(f"{store}/{load}" for store, load in re.findall(r"(\d+) bytes spill stores, (\d+) bytes", text))
    shared = compiled.metadata.shared
    _emit(f"{label:45s} {registers:>5s} registers, spill stores/loads (bytes) {spills}, shared {shared // 1024} KB")


_LINES: list[str] = []


def forest_report() -> None:
    """arctic-dedup's forest decode attention on RL-8x16's shapes (bf16, 32 q / 8 kv heads, d=128, block 16, one
    query token): the prefix pass (64 GQA rows of 16 members) and the suffix pass, at the tiles of the H200 runs.
    The shared-memory size shows how many K/V tiles the pipeliner keeps in flight."""
    pointers = {"*": "*i32", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16"}
    pointers.update({name: "*fp32" for name in ("lse_ptr", "prefix_part_out_ptr", "prefix_part_lse_ptr")})
    pointers.update({name: "*fp32" for name in ("suffix_part_out_ptr", "suffix_part_lse_ptr")})
    shapes = {"HAS_PREFIX": True, "OWNERS_BLOCK": 256, "G": 4, "QMAX": 1, "PAGE": 16, "PDL": 0, "EARLY": False}
    shapes.update(PREFIX_BLOCK_M=64, SUFFIX_BLOCK_M=16, ROWS=4, HEAD_DIM=128, UPCAST=False, DOT_PRECISION="tf32")
    kernel = forest_kernels.forest_attention_kernel
    # RL-8x16's launch values: q [128, 32, 128], paged K/V [blocks, 16, 8, 128], block table rows of 544 blocks.
    ints = {"stride_q_token": 4096, "stride_q_head": 128, "stride_q_dim": 1, "stride_table_row": 544}
    for cache in ("k", "v"):
        ints.update({f"stride_{cache}_block": 16384, f"stride_{cache}_token": 1024, f"stride_{cache}_head": 128})
        ints[f"stride_{cache}_dim"] = 1
    ints.update(stride_out_token=4096, stride_out_head=128, stride_out_dim=1, stride_lse_token=32, stride_lse_head=1)
    ints.update(num_requests=128, head_dim=128, num_kv_heads=8)
    # The early combine's counting passes (dependent launches: PDL mode 2) next to the default ones, and the single
    # group's one launch (both item kinds).
    for pass_, label, prefix_n, suffix_n, early in (
        (1, "prefix pass", 64, 32, False),
        (2, "suffix pass", 64, 32, False),
        (2, "suffix pass", 64, 64, False),
        (1, "prefix pass, early combine", 64, 32, True),
        (2, "suffix pass, early combine", 64, 32, True),
        (0, "one launch", 64, 32, False),
        (0, "one launch, early combine", 64, 32, True),
    ):
        tiles = {**shapes, "PREFIX_BLOCK_N": prefix_n, "SUFFIX_BLOCK_N": suffix_n, "PASS": pass_, "EARLY": early}
        tiles["PDL"] = 2 if early else 0
        block_n = prefix_n if pass_ == 1 else suffix_n
        report(f"forest {label} bf16 block_n {block_n}", kernel, pointers, tiles, 4, ("scale_log2",), 3, ints)
    combine_pointers = {"*": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_out_ptr": "*fp32"}
    combine_pointers["part_lse_ptr"] = "*fp32"
    combine_ints = {name: ints[name] for name in ("stride_out_token", "stride_out_head", "stride_out_dim")}
    combine_ints.update(stride_lse_token=32, stride_lse_head=1, num_requests=128, head_dim=128, num_kv_heads=8)
    combine_ints.update(dim_chunks=1, suffix_part_offset=16 * 129 * 8 * 64)
    flags = {"HAS_PREFIX": True, "G": 4, "QMAX": 1, "PREFIX_BLOCK_M": 64, "ROWS": 4, "PDL": 0}
    flags.update(EARLY=False, LOAD_CACHE="")
    combine = forest_kernels.forest_combine_kernel
    # ForestKernelConfig()'s combine (4 warps, whole heads, 16 partials at a time), the variants timed in the
    # tuning rounds, and the default rule's (1 warp, 64-dim halves, 8 partials at a time).
    shapes_timed = ((4, 16, 128), (4, 8, 128), (2, 8, 128), (2, 4, 128), (1, 16, 32), (1, 8, 32), (1, 8, 64))
    for warps, chunk, dims in shapes_timed:
        label = f"forest combine {warps} warps chunk {chunk}" + ("" if dims == 128 else f" dims {dims}")
        sliced = combine_ints if dims == 128 else {**combine_ints, "dim_chunks": 128 // dims}
        tiles = {**flags, "CHUNK": chunk, "DIM_BLOCK": dims}
        report(label, combine, combine_pointers, tiles, warps, (), 3, sliced)
    early = {**flags, "CHUNK": 8, "DIM_BLOCK": 64, "EARLY": True, "LOAD_CACHE": ".cg", "PDL": 3}
    report("forest combine 1 warps chunk 8 dims 64, early", combine, combine_pointers, early, 1, (), 3,
           {**combine_ints, "dim_chunks": 2})  # fmt: skip


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
    forest_report()
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(_LINES) + "\n")


if __name__ == "__main__":
    main()
