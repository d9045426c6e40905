"""Policy losses: a registry of named losses and the built-in PPO / GRPO / GSPO family.

Every loss returns this micro-batch's *share* of the step's loss: per-token terms are summed over the micro-batch
and divided by denominators counted over the whole step (``LossInputs.global_tokens`` / ``global_sequences``: all
micro-batches of all data-parallel ranks). Summing the shares over micro-batches and ranks therefore gives the loss,
and the gradient, of the whole step computed in one call, whatever the split.

The built-in per-token loss, for a response token t of sequence i with mask m, advantage A and importance ratio r:

    pg    = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
    pg    = min(pg, -A clip_ratio_c)                  where A < 0, when dual clip is on
    pg    = pg * min(exp(old - rollout), tis_cap)     truncated importance sampling, when tis_cap is set
    loss  = pg + kl_coef * KL(policy || reference) - entropy_coef * entropy

with r = exp(log_prob - old_log_prob) per token, or (``importance_ratio_level="sequence"``, GSPO) the sequence's
geometric-mean ratio exp(mean_t(log_prob - old_log_prob)), carried to each token as
``sg(r_i) * exp(log_prob_t - sg(log_prob_t))`` so its gradient is the sequence-level one.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_type_hints

import torch

from arctic_rl.errors import ConfigError

__all__ = [
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "AggregationMode",
    "GspoLossConfig",
    "KlEstimator",
    "LossFn",
    "LossInputs",
    "LossNeeds",
    "LossOutput",
    "PolicyLossConfig",
    "RegisteredLoss",
    "aggregate",
    "count_loss_denominators",
    "get_loss_fn",
    "kl_penalty",
    "loss_needs",
    "parse_dataclass_config",
    "policy_loss",
    "register_loss_fn",
    "registered_loss_names",
]

AggregationMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KlEstimator = Literal["k1", "k2", "k3"]
AGGREGATION_MODES: tuple[str, ...] = get_args(AggregationMode)
KL_ESTIMATORS: tuple[str, ...] = get_args(KlEstimator)

# exp() of a log-ratio beyond this overflows float32 long before it means anything; the clip decides such tokens.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's tensors and the step-wide denominators a loss divides by.

    Attributes:
        log_probs: ``[b, R]`` current policy log-probs of the response tokens (requires grad), 0 at padding.
        old_log_probs: ``[b, R]`` log-probs of the policy that the advantages were computed for.
        advantages: ``[b, R]`` (or ``[b]``, broadcast over the response).
        response_mask: ``[b, R]`` 1 at real response tokens, 0 at padding (any dtype; used as float).
        ref_log_probs: ``[b, R]`` reference-model log-probs, for the KL term.
        rollout_log_probs: ``[b, R]`` the sampler's own log-probs, for truncated importance sampling.
        entropy: ``[b, R]`` per-token entropy of the current policy, when the loss asked for it.
        global_tokens: response tokens (sum of ``response_mask``) of the whole step, all micro-batches and ranks.
        global_sequences: sequences with at least one response token in the whole step.
        max_response_length: R of the step's batch (the constant of ``seq-mean-token-sum-norm``).
    """

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    ref_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    global_tokens: float = 0.0
    global_sequences: float = 0.0
    max_response_length: int = 0


@dataclass(frozen=True)
class LossOutput:
    """``loss``: a scalar, this micro-batch's share of the step's loss (sum the shares for the step's loss).

    ``metrics``: detached scalars with the same convention (summing the shares gives the step's mean).
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


@dataclass(frozen=True)
class LossNeeds:
    """What the engine must provide in ``LossInputs`` for a loss and its config."""

    entropy: bool = False
    ref_log_probs: bool = False
    rollout_log_probs: bool = False

    def batch_keys(self, *, old_log_probs_from_forward: bool) -> tuple[str, ...]:
        """The optional batch keys a training batch must hold for this loss (what ``fwd_bwd`` checks, in the service
        and in a directly called engine alike); ``old_log_probs`` are not needed when the forward provides them."""
        keys = ["advantages"] if old_log_probs_from_forward else ["old_log_probs", "advantages"]
        if self.ref_log_probs:
            keys.append("ref_log_prob")
        if self.rollout_log_probs:
            keys.append("rollout_log_probs")
        return tuple(keys)


LossFn = Callable[[LossInputs, Mapping[str, Any]], LossOutput]


def count_loss_denominators(response_mask: torch.Tensor) -> tuple[float, float]:
    """``(global_tokens, global_sequences)`` of a step's full ``[B, R]`` response mask (count once per step)."""
    tokens_per_sequence = response_mask.detach().to(torch.float64).sum(dim=-1)
    return float(tokens_per_sequence.sum()), float((tokens_per_sequence > 0).sum())


