"""Tree attention on one GPU: correctness of every backend, a Triton tile sweep, and useful TFLOP/s.

    python benchmarks/tree_attention.py [--out DIR] [--quick] [--budget-s SECONDS]
    python benchmarks/tree_attention.py --sdpa-rule [--out DIR]     # sdpa vs Flex on many small trees and a trie

Useful work (the FLOP formula every TFLOP/s number here uses): a visible (query, key) pair costs ``2 * D`` FLOPs
for ``q.k`` and ``2 * D`` for ``p.v`` per query head, so

    useful_fwd = 4 * D * Hq * pairs,  useful_bwd = 2.5 * useful_fwd,  useful_fwd_bwd = 3.5 * useful_fwd,

with ``pairs = sum_k (kv_visible_until[k] - k)`` (every query that sees key ``k``). Work a kernel does on masked
elements or recomputes in the backward is not counted. The baseline, plain causal attention over every sample
separately (SDPA flash on the unpacked, non-deduplicated sequences), is reported with the same formula over its own
causal pairs, and its time is what deduplication saves.

Sections (each guarded: an error is recorded in the JSON and the run goes on; a time budget skips what is left):
  1. correctness, bf16, Qwen3-4B heads (32 q, 8 kv, d=128), every backend against the fp32 reference, outputs,
     lse and gradients, judged against a plain bf16 implementation's own error (``ratio_to_bf16_noise``);
  2. Triton tile sweep (forward, dK/dV, dQ, atomic dQ) at P=8192 G=16 R=512; the best settings are printed and used;
  3. performance at P=8192 G=16 R=512, the ragged variant (R uniform in 128..1024) and long (P=32K, G=8, R=2K):
     forward, backward and forward+backward per backend, next to SDPA flash on the unpacked sequences, plus the
     plan and metadata build times as a fraction of the attention time;
  4. a long-prompt check: Triton against FlexAttention and against an exact fp32 computation of sampled rows.
Writes ``<out>/tree_attention.json`` (after every section) and ``tree_attention.png``; prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import cuda_time_ms, default_out_dir, host_issue_us, print_table, run_metadata, write_results

from arctic_dedup import Plan, build_plan_from_layout
from arctic_dedup.attention import tree_attention, tree_attention_reference
from arctic_dedup.attention._launch import (
    TritonConfig,
    default_triton_config,
    launch_backward,
    launch_forward,
)
from arctic_dedup.attention._tables import build_kernel_tables
from arctic_dedup.attention.function import triton_tree_attention
from arctic_dedup.attention.metadata import TreeAttentionMetadata, prepare_tree_attention
from arctic_dedup.attention.sdpa_calls import build_sdpa_calls
from arctic_dedup.plan.layout import SampleLayout

NAME = "tree_attention"
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
MODEL_ATTENTION_LAYERS = 36  # Qwen3-4B: one plan (and its metadata) serves this many attention layers per pass
# Module constants so a CPU dry run (tests of this script under the Triton interpreter) can shrink them.
DEVICE = "cuda"
FORMULA = "useful_fwd = 4*D*Hq*pairs; useful_bwd = 2.5*useful_fwd; useful_fwd_bwd = 3.5*useful_fwd"


@dataclass
class Run:
    out_dir: Path
    budget_s: float
    name: str = NAME
    started: float = field(default_factory=time.time)
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def left(self) -> float:
        return self.budget_s - (time.time() - self.started)

    def save(self) -> None:
        self.summary["errors"] = self.errors
        self.summary["elapsed_s"] = round(time.time() - self.started, 1)
        write_results(self.out_dir, self.name, self.summary, self.rows)

    def attempt(self, what: str, fn: Callable[[], Any], need_s: float = 0.0) -> Any:
        """Run ``fn`` unless the budget is spent (returns None then); record (not raise) its errors."""
        if self.left() < need_s:
            self.errors.append(f"{what}: skipped, {self.left():.0f}s of the time budget left")
            print(f"[skip] {what}: time budget", flush=True)
            return None
        began = time.time()
        try:
            return fn()
        except Exception as error:
            message = f"{what}: {type(error).__name__}: {error}"
            self.errors.append(message[:2000])
            print(f"[error] {message[:400]}", flush=True)
            traceback.print_exc()
            return None
        finally:
            print(f"[done] {what} in {time.time() - began:.1f}s ({self.left():.0f}s left)", flush=True)
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------- plans


def _layout(prompts: list[int], responses: list[list[int]], seed: int) -> SampleLayout:
    generator = torch.Generator().manual_seed(seed)
    ids, prompt_lengths, response_lengths = [], [], []
    for prompt_length, lengths in zip(prompts, responses):
        prompt = torch.randint(1, 100_000, (prompt_length,), generator=generator)
        for length in lengths:
            ids += [prompt, torch.randint(1, 100_000, (length,), generator=generator)]
            prompt_lengths.append(prompt_length)
            response_lengths.append(length)
    return SampleLayout.from_unpadded(
        torch.cat(ids).to(DEVICE), torch.tensor(prompt_lengths).to(DEVICE), torch.tensor(response_lengths).to(DEVICE)
    )


def _deep_layout(scale: int, seed: int) -> SampleLayout:
    """A 4-level trie: shared system prompt, two questions, partial answers, branched endings."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(length: int) -> torch.Tensor:
        return torch.randint(1, 100_000, (length,), generator=generator)

    system = tokens(11 * scale)
    samples, prompt_lengths = [], []
    for question in (5 * scale, 7 * scale + 3):
        question_tokens = tokens(question)
        for partial in (3 * scale + 1, 6 * scale):
            partial_tokens = tokens(partial)
            for tail in (1, 4 * scale, 0, 2 * scale + 5):
                samples.append(torch.cat([system, question_tokens, partial_tokens, tokens(tail)]))
                prompt_lengths.append(11 * scale + question)
    lengths = [int(sample.numel()) - prompt for sample, prompt in zip(samples, prompt_lengths)]
    return SampleLayout.from_unpadded(
        torch.cat(samples).to(DEVICE), torch.tensor(prompt_lengths).to(DEVICE), torch.tensor(lengths).to(DEVICE)
    )


