"""The main job until the RL recipe lands: ZoRRO Train on a tiny random-init Qwen3, on the CPU.

Runs the same PPO policy-loss steps with deduplication on and off over GRPO-like batches (each prompt sampled
several times), checks that log-probs and gradients agree, and prints the dedup savings: tokens, the FLOP bound
from the cost model, and the measured step times.

    python recipes/zorro_tiny_cpu.py [--steps 3] [--batch-size 16] [--prompts 2] [--prompt-len 256]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from tqdm import tqdm
from transformers import Qwen3Config, Qwen3ForCausalLM

from arctic_dedup import ModelShape, dedup_cost_of_plan
from arctic_dedup.testing import create_dummy_batch
from arctic_zorro_train import DeduplicatedActor, plan_batch


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=2, help="unique prompts per batch")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = tiny_qwen3(args.vocab_size)
    dedup = DeduplicatedActor(model, device="cpu", dtype=torch.float32)
    baseline = DeduplicatedActor(copy.deepcopy(model), device="cpu", dtype=torch.float32, deduplicate=False)
    shape = ModelShape.from_module(model, model.config)
    times = {"dedup": 0.0, "baseline": 0.0}
    worst_logprob, worst_grad = 0.0, 0.0
    for step in tqdm(range(args.steps), desc="policy-loss steps (dedup and baseline)"):
        batch = create_dummy_batch(
            args.batch_size,
            args.prompts,
            args.prompt_len,
            args.response_len,
            vocab_size=args.vocab_size,
            include_training_fields=True,
            add_padding=True,
            seed=step,
        )
        with torch.no_grad():
            logprob_gap = (dedup.forward(batch).logprobs - baseline.forward(batch).logprobs).abs().max()
        worst_logprob = max(worst_logprob, float(logprob_gap))
        seconds_dedup, metrics = _step(dedup, batch)
        seconds_base, _ = _step(baseline, batch)
        if step > 0:
            times["dedup"] += seconds_dedup
            times["baseline"] += seconds_base
        for (name, p_dedup), p_base in zip(dedup.model.named_parameters(), baseline.model.parameters(), strict=True):
            assert p_dedup.grad is not None and p_base.grad is not None, name
            gap = (p_dedup.grad - p_base.grad).norm() / p_base.grad.norm().clamp_min(1e-30)
            worst_grad = max(worst_grad, float(gap))
    plan = plan_batch(batch["input_ids"], args.response_len, batch["attention_mask"], batch["position_ids"])
    cost = dedup_cost_of_plan(plan, shape)
    timed_steps = max(1, args.steps - 1)
    speedup = times["baseline"] / max(times["dedup"], 1e-9)
    print()
    print(
        f"batch: {args.batch_size} samples, {args.prompts} unique prompts, prompt<={args.prompt_len}, "
        f"response<={args.response_len} (random padding); model: tiny Qwen3, {shape.num_matmul_params} matmul params"
    )
    print(
        f"tokens: {cost.tokens_base} without dedup -> {cost.tokens_dedup} with dedup "
        f"({cost.token_bound:.2f}x fewer, {100 * (1 - 1 / cost.token_bound):.1f}% saved)"
    )
    print(f"FLOP bound on the speedup: {cost.flop_bound:.2f}x")
    print(
        f"measured fwd+bwd step (mean of {timed_steps}): dedup {times['dedup'] / timed_steps * 1e3:.1f} ms, "
        f"baseline {times['baseline'] / timed_steps * 1e3:.1f} ms -> {speedup:.2f}x "
        f"({speedup / cost.flop_bound:.0%} of the bound, CPU)"
    )
    print(
        f"exactness: max |logprob dedup - baseline| = {worst_logprob:.2e}, "
        f"max gradient rel-L2 = {worst_grad:.2e}, last policy loss {metrics['actor/policy_loss']:.4f}"
    )


if __name__ == "__main__":
    main()
