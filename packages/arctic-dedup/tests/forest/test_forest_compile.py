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


def _compile_all() -> None:
    from arctic_dedup.forest import _kernels

    prefix = _compile(
        _kernels.prefix_attention_kernel,
        {"NUM_TILES": 128, "SEARCH_STEPS": 9, "MEMBERS": 16, "BLOCK_M": 64, "BLOCK_N": 64, **COMMON},
        4,
        2,
    )
    suffix = _compile(
        _kernels.suffix_attention_kernel,
        {"NUM_REQUESTS": 128, "SEARCH_STEPS": 9, "BLOCK_M": 16, "BLOCK_N": 64, **COMMON},
        4,
        2,
    )
    _compile(
        _kernels.combine_kernel,
        {
            "HAS_PREFIX": True,
            "G": 4,
            "QMAX": 1,
            "PREFIX_BLOCK_M": 64,
            "SUFFIX_BLOCK_M": 16,
            "BLOCK_R": 16,
            "HEAD_DIM": 128,
        },
        4,
        1,
    )
    # The prefix pass must run on Hopper's warpgroup tensor cores and every pass must load 16 bytes at a time.
    assert "wgmma" in prefix.asm["ptx"]  # type: ignore[attr-defined]
    for compiled in (prefix, suffix):
        assert ".v4.b32" in compiled.asm["ptx"]  # type: ignore[attr-defined]


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