def performance_layouts(quick: bool) -> dict[str, SampleLayout]:
    generator = torch.Generator().manual_seed(1)
    ragged = torch.randint(128, 1025, (16,), generator=generator).tolist()
    layouts = {"P8192_G16_R512": _layout([8192], [[512] * 16], seed=2)}
    if not quick:
        layouts["P8192_G16_ragged"] = _layout([8192], [ragged], seed=3)
        layouts["P32768_G8_R2048"] = _layout([32768], [[2048] * 8], seed=4)
    return layouts


def sdpa_rule_layouts() -> dict[str, SampleLayout]:
    """Shapes that decide auto's rule for ``sdpa``: many small prompt trees, trees at the 4096-token floor, a trie."""
    return {
        "G64_P512_R8x128": _layout([512] * 64, [[128] * 8] * 64, seed=5),
        "G16_P2048_R8x256": _layout([2048] * 16, [[256] * 8] * 16, seed=6),
        "G4_P8192_R16x512": _layout([8192] * 4, [[512] * 16] * 4, seed=7),
        "trie_x256": _deep_layout(256, seed=8),
    }


def section_sdpa_rule(run: Run) -> None:
    """sdpa against FlexAttention, varlen and Triton, forward+backward, on ``sdpa_rule_layouts``."""
    default = default_triton_config(HEAD_DIM, torch.device(DEVICE))
    configs = Configs(default, default)
    backends = _backends(configs)
    for shape, layout in sdpa_rule_layouts().items():
        plan = build_plan_from_layout(layout, sharing="trie" if shape.startswith("trie") else "prompt")
        tensors = _inputs(plan, seed=13)
        base = {
            "section": "sdpa_rule",
            "shape": shape,
            "tokens": plan.num_packed_tokens,
            "trees": plan.tree.num_trees,
            "levels": plan.tree.num_levels,
            "tokens_per_tree": plan.num_packed_tokens / plan.tree.num_trees,
            "pairs": useful_pairs(plan),
        }
        for backend in ("flex", "sdpa", "varlen", "triton_atomic_dq"):
            measure = functools.partial(_measure_row, run, base, backends[backend], plan, tensors, 5, backend)
            run.attempt(f"sdpa rule {shape} {backend}", measure, need_s=45 if backend == "flex" else 15)
        rows = {row["backend"]: row for row in run.rows if row.get("shape") == shape and "fwd_bwd_ms" in row}
        if "flex" in rows and "sdpa" in rows:
            run.summary.setdefault("sdpa_vs_flex_fwdbwd", {})[shape] = (
                rows["flex"]["fwd_bwd_ms"] / rows["sdpa"]["fwd_bwd_ms"]
            )
        run.save()


def useful_pairs(plan: Plan) -> int:
    until = plan.kv_visible_until.long()
    return int((until - torch.arange(until.numel(), device=until.device)).sum())


def _inputs(plan: Plan, seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    tokens = plan.num_packed_tokens
    shapes = ((tokens, HEADS_Q, HEAD_DIM), (tokens, HEADS_KV, HEAD_DIM), (tokens, HEADS_KV, HEAD_DIM))
    return tuple(torch.randn(shape, generator=generator, device=DEVICE, dtype=dtype) for shape in shapes)


# ----------------------------------------------------------------------------------------------------- correctness


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.float() - reference.float()).norm() / reference.float().norm().clamp_min(1e-30))


def _forward_backward(fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor):  # type: ignore[no-untyped-def]
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    return out.detach(), lse.detach(), grads


@dataclass(frozen=True)
class Configs:
    """Triton settings for the deterministic backward (dK/dV + dQ kernels) and for the atomic-dQ backward."""

    deterministic: TritonConfig
    atomic: TritonConfig