def parse_dataclass_config(config_type: type[Any], config: Mapping[str, Any] | Any, *, what: str) -> Any:
    """Build the frozen dataclass ``config_type`` from a dict; unknown keys and wrong types raise ``ConfigError``.

    An instance of ``config_type`` is returned as is. Integers are accepted for float fields.
    """
    if isinstance(config, config_type):
        return config
    if not isinstance(config, Mapping):
        raise ConfigError(f"{what} config must be a dict, got {type(config).__name__}.")
    known = {field.name: field for field in dataclasses.fields(config_type)}
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise ConfigError(f"{what} config has unknown keys {unknown}; the known keys are {sorted(known)}.")
    hints = get_type_hints(config_type)
    values = {}
    for name, value in config.items():
        values[name] = _check_value(value, hints[name], f"{what} config {name!r}")
    try:
        return config_type(**values)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{what} config is invalid: {error}") from None


def _check_value(value: Any, annotation: Any, where: str) -> Any:
    origin = getattr(annotation, "__origin__", None)
    options = get_args(annotation)
    if origin is Literal:
        if value not in options or isinstance(value, bool) != isinstance(options[0], bool):
            raise ConfigError(f"{where} must be one of {list(options)}, got {value!r}.")
        return value
    if options and type(None) in options:
        if value is None:
            return None
        inner = [option for option in options if option is not type(None)]
        return _check_value(value, inner[0], where)
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be a bool, got {value!r}.")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number, got {value!r}.")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an int, got {value!r}.")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a str, got {value!r}.")
        return value
    return value


