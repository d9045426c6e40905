# mypy: disable-error-code="no-untyped-def"
"""Triton kernels of the log-prob chunk math (``@triton.jit`` code only; launchers in ``logprobs.py``).

One program per token row streams the row's logits in ``BLOCK``-wide slices: the forward keeps a running max, sum of
exponentials and (for the entropy) exponential-weighted sum of logits per lane and combines the lanes at the end;
the backward writes the logits' gradient in one pass from the saved log-normalizer.
"""

from __future__ import annotations

import triton
import triton.language as tl

from arctic_zorro_train.kernels._rounding import cast_rounded


@triton.jit
def _logprob_forward_kernel(
    logits_ptr,
    labels_ptr,
    logprobs_ptr,
    log_normalizer_ptr,
    entropy_ptr,
    vocab,
    row_stride,
    temperature,
    WITH_ENTROPY: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * row_stride
    lanes = tl.arange(0, BLOCK)
    running_max = tl.full([BLOCK], float("-inf"), COMPUTE_DTYPE)
    exp_sum = tl.zeros([BLOCK], COMPUTE_DTYPE)
    weighted_sum = tl.zeros([BLOCK], COMPUTE_DTYPE)
    for start in range(0, vocab, BLOCK):
        columns = start + lanes
        valid = columns < vocab
        scaled = tl.load(row_logits + columns, mask=valid, other=0.0).to(COMPUTE_DTYPE) / temperature
        new_max = tl.where(valid, tl.maximum(running_max, scaled), running_max)
        # A lane whose values so far are all -inf (none seen yet, or masked logits) keeps max -inf. Subtracting a
        # finite stand-in instead gives exp(-inf) = 0 for both factors: exp(-inf - -inf) would be NaN, and a NaN
        # weight of a valid lane would reach the row's sum.
        finite_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(running_max - finite_max)
        weight = tl.where(valid, tl.exp(scaled - finite_max), 0.0)
        exp_sum = exp_sum * rescale + weight
        if WITH_ENTROPY:
            # A -inf logit has weight 0 and adds nothing (0 * -inf would be NaN).
            weighted_sum = weighted_sum * rescale + weight * tl.where(weight > 0.0, scaled, 0.0)
        running_max = new_max
    row_max = tl.max(running_max, axis=0)
    lane_scale = tl.exp(running_max - row_max)
    total = tl.sum(exp_sum * lane_scale, axis=0)
    log_normalizer = row_max + tl.log(total)
    label = tl.load(labels_ptr + row)
    label_logit = tl.load(row_logits + label).to(COMPUTE_DTYPE) / temperature
    tl.store(logprobs_ptr + row, label_logit - log_normalizer)
    tl.store(log_normalizer_ptr + row, log_normalizer)
    if WITH_ENTROPY:
        # H = log Z - sum_v p_v z_v
        tl.store(entropy_ptr + row, log_normalizer - tl.sum(weighted_sum * lane_scale, axis=0) / total)


@triton.jit
def _logprob_backward_kernel(
    logits_ptr,
    labels_ptr,
    log_normalizer_ptr,
    entropy_ptr,
    grad_logprobs_ptr,
    grad_entropy_ptr,
    grad_logits_ptr,
    vocab,
    row_stride,
    grad_row_stride,
    temperature,
    HAS_LOGPROB_GRAD: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * row_stride
    row_grad = grad_logits_ptr + row * grad_row_stride
    lanes = tl.arange(0, BLOCK)
    log_normalizer = tl.load(log_normalizer_ptr + row)
    label = tl.load(labels_ptr + row)
    grad_logprob = tl.zeros([], COMPUTE_DTYPE)
    if HAS_LOGPROB_GRAD:
        grad_logprob = tl.load(grad_logprobs_ptr + row).to(COMPUTE_DTYPE)
    grad_entropy = tl.zeros([], COMPUTE_DTYPE)
    entropy = tl.zeros([], COMPUTE_DTYPE)
    if HAS_ENTROPY_GRAD:
        grad_entropy = tl.load(grad_entropy_ptr + row).to(COMPUTE_DTYPE)
        entropy = tl.load(entropy_ptr + row).to(COMPUTE_DTYPE)
    for start in range(0, vocab, BLOCK):
        columns = start + lanes
        valid = columns < vocab
        scaled = tl.load(row_logits + columns, mask=valid, other=0.0).to(COMPUTE_DTYPE) / temperature
        log_p = scaled - log_normalizer
        p = tl.exp(log_p)
        # d logprob / dz = onehot(label) - p;  dH / dz = -p (log p + H)
        grad = tl.where(columns == label, grad_logprob, 0.0) - grad_logprob * p
        if HAS_ENTROPY_GRAD:
            # p log p -> 0 as p -> 0: a -inf logit contributes nothing (0 * -inf would be NaN).
            grad = grad - grad_entropy * p * (tl.where(p > 0.0, log_p, 0.0) + entropy)
        grad = grad / temperature
        tl.store(row_grad + columns, cast_rounded(grad, grad_logits_ptr.dtype.element_ty), mask=valid)
