"""The ``sdpa`` backend: one-level trees (a prompt and its responses) as dense calls to torch's fused attention
kernels, merged by log-sum-exp.

For every tree of the plan: (A) the prompt's causal self-attention; (B) the queries of all its responses against
the prompt's keys, one non-causal call, since every response sees the whole prompt; (C) each response's causal
self-attention, responses of one length in one batched call. B and C merge by log-sum-exp. All three read views of
the packed stream: no copy of the prompt's K/V per response, and no gather when a tree's responses share a length.
Ragged responses run C as one FlashAttention-2 varlen call over their own rows on CUDA (C is a few percent of the
pairs), and as one padded batch on CPU (padded rows are never seen by real ones and carry zero gradient).
The backward pass gives each part's backward kernel the *merged* output and log-sum-exp, which makes its
probabilities the global ones, so the parts' gradients are exactly pieces of the full gradient and add up.

Kernels: cuDNN's fused attention on CUDA GPUs of compute capability 9.0 or newer (the kernel torch's own
``scaled_dot_product_attention`` picks there, and the one the non-deduplicated baseline runs), torch's bundled
FlashAttention-2 on older CUDA GPUs, and torch's CPU flash kernel on CPU (any float dtype; what the exactness tests
run). Limits: trees of depth 1 (``plan.tree.num_levels <= 2``: the GRPO/PPO layout; tries of shared prefixes go to
``flex``/``triton``), no sliding window, no softcap, no gradient through the returned lse.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import once_differentiable
from torch.utils.weak import WeakTensorKeyDictionary

if TYPE_CHECKING:
    from arctic_dedup.plan import Plan

__all__ = ["build_sdpa_trees", "sdpa_kernel_name", "sdpa_supports", "sdpa_tree_attention"]


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
# The plan as one-level trees (host integers, built once per plan).


@dataclass(frozen=True)
class _Tree:
    """Packed rows of one tree: the prompt ``[prompt_start, prompt_start + prompt_length)`` then its responses,
    contiguous from ``responses_start`` (zero-length responses own no rows and are left out)."""

    prompt_start: int
    prompt_length: int
    responses_start: int
    response_lengths: tuple[int, ...]
    # Ragged responses only: [n, longest] packed rows (padding repeats the response's last row) and, for the
    # [n * longest] padded rows, the flat positions of the real ones in response order.
    padded_rows: torch.Tensor | None
    real_positions: torch.Tensor | None
    # Ragged responses only: int32 offsets of the responses within their rows (FlashAttention varlen on CUDA).
    cu_seqlens: torch.Tensor | None = None

    @property
    def responses_rows(self) -> int:
        return sum(self.response_lengths)


_TREES: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def sdpa_supports(plan: Plan) -> str | None:
    """None when ``backend='sdpa'`` can run this plan, else why not (in words)."""
    if plan.tree.num_levels > 2:
        return (
            f"the plan's trees are {plan.tree.num_levels} levels deep; backend='sdpa' runs prompt + responses trees "
            "(sharing='prompt', or a trie without nested prefixes). Use backend='flex' or 'triton' for tries."
        )
    return None


def _trees(plan: Plan) -> tuple[_Tree, ...]:
    cached = _TREES.get(plan.kv_visible_until)
    if cached is None:
        cached = _TREES[plan.kv_visible_until] = build_sdpa_trees(plan)
    return cached  # type: ignore[no-any-return]


def build_sdpa_trees(plan: Plan) -> tuple[_Tree, ...]:
    """The plan's trees as ``backend='sdpa'`` runs them (host integers; one device sync). Uncached: the backend
    keeps one per plan."""
    problem = sdpa_supports(plan)
    if problem is not None:
        raise NotImplementedError(problem)
    tree = plan.tree
    start, length, parent = torch.stack([tree.node_start, tree.node_length, tree.node_parent]).tolist()
    device = plan.kv_visible_until.device
    trees: list[_Tree] = []
    for root in (node for node in range(len(start)) if parent[node] < 0):
        children = [node for node in range(len(start)) if parent[node] == root and length[node] > 0]
        responses_start = start[root] + length[root]
        lengths = tuple(length[child] for child in children)
        expected = responses_start
        for child in children:
            if start[child] != expected:
                raise NotImplementedError(
                    "backend='sdpa' needs each tree's responses packed contiguously after their prompt; this plan "
                    "interleaves them. Use backend='flex' or 'triton'."
                )
            expected += length[child]
        padded_rows = real_positions = cu_seqlens = None
        if len(set(lengths)) > 1:
            longest = max(lengths)
            offsets = torch.tensor([start[child] for child in children])
            steps = torch.arange(longest)
            lengths_tensor = torch.tensor(lengths)
            padded_rows = (offsets[:, None] + torch.minimum(steps[None, :], lengths_tensor[:, None] - 1)).to(device)
            real = (steps[None, :] < lengths_tensor[:, None]).flatten()
            real_positions = torch.nonzero(real).flatten().to(device)
            cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(device)
        trees.append(
            _Tree(start[root], length[root], responses_start, lengths, padded_rows, real_positions, cu_seqlens)
        )
    return tuple(trees)


# ----------------------------------------------------------------------------------------------------------------
# Ragged responses on CUDA: part C as one FlashAttention-2 varlen call over the responses' own rows (no padding,
# no gather; part C is a few percent of the pairs, so FA2's lower rate than cuDNN's does not matter).


def _ragged_own_varlen(device: torch.device) -> bool:
    return device.type == "cuda"


def _varlen_kernels() -> Any:
    from arctic_dedup.attention.varlen import _TorchFlash

    return _TorchFlash


def _own_segments(tree: _Tree) -> Any:
    from arctic_dedup.attention.varlen import _Segments

    assert tree.cu_seqlens is not None
    longest = max(tree.response_lengths)
    return _Segments(None, None, tree.cu_seqlens, tree.cu_seqlens, longest, longest, True)


# ----------------------------------------------------------------------------------------------------------------
# Views between the packed stream [T, H, D] and the kernels' [B, H, S, D].


def _batch(x: torch.Tensor, start: int, count: int, length: int) -> torch.Tensor:
    """Rows ``[start, start + count * length)`` of ``[T, H, D]`` as ``[count, H, length, D]`` (a view)."""
    return x[start : start + count * length].unflatten(0, (count, length)).transpose(1, 2)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[B * S, H, D]`` (``[B, H, S]`` -> ``[B * S, H]``)."""
    return x.transpose(1, 2).flatten(0, 1)


