"""Log-probabilities and entropies of response tokens from the hidden states that predict them.

The softmax math runs in fp32, or in float64 for a float64 model (then logprobs and entropies are float64 too).
Three logits modes (``M`` response tokens, vocabulary ``V``):

* ``"none"``: one ``[M, V]`` logits tensor, plain autograd (also returned to the caller);
* ``"compute"``: the ``[M, V]`` logits once, log-softmax and entropy in token chunks (smaller fp32 temporaries);
* ``"memory"``: never an ``[M, V]`` tensor. Chunks of tokens go through the LM head with no graph; the backward
  recomputes each chunk's logits and applies the closed-form gradients of log-softmax and entropy. When the LM
  head's weight is sharded by DeepSpeed ZeRO-3 (it is only materialized inside the head's own forward and its
  autograd backward) or its gradients are reduced by a post-accumulate hook (ZeRO-1/2), each chunk is instead
  wrapped in non-reentrant activation checkpointing, which recomputes it inside the main backward pass (where ZeRO-3
  gathers the weight again, and every gradient is accumulated once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from arctic_zorro_train.kernels.reference import logprob_logits_gradient_reference, logprob_statistics_reference

__all__ = ["LogitsMode", "TokenLogprobs", "token_logprobs"]

LogitsMode = Literal["none", "compute", "memory"]
LOGITS_MODES: tuple[str, ...] = ("none", "compute", "memory")


@dataclass(frozen=True)
class TokenLogprobs:
    """logprobs ``[M]`` fp32 (float64 for float64 logits); entropy ``[M]`` the same or None; logits ``[M, V]``
    (mode ``"none"`` only, before the temperature) or None."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    logits: torch.Tensor | None


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16- and 32-bit floats, float64 for float64 (never a downcast)."""
    return torch.promote_types(dtype, torch.float32)


def _head_fn(lm_head: Any, fp32_logits: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    if not fp32_logits:
        return lm_head  # type: ignore[return-value]

    def fp32_head(hidden: torch.Tensor) -> torch.Tensor:
        dtype = _softmax_dtype(lm_head.weight.dtype)
        bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.to(dtype)
        return torch.nn.functional.linear(hidden.to(dtype), lm_head.weight.to(dtype), bias)

    return fp32_head


def _statistics(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs, entropies or None) through torch's differentiable ops (modes "none" and "compute", ZeRO-3)."""
    logprobs, _, entropy = logprob_statistics_reference(logits, labels, temperature, with_entropy)
    return logprobs, entropy


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """hidden ``[M, d]`` -> (logprobs ``[M]``, entropy ``[M]``), recomputing logits chunk by chunk in backward.

    The chunk math is ``arctic_zorro_train.kernels.logprobs`` (``fused``: one Triton pass over the logits each way)
    or its torch twins; the backward uses the forward's log-normalizers and entropies. The LM head's parameters get
    their gradients from a nested backward through the head module (as reentrant activation checkpointing does);
    they are passed in only so autograd knows this node depends on them.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        head: Callable[[torch.Tensor], torch.Tensor],
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        fused: bool,
        *head_parameters: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        statistics = _fused_statistics if fused else logprob_statistics_reference
        dtype = _softmax_dtype(hidden.dtype)
        logprobs = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        log_normalizer = torch.empty_like(logprobs)
        entropy = torch.zeros_like(logprobs)
        with torch.no_grad():
            for start in range(0, hidden.shape[0], chunk_size):
                stop = start + chunk_size
                chunk = statistics(head(hidden[start:stop]), labels[start:stop], temperature, with_entropy)
                logprobs[start:stop], log_normalizer[start:stop] = chunk[0], chunk[1]
                if chunk[2] is not None:
                    entropy[start:stop] = chunk[2]
        ctx.save_for_backward(hidden, labels, log_normalizer, entropy)
        ctx.head = head
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        ctx.fused = fused
        ctx.num_head_parameters = len(head_parameters)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, labels, log_normalizer, entropy = ctx.saved_tensors
        gradient = _fused_gradient if ctx.fused else logprob_logits_gradient_reference
        if not ctx.with_entropy:
            grad_entropy = None
        grad_hidden = torch.zeros_like(hidden)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            stop = start + ctx.chunk_size
            with torch.enable_grad():
                chunk = hidden[start:stop].detach().requires_grad_(True)
                logits = ctx.head(chunk)
                with torch.no_grad():
                    grad_logits = gradient(
                        logits.detach(),
                        labels[start:stop],
                        log_normalizer[start:stop],
                        entropy[start:stop] if grad_entropy is not None else None,
                        None if grad_logprobs is None else grad_logprobs[start:stop],
                        None if grad_entropy is None else grad_entropy[start:stop],
                        ctx.temperature,
                    )
                torch.autograd.backward(logits, grad_logits)
            if chunk.grad is not None:
                grad_hidden[start:stop] = chunk.grad
        return (grad_hidden, None, None, None, None, None, None, *([None] * ctx.num_head_parameters))


def _fused_statistics(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    from arctic_zorro_train.kernels.logprobs import logprob_statistics  # imports triton: only where it runs

    return logprob_statistics(logits, labels, temperature, with_entropy)


def _fused_gradient(*args: Any) -> torch.Tensor:
    from arctic_zorro_train.kernels.logprobs import logprob_logits_gradient

    return logprob_logits_gradient(*args)


def _checkpointed_chunks(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from torch.utils.checkpoint import checkpoint

    def chunk_outputs(states: torch.Tensor, chunk_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs, entropy = _statistics(head(states), chunk_labels, temperature, with_entropy)
        return logprobs, logprobs if entropy is None else entropy

    pieces = [
        checkpoint(
            chunk_outputs, hidden[start : start + chunk_size], labels[start : start + chunk_size], use_reentrant=False
        )
        for start in range(0, hidden.shape[0], chunk_size)
    ]
    logprobs = torch.cat([piece[0] for piece in pieces])
    return logprobs, torch.cat([piece[1] for piece in pieces]) if with_entropy else None


def _needs_one_accumulation(module: nn.Module) -> bool:
    """The head's gradients must arrive through the main backward, once: its weight is sharded by DeepSpeed ZeRO-3
    (materialized only inside the head's own forward and backward), or a parameter has a post-accumulate-grad hook
    (DeepSpeed ZeRO-1/2 reduce each gradient the first time it is accumulated; a nested backward per chunk would
    accumulate it once per chunk)."""
    return any(
        hasattr(parameter, "ds_id") or bool(getattr(parameter, "_post_accumulate_grad_hooks", None))
        for parameter in module.parameters()
    )


def token_logprobs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_head: nn.Module,
    *,
    temperature: float = 1.0,
    mode: LogitsMode = "none",
    calculate_entropy: bool = False,
    chunk_size: int = 1024,
    fp32_logits: bool = False,
    fused: bool = False,
) -> TokenLogprobs:
    """Log-probabilities of ``labels [M]`` under ``lm_head(hidden [M, d]) / temperature`` (and entropies).

    ``fp32_logits`` runs the LM head itself in fp32 (otherwise only the softmax math is fp32). A float64 model stays
    in float64 throughout. ``fused``: mode ``"memory"`` runs its chunk math as Triton kernels
    (``arctic_zorro_train.kernels.logprobs``; CUDA, or CPU under ``TRITON_INTERPRET=1``); the other modes ignore it.
    """
    if mode not in LOGITS_MODES:
        raise ValueError(f"logits mode must be one of {LOGITS_MODES}, got {mode!r}.")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    head = _head_fn(lm_head, fp32_logits)
    if hidden.shape[0] == 0:
        # No response tokens at all: keep the graph connected so backward() still works.
        empty = hidden.sum(dim=-1).to(_softmax_dtype(hidden.dtype))
        return TokenLogprobs(logprobs=empty, entropy=empty.clone() if calculate_entropy else None, logits=None)
    if mode == "memory" and _needs_one_accumulation(lm_head):
        logprobs, entropy = _checkpointed_chunks(hidden, labels, head, temperature, chunk_size, calculate_entropy)
        return TokenLogprobs(logprobs=logprobs, entropy=entropy, logits=None)
    if mode == "memory":
        parameters = [p for p in lm_head.parameters() if p.requires_grad]
        logprobs, entropy = _ChunkedHeadLogprobs.apply(
            hidden, labels, head, temperature, chunk_size, calculate_entropy, fused, *parameters
        )
        return TokenLogprobs(logprobs=logprobs, entropy=entropy if calculate_entropy else None, logits=None)
    logits = head(hidden)
    if mode == "none":
        logprobs, entropy = _statistics(logits, labels, temperature, calculate_entropy)
        return TokenLogprobs(logprobs=logprobs, entropy=entropy, logits=logits)
    pieces = [
        _statistics(
            logits[start : start + chunk_size], labels[start : start + chunk_size], temperature, calculate_entropy
        )
        for start in range(0, logits.shape[0], chunk_size)
    ]
    logprobs = torch.cat([piece[0] for piece in pieces])
    entropy = torch.cat([piece[1] for piece in pieces if piece[1] is not None]) if calculate_entropy else None
    return TokenLogprobs(logprobs=logprobs, entropy=entropy, logits=None)
