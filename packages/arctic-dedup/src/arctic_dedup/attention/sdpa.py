"""The ``sdpa`` backend: the plan's trees as dense calls to torch's fused attention kernels, merged by log-sum-exp.

A query sees its own node causally and every ancestor node whole. So the tree splits into dense problems, each one
call on views of the packed stream (nodes are in preorder, which is the packed order): every node's causal
self-attention (consecutive nodes without descendant tokens, e.g. the responses of a prompt, in one batched call),
and for every node with descendants, the queries of all its descendants (contiguous rows) against the node's keys,
one non-causal call. For the GRPO/PPO layout (a prompt and its responses) that is three calls per tree: (A) the
prompt, causal; (B) all its responses against the prompt, so the prompt's K/V are read once per tree, not once per
response; (C) the responses, causal, as a batch: a view when they share a length; ragged ones as one
FlashAttention-2 varlen call over their rows on CUDA (C is a few percent of the pairs) and a padded batch on CPU
(padded rows are never seen by real ones and carry zero gradient). Partial results merge by log-sum-exp (in fp32;
rows merged more than once, in deeper trees, accumulate in fp32 and are rounded once). The backward pass gives
each call's backward kernel the *merged* output and log-sum-exp, which makes its probabilities the global ones, so
the calls' gradients are exact pieces of the full gradient and add up.

Kernels: cuDNN's fused attention on CUDA GPUs of compute capability 9.0 or newer (the kernel torch's own
``scaled_dot_product_attention`` picks there, and the one the non-deduplicated baseline runs), torch's bundled
FlashAttention-2 on older CUDA GPUs and whenever the backward must be deterministic, and torch's CPU flash kernel on
CPU (any float dtype; what the exactness tests run). Limits: no sliding window, no softcap, no gradient through the
returned lse; bf16/fp16 on CUDA. Calls grow with the number of inner nodes, so ``auto`` uses this backend for
prompt trees (measured) and leaves deeper tries to FlexAttention and Triton.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from arctic_dedup.attention._no_lse_grad import NoLseGradientFunction
from arctic_dedup.attention.metadata import TreeAttentionMetadata
from arctic_dedup.attention.sdpa_calls import SdpaRun
from arctic_dedup.attention.varlen import _Segments, _TorchFlash
from arctic_dedup.lse import merge_attention_states

__all__ = ["sdpa_kernel_name", "sdpa_tree_attention"]


# ----------------------------------------------------------------------------------------------------------------
# Dense kernels: [B, H, S, D] views in, (out [B, H, S, D], lse [B, H, S] fp32 natural log, state) out.


class _CpuFlash:
    name = "cpu_flash"

    @staticmethod
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()

    @staticmethod
    def backward(
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
        state: tuple[Any, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        del state
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return dq, dk, dv


class _Cudnn:
    name = "cudnn"

    @staticmethod
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:
        result = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        out, lse = result[0], result[1]
        return out, lse.reshape(lse.shape[0], lse.shape[1], lse.shape[2]), tuple(result[2:8])

    @staticmethod
    def backward(
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
        state: tuple[Any, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cum_q, cum_k, max_q, max_k, seed, offset = state
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal,
            scale=scale,
        )  # fmt: skip
        return dq, dk, dv


class _CudaFlash:
    """torch's bundled FlashAttention-2 (dense mode of the op ``backend='varlen'`` uses; ``[B, S, H, D]``)."""

    name = "flash"

    @staticmethod
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        result = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False, scale=scale
        )
        return result[0].transpose(1, 2), result[1], (result[2], result[3])

    @staticmethod
    def backward(
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
        state: tuple[Any, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        grad_out, q, k, v, out = (x.transpose(1, 2) for x in (grad_out, q, k, v, out))
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], 0.0, causal, state[0], state[1],
            scale=scale,
        )  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


_Kernel = type[_CpuFlash] | type[_Cudnn] | type[_CudaFlash]


def _kernel_for(device: torch.device, deterministic: bool = False) -> _Kernel:
    if device.type == "cpu":
        return _CpuFlash
    # cuDNN's backward accumulates dQ with atomics; FlashAttention-2 has a deterministic backward.
    if deterministic or torch.are_deterministic_algorithms_enabled():
        return _CudaFlash
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        return _Cudnn
    return _CudaFlash


@contextlib.contextmanager
def _deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """torch's kernels read determinism from the global flag: set it (not warn-only) for the duration."""
    if not enabled:
        yield
        return
    previous, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=warn_only)


def sdpa_kernel_name(device: torch.device) -> str:
    """Which dense kernel ``backend='sdpa'`` runs on ``device``: ``"cudnn"``, ``"flash"`` or ``"cpu_flash"``."""
    return _kernel_for(device).name


# ----------------------------------------------------------------------------------------------------------------
# Views between the packed stream [T, H, D] and the kernels' [B, H, S, D].


