"""Gradient checkpointing under the patch: same results, and far fewer activation bytes kept for the backward.

Memory is measured as the bytes of distinct storages that autograd keeps for the backward pass (an outer
saved-tensor hook; checkpointed regions keep theirs through their own inner hooks, so they are not retained).
The H200 benchmark measures the same with torch.cuda peak memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from zorro_cases import fresh_model

from arctic_zorro_train import DeduplicatedActor, create_dummy_batch
from arctic_zorro_train.testing import collect_grads, relative_error


@contextmanager
def saved_activation_bytes() -> Iterator[list[int]]:
    storages: dict[int, int] = {}
    total = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            total[0] = sum(storages.values())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield total


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_moe"])
def test_checkpointing_is_exact_and_saves_memory(family: str) -> None:
    model = fresh_model(family, num_hidden_layers=4)
    model.train()
    batch = create_dummy_batch(4, 2, 24, 8, vocab_size=120, add_padding=True, include_training_fields=True, seed=5)
    actor = DeduplicatedActor(model, kl_coef=0.1)
    results = {}
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad(set_to_none=True)
        with saved_activation_bytes() as saved:
            metrics = actor.compute_policy_loss_and_backward(batch)
        results[checkpointing] = (metrics, collect_grads(model), saved[0])
    model.gradient_checkpointing_disable()
    (plain_metrics, plain_grads, plain_bytes), (ckpt_metrics, ckpt_grads, ckpt_bytes) = results[False], results[True]
    assert ckpt_metrics["actor/policy_loss"] == pytest.approx(plain_metrics["actor/policy_loss"], rel=1e-6)
    if "actor/moe_aux_loss" in plain_metrics:
        assert ckpt_metrics["actor/moe_aux_loss"] == pytest.approx(plain_metrics["actor/moe_aux_loss"], rel=1e-6)
    for name, grad in plain_grads.items():
        assert relative_error(ckpt_grads[name], grad) <= 1e-5, name
    assert ckpt_bytes < 0.5 * plain_bytes, f"checkpointing kept {ckpt_bytes} bytes vs {plain_bytes} without"