def _prepare(plan: Plan, backend: Any, config: TritonConfig | None = None) -> TreeAttentionMetadata:
    return prepare_tree_attention(
        plan, backends=(backend,), head_dim=HEAD_DIM, dtype=torch.bfloat16, triton_config=config
    )


def _backends(configs: Configs) -> dict[str, Callable[..., Any]]:
    def run(backend: str, **extra: Any) -> Callable[..., Any]:
        def call(plan: Plan) -> Callable[..., Any]:
            # Prepared once per plan, as a model does before its layers.
            if backend.startswith("triton"):
                prepared = _prepare(plan, "triton", extra.get("config"))
                return lambda q, k, v: triton_tree_attention(q, k, v, prepared, scale=HEAD_DIM**-0.5, **extra)
            metadata = _prepare(plan, backend) if backend in ("flex", "sdpa") else None
            return lambda q, k, v: tree_attention(q, k, v, plan, backend=backend, return_lse=True, metadata=metadata)  # type: ignore[call-overload]

        return call

    return {
        "flex": run("flex"),
        "triton": run("triton", deterministic=True, config=configs.deterministic),
        "triton_atomic_dq": run("triton", deterministic=False, config=configs.atomic),
        "varlen": run("varlen"),
        "sdpa": run("sdpa"),
    }


def _reference_pair(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> tuple:
    """(exact fp32 reference on the bf16 inputs, plain bf16 implementation): outputs, lse and gradients."""
    until = plan.kv_visible_until
    exact = _forward_backward(
        lambda a, b, c: tree_attention_reference(a.float(), b.float(), c.float(), until, max_scores=2**31),
        q, k, v, grad.float(),
    )  # fmt: skip
    noise = _forward_backward(
        lambda a, b, c: tree_attention_reference(a, b, c, until, max_scores=2**31, compute_dtype=torch.bfloat16),
        q, k, v, grad,
    )  # fmt: skip
    return exact, noise


GRADIENT_NAMES = ["out", "dq", "dk", "dv"]


def _check_backend(
    run: Run, case: str, plan: Plan, inputs: tuple, exact: tuple, noise_errors: list[float], backend: str,
    make: Callable[..., Any],
) -> None:  # fmt: skip
    q, k, v, grad = inputs
    got = _forward_backward(make(plan), q, k, v, grad)
    errors = [_relative_error(x, y) for x, y in zip([got[0], *got[2]], [exact[0], *exact[2]])]
    lse_error = float((got[1].float() - exact[1]).abs().max())
    finite = all(bool(torch.isfinite(t).all()) for t in [got[0], got[1], *got[2]])
    ratios = {name: error / max(base, 1e-6) for name, error, base in zip(GRADIENT_NAMES, errors, noise_errors)}
    run.rows.append(
        {
            "section": "correctness",
            "case": case,
            "tokens": plan.num_packed_tokens,
            "backend": backend,
            "passed": finite and lse_error < 0.05 and all(ratio < 3.0 for ratio in ratios.values()),
            "lse_max_abs_error": lse_error,
            **{f"{name}_rel_error": error for name, error in zip(GRADIENT_NAMES, errors)},
            **{f"{name}_bf16_noise": base for name, base in zip(GRADIENT_NAMES, noise_errors)},
            "worst_ratio_to_bf16_noise": max(ratios.values()),
        }
    )
    print_table(
        [run.rows[-1]], ["case", "backend", "passed", "out_rel_error", "dq_rel_error", "worst_ratio_to_bf16_noise"]
    )


def _correctness_case(run: Run, configs: Configs, case: str, plan: Plan) -> None:
    q, k, v = _inputs(plan, seed=7)
    grad = torch.randn(q.shape, device=DEVICE, dtype=q.dtype)
    pair = run.attempt(f"correctness {case} reference", functools.partial(_reference_pair, plan, q, k, v, grad))
    if pair is None:
        return
    exact, noise = pair
    noise_errors = [_relative_error(x, y) for x, y in zip([noise[0], *noise[2]], [exact[0], *exact[2]])]
    for backend, make in _backends(configs).items():
        check = functools.partial(_check_backend, run, case, plan, (q, k, v, grad), exact, noise_errors, backend, make)
        run.attempt(f"correctness {case} {backend}", check, need_s=20)


def section_correctness(run: Run, configs: Configs) -> None:
    plans = {
        # A prompt that is not a multiple of the block size; empty, one-token and ragged responses.
        "ragged_edges": build_plan_from_layout(_layout([1000, 77], [[0, 1, 37, 128, 255, 300, 129], [64, 1]], 5)),
        # Both cases pad to FlexAttention's 2048-token bucket: one compilation serves both.
        "deep_trie": build_plan_from_layout(_deep_layout(29, 6), sharing="trie"),
    }
    for case, plan in plans.items():
        _correctness_case(run, configs, case, plan)
    checked = [row for row in run.rows if row["section"] == "correctness"]
    run.summary["correctness_all_passed"] = bool(checked) and all(row["passed"] for row in checked)
    run.save()


# ------------------------------------------------------------------------------------------------------ the sweep

# (block_m, block_n, num_warps, num_stages); the first entry of each list is the default. All compile for sm_90
# without register spills (checked offline with ptxas).
FWD_SWEEP = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (128, 128, 8, 2)]
DKDV_SWEEP = [(32, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 2), (64, 64, 8, 2), (32, 64, 8, 2)]
DQ_SWEEP = [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)]
ATOMIC_SWEEP = [(32, 128, 8, 2), (64, 64, 8, 2), (16, 128, 8, 2), (32, 64, 8, 2)]


