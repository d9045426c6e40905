"""Does a flat loop across work items stream faster than one program per item? And what does a plain read reach?

Forest decode gives each work item (an owner's split: a group tile's prefix or a request's suffix, for one kv head)
a program of its own. A program pays ~4-6 us before its first K/V tile arrives and drains its pipeline at the end
(``fca_loop_probe.py --sweep``), and RL-8x16's suffix pass is ~2 waves of 1024 such programs of 512 tokens. This
probe times the same inner loop (``fca_loop_probe``'s ``_softmax_step`` over scattered pages, ids one step ahead)
in two forms over the same caches:

- ``per_item``: one program per (item, kv head), as forest decode does;
- ``flat``: a fixed grid of P programs; the owners' steps are laid end to end and program p takes the p-th run of
  ``ceil(steps / P)`` of them, crossing owners inside one pipelined loop (the next owner's first K/V tiles are in
  flight while the current owner's last ones are used). Where an owner's steps end or the run ends, the program
  writes a partial (output and log2-sum-exp) and starts the next owner; the host merges the partials for the check.

And ``read ceiling``: a Triton kernel that only reads a contiguous 2 GiB buffer (a sum), the most any read-only
kernel can stream here (the copy rate counts reads and writes, so a read-only kernel can beat it).

    python benchmarks/lab/fca_flat_probe.py            (H200, about 30 s; writes fca_flat_probe.json)
    python benchmarks/lab/fca_flat_probe.py --smoke    (CPU, Triton interpreter: both forms checked against torch)
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import itertools
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

# The lab imports the shared harness and the main benchmarks from benchmarks/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbps, default_lab_out_dir, print_table, write_results
from fca_decode import _graph_time_us
from fca_loop_probe import MODES, ProbeShape, Setup, _softmax_step


@triton.jit
def flat_probe_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    part_out_ptr,
    part_lse_ptr,
    steps_per_owner,
    total_steps,
    run_steps,
    pages_per_item,
    num_kv_heads,
    stride_block,
    stride_token,
    stride_head,
    MAX_SEGMENTS: tl.constexpr,
    BRANCH: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    # Owner o = item * num_kv_heads + kv_head owns flat steps [o * S, (o + 1) * S); this program runs
    # [pid * run_steps, (pid + 1) * run_steps). Segment j of an owner is the j-th program that touches it.
    pid = tl.program_id(0)
    first_step = pid * run_steps
    last_step = tl.minimum(first_step + run_steps, total_steps)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    lanes = tl.arange(0, BLOCK_N)
    owner = first_step // steps_per_owner
    runs = first_step < last_step
    q = tl.load(
        q_ptr + (owner * BLOCK_M + rows)[:, None].to(tl.int64) * HEAD_DIM + dims[None, :],
        mask=runs & (rows[:, None] >= 0),
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    step = first_step - owner * steps_per_owner
    next_pages = tl.load(
        table_ptr + (owner // num_kv_heads).to(tl.int64) * pages_per_item + (step * BLOCK_N + lanes) // PAGE,
        mask=runs,
        other=0,
    )
    for flat in range(first_step, last_step):
        owner = flat // steps_per_owner
        step = flat - owner * steps_per_owner
        kv_head = owner % num_kv_heads
        tokens = step * BLOCK_N + lanes
        pages = next_pages.to(tl.int64)
        following = flat + 1
        following_owner = following // steps_per_owner
        following_tokens = (following - following_owner * steps_per_owner) * BLOCK_N + lanes
        next_pages = tl.load(
            table_ptr + (following_owner // num_kv_heads).to(tl.int64) * pages_per_item + following_tokens // PAGE,
            mask=following < last_step,
            other=0,
        )
        kv_rows = (
            pages * stride_block + (tokens % PAGE).to(tl.int64) * stride_token + kv_head.to(tl.int64) * stride_head
        )
        k = tl.load(k_ptr + kv_rows[:, None] + dims[None, :])
        v = tl.load(v_ptr + kv_rows[:, None] + dims[None, :])
        # A new owner's query (the run's first owner's was loaded before the loop).
        fresh = (step == 0) & (flat > first_step)
        if fresh:
            # Inside a branch, so the pipeliner does not give the query buffers of its own (shared memory).
            q = tl.load(q_ptr + (owner * BLOCK_M + rows)[:, None].to(tl.int64) * HEAD_DIM + dims[None, :])
        m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc)
        ends = (step == steps_per_owner - 1) | (following == last_step)
        segment = pid - (owner * steps_per_owner) // run_steps
        slot = ((owner * MAX_SEGMENTS + segment) * BLOCK_M + rows).to(tl.int64)
        if BRANCH:
            # The partial's store (a layout conversion of the accumulator) only where an owner's run ends.
            if ends:
                tl.store(part_out_ptr + slot[:, None] * HEAD_DIM + dims[None, :], acc / l_i[:, None])
                tl.store(part_lse_ptr + slot, m_i + tl.log2(l_i))
                m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
                acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        else:
            # Masked stores and selects every step (no branch in the loop body).
            tl.store(
                part_out_ptr + slot[:, None] * HEAD_DIM + dims[None, :],
                acc / l_i[:, None],
                mask=ends & (rows[:, None] >= 0),
            )
            tl.store(part_lse_ptr + slot, m_i + tl.log2(l_i), mask=ends & (rows >= 0))
            m_i = tl.where(ends, float("-inf"), m_i)
            l_i = tl.where(ends, 0.0, l_i)
            acc = tl.where(ends, 0.0, acc)


@triton.jit
def read_ceiling_kernel(x_ptr, out_ptr, elements_per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * elements_per_program
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in tl.range(0, elements_per_program, BLOCK, num_stages=4):
        total += tl.load(x_ptr + start + offset + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(total, 0))


@dataclass(frozen=True)
class FlatCase:
    shape: ProbeShape
    programs: tuple[int, ...]  # flat grids to time beside the per-item launch


# Each case's first flat grid has one program per owner (the flat loop's own cost: no owner is split or shared).
CASES = (
    FlatCase(ProbeShape("RL-8x16 suffix pass (16x32, 1024 owners x 512 tokens)", 16, 32, 128, 512), (1024, 528, 792)),
    FlatCase(ProbeShape("RL-8x16 suffix pass, 16x64 tiles", 16, 64, 128, 512), (1024, 264, 528)),
    FlatCase(ProbeShape("RL-8x16 prefix pass (64x64, 256 owners x 2048 tokens)", 64, 64, 32, 2048), (256, 132)),
    FlatCase(ProbeShape("single group prefix (64x64, 128 owners x 512 tokens)", 64, 64, 16, 512), (128, 132)),
    FlatCase(ProbeShape("single group suffix (16x32, 128 owners x 512 tokens)", 16, 32, 16, 512), (128, 264, 528)),
)
SMOKE_CASES = (
    FlatCase(ProbeShape("smoke 16x16", 16, 16, 3, 128), (1, 4, 5, 16)),
    FlatCase(ProbeShape("smoke 16x32", 16, 32, 2, 256, 4), (3, 7)),
)


def _flat_launch(setup: Setup, programs: int, parts: tuple[torch.Tensor, torch.Tensor], copy: int, branch: bool) -> Any:
    key, value = setup.caches[copy]
    shape = setup.shape
    steps_per_owner = shape.tokens_per_item // shape.block_n
    total = shape.items * setup.heads * steps_per_owner
    run_steps = triton.cdiv(total, programs)
    return flat_probe_kernel[(programs,)](
        setup.query,
        key,
        value,
        setup.table,
        parts[0],
        parts[1],
        steps_per_owner,
        total,
        run_steps,
        setup.pages_per_item,
        setup.heads,
        key.stride(0),
        key.stride(1),
        key.stride(2),
        MAX_SEGMENTS=parts[1].shape[1],
        BRANCH=branch,
        PAGE=setup.page,
        BLOCK_M=shape.rows,
        BLOCK_N=shape.block_n,
        HEAD_DIM=setup.head_dim,
        num_warps=4,
        num_stages=shape.stages,
    )


def _flat_parts(setup: Setup, programs: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = setup.shape
    owners = shape.items * setup.heads
    steps_per_owner = shape.tokens_per_item // shape.block_n
    run_steps = triton.cdiv(owners * steps_per_owner, programs)
    # An owner's S steps meet at most ceil((S - 1) / run) + 1 runs.
    segments = triton.cdiv(steps_per_owner - 1, run_steps) + 1
    device = setup.query.device
    out = torch.zeros(owners, segments, shape.rows, setup.head_dim, dtype=torch.float32, device=device)
    lse = torch.full((owners, segments, shape.rows), float("-inf"), dtype=torch.float32, device=device)
    return out, lse


def _merge(parts: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Each owner's segments merged by log2-sum-exp (unwritten segments keep lse = -inf)."""
    out, lse = parts
    weights = torch.softmax(lse * torch.log(torch.tensor(2.0)), dim=1)
    return (weights[..., None] * torch.nan_to_num(out)).sum(1).reshape(-1, out.shape[-1])