@dataclass(frozen=True)
class PolicyLossConfig:
    """Options of the built-in policy losses (``"grpo"``, ``"ppo"``, ``"gspo"``); defaults differ per name.

    Attributes:
        clip_ratio_low: the ratio is clipped from below at ``1 - clip_ratio_low``.
        clip_ratio_high: the ratio is clipped from above at ``1 + clip_ratio_high`` (DAPO's clip-higher: > low).
        clip_ratio_c: dual clip: for negative advantages the loss is capped at ``-A * clip_ratio_c`` (> 1); None: off.
        importance_ratio_level: ``"token"`` (PPO/GRPO) or ``"sequence"`` (GSPO: per-sequence geometric mean).
        loss_agg_mode: how per-token losses become the step's loss (see ``aggregate``).
        kl_coef: weight of the KL penalty to the reference policy (needs ``ref_log_probs``); 0: off.
        kl_estimator: ``"k1"`` (log-ratio), ``"k2"`` (half squared log-ratio) or ``"k3"`` (low-variance, >= 0).
        entropy_coef: weight of the entropy bonus (subtracted from the loss; needs ``entropy``); 0: off.
        tis_cap: truncated importance sampling: each token's policy loss is weighted by
            ``min(exp(old_log_probs - rollout_log_probs), tis_cap)`` (needs ``rollout_log_probs``); None: off.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = None
    importance_ratio_level: Literal["token", "sequence"] = "token"
    loss_agg_mode: AggregationMode = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: KlEstimator = "k3"
    entropy_coef: float = 0.0
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_ratio_low < 1.0 or self.clip_ratio_high < 0.0:
            raise ValueError(
                f"clip_ratio_low must be in [0, 1) and clip_ratio_high >= 0, got {self.clip_ratio_low} and "
                f"{self.clip_ratio_high}; typical values are 0.2 and 0.2 (or 0.28 for clip-higher)."
            )
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c (dual clip) must be > 1 (typically 3.0), got {self.clip_ratio_c}.")
        if self.kl_coef < 0.0 or self.entropy_coef < 0.0:
            raise ValueError(f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef} and {self.entropy_coef}.")
        if self.tis_cap is not None and self.tis_cap <= 0.0:
            raise ValueError(f"tis_cap must be > 0 (typically 2.0), got {self.tis_cap}.")

    def needs(self) -> LossNeeds:
        return LossNeeds(
            entropy=self.entropy_coef != 0.0,
            ref_log_probs=self.kl_coef != 0.0,
            rollout_log_probs=self.tis_cap is not None,
        )


@dataclass(frozen=True)
class RegisteredLoss:
    """A named loss: its function, whether it always needs entropy, and its typed config (if any).

    ``parse_config(dict)`` validates a user's config (a ``config_type`` instance, or the dict itself when the loss
    declared no type); calling the entry runs the loss on a parsed or raw config.
    """

    name: str
    fn: LossFn
    needs_entropy: bool = False
    config_type: type[Any] | None = None

    def parse_config(self, config: Mapping[str, Any] | None = None) -> Any:
        config = {} if config is None else config
        if self.config_type is None:
            if not isinstance(config, Mapping):
                raise ConfigError(f"loss {self.name!r} config must be a dict, got {type(config).__name__}.")
            return dict(config)
        return parse_dataclass_config(self.config_type, config, what=f"loss {self.name!r}")

    def needs(self, config: Mapping[str, Any] | None = None) -> LossNeeds:
        parsed = self.parse_config(config)
        declared = parsed.needs() if hasattr(parsed, "needs") else LossNeeds()
        return dataclasses.replace(declared, entropy=declared.entropy or self.needs_entropy)

    def __call__(self, inputs: LossInputs, config: Mapping[str, Any] | Any = None) -> LossOutput:
        return self.fn(inputs, self.parse_config(config))


_REGISTRY: dict[str, RegisteredLoss] = {}
_REGISTRY_LOCK = threading.Lock()


def register_loss_fn(
    name: str,
    fn: LossFn,
    *,
    needs_entropy: bool = False,
    overwrite: bool = False,
    config_type: type[Any] | None = None,
) -> None:
    """Register ``fn`` under ``name`` (chosen with ``processing={"loss_fn": name, "config": {...}}``).

    ``fn(inputs, config)`` must return this micro-batch's share of the step's loss (divide by
    ``inputs.global_tokens`` / ``global_sequences``, never by local counts). With ``config_type`` (a frozen
    dataclass) the user's dict is parsed into it first, unknown keys refused; a ``needs()`` method on it tells the
    engines which optional inputs to compute.
    """
    if not name or not isinstance(name, str):
        raise ConfigError(f"a loss name must be a non-empty str, got {name!r}.")
    if not callable(fn):
        raise ConfigError(f"loss {name!r}: fn must be callable, got {type(fn).__name__}.")
    if config_type is not None and not dataclasses.is_dataclass(config_type):
        raise ConfigError(f"loss {name!r}: config_type must be a dataclass, got {config_type!r}.")
    with _REGISTRY_LOCK:
        if name in _REGISTRY and not overwrite:
            raise ConfigError(f"a loss named {name!r} is already registered; pass overwrite=True to replace it.")
        _REGISTRY[name] = RegisteredLoss(name=name, fn=fn, needs_entropy=needs_entropy, config_type=config_type)


def get_loss_fn(name: str) -> RegisteredLoss:
    """The registered loss ``name``; an unknown name raises ``ConfigError`` listing the registered ones."""
    with _REGISTRY_LOCK:
        registered = _REGISTRY.get(name)
        if registered is None:
            raise ConfigError(f"no loss named {name!r}; registered losses: {sorted(_REGISTRY)}.")
        return registered


def registered_loss_names() -> list[str]:
    """The names of every registered loss, sorted."""
    with _REGISTRY_LOCK:
        return sorted(_REGISTRY)


def loss_needs(name: str, config: Mapping[str, Any] | None = None) -> LossNeeds:
    """Which optional inputs (entropy, reference and rollout log-probs) the loss ``name`` needs with ``config``."""
    return get_loss_fn(name).needs(config)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: AggregationMode,
    *,
    global_tokens: float,
    global_sequences: float,
    max_response_length: int,
) -> torch.Tensor:
    """This micro-batch's share of the step's aggregate of ``per_token`` ``[b, R]`` over ``mask``.

    - ``token-mean``: sum over every response token of the step / step's tokens.
    - ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean.
    - ``seq-mean-token-sum-norm``: mean over sequences of token sum / ``max_response_length`` (Dr. GRPO; a constant
      divisor, so long and short responses weigh their tokens alike).

    Sequences without response tokens count nowhere (``global_sequences`` excludes them).
    """
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / _positive(global_tokens, "global_tokens")
    sequences = _positive(global_sequences, "global_sequences")
    if mode == "seq-mean-token-sum":
        return masked.sum() / sequences
    if mode == "seq-mean-token-mean":
        tokens = mask.sum(dim=-1).clamp(min=1.0)
        return (masked.sum(dim=-1) / tokens).sum() / sequences
    if mode == "seq-mean-token-sum-norm":
        if max_response_length < 1:
            raise ConfigError(
                f"seq-mean-token-sum-norm divides by max_response_length, got {max_response_length}; set "
                "LossInputs.max_response_length to the step batch's response width R."
            )
        return masked.sum() / (sequences * max_response_length)
    raise ConfigError(f"unknown loss_agg_mode {mode!r}; use one of {list(AGGREGATION_MODES)}.")


def _positive(value: float, name: str) -> float:
    if not value > 0:
        raise ConfigError(
            f"LossInputs.{name} must be > 0 (counted over the whole step with count_loss_denominators), got {value}."
        )
    return float(value)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from log-probs of tokens sampled from the policy.

    k1 = log p - log q; k2 = (log p - log q)^2 / 2; k3 = q/p - log(q/p) - 1 (Schulman's low-variance estimator).
    """
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        reverse = (-log_ratio).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.exp(reverse) - reverse - 1.0
    raise ConfigError(f"unknown kl_estimator {estimator!r}; use one of {list(KL_ESTIMATORS)}.")


