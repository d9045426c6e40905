"""Where a paged attention loop's time goes: the forest decode inner loop alone, with its page ids from four sources.

Every forest pass measured so far streams about one K/V tile per program every ~2 us whatever the tile size (64x64
prefix tiles at 2 programs per SM, 16x32 suffix tiles at 4 per SM; ``lab/forest_NOTES.md``, round 9), well under
the copy rate in the single group's one wave. One hypothesis is the page id chain: each step's K/V addresses come from a
block-table load issued the step before, so a step cannot be shorter than that load's round trip. This probe runs
the loop of ``_attend_block`` (online softmax over paged K/V, tensor-core dots) on the same scattered pages with:

- ``table_ahead``: ids loaded one step ahead from the block table (what forest decode does);
- ``table_chunk``: ids of BLOCK_N pages loaded at once, each step's gathered from registers (``tl.gather``): one
  table round trip per BLOCK_N pages (1024 or 512 tokens) instead of one per step;
- ``hashed``: ids computed from the token index (the same scattered pages, no table read at all): the floor for any
  id source;
- ``contiguous``: consecutive pages (no table, no scattering): what a contiguous cache would allow.

Shapes (bf16, d=128, block 16, 8 kv heads, kv heads adjacent programs, 4 warps, 3 stages): the single group's prefix
pass (64 rows, 64-token steps, 16 splits x 8 heads of 512 tokens), RL-8x16's (256 programs of 2048 tokens) and its
suffix pass (16 rows, 32-token steps, 1024 programs of 512 tokens). Each call reads a different copy of the cache
(4 copies, more than L2). Prints TB/s of K/V read per shape and id source; writes fca_loop_probe.json.

    python benchmarks/lab/fca_loop_probe.py            (H200, about 30 s)
    python benchmarks/lab/fca_loop_probe.py --smoke    (CPU, Triton interpreter: checks every mode against torch)
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
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
from common import default_lab_out_dir, print_table, write_results
from fca_decode import _graph_time_us

# The gather mode last: a fault there (an illegal address ends the CUDA context) keeps the others' rows.
MODES = {"table_ahead": 0, "hashed": 2, "contiguous": 3, "table_chunk": 1}
HASH = 7919  # odd multiplier: page p of the cache's num_blocks (a power of two) -> p * HASH % num_blocks


@triton.jit
def _page_of(item, page, pages_per_item, num_blocks, MODE: tl.constexpr):
    if MODE == 3:
        return (item * pages_per_item + page).to(tl.int64)
    return ((item * pages_per_item + page).to(tl.int64) * 7919) % num_blocks


@triton.jit
def _softmax_step(q, k, v, m_i, l_i, acc):
    # One online-softmax step over a K/V tile (exp2 of raw scores: the probe's queries carry the scale).
    scores = tl.dot(q, tl.trans(k))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def loop_probe_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    out_ptr,
    tokens_per_item,
    pages_per_item,
    num_blocks,
    num_kv_heads,
    stride_block,
    stride_token,
    stride_head,
    MODE: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    pid = tl.program_id(0)
    item = pid // num_kv_heads
    kv_head = pid % num_kv_heads
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (pid * BLOCK_M + rows)[:, None].to(tl.int64) * HEAD_DIM + dims[None, :])
    row_ptr = table_ptr + item.to(tl.int64) * pages_per_item
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    head_offset = kv_head.to(tl.int64) * stride_head
    if MODE == 1:
        # BLOCK_N pages per table load (the gather's source and index then have one shape and layout).
        CHUNK_TOKENS: tl.constexpr = BLOCK_N * PAGE
        for chunk in range(0, tokens_per_item, CHUNK_TOKENS):
            slots = chunk // PAGE + tl.arange(0, BLOCK_N)
            chunk_ids = tl.load(row_ptr + slots, mask=slots < pages_per_item, other=0)
            for base in range(0, tl.minimum(CHUNK_TOKENS, tokens_per_item - chunk), BLOCK_N):
                local = base + tl.arange(0, BLOCK_N)
                pages = tl.gather(chunk_ids, local // PAGE, 0).to(tl.int64)
                local = chunk + local
                kv_rows = pages * stride_block + (local % PAGE).to(tl.int64) * stride_token + head_offset
                k = tl.load(k_ptr + kv_rows[:, None] + dims[None, :])
                v = tl.load(v_ptr + kv_rows[:, None] + dims[None, :])
                m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc)
    else:
        next_tokens = tl.arange(0, BLOCK_N)
        if MODE == 0:
            next_pages = tl.load(row_ptr + next_tokens // PAGE)
        else:
            next_pages = _page_of(item, next_tokens // PAGE, pages_per_item, num_blocks, MODE)
        for base in range(0, tokens_per_item, BLOCK_N):
            tokens = base + tl.arange(0, BLOCK_N)
            pages = next_pages.to(tl.int64)
            following = tokens + BLOCK_N
            if MODE == 0:
                next_pages = tl.load(row_ptr + following // PAGE, mask=following < tokens_per_item, other=0)
            else:
                next_pages = _page_of(item, following // PAGE, pages_per_item, num_blocks, MODE)
            kv_rows = pages * stride_block + (tokens % PAGE).to(tl.int64) * stride_token + head_offset
            k = tl.load(k_ptr + kv_rows[:, None] + dims[None, :])
            v = tl.load(v_ptr + kv_rows[:, None] + dims[None, :])
            m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc)
    tl.store(out_ptr + (pid * BLOCK_M + rows)[:, None].to(tl.int64) * HEAD_DIM + dims[None, :], acc / l_i[:, None])


@dataclass(frozen=True)
class ProbeShape:
    name: str
    rows: int
    block_n: int
    items: int
    tokens_per_item: int
    stages: int = 3
    modes: tuple[str, ...] = tuple(MODES)


AHEAD = ("table_ahead",)
# table_chunk faulted (illegal address) on the H200 for items of more than one chunk (RL-8x16's 2048-token prefix
# items, 2026-12-01); with one chunk it ran and timed like the others, so the multi-chunk shapes leave it out.
SHAPES = (
    ProbeShape("single group prefix pass (64x64, 128 programs x 512 tokens)", 64, 64, 16, 512),
    ProbeShape("RL-8x16 prefix pass (64x64, 256 programs x 2048 tokens)", 64, 64, 32, 2048, modes=AHEAD),
    ProbeShape("RL-8x16 suffix pass (16x32, 1024 programs x 512 tokens)", 16, 32, 128, 512, modes=AHEAD),
    # The single group's programs one per SM, by tile and stages: which of its two programs per SM is the slow one.
    ProbeShape("single group prefix, 4 stages (64x64)", 64, 64, 16, 512, 4, AHEAD),
    ProbeShape("single group suffix (16x32, 128 programs x 512 tokens)", 16, 32, 16, 512, 3, AHEAD),
    ProbeShape("single group suffix, 4 stages (16x32)", 16, 32, 16, 512, 4, AHEAD),
    ProbeShape("single group suffix, 6 stages (16x32)", 16, 32, 16, 512, 6, AHEAD),
    ProbeShape("single group suffix (16x64)", 16, 64, 16, 512, 3, AHEAD),
    ProbeShape("single group suffix, 4 stages (16x64)", 16, 64, 16, 512, 4, AHEAD),
)
# --sweep: time = fixed cost + per-step cost? One program per SM (16 items x 8 kv heads), tokens per item swept.
_ONE_PER_SM = tuple(
    ProbeShape(
        f"sweep {rows}x{block_n} {stages} stages, 128 programs x {tokens} tokens",
        rows,
        block_n,
        16,
        tokens,
        stages,
        AHEAD,
    )
    for rows, block_n in ((64, 64), (16, 32))
    for stages in (2, 3)
    for tokens in (64, 256, 512, 1024, 2048, 4096)
)
SWEEP_SHAPES = (
    *_ONE_PER_SM,
    ProbeShape("sweep 64x64 3 stages, 256 programs x 512 tokens (2 per SM)", 64, 64, 32, 512, 3, AHEAD),
    ProbeShape("sweep 16x32 3 stages, 256 programs x 512 tokens (2 per SM)", 16, 32, 32, 512, 3, AHEAD),
    ProbeShape("sweep 16x32 3 stages, 512 programs x 512 tokens (4 per SM)", 16, 32, 64, 512, 3, AHEAD),
)
# --suffix-ids (round 22): the 16-row suffix loop by id source and stages. Its per-step cost (0.78 us per 16 KB step
# alone on an SM, 4-6 stages no better) looks like one round trip per step: is it the page-id load the next K/V copy
# waits for? One item of 512 tokens per program is one table chunk, so every mode runs.
SUFFIX_ID_SHAPES = tuple(
    ProbeShape(
        f"suffix ids 16x{block_n} {stages} stages, {items * 8} programs x 512 tokens", 16, block_n, items, 512, stages
    )
    for block_n in (32, 64)
    for stages in (3, 4, 6)
    for items in (16, 64)
)
SMOKE_SHAPES = (ProbeShape("smoke 16x16", 16, 16, 2, 128), ProbeShape("smoke 16x32", 16, 32, 3, 256, 4))


class Setup:
    """Paged K/V caches (``copies`` of them), a scattered block table and queries for one probe shape."""

    def __init__(self, shape: ProbeShape, heads: int, head_dim: int, page: int, copies: int, device: str) -> None:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        pages_per_item = shape.tokens_per_item // page
        num_blocks = triton.next_power_of_2(shape.items * pages_per_item)
        self.shape, self.heads, self.head_dim, self.page = shape, heads, head_dim, page
        self.pages_per_item, self.num_blocks = pages_per_item, num_blocks
        index = torch.arange(shape.items * pages_per_item, dtype=torch.int64)
        self.table = ((index * HASH) % num_blocks).to(torch.int32).to(device)
        self.caches = [
            (
                torch.randn(num_blocks, page, heads, head_dim, dtype=dtype, device=device),
                torch.randn(num_blocks, page, heads, head_dim, dtype=dtype, device=device),
            )
            for _ in range(copies)
        ]
        programs = shape.items * heads
        self.query = torch.randn(programs * shape.rows, head_dim, dtype=dtype, device=device) * head_dim**-0.5
        self.out = torch.empty(programs * shape.rows, head_dim, dtype=torch.float32, device=device)
        self.read_bytes = 2 * shape.items * shape.tokens_per_item * heads * head_dim * self.caches[0][0].element_size()

    def launch(self, mode: int, copy: int) -> Any:
        key, value = self.caches[copy]
        shape = self.shape
        return loop_probe_kernel[(shape.items * self.heads,)](
            self.query,
            key,
            value,
            self.table,
            self.out,
            shape.tokens_per_item,
            self.pages_per_item,
            self.num_blocks,
            self.heads,
            key.stride(0),
            key.stride(1),
            key.stride(2),
            MODE=mode,
            PAGE=self.page,
            BLOCK_M=shape.rows,
            BLOCK_N=shape.block_n,
            HEAD_DIM=self.head_dim,
            num_warps=4,
            num_stages=shape.stages,
        )

    def reference(self, mode: int, copy: int) -> torch.Tensor:
        """Plain torch attention of each program's rows over its item's pages (fp32)."""
        key, value = self.caches[copy]
        shape = self.shape
        index = torch.arange(shape.items * self.pages_per_item, device=key.device)
        pages = index if mode == MODES["contiguous"] else (index * HASH) % self.num_blocks
        pages = pages.view(shape.items, self.pages_per_item)
        outs = []
        for item in range(shape.items):
            keys = key[pages[item]].reshape(-1, self.heads, self.head_dim).float()
            values = value[pages[item]].reshape(-1, self.heads, self.head_dim).float()
            for head in range(self.heads):
                program = item * self.heads + head
                q = self.query[program * shape.rows : (program + 1) * shape.rows].float()
                scores = q @ keys[:, head].T  # the probe's dot has no scale: exp2 of raw scores
                weights = torch.softmax(scores * torch.log(torch.tensor(2.0)), dim=-1)
                outs.append(weights @ values[:, head])
        return torch.cat(outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: $OUT or benchmarks/results)")
    parser.add_argument("--smoke", action="store_true", help="CPU: check every mode against torch on tiny shapes")
    parser.add_argument(
        "--sweep", action="store_true", help="one program per SM, tokens per item swept (fixed vs step)"
    )
    parser.add_argument(
        "--suffix-ids", action="store_true", help="the 16-row suffix loop by page-id source, tile and stages"
    )
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("fca_loop_probe needs a CUDA GPU (or --smoke)")
    started = time.time()
    heads, head_dim, page = (2, 32, 16) if args.smoke else (8, 128, 16)
    rows: list[dict[str, Any]] = []
    chosen = SUFFIX_ID_SHAPES if args.suffix_ids else (SWEEP_SHAPES if args.sweep else SHAPES)
    for shape in SMOKE_SHAPES if args.smoke else chosen:
        setup = Setup(shape, heads, head_dim, page, 1 if args.smoke else 4, device)
        for mode_name in shape.modes:
            mode = MODES[mode_name]
            compiled = setup.launch(mode, 0)
            if device == "cuda":
                torch.cuda.synchronize()
            error = (setup.out - setup.reference(mode, 0)).abs().max().item()
            row: dict[str, Any] = {"shape": shape.name, "ids": mode_name, "stages": shape.stages}
            row["max_abs_error"] = error
            if device == "cuda":
                calls = [partial(setup.launch, mode, copy) for copy in range(4)] * 2
                us = _graph_time_us(calls, 10, "cuda")
                row.update(us=us, TBps=setup.read_bytes / us / 1e6, MB=setup.read_bytes / 1e6)
                row.update(registers=compiled.n_regs, shared_KB=compiled.metadata.shared // 1024)
            rows.append(row)
            print(row, flush=True)
        del setup
        if device == "cuda":
            torch.cuda.empty_cache()
    bad = [row for row in rows if not row["max_abs_error"] < (2e-2 if device == "cuda" else 1e-4)]
    summary = {"seconds": time.time() - started, "ok": not bad}
    print_table(rows, ["shape", "ids", "stages", "us", "MB", "TBps", "registers", "shared_KB", "max_abs_error"])
    path = write_results(
        args.out or default_lab_out_dir(),
        "fca_loop_probe_suffix_ids" if args.suffix_ids else "fca_loop_probe_sweep" if args.sweep else "fca_loop_probe",
        summary,
        rows,
    )
    print(f"{'ok' if not bad else 'FAILED'} in {summary['seconds']:.0f} s | wrote {path}", flush=True)
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
