"""One RL step on one GPU, phase by phase: the whole stack (client -> Ray -> DeepSpeed trainer with ZoRRO + vLLM
sampler with FCA) against the ideal step and against TRL's ``GRPOTrainer`` with vLLM colocated.

Checked on the CPU by ``--cpu-smoke`` (run by ``benchmarks/tests/test_rl_step_gpu.py``); the GPU results (one H100,
``--model 1.7b``) are in ``benchmarks/results/rl_step_gpu.json`` with their notes.

The step: 8 prompts x 16 samples, prompts of 8192 tokens, responses of exactly 512 (``min_tokens`` = ``max_tokens``),
on a random-init model of the Qwen3-4B layer shape (36 layers, hidden 2560, 32/8 heads of 128, MLP 9728, bf16) built
in code. The task is the main job's parity task (``recipes/grpo_parity.py``: each prompt is 8192 - 40 bytes of random
letters, then its question; one byte is one token of the byte tokenizer), so both sides can show the same reward
trend. The one departure from Qwen3-4B: the vocabulary is the byte tokenizer's 320 tokens, not 151936 (the logits
layer is the byte vocabulary's, so the reward is defined; every transformer layer has the 4B shape).

Our variants (each a fresh client; ``--steps`` steps, the first one warm-up):

- ``colocated``: trainer and sampler time-share the GPU: generate -> ``sleep_inference(2)`` (the sampler's weights
  are discarded, not copied out: the sync overwrites them) -> ``wake_training`` -> ``train_step`` (old log-probs from
  the training forward: one update per batch) -> ``empty_training_cache`` -> ``wake_inference(["weights"])`` ->
  ``sync_weights`` (CUDA IPC) -> ``sleep_training`` -> ``wake_inference(["kv_cache"])``: the KV cache never sits
  beside the trainer's state, so the peak is the trainer's own (state + activations) plus the sampler's bf16 weights
  (the 4B shape's ~68 GiB of ZeRO-2 state fits an 80 GB card so: an H100 ran it on 2026-12-08). ZoRRO and FCA on
  (``colocated``) and off (``colocated_no_dedup``).
- ``colocated_moments``: the same order, but the trainer offloads only AdamW's moments (``sleep_training("moments")``,
  8 bytes a parameter instead of ~20): for a card where the rest of the trainer's state and the sampler's share fit
  together while sampling (the 4B shape on 80 GB: ~44 GB + 0.35 of the card), the host copies a step shrink ~2.5x.
- ``colocated_trainer_awake``: only the sampler sleeps (level 2) while the trainer, whose state stays on the GPU,
  trains: generate -> ``sleep_inference(2)`` -> ``train_step`` -> ``empty_training_cache`` -> ``wake_inference`` ->
  ``sync_weights``. Fits when the trainer's state and vLLM's share of the card fit together (the 1.7B shape on 80 GB).
- ``resident``: both engines stay in the GPU's memory (a model that fits twice; on an 80 GB card the 4B trainer with
  fp32 AdamW state and a vLLM of 0.35 of the memory may not, which the row then records): generate ->
  ``train_step(sync_weights=True)``.

Phases per step: ``generate``, ``log_prob`` (0 here: the training forward provides the old log-probs), ``train``
(forward-backward and optimizer step), ``sync``, ``sleep_wake`` (every sleep / wake call, and the cache release).
``summary.headline_variant`` is the fastest of ``colocated``, ``colocated_moments`` and ``colocated_trainer_awake``
among those that ran;
``summary.sync_and_sleep_share`` is its (sync + sleep_wake) / step (goal <= 0.10).

The ideal step (``ideal_phases``; docs/performance.md's formulas, the device's own measured matmul rate and copy rate):
generate = prefill of each unique prompt once (FLOPs at the matmul rate) + 512 decode steps, each the larger of its
FLOPs at the matmul rate and its bytes (weights once, every group's prompt KV once and each sample's own KV: FCA's
unique bytes) at the copy rate; train = ZoRRO's deduplicated training FLOPs (section 1's F, no recompute) at the
matmul rate; sync = the bf16 weights once at the copy rate; log-prob and sleep/wake = 0 (an ideal loop needs
neither). ``summary.ideal_fraction`` = ideal step / measured step.

TRL's side: ``vs_trl_peer.py`` in ``--trl-python`` (default: this interpreter) with ``GRPOConfig(use_vllm=True,
vllm_mode="colocate", vllm_enable_sleep_mode=True, bf16=True, gradient_checkpointing=True)``, the same model, prompts,
reward, group, lengths, learning rate, AdamW and loss (``trl_gpu_config``); 16 completions per micro-batch, 8
micro-batches per optimizer step, one generation per step. TRL computes the old log-probs with a separate forward
when it samples with vLLM (its importance-sampling correction, on by default); we do not need to
(``old_log_probs_from_forward``).
``summary.vs_trl_speedup`` = the headline variant's trajectories/s over TRL's (steps after the first).

What the offline GPU box needs beside torch, Triton and transformers (carried as wheels; see
``scripts/fetch_gpu_wheels.sh`` and ``../shared/tools/vllm-gpu/`` for how they travel in parts): vLLM's CUDA build,
Ray 2.60 (its Java jars and source maps removed to fit), DeepSpeed 0.19.8 (``DS_BUILD_OPS=0``, pure Python) with
hjson and pydantic, TRL 1.16 with accelerate and datasets, and this repository's packages. No model hub is used.

    python benchmarks/rl_step_gpu.py                         # one GPU, the 4B shape, ~30 minutes
    python benchmarks/rl_step_gpu.py --model 1.7b --variants colocated colocated_trainer_awake --steps 3 \
        --trl-python ''                                      # ours, H100
    python benchmarks/rl_step_gpu.py --model 1.7b --variants --steps 2    # TRL's side (~163 s a step on an H100)
    python benchmarks/rl_step_gpu.py --merge A/rl_step_gpu.json B/rl_step_gpu.json --out benchmarks/results
    python benchmarks/rl_step_gpu.py --cpu-smoke             # CPU, tiny model, split and colocated: checks the script
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

from common import default_out_dir, print_table, run_metadata
from grpo_parity import RunSettings, make_prompts, parity_reward
from vs_trl import step_prompts, trl_config
from zorro_train import QWEN3_4B

NAME = "rl_step_gpu"
PEER = Path(__file__).resolve().parent / "vs_trl_peer.py"
PHASES: tuple[str, ...] = ("generate", "log_prob", "train", "sync", "sleep_wake")
# The question after the filler is about 40 bytes ("(abcdefgh) answer with even bytes: even").
QUESTION_BYTES = 40
BYTE_VOCABULARY = 320
GOAL_SPEEDUP = 2.0
GOAL_SYNC_AND_SLEEP_SHARE = 0.10


@dataclass(frozen=True)
class Variant:
    """One way to run our step: ZoRRO + FCA on or off; time-sharing the GPU (sleep / wake) or both resident.

    Time-sharing puts the sampler to sleep at level 2 (its weights are discarded, not copied to the host: the sync
    after every wake overwrites them) and, with ``trainer_sleeps``, the trainer's state too (when the trainer and
    vLLM's share of the card do not fit together while sampling): ``trainer_sleep_mode`` of it (``sleep_training``'s
    mode: "all", or "moments" for AdamW's moments alone where that frees room enough)."""

    name: str
    dedup: bool
    colocated_sleep: bool
    trainer_sleeps: bool = True
    trainer_sleep_mode: str = "all"


