"""Checks of an operation's arguments that need more than its body model, run before any engine is called."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from arctic_rl.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from arctic_rl.losses import LossNeeds

__all__ = [
    "check_checkpoint_arguments",
    "check_flag",
    "check_temperature",
    "parse_processing",
]

DEFAULT_LOSS = "grpo"


def parse_processing(processing: Mapping[str, Any] | None) -> tuple[str, dict[str, Any], LossNeeds]:
    """The loss's registered name, its options and what it needs of the batch; an unknown loss or a bad option is
    refused here."""
    from arctic_rl.losses import get_loss_fn

    processing = {} if processing is None else processing
    if not isinstance(processing, Mapping):
        raise ConfigError(
            f"processing must be a dict like {{'loss_fn': 'grpo', 'config': {{...}}}}, got {type(processing).__name__}."
        )
    unknown = set(processing) - {"loss_fn", "config"}
    if unknown:
        raise ConfigError(f"processing accepts the keys 'loss_fn' and 'config', got also {sorted(unknown)}.")
    name = processing.get("loss_fn", DEFAULT_LOSS)
    if not isinstance(name, str):
        raise InvalidRequestError(
            "processing.loss_fn", f"must be the name of a registered loss (a string), got {type(name).__name__}."
        )
    raw_config = processing.get("config")
    if raw_config is not None and not isinstance(raw_config, Mapping):
        raise InvalidRequestError(
            "processing.config", f"must be a dict of the loss's options, got {type(raw_config).__name__}."
        )
    if raw_config is not None and not all(isinstance(key, str) for key in raw_config):
        raise InvalidRequestError("processing.config", "keys must be option names (strings).")
    config = dict(raw_config or {})
    return name, config, get_loss_fn(name).needs(config)


def check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidRequestError(name, f"must be true or false, got {value!r}.")


def check_temperature(temperature: Any) -> None:
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)) or not (
        math.isfinite(temperature) and temperature > 0
    ):
        raise InvalidRequestError("temperature", f"must be a finite number > 0, got {temperature!r}.")


def check_checkpoint_arguments(path: Any, step: Any) -> None:
    if not isinstance(path, str) or not path or "\x00" in path:
        raise InvalidRequestError("path", f"must be a directory path (a non-empty string), got {path!r}.")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise InvalidRequestError("step", f"must be an integer >= 0 (a step number) or None, got {step!r}.")