def _time_forward(plan: Plan, tensors: tuple[torch.Tensor, ...], config: TritonConfig) -> float:
    q, k, v = tensors
    prepared = _prepare(plan, "triton", config)
    return cuda_time_ms(
        lambda: launch_forward(
            q, k, v, prepared, scale=HEAD_DIM**-0.5, sliding_window=None, softcap=None, config=config
        ),
        warmup=3,
        repeats=10,
    )


def _time_backward(plan: Plan, tensors: tuple[torch.Tensor, ...], config: TritonConfig, deterministic: bool) -> float:
    q, k, v = tensors
    scale = HEAD_DIM**-0.5
    prepared = _prepare(plan, "triton", config)
    out, lse = launch_forward(q, k, v, prepared, scale=scale, sliding_window=None, softcap=None, config=config)
    grad = torch.randn_like(out)
    return cuda_time_ms(
        lambda: launch_backward(
            grad, q, k, v, out, lse, None, prepared, scale=scale, sliding_window=None, softcap=None, config=config,
            deterministic=deterministic,
        ),
        warmup=3,
        repeats=10,
    )  # fmt: skip


def section_sweep(run: Run, plan: Plan, base: TritonConfig) -> Configs:
    tensors = _inputs(plan, seed=11)
    useful_fwd = 4 * HEAD_DIM * HEADS_Q * useful_pairs(plan)
    best = base

    def record(kernel: str, config: TritonConfig, milliseconds: float, flops: float) -> None:
        run.rows.append(
            {
                "section": "sweep",
                "kernel": kernel,
                "config": asdict(config),
                "ms": milliseconds,
                "useful_tflops": flops / milliseconds / 1e9,
            }
        )
        print(f"  sweep {kernel:10s} {milliseconds:8.3f} ms  {flops / milliseconds / 1e9:6.0f} TFLOP/s  {config}")

    def sweep(
        kernel: str, candidates: list[TritonConfig], deterministic: bool = True
    ) -> list[tuple[float, TritonConfig]]:
        timings = []
        for candidate in candidates:

            def measure(candidate: TritonConfig = candidate) -> float:
                if kernel == "forward":
                    milliseconds = _time_forward(plan, tensors, candidate)
                    record(kernel, candidate, milliseconds, useful_fwd)
                else:
                    milliseconds = _time_backward(plan, tensors, candidate, deterministic)
                    record(kernel, candidate, milliseconds, 2.5 * useful_fwd)
                return milliseconds

            milliseconds = run.attempt(f"sweep {kernel} {candidate}", measure, need_s=70)
            if milliseconds is not None:
                timings.append((milliseconds, candidate))
        return timings

    forward = sweep(
        "forward",
        [replace(best, block_m=m, block_n=n, num_warps=w, num_stages=s) for m, n, w, s in FWD_SWEEP],
    )
    best = min(forward, key=lambda item: item[0])[1] if forward else best
    dkdv = sweep(
        "backward",
        [replace(best, bwd_block_m=m, bwd_block_n=n, bwd_num_warps=w, bwd_num_stages=s) for m, n, w, s in DKDV_SWEEP],
    )
    best = min(dkdv, key=lambda item: item[0])[1] if dkdv else best
    dq = sweep(
        "backward",
        [replace(best, dq_block_m=m, dq_block_n=n, dq_num_warps=w, dq_num_stages=s) for m, n, w, s in DQ_SWEEP],
    )
    best_atomic = replace(best, atomic_dq=True)
    if dq:
        best = min(dq, key=lambda item: item[0])[1]
        # The atomic-dQ backward is one kernel (dK/dV tiles also add their dQ share), so it sweeps those tiles.
        atomic = sweep(
            "backward_atomic_dq",
            [
                replace(best, atomic_dq=True, bwd_block_m=m, bwd_block_n=n, bwd_num_warps=w, bwd_num_stages=s)
                for m, n, w, s in ATOMIC_SWEEP
            ],
            deterministic=False,
        )
        if atomic:
            best_atomic = min(atomic, key=lambda item: item[0])[1]
    run.summary["best_triton_config"] = asdict(best)
    run.summary["best_triton_config_atomic_dq"] = asdict(best_atomic)
    print(f"best Triton config (deterministic): {best}", flush=True)
    print(f"best Triton config (atomic dQ): {best_atomic}", flush=True)
    run.save()
    return Configs(best, best_atomic)


