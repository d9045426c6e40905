"""Weight sync between engines. Sender side: the trainer's full parameters under Hugging Face names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

__all__ = ["FullParameterSource", "iter_full_parameters"]


class FullParameterSource(Protocol):
    def iter_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def iter_full_parameters(engine: FullParameterSource) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, full tensor)`` of every parameter of a ``TrainingEngine`` or ``LogProbEngine``.

    Under ZeRO-3 each parameter is gathered collectively: every rank must iterate to the end (rank 0 sends, the
    others drop the tensors). Under ZeRO 0-2 the tensors are the live parameters: copy them before the next step.
    """
    return engine.iter_full_parameters()
