"""The public function: argument checks, the auto rule, exports, and branch isolation for every CPU backend."""

from __future__ import annotations

import pytest
import torch
from tree_attention_cases import CPU_CASES, deep_trie_plan, make_inputs

import arctic_dedup.attention as attention
from arctic_dedup import PlanError
from arctic_dedup.attention import (
    MAX_REFERENCE_SCORES,
    TreeAttentionBackend,
    choose_backend,
    prepare_tree_attention,
    tree_attention,
)

EXPORTED = [
    "BACKENDS",
    "MAX_REFERENCE_SCORES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "ConcreteBackend",
    "TreeAttentionBackend",
    "TreeAttentionMetadata",
    "auto_backends",
    "choose_backend",
    "prepare_tree_attention",
    "reference_mask",
    "tree_attention",
    "tree_attention_reference",
]


def test_exported_names() -> None:
    assert sorted(attention.__all__) == sorted(EXPORTED)
    for name in EXPORTED:
        assert hasattr(attention, name)


def test_returns_output_and_lse() -> None:
    plan = CPU_CASES[2].build()
    q, k, v = make_inputs(plan, 4, 2, 16, torch.bfloat16)
    out = tree_attention(q, k, v, plan, backend="reference")
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == torch.bfloat16
    out, lse = tree_attention(q, k, v, plan, backend="reference", return_lse=True)
    assert lse.shape == (plan.num_packed_tokens, 4) and lse.dtype == torch.float32


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda q, k, v: (q[:-1], k, v), PlanError, "plan packs"),
        (lambda q, k, v: (q, k[:-1], v[:-1]), PlanError, "plan packs"),
        (lambda q, k, v: (q, k, v[:, :, :8]), ValueError, "same"),
        (lambda q, k, v: (q[None], k, v), ValueError, r"\[T, H, D\]"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, "multiple"),
        (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, "bfloat16"),
        (lambda q, k, v: (q.half(), k, v), TypeError, "share a dtype"),
        (lambda q, k, v: (q[..., :8], k[..., :8], v[..., :8]), ValueError, "head dim"),
        (lambda q, k, v: (q[..., :8], k, v), ValueError, "head dim"),
    ],
)
def test_rejects_bad_inputs(change, error, match) -> None:  # type: ignore[no-untyped-def]
    plan = CPU_CASES[2].build()
    q, k, v = change(*make_inputs(plan, 4, 2, 16))
    with pytest.raises(error, match=match):
        tree_attention(q, k, v, plan, backend="reference")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"backend": "fast"}, "backend must be"),
        ({"scale": -1.0}, "scale"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"softcap": 0.0}, "softcap"),
    ],
)
def test_rejects_bad_options(options: dict, match: str) -> None:
    plan = CPU_CASES[2].build()
    with pytest.raises(ValueError, match=match):
        tree_attention(*make_inputs(plan, 2, 2, 16), plan, **options)


def test_auto_rule_on_cpu() -> None:
    small = torch.empty(64, 4, 16, device="meta")
    assert choose_backend(small, 2) == "reference"
    assert choose_backend(small, 2, needs_grad=True) == "reference"
    large_tokens = int((MAX_REFERENCE_SCORES / 4) ** 0.5) + 1
    large = torch.empty(large_tokens, 4, 16, device="meta")
    assert choose_backend(large, 2) == "flex"
    # Gradients on CPU only come from the reference, which then names its size limit...
    assert choose_backend(large, 2, needs_grad=True) == "reference"
    # ...unless the trees are prompt trees: then torch's CPU flash kernel behind sdpa, exact and without the limit.
    assert choose_backend(large, 2, needs_grad=True, tree_levels=2) == "sdpa"
    assert choose_backend(large, 2, tree_levels=1) == "sdpa"
    assert choose_backend(large, 2, needs_grad=True, tree_levels=3) == "reference"
    assert choose_backend(large, 2, needs_grad=True, tree_levels=2, sliding_window=8) == "reference"
    assert choose_backend(large, 2, needs_grad=True, tree_levels=2, lse_needs_grad=True) == "reference"
    assert choose_backend(small, 2, needs_grad=True, tree_levels=2) == "reference"


def test_auto_runs_and_is_differentiable_on_cpu() -> None:
    plan = CPU_CASES[5].build()
    q, k, v = make_inputs(plan, 4, 2, 16, requires_grad=True)
    tree_attention(q, k, v, plan).sum().backward()
    assert all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


def _branch_tokens(plan, sample: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Packed positions of one sample's tokens: its leaf branch plus all its ancestors."""
    begin, end = plan.layout.sample_offsets[sample : sample + 2].tolist()
    return plan.unpack_map.gather_index[begin:end]


@pytest.mark.parametrize("backend", ["reference", "flex"])
def test_branch_isolation_is_bit_exact(backend: TreeAttentionBackend) -> None:
    plan = deep_trie_plan()
    q, k, v = make_inputs(plan, 2, 1, 16, seed=7)
    base = tree_attention(q, k, v, plan, backend=backend)
    generator = torch.Generator().manual_seed(8)
    for sample in range(0, plan.num_samples, 3):
        inside = torch.zeros(plan.num_packed_tokens, dtype=torch.bool)
        inside[_branch_tokens(plan, sample)] = True
        outside = ~inside
        assert bool(outside.any())
        changed = [t.clone() for t in (q, k, v)]
        for tensor in changed:
            tensor[outside] = torch.randn(tensor[outside].shape, generator=generator) * 10
        out = tree_attention(changed[0], changed[1], changed[2], plan, backend=backend)
        assert torch.equal(out[inside], base[inside])
        assert not torch.equal(out[outside], base[outside])


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_prepared_metadata_gives_the_same_result_as_a_call_without(backend: TreeAttentionBackend) -> None:
    """A model prepares once and passes the metadata to every layer; a lone call prepares its own: same numbers."""
    plan = CPU_CASES[3].build()
    q, k, v = make_inputs(plan, 4, 2, 16, requires_grad=True)
    metadata = prepare_tree_attention(plan, backends=(backend,), head_dim=16, dtype=q.dtype)
    results = []
    for prepared in (metadata, None):
        out, lse = tree_attention(q, k, v, plan, backend=backend, return_lse=True, metadata=prepared)
        results.append((out, lse, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_metadata_must_match_the_plan_and_the_backend() -> None:
    plan, other = CPU_CASES[3].build(), CPU_CASES[2].build()
    q, k, v = make_inputs(plan, 4, 2, 16)
    metadata = prepare_tree_attention(plan, backends=("sdpa",), head_dim=16, dtype=q.dtype)
    with pytest.raises(PlanError, match="another plan"):
        tree_attention(q, k, v, plan, backend="sdpa", metadata=prepare_tree_attention(
            other, backends=("sdpa",), head_dim=16, dtype=q.dtype
        ))  # fmt: skip
    with pytest.raises(PlanError, match=r"backend='triton' but the metadata was prepared for \['sdpa'\]"):
        tree_attention(q, k, v, plan, backend="triton", metadata=metadata)
    # reference and varlen read only the plan: any metadata of the plan is accepted.
    tree_attention(q, k, v, plan, backend="reference", metadata=metadata)
