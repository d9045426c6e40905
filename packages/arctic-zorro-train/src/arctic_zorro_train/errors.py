"""Errors raised by arctic-zorro-train. Each message says what was expected, what was received and how to fix it."""

from __future__ import annotations

__all__ = ["MissingDependencyError", "UnsupportedModelError", "ZorroPatchError"]


class UnsupportedModelError(ValueError):
    """The model's architecture has no patch table; the message lists the supported ones."""


class ZorroPatchError(RuntimeError):
    """The model is not patched (or patched differently) for the call that was made."""


class MissingDependencyError(ImportError):
    """An optional dependency is needed for the requested feature; the message names the extra to install."""