@dataclass
class _Parts:
    """The three calls of one tree (A prompt, B responses x prompt, C responses x themselves)."""

    prompt: tuple[Any, ...] | None = None
    cross: tuple[Any, ...] | None = None
    own: tuple[Any, ...] | None = None


def _own_inputs(tree: _Tree, x: torch.Tensor) -> torch.Tensor:
    """Part C's ``[n, H, R, D]`` for ``x`` ``[T, H, D]`` (a view, or a padded gather for ragged responses)."""
    if tree.padded_rows is None:
        return _batch(x, tree.responses_start, len(tree.response_lengths), tree.response_lengths[0])
    return x[tree.padded_rows].transpose(1, 2)


def _own_rows(tree: _Tree, x: torch.Tensor) -> torch.Tensor:
    """Part C's ``[n, H, R, ...]`` result back to the responses' packed rows ``[rows, H, ...]``."""
    rows = _rows(x)
    return rows if tree.real_positions is None else rows[tree.real_positions]


def _own_scatter(tree: _Tree, x: torch.Tensor, target: torch.Tensor) -> None:
    """Add part C's key/value gradient ``[n, H, R, D]`` into the packed ``target`` rows."""
    if tree.padded_rows is None:
        target[tree.responses_start : tree.responses_start + tree.responses_rows] += _rows(x)
    else:
        target.index_add_(0, tree.padded_rows.flatten(), _rows(x))