VARIANTS: dict[str, Variant] = {
    "colocated": Variant("colocated", dedup=True, colocated_sleep=True),
    "colocated_trainer_awake": Variant(
        "colocated_trainer_awake", dedup=True, colocated_sleep=True, trainer_sleeps=False
    ),
    "colocated_moments": Variant("colocated_moments", dedup=True, colocated_sleep=True, trainer_sleep_mode="moments"),
    "colocated_no_dedup": Variant("colocated_no_dedup", dedup=False, colocated_sleep=True),
    "resident": Variant("resident", dedup=True, colocated_sleep=False),
}
# The summary's headline: the fastest of these that ran (each time-shares the GPU; which one fits depends on the card).
HEADLINE_CANDIDATES: tuple[str, ...] = ("colocated", "colocated_moments", "colocated_trainer_awake")
SAMPLER_SLEEP_LEVEL = 2
# The smoke run checks the split path with and without dedup, and the colocated order of calls: the CPU build of
# vLLM refuses sleep mode, but the engines' sleep states (and the trainer's offload) still run there, so an order the
# service or the engines refuse fails here too.
SMOKE_VARIANTS: dict[str, Variant] = {
    "split": Variant("split", dedup=True, colocated_sleep=False),
    "split_no_dedup": Variant("split_no_dedup", dedup=False, colocated_sleep=False),
    "colocated": VARIANTS["colocated"],
}


