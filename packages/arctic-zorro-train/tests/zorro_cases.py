"""Shared helpers for the zorro-train tests: tiny models and the dedup-vs-reference assertion (batch layouts, the
per-sample reference and the measurement itself live in ``arctic_zorro_train.testing`` and ``.parity``).

Exactness is tested in float64. The deduplicated model and the plain per-sample transformers run share the same
float64 weights and run inside ``float64_everywhere`` (transformers' internal fp32 casts keep float64), so the two
differ only by float64 rounding: at most 1.1e-14 over the whole suite (the session summary prints the largest),
gradients with heavy cancellation (q/k projections of 2-3 token sequences, the Gated DeltaNet decay parameters)
included. The bound is still 1e-5 for every value and every parameter, so any real mistake (a wrong mask, a missing
child gradient, a shifted conv tail) fails by orders of magnitude. fp32 could not carry that bound everywhere: on those
cancelling gradients fp32 rounding alone moves transformers' own results by more than 1e-5. A smaller fp32 suite
(``test_families.py``) keeps 1e-5 on cases where fp32 is well-conditioned.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest
import torch
from torch import nn

from arctic_zorro_train import DeduplicatedActor
from arctic_zorro_train.parity import PARITY_TOLERANCE, measure_parity
from arctic_zorro_train.testing import (
    Sample,
    build_model,
    long_samples,
    make_batch,
    model_precision,
    reference_loss,
    tiny_config,
)

__all__ = [
    "GRADIENT_BREAKS",
    "HYBRID_FAMILIES",
    "LARGEST_DIFFERENCES",
    "TOLERANCE",
    "Sample",
    "break_gradient",
    "compare_with_reference",
    "float64_model",
    "fresh_model",
    "long_samples",
    "make_batch",
    "model_precision",
    "record_differences",
    "reference_loss",
]

TOLERANCE = PARITY_TOLERANCE
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_vlm", "qwen3_5_moe_vlm")

# The largest dedup-vs-reference difference seen in this session, per dtype (and setup): (difference, what, test).
LARGEST_DIFFERENCES: dict[str, tuple[float, str, str]] = {}


def fresh_model(
    family: str, attn_implementation: str = "eager", *, dtype: torch.dtype = torch.float32, **overrides: object
) -> Any:
    return build_model(tiny_config(family, **overrides), dtype=dtype, attn_implementation=attn_implementation)


def float64_model(family: str, attn_implementation: str = "eager", **overrides: object) -> Any:
    """The exactness tests' model: a tiny random-init ``family`` model in float64."""
    return fresh_model(family, attn_implementation, dtype=torch.float64, **overrides)


def compare_with_reference(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    actor: DeduplicatedActor | None = None,
    temperature: float = 1.0,
    kl_coef: float = 0.1,
    check_grads: bool = True,
    **actor_options: object,
) -> dict[str, float]:
    """Assert dedup logprobs/entropy (max abs, from a no-grad and a training forward), the loss and every parameter
    gradient (relative L2) are within ``TOLERANCE`` of the per-sample run of the same model, both in training mode
    (``measure_parity``); return the differences."""
    dtype = next(model.parameters()).dtype
    report = measure_parity(
        model,
        batch,
        actor=actor,
        temperature=temperature,
        kl_coef=kl_coef,
        check_grads=check_grads,
        **actor_options,
    )
    # fp32 softmax math, float64 for a float64 model: no step of the float64 run rounds to fp32.
    assert report.output_dtype == torch.promote_types(dtype, torch.float32)
    errors = report.errors()
    record_differences(str(dtype).removeprefix("torch."), errors)
    assert report.passed, f"{dtype}: {report.failures()} differ by more than {TOLERANCE}"
    return errors


def record_differences(label: str, errors: dict[str, float]) -> None:
    """Note the largest of ``errors`` under ``label`` for the session summary (conftest.py)."""
    name = max(errors, key=errors.__getitem__)
    if errors[name] > LARGEST_DIFFERENCES.get(label, (-1.0, "", ""))[0]:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").removesuffix(" (call)")
        LARGEST_DIFFERENCES[label] = (errors[name], name, test)


# Where to break the deduplicated path per family: the tree attention of an attention-only family, the tree Gated
# DeltaNet rule of a hybrid one (module, attribute the patched layers look up at call time).
GRADIENT_BREAKS = {
    "qwen3": ("arctic_zorro_train.attention", "_tree_attention"),
    "qwen3_5": ("arctic_zorro_train.gated_delta", "tree_gated_delta_rule"),
}


def break_gradient(monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """Halve the gradient through ``family``'s deduplicated attention (or Gated DeltaNet rule) while keeping its
    output bitwise: a wrong gradient path that only a training-mode gradient comparison catches."""
    module_name, attribute = GRADIENT_BREAKS[family]
    module = importlib.import_module(module_name)
    original = getattr(module, attribute)

    def halved(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(*args, **kwargs)
        return out.detach() + 0.5 * (out - out.detach())

    monkeypatch.setattr(module, attribute, halved)
