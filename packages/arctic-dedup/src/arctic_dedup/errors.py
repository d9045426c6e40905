"""Errors raised on bad input. Each message says what was expected, what was received, and how to fix it."""

from __future__ import annotations

__all__ = ["BatchLayoutError", "PlanError"]


class BatchLayoutError(ValueError):
    """The batch does not follow the declared layout (shapes, padding sides, lengths, empty batch)."""


class PlanError(RuntimeError):
    """A plan could not be built or does not fit the tensor it is applied to."""