def _merge_eager(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint keys -> the attention over both: ``[rows, H, D]`` outputs weighted by
    ``exp(lse_part - lse_total)`` in fp32, and ``lse_total`` ``[rows, H]`` fp32."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    total = torch.logaddexp(lse_a, lse_b)
    merged = out_a.float() * torch.exp(lse_a - total).unsqueeze(-1)
    merged = merged + out_b.float() * torch.exp(lse_b - total).unsqueeze(-1)
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


def _own_backward(
    tree: _Tree,
    kernel: _Kernel,
    ctx: Any,
    state: tuple[Any, ...],
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> torch.Tensor:
    """Part C's backward through the dense kernel (views, or the padded batch); adds into dk/dv, returns the
    responses' dq rows."""
    r0 = tree.responses_start
    if tree.padded_rows is None:
        lse_own = _batch(lse.unsqueeze(-1), r0, len(tree.response_lengths), tree.response_lengths[0])
        lse_own = lse_own.squeeze(-1).contiguous()
    else:
        lse_own = lse[tree.padded_rows].transpose(1, 2).contiguous()
    grad_own = _own_inputs(tree, grad_out)
    if tree.padded_rows is not None:
        # Padded query rows: zero upstream gradient, so they add nothing to any gradient.
        padding = torch.ones(grad_own.shape[0] * grad_own.shape[2], dtype=torch.bool, device=query.device)
        padding[tree.real_positions] = False
        grad_own = grad_own.masked_fill(padding.view(grad_own.shape[0], 1, -1, 1), 0)
    g_q, g_k, g_v = kernel.backward(
        grad_own, _own_inputs(tree, query), _own_inputs(tree, key), _own_inputs(tree, value),
        _own_inputs(tree, out), lse_own, True, ctx.scale, state,
    )  # fmt: skip
    _own_scatter(tree, g_k, dk)
    _own_scatter(tree, g_v, dv)
    return _own_rows(tree, g_q)


class _SdpaTreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        plan: Plan,
        scale: float,
        deterministic: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kernel = _kernel_for(query.device, deterministic)
        trees = _trees(plan)
        out = torch.empty_like(query)
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        states: list[_Parts] = []
        for tree in trees:
            parts = _Parts()
            p0, p1 = tree.prompt_start, tree.prompt_start + tree.prompt_length
            if tree.prompt_length:
                o, s, parts.prompt = kernel.forward(
                    _batch(query, p0, 1, p1 - p0), _batch(key, p0, 1, p1 - p0), _batch(value, p0, 1, p1 - p0),
                    True, scale,
                )  # fmt: skip
                out[p0:p1] = _rows(o)
                lse[p0:p1] = _rows(s)
            if tree.response_lengths:
                r0, r1 = tree.responses_start, tree.responses_start + tree.responses_rows
                if tree.padded_rows is not None and _ragged_own_varlen(query.device):
                    o_own, s_own, parts.own = _varlen_kernels().forward(
                        *(x[r0:r1].contiguous() for x in (query, key, value)), _own_segments(tree), scale
                    )
                    s_own = s_own.t().float()
                else:
                    o_own, s_own, parts.own = kernel.forward(
                        _own_inputs(tree, query), _own_inputs(tree, key), _own_inputs(tree, value), True, scale
                    )
                    o_own, s_own = _own_rows(tree, o_own), _own_rows(tree, s_own).float()
                if tree.prompt_length:
                    o_cross, s_cross, parts.cross = kernel.forward(
                        _batch(query, r0, 1, r1 - r0), _batch(key, p0, 1, p1 - p0), _batch(value, p0, 1, p1 - p0),
                        False, scale,
                    )  # fmt: skip
                    merged, total = _merge(_rows(o_cross), _rows(s_cross), o_own, s_own)
                    out[r0:r1] = merged
                    lse[r0:r1] = total
                else:
                    out[r0:r1] = o_own
                    lse[r0:r1] = s_own
            states.append(parts)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan, ctx.scale, ctx.states, ctx.kernel, ctx.deterministic = plan, scale, states, kernel, deterministic
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        if grad_lse is not None and bool(grad_lse.ne(0).any()):
            raise NotImplementedError(
                "backend='sdpa' does not propagate gradients through the returned lse; use 'triton', 'flex' or "
                "'reference' when the loss depends on the lse."
            )
        if grad_out is None:
            return None, None, None, None, None, None
        with _deterministic_algorithms(ctx.deterministic):
            return _SdpaTreeAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        kernel = ctx.kernel
        grad_out = grad_out.contiguous()
        dq = torch.empty_like(query)
        dk = torch.zeros_like(key)
        dv = torch.zeros_like(value)
        for tree, parts in zip(_trees(ctx.plan), ctx.states):
            p0, p1 = tree.prompt_start, tree.prompt_start + tree.prompt_length

            def batch(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
                return _batch(x, start, 1, stop - start)

            def batch_lse(start: int, stop: int) -> torch.Tensor:
                return lse[start:stop].t().unsqueeze(0).contiguous()

            if tree.prompt_length:
                g_q, g_k, g_v = kernel.backward(
                    batch(grad_out, p0, p1), batch(query, p0, p1), batch(key, p0, p1), batch(value, p0, p1),
                    batch(out, p0, p1), batch_lse(p0, p1), True, ctx.scale, parts.prompt,
                )  # fmt: skip
                dq[p0:p1] = _rows(g_q)
                dk[p0:p1] += _rows(g_k)
                dv[p0:p1] += _rows(g_v)
            if not tree.response_lengths:
                continue
            r0, r1 = tree.responses_start, tree.responses_start + tree.responses_rows
            if tree.padded_rows is not None and _ragged_own_varlen(query.device):
                g_q, g_k, g_v = _varlen_kernels().backward(
                    *(x[r0:r1].contiguous() for x in (grad_out, query, key, value, out)),
                    lse[r0:r1].t().contiguous(), _own_segments(tree), ctx.scale, parts.own,
                )  # fmt: skip
                dq_responses = g_q
                dk[r0:r1] += g_k
                dv[r0:r1] += g_v
            else:
                dq_responses = _own_backward(
                    tree, kernel, ctx, parts.own, grad_out, query, key, value, out, lse, dk, dv
                )
            if tree.prompt_length:
                g_q, g_k, g_v = kernel.backward(
                    batch(grad_out, r0, r1), batch(query, r0, r1), batch(key, p0, p1), batch(value, p0, p1),
                    batch(out, r0, r1), batch_lse(r0, r1), False, ctx.scale, parts.cross,
                )  # fmt: skip
                torch.add(dq_responses, _rows(g_q), out=dq[r0:r1])
                dk[p0:p1] += _rows(g_k)
                dv[p0:p1] += _rows(g_v)
            else:
                dq[r0:r1] = dq_responses
        return dq, dk, dv, None, None, None


def sdpa_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: Plan,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[T, Hq, D]``, lse ``[T, Hq]`` fp32); see the module docstring for what is supported.
    ``deterministic`` (or ``torch.use_deterministic_algorithms``): FlashAttention-2's deterministic backward on CUDA
    instead of cuDNN's (the CPU kernel is deterministic anyway)."""
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
    problem = sdpa_supports(plan)
    if problem is not None:
        raise NotImplementedError(problem)
    result: tuple[torch.Tensor, torch.Tensor] = _SdpaTreeAttention.apply(query, key, value, plan, scale, deterministic)
    return result
