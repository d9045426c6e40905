"""The main job until the RL recipe lands: ZoRRO Train on a tiny random-init Qwen3, on the CPU.

Runs the same PPO policy-loss steps with deduplication on and off over GRPO-like batches (each prompt sampled
several times), checks that log-probs and gradients agree, and prints the dedup savings: tokens, the FLOP bound
from the cost model, and the measured step times.

Timing: one batch, ``--warmup`` untimed steps per side, then ``--timed-steps`` steps per side, interleaved (the
order alternates every step) so that both sides share the machine's noise; the report gives medians and spreads.
A measured speedup above the FLOP bound is reported as noise, not as a result.

    python recipes/zorro_tiny_cpu.py [--timed-steps 9] [--batch-size 16] [--prompts 2] [--prompt-len 256]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import Qwen3Config, Qwen3ForCausalLM

from arctic_dedup import ModelShape, dedup_cost_of_plan
from arctic_dedup.testing import create_dummy_batch
from arctic_zorro_train import DeduplicatedActor, plan_batch


@dataclass(frozen=True)
class Spread:
    """Median, quartiles and extremes of repeated measurements."""

    median: float
    lower_quartile: float
    upper_quartile: float
    minimum: float
    maximum: float

    @staticmethod
    def of(values: Sequence[float]) -> Spread:
        if len(values) < 2:
            raise ValueError(f"a spread needs at least 2 measurements, got {len(values)}; time more steps.")
        lower, median, upper = statistics.quantiles(values, n=4, method="inclusive")
        return Spread(median, lower, upper, min(values), max(values))


@dataclass(frozen=True)
class SpeedupReport:
    """Step times with and without dedup, and what their ratio says against the FLOP bound."""

    dedup_seconds: Spread
    baseline_seconds: Spread
    step_ratios: Spread  # baseline / dedup of each interleaved pair of steps
    speedup: float  # median baseline time / median dedup time
    flop_bound: float

    @property
    def above_bound(self) -> bool:
        """Dedup cannot run faster than its FLOP savings allow: a speedup above the bound is noise."""
        return self.speedup > self.flop_bound

    def verdict(self) -> str:
        if self.above_bound:
            return "above the FLOP bound: noise, rerun on a quiet machine"
        return f"{self.speedup / self.flop_bound:.0%} of the bound"


def speedup_report(
    dedup_seconds: Sequence[float], baseline_seconds: Sequence[float], flop_bound: float
) -> SpeedupReport:
    """Summarize interleaved step times: ``dedup_seconds[i]`` and ``baseline_seconds[i]`` ran back to back."""
    if len(dedup_seconds) != len(baseline_seconds):
        raise ValueError(
            f"got {len(dedup_seconds)} dedup and {len(baseline_seconds)} baseline step times; time both sides "
            "the same number of interleaved steps."
        )
    if min(*dedup_seconds, *baseline_seconds) <= 0:
        raise ValueError("step times must be positive.")
    dedup, baseline = Spread.of(dedup_seconds), Spread.of(baseline_seconds)
    ratios = [base / dedup for dedup, base in zip(dedup_seconds, baseline_seconds, strict=True)]
    return SpeedupReport(dedup, baseline, Spread.of(ratios), baseline.median / dedup.median, flop_bound)


def format_times(label: str, seconds: Spread) -> str:
    median, lower, upper, low, high = (
        1e3 * value
        for value in (seconds.median, seconds.lower_quartile, seconds.upper_quartile, seconds.minimum, seconds.maximum)
    )
    return f"{label} {median:.1f} ms (IQR {lower:.1f}-{upper:.1f}, min-max {low:.1f}-{high:.1f})"


def tiny_qwen3(vocab_size: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).float()


def _step(actor: DeduplicatedActor, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, float]]:
    actor.model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    metrics = actor.compute_policy_loss_and_backward(batch)
    return time.perf_counter() - started, metrics


def _batch(args: argparse.Namespace, seed: int) -> dict[str, torch.Tensor]:
    return create_dummy_batch(
        args.batch_size,
        args.prompts,
        args.prompt_len,
        args.response_len,
        vocab_size=args.vocab_size,
        include_training_fields=True,
        add_padding=True,
        seed=seed,
    )


def check_exactness(
    dedup: DeduplicatedActor, baseline: DeduplicatedActor, batch: dict[str, torch.Tensor]
) -> tuple[float, float, float]:
    """(max |logprob dedup - baseline|, max gradient rel-L2, dedup policy loss) of one step on ``batch``."""
    with torch.no_grad():
        logprob_gap = float((dedup.forward(batch).logprobs - baseline.forward(batch).logprobs).abs().max())
    _, metrics = _step(dedup, batch)
    _step(baseline, batch)
    worst_grad = 0.0
    for (name, p_dedup), p_base in zip(dedup.model.named_parameters(), baseline.model.parameters(), strict=True):
        assert p_dedup.grad is not None and p_base.grad is not None, name
        gap = (p_dedup.grad - p_base.grad).norm() / p_base.grad.norm().clamp_min(1e-30)
        worst_grad = max(worst_grad, float(gap))
    return logprob_gap, worst_grad, metrics["actor/policy_loss"]


def time_steps(
    dedup: DeduplicatedActor, baseline: DeduplicatedActor, batch: dict[str, torch.Tensor], warmup: int, timed: int
) -> tuple[list[float], list[float]]:
    """Interleaved step times on one batch; the side that runs first alternates, so neither always runs second."""
    times: dict[str, list[float]] = {"dedup": [], "baseline": []}
    actors = {"dedup": dedup, "baseline": baseline}
    for step in tqdm(range(warmup + timed), desc="timed policy-loss steps (dedup and baseline, interleaved)"):
        order = ("dedup", "baseline") if step % 2 == 0 else ("baseline", "dedup")
        for side in order:
            seconds, _ = _step(actors[side], batch)
            if step >= warmup:
                times[side].append(seconds)
    return times["dedup"], times["baseline"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check-batches", type=int, default=3, help="batches the exactness check runs over")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side before timing")
    parser.add_argument("--timed-steps", type=int, default=9, help="timed steps per side (>= 2)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=2, help="unique prompts per batch")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()
    if args.timed_steps < 2 or args.warmup < 0 or args.check_batches < 1:
        parser.error("need --timed-steps >= 2, --warmup >= 0 and --check-batches >= 1.")
    model = tiny_qwen3(args.vocab_size)
    dedup = DeduplicatedActor(model, device="cpu", dtype=torch.float32)
    baseline = DeduplicatedActor(copy.deepcopy(model), device="cpu", dtype=torch.float32, deduplicate=False)
    shape = ModelShape.from_module(model, model.config)

    worst_logprob, worst_grad, policy_loss = 0.0, 0.0, 0.0
    for seed in range(args.check_batches):
        logprob_gap, grad_gap, policy_loss = check_exactness(dedup, baseline, _batch(args, seed))
        worst_logprob, worst_grad = max(worst_logprob, logprob_gap), max(worst_grad, grad_gap)

    batch = _batch(args, seed=0)
    dedup_seconds, baseline_seconds = time_steps(dedup, baseline, batch, args.warmup, args.timed_steps)
    plan = plan_batch(batch["input_ids"], args.response_len, batch["attention_mask"], batch["position_ids"])
    cost = dedup_cost_of_plan(plan, shape)
    report = speedup_report(dedup_seconds, baseline_seconds, cost.flop_bound)
    print()
    print(
        f"batch: {args.batch_size} samples, {args.prompts} unique prompts, prompt<={args.prompt_len}, "
        f"response<={args.response_len} (random padding); model: tiny Qwen3, {shape.num_matmul_params} matmul params"
    )
    print(
        f"tokens (timed batch): {cost.tokens_base} without dedup -> {cost.tokens_dedup} with dedup "
        f"({cost.token_bound:.2f}x fewer, {100 * (1 - 1 / cost.token_bound):.1f}% saved)"
    )
    print(f"FLOP bound on the speedup: {cost.flop_bound:.2f}x")
    print(
        f"measured fwd+bwd step, median of {args.timed_steps} interleaved (after {args.warmup} warm-up): "
        f"{format_times('dedup', report.dedup_seconds)}, {format_times('baseline', report.baseline_seconds)}"
    )
    print(
        f"speedup {report.speedup:.2f}x (per-step ratios IQR {report.step_ratios.lower_quartile:.2f}-"
        f"{report.step_ratios.upper_quartile:.2f}x, min-max {report.step_ratios.minimum:.2f}-"
        f"{report.step_ratios.maximum:.2f}x): {report.verdict()} (CPU)"
    )
    print(
        f"exactness over {args.check_batches} batches: max |logprob dedup - baseline| = {worst_logprob:.2e}, "
        f"max gradient rel-L2 = {worst_grad:.2e}, last policy loss {policy_loss:.4f}"
    )


if __name__ == "__main__":
    main()
