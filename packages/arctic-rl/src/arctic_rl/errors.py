"""The exceptions arctic-rl raises; every one derives from ``ArcticRLError``.

Each exception pickles with its own arguments (``__reduce__``) so that it crosses a Ray actor boundary unchanged.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = [
    "ArcticRLError",
    "BatchValidationError",
    "ConfigError",
    "EngineDiedError",
    "EngineError",
    "EngineStateError",
    "InvalidRequestError",
    "MissingDependencyError",
    "TransportError",
    "WireFormatError",
    "import_optional",
]


class ArcticRLError(Exception):
    """Base class of every error arctic-rl raises on purpose."""


class ConfigError(ArcticRLError, ValueError):
    """A configuration (client config, loss config, placement request) that cannot be used as given."""


class BatchValidationError(ArcticRLError, ValueError):
    """A batch that does not have the padded layout the engines expect; ``key`` names the offending entry."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(key, message)
        self.key = key
        self.message = message

    def __str__(self) -> str:
        return f"batch[{self.key!r}]: {self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.message))


class EngineError(ArcticRLError, RuntimeError):
    """An engine failed to start or died during a call; ``engine`` names it (e.g. ``"training[0]"``)."""

    def __init__(self, engine: str, message: str) -> None:
        super().__init__(engine, message)
        self.engine = engine
        self.message = message

    def __str__(self) -> str:
        return f"{self.engine} engine: {self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.engine, self.message))


class EngineDiedError(EngineError):
    """An engine is gone: its process died, or it did not answer a call within its time limit and was declared
    failed. The server reports it in ``/health`` from then on; only a restart brings it back (HTTP 503)."""


class InvalidRequestError(ArcticRLError, ValueError):
    """A request value the engines cannot take (a token id outside the vocabulary, a seed out of range, a path that
    does not exist, ...), refused before it reaches vLLM or DeepSpeed; ``field`` names it (HTTP 422)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.message))


class EngineStateError(ArcticRLError, RuntimeError):
    """An operation asked of an engine in a state that does not allow it (e.g. ``fwd_bwd`` while sleeping).

    Raised before any state changes, so the engine is still usable once the caller fixes the order of its calls.
    """

    def __init__(self, message: str, *, engine: str | None = None) -> None:
        super().__init__(message)
        self.engine = engine
        self.message = message

    def __str__(self) -> str:
        return self.message if self.engine is None else f"{self.engine} engine: {self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_engine_state_error, (type(self), self.message, self.engine))


def _rebuild_engine_state_error(cls: type[EngineStateError], message: str, engine: str | None) -> EngineStateError:
    return cls(message, engine=engine)


class WireFormatError(ArcticRLError, ValueError):
    """Bytes that are not an arctic-rl wire message, or a value the wire format cannot carry (``arctic_rl.wire``)."""


class TransportError(ArcticRLError, ConnectionError):
    """The HTTP server could not be reached or stopped answering; the message names its address and what to check."""


class MissingDependencyError(ArcticRLError, ImportError):
    """An optional dependency (DeepSpeed, vLLM, transformers, ...) is not installed; the message names the extra."""

    def __init__(self, package: str, extra: str, purpose: str = "") -> None:
        self.package = package
        self.extra = extra
        self.purpose = purpose
        why = f" {purpose}" if purpose else ""
        super().__init__(
            f"`{package}` is not installed but is needed{why}; install it with `pip install 'arctic-rl[{extra}]'`."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.package, self.extra, self.purpose))


def import_optional(module: str, *, extra: str, purpose: str = "") -> ModuleType:
    """Import ``module`` at first use; a missing package raises ``MissingDependencyError`` naming ``extra``."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        top_level = module.split(".")[0]
        if error.name is not None and error.name.split(".")[0] != top_level:
            raise
        raise MissingDependencyError(top_level, extra, purpose) from error