# ----------------------------------------------------------------------------------------------------- performance


def _sdpa_baseline(layout: SampleLayout, seed: int) -> tuple[Callable[[], Any], Callable[[], Any], int]:
    """Plain causal attention over every unpacked sample (SDPA, flash backend); lengths grouped so equal-length
    samples go in one batched call. Returns (forward, forward+backward, causal pairs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    lengths = (layout.prompt_lengths + layout.response_lengths).tolist()
    groups: dict[int, int] = {}
    for length in lengths:
        groups[length] = groups.get(length, 0) + 1
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for length, count in groups.items():
        q = torch.randn(count, HEADS_Q, length, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, generator=generator)
        # SDPA's flash kernel wants equal head counts: expand the kv heads (GQA) like a non-deduplicated run would.
        k = torch.randn(count, HEADS_KV, length, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, generator=generator)
        v = torch.randn_like(k)
        k = k.repeat_interleave(HEADS_Q // HEADS_KV, dim=1).requires_grad_(True)
        v = v.repeat_interleave(HEADS_Q // HEADS_KV, dim=1).requires_grad_(True)
        batches.append((q.requires_grad_(True), k, v))
    grads = [torch.randn_like(batch[0]) for batch in batches]

    def forward() -> list[torch.Tensor]:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            return [scaled_dot_product_attention(q, k, v, is_causal=True) for q, k, v in batches]

    def forward_backward() -> None:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for (q, k, v), grad in zip(batches, grads):
                out = scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.autograd.grad(out, (q, k, v), grad)

    pairs = sum(length * (length + 1) // 2 for length in lengths)
    return forward, forward_backward, pairs


def _measure_backend(fn: Callable[..., Any], tensors: tuple[torch.Tensor, ...], repeats: int) -> dict[str, float]:
    """Forward (as in training: autograd recording), backward alone, and both, in median milliseconds."""
    q, k, v = (t.detach().requires_grad_(True) for t in tensors)
    grad = torch.randn_like(q)
    forward_ms = cuda_time_ms(lambda: fn(q, k, v), warmup=3, repeats=repeats)
    recorded = fn(q, k, v)[0]
    backward_ms = cuda_time_ms(
        lambda: torch.autograd.grad(recorded, (q, k, v), grad, retain_graph=True), warmup=3, repeats=repeats
    )

    def both() -> None:
        torch.autograd.grad(fn(q, k, v)[0], (q, k, v), grad)

    total_ms = cuda_time_ms(both, warmup=2, repeats=repeats)
    return {"fwd_ms": forward_ms, "bwd_ms": backward_ms, "fwd_bwd_ms": total_ms}


def _metadata_times(layout: SampleLayout, plan: Plan, config: TritonConfig) -> dict[str, float]:
    def host_ms(fn: Callable[[], Any], repeats: int = 5) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            began = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - began) * 1e3)
        return sorted(times)[len(times) // 2]

    def triton_tables() -> None:
        # The Triton kernels' three tile shapes and FlexAttention's 128x128.
        for block_m, block_n in {
            (config.block_m, config.block_n),
            (config.bwd_block_m, config.bwd_block_n),
            (config.dq_block_m, config.dq_block_n),
            (128, 128),
        }:
            build_kernel_tables(plan.kv_visible_until, plan.position_ids, block_m, block_n)

    def sdpa_trees() -> None:
        # The sdpa backend's metadata: the host list of (prompt, responses) rows.
        build_sdpa_calls(plan)

    return {
        "plan_build_ms": host_ms(lambda: build_plan_from_layout(layout)),
        "triton_tables_ms": host_ms(triton_tables),
        "sdpa_trees_ms": host_ms(sdpa_trees),
    }


def _measure_row(
    run: Run, base: dict[str, Any], make: Callable[..., Any], plan: Plan, tensors: tuple, repeats: int, backend: str
) -> None:
    useful_fwd = 4 * HEAD_DIM * HEADS_Q * base["pairs"]
    times = _measure_backend(make(plan), tensors, repeats)
    run.rows.append(
        {
            **base,
            "backend": backend,
            **times,
            "fwd_useful_tflops": useful_fwd / times["fwd_ms"] / 1e9,
            "bwd_useful_tflops": 2.5 * useful_fwd / times["bwd_ms"] / 1e9,
            "fwd_bwd_useful_tflops": 3.5 * useful_fwd / times["fwd_bwd_ms"] / 1e9,
        }
    )
    print_table([run.rows[-1]], ["shape", "backend", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_bwd_useful_tflops"])


def _baseline_row(run: Run, base: dict[str, Any], layout: SampleLayout, repeats: int) -> None:
    forward, forward_backward, baseline_pairs = _sdpa_baseline(layout, seed=17)
    baseline_fwd = 4 * HEAD_DIM * HEADS_Q * baseline_pairs
    forward_ms = cuda_time_ms(forward, warmup=2, repeats=repeats)
    total_ms = cuda_time_ms(forward_backward, warmup=2, repeats=repeats)
    run.rows.append(
        {
            **base,
            "backend": "sdpa_unpacked_causal",
            "baseline_pairs": baseline_pairs,
            "fwd_ms": forward_ms,
            "fwd_bwd_ms": total_ms,
            "fwd_useful_tflops": baseline_fwd / forward_ms / 1e9,
            "fwd_bwd_useful_tflops": 3.5 * baseline_fwd / total_ms / 1e9,
            "pair_ratio_bound": baseline_pairs / base["pairs"],
        }
    )


def _metadata_row(run: Run, base: dict[str, Any], layout: SampleLayout, plan: Plan, configs: Configs) -> None:
    times = _metadata_times(layout, plan, configs.deterministic)
    attention = [row for row in run.rows if row.get("shape") == base["shape"] and row.get("backend") == "triton"]
    sdpa = [row for row in run.rows if row.get("shape") == base["shape"] and row.get("backend") == "sdpa"]
    fraction = {}
    if attention:
        attention_ms = attention[-1]["fwd_bwd_ms"]
        metadata_ms = times["triton_tables_ms"]
        # The plan and its metadata are built once per micro-batch and read by every attention layer.
        fraction = {
            "metadata_fraction_of_one_layer": metadata_ms / attention_ms,
            "metadata_fraction_of_all_layers": metadata_ms / (MODEL_ATTENTION_LAYERS * attention_ms),
            "plan_fraction_of_one_layer": times["plan_build_ms"] / attention_ms,
        }
    if sdpa:
        fraction["sdpa_metadata_fraction_of_one_layer"] = times["sdpa_trees_ms"] / sdpa[-1]["fwd_bwd_ms"]
    run.rows.append({**base, "backend": "metadata", **times, **fraction})


def _host_issue_row(run: Run, base: dict[str, Any], plan: Plan, tensors: tuple, configs: Configs) -> None:
    """Host time to issue one layer's forward eagerly with the metadata prepared once (36 layers x 10 steps)."""
    backends = _backends(configs)
    q, k, v = tensors[:3]
    for backend in ("triton", "sdpa"):
        forward = backends[backend](plan)

        def call(forward: Callable[..., Any] = forward) -> None:
            with torch.no_grad():
                forward(q, k, v)

        times = host_issue_us([call] * 360)
        run.rows.append({**base, "backend": f"{backend}_host_issue", **times})
        run.summary[f"{backend}_host_issue_us_per_call"] = times["host_issue_us_per_call"]
        print_table([run.rows[-1]], ["shape", "backend", "host_issue_us_per_call", "wall_us_per_call"])