@dataclass(frozen=True)
class StepShape:
    """The batch of one step and the model's shape (``Qwen3Config`` fields)."""

    prompts: int
    group: int
    prompt_tokens: int
    response_tokens: int
    model: dict[str, Any]

    @property
    def trajectories(self) -> int:
        return self.prompts * self.group


# Qwen3-1.7B's layer shape: the 4B trainer (bf16 weights, fp32 master weights and AdamW moments, ~72 GB, plus the
# checkpointed activations of a 131k-token stream) does not fit an 80 GB H100 beside anything; 1.7B does.
QWEN3_1_7B: dict[str, Any] = {
    **QWEN3_4B,
    "num_hidden_layers": 28,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "intermediate_size": 6144,
}
MODELS: dict[str, dict[str, Any]] = {"4b": QWEN3_4B, "1.7b": QWEN3_1_7B}


def gpu_shape(model_name: str = "4b") -> StepShape:
    model = {
        **MODELS[model_name],
        "vocab_size": BYTE_VOCABULARY,
        "tie_word_embeddings": False,
        "max_position_embeddings": 16384,
    }
    return StepShape(prompts=8, group=16, prompt_tokens=8192, response_tokens=512, model=model)


def smoke_shape() -> StepShape:
    from arctic_rl.testing import TINY_QWEN3

    return StepShape(prompts=2, group=4, prompt_tokens=96, response_tokens=8, model=dict(TINY_QWEN3))


def run_settings(shape: StepShape, steps: int, lr: float) -> RunSettings:
    return replace(
        RunSettings(),
        steps=steps,
        prompts_per_step=shape.prompts,
        group=shape.group,
        max_tokens=shape.response_tokens,
        prompt_padding=max(shape.prompt_tokens - QUESTION_BYTES, 0),
        lr=lr,
    )


# ------------------------------------------------------------------------------------------------------ the ideal
def model_parameters(model: dict[str, Any]) -> dict[str, float]:
    """Matmul parameters of the transformer layers (``N``) and of the logits layer, and all parameters' count."""
    hidden, heads, kv_heads, head_dim = (model[key] for key in ("hidden_size", "num_attention_heads",
                                                                "num_key_value_heads", "head_dim"))  # fmt: skip
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * model["intermediate_size"]
    layers = model["num_hidden_layers"] * (attention + mlp)
    logits = hidden * model["vocab_size"]
    embeddings = 0 if model.get("tie_word_embeddings") else hidden * model["vocab_size"]
    return {"layers": float(layers), "logits": float(logits), "total": float(layers + logits + embeddings)}


def ideal_phases(shape: StepShape, matmul_flops_per_s: float, copy_bytes_per_s: float) -> dict[str, float]:
    """Seconds of each phase at the device's rates with all sharing used (module docstring); bf16 (2 bytes)."""
    counts = model_parameters(shape.model)
    layers, heads = shape.model["num_hidden_layers"], shape.model["num_attention_heads"]
    head_dim, kv_heads = shape.model["head_dim"], shape.model["num_key_value_heads"]
    prompt, response, groups, group = shape.prompt_tokens, shape.response_tokens, shape.prompts, shape.group
    attention_per_pair = 4 * heads * head_dim * layers
    # Prefill: each unique prompt once (causal pairs P^2 / 2).
    prefill = groups * (prompt * 2 * counts["layers"] + prompt**2 / 2 * attention_per_pair)
    generate = prefill / matmul_flops_per_s
    kv_bytes_per_token = 2 * kv_heads * head_dim * 2 * layers
    for position in range(response):
        tokens = groups * group
        flops = tokens * (2 * (counts["layers"] + counts["logits"]) + (prompt + position) * attention_per_pair)
        unique_kv = groups * (prompt + group * position) * kv_bytes_per_token
        read = 2 * (counts["layers"] + counts["logits"]) + unique_kv
        generate += max(flops / matmul_flops_per_s, read / copy_bytes_per_s)
    # Training, ZoRRO's stream: each prompt once, followed by its responses (docs/performance.md section 1, the
    # 3.5 = forward + backward of attention).
    tokens = groups * (prompt + group * response)
    pairs = groups * (prompt**2 / 2 + group * (response * prompt + response**2 / 2))
    train_flops = tokens * 6 * counts["layers"] + pairs * attention_per_pair * 3.5
    train_flops += groups * group * response * 6 * counts["logits"]
    return {
        "generate": generate,
        "log_prob": 0.0,
        "train": train_flops / matmul_flops_per_s,
        "sync": 2 * counts["total"] / copy_bytes_per_s,
        "sleep_wake": 0.0,
    }


