"""The autograd base of the backends whose backward runs through the output only (``sdpa``, ``varlen``)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.autograd.function import once_differentiable

__all__ = ["NoLseGradientFunction"]


class NoLseGradientFunction(torch.autograd.Function):
    """``forward`` returns ``(out, lse)``; ``backward`` refuses a nonzero gradient on the lse with a message naming
    the backends that propagate it, and hands the output gradient to the subclass's ``output_backward``.

    Subclasses set ``BACKEND`` (the name users pass as ``backend=``) and implement ``output_backward(ctx,
    grad_out)``, returning one gradient per ``forward`` input.
    """

    BACKEND: ClassVar[str]

    @classmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        cls, ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        if grad_lse is not None and bool(grad_lse.ne(0).any()):
            raise NotImplementedError(
                f"backend={cls.BACKEND!r} does not propagate gradients through the returned lse; use 'triton', "
                "'flex' or 'reference' when the loss depends on the lse."
            )
        if grad_out is None:
            return (None,) * len(ctx.needs_input_grad)
        return cls.output_backward(ctx, grad_out)

    @staticmethod
    def output_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        raise NotImplementedError("subclasses of NoLseGradientFunction implement output_backward")
