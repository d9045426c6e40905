"""The log-prob chunk math of the ``"memory"`` logits mode as two Triton passes over a chunk's logits.

torch spends ~70 bytes of memory traffic per logit on it (an fp32 copy of the bf16 logits, log-softmax, exp, the
gradient's fp32 temporaries, the cast back); on the deduplicated stream, where every response token's logits are
computed once per step either way, that memory-bound work is a fixed cost the dedup speedup cannot shrink
(benchmarks/results/zorro_hybrid_notes.md). Here the forward reads the logits once (log-normalizer, label log-prob,
entropy) and the backward reads them once more and writes the logits' gradient in their dtype.

The formulas are ``arctic_zorro_train.kernels.reference.logprob_statistics_reference`` and
``logprob_logits_gradient_reference`` (fp32 math, float64 for float64 logits).
"""

from __future__ import annotations

import torch
import triton

from arctic_zorro_train.kernels._launch_support import accumulator_dtype, new_buffer, triton_compute_dtype
from arctic_zorro_train.kernels._logprob_kernels import _logprob_backward_kernel, _logprob_forward_kernel

__all__ = ["logprob_logits_gradient", "logprob_statistics"]

# Tests set this to fill every new output with NaN, so an element a kernel forgets to write fails the comparison.
poison_outputs = False
_MAX_BLOCK = 4096
_NUM_WARPS = 8
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _block(vocab: int) -> int:
    return min(_MAX_BLOCK, triton.next_power_of_2(max(vocab, 16)))


def _check(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [tokens, vocab] and labels [tokens]; got {tuple(logits.shape)} and {tuple(labels.shape)}."
        )
    if logits.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"logits must be fp16, bf16, fp32 or fp64, got {logits.dtype}; cast them first.")
    if labels.dtype != torch.int64 or labels.device != logits.device:
        raise ValueError(f"labels must be int64 on {logits.device}, got {labels.dtype} on {labels.device}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def logprob_statistics(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logprobs ``[n]``, log-normalizers ``[n]``, entropies ``[n]`` or None) of ``logits [n, V] / temperature``
    at ``labels [n]``, in fp32 (float64 for float64 logits). No autograd: the caller's backward uses
    ``logprob_logits_gradient``."""
    logits = _check(logits, labels, temperature)
    rows, vocab = logits.shape
    dtype = accumulator_dtype(logits.dtype)
    logprobs = new_buffer((rows,), dtype, logits.device, poison=poison_outputs)
    log_normalizer = new_buffer((rows,), dtype, logits.device, poison=poison_outputs)
    entropy = new_buffer((rows,), dtype, logits.device, poison=poison_outputs) if with_entropy else None
    if rows:
        _logprob_forward_kernel[(rows,)](
            logits,
            labels,
            logprobs,
            log_normalizer,
            logprobs if entropy is None else entropy,
            vocab,
            logits.stride(0),
            float(temperature),
            WITH_ENTROPY=with_entropy,
            COMPUTE_DTYPE=triton_compute_dtype(logits.dtype),
            BLOCK=_block(vocab),
            num_warps=_NUM_WARPS,
        )
    return logprobs, log_normalizer, entropy


def logprob_logits_gradient(
    logits: torch.Tensor,
    labels: torch.Tensor,
    log_normalizer: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """The gradient ``[n, V]`` (in ``logits``' dtype) of ``sum(grad_logprobs * logprobs + grad_entropy * entropy)``
    with respect to ``logits``, from ``logprob_statistics``' log-normalizers and entropies (``entropy`` is needed
    only with ``grad_entropy``)."""
    logits = _check(logits, labels, temperature)
    rows, vocab = logits.shape
    if grad_entropy is not None and entropy is None:
        raise ValueError("grad_entropy needs the entropies logprob_statistics returned (with_entropy=True).")
    grad_logits = new_buffer((rows, vocab), logits.dtype, logits.device, poison=poison_outputs)
    if rows:
        stats = log_normalizer.contiguous()
        _logprob_backward_kernel[(rows,)](
            logits,
            labels,
            stats,
            stats if entropy is None else entropy.contiguous(),
            stats if grad_logprobs is None else grad_logprobs.contiguous(),
            stats if grad_entropy is None else grad_entropy.contiguous(),
            grad_logits,
            vocab,
            logits.stride(0),
            grad_logits.stride(0),
            float(temperature),
            HAS_LOGPROB_GRAD=grad_logprobs is not None,
            HAS_ENTROPY_GRAD=grad_entropy is not None,
            COMPUTE_DTYPE=triton_compute_dtype(logits.dtype),
            BLOCK=_block(vocab),
            num_warps=_NUM_WARPS,
        )
    return grad_logits