def measure_rates(device: torch.device) -> dict[str, float]:
    """The device's bf16 matmul FLOP/s (8192^3 on a GPU) and its copy rate in bytes/s (read + written)."""
    cuda = device.type == "cuda"
    size = 8192 if cuda else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    left = torch.randn(size, size, device=device, dtype=dtype)
    right = torch.randn(size, size, device=device, dtype=dtype)
    source = torch.empty((1 << 30) if cuda else (1 << 24), device=device, dtype=torch.uint8)
    target = torch.empty_like(source)

    def timed(work: Any, repeats: int) -> float:
        work()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            work()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats

    matmul = timed(lambda: left @ right, 20)
    copy = timed(lambda: target.copy_(source), 20)
    return {"matmul_flops_per_s": 2 * size**3 / matmul, "copy_bytes_per_s": 2 * source.numel() / copy}


# ---------------------------------------------------------------------------------------------------- our side
def client_config(model_dir: str, shape: StepShape, variant: Variant, settings: RunSettings, cuda: bool) -> Any:
    from arctic_rl import ArcticRLClientConfig

    max_model_len = shape.prompt_tokens + shape.response_tokens + 64
    sampling: dict[str, Any] = {"max_model_len": max_model_len}
    if cuda:
        sampling["gpu_memory_utilization"] = 0.35
    else:
        sampling["kv_cache_space_gib"] = 1
    return ArcticRLClientConfig(
        model_name=model_dir,
        comm_protocol="ray",
        device="cuda" if cuda else "cpu",
        dtype="bfloat16" if cuda else "float32",
        training_gpus=1,
        sampling_gpus=1,
        log_prob_gpus=0,
        colocate=cuda,
        seed=settings.seed,
        training={
            "lr": settings.lr,
            "max_grad_norm": 1.0,
            "gradient_checkpointing": cuda,
            "zero_stage": 2 if cuda else 0,
        },
        zorro_train={"enable": variant.dedup},
        fca={"enable": variant.dedup},
        sampling=sampling,
    )


