"""Probe: does a warp-specialized TMA loop stream the single group's shared prefix faster than forest decode's pass?

Forest decode's prefix pass streams the single group's 33.6 MB of prefix K/V (16 requests x 8192 shared tokens,
8 kv heads, d=128, bf16, block 16) at ~1.9 TB/s in one wave (forest/NOTES.md, rounds 4-8). Triton 3.6 runs a Hopper
warp-specialization pass on loops marked ``tl.range(..., warp_specialize=True)`` (8 warps) and lowers
tensor-descriptor loads to TMA; Hopper TMA cannot gather rows of different pages, so each step here loads one
16-token block ([16, 128] box) of K and of V for one kv head. This probe times that loop alone, over the same
prefix splits as the forest pass (16 splits x 8 kv heads = 128 programs), against the forest prefix pass alone on
the same batch, both in CUDA graphs cycling over 4 copies of the cache (no L2 reuse between calls). Not library
code: the probe's inputs (each kv head's 64 query rows, the leader's table row) are gathered outside the timing,
and its outputs are split partials, checked by merging them against an fp32 reference.

    python benchmarks/fca_ws_probe.py --out benchmarks/results     (H200; ~1 min; writes fca_ws_probe.json)
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))

from fca_decode import H200, Case, _forest_plan, _graph_time_us, write_results

from arctic_dedup.forest import ForestKernelConfig, ForestWorkspace
from arctic_dedup.forest._launch import allocate_partials, launch_attention
from arctic_dedup.forest.testing import DecodeBatch

COPIES = 4
SPLITS = 16


@triton.jit
def _prefix_probe_kernel(
    q_ptr,
    k_desc,
    v_desc,
    table_ptr,
    part_out_ptr,
    part_lse_ptr,
    pages_per_split,
    scale_log2,
    num_kv_heads,
    BLOCK_M: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    STAGES: tl.constexpr,
):
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (kv_head * BLOCK_M + rows)[:, None] * HEAD_DIM + dims[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    first = split * pages_per_split
    for index in tl.range(first, first + pages_per_split, warp_specialize=WARP_SPECIALIZE, num_stages=STAGES):
        page = tl.load(table_ptr + index)
        k = k_desc.load([page * PAGE, kv_head * HEAD_DIM])
        v = v_desc.load([page * PAGE, kv_head * HEAD_DIM])
        scores = tl.dot(q, tl.trans(k)) * scale_log2
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
        m_i = m_new
    base = (split * num_kv_heads + kv_head) * BLOCK_M + rows
    tl.store(part_out_ptr + base[:, None] * HEAD_DIM + dims[None, :], acc / l_i[:, None])
    tl.store(part_lse_ptr + base, (m_i + tl.log2(l_i)) * 0.6931471805599453)


class _Probe:
    """One copy's inputs: the forest plan (for its prefix pass) and the probe's gathered query rows and table."""

    def __init__(self, batch: DecodeBatch, config: ForestKernelConfig) -> None:
        self.batch = batch
        workspace = ForestWorkspace(batch.key_cache.shape[0], "cuda")
        self.plan = _forest_plan(batch, H200, config, workspace)
        self.partials = allocate_partials(self.plan, batch.query.shape[2], batch.query.device)
        self.out = torch.empty_like(batch.query)
        self.lse = torch.empty(batch.query.shape[:2], device="cuda")
        assert int(self.plan.num_groups[0]) == 1, "the single group must be found"
        leader = int(self.plan.tile_leader[0])
        self.prefix_pages = int(self.plan.tile_prefix_blocks[0])
        members = self.plan.member_list[: int(self.plan.tile_member_count[0])].long()
        heads_kv, group = H200.heads_kv, H200.queries_per_kv
        tokens = batch.query_start_loc[members].long()
        # [kv head, member * G + g, d]: the 64 GQA rows of the prefix tile, as the forest pass builds them.
        rows = batch.query[tokens].view(len(tokens), heads_kv, group, -1).permute(1, 0, 2, 3)
        self.q = rows.reshape(heads_kv, len(tokens) * group, -1).contiguous()
        self.members = members
        self.table = batch.block_table[leader, : self.prefix_pages].to(torch.int32).contiguous()
        cache_rows = batch.key_cache.shape[0] * batch.key_cache.shape[1]
        width = heads_kv * batch.key_cache.shape[3]
        self.k2d = batch.key_cache.reshape(cache_rows, width)
        self.v2d = batch.value_cache.reshape(cache_rows, width)
        self.part_out = torch.empty(SPLITS, heads_kv, self.q.shape[1], self.q.shape[2], device="cuda")
        self.part_lse = torch.empty(SPLITS, heads_kv, self.q.shape[1], device="cuda")

    def forest_prefix_pass(self, scale: float) -> None:
        batch = self.batch
        launch_attention(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            self.plan,
            scale,
            self.out,
            self.lse,
            self.partials,
            passes=(1,),
        )

    def probe(self, scale: float, warp_specialize: bool, stages: int, num_warps: int) -> None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        page, dim = H200.block, H200.head_dim
        k_desc = TensorDescriptor(self.k2d, list(self.k2d.shape), list(self.k2d.stride()), [page, dim])
        v_desc = TensorDescriptor(self.v2d, list(self.v2d.shape), list(self.v2d.stride()), [page, dim])
        _prefix_probe_kernel[(SPLITS, H200.heads_kv)](
            self.q,
            k_desc,
            v_desc,
            self.table,
            self.part_out,
            self.part_lse,
            self.prefix_pages // SPLITS,
            scale * 1.4426950408889634,
            H200.heads_kv,
            BLOCK_M=self.q.shape[1],
            PAGE=page,
            HEAD_DIM=dim,
            WARP_SPECIALIZE=warp_specialize,
            STAGES=stages,
            num_warps=num_warps,
        )

    def probe_error(self, scale: float) -> float:
        """The probe's split partials merged by log-sum-exp against fp32 attention over the prefix tokens."""
        weights = torch.softmax(self.part_lse, dim=0)
        merged = (weights[..., None] * self.part_out).sum(0)
        batch = self.batch
        tokens = (self.table.long()[:, None] * H200.block + torch.arange(H200.block, device="cuda")).reshape(-1)
        keys = batch.key_cache.reshape(-1, H200.heads_kv, H200.head_dim)[tokens].float()
        values = batch.value_cache.reshape(-1, H200.heads_kv, H200.head_dim)[tokens].float()
        scores = torch.einsum("hrd,thd->hrt", self.q.float(), keys) * scale
        reference = torch.einsum("hrt,thd->hrd", torch.softmax(scores, -1), values)
        return float((merged - reference).norm() / reference.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fca_ws_probe.py needs a CUDA GPU (Hopper: TMA and warp specialization)")
    scale = H200.head_dim**-0.5
    config = ForestKernelConfig(prefix_block_n=64, prefix_waves=1.0, waves=1.0, split_passes=True)
    case = Case("single_group_16x8704", [8192], [[512] * 16], False, H200, copies=COPIES)
    probes = [_Probe(batch, config) for batch in case.batches]
    prefix_bytes = probes[0].prefix_pages * H200.block * H200.heads_kv * H200.head_dim * 2 * 2
    per_graph = 8
    rows: list[dict[str, Any]] = []

    def timed(label: str, calls: list[Any], **extra: Any) -> None:
        cycled = [calls[i % len(calls)] for i in range(per_graph)]
        us = _graph_time_us(cycled, args.repeats, "cuda")
        rows.append({"variant": label, "us": us, "TB/s": prefix_bytes / us / 1e6, **extra})
        print(f"{label}: {us:.1f} us ({prefix_bytes / us / 1e6:.2f} TB/s on {prefix_bytes / 1e6:.1f} MB)", flush=True)

    items = int(probes[0].plan.work_start[probes[0].plan.num_requests])
    timed(
        "forest prefix pass (64x64 tiles, 4 warps, 3 stages)",
        [partial(p.forest_prefix_pass, scale) for p in probes],
        prefix_items=items,
    )
    for warp_specialize, stages, num_warps in (
        (False, 3, 8),
        (False, 4, 8),
        (True, 2, 8),
        (True, 3, 8),
        (True, 4, 8),
        (False, 3, 4),
    ):
        label = f"probe ws={warp_specialize} stages={stages} warps={num_warps}"
        try:
            probes[0].probe(scale, warp_specialize, stages, num_warps)
            error = probes[0].probe_error(scale)
            if not error < 1.5e-2:
                rows.append({"variant": label, "error": error, "ok": False})
                print(f"{label}: WRONG (relative error {error:.3g})", flush=True)
                continue
            calls = [partial(p.probe, scale, warp_specialize, stages, num_warps) for p in probes]
            timed(label, calls, rel_error_vs_reference=error, ok=True)
        except Exception as error:  # a variant this Triton cannot build must not hide the others
            rows.append({"variant": label, "ok": False, "error": f"{type(error).__name__}: {str(error)[:300]}"})
            print(f"{label}: FAILED {type(error).__name__}: {str(error)[:200]}", flush=True)
    summary = {"prefix_MB": prefix_bytes / 1e6, "splits": SPLITS, "copies": COPIES, "per_graph": per_graph}
    best = min((r for r in rows if r["variant"].startswith("probe") and "us" in r), key=lambda r: r["us"], default=None)
    summary["best_probe"] = best["variant"] if best else None
    summary["best_probe_us"] = best["us"] if best else math.nan
    summary["forest_prefix_pass_us"] = rows[0]["us"]
    path = write_results(Path(args.out), "fca_ws_probe", summary, rows)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
