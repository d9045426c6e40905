"""What ``fca_vllm.py`` loads inside vLLM's engine process (by name, so it must be importable there: the benchmark puts
this folder on ``PYTHONPATH``): a worker extension that reports the engine's choices and times kernels per category,
and a logits processor that forces each request along a given token sequence (teacher forcing through the decode path).

Not a script: ``fca_vllm.py`` is the entry point.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from arctic_fca import FcaWorkerExtension

__all__ = ["FORCED_TOKENS_KEY", "BenchWorkerExtension", "ForcedContinuation", "kernel_category"]

# The A/B of the host-bound rows (notes, 2026-12-07): ARCTIC_BENCH_NO_PDL=1 in the benchmark's environment launches
# FCA's kernels in this engine without programmatic dependent launches (the library uses them where the device has
# them: an early combine then waits on the GPU for its request's partials).
if os.environ.get("ARCTIC_BENCH_NO_PDL") == "1":
    from arctic_dedup.forest import _launch

    _launch.dependent_launches = lambda config, device: False

# The A/B of FlashAttention's share of a CUSTOM step (notes, fifteenth session): ARCTIC_BENCH_FA3_OWN_SCHEDULE=1 has
# FlashAttention 3 schedule the requests FCA leaves it from their own lengths (scheduler_metadata None: FA3 runs its
# own prepare kernel inside the call) instead of reusing vLLM's ahead-of-time schedule, made for every request's full
# length (a request FCA grouped then gets the splits of its whole context, each of which reads nothing);
# ARCTIC_BENCH_FA3_OWN_SCHEDULE=nosplit also caps it at one split per request (no split-KV, no combine).
_FA3_SCHEDULE = os.environ.get("ARCTIC_BENCH_FA3_OWN_SCHEDULE", "0")
if _FA3_SCHEDULE in ("1", "nosplit"):
    from arctic_fca import forest_step

    _standard_metadata = forest_step.standard_metadata

    def _own_schedule(metadata: Any) -> Any:
        made_now = getattr(metadata, "fca_standard", None) is None
        standard = _standard_metadata(metadata)
        if made_now:
            standard.scheduler_metadata = None
            if _FA3_SCHEDULE == "nosplit":
                standard.max_num_splits = 1
        return standard

    forest_step.standard_metadata = _own_schedule

# SamplingParams.extra_args key holding the token ids a request must emit, one per decode step.
FORCED_TOKENS_KEY = "forced_tokens"

# Kernels that read or write the KV cache for attention: FlashAttention (vLLM's default on Hopper), vLLM's Triton and
# CPU attention, the KV-cache write, and FCA's forest kernels with their on-device planning.
ATTENTION_KERNEL = re.compile(
    r"flash|attn|attention|reshape_and_cache|forest_|plan_(count|cut|group|paged)_kernel", re.IGNORECASE
)


# CUDA runtime / driver calls whose counts per step tell a replayed full graph (one graph launch) from kernels
# launched one by one, and show the host waiting on the device.
RUNTIME_CALLS: tuple[str, ...] = (
    "cudaGraphLaunch",
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchKernelExC",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpyAsync",
)


def kernel_category(name: str) -> str:
    return "attention" if ATTENTION_KERNEL.search(name) else "rest"


class BenchWorkerExtension(FcaWorkerExtension):
    """FCA's counters (inherited) plus the benchmark's probes; vLLM mixes these methods into its worker."""

    def bench_engine_info(self) -> dict[str, Any]:
        """The CUDA-graph mode vLLM settled on (after backends stated their support) and the attention backends (their
        names, and their classes: FCA's Triton wrapper runs under vLLM's name TRITON_ATTN)."""
        worker: Any = self
        compilation = worker.vllm_config.compilation_config
        layers = compilation.static_forward_context.values()
        classes = {layer.attn_backend for layer in layers if hasattr(layer, "attn_backend")}
        runner = type(getattr(worker, "model_runner", None))
        return {
            # Asked here: in the engine's own process a CUDA call would hold a second CUDA context for the whole run.
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "cudagraph_mode": getattr(compilation.cudagraph_mode, "name", str(compilation.cudagraph_mode)),
            "attention_backends": sorted(backend.get_name() for backend in classes),
            "attention_classes": sorted(f"{backend.__module__}.{backend.__qualname__}" for backend in classes),
            "model_runner": f"{runner.__module__}.{runner.__qualname__}",
        }

    def bench_profile_start(self) -> None:
        worker: Any = self
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            # The host side too: which runtime calls a step makes (one graph launch, or kernel launches) and where
            # the engine's host time goes.
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        worker._bench_profiler = torch.profiler.profile(activities=activities)
        worker._bench_profiler.start()

    def bench_profile_stop(self) -> dict[str, Any]:
        """Microseconds of device time per category since ``bench_profile_start`` (CPU op time on a CPU), and the
        five costliest kernels of each category so the classification can be checked by eye; on a GPU also the host
        events with the most self time and the counts of the CUDA runtime's launch and synchronization calls."""
        worker: Any = self
        profiler = worker._bench_profiler
        profiler.stop()
        worker._bench_profiler = None
        cuda = torch.cuda.is_available()
        by_name: dict[str, float] = defaultdict(float)
        host: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for event in profiler.events():
            if cuda and event.device_type == torch.autograd.DeviceType.CUDA:
                by_name[event.name] += event.time_range.elapsed_us()
            elif cuda:
                host[event.name][0] += event.self_cpu_time_total
                host[event.name][1] += 1
            else:
                by_name[event.name] += event.self_cpu_time_total
        totals: dict[str, float] = defaultdict(float)
        top: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for name, microseconds in sorted(by_name.items(), key=lambda item: -item[1]):
            category = kernel_category(name)
            totals[category] += microseconds
            if len(top[category]) < 5:
                top[category].append((name[:120], round(microseconds, 1)))
        result: dict[str, Any] = {
            "attention_us": totals["attention"],
            "rest_us": totals["rest"],
            "kernels": len(by_name),
            "top": dict(top),
            "device": "cuda" if cuda else "cpu",
        }
        if cuda:
            ranked = sorted(host.items(), key=lambda item: -item[1][0])
            result["host_top"] = [(name[:120], round(micro, 1), int(count)) for name, (micro, count) in ranked[:15]]
            result["runtime_calls"] = {name: int(host[name][1]) for name in RUNTIME_CALLS if name in host}
        return result