def run_ours(model_dir: str, shape: StepShape, variant: Variant, settings: RunSettings, cuda: bool) -> dict[str, Any]:
    """``settings.steps`` steps of ``variant``: per step its reward, phase seconds and the service's metrics."""
    from transformers import AutoTokenizer

    from arctic_rl import build_grpo_batch, create_arctic_rl_client

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(settings.seed)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    config = client_config(model_dir, shape, variant, settings, cuda)
    with create_arctic_rl_client(config, blocking_calls=True) as client:
        setup_seconds = time.perf_counter() - start
        if variant.colocated_sleep and variant.trainer_sleeps:
            client.sleep_training(variant.trainer_sleep_mode)
        for step in range(settings.steps):
            prompts = make_prompts(rng, settings.prompts_per_step, settings.prompt_padding)
            prompt_ids = [tokenizer(text)["input_ids"] for text, _ in prompts]
            seconds = dict.fromkeys(PHASES, 0.0)
            clock = time.perf_counter()
            samples = client.generate(
                prompt_ids,
                {
                    "n": settings.group,
                    "max_tokens": settings.max_tokens,
                    "min_tokens": settings.max_tokens,
                    "temperature": settings.temperature,
                    "seed": settings.seed * 100_003 + step,
                    # The reward reads token ids (the main job's setting): no per-step decoding of every sampled
                    # token's log-prob entry (2-4 ms a step at 128 sequences on the 2-core CPU machine: lab results,
                    # sampler_detokenize_cpu.txt).
                    "detokenize": False,
                },
            )
            seconds["generate"] = time.perf_counter() - clock
            rewards = [
                [parity_reward(parity, sample["token_ids"]) for sample in group]
                for (_, parity), group in zip(prompts, samples, strict=True)
            ]
            batch = build_grpo_batch(prompt_ids, samples, rewards, pad_token_id=tokenizer.pad_token_id)
            processing = {"loss_fn": "grpo", "config": {}}
            if variant.colocated_sleep:
                clock = time.perf_counter()
                client.sleep_inference(SAMPLER_SLEEP_LEVEL)
                if variant.trainer_sleeps:
                    client.wake_training()
                seconds["sleep_wake"] += time.perf_counter() - clock
                clock = time.perf_counter()
                trained = client.train_step(batch, processing, old_log_probs_from_forward=True)
                seconds["train"] = time.perf_counter() - clock
                clock = time.perf_counter()
                # The activations' cached blocks go back to the device before vLLM maps its memory again.
                client.empty_training_cache()
                # A sleeping trainer leaves the GPU before the KV cache comes back: only the weights wake for the sync.
                client.wake_inference(["weights"] if variant.trainer_sleeps else None)
                seconds["sleep_wake"] += time.perf_counter() - clock
                seconds["sync"] = client.sync_weights()["time_s"]
                if variant.trainer_sleeps:
                    clock = time.perf_counter()
                    client.sleep_training(variant.trainer_sleep_mode)
                    client.wake_inference(["kv_cache"])
                    seconds["sleep_wake"] += time.perf_counter() - clock
            else:
                clock = time.perf_counter()
                trained = client.train_step(batch, processing, old_log_probs_from_forward=True, sync_weights=True)
                round_trip = time.perf_counter() - clock
                seconds["sync"] = float(trained["step"]["metrics"].get("time/sync", 0.0))
                seconds["train"] = round_trip - seconds["sync"]
            metrics = trained["step"]["metrics"]
            flat = [reward for group in rewards for reward in group]
            rows.append(
                {
                    "side": variant.name,
                    "step": step,
                    "reward": statistics.fmean(flat),
                    "trajectories": len(flat),
                    "response_tokens": int(batch["response_mask"].sum()),
                    "seconds": sum(seconds.values()),
                    "phases": seconds,
                    "zorro_savings": float(metrics.get("zorro/savings", 0.0)),
                    "fca": {key: float(value) for key, value in metrics.items() if key.startswith("fca/")},
                    "mismatch_kl": float(metrics.get("mismatch/kl", 0.0)),
                }
            )
            print(f"{variant.name} step {step}: " + ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items()), flush=True)
    return {"setup_seconds": setup_seconds, "rows": rows}


# ---------------------------------------------------------------------------------------------------- TRL's side
def trl_gpu_config(settings: RunSettings, shape: StepShape) -> dict[str, Any]:
    """``vs_trl.trl_config`` (the main job's optimizer and loss, translated) on one GPU with vLLM colocated: one
    group per micro-batch, one generation of the whole step per optimizer step."""
    config = trl_config(settings)
    config.update(
        per_device_train_batch_size=settings.group,
        gradient_accumulation_steps=settings.prompts_per_step,
        steps_per_generation=settings.prompts_per_step,
        use_cpu=False,
        bf16=True,
        gradient_checkpointing=True,
        model_init_kwargs={"dtype": "bfloat16"},
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=True,
        vllm_gpu_memory_utilization=0.35,
        vllm_max_model_length=shape.prompt_tokens + shape.response_tokens + 64,
        # Responses of exactly max_completion_length tokens, as on our side.
        generation_kwargs={"min_tokens": settings.max_tokens},
    )
    return config


def run_trl(model_dir: str, settings: RunSettings, shape: StepShape, python: str, scratch: Path) -> dict[str, Any]:
    settings_file, result_file = scratch / "trl_gpu_settings.json", scratch / "trl_gpu_result.json"
    peer_settings = {
        "model_dir": model_dir,
        "prompts": step_prompts(settings),
        "grpo_config": trl_gpu_config(settings, shape),
        "threads": 8,
    }
    settings_file.write_text(json.dumps(peer_settings, indent=1))
    done = subprocess.run([python, str(PEER), "--settings", str(settings_file), "--out", str(result_file)], check=False)
    if done.returncode != 0:
        return {"error": f"the TRL run under {python} exited with {done.returncode} (its output is above)"}
    result: dict[str, Any] = json.loads(result_file.read_text())
    result["rows"] = [{"side": "trl", **row} for row in result["rows"]]
    return result


