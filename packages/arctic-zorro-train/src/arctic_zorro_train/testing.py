"""Helpers for tests, examples and benchmarks, under one import path: tiny random-init models of every supported
family (``tiny_models``), a small GRPO-like batch and the plain per-sample reference run (``reference_run``), and
arctic-dedup's dummy batch. The package's own code imports those modules, not this one."""

from __future__ import annotations

from arctic_dedup.testing import create_dummy_batch
from arctic_zorro_train.reference_run import (
    ReferenceOutputs,
    Sample,
    collect_grads,
    float64_everywhere,
    float64_recurrent_gated_delta_rule,
    gradient_errors,
    long_samples,
    make_batch,
    model_precision,
    per_sample_reference,
    reference_loss,
    relative_error,
)
from arctic_zorro_train.tiny_models import FAMILIES, build_model, tiny_config, tiny_config_like

__all__ = [
    "FAMILIES",
    "ReferenceOutputs",
    "Sample",
    "build_model",
    "collect_grads",
    "create_dummy_batch",
    "float64_everywhere",
    "float64_recurrent_gated_delta_rule",
    "gradient_errors",
    "long_samples",
    "make_batch",
    "model_precision",
    "per_sample_reference",
    "reference_loss",
    "relative_error",
    "tiny_config",
    "tiny_config_like",
]
