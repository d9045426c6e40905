"""Parity of the deduplicated run with the plain model run on each sample alone.

``measure_parity`` runs both on one model and batch, in eval mode and in training mode (switching the patched model
between them, as RL engines do), and reports every difference: the package's tests assert on it, and
``check_parity`` runs it on a tiny random-init copy of any supported architecture, saved and loaded back as users
load models (seconds on a CPU). ``apply_zorro`` runs ``check_parity`` as a self-check under a transformers release
outside the tested range (``versions.py``); ``python -m arctic_zorro_train.check`` prints it as a table.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from arctic_zorro_train.actor import DeduplicatedActor
from arctic_zorro_train.reference_run import (
    collect_grads,
    gradient_errors,
    long_samples,
    make_batch,
    model_precision,
    reference_loss,
)
from arctic_zorro_train.settings import ZorroSettings
from arctic_zorro_train.tiny_models import build_model, tiny_config_like
from arctic_zorro_train.versions import installed_transformers, parity_check_running, register_self_check

__all__ = [
    "MODEL_MODES",
    "PARITY_TOLERANCE",
    "ModelMode",
    "ParameterParity",
    "ParityReport",
    "check_parity",
    "measure_parity",
]

# The project's exactness bound: logprobs and entropies (max absolute difference), the loss, and every parameter
# gradient (relative L2) of the deduplicated run against the per-sample run, in fp32 and float64 alike.
PARITY_TOLERANCE = 1e-5

# check_parity's batch and loss: the fp32 layout of the exactness tests (sequences of 25-32 tokens, where fp32
# rounding stays about 5x below the bound), a temperature other than 1 and a KL term, so every loss path runs.
_TEMPERATURE = 0.8
_KL_COEF = 0.1


ModelMode = Literal["eval", "train"]
# The modes measure_parity runs in, in this order: a log-prob engine's eval() forward, then the training step after
# the switch back to train() (transformers 5.25 re-kernelizes a loaded model on that switch, issue #37).
MODEL_MODES: tuple[ModelMode, ...] = ("eval", "train")


def _within(error: float, tolerance: float) -> bool:
    # Written so that NaN fails: a NaN gradient is not parity.
    return error <= tolerance


def _exceeds(error: float, previous: float) -> bool:
    """Whether ``error`` is worse than ``previous`` (NaN is worse than any number)."""
    return not math.isnan(previous) and (math.isnan(error) or error > previous)


def _worse(first: float, second: float) -> float:
    """The larger error, NaN where either is NaN."""
    return math.nan if math.isnan(first) or math.isnan(second) else max(first, second)


@dataclass(frozen=True)
class ParameterParity:
    """One parameter's gradient: relative L2 error of the deduplicated run's against the per-sample run's
    (absolute where the per-sample gradient is zero), the largest over the modes checked; ``mode`` is where it
    was largest."""

    name: str
    relative_error: float
    tolerance: float = PARITY_TOLERANCE
    mode: ModelMode = "train"

    @property
    def passed(self) -> bool:
        return _within(self.relative_error, self.tolerance)


@dataclass(frozen=True)
class ParityReport:
    """Deduplicated run vs per-sample run of one model on one batch, in each of ``modes`` (``module.eval()`` /
    ``module.train()``); every error is the largest over the modes.

    ``logprob_error`` / ``entropy_error``: the largest absolute difference over every response token, taken over
    a no-grad forward (what a log-prob engine runs) and a forward with autograd on (the training forward).
    ``loss_error``: absolute difference of the policy loss; ``parameters``: every parameter's gradient error, in
    the model's parameter order (both ``None`` / empty when gradients were not checked).
    """

    model_type: str
    dtype: torch.dtype
    attn_implementation: str
    transformers_version: str
    logprob_error: float
    entropy_error: float
    loss_error: float | None
    parameters: tuple[ParameterParity, ...]
    output_dtype: torch.dtype
    tolerance: float = PARITY_TOLERANCE
    modes: tuple[ModelMode, ...] = ("train",)

    @property
    def passed(self) -> bool:
        return all(_within(error, self.tolerance) for error in self.errors().values())

    def errors(self) -> dict[str, float]:
        """Every compared quantity by name: ``logprobs``, ``entropy``, ``loss`` and each parameter's name."""
        errors = {"logprobs": self.logprob_error, "entropy": self.entropy_error}
        if self.loss_error is not None:
            errors["loss"] = self.loss_error
        errors.update((parameter.name, parameter.relative_error) for parameter in self.parameters)
        return errors

    def failures(self) -> dict[str, float]:
        """The compared quantities above the tolerance (NaN included), worst first."""
        failed = {name: error for name, error in self.errors().items() if not _within(error, self.tolerance)}
        return dict(sorted(failed.items(), key=lambda item: -item[1] if not math.isnan(item[1]) else -math.inf))

    def worst_parameters(self, count: int = 5) -> tuple[ParameterParity, ...]:
        """The ``count`` parameters with the largest gradient error (NaN first)."""
        ordered = sorted(
            self.parameters,
            key=lambda parameter: math.inf if math.isnan(parameter.relative_error) else parameter.relative_error,
        )
        return tuple(reversed(ordered[-count:])) if count > 0 else ()

    def summary(self) -> str:
        """One line: what was checked, the largest differences, and the verdict."""
        worst = self.worst_parameters(1)
        gradient = f"{worst[0].relative_error:.2e} ({worst[0].name}, {worst[0].mode})" if worst else "not checked"
        verdict = "PASSED" if self.passed else f"FAILED ({len(self.failures())} above the bound)"
        return (
            f"{self.model_type}, {str(self.dtype).removeprefix('torch.')}, {self.attn_implementation} attention, "
            f"{' and '.join(self.modes)} mode, transformers {self.transformers_version}: max |logprob diff| "
            f"{self.logprob_error:.2e}, max |entropy diff| {self.entropy_error:.2e}, worst gradient rel-L2 "
            f"{gradient}; bound {self.tolerance:g}: {verdict}"
        )