def _batch(x: torch.Tensor, start: int, count: int, length: int) -> torch.Tensor:
    """Rows ``[start, start + count * length)`` of ``[T, H, D]`` as ``[count, H, length, D]`` (a view)."""
    return x[start : start + count * length].unflatten(0, (count, length)).transpose(1, 2)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[B * S, H, D]`` (``[B, H, S]`` -> ``[B * S, H]``)."""
    return x.transpose(1, 2).flatten(0, 1)


def _one(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` as one sequence ``[1, H, stop - start, D]``."""
    return _batch(x, start, 1, stop - start)


def _run_inputs(run: SdpaRun, x: torch.Tensor) -> torch.Tensor:
    """A run's ``[n, H, L, ...]`` batch of ``x`` ``[T, H, ...]``: a view, or the padded gather of a ragged run."""
    if run.padded_rows is None:
        return _batch(x, run.start, len(run.lengths), run.lengths[0])
    return x[run.padded_rows].transpose(1, 2)


def _run_rows(run: SdpaRun, x: torch.Tensor) -> torch.Tensor:
    """A run's ``[n, H, L, ...]`` result back to its packed rows ``[rows, H, ...]``."""
    rows = _rows(x)
    return rows if run.real_positions is None else rows[run.real_positions]


def _run_segments(run: SdpaRun) -> _Segments:
    assert run.cu_seqlens is not None
    longest = max(run.lengths)
    return _Segments(None, None, run.cu_seqlens, run.cu_seqlens, longest, longest, True)


