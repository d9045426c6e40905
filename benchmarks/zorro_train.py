"""ZoRRO Train on the GPU: deduplicated vs non-deduplicated forward + backward of the PPO policy loss.

Both runs use the same random-init model (bf16) and the same recompute policy, compute logits only for response
tokens (chunked, never a [tokens, vocab] tensor), and pack tokens without padding:

* baseline: every sample is its own sequence (a plan without sharing), one sample per micro-batch with gradient
  accumulation ("packed": the same patched model with ``tree_attention(backend="sdpa")``, which runs each sample as
  one causal cuDNN call); also plain transformers + SDPA per sample, and the faster of the two is the baseline;
* dedup: the whole group in one packed stream, tree attention (every available backend is timed, the best is used).

The FLOP bound and MFU follow performance.md (``arctic_dedup.cost``): F = T*6N + pairs*4*H_q*d_h*L_a*3.5 +
sum(R)*6*d*V, MFU = F / (time * 775 TFLOP/s). A speedup is reported only when the baseline reaches 50% MFU.

Sections (pick with --sections; each fits one 10-minute device call, ``all`` does not):
  dense    Qwen3-4B shape, P=8192, G=16, R=512                               (~3 min)
  ragged   the same with R uniform in 128..1024                              (~3 min)
  hybrid   Qwen3.5-like hybrid (3 Gated DeltaNet layers per full attention)  (~3 min; needs fla-core wheels)
  memory   peak memory at equal G (full recompute), max responses per prompt (~4 min)
  sweep    1/2/4/16 unique prompts in 16 samples, P from 512 to 32K        (~5 min; 8 of the 36 layers;
           one prompt group per dedup micro-batch, one sample per baseline micro-batch)

Run on the H200:  python benchmarks/zorro_train.py --sections dense ragged --out "$OUT"
                  (rows of sections not run are kept from --merge-with, default benchmarks/results/zorro_train.json)
Plot elsewhere:   python benchmarks/zorro_train.py --plot-from benchmarks/results/zorro_train.json
CPU smoke check:  python benchmarks/zorro_train.py --smoke --out /tmp/zt   (tiny model, code paths only)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
try:
    import arctic_zorro_train  # noqa: F401
except ImportError:
    sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "packages" / "arctic-dedup" / "src"))
    sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "packages" / "arctic-zorro-train" / "src"))

from common import default_out_dir, print_table, run_metadata

from arctic_dedup.cost import ModelShape, dedup_cost
from arctic_zorro_train import apply_zorro, plan_batch, ppo_policy_loss, token_logprobs, zorro_forward
from arctic_zorro_train.fused import use_fused_kernels

PEAK_TFLOPS = 775.0
NAME = "zorro_train"
SECTIONS = ("dense", "ragged", "hybrid", "memory", "sweep")

QWEN3_4B: dict[str, Any] = {
    "num_hidden_layers": 36,
    "hidden_size": 2560,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "max_position_embeddings": 65536,
    "tie_word_embeddings": True,
}
# A Qwen3.5-like hybrid of about the same size: 24 Gated DeltaNet + 8 gated full-attention layers.
HYBRID: dict[str, Any] = {
    "num_hidden_layers": 32,
    "hidden_size": 2560,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "intermediate_size": 9216,
    "vocab_size": 248320,
    "max_position_embeddings": 65536,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": True,
}
TINY: dict[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
}


@dataclass(frozen=True)
class Options:
    device: torch.device
    repeats: int
    quick: bool
    smoke: bool
    dedup_choice: tuple[str, ...] = ()
    baselines: tuple[str, ...] = ("packed", "hf_sdpa")
    time_despite_fla_640: bool = False
    sweep_prompts: tuple[int, ...] = ()
    # The sweep packs whole samples (baseline) and whole prompt groups (dedup) into micro-batches of at most this many
    # tokens, as RL trainers do (verl's ppo_max_token_len_per_gpu): one sample of 1K tokens per micro-batch would
    # leave the baseline far under its MFU, and 16 one-sample groups packed alike equal the baseline.
    sweep_micro_batch_tokens: int = 32768
    # Samples per micro-batch of the packed baseline; None: 1, and for the hybrid also 2, 4 and 16 (fla's Gated
    # DeltaNet recurrence is parallel over sequences and heads only, so one long sample per micro-batch starves it;
    # without recompute 4 samples did not fit, 2 may with the fused norms' smaller activations).
    baseline_samples: tuple[int, ...] | None = None
    # The fused kernels (ZorroSettings.fused_kernels: the hybrids' norms, conv and SwiGLU, every family's log-prob
    # chunk), in the dedup and baseline runs alike.
    fused_kernels: str = "auto"

    @property
    def dedup_backends(self) -> tuple[str, ...]:
        if self.device.type != "cuda":
            return ("reference",)
        return self.dedup_choice or ("sdpa", "flex", "triton", "varlen")

    @property
    def baseline_backend(self) -> str:
        return "sdpa" if self.device.type == "cuda" else "reference"


# ----------------------------------------------------------------------------------------------------------------
# Models and batches


def build_model(kind: str, options: Options, num_layers: int | None = None) -> Any:
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config

    shape: dict[str, Any] = dict(TINY if options.smoke else (HYBRID if kind == "hybrid" else QWEN3_4B))
    if num_layers is not None:
        shape["num_hidden_layers"] = num_layers
    if kind == "hybrid":
        layers = shape["num_hidden_layers"]
        shape["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
        if options.smoke:
            layers = shape["num_hidden_layers"] = 4
            shape["layer_types"] = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
            shape.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16)
            shape.update(linear_value_head_dim=16, linear_conv_kernel_dim=4)
        config: Any = Qwen3_5TextConfig(**shape)
    else:
        config = Qwen3Config(**shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with options.device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if not options.smoke else torch.float32)
    model.train()
    return model


def group_batch(
    prompts: Sequence[int], responses: Sequence[Sequence[int]], vocab: int, device: torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Group g has prompt length ``prompts[g]`` and responses of lengths ``responses[g]`` (verl layout)."""
    generator = torch.Generator().manual_seed(seed)
    width_p = max(prompts)
    width_r = max(max(group) for group in responses)
    rows_ids, rows_mask = [], []
    for prompt_length, group in zip(prompts, responses, strict=True):
        prompt = torch.randint(1, vocab, (prompt_length,), generator=generator)
        for response_length in group:
            ids = torch.zeros(width_p + width_r, dtype=torch.long)
            mask = torch.zeros_like(ids)
            ids[width_p - prompt_length : width_p] = prompt
            mask[width_p - prompt_length : width_p + response_length] = 1
            ids[width_p : width_p + response_length] = torch.randint(1, vocab, (response_length,), generator=generator)
            rows_ids.append(ids)
            rows_mask.append(mask)
    input_ids, mask = torch.stack(rows_ids), torch.stack(rows_mask)
    shape = (input_ids.shape[0], width_r)
    batch = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp_min(0),
        "responses": input_ids[:, width_p:],
        "response_mask": mask[:, width_p:],
        "old_log_probs": -torch.rand(shape, generator=generator) * 3,
        "advantages": torch.randn(shape, generator=generator),
    }
    return {name: tensor.to(device) for name, tensor in batch.items()}