def _max_abs_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.shape != expected.shape:
        return math.inf
    if actual.numel() == 0:
        return 0.0
    return float((actual.double() - expected.double()).abs().max())


def measure_parity(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    *,
    actor: DeduplicatedActor | None = None,
    temperature: float = 1.0,
    kl_coef: float = 0.1,
    check_grads: bool = True,
    modes: Sequence[ModelMode] = MODEL_MODES,
    **actor_options: Any,
) -> ParityReport:
    """Run ``model`` per sample (plain transformers, unpatched unless ``actor`` already patched it) and deduplicated
    (``DeduplicatedActor``, patched on first use) on ``batch`` in each of ``modes``, and compare.

    The per-sample runs of every mode come first, then the patch, then the deduplicated runs, each after switching
    the patched model to its mode: RL engines switch a patched policy between ``eval()`` (log-probs) and
    ``train()`` (the update), and a switch may change which code a layer runs (transformers 5.25 re-kernelizes a
    loaded model on it, which dropped the patched Gated DeltaNet forwards: issue #37).

    A float64 model runs inside ``float64_everywhere`` (no fp32 step anywhere). Leaves the last mode's
    deduplicated gradients in ``model``'s ``.grad`` and its training/eval mode as it was.

    Args:
        batch: a verl batch with training fields (``old_log_probs``, ``advantages``, ``ref_log_prob``).
        actor: an actor over ``model`` to reuse (otherwise one is made with ``kl_coef`` and ``actor_options``).
        check_grads: also compare the loss and every parameter gradient.
        modes: ``"eval"`` and/or ``"train"``, in the order to run them.
    """
    if not modes or any(mode not in MODEL_MODES for mode in modes):
        raise ValueError(f"modes must name some of {MODEL_MODES}, got {tuple(modes)!r}.")
    was_training = model.training
    references: dict[ModelMode, tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = {}
    logprob_error = entropy_error = 0.0
    loss_error: float | None = None
    worst: dict[str, ParameterParity] = {}
    try:
        with model_precision(model):
            for mode in modes:
                model.train(mode == "train")
                model.zero_grad(set_to_none=True)
                loss, logprobs, entropy = reference_loss(model, batch, temperature=temperature, kl_coef=kl_coef)
                if check_grads:
                    loss.backward()
                references[mode] = (loss.detach(), logprobs, entropy, collect_grads(model))
            model.zero_grad(set_to_none=True)
            actor = actor or DeduplicatedActor(model, kl_coef=kl_coef, **actor_options)
            for mode in modes:
                model.train(mode == "train")
                loss, logprobs, entropy, expected_grads = references[mode]
                with torch.no_grad():
                    inference = actor.forward(batch, temperature=temperature, calculate_entropy=True)
                training = actor.forward(batch, temperature=temperature, calculate_entropy=True)
                for output in (inference, training):
                    logprob_error = _worse(logprob_error, _max_abs_difference(output.logprobs.detach(), logprobs))
                    difference = (
                        math.inf if output.entropy is None else _max_abs_difference(output.entropy.detach(), entropy)
                    )
                    entropy_error = _worse(entropy_error, difference)
                del training
                if check_grads:
                    model.zero_grad(set_to_none=True)
                    metrics = actor.compute_policy_loss_and_backward(batch, temperature=temperature)
                    error = abs(metrics["actor/policy_loss"] - float(loss))
                    loss_error = error if loss_error is None else _worse(loss_error, error)
                    for name, error in gradient_errors(model, expected_grads).items():
                        previous = worst.get(name)
                        if previous is None or _exceeds(error, previous.relative_error):
                            worst[name] = ParameterParity(name, error, mode=mode)
    finally:
        model.train(was_training)
    config: Any = model.config
    return ParityReport(
        model_type=str(config.model_type),
        dtype=next(model.parameters()).dtype,
        attn_implementation=str(config._attn_implementation),
        transformers_version=installed_transformers(),
        logprob_error=logprob_error,
        entropy_error=entropy_error,
        loss_error=loss_error,
        parameters=tuple(worst.values()),
        output_dtype=inference.logprobs.dtype,
        modes=tuple(modes),
    )


def _reference_implementation(config: Any) -> str:
    """The attention the tiny per-sample run uses: the model's own where it runs on a CPU, else ``sdpa``."""
    implementation = getattr(config, "_attn_implementation", None)
    return implementation if implementation in ("eager", "sdpa") else "sdpa"


def check_parity(
    model_or_config: nn.Module | Any,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    settings: ZorroSettings | None = None,
    seed: int = 0,
) -> ParityReport:
    """Check deduplicated training against plain per-sample training on a tiny model of ``model_or_config``'s
    architecture, on the CPU, in seconds.

    Builds a tiny random-init model from the config (``tiny_config_like``: few layers, hidden size 64, the family's
    layer types, MoE routing and attention kind kept, dropout 0) in ``dtype``, saved and loaded back with
    ``from_pretrained`` as users load models, and a small GRPO-like batch (prompt groups of three, two and one, left
    and right padding, 25-32 tokens per sequence). Runs both in eval mode and, after switching the patched model,
    in training mode (``measure_parity``) with the PPO clip loss plus a KL term (and the MoE aux loss where the
    config outputs router logits), and compares logprobs, entropies, the loss and every parameter gradient with
    ``PARITY_TOLERANCE``.
    The weights of ``model_or_config`` are never read or changed, and the global RNG state is left as it was.

    Args:
        model_or_config: a supported Hugging Face model, or its config (``PretrainedConfig``).
        dtype: ``torch.float32`` (the default) or ``torch.float64`` (runs inside ``float64_everywhere``).
        attn_implementation: ``"eager"`` or ``"sdpa"`` for the per-sample run (default: the model's where it is one
            of these, else ``"sdpa"``).
        settings: the patch's settings; the attention mode (split or reconstruct), sharing and logits options
            apply. Tree-attention backends and fused kernels stay ``"auto"`` (the CPU's): they are this package's
            own code, tested against their references, not transformers'.
        seed: seed of the tiny model's random weights.

    Returns:
        A ``ParityReport``; ``report.passed`` is the verdict.

    Raises:
        UnsupportedModelError: the architecture has no patch table.
        ValueError: ``dtype`` is neither float32 nor float64.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"check_parity runs in torch.float32 or torch.float64, got {dtype}: in bf16 rounding alone exceeds the "
            "1e-5 bound (the GPU tests compare bf16 runs with an fp32 truth instead)."
        )
    config = model_or_config.config if isinstance(model_or_config, nn.Module) else model_or_config
    tiny = tiny_config_like(config)
    implementation = attn_implementation or _reference_implementation(config)
    settings = settings or ZorroSettings()
    options: dict[str, Any] = {
        "use_split_attention": settings.use_split_attention,
        "sharing": settings.sharing,
        "logits_optimization": settings.logits_mode,
        "logits_chunk_size": settings.logits_chunk_size,
        "fp32_logits": settings.fp32_logits,
    }
    # The check needs autograd even when called under no_grad / inference_mode (apply_zorro in an inference
    # script), and must not move the caller's random stream.
    with (
        torch.random.fork_rng(devices=[]),
        torch.inference_mode(False),
        torch.enable_grad(),
        parity_check_running(),
    ):
        model = build_model(tiny, dtype=dtype, attn_implementation=implementation, seed=seed, from_pretrained=True)
        batch = make_batch(long_samples(), extra_prompt_padding=2, extra_response_padding=1)
        return measure_parity(model, batch, temperature=_TEMPERATURE, kl_coef=_KL_COEF, **options)


@dataclass(frozen=True)
class _SelfCheckKey:
    """What a self-check's result depends on: the tiny model's config, the reference attention and the settings
    that change the deduplicated path."""

    tiny_config: str
    attn_implementation: str
    use_split_attention: bool
    sharing: str
    logits_mode: str
    fp32_logits: bool


# Self-check reports of this process: the guard runs check_parity once per architecture and config shape.
_SELF_CHECKS: dict[_SelfCheckKey, ParityReport] = {}


def _self_check(model: Any, settings: ZorroSettings) -> ParityReport:
    """``check_parity`` on a tiny model of ``model``'s architecture, once per key per process.

    fp32 first. Where fp32 misses the bound, a float64 run decides: fp32 rounding alone can cross 1e-5 on
    gradients with heavy cancellation (the Gated DeltaNet decay parameters), while a real difference between the
    deduplicated and the plain run is as large in float64 as in fp32. If the float64 run cannot run, the fp32
    report stands.
    """
    config = model.config
    key = _SelfCheckKey(
        tiny_config=json.dumps(tiny_config_like(config).to_dict(), sort_keys=True, default=str),
        attn_implementation=_reference_implementation(config),
        use_split_attention=settings.use_split_attention,
        sharing=settings.sharing,
        logits_mode=settings.logits_mode,
        fp32_logits=settings.fp32_logits,
    )
    if key not in _SELF_CHECKS:
        report = check_parity(model, settings=settings)
        if not report.passed:
            try:
                report = check_parity(model, settings=settings, dtype=torch.float64)
            except Exception as error:
                warnings.warn(f"the float64 parity self-check could not run ({error!r})", stacklevel=2)
        _SELF_CHECKS[key] = report
    return _SELF_CHECKS[key]


register_self_check(_self_check)
