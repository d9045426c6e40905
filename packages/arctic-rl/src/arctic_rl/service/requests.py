"""Checks of an operation's arguments that need more than its body model, run before any engine is called."""

from __future__ import annotations

import math
from typing import Any

from arctic_rl.errors import InvalidRequestError

__all__ = [
    "check_checkpoint_arguments",
    "check_flag",
    "check_temperature",
]


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
