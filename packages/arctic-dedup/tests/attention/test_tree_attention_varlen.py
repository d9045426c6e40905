"""The varlen backend's decomposition (per-node causal call + per-level cross calls, lse merge, backward with the
merged output and lse) on CPU through a dense stand-in for the flash kernels; the real kernels run in test_gpu."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tree_attention_cases import CPU_CASES, Case, make_inputs

from arctic_dedup.attention import tree_attention, varlen


def _segment_scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:
        visible = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def _expand(k: torch.Tensor, num_heads: int) -> torch.Tensor:
    return k.repeat_interleave(num_heads // k.shape[1], dim=1)


class DenseVarlenKernels:
    """The flash varlen contract in plain torch: forward -> (out, lse [H, total_q], state); backward recomputes the
    probabilities from the lse it is given and uses rowsum(dO * out) of the out it is given, like FlashAttention."""

    @staticmethod
    def _pairs(part: Any) -> list[tuple[int, int, int, int]]:
        cu_q, cu_k = part.cu_seqlens_q.tolist(), part.cu_seqlens_k.tolist()
        return [(cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]) for i in range(len(cu_q) - 1)]

    @classmethod
    def forward(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: Any, scale: float) -> Any:
        heads = q.shape[1]
        out = torch.empty_like(q)
        lse = torch.empty(heads, q.shape[0])
        for q0, q1, k0, k1 in cls._pairs(part):
            scores = _segment_scores(q[q0:q1], _expand(k[k0:k1], heads), scale, part.causal)
            lse[:, q0:q1] = torch.logsumexp(scores, -1)
            probabilities = torch.softmax(scores, -1)
            out[q0:q1] = torch.einsum("hqk,khd->qhd", probabilities, _expand(v[k0:k1], heads).float()).to(q.dtype)
        return out, lse, ()

    @classmethod
    def backward(cls, grad_out, q, k, v, out, lse, part, scale, state) -> Any:  # type: ignore[no-untyped-def]
        heads, group = q.shape[1], q.shape[1] // k.shape[1]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for q0, q1, k0, k1 in cls._pairs(part):
            keys, values = _expand(k[k0:k1], heads).float(), _expand(v[k0:k1], heads).float()
            scores = _segment_scores(q[q0:q1], keys, scale, part.causal)
            probabilities = torch.exp(scores - lse[:, q0:q1, None])
            do = grad_out[q0:q1].float()
            delta = (do * out[q0:q1].float()).sum(-1).t()
            dp = torch.einsum("qhd,khd->hqk", do, values)
            ds = probabilities * (dp - delta[..., None])
            dq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, keys).to(q.dtype) * scale
            dk_full = torch.einsum("hqk,qhd->khd", ds, q[q0:q1].float()) * scale
            dv_full = torch.einsum("hqk,qhd->khd", probabilities, do)
            dk[k0:k1] = dk_full.view(k1 - k0, -1, group, q.shape[2]).sum(2).to(k.dtype)
            dv[k0:k1] = dv_full.view(k1 - k0, -1, group, q.shape[2]).sum(2).to(v.dtype)
        return dq, dk, dv


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_varlen_decomposition_matches_reference(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(varlen, "_kernels", lambda: DenseVarlenKernels)
    plan = case.build()
    q, k, v = make_inputs(plan, 4, 2, 16, requires_grad=True, seed=4)
    out, lse = varlen._VarlenTreeAttention.apply(q, k, v, plan, 0.3)
    ref, ref_lse = tree_attention(q, k, v, plan, backend="reference", scale=0.3, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    expected = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_varlen_rejects_what_it_cannot_do() -> None:
    plan = CPU_CASES[2].build()
    q, k, v = make_inputs(plan, 2, 2, 16)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        tree_attention(q, k, v, plan, backend="varlen", sliding_window=4)
    with pytest.raises(NotImplementedError, match="softcap"):
        tree_attention(q, k, v, plan, backend="varlen", softcap=3.0)
    with pytest.raises(RuntimeError, match="CUDA"):
        tree_attention(q, k, v, plan, backend="varlen")