def _performance_shape(run: Run, shape: str, layout: SampleLayout, configs: Configs, quick: bool) -> None:
    repeats = 5 if quick else 10
    plan = build_plan_from_layout(layout)
    tensors = _inputs(plan, seed=13)
    base = {"section": "performance", "shape": shape, "tokens": plan.num_packed_tokens, "pairs": useful_pairs(plan)}
    backends = _backends(configs)
    for backend in ["triton", "flex", "sdpa"] if quick else ["triton", "flex", "triton_atomic_dq", "varlen", "sdpa"]:
        measure = functools.partial(_measure_row, run, base, backends[backend], plan, tensors, repeats, backend)
        run.attempt(f"performance {shape} {backend}", measure, need_s=45 if backend == "flex" else 15)
    run.attempt(
        f"performance {shape} sdpa baseline", functools.partial(_baseline_row, run, base, layout, repeats), need_s=20
    )
    run.attempt(
        f"performance {shape} metadata", functools.partial(_metadata_row, run, base, layout, plan, configs), need_s=10
    )
    if not run.summary.get("triton_host_issue_us_per_call"):
        host = functools.partial(_host_issue_row, run, base, plan, tensors, configs)
        run.attempt(f"performance {shape} host issue", host, need_s=10)
    run.save()


def section_performance(run: Run, layouts: dict[str, SampleLayout], configs: Configs, quick: bool) -> None:
    for shape, layout in layouts.items():
        _performance_shape(run, shape, layout, configs, quick)