def select_samples(batch: dict[str, torch.Tensor], rows: Sequence[int]) -> dict[str, torch.Tensor]:
    index = torch.tensor(list(rows), device=batch["input_ids"].device)
    return {name: tensor.index_select(0, index) for name, tensor in batch.items()}


# ----------------------------------------------------------------------------------------------------------------
# Steps


def _loss(logprobs: torch.Tensor, batch: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    valid = batch["response_mask"].bool()
    loss, _ = ppo_policy_loss(
        logprobs, batch["old_log_probs"][valid], batch["advantages"][valid], batch["response_mask"][valid].float()
    )
    return loss * scale


def _patch_for_training(model: Any, backend: str, fused_kernels: str) -> None:
    """The patch both steps run under: "memory" logits (only response tokens' logits, chunked)."""
    apply_zorro(
        model,
        patch_forward=False,
        attention_backend=backend,
        logits_mode="memory",
        logits_chunk_size=2048,
        fused_kernels=fused_kernels,
    )


def dedup_step(
    model: Any,
    batch: dict[str, torch.Tensor],
    backend: str,
    groups: Sequence[Sequence[int]] | None = None,
    fused_kernels: str = "auto",
) -> Callable[[], None]:
    """Deduplicated: one packed stream per micro-batch; ``groups`` (rows per micro-batch, whole prompt groups)
    defaults to the whole batch in one micro-batch."""
    width = batch["responses"].shape[1]
    total = float(batch["response_mask"].sum())
    micro_batches = [batch] if groups is None else [select_samples(batch, rows) for rows in groups]

    def step() -> None:
        _patch_for_training(model, backend, fused_kernels)
        for micro in micro_batches:
            plan = plan_batch(micro["input_ids"], width, micro["attention_mask"], micro["position_ids"])
            output = zorro_forward(model, plan)
            _loss(output.logprobs, micro, float(micro["response_mask"].sum()) / total).backward()

    return step


def baseline_step(
    model: Any, batch: dict[str, torch.Tensor], backend: str, per_micro_batch: int, fused_kernels: str = "auto"
) -> Callable[[], None]:
    """Non-deduplicated: micro-batches of ``per_micro_batch`` samples, each packed without sharing."""
    width = batch["responses"].shape[1]
    total = float(batch["response_mask"].sum())
    rows = list(range(batch["input_ids"].shape[0]))
    micro_batches = [select_samples(batch, rows[i : i + per_micro_batch]) for i in range(0, len(rows), per_micro_batch)]

    def step() -> None:
        _patch_for_training(model, backend, fused_kernels)
        for micro in micro_batches:
            plan = plan_batch(
                micro["input_ids"], width, micro["attention_mask"], micro["position_ids"], deduplicate=False
            )
            output = zorro_forward(model, plan)
            _loss(output.logprobs, micro, float(micro["response_mask"].sum()) / total).backward()

    return step


def hf_sdpa_step(model: Any, batch: dict[str, torch.Tensor], fused_kernels: str = "auto") -> Callable[[], None]:
    """Plain transformers + SDPA on each sample's valid tokens, logits only at the response predictors."""
    width = batch["responses"].shape[1]
    total = float(batch["response_mask"].sum())
    samples = []
    for row in range(batch["input_ids"].shape[0]):
        valid = batch["attention_mask"][row].bool()
        prompt = int(valid[:-width].sum())
        length = int(valid.sum())
        samples.append((row, batch["input_ids"][row][valid], batch["position_ids"][row][valid], prompt, length))

    def step() -> None:
        backbone = model.model
        for row, ids, positions, prompt, length in samples:
            # squeeze, like zorro_forward: a view both ways (indexing [0] would zero-fill and copy in the backward)
            hidden = backbone(input_ids=ids[None], position_ids=positions[None], use_cache=False)[0].squeeze(0)
            # the same log-prob chunk math as the patched runs (their fused_kernels setting)
            out = token_logprobs(
                hidden[prompt - 1 : length - 1],
                ids[prompt:length],
                model.lm_head,
                mode="memory",
                chunk_size=2048,
                fused=use_fused_kernels(fused_kernels, hidden),
            )
            micro = select_samples(batch, [row])
            _loss(out.logprobs, micro, float(micro["response_mask"].sum()) / total).backward()

    return step


def time_step(step: Callable[[], None], model: Any, options: Options) -> dict[str, Any]:
    """Median seconds of ``step`` (warm-up first), and the peak memory of one step."""
    device = options.device
    model.zero_grad(set_to_none=True)
    step()
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(options.repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            step()
            times.append(time.perf_counter() - began)
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"seconds": statistics.median(times), "times": times, "peak_gib": peak}


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


# ----------------------------------------------------------------------------------------------------------------
# Sections


def _cost_row(model: Any, prompts: Sequence[int], responses: Sequence[Sequence[int]]) -> tuple[Any, ModelShape]:
    shape = ModelShape.from_module(model, model.config)
    cost = dedup_cost(list(zip(prompts, responses, strict=True)), shape)
    return cost, shape


def compare(
    section: str,
    model: Any,
    prompts: Sequence[int],
    responses: Sequence[Sequence[int]],
    options: Options,
    *,
    with_hf_baseline: bool = True,
    baseline_samples: Sequence[int] = (1,),
) -> list[dict[str, Any]]:
    """Time the baseline variants and every dedup backend on one batch; return result rows."""
    batch = group_batch(prompts, responses, model.config.vocab_size, options.device)
    cost, _ = _cost_row(model, prompts, responses)
    config = {
        "prompt_lengths": sorted(set(prompts)),
        "groups": len(prompts),
        "samples": sum(len(group) for group in responses),
        "mean_response": statistics.mean(r for group in responses for r in group),
        "flop_bound": cost.flop_bound,
        "token_bound": cost.token_bound,
    }
    # (run, backend, step, flops, samples per micro-batch)
    variants: list[tuple[str, str, Callable[[], None], float, int | None]] = []
    if "packed" in options.baselines or not with_hf_baseline:
        for samples in baseline_samples:
            step = baseline_step(model, batch, options.baseline_backend, samples, options.fused_kernels)
            variants.append(("baseline", options.baseline_backend, step, cost.flops_base, samples))
    if with_hf_baseline and "hf_sdpa" in options.baselines:
        variants.append(("baseline", "hf_sdpa", hf_sdpa_step(model, batch, options.fused_kernels), cost.flops_base, 1))
    for backend in options.dedup_backends:
        step = dedup_step(model, batch, backend, fused_kernels=options.fused_kernels)
        variants.append(("dedup", backend, step, cost.flops_dedup, None))
    rows = []
    for run, backend, step, flops, samples in variants:
        row: dict[str, Any] = {"section": section, "run": run, "backend": backend, **config}
        if samples is not None:
            row["samples_per_micro_batch"] = samples
        try:
            measured = time_step(step, model, options)
            row.update(measured)
            row["tflops"] = flops / measured["seconds"] / 1e12
            row["mfu"] = row["tflops"] / PEAK_TFLOPS
        except Exception as error:  # one failing variant must not lose the others
            if run == "baseline" and samples is not None and samples > 1 and is_oom(error):
                # A larger baseline micro-batch that does not fit is no failure (and no reason to recompute).
                row["skipped"] = f"{samples} samples per micro-batch do not fit in memory"
            else:
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                if not is_oom(error):
                    row["traceback"] = traceback.format_exc()[-2000:]
        rows.append(row)
        release(options.device)
    best_base = _best(rows, "baseline")
    best_dedup = _best(rows, "dedup")
    if best_base and best_dedup:
        speedup = best_base["seconds"] / best_dedup["seconds"]
        rows.append(
            {
                "section": section,
                "run": "summary",
                **config,
                "baseline_backend": best_base["backend"],
                "baseline_samples_per_micro_batch": best_base.get("samples_per_micro_batch"),
                "dedup_backend": best_dedup["backend"],
                "speedup": speedup,
                "efficiency": speedup / cost.flop_bound,
                "baseline_mfu": best_base["mfu"],
                "dedup_mfu": best_dedup["mfu"],
                "plan_seconds": _plan_seconds(batch, options),
            }
        )
    return rows


def _best(rows: list[dict[str, Any]], run: str) -> dict[str, Any] | None:
    timed = [row for row in rows if row.get("run") == run and "seconds" in row]
    return min(timed, key=lambda row: row["seconds"]) if timed else None


def _plan_seconds(batch: dict[str, torch.Tensor], options: Options) -> float:
    width = batch["responses"].shape[1]
    if options.device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    plan_batch(batch["input_ids"], width, batch["attention_mask"], batch["position_ids"])
    if options.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began


def _with_recompute_fallback(run: Callable[[bool], list[dict[str, Any]]], model: Any) -> list[dict[str, Any]]:
    """No recompute first; if a run runs out of memory, both runs again with full recompute (same policy)."""
    rows = run(False)
    if any(is_oom_text(row.get("error", "")) for row in rows):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        rows = [dict(row, recompute="none") for row in rows] + [dict(row, recompute="full") for row in run(True)]
        model.gradient_checkpointing_disable()
    else:
        rows = [dict(row, recompute="none") for row in rows]
    return rows


def is_oom_text(text: str) -> bool:
    return "out of memory" in text.lower() or "OutOfMemoryError" in text


def section_dense(options: Options, ragged: bool) -> list[dict[str, Any]]:
    model = build_model("dense", options)
    prompt, group = (8192, 16) if not options.smoke else (64, 4)
    if ragged:
        generator = torch.Generator().manual_seed(1)
        low, high = (128, 1024) if not options.smoke else (4, 16)
        lengths = torch.randint(low, high + 1, (group,), generator=generator).tolist()
    else:
        lengths = [512 if not options.smoke else 8] * group
    name = "ragged" if ragged else "dense"
    rows = _with_recompute_fallback(
        lambda _: compare(name, model, [prompt], [lengths], options, baseline_samples=options.baseline_samples or (1,)),
        model,
    )
    return rows


def section_hybrid(options: Options) -> list[dict[str, Any]]:
    import importlib.util

    from arctic_zorro_train.gated_delta import fla_unusable_reason

    bypassed = lift_fla_640_guard_if_asked(options)
    reason = fla_unusable_reason(options.device) if options.device.type == "cuda" else None
    if reason is not None:
        # transformers' torch Gated DeltaNet kernel would make both runs slow and say nothing about the fast path.
        return [{"section": "hybrid", "run": "error", "error": f"not measured: {reason}"}]
    model = build_model("hybrid", options)
    prompt, group = (8192, 16) if not options.smoke else (64, 4)
    lengths = [512 if not options.smoke else 8] * group
    rows = _with_recompute_fallback(
        lambda _: compare(
            "hybrid",
            model,
            [prompt],
            [lengths],
            options,
            with_hf_baseline=False,
            baseline_samples=options.baseline_samples or (1, 2, 4, 16),
        ),
        model,
    )
    fla = importlib.util.find_spec("fla") is not None
    kernel = "fla" if fla and options.device.type == "cuda" else "torch"
    rows = [dict(row, gated_delta_kernel=kernel, fused_kernels=options.fused_kernels) for row in rows]
    if bypassed:
        rows = [dict(row, timing_only=FLA_640_NOTE) for row in rows]
    return rows


FLA_640_NOTE = (
    "timing only: fla refuses its gated chunk_bwd_dqkwg kernel on Hopper with Triton >= 3.4 and < 3.7.1 (fla issue "
    "#640: Triton miscompiles it, the gradient values are wrong); this run lifted that guard to time the same kernels "
    "(the compiler fix does not change their work). Baseline and dedup run the same GDN kernels; gradient values of "
    "this run were not used. Correctness of the hybrid path is tested separately (CPU fp32/fp64, GPU torch kernel)."
)


def lift_fla_640_guard_if_asked(options: Options) -> bool:
    """With ``--time-despite-fla-640``, lift fla's #640 refusal when (and only when) it is what stops fla here;
    True when it was lifted (the rows are then timing only)."""
    if not options.time_despite_fla_640 or options.device.type != "cuda":
        return False
    from arctic_zorro_train.gated_delta import fla_unusable_reason

    reason = fla_unusable_reason(options.device)
    return reason is not None and "#640" in reason and _bypass_fla_640_guard()


def _bypass_fla_640_guard() -> bool:
    """Benchmark only (``--time-despite-fla-640``): lift fla's #640 refusal so the hybrid can be timed."""
    from fla.ops.common import chunk_o

    from arctic_zorro_train import gated_delta

    if not hasattr(chunk_o, "TRITON_ABOVE_3_7_1"):
        return False
    chunk_o.TRITON_ABOVE_3_7_1 = True
    gated_delta._fla_probe.cache_clear()
    return True


def _peak_of(step: Callable[[], None], model: Any, options: Options) -> float | None:
    model.zero_grad(set_to_none=True)
    release(options.device)
    if options.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step()
    model.zero_grad(set_to_none=True)
    if options.device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def _max_group(
    make_step: Callable[[int], Callable[[], None]], model: Any, options: Options, probes: tuple[int, int]
) -> dict[str, Any]:
    """Largest G that fits: fit peak(G) = a + b*G on two probes, try the prediction, then bisect between the largest
    G that fitted and the smallest that did not (to within 5%, at most 6 tries). ``verified`` always fitted."""
    peaks = [_peak_of(make_step(g), model, options) for g in probes]
    if peaks[0] is None or peaks[1] is None:
        return {"probes": list(probes), "peaks_gib": peaks}
    capacity = torch.cuda.get_device_properties(options.device).total_memory / 2**30
    slope = (peaks[1] - peaks[0]) / (probes[1] - probes[0])
    predicted = int(probes[1] + (capacity * 0.97 - peaks[1]) / max(slope, 1e-9))
    fitted, failed = probes[1], None
    candidate, tried = predicted, []
    for _ in range(6):
        try:
            _peak_of(make_step(candidate), model, options)
            fitted = candidate
            tried.append((candidate, True))
            if failed is None:
                break  # the prediction itself fits
        except Exception as error:
            if not is_oom(error):
                raise
            release(options.device)
            failed = candidate
            tried.append((candidate, False))
        if failed - fitted <= max(1, fitted // 20):
            break
        candidate = (fitted + failed) // 2
    return {"probes": list(probes), "peaks_gib": peaks, "predicted": predicted, "verified": fitted, "tried": tried}


def _fits(make_step: Callable[[int], Callable[[], None]], group: int, model: Any, options: Options) -> dict[str, Any]:
    """Does one dedup micro-batch of ``group`` responses per prompt fit (performance.md: >= 4x the baseline's)?"""
    row: dict[str, Any] = {"section": "memory", "run": "dedup_at_4x_baseline_max", "group": group, "recompute": "full"}
    try:
        row["peak_gib"] = _peak_of(make_step(group), model, options)
        row["fits"] = True
    except Exception as error:
        if not is_oom(error):
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        row["fits"] = False
    release(options.device)
    return row


def section_memory(options: Options) -> list[dict[str, Any]]:
    """Full recompute in both runs; the baseline packs the whole group in one micro-batch (no sharing)."""
    model = build_model("dense", options)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompt, response = (8192, 512) if not options.smoke else (64, 8)
    vocab = model.config.vocab_size
    backend = options.dedup_backends[0]

    def baseline(group: int) -> Callable[[], None]:
        batch = group_batch([prompt], [[response] * group], vocab, options.device)
        return baseline_step(model, batch, options.baseline_backend, group, options.fused_kernels)

    def dedup(group: int) -> Callable[[], None]:
        batch = group_batch([prompt], [[response] * group], vocab, options.device)
        return dedup_step(model, batch, backend, fused_kernels=options.fused_kernels)

    rows: list[dict[str, Any]] = []
    for group in (16, 32) if not options.smoke else (4,):
        row: dict[str, Any] = {"section": "memory", "run": "equal_group", "group": group, "recompute": "full"}
        try:
            row["baseline_peak_gib"] = _peak_of(baseline(group), model, options)
            row["dedup_peak_gib"] = _peak_of(dedup(group), model, options)
            if row["baseline_peak_gib"] and row["dedup_peak_gib"]:
                row["memory_ratio"] = row["dedup_peak_gib"] / row["baseline_peak_gib"]
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        rows.append(row)
        release(options.device)
    # Gradient checkpointing under the patch must save memory: the same dedup step without it.
    row = {"section": "memory", "run": "checkpointing", "group": 16 if not options.smoke else 4}
    try:
        model.gradient_checkpointing_disable()
        row["dedup_peak_without_gib"] = _peak_of(dedup(row["group"]), model, options)
    except Exception as error:
        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    finally:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with_checkpointing = [r.get("dedup_peak_gib") for r in rows if r.get("group") == row["group"]]
    row["dedup_peak_with_gib"] = with_checkpointing[0] if with_checkpointing else None
    rows.append(row)
    release(options.device)
    if options.device.type == "cuda":
        for run, make_step, probes in (("baseline", baseline, (8, 16)), ("dedup", dedup, (32, 64))):
            row = {"section": "memory", "run": f"max_group_{run}", "recompute": "full"}
            try:
                row.update(_max_group(make_step, model, options, probes))
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            rows.append(row)
            release(options.device)
            if run == "baseline" and row.get("verified"):
                rows.append(_fits(dedup, 4 * row["verified"], model, options))
    model.gradient_checkpointing_disable()
    return rows


def section_sweep(options: Options) -> list[dict[str, Any]]:
    layers = 8 if not options.smoke else 2
    model = build_model("dense", options, num_layers=layers)
    if options.sweep_prompts:
        prompt_lengths = list(options.sweep_prompts)
    elif options.smoke:
        prompt_lengths = [16, 64]
    elif options.quick:
        prompt_lengths = [2048, 8192]
    else:
        prompt_lengths = [512, 2048, 8192, 32768]
    response = 512 if not options.smoke else 8
    samples = 16 if not options.smoke else 4
    uniques = [1, 2, 4, 16] if not options.smoke else [1, 4]
    rows = []
    budget = options.sweep_micro_batch_tokens
    for prompt in prompt_lengths:
        batch_rows: list[dict[str, Any]] = []
        baseline_per_micro_batch = max(1, budget // (prompt + response))
        for unique in uniques:
            per_prompt = samples // unique
            prompts = [prompt] * unique
            responses = [[response] * per_prompt for _ in range(unique)]
            batch = group_batch(prompts, responses, model.config.vocab_size, options.device, seed=unique)
            cost, _ = _cost_row(model, prompts, responses)
            groups_per_micro_batch = max(1, budget // (prompt + per_prompt * response))
            row: dict[str, Any] = {
                "section": "sweep",
                "run": "dedup",
                "prompt": prompt,
                "unique_prompts": unique,
                "samples": samples,
                "layers": layers,
                "flop_bound": cost.flop_bound,
                "micro_batch_tokens": budget,
                "baseline_samples_per_micro_batch": baseline_per_micro_batch,
                "dedup_groups_per_micro_batch": min(groups_per_micro_batch, unique),
            }
            try:
                if unique == uniques[0]:
                    step = baseline_step(
                        model, batch, options.baseline_backend, baseline_per_micro_batch, options.fused_kernels
                    )
                    baseline_seconds = time_step(step, model, options)["seconds"]
                # Whole prompt groups per micro-batch (never split), packed like the baseline's samples.
                groups = [
                    [
                        member
                        for u in range(first, min(first + groups_per_micro_batch, unique))
                        for member in range(u * per_prompt, (u + 1) * per_prompt)
                    ]
                    for first in range(0, unique, groups_per_micro_batch)
                ]
                dedup = dedup_step(model, batch, options.dedup_backends[0], groups, options.fused_kernels)
                measured = time_step(dedup, model, options)
                row.update(measured)
                # Every sweep batch has the same samples count and lengths, so one baseline serves all.
                row["baseline_seconds"] = baseline_seconds
                row["speedup"] = baseline_seconds / measured["seconds"]
                row["efficiency"] = row["speedup"] / cost.flop_bound
                row["dedup_mfu"] = cost.flops_dedup / measured["seconds"] / 1e12 / PEAK_TFLOPS
                row["baseline_mfu"] = cost.flops_base / baseline_seconds / 1e12 / PEAK_TFLOPS
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            batch_rows.append(row)
            release(options.device)
        rows.extend(batch_rows)
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Summary, files, plot


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    dense = _summary_row(rows, "dense")
    if dense:
        trustworthy = dense["baseline_mfu"] >= 0.5
        summary["dense_flop_bound"] = dense["flop_bound"]
        summary["baseline_mfu"] = dense["baseline_mfu"]
        summary["dedup_mfu"] = dense["dedup_mfu"]
        summary["dense_speedup"] = dense["speedup"] if trustworthy else None
        summary["dense_efficiency"] = dense["efficiency"] if trustworthy else None
        summary["dense_speedup_measured"] = dense["speedup"]
        summary["dense_plan_fraction"] = dense["plan_seconds"] / _best_seconds(rows, "dense", "dedup")
        if not trustworthy:
            summary["note"] = "baseline below 50% MFU: speedup not reported (see dense_speedup_measured)"
    ragged = _summary_row(rows, "ragged")
    if ragged:
        summary["ragged_speedup"] = ragged["speedup"] if ragged["baseline_mfu"] >= 0.5 else None
        summary["ragged_efficiency"] = ragged["efficiency"] if ragged["baseline_mfu"] >= 0.5 else None
    hybrid = _summary_row(rows, "hybrid")
    if hybrid:
        summary["hybrid_efficiency"] = hybrid["efficiency"] if hybrid["baseline_mfu"] >= 0.5 else None
        summary["hybrid_efficiency_measured"] = hybrid["efficiency"]
        summary["hybrid_baseline_mfu"] = hybrid["baseline_mfu"]
    ratios = [row["memory_ratio"] for row in rows if row.get("section") == "memory" and "memory_ratio" in row]
    if ratios:
        summary["memory_ratio"] = min(ratios)
    maxima: dict[str, int] = {
        row["run"]: row["verified"]
        for row in rows
        if str(row.get("run", "")).startswith("max_group_") and row.get("verified")
    }
    fits = [row for row in rows if row.get("run") == "dedup_at_4x_baseline_max"]
    if fits:
        summary["dedup_fits_4x_baseline_group"] = fits[-1]["fits"]
        summary["dedup_group_checked"] = fits[-1]["group"]
    if "max_group_baseline" in maxima and "max_group_dedup" in maxima:
        summary["max_group_baseline"] = maxima["max_group_baseline"]
        summary["max_group_dedup"] = maxima["max_group_dedup"]
        summary["max_group_ratio"] = maxima["max_group_dedup"] / maxima["max_group_baseline"]
    return summary


def _summary_row(rows: list[dict[str, Any]], section: str) -> dict[str, Any] | None:
    candidates = [row for row in rows if row.get("section") == section and row.get("run") == "summary"]
    # With a recompute fallback, the "full" pair is the one where both runs fit.
    candidates.sort(key=lambda row: row.get("recompute") == "full", reverse=True)
    return candidates[0] if candidates else None


def _best_seconds(rows: list[dict[str, Any]], section: str, run: str) -> float:
    timed = [
        row["seconds"] for row in rows if row.get("section") == section and row.get("run") == run and "seconds" in row
    ]
    return min(timed) if timed else float("nan")


def merge_previous(path: Path, rows: list[dict[str, Any]], sections: Sequence[str]) -> list[dict[str, Any]]:
    """Keep the rows of sections not re-run in this call, so sections can run in separate device calls. Every row
    carries ``measured`` (the commit and date of the run that produced it)."""
    meta = run_metadata()
    stamp = {key: meta[key] for key in ("commit", "date")}
    rows = [{**row, "measured": row.get("measured", stamp)} for row in rows]
    if not path.exists():
        return rows
    try:
        results = json.loads(path.read_text())
        previous, meta = results["rows"], results.get("meta", {})
    except (ValueError, KeyError):
        return rows
    earlier = {key: meta.get(key, "unknown") for key in ("commit", "date")}
    new_sweep_prompts = {row.get("prompt") for row in rows if row.get("section") == "sweep"}

    def keep(row: dict[str, Any]) -> bool:
        if row.get("section") == "sweep":  # the sweep may run a few prompt lengths per device call
            return row.get("prompt") not in new_sweep_prompts
        return row.get("section") not in sections

    kept = [{**row, "measured": row.get("measured", earlier)} for row in previous if keep(row)]
    return kept + rows


def _speed_label(summary: dict[str, Any]) -> str:
    """A section's tick label with what qualifies its speedup: the baseline's MFU (a speedup over a baseline under 50%
    MFU is not reported) and whether the run only timed kernels whose values were not trusted."""
    label = f"{summary['section']}\nbaseline {summary['baseline_mfu']:.0%} MFU"
    if summary["baseline_mfu"] < 0.5:
        label += " (< 50%:\nnot a reported speedup)"
    if summary.get("timing_only"):
        label += "\ntiming only (fla #640)"
    return label


def plot(results: dict[str, Any], path: Path) -> None:
    """Left: measured speedup and FLOP bound per section (dense, ragged, hybrid); middle: peak memory at equal group
    size; right: the dedup-ratio sweep against its bounds (each panel only when its section ran)."""
    import matplotlib  # type: ignore[import-not-found]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found]

    summaries = [row for row in results["rows"] if row.get("run") == "summary" and row.get("section") != "sweep"]
    memory = [
        row
        for row in results["rows"]
        if row.get("section") == "memory"
        and row.get("run") == "equal_group"
        and row.get("baseline_peak_gib") is not None
        and row.get("dedup_peak_gib") is not None
    ]
    sweep = [row for row in results["rows"] if row.get("section") == "sweep" and "speedup" in row]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    speed_axis, memory_axis, sweep_axis = axes
    if summaries:
        names = [row["section"] for row in summaries]
        positions = range(len(names))
        speed_axis.bar([p - 0.2 for p in positions], [row["speedup"] for row in summaries], 0.4, label="measured")
        speed_axis.bar([p + 0.2 for p in positions], [row["flop_bound"] for row in summaries], 0.4, label="FLOP bound")
        for position, row in zip(positions, summaries, strict=True):
            speed_axis.text(position - 0.2, row["speedup"], f"{row['speedup']:.2f}x", ha="center", va="bottom")
        speed_axis.set_xticks(list(positions), [_speed_label(row) for row in summaries], fontsize=8)
        speed_axis.set_ylabel("fwd+bwd speedup over non-dedup")
        speed_axis.legend(fontsize=8)
    speed_axis.set_title("Qwen3-4B shape, P=8192, 16 responses", fontsize=9)
    if memory:
        groups = [row["group"] for row in memory]
        positions = range(len(groups))
        memory_axis.bar(
            [p - 0.2 for p in positions], [row["baseline_peak_gib"] for row in memory], 0.4, label="baseline"
        )
        memory_axis.bar([p + 0.2 for p in positions], [row["dedup_peak_gib"] for row in memory], 0.4, label="dedup")
        memory_axis.set_xticks(list(positions), [f"G={group}" for group in groups])
        memory_axis.set_ylabel("peak GiB (full recompute)")
        memory_axis.legend(fontsize=8)
    memory_axis.set_title("peak memory at equal group size", fontsize=9)
    for unique in sorted({row["unique_prompts"] for row in sweep}):
        series = sorted((row for row in sweep if row["unique_prompts"] == unique), key=lambda row: row["prompt"])
        prompts = [row["prompt"] for row in series]
        line = sweep_axis.plot(prompts, [row["speedup"] for row in series], marker="o", label=f"{unique} unique / 16")
        sweep_axis.plot(
            prompts, [row["flop_bound"] for row in series], linestyle="--", color=line[0].get_color(), alpha=0.6
        )
    if sweep:
        sweep_axis.set_xscale("log", base=2)
        sweep_axis.set_yscale("log", base=2)
        sweep_axis.legend(fontsize=8)
    else:
        sweep_axis.text(0.5, 0.5, "sweep not run yet", ha="center", va="center", transform=sweep_axis.transAxes)
    sweep_axis.set_xlabel("prompt length P (R = 512, 16 samples)")
    layers = sweep[0].get("layers", "") if sweep else ""
    budget = sweep[0].get("micro_batch_tokens") if sweep else None
    packing = f", micro-batches <= {budget // 1024}K tokens" if budget else ""
    sweep_axis.set_title(f"dedup-ratio sweep, {layers} layers{packing} (dashed: FLOP bound)", fontsize=9)
    figure.suptitle(f"ZoRRO Train fwd+bwd on {results['meta'].get('device', '')}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_out_dir())
    parser.add_argument("--quick", action="store_true", help="fewer repeats and sweep points")
    parser.add_argument("--sections", nargs="*", default=["dense"], choices=[*SECTIONS, "all"])
    parser.add_argument("--smoke", action="store_true", help="tiny model on any device: checks the code paths only")
    parser.add_argument("--plot-from", type=Path, default=None, help="only draw the PNG from a results JSON")
    parser.add_argument(
        "--merge-with",
        type=Path,
        default=Path(__file__).parent / "results" / f"{NAME}.json",
        help="earlier results whose other sections are kept (default: the committed results file)",
    )
    parser.add_argument(
        "--dedup-backends",
        nargs="*",
        default=[],
        choices=["flex", "triton", "varlen", "sdpa"],
        help="tree-attention backends timed for the dedup run (default: sdpa, flex, triton, varlen; the first one "
        "also serves the memory and sweep sections)",
    )
    parser.add_argument(
        "--sweep-micro-batch-tokens",
        type=int,
        default=32768,
        help="sweep: whole samples (baseline) and whole prompt groups (dedup) are packed into micro-batches of at "
        "most this many tokens (a group larger than this is one micro-batch)",
    )
    parser.add_argument(
        "--sweep-prompts",
        nargs="*",
        type=int,
        default=[],
        help="sweep: these prompt lengths only (rows of other lengths are kept from --merge-with)",
    )
    parser.add_argument(
        "--time-despite-fla-640",
        action="store_true",
        help="hybrid: time fla's gated kernels even where fla refuses them as miscompiled (rows marked timing_only)",
    )
    parser.add_argument(
        "--fused-kernels",
        default="auto",
        choices=["auto", "never"],
        help="fused norms, conv, SwiGLU, log-prob chunk (ZorroSettings.fused_kernels) in dedup and baseline alike",
    )
    parser.add_argument(
        "--baselines",
        nargs="*",
        default=["packed", "hf_sdpa"],
        choices=["packed", "hf_sdpa"],
        help="non-dedup baselines timed (the faster one is the baseline): our packed path without sharing, and HF",
    )
    parser.add_argument(
        "--baseline-samples",
        nargs="*",
        type=int,
        default=[],
        help="samples per micro-batch of the packed baseline, each timed (the fastest counts); default 1, and 1 2 4 16 "
        "for the hybrid (2: without recompute, 4 did not fit)",
    )
    args = parser.parse_args()
    if args.plot_from is not None:
        results = json.loads(args.plot_from.read_text())
        plot(results, args.plot_from.with_suffix(".png"))
        return 0
    sections = list(SECTIONS) if "all" in args.sections else args.sections
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("zorro_train benchmark: needs a CUDA GPU (use --smoke for a CPU check of the code paths)")
        return 1
    options = Options(
        device=device,
        repeats=2 if (args.quick or args.smoke) else 3,
        quick=args.quick,
        smoke=args.smoke,
        dedup_choice=tuple(args.dedup_backends),
        baselines=tuple(args.baselines),
        time_despite_fla_640=args.time_despite_fla_640,
        fused_kernels=args.fused_kernels,
        sweep_prompts=tuple(args.sweep_prompts),
        sweep_micro_batch_tokens=args.sweep_micro_batch_tokens,
        baseline_samples=tuple(args.baseline_samples) or None,
    )
    runners: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "dense": lambda: section_dense(options, ragged=False),
        "ragged": lambda: section_dense(options, ragged=True),
        "hybrid": lambda: section_hybrid(options),
        "memory": lambda: section_memory(options),
        "sweep": lambda: section_sweep(options),
    }
    rows: list[dict[str, Any]] = []
    for section in sections:
        began = time.perf_counter()
        try:
            rows.extend(runners[section]())
        except Exception as error:  # a failed section is recorded, the others still run
            rows.append(
                {
                    "section": section,
                    "run": "error",
                    "error": f"{type(error).__name__}: {error}"[:500],
                    "traceback": traceback.format_exc()[-3000:],
                }
            )
        release(device)
        print(f"[{section}] {time.perf_counter() - began:.0f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{NAME}.json"
    rows = merge_previous(path if path.exists() else args.merge_with, rows, sections)
    results = {"meta": run_metadata(), "summary": summarize(rows), "rows": rows}
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    try:
        plot(results, path.with_suffix(".png"))
    except ImportError:
        print("matplotlib missing: plot later with --plot-from", path)
    table = [row for row in rows if row.get("run") in ("baseline", "dedup") and row.get("section") != "sweep"]
    print_table(
        table,
        ["section", "run", "backend", "samples_per_micro_batch", "recompute", "seconds", "mfu", "peak_gib", "error"],
    )
    sweep = [row for row in rows if row.get("section") == "sweep"]
    if sweep:
        print_table(sweep, ["prompt", "unique_prompts", "seconds", "speedup", "flop_bound", "efficiency", "error"])
    print(json.dumps(results["summary"], indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