class ForcedContinuation(LogitsProcessor):
    """Forces every request whose ``SamplingParams.extra_args[FORCED_TOKENS_KEY]`` is set to emit those tokens in
    order, so different engines score the same sequences through their decode path. Every other logit of a forced
    request becomes -inf; vLLM's returned logprobs are computed from the raw logits (``logprobs_mode``
    ``raw_logprobs``, the default), so they are the model's own."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (the tokens to force, the request's live list of output tokens)
        self.forced: dict[int, tuple[list[int], list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        tokens = (sampling_params.extra_args or {}).get(FORCED_TOKENS_KEY)
        if tokens is not None and not (isinstance(tokens, list) and all(isinstance(token, int) for token in tokens)):
            raise ValueError(f"extra_args[{FORCED_TOKENS_KEY!r}] must be a list of token ids, got {tokens!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.forced.pop(index, None)
        for index, params, _prompt, output in batch_update.added:
            tokens = (params.extra_args or {}).get(FORCED_TOKENS_KEY) if params is not None else None
            if tokens:
                self.forced[index] = (tokens, output)
            else:
                self.forced.pop(index, None)
        for source, target, direction in batch_update.moved:
            moving = self.forced.pop(source, None)
            if direction == MoveDirectionality.SWAP:
                replaced = self.forced.pop(target, None)
                if replaced is not None:
                    self.forced[source] = replaced
            else:
                self.forced.pop(target, None)
            if moving is not None:
                self.forced[target] = moving

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows, columns = [], []
        for index, (tokens, output) in self.forced.items():
            position = len(output)
            if position < len(tokens):
                rows.append(index)
                columns.append(tokens[position])
        if rows:
            row_index = torch.tensor(rows, device=logits.device)
            column_index = torch.tensor(columns, device=logits.device)
            logits[row_index] = float("-inf")
            logits[row_index, column_index] = 0.0
        return logits