# -------------------------------------------------------------------------------------------------------- report
def side_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Trajectories/s and mean phase seconds over the steps after the first (warm-up), and the reward trend."""
    later = rows[1:] or rows
    seconds = sum(row["seconds"] for row in later)
    phases = list(dict.fromkeys(name for row in later for name in row["phases"]))
    return {
        "trajectories_per_s": sum(row["trajectories"] for row in later) / seconds,
        "step_seconds": seconds / len(later),
        "phases": {name: statistics.fmean(row["phases"].get(name, 0.0) for row in later) for name in phases},
        "reward_first": rows[0]["reward"],
        "reward_last": rows[-1]["reward"],
    }


def headline_variant(sides: dict[str, dict[str, Any]], default: str) -> str:
    """The fastest time-sharing variant among ``sides`` (``default`` when none of them ran)."""
    ran = [name for name in HEADLINE_CANDIDATES if name in sides]
    return max(ran, key=lambda name: sides[name]["trajectories_per_s"]) if ran else default


def summarize(sides: dict[str, dict[str, Any]], ideal: dict[str, float], headline: str) -> dict[str, Any]:
    headline = headline_variant(sides, headline)
    summary: dict[str, Any] = {"headline_variant": headline, "ideal_step_seconds": sum(ideal.values())}
    for name, side in sides.items():
        summary[f"trajectories_per_s_{name}"] = side["trajectories_per_s"]
    ours = sides.get(headline)
    if ours is not None:
        phases = ours["phases"]
        summary["sync_and_sleep_share"] = (phases.get("sync", 0.0) + phases.get("sleep_wake", 0.0)) / ours[
            "step_seconds"
        ]
        summary["ideal_fraction"] = summary["ideal_step_seconds"] / ours["step_seconds"]
    if ours is not None and "trl" in sides:
        summary["vs_trl_speedup"] = ours["trajectories_per_s"] / sides["trl"]["trajectories_per_s"]
    return summary


def plot(rows: list[dict[str, Any]], sides: dict[str, dict[str, Any]], ideal: dict[str, float], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (reward_axis, phase_axis) = plt.subplots(1, 2, figsize=(12, 4))
    for name in sides:
        steps = [row for row in rows if row["side"] == name]
        reward_axis.plot([row["step"] for row in steps], [row["reward"] for row in steps], marker=".", label=name)
    reward_axis.set_xlabel("step")
    reward_axis.set_ylabel("mean reward of the step")
    reward_axis.set_ylim(0, 1)
    reward_axis.legend(fontsize=8)
    bars = {**{name: side["phases"] for name, side in sides.items()}, "ideal": ideal}
    names = list(dict.fromkeys(phase for phases in bars.values() for phase in phases))
    for position, phases in enumerate(bars.values()):
        bottom = 0.0
        for index, phase in enumerate(names):
            value = phases.get(phase, 0.0)
            phase_axis.bar(position, value, bottom=bottom, color=f"C{index}", label=phase if position == 0 else None)
            bottom += value
    phase_axis.set_xticks(range(len(bars)), list(bars), fontsize=8)
    phase_axis.set_ylabel("seconds per step (after the first)")
    phase_axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    plt.close(figure)


def build_model_dir(directory: Path, shape: StepShape, cuda: bool) -> str:
    """A random-init Qwen3 of ``shape.model`` (bf16 on the GPU) and the byte tokenizer, built in code."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from arctic_rl.testing import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    config = Qwen3Config(
        **shape.model,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return str(directory)


def start_ray(attempts: int = 3) -> None:
    """A local Ray instance, retried: on a loaded machine a raylet can miss Ray's fixed 30 s registration deadline
    (Ray raises a bare ``Exception`` saying it "timed out during startup")."""
    import ray

    for attempt in range(attempts):
        try:
            ray.init(include_dashboard=False, log_to_driver=False)
            return
        except Exception as error:
            if "timed out during startup" not in str(error) or attempt == attempts - 1:
                raise
            ray.shutdown()


def merge_runs(paths: list[Path]) -> dict[str, Any]:
    """One report from runs split over device calls (e.g. ours in one, TRL's in the next): the same shape and
    settings, each side's rows from the last run that has them."""
    runs = [json.loads(path.read_text()) for path in paths]
    shapes = {json.dumps(run["settings"]["shape"], sort_keys=True) for run in runs}
    if len(shapes) != 1:
        raise SystemExit(f"--merge: the runs have different shapes ({len(shapes)}); merge runs of one --model only.")
    merged: dict[str, Any] = {**runs[-1], "rows": [], "runs": {}}
    sides_seen: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        for row in run["rows"]:
            sides_seen.setdefault(row["side"], [])
        for side in dict.fromkeys(row["side"] for row in run["rows"]):
            sides_seen[side] = [row for row in run["rows"] if row["side"] == side]
        merged["runs"].update(run["runs"])
    merged["rows"] = [row for rows in sides_seen.values() for row in rows]
    merged["meta"] = {**runs[-1]["meta"], "merged_from": [run["meta"] for run in runs]}
    return merged


