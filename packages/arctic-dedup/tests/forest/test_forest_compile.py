"""The kernels compile for Hopper (sm_90) on a machine without a GPU, as the JIT would specialize them.

The interpreter runs kernels as Python, so it misses compile-time errors (non-constexpr globals, type mismatches in
loops, shared-memory overflows). Triton's CUDA backend compiles to a cubin without a device; this catches those.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

UNIT_STRIDES = {"stride_q_dim", "stride_k_dim", "stride_v_dim", "stride_out_dim", "stride_lse_head"}
DATA_POINTERS = {"q_ptr", "k_ptr", "v_ptr", "out_ptr"}


class _CannotCompileOffline(Exception):
    pass


def _compile(kernel: object, constants: dict[str, object], num_warps: int, num_stages: int) -> object:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature: dict[str, str] = {}
    constexprs: dict[str, object] = dict(constants)
    attrs: dict[tuple[int, ...], list[list[object]]] = {}
    for index, name in enumerate(kernel.arg_names):  # type: ignore[attr-defined]
        if name in constants:
            signature[name] = "constexpr"
        elif name in UNIT_STRIDES:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            if name in DATA_POINTERS:
                signature[name] = "*bf16"
            elif name.endswith("_ptr"):
                signature[name] = "*fp32" if "part" in name or name == "lse_ptr" else "*i32"
            else:
                signature[name] = "fp32" if name == "scale_log2" else "i32"
            if name.endswith("_ptr") or name.startswith("stride") or name == "head_dim":
                attrs[(index,)] = [["tt.divisibility", 16]]
    if "PDL" in kernel.arg_names and "PDL" not in constants:  # type: ignore[attr-defined]
        signature["PDL"], constexprs["PDL"] = "constexpr", 0
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    try:
        return triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
        )
    except (TypeError, AttributeError, FileNotFoundError, RuntimeError) as error:
        if "CompilationError" in type(error).__name__:
            raise
        raise _CannotCompileOffline(str(error)) from error


COMMON = {"G": 4, "QMAX": 1, "PAGE": 16, "HEAD_DIM": 128, "UPCAST": False, "DOT_PRECISION": "tf32"}
ATTENTION = {
    "OWNERS_BLOCK": 256,
    "PREFIX_BLOCK_M": 64,
    "SUFFIX_BLOCK_M": 16,
    "ROWS": 4,
    "PREFIX_BLOCK_N": 32,
    "SUFFIX_BLOCK_N": 32,
    "PASS": 0,
    "EARLY": False,
    **COMMON,
}
COMBINE = {"HAS_PREFIX": True, "G": 4, "QMAX": 1, "PREFIX_BLOCK_M": 64, "ROWS": 4, "EARLY": False, "LOAD_CACHE": ""}
# Hopper: 228 KB of shared memory per multiprocessor, 227 KB per program, 1 KB of it reserved per program.
SHARED_PER_SM = 228 * 1024


def compile_attention(has_prefix: bool, num_warps: int = 4, num_stages: int = 3, **overrides: object) -> object:
    from arctic_dedup.forest import _kernels

    return _compile(
        _kernels.forest_attention_kernel, {**ATTENTION, "HAS_PREFIX": has_prefix, **overrides}, num_warps, num_stages
    )


def _compile_all() -> None:
    from arctic_dedup.forest import _kernels

    forest = compile_attention(True)
    paged = compile_attention(False, SUFFIX_BLOCK_N=64)
    for kernel in (_kernels.plan_count_kernel, _kernels.plan_cut_kernel):
        _compile(kernel, {"BLOCK_E": 1024}, 4, 1)
    _compile(_kernels.plan_group_kernel, {"MEMBERS": 16, "BLOCK_R": 128, "BLOCK_E": 1024}, 4, 1)
    _compile(_kernels.plan_paged_kernel, {"BLOCK_R": 128}, 4, 1)
    _compile(
        _kernels.forest_combine_kernel,
        {**COMBINE, "CHUNK": 16, "DIM_BLOCK": 128},
        4,
        1,
    )
    # Programmatic dependent launch: every kernel lets the next launch start, then waits for the one before it,
    # before touching memory; without PDL nothing of it is emitted.
    dependent = [
        compile_attention(True, PDL=1),
        _compile(_kernels.plan_count_kernel, {"BLOCK_E": 1024, "PDL": 1}, 4, 1),
        _compile(_kernels.plan_group_kernel, {"MEMBERS": 16, "BLOCK_R": 128, "BLOCK_E": 1024, "PDL": 1}, 4, 1),
        _compile(
            _kernels.forest_combine_kernel,
            {**COMBINE, "CHUNK": 16, "DIM_BLOCK": 32, "PDL": 1},
            1,
            1,
        ),
    ]
    for compiled in dependent:
        ptx = compiled.asm["ptx"]  # type: ignore[attr-defined]
        trigger, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
        assert 0 <= trigger < wait, (compiled.name, trigger, wait)
        assert wait < min(ptx.find(op) for op in ("ld.global", "atom.global") if op in ptx)
    assert "griddepcontrol" not in forest.asm["ptx"]  # type: ignore[attr-defined]
    # Chained passes: the prefix pass waits before it lets the suffix pass start; the suffix pass waits last.
    prefix_ptx = compile_attention(True, PDL=2, PASS=1, PREFIX_BLOCK_N=64).asm["ptx"]  # type: ignore[attr-defined]
    assert 0 <= prefix_ptx.find("griddepcontrol.wait") < prefix_ptx.find("griddepcontrol.launch_dependents")
    suffix_ptx = compile_attention(True, PDL=3, PASS=2).asm["ptx"]  # type: ignore[attr-defined]
    wait = suffix_ptx.find("griddepcontrol.wait")
    assert 0 <= suffix_ptx.find("griddepcontrol.launch_dependents") < suffix_ptx.find("ld.global") < wait
    assert suffix_ptx.rfind("st.global") < wait
    # The early combine: attention items wait for the plan before letting the combine start and release their
    # counts after their stores; the combine lets the next launch start at once, polls its count with sleeps, reads
    # around L1 and waits for the attention launch only at its very end.
    for pass_ in (0, 1, 2):
        counting = compile_attention(True, PDL=2, PASS=pass_, EARLY=True).asm["ptx"]  # type: ignore[attr-defined]
        assert 0 <= counting.find("griddepcontrol.wait") < counting.find("griddepcontrol.launch_dependents")
        release = counting.rfind("atom.global.gpu.release")
        assert counting.rfind("st.global", 0, release) < counting.rfind("bar.sync", 0, release), pass_
        assert counting.count("atom.global.gpu.release") == (2 if pass_ == 0 else 1), pass_
    early = _compile(_kernels.forest_combine_kernel, {**COMBINE, "CHUNK": 8, "DIM_BLOCK": 64, "EARLY": True}
                     | {"LOAD_CACHE": ".cg", "PDL": 3}, 1, 1).asm["ptx"]  # type: ignore[attr-defined]  # fmt: skip
    wait = early.find("griddepcontrol.wait")
    assert 0 <= early.find("griddepcontrol.launch_dependents") < early.find("ld.global") and "nanosleep" in early
    assert "ld.global.gpu.acquire" in early and "ld.global.cg" in early and early.rfind("st.global") < wait
    # Prefix tiles run on Hopper's warpgroup tensor cores; every pass loads 16 bytes at a time.
    assert "wgmma" in forest.asm["ptx"]  # type: ignore[attr-defined]
    for compiled in (forest, paged):
        assert ".v4.b32" in compiled.asm["ptx"]  # type: ignore[attr-defined]
        # Three programs per multiprocessor (the default configs), so prefix and suffix items stream side by side;
        # more than one shared-memory buffer per operand means Triton prefetches K/V ahead of use.
        shared = compiled.metadata.shared  # type: ignore[attr-defined]
        assert 3 * (shared + 1024) <= SHARED_PER_SM, shared
    assert paged.metadata.shared > 2 * 64 * 128 * 2 * 2  # type: ignore[attr-defined]
    _compile_config_shapes()


def _compile_config_shapes() -> None:
    """The tile shapes and pipelines a ``ForestKernelConfig`` may ask for compile for Hopper and fit its memory."""
    from arctic_dedup.forest import _kernels

    attention = [
        ({"PASS": 1}, 4, 3),
        ({"PASS": 1, "PREFIX_BLOCK_N": 64}, 4, 3),
        ({"PASS": 1, "PREFIX_BLOCK_N": 128}, 8, 2),
        ({"PASS": 2}, 4, 3),
        ({"PASS": 2, "SUFFIX_BLOCK_N": 64}, 4, 3),
        ({"PREFIX_BLOCK_N": 64}, 4, 3),
        ({"PREFIX_BLOCK_N": 64}, 4, 2),
        # Deep prefix pipeline (112 KB, 2/SM), deep suffix pipeline (69 KB, 3/SM).
        ({"PASS": 1}, 4, 6),
        ({"PASS": 2}, 4, 5),
    ]
    for overrides, num_warps, num_stages in attention:
        compiled = compile_attention(True, num_warps, num_stages, **overrides)
        shared = compiled.metadata.shared  # type: ignore[attr-defined]
        assert shared + 1024 <= SHARED_PER_SM, (overrides, shared)
        # Still pipelined: more than one buffer per K/V operand.
        block_n = overrides.get("SUFFIX_BLOCK_N" if overrides.get("PASS") == 2 else "PREFIX_BLOCK_N", 32)
        assert shared > 2 * block_n * 128 * 2 * 2, (overrides, shared)
    _compile(
        _kernels.forest_combine_kernel,
        {**COMBINE, "CHUNK": 64, "DIM_BLOCK": 32},
        4,
        1,
    )


@pytest.mark.slow
def test_kernels_compile_for_hopper() -> None:
    # The interpreter replaces @triton.jit functions at import, so compile in a fresh process without it.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    if result.returncode == 3:
        pytest.skip(f"this triton build cannot compile for sm_90 offline: {result.stdout[-500:]}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


if __name__ == "__main__":
    try:
        _compile_all()
    except _CannotCompileOffline as error:
        print(error)
        sys.exit(3)
