"""The ``varlen`` backend: flash-attention varlen calls over the plan's node segments, merged by log-sum-exp.

One causal call runs every node's self-attention (``plan.varlen.cu_seqlens_nodes``); one non-causal call per tree
depth lets the queries of each node's subtree attend to that node's tokens (``plan.varlen.cross_levels``). Each
query's partial results merge by log-sum-exp. The backward pass calls the flash backward kernel once per part with
the *merged* output and log-sum-exp, which makes each part's probabilities the global ones, so the per-part
gradients are exactly the pieces of the full gradient (dQ and dK/dV are summed over the parts).

Kernels: the ``flash_attn`` package's varlen kernels when it is installed, otherwise the same FlashAttention-2
kernels that torch ships (``torch.ops.aten._flash_attention_forward``, which also backs
``torch.nn.attention.varlen.varlen_attn``). CUDA only; bf16/fp16; no softcap or sliding window (a window measured
in logical positions cannot be expressed per varlen call once queries of several branches share a call).
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import once_differentiable

from arctic_dedup.attention._no_lse_grad import NoLseGradientFunction
from arctic_dedup.lse import merge_attention_states

if TYPE_CHECKING:
    from arctic_dedup.plan import Plan

__all__ = ["varlen_available", "varlen_kernel_source", "varlen_tree_attention"]


def varlen_kernel_source() -> str:
    """``"flash_attn"`` when that package is importable, else ``"torch"`` (torch's bundled FlashAttention-2)."""
    return "flash_attn" if importlib.util.find_spec("flash_attn") is not None else "torch"


def varlen_available() -> bool:
    return torch.cuda.is_available() and (
        varlen_kernel_source() == "flash_attn" or hasattr(torch.ops.aten, "_flash_attention_forward")
    )


@dataclass(frozen=True)
class _Segments:
    """One varlen call: query rows (None = all, in order), key rows (None = all), cu_seqlens and max lengths."""

    query_index: torch.Tensor | None
    key_index: torch.Tensor | None
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool


def _segments(plan: Plan) -> list[_Segments]:
    varlen = plan.varlen
    cu_nodes = varlen.cu_seqlens_nodes.to(torch.int32)
    parts = [_Segments(None, None, cu_nodes, cu_nodes, varlen.max_seqlen_nodes, varlen.max_seqlen_nodes, True)]
    for level in varlen.cross_levels:
        parts.append(
            _Segments(
                level.query_index,
                level.key_index,
                level.cu_seqlens_q.to(torch.int32),
                level.cu_seqlens_k.to(torch.int32),
                level.max_seqlen_q,
                level.max_seqlen_k,
                False,
            )
        )
    return parts


class _TorchFlash:
    """torch's bundled FlashAttention-2 varlen kernels (aten ops; lse ``[H, total_q]``)."""

    @staticmethod
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: _Segments, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:
        result = torch.ops.aten._flash_attention_forward(
            q, k, v, part.cu_seqlens_q, part.cu_seqlens_k, part.max_seqlen_q, part.max_seqlen_k, 0.0, part.causal,
            False, scale=scale,
        )  # fmt: skip
        return result[0], result[1], (result[2], result[3])

    @staticmethod
    @once_differentiable
    def backward(
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        part: _Segments,
        scale: float,
        state: tuple[Any, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out, q, k, v, out, lse, part.cu_seqlens_q, part.cu_seqlens_k, part.max_seqlen_q, part.max_seqlen_k,
            0.0, part.causal, state[0], state[1], scale=scale,
        )  # fmt: skip
        return dq, dk, dv


class _FlashAttnPackage:
    """The ``flash_attn`` package's private varlen forward/backward (their arguments changed across 2.x releases,
    so they are passed by name after reading the installed signature)."""

    @staticmethod
    def _window_kwargs(function: Any) -> dict[str, Any]:
        names = inspect.signature(function).parameters
        if "window_size_left" in names:
            return {"window_size_left": -1, "window_size_right": -1}
        return {"window_size": (-1, -1)} if "window_size" in names else {}

    @staticmethod
    def _optional_kwargs(function: Any, **candidates: Any) -> dict[str, Any]:
        names = inspect.signature(function).parameters
        return {name: value for name, value in candidates.items() if name in names}

    @classmethod
    def forward(
        cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: _Segments, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:
        from flash_attn import flash_attn_interface

        function = flash_attn_interface._flash_attn_varlen_forward
        result = function(
            q,
            k,
            v,
            part.cu_seqlens_q,
            part.cu_seqlens_k,
            part.max_seqlen_q,
            part.max_seqlen_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=part.causal,
            **cls._window_kwargs(function),
            **cls._optional_kwargs(function, softcap=0.0, alibi_slopes=None, return_softmax=False),
        )
        # Newer releases return (out, lse, S_dmask, rng_state); older ones (out, q, k, v, out_padded, lse, ...).
        if len(result) >= 8:
            return result[0], result[5], (result[-1],)
        return result[0], result[1], (result[-1],)

    @classmethod
    def backward(
        cls,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        part: _Segments,
        scale: float,
        state: tuple[Any, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from flash_attn import flash_attn_interface

        function = flash_attn_interface._flash_attn_varlen_backward
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        function(
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            dq,
            dk,
            dv,
            part.cu_seqlens_q,
            part.cu_seqlens_k,
            part.max_seqlen_q,
            part.max_seqlen_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=part.causal,
            **cls._window_kwargs(function),
            **cls._optional_kwargs(
                function,
                softcap=0.0,
                alibi_slopes=None,
                deterministic=torch.are_deterministic_algorithms_enabled(),
                rng_state=state[0],
            ),
        )
        return dq, dk, dv


def _kernels() -> type[_TorchFlash] | type[_FlashAttnPackage]:
    return _FlashAttnPackage if varlen_kernel_source() == "flash_attn" else _TorchFlash


def _rows(tensor: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return tensor if index is None else tensor.index_select(0, index)


def _lse_rows(lse: torch.Tensor, num_heads: int, num_rows: int) -> torch.Tensor:
    """The kernels' lse ``[H, rows]`` -> ``[rows, H]`` fp32 (and a clear error on an unexpected layout)."""
    if tuple(lse.shape) != (num_heads, num_rows):
        raise RuntimeError(
            f"the varlen kernel returned a log-sum-exp of shape {tuple(lse.shape)}, expected [H, total_q] = "
            f"{(num_heads, num_rows)}; this torch/flash_attn version is not supported by backend='varlen'."
        )
    return lse.t().float()


class _VarlenTreeAttention(NoLseGradientFunction):
    BACKEND = "varlen"

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: Plan, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kernels = _kernels()
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        num_heads = query.shape[1]
        parts = _segments(plan)
        outputs: list[torch.Tensor] = []
        lses: list[torch.Tensor] = []
        states: list[tuple[Any, ...]] = []
        for part in parts:
            q = _rows(query, part.query_index)
            out, lse, state = kernels.forward(q, _rows(key, part.key_index), _rows(value, part.key_index), part, scale)
            outputs.append(out)
            lses.append(_lse_rows(lse, num_heads, q.shape[0]))
            states.append(state)
        # Fold every cross part into the rows it covers (node self-attention covers every row once).
        merged, total = outputs[0].float(), lses[0].clone()
        for part, out, lse in zip(parts[1:], outputs[1:], lses[1:]):
            assert part.query_index is not None
            rows = part.query_index
            merged[rows], total[rows] = merge_attention_states(merged[rows], total[rows], out, lse)
        result = merged.to(query.dtype)
        ctx.save_for_backward(query, key, value, result, total)
        ctx.plan = plan
        ctx.scale = scale
        ctx.states = states
        ctx.set_materialize_grads(False)
        return result, total

    @staticmethod
    def output_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, total = ctx.saved_tensors
        kernels = _kernels()
        grad_out = grad_out.contiguous()
        dq = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        dk = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
        dv = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
        for part, state in zip(_segments(ctx.plan), ctx.states):
            rows = part.query_index
            lse = _rows(total, rows).t().contiguous()
            part_dq, part_dk, part_dv = kernels.backward(
                _rows(grad_out, rows),
                _rows(query, rows),
                _rows(key, part.key_index),
                _rows(value, part.key_index),
                _rows(out, rows),
                lse,
                part,
                ctx.scale,
                state,
            )
            if rows is None:
                dq += part_dq.float()
            else:
                dq.index_add_(0, rows, part_dq.float())
            if part.key_index is None:
                dk += part_dk.float()
                dv += part_dv.float()
            else:
                dk.index_add_(0, part.key_index, part_dk.float())
                dv.index_add_(0, part.key_index, part_dv.float())
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None


def varlen_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: Plan,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[T, Hq, D]``, lse ``[T, Hq]`` fp32); see the module docstring for what is supported."""
    if sliding_window is not None or softcap is not None:
        raise NotImplementedError(
            "backend='varlen' supports neither sliding_window nor softcap (a window in logical positions does not "
            "map onto per-level varlen calls); use backend='triton' or 'flex' (or 'auto', which never picks varlen)."
        )
    if not query.is_cuda:
        raise RuntimeError(f"backend='varlen' needs CUDA tensors, got {query.device}; use 'flex' or 'reference'.")
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(
            f"backend='varlen' (FlashAttention-2 kernels) takes float16 or bfloat16, got {query.dtype}; use "
            "backend='triton' for float32."
        )
    if not varlen_available():
        raise RuntimeError("backend='varlen' needs torch's flash-attention kernels or the `flash_attn` package.")
    result: tuple[torch.Tensor, torch.Tensor] = _VarlenTreeAttention.apply(query, key, value, plan, scale)
    return result