def section_long_check(run: Run, configs: Configs) -> None:
    """P=32K, G=8, R=2K: Triton against FlexAttention (outputs and gradients) and both against an exact fp32
    computation of 512 sampled query rows (forward)."""
    layout = _layout([32768], [[2048] * 8], seed=4)
    plan = build_plan_from_layout(layout)
    q, k, v = _inputs(plan, seed=19)
    grad = torch.randn_like(q)
    backends = _backends(configs)
    results = {name: _forward_backward(backends[name](plan), q, k, v, grad) for name in ("triton", "flex")}
    generator = torch.Generator(device=DEVICE).manual_seed(23)
    rows = torch.randint(0, plan.num_packed_tokens, (512,), device=DEVICE, generator=generator)
    tokens = torch.arange(plan.num_packed_tokens, device=DEVICE)
    until = plan.kv_visible_until.long()
    visible = (tokens[None, :] <= rows[:, None]) & (rows[:, None] < until[None, :])
    group = HEADS_Q // HEADS_KV
    scores = torch.einsum("rhd,khd->hrk", q[rows].float(), k.float().repeat_interleave(group, dim=1)) / math.sqrt(
        HEAD_DIM
    )
    scores = scores.masked_fill(~visible[None], float("-inf"))
    exact_rows = torch.einsum("hrk,khd->rhd", torch.softmax(scores, -1), v.float().repeat_interleave(group, dim=1))
    row: dict[str, Any] = {"section": "long_check", "tokens": plan.num_packed_tokens}
    for name, (out, _, _) in results.items():
        row[f"{name}_sampled_rows_rel_error"] = _relative_error(out[rows], exact_rows)
    for index, gradient_name in enumerate(("dq", "dk", "dv")):
        row[f"triton_vs_flex_{gradient_name}_rel_error"] = _relative_error(
            results["triton"][2][index], results["flex"][2][index]
        )
    row["triton_vs_flex_out_rel_error"] = _relative_error(results["triton"][0], results["flex"][0])
    row["passed"] = all(float(value) < 2e-2 for key, value in row.items() if key.endswith("rel_error"))
    run.rows.append(row)
    run.summary["long_check_passed"] = row["passed"]
    run.save()


# --------------------------------------------------------------------------------------------------------- summary


def _headline(run: Run) -> None:
    def find(shape: str, backend: str) -> dict[str, Any] | None:
        for row in run.rows:
            if row.get("section") == "performance" and row.get("shape") == shape and row.get("backend") == backend:
                return row
        return None

    first = "P8192_G16_R512"
    triton, flex = find(first, "triton"), find(first, "flex")
    atomic = find(first, "triton_atomic_dq")
    fastest = min([row for row in (triton, atomic) if row is not None], key=lambda row: row["fwd_bwd_ms"], default=None)
    if fastest is not None:
        run.summary["triton_useful_tflops_fwdbwd"] = fastest["fwd_bwd_useful_tflops"]
        run.summary["triton_variant"] = fastest["backend"]
        run.summary["triton_fraction_of_matmul_rate"] = fastest["fwd_bwd_useful_tflops"] / 775.0
    if fastest is not None and flex is not None:
        run.summary["triton_vs_flex_fwdbwd"] = flex["fwd_bwd_ms"] / fastest["fwd_bwd_ms"]
        run.summary["flex_useful_tflops_fwdbwd"] = flex["fwd_bwd_useful_tflops"]
    per_shape = {}
    for shape in {row.get("shape") for row in run.rows if row.get("section") == "performance"}:
        entries = {row["backend"]: row for row in run.rows if row.get("shape") == shape}
        fast = [entries[name] for name in ("triton", "triton_atomic_dq") if name in entries]
        if fast and "flex" in entries:
            best = min(fast, key=lambda row: row["fwd_bwd_ms"])
            per_shape[shape] = {
                "triton_vs_flex_fwdbwd": entries["flex"]["fwd_bwd_ms"] / best["fwd_bwd_ms"],
                "triton_vs_flex_fwd": entries["flex"]["fwd_ms"] / best["fwd_ms"],
                "triton_vs_flex_bwd": entries["flex"]["bwd_ms"] / best["bwd_ms"],
            }
        if fast and "sdpa_unpacked_causal" in entries:
            best = min(fast, key=lambda row: row["fwd_bwd_ms"])
            per_shape.setdefault(shape, {})["speedup_over_unpacked_sdpa"] = (
                entries["sdpa_unpacked_causal"]["fwd_bwd_ms"] / best["fwd_bwd_ms"]
            )
            per_shape[shape]["pair_ratio_bound"] = entries["sdpa_unpacked_causal"]["pair_ratio_bound"]
        if "sdpa" in entries and "flex" in entries:
            per_shape.setdefault(shape, {}).update(
                {
                    "sdpa_vs_flex_fwdbwd": entries["flex"]["fwd_bwd_ms"] / entries["sdpa"]["fwd_bwd_ms"],
                    "sdpa_vs_flex_fwd": entries["flex"]["fwd_ms"] / entries["sdpa"]["fwd_ms"],
                    "sdpa_vs_flex_bwd": entries["flex"]["bwd_ms"] / entries["sdpa"]["bwd_ms"],
                    "sdpa_fraction_of_matmul_rate": entries["sdpa"]["fwd_bwd_useful_tflops"] / 775.0,
                }
            )
        if "metadata" in entries:
            metadata = entries["metadata"]
            one_layer = metadata.get("metadata_fraction_of_one_layer")
            per_shape.setdefault(shape, {})["metadata_fraction_of_one_layer"] = one_layer
            if one_layer is not None:
                per_shape[shape]["metadata_fraction_of_all_layers"] = one_layer / MODEL_ATTENTION_LAYERS
            if "sdpa_metadata_fraction_of_one_layer" in metadata:
                per_shape[shape]["sdpa_metadata_fraction_of_one_layer"] = metadata[
                    "sdpa_metadata_fraction_of_one_layer"
                ]
    run.summary["per_shape"] = per_shape
    sdpa = find(first, "sdpa")
    if sdpa is not None and flex is not None:
        run.summary["sdpa_vs_flex_fwdbwd"] = flex["fwd_bwd_ms"] / sdpa["fwd_bwd_ms"]
        run.summary["sdpa_useful_tflops_fwdbwd"] = sdpa["fwd_bwd_useful_tflops"]
    run.summary["flop_formula"] = FORMULA
    run.summary["matmul_rate_tflops"] = 775.0