def _read_ceiling(repeats: int) -> dict[str, Any]:
    elements = 1 << 30  # 2 GiB of bf16
    x = torch.empty(elements, dtype=torch.bfloat16, device="cuda").normal_()
    programs = 132 * 8
    block = 4096
    per_program = triton.cdiv(elements // programs, block) * block
    programs = elements // per_program
    sums = torch.empty(programs, dtype=torch.float32, device="cuda")
    compiled = read_ceiling_kernel[(programs,)](x, sums, per_program, BLOCK=block, num_warps=8)
    torch.cuda.synchronize()
    expected = x[: programs * per_program].float().view(programs, -1).sum(1)
    error = ((sums - expected).abs() / expected.abs().clamp_min(1.0)).max().item()
    us = _graph_time_us(
        [partial(read_ceiling_kernel[(programs,)], x, sums, per_program, BLOCK=block, num_warps=8)], repeats, "cuda"
    )
    read = programs * per_program * 2
    return {
        "shape": f"read ceiling ({read / 2**30:.1f} GiB contiguous, {programs} programs)",
        "form": "read",
        "us": us,
        "MB": read / 1e6,
        "TBps": read / us / 1e6,
        "registers": compiled.n_regs,
        "rel_error": error,
        "ok": error < 1e-3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: $OUT or benchmarks/results)")
    parser.add_argument("--smoke", action="store_true", help="CPU: check both forms against torch on tiny shapes")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("fca_flat_probe needs a CUDA GPU (or --smoke)")
    started = time.time()
    heads, head_dim, page = (2, 32, 16) if args.smoke else (8, 128, 16)
    copies = 1 if args.smoke else 4
    rows: list[dict[str, Any]] = []
    table_ahead = MODES["table_ahead"]
    tolerance = 2e-2 if device == "cuda" else 1e-4
    for case in SMOKE_CASES if args.smoke else CASES:
        setup = Setup(case.shape, heads, head_dim, page, copies, device)
        reference = setup.reference(table_ahead, 0)
        base = {"shape": case.shape.name, "stages": case.shape.stages, "MB": setup.read_bytes / 1e6}
        compiled = setup.launch(table_ahead, 0)
        row: dict[str, Any] = {**base, "form": "per_item", "programs": case.shape.items * heads}
        row["max_abs_error"] = (setup.out - reference).abs().max().item()
        row["ok"] = row["max_abs_error"] < tolerance
        if device == "cuda":
            us = _graph_time_us([partial(setup.launch, table_ahead, c) for c in range(copies)] * 2, 10, device)
            row.update(us=us, TBps=setup.read_bytes / us / 1e6, registers=compiled.n_regs)
        rows.append(row)
        print(row, flush=True)
        for programs, branch in itertools.product(case.programs, (False, True)):
            parts = _flat_parts(setup, programs)
            compiled = _flat_launch(setup, programs, parts, 0, branch)
            row = {**base, "form": "flat, branch" if branch else "flat, masked", "programs": programs}
            row["segments"] = parts[1].shape[1]
            row["max_abs_error"] = (_merge(parts) - reference).abs().max().item()
            row["ok"] = row["max_abs_error"] < tolerance
            if device == "cuda":
                calls = [partial(_flat_launch, setup, programs, parts, c, branch) for c in range(copies)] * 2
                us = _graph_time_us(calls, 10, device)
                row.update(us=us, TBps=setup.read_bytes / us / 1e6, registers=compiled.n_regs)
                row["shared_KB"] = compiled.metadata.shared // 1024
            rows.append(row)
            print(row, flush=True)
        del setup
        if device == "cuda":
            torch.cuda.empty_cache()
    summary: dict[str, Any] = {}
    if device == "cuda":
        rows.append(_read_ceiling(20))
        summary["read_ceiling_tbps"] = rows[-1]["TBps"]
        summary["copy_tbps"] = copy_bandwidth_gbps() / 1e3
        print(rows[-1], flush=True)
    bad = [row for row in rows if not row["ok"]]
    summary.update(seconds=time.time() - started, ok=not bad)
    print_table(rows, ["shape", "form", "programs", "stages", "us", "MB", "TBps", "registers", "max_abs_error"])
    path = write_results(args.out or default_lab_out_dir(), "fca_flat_probe", summary, rows)
    print(f"{'ok' if not bad else 'FAILED'} in {summary['seconds']:.0f} s | wrote {path}", flush=True)
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