def _run_forward(
    run: SdpaRun, kernel: _Kernel, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:
    """(out rows ``[rows, H, D]``, lse rows ``[rows, H]`` fp32, kernel state) of a run's causal self-attention."""
    if run.cu_seqlens is not None:
        q, k, v = (x[run.start : run.stop].contiguous() for x in (query, key, value))
        out, lse, state = _TorchFlash.forward(q, k, v, _run_segments(run), scale)
        return out, lse.t().float(), state
    out, lse, state = kernel.forward(
        _run_inputs(run, query), _run_inputs(run, key), _run_inputs(run, value), True, scale
    )
    return _run_rows(run, out), _run_rows(run, lse).float(), state


def _run_backward(
    run: SdpaRun, kernel: _Kernel, saved: tuple[torch.Tensor, ...], grad_out: torch.Tensor, scale: float, state: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A run's (dq, dk, dv) rows ``[rows, H, D]`` (its rows only: a run's keys are its own rows)."""
    query, key, value, out, lse = saved
    r0, r1 = run.start, run.stop
    if run.cu_seqlens is not None:
        g, q, k, v, o = (x[r0:r1].contiguous() for x in (grad_out, query, key, value, out))
        dq, dk, dv = _TorchFlash.backward(g, q, k, v, o, lse[r0:r1].t().contiguous(), _run_segments(run), scale, state)
        return dq, dk, dv
    grad_run = _run_inputs(run, grad_out)
    if run.padded_rows is None:
        lse_run = _batch(lse.unsqueeze(-1), r0, len(run.lengths), run.lengths[0]).squeeze(-1).contiguous()
    else:
        lse_run = lse[run.padded_rows].transpose(1, 2).contiguous()
        # Padded query rows: zero upstream gradient, so they add nothing to any gradient.
        padding = torch.ones(grad_run.shape[0] * grad_run.shape[2], dtype=torch.bool, device=query.device)
        padding[run.real_positions] = False
        grad_run = grad_run.masked_fill(padding.view(grad_run.shape[0], 1, -1, 1), 0)
    g_q, g_k, g_v = kernel.backward(
        grad_run, _run_inputs(run, query), _run_inputs(run, key), _run_inputs(run, value), _run_inputs(run, out),
        lse_run, True, scale, state,
    )  # fmt: skip
    if run.padded_rows is None:
        return _rows(g_q), _rows(g_k), _rows(g_v)
    flat = run.padded_rows.flatten() - r0
    dk = torch.zeros((r1 - r0, *key.shape[1:]), dtype=g_k.dtype, device=key.device).index_add_(0, flat, _rows(g_k))
    dv = torch.zeros((r1 - r0, *value.shape[1:]), dtype=g_v.dtype, device=value.device).index_add_(0, flat, _rows(g_v))
    return _run_rows(run, g_q), dk, dv


def _merge_eager(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_attention_states``, its output rounded to ``out_a``'s dtype (fp32 targets stay fp32)."""
    merged, total = merge_attention_states(out_a, lse_a, out_b, lse_b)
    return merged.to(out_a.dtype), total


_compiled_merge: Any = None
_merge_compile_failed = False


def _merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_merge_eager``; on CUDA compiled into one fused kernel (eager makes ~1 GB of fp32 temporaries per layer at
    16K tokens; compiled it reads both partials once and writes the result once). Falls back to eager for good if
    compilation fails, with a warning."""
    global _compiled_merge, _merge_compile_failed
    if not out_a.is_cuda or _merge_compile_failed:
        return _merge_eager(out_a, lse_a, out_b, lse_b)
    try:
        if _compiled_merge is None:
            _compiled_merge = torch.compile(_merge_eager, dynamic=True, fullgraph=True)
        result: tuple[torch.Tensor, torch.Tensor] = _compiled_merge(out_a, lse_a, out_b, lse_b)
        return result
    except Exception as error:  # compilation problems must not stop training: the eager merge is exact too
        _merge_compile_failed = True
        warnings.warn(f"tree attention 'sdpa': compiled merge failed ({error}); using the eager merge", stacklevel=2)
        return _merge_eager(out_a, lse_a, out_b, lse_b)


class _SdpaTreeAttention(NoLseGradientFunction):
    BACKEND = "sdpa"

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: TreeAttentionMetadata,
        scale: float,
        deterministic: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kernel = _kernel_for(query.device, deterministic)
        calls = metadata.calls()
        out = torch.empty_like(query)
        # Rows merged more than once (trees deeper than prompt + responses) accumulate in fp32, rounded once.
        target = out if calls.max_crosses_per_row <= 1 else torch.empty_like(query, dtype=torch.float32)
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        run_states: list[Any] = []
        for run in calls.runs:  # every row belongs to exactly one run
            rows_out, rows_lse, state = _run_forward(run, kernel, query, key, value, scale)
            target[run.start : run.stop] = rows_out
            lse[run.start : run.stop] = rows_lse
            run_states.append(state)
        cross_states: list[Any] = []
        for cross in calls.crosses:
            q0, q1, k0, k1 = cross.query_start, cross.query_stop, cross.key_start, cross.key_stop
            o, s, state = kernel.forward(_one(query, q0, q1), _one(key, k0, k1), _one(value, k0, k1), False, scale)
            merged, total = _merge(target[q0:q1], lse[q0:q1], _rows(o), _rows(s))
            target[q0:q1] = merged
            lse[q0:q1] = total
            cross_states.append(state)
        if target is not out:
            out.copy_(target)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.calls, ctx.scale, ctx.kernel, ctx.deterministic = calls, scale, kernel, deterministic
        ctx.run_states, ctx.cross_states = run_states, cross_states
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def output_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with _deterministic_algorithms(ctx.deterministic):
            return _SdpaTreeAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = tuple(ctx.saved_tensors)
        query, key, value, out, lse = saved
        kernel, calls = ctx.kernel, ctx.calls
        grad_out = grad_out.contiguous()
        # Each run writes its own rows first (the runs cover every row once); the cross calls then add.
        dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        for run, state in zip(calls.runs, ctx.run_states):
            g_q, g_k, g_v = _run_backward(run, kernel, saved, grad_out, ctx.scale, state)
            dq[run.start : run.stop] = g_q
            dk[run.start : run.stop] = g_k
            dv[run.start : run.stop] = g_v
        for cross, state in zip(calls.crosses, ctx.cross_states):
            q0, q1, k0, k1 = cross.query_start, cross.query_stop, cross.key_start, cross.key_stop
            g_q, g_k, g_v = kernel.backward(
                _one(grad_out, q0, q1), _one(query, q0, q1), _one(key, k0, k1), _one(value, k0, k1),
                _one(out, q0, q1), lse[q0:q1].t().unsqueeze(0).contiguous(), False, ctx.scale, state,
            )  # fmt: skip
            dq[q0:q1] += _rows(g_q)
            dk[k0:k1] += _rows(g_k)
            dv[k0:k1] += _rows(g_v)
        return dq, dk, dv, None, None, None


def sdpa_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    metadata: TreeAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[T, Hq, D]``, lse ``[T, Hq]`` fp32); see the module docstring for what is supported.
    ``metadata``: ``prepare_tree_attention(plan, backends=("sdpa",), ...)``. ``deterministic`` (or
    ``torch.use_deterministic_algorithms``): FlashAttention-2's deterministic backward on CUDA instead of cuDNN's
    (the CPU kernel is deterministic anyway)."""
    if sliding_window is not None or softcap is not None:
        raise NotImplementedError(
            "backend='sdpa' supports neither sliding_window nor softcap (torch's fused kernels take neither here); "
            "use backend='triton' or 'flex'."
        )
    if query.is_cuda and query.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(
            f"backend='sdpa' on CUDA (cuDNN / FlashAttention-2 kernels) takes float16 or bfloat16, got {query.dtype}; "
            "use backend='flex' or 'triton' for float32."
        )
    result: tuple[torch.Tensor, torch.Tensor] = _SdpaTreeAttention.apply(
        query, key, value, metadata, scale, deterministic
    )
    return result