def report(result: dict[str, Any], out: Path, headline: str) -> None:
    """Sides, summary, JSON and PNG from ``result``'s rows (fills ``sides`` and ``summary``)."""
    rows, ideal = result["rows"], result["ideal_phases"]
    sides = {
        name: side_summary([row for row in rows if row["side"] == name])
        for name in dict.fromkeys(row["side"] for row in rows)
    }
    result["sides"] = sides
    result["summary"] = summarize(sides, ideal, headline)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, sides, ideal, out / f"{NAME}.png")
    columns = ["trajectories_per_s", "step_seconds", "reward_first", "reward_last"]
    print_table(
        [{"side": name, **{key: side[key] for key in columns}} for name, side in sides.items()], ["side", *columns]
    )
    print(json.dumps(result["summary"], indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--variants", nargs="*", choices=sorted(VARIANTS), default=list(VARIANTS), help="ours; none: TRL's side only"
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="4b", help="layer shape (1.7b fits an 80 GB card)")
    parser.add_argument("--merge", nargs="+", type=Path, default=None, help="no GPU: join runs' JSON into one report")
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is warm-up")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--trl-python", default=sys.executable, help="interpreter with trl and vLLM ('' skips TRL)")
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny model, smoke variants, no TRL: checks")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.merge:
        out = args.out or default_out_dir()
        out.mkdir(parents=True, exist_ok=True)
        report(merge_runs(args.merge), out, headline="colocated")
        return 0
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        parser.error("no GPU is visible: run on a GPU machine, or pass --cpu-smoke to check the script on the CPU.")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is warm-up).")
    shape = smoke_shape() if args.cpu_smoke else gpu_shape(args.model)
    variants = list(SMOKE_VARIANTS.values()) if args.cpu_smoke else [VARIANTS[name] for name in args.variants]
    steps = 2 if args.cpu_smoke else args.steps
    settings = run_settings(shape, steps, args.lr)
    out = args.out or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    rates = measure_rates(torch.device("cuda" if cuda else "cpu"))
    ideal = ideal_phases(shape, rates["matmul_flops_per_s"], rates["copy_bytes_per_s"])

    rows: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    import ray

    # One Ray instance for every variant: each client attaches to it (and leaves it up) instead of starting and
    # stopping its own, which costs seconds per variant and can time out on a loaded machine.
    start_ray()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = build_model_dir(Path(scratch) / "model", shape, cuda)
        for variant in variants:
            try:
                result = run_ours(model_dir, shape, variant, settings, cuda)
            except Exception as error:  # a variant that does not fit the GPU is a result too: record why
                runs[variant.name] = {"error": f"{type(error).__name__}: {error}"}
                print(f"{variant.name} did not run: {error}", file=sys.stderr)
                continue
            rows += result["rows"]
            runs[variant.name] = {"setup_seconds": result["setup_seconds"]}
        ray.shutdown()
        if args.trl_python and not args.cpu_smoke:
            trl = run_trl(model_dir, settings, shape, args.trl_python, Path(scratch))
            rows += trl.pop("rows", [])
            runs["trl"] = trl
    headline = "colocated" if not args.cpu_smoke else "split"
    meta = run_metadata()
    meta["note"] = "CPU smoke run: checks the script, not a result" if args.cpu_smoke else "GPU run"
    result = {
        "meta": meta,
        "settings": {
            "shape": asdict(shape),
            "model": "tiny" if args.cpu_smoke else args.model,
            "ours": asdict(settings),
            "trl": trl_gpu_config(settings, shape),
            "rates": rates,
            "goals": {"vs_trl_speedup": GOAL_SPEEDUP, "sync_and_sleep_share": GOAL_SYNC_AND_SLEEP_SHARE},
        },
        "ideal_phases": ideal,
        "runs": runs,
        "rows": rows,
    }
    report(result, out, headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