def _plot(run: Run) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        run.errors.append(f"plot: {error}")
        return
    rows = [row for row in run.rows if row.get("section") == "performance" and "fwd_bwd_useful_tflops" in row]
    shapes = sorted({row["shape"] for row in rows})
    backends = ["triton", "triton_atomic_dq", "flex", "varlen", "sdpa", "sdpa_unpacked_causal"]
    figure, axis = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(backends)
    for index, backend in enumerate(backends):
        values = [
            next((row["fwd_bwd_useful_tflops"] for row in rows if row["shape"] == s and row["backend"] == backend), 0)
            for s in shapes
        ]
        axis.bar([x + index * width for x in range(len(shapes))], values, width, label=backend)
    axis.axhline(775 * 0.6, color="gray", linestyle="--", linewidth=1, label="60% of bf16 matmul")
    axis.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes)
    axis.set_ylabel("useful TFLOP/s, forward + backward")
    axis.set_title(f"Tree attention, {HEADS_Q}q/{HEADS_KV}kv heads, d={HEAD_DIM} ({run_metadata()['device']})")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(run.out_dir / f"{NAME}.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_out_dir())
    parser.add_argument("--quick", action="store_true", help="correctness and the first shape only (for gpu_tests)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting new work after this long")
    parser.add_argument(
        "--sdpa-rule", action="store_true", help="only sdpa vs Flex on many-tree and trie shapes (about 3 minutes)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tree_attention: needs a CUDA GPU; nothing measured.")
        return
    if args.sdpa_rule:
        rule_run = Run(args.out, min(args.budget_s, 200.0), name=f"{NAME}_sdpa_rule")
        rule_run.summary["flop_formula"] = FORMULA
        rule_run.attempt("sdpa rule", lambda: section_sdpa_rule(rule_run))
        rule_run.save()
        rows = [row for row in rule_run.rows if "fwd_bwd_ms" in row]
        print_table(
            rows, ["shape", "tokens_per_tree", "backend", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_bwd_useful_tflops"]
        )
        print(rule_run.summary.get("sdpa_vs_flex_fwdbwd"), f"errors: {len(rule_run.errors)}")
        return
    run = Run(args.out, args.budget_s)
    run.summary["flop_formula"] = FORMULA
    default = default_triton_config(HEAD_DIM, torch.device(DEVICE))
    configs = Configs(default, replace(default, atomic_dq=True))
    run.attempt("correctness", lambda: section_correctness(run, configs))
    layouts = performance_layouts(args.quick)
    if not args.quick:
        first_plan = build_plan_from_layout(layouts["P8192_G16_R512"])
        configs = run.attempt("sweep", lambda: section_sweep(run, first_plan, default), need_s=120) or configs
    run.attempt("performance", lambda: section_performance(run, layouts, configs, args.quick))
    if not args.quick:
        run.attempt("long check", lambda: section_long_check(run, configs), need_s=40)
    _headline(run)
    run.save()
    _plot(run)
    table = [row for row in run.rows if row.get("section") == "performance" and row.get("backend") != "metadata"]
    print_table(
        table, ["shape", "backend", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_useful_tflops", "fwd_bwd_useful_tflops"]
    )
    headline_keys = ["triton_vs_flex_fwdbwd", "triton_useful_tflops_fwdbwd", "flex_useful_tflops_fwdbwd"]
    print({key: run.summary.get(key) for key in [*headline_keys, "correctness_all_passed", "long_check_passed"]})
    print(f"best Triton config (deterministic): {run.summary.get('best_triton_config')}")
    print(f"best Triton config (atomic dQ): {run.summary.get('best_triton_config_atomic_dq')}")
    print(f"errors: {len(run.errors)} (see {run.out_dir / (NAME + '.json')})")


if __name__ == "__main__":
    main()
