"""The per-forward context prepares tree attention once; every attention layer only reads that preparation."""

from __future__ import annotations

import pytest
import torch

import arctic_dedup.attention.metadata as metadata_module
from arctic_dedup import PlanError
from arctic_zorro_train import apply_zorro, plan_batch, zorro_forward
from arctic_zorro_train.context import build_context, layer_attention
from arctic_zorro_train.testing import build_model, tiny_config


def _plan() -> object:
    torch.manual_seed(0)
    ids = torch.randint(1, 100, (4, 20))
    ids[:, :12] = ids[0, :12].clone()
    mask = torch.ones_like(ids)
    return plan_batch(ids, 8, mask, mask.cumsum(-1) - 1)


def test_sdpa_calls_are_built_once_per_forward_not_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config("qwen3", num_hidden_layers=3)
    model = build_model(config, attn_implementation="sdpa")
    apply_zorro(model, patch_forward=False, attention_backend="sdpa")
    builds: list[object] = []
    original = metadata_module.build_sdpa_calls
    monkeypatch.setattr(metadata_module, "build_sdpa_calls", lambda plan: builds.append(plan) or original(plan))
    plan = _plan()
    output = zorro_forward(model, plan)  # type: ignore[arg-type]
    output.logprobs.sum().backward()
    assert builds == [plan]


def test_auto_context_prepares_what_auto_picks_for_the_layers() -> None:
    config = tiny_config("mistral")
    plan = _plan()
    attention = layer_attention(config, torch.float32, grad_possible=True)
    assert attention.sliding_windows == (None, config.sliding_window)
    assert attention.needs_grad == (False, True)
    context = build_context(
        plan,  # type: ignore[arg-type]
        attention_backend="auto",
        attention=attention,
        conv_width=None,
        needs_reconstruct=False,
    )
    # Tiny CPU plans fit the dense reference, which needs nothing prepared.
    assert context.attention.plan is plan
    assert context.attention.backends == frozenset({"reference"})
    fixed = build_context(
        plan,  # type: ignore[arg-type]
        attention_backend="flex",
        attention=attention,
        conv_width=None,
        needs_reconstruct=False,
    )
    assert {key[2] for key in fixed.attention.block_tables} == {None, config.sliding_window}
    with pytest.raises(PlanError, match="not 'sdpa'"):
        fixed.attention.calls()
