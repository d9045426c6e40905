"""Shared pieces of the DeepSpeed engine tests: configs over the tiny Qwen3, batches, gradient reading, and the
worker one data-parallel rank runs in the multi-rank test."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from arctic_dedup.testing import create_dummy_batch
from arctic_rl.config import ArcticRLClientConfig

RESPONSE_WIDTH = 5
VOCAB = 300


def make_config(model_dir: str, **overrides: Any) -> ArcticRLClientConfig:
    """A CPU fp32 config over the tiny model; ``training`` / ``zorro_train`` overrides are merged into defaults that
    make gradients visible (lr 1e-3, no clipping)."""
    training = {"lr": 1e-3, "max_grad_norm": None, "zero_stage": 0, **overrides.pop("training", {})}
    zorro = {"enable": True, **overrides.pop("zorro_train", {})}
    fields: dict[str, Any] = {"device": "cpu", "dtype": "float32", **overrides}
    return ArcticRLClientConfig(model_name=model_dir, training=training, zorro_train=zorro, **fields)


def make_batch(
    batch_size: int = 8, prompts: int = 3, *, seed: int = 1, prompt_len: int = 9, width: int = RESPONSE_WIDTH
) -> dict[str, torch.Tensor]:
    """A padded GRPO batch: ``prompts`` prompts sampled several times each, padded prompts and responses."""
    batch = create_dummy_batch(
        batch_size,
        prompts,
        prompt_len,
        width,
        vocab_size=VOCAB,
        include_training_fields=True,
        add_padding=True,
        seed=seed,
    )
    batch.pop("prompts")
    batch["advantages"] = (
        torch.randn(batch_size, generator=torch.Generator().manual_seed(seed))[:, None].expand(-1, width).contiguous()
    )
    return batch


def step_denominators(batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
    mask = batch["response_mask"]
    return {"global_tokens": float(mask.sum()), "global_sequences": float((mask.sum(1) > 0).sum())}


def fwd_bwd(
    engine: Any, batch: Mapping[str, torch.Tensor], denominators: Mapping[str, float] | None = None, **loss: Any
) -> dict[str, Any]:
    config = {"kl_coef": 0.1, "kl_estimator": "k3", **loss}
    return engine.fwd_bwd(  # type: ignore[no-any-return]
        batch,
        loss_name="grpo",
        loss_config=config,
        **(denominators or step_denominators(batch)),
    )


def stage0_gradients(engine: Any) -> dict[str, torch.Tensor]:
    """The accumulated (not yet reduced) gradients of a stage-0 engine: with one rank, the step's gradients."""
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in engine.module.named_parameters()
    }


def full_parameters(engine: Any) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in engine.iter_full_parameters()}


def relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    difference = float((actual.double() - expected.double()).norm())
    scale = float(expected.double().norm())
    return difference / scale if scale > 0 else difference


def select_rows(batch: Mapping[str, torch.Tensor], rows: Sequence[int]) -> dict[str, torch.Tensor]:
    index = torch.tensor(list(rows), dtype=torch.long)
    return {name: value.index_select(0, index) for name, value in batch.items()}


# With eps far above |gradient|, AdamW's first step moves each weight by lr * g / (|g| + eps) ~ lr * g / eps: the update
# is proportional to the gradient, so equal updates mean equal gradients. With the default eps the first step is
# lr * sign(g), which turns fp32 reduction-order noise in a near-zero gradient into a full-size difference.
GRADIENT_PROPORTIONAL_ADAM = {"eps": 1.0, "lr": 1.0}


def data_parallel_rank(
    rank: int,
    world_size: int,
    port: int,
    model_dir: str,
    stage: int,
    batch: dict[str, torch.Tensor],
    shares: list[list[int]],
    results: str,
    training: dict[str, Any] | None = None,
) -> None:
    """One rank of the multi-rank test: its share of the batch, one step, then the full weights (collective).
    ``training`` adds TrainingConfig fields (e.g. a small ``micro_batch_tokens``)."""
    torch.set_num_threads(1)
    from arctic_rl.engines.training import TrainingEngine

    engine = TrainingEngine(
        make_config(model_dir, training={"zero_stage": stage, **GRADIENT_PROPORTIONAL_ADAM, **(training or {})}),
        rank=rank,
        world_size=world_size,
        master_port=port,
    )
    share = select_rows(batch, shares[rank])
    outcome_log_probs = engine.fwd_no_grad(share)["logprobs"]
    reply = fwd_bwd(engine, share, step_denominators(batch))
    stepped = engine.step()
    weights = full_parameters(engine)
    norm = engine.weight_norm()
    outcome = {
        "loss": reply["loss"],
        "micro_batches": reply["micro_batches"],
        "log_probs": outcome_log_probs,
        "step": stepped,
        "weight_norm": norm,
        "weights": weights if rank == 0 else None,
    }
    torch.save(outcome, f"{results}/rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def checkpoint_rank(rank: int, world_size: int, port: int, model_dir: str, root: str, results: str) -> None:
    """One rank of the two-rank checkpoint test: train a step on its share, save, train another, then load a
    checkpoint that only rank 1 finds damaged (both must refuse, nothing changes), then the good one on both."""
    torch.set_num_threads(1)
    from arctic_rl.engines.training import TrainingEngine
    from arctic_rl.errors import InvalidRequestError

    engine = TrainingEngine(
        make_config(model_dir, training={"zero_stage": 2}), rank=rank, world_size=world_size, master_port=port
    )
    batch = make_batch(seed=1)
    share = select_rows(batch, [[0, 1, 2, 3], [4, 5, 6, 7]][rank])
    fwd_bwd(engine, share, step_denominators(batch))
    engine.step()
    engine.save_checkpoint(f"{root}/good", 1)
    saved = full_parameters(engine)
    fwd_bwd(engine, share, step_denominators(batch))
    engine.step()
    trained = full_parameters(engine)
    torch.distributed.barrier()
    # The damaged copy is made once both ranks have saved.
    if rank == 0:
        import shutil

        shutil.copytree(f"{root}/good", f"{root}/damaged")
        optimizer = f"{root}/damaged/global_step1/zero_pp_rank_1_mp_rank_00_optim_states.pt"
        with open(optimizer, "r+b") as handle:
            handle.truncate(1000)
    torch.distributed.barrier()
    refusal = ""
    try:
        engine.load_checkpoint(f"{root}/{'good' if rank == 0 else 'damaged'}")
    except InvalidRequestError as error:
        refusal = str(error)
    unchanged = full_parameters(engine)
    step = engine.load_checkpoint(f"{root}/good")
    loaded = full_parameters(engine)
    outcome = {
        "refusal": refusal,
        "unchanged": all(torch.equal(unchanged[name], trained[name]) for name in trained),
        "restored": all(torch.equal(loaded[name], saved[name]) for name in saved),
        "step": step,
        "step_count": engine.step_count,
    }
    torch.save(outcome, f"{results}/rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
