"""MoE router statistics over the packed stream, weighted so they equal the non-deduplicated batch's.

A packed token shared by ``m`` samples stands for ``m`` tokens of the original batch, so every per-token sum is
weighted by ``plan.multiplicity``. The aux loss is the Switch-Transformer load-balancing loss that transformers'
Qwen MoE models use (``num_experts * sum_e f_e * P_e`` over all layers' tokens, ``f`` the top-k assignment share,
``P`` the mean router probability), so it matches ``load_balancing_loss_func`` on the padded batch with its
attention mask.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["RouterStatistics", "collect_router_logits", "router_statistics"]


@dataclass(frozen=True)
class RouterStatistics:
    """aux_loss: scalar (differentiable through the router logits); expert_load ``[L, E]``: multiplicity-weighted
    top-k assignments per MoE layer and expert (tokens of the original batch); router_probability ``[L, E]``: the
    weighted mean router probability per layer and expert."""

    aux_loss: torch.Tensor
    expert_load: torch.Tensor
    router_probability: torch.Tensor


@contextmanager
def collect_router_logits(routers: Sequence[nn.Module]) -> Iterator[list[torch.Tensor]]:
    """Collect each router's logits (its first output, ``[T, E]``) for the duration of one forward.

    Hooks are removed on exit, so a gradient-checkpoint recompute in the backward does not append again.
    """
    collected: list[torch.Tensor] = []

    def hook(module: nn.Module, inputs: Any, output: Any) -> None:
        collected.append(output[0] if isinstance(output, tuple) else output)

    handles = [router.register_forward_hook(hook) for router in routers]
    try:
        yield collected
    finally:
        for handle in handles:
            handle.remove()


def router_statistics(
    router_logits: Sequence[torch.Tensor], weights: torch.Tensor, num_experts: int, top_k: int
) -> RouterStatistics:
    """Weighted load-balancing statistics. router_logits: one ``[T, E]`` per MoE layer; weights ``[T]``."""
    if not router_logits:
        raise ValueError("no router logits were collected; is this an MoE model with its routers patched?")
    # fp32 (float64 for a float64 model: never a downcast).
    dtype = torch.promote_types(router_logits[0].dtype, torch.float32)
    weights = weights.to(dtype)
    loads = []
    probabilities = []
    for logits in router_logits:
        routing = torch.softmax(logits.to(dtype), dim=-1)
        selected = torch.topk(routing, top_k, dim=-1).indices
        load = torch.zeros(num_experts, dtype=dtype, device=logits.device)
        load.scatter_add_(0, selected.reshape(-1), weights.repeat_interleave(top_k))
        loads.append(load)
        probabilities.append((routing * weights[:, None]).sum(dim=0))
    expert_load = torch.stack(loads)
    probability_sum = torch.stack(probabilities)
    total_rows = weights.sum() * len(router_logits)
    tokens_per_expert = expert_load.sum(dim=0) / total_rows
    router_probability = probability_sum.sum(dim=0) / total_rows
    aux_loss = (tokens_per_expert * router_probability).sum() * num_experts
    return RouterStatistics(
        aux_loss=aux_loss,
        expert_load=expert_load,
        router_probability=probability_sum / weights.sum(),
    )