def policy_loss(inputs: LossInputs, config: Mapping[str, Any] | PolicyLossConfig) -> LossOutput:
    """The built-in clipped policy loss (PPO / GRPO / GSPO, see the module docstring) with KL, entropy and TIS."""
    options = parse_dataclass_config(PolicyLossConfig, config, what="policy loss")
    log_probs = inputs.log_probs
    mask = inputs.response_mask.to(log_probs.dtype)
    shape = tuple(log_probs.shape)
    if log_probs.dim() != 2:
        raise ConfigError(f"LossInputs.log_probs must be [b, R], got shape {shape}.")
    old_log_probs = _same_shape(inputs.old_log_probs, shape, "old_log_probs").to(log_probs.dtype)
    advantages = inputs.advantages.to(log_probs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand(shape)
    advantages = _same_shape(advantages, shape, "advantages")
    _same_shape(mask, shape, "response_mask")

    def share(per_token: torch.Tensor, mode: AggregationMode) -> torch.Tensor:
        return aggregate(
            per_token,
            mask,
            mode,
            global_tokens=inputs.global_tokens,
            global_sequences=inputs.global_sequences,
            max_response_length=inputs.max_response_length,
        )

    def token_mean(per_token: torch.Tensor) -> torch.Tensor:
        return share(per_token.detach(), "token-mean")

    log_ratio = (log_probs - old_log_probs) * mask
    if options.importance_ratio_level == "sequence":
        tokens = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
        sequence_log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / tokens).detach()
        log_ratio = sequence_log_ratio + log_probs - log_probs.detach()
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))

    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - options.clip_ratio_low, 1.0 + options.clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics = {"clip_fraction": token_mean((clipped > unclipped).to(log_probs.dtype))}
    if options.clip_ratio_c is not None:
        cap = -advantages * options.clip_ratio_c
        dual_clipped = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual_clipped, cap, per_token)
        metrics["dual_clip_fraction"] = token_mean(dual_clipped.to(log_probs.dtype))
    if options.tis_cap is not None:
        rollout = _required(inputs.rollout_log_probs, "rollout_log_probs", "tis_cap", shape)
        weight = torch.exp((old_log_probs - rollout.to(log_probs.dtype)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        truncated = weight > options.tis_cap
        per_token = per_token * weight.clamp(max=options.tis_cap).detach()
        metrics["tis_weight"] = token_mean(weight.clamp(max=options.tis_cap))
        metrics["tis_truncated_fraction"] = token_mean(truncated.to(log_probs.dtype))
    mode: AggregationMode = options.loss_agg_mode
    loss = share(per_token, mode)
    metrics["pg_loss"] = loss.detach()
    metrics["ppo_kl"] = token_mean(old_log_probs - log_probs)

    if options.kl_coef != 0.0:
        ref = _required(inputs.ref_log_probs, "ref_log_probs", "kl_coef", shape)
        kl = share(kl_penalty(log_probs, ref.to(log_probs.dtype), options.kl_estimator), mode)
        loss = loss + options.kl_coef * kl
        metrics["kl"] = kl.detach()
    if inputs.entropy is not None:
        entropy = _same_shape(inputs.entropy, shape, "entropy").to(log_probs.dtype)
        if options.entropy_coef != 0.0:
            entropy_share = share(entropy, mode)
            loss = loss - options.entropy_coef * entropy_share
        metrics["entropy"] = token_mean(entropy)
    elif options.entropy_coef != 0.0:
        raise ConfigError(
            "entropy_coef is set but LossInputs.entropy is None; compute the entropy (loss_needs(...).entropy) "
            "or set entropy_coef=0."
        )
    return LossOutput(loss=loss, metrics=metrics)


def _same_shape(tensor: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise ConfigError(
            f"LossInputs.{name} must have the shape of log_probs {list(shape)}, got {list(tensor.shape)}."
        )
    return tensor


def _required(tensor: torch.Tensor | None, name: str, option: str, shape: tuple[int, ...]) -> torch.Tensor:
    if tensor is None:
        raise ConfigError(
            f"the loss option {option} needs LossInputs.{name}, which is None; provide it in the batch "
            f"({'ref_log_prob' if name == 'ref_log_probs' else name}) or turn {option} off."
        )
    return _same_shape(tensor, shape, name)


@dataclass(frozen=True)
class GspoLossConfig(PolicyLossConfig):
    """``PolicyLossConfig`` with GSPO's defaults: sequence-level ratios, which need much tighter clipping than
    token-level ones (Zheng et al. 2025: 3e-4 / 4e-4), and the sequence mean of token means."""

    clip_ratio_low: float = 3e-4
    clip_ratio_high: float = 4e-4
    importance_ratio_level: Literal["token", "sequence"] = "sequence"
    loss_agg_mode: AggregationMode = "seq-mean-token-mean"


def _policy_loss_with(config_type: type[PolicyLossConfig]) -> LossFn:
    # The registered function parses with its own defaults, so `get_loss_fn(name).fn(inputs, raw_dict)` and
    # `get_loss_fn(name)(inputs, raw_dict)` agree.
    def loss(inputs: LossInputs, config: Mapping[str, Any]) -> LossOutput:
        return policy_loss(inputs, parse_dataclass_config(config_type, config, what="policy loss"))

    return loss


register_loss_fn("grpo", _policy_loss_with(PolicyLossConfig), config_type=PolicyLossConfig)
register_loss_fn("ppo", _policy_loss_with(PolicyLossConfig), config_type=PolicyLossConfig)
register_loss_fn("gspo", _policy_loss_with(GspoLossConfig), config_type=GspoLossConfig)
