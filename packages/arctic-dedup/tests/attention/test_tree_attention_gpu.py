"""Tree attention on a CUDA GPU: every backend in bf16 within the reference's own bf16 noise, forward and backward;
fp32 against the reference; head dims, GQA, windows and softcaps; groups of 64; a 32K prompt; determinism,
isolation and FlexAttention's no-recompile promise. Run by ``nox -s gpu_tests`` (``-m gpu``)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tree_attention_cases import deep_trie_plan, prompt_groups_plan

from arctic_dedup import Plan
from arctic_dedup.attention import _launch, choose_backend, tree_attention, tree_attention_reference
from arctic_dedup.attention.varlen import varlen_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_launch, "poison_outputs", True)


def _plans() -> dict[str, Callable[[], Plan]]:
    # All land in FlexAttention's 1024-token bucket, so the flex cases share one compilation.
    generator = torch.Generator().manual_seed(0)
    group_of_64 = torch.randint(5, 16, (64,), generator=generator).tolist()
    return {
        "ragged_edges": lambda: prompt_groups_plan([300, 77], [[0, 1, 37, 128, 255, 129], [64, 1, 5]], device="cuda"),
        "deep_trie": lambda: deep_trie_plan("cuda", scale=16),
        "group_of_64": lambda: prompt_groups_plan([257], [group_of_64], device="cuda"),
        # 7 * 128 + 1 tokens: the last key block holds a single real key.
        "one_past_block": lambda: prompt_groups_plan([890], [[7]], device="cuda"),
    }


def _inputs(plan: Plan, heads_q: int, heads_kv: int, head_dim: int, dtype: torch.dtype, seed: int) -> list[Any]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    tokens = plan.num_packed_tokens
    shapes = [(tokens, heads_q, head_dim), (tokens, heads_kv, head_dim), (tokens, heads_kv, head_dim)]
    tensors = [torch.randn(shape, device="cuda", generator=generator).to(dtype) for shape in shapes]
    grad = torch.randn(shapes[0], device="cuda", generator=generator).to(dtype)
    return [*tensors, grad]


def _run(fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> list:
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, lse = fn(*leaves)
    return [out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, grad.to(out.dtype))]


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.float() - reference.float()).norm() / reference.float().norm())


def _check_bf16(
    plan: Plan, backend: str, *, heads: tuple[int, int, int] = (16, 4, 128), seed: int = 0, **options: Any
) -> None:
    """|fast - exact| within a small factor of |plain bf16 - exact| for out, dq, dk, dv; lse close."""
    q, k, v, grad = _inputs(plan, *heads, torch.bfloat16, seed)
    scale = options.pop("scale", None)
    deterministic = options.pop("deterministic", False)

    def reference(dtype: torch.dtype) -> Callable[..., Any]:
        def call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Any:
            inputs = (a.float(), b.float(), c.float()) if dtype == torch.float32 else (a, b, c)
            return tree_attention_reference(
                *inputs, plan.kv_visible_until, position_ids=plan.position_ids, scale=scale, compute_dtype=dtype,
                max_scores=2**31, **options,
            )  # fmt: skip

        return call

    exact = _run(reference(torch.float32), q, k, v, grad)
    noise = _run(reference(torch.bfloat16), q, k, v, grad)
    got = _run(
        lambda a, b, c: tree_attention(
            a, b, c, plan, backend=backend, scale=scale, return_lse=True, deterministic=deterministic, **options
        ),
        q, k, v, grad,
    )  # fmt: skip
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    assert all(bool(torch.isfinite(t).all()) for t in got)
    torch.testing.assert_close(got[1], exact[1], rtol=0, atol=2e-2)
    for name, index in (("out", 0), ("dq", 2), ("dk", 3), ("dv", 4)):
        ours, theirs = _relative(got[index], exact[index]), _relative(noise[index], exact[index])
        assert ours <= 3 * theirs + 1e-3, f"{backend} {name}: relative error {ours:.2e}, bf16 noise {theirs:.2e}"


BACKENDS = ["triton", "flex", "varlen", "sdpa"]


@pytest.mark.parametrize("case", list(_plans()))
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_backends_bf16(case: str, backend: str) -> None:
    if backend == "varlen" and not varlen_available():
        pytest.skip("no flash-attention varlen kernels in this torch build")
    _check_bf16(_plans()[case](), backend)


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("heads", [(16, 4, 128), (8, 8, 64), (8, 1, 256)])
def test_gpu_sdpa_kernels(kernel: str, heads: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Both dense kernels behind backend='sdpa' (cuDNN is the default on Hopper; FlashAttention-2 elsewhere), on
    ragged responses (padded batch) and on equal ones (views, no gather), head dims 64/128/256 and GQA."""
    from arctic_dedup.attention import sdpa

    chosen = {"cudnn": sdpa._Cudnn, "flash": sdpa._CudaFlash}[kernel]
    monkeypatch.setattr(sdpa, "_kernel_for", lambda device, deterministic=False: chosen)
    _check_bf16(_plans()["ragged_edges"](), "sdpa", heads=heads)
    _check_bf16(prompt_groups_plan([515], [[64] * 8], device="cuda"), "sdpa", heads=heads)


def test_gpu_triton_deterministic_and_atomic_dq() -> None:
    plan = _plans()["group_of_64"]()
    _check_bf16(plan, "triton", deterministic=True)
    config = _launch.TritonConfig(atomic_dq=True)
    q, k, v, grad = _inputs(plan, 16, 4, 128, torch.bfloat16, 1)
    from arctic_dedup.attention.function import triton_tree_attention
    from arctic_dedup.attention.metadata import prepare_tree_attention

    prepared = prepare_tree_attention(plan, backends=("triton",), head_dim=128, dtype=q.dtype, triton_config=config)
    atomic = _run(lambda a, b, c: triton_tree_attention(a, b, c, prepared, scale=0.1, config=config), q, k, v, grad)
    default = prepare_tree_attention(plan, backends=("triton",), head_dim=128, dtype=q.dtype)
    fixed = [
        _run(lambda a, b, c: triton_tree_attention(a, b, c, default, scale=0.1, deterministic=True), q, k, v, grad)
        for _ in range(2)
    ]
    assert all(torch.equal(x, y) for x, y in zip(*fixed)), "deterministic backward is not bitwise repeatable"
    for x, y in zip(atomic[2:], fixed[0][2:]):
        assert _relative(x, y) < 1e-2


@pytest.mark.parametrize(
    ("heads", "label"), [((8, 8, 64), "d64_mha"), ((8, 1, 256), "d256_mqa"), ((32, 8, 128), "qwen3")]
)
def test_gpu_triton_head_dims_and_groups(heads: tuple[int, int, int], label: str) -> None:
    _check_bf16(_plans()["deep_trie"](), "triton", heads=heads)


@pytest.mark.parametrize("backend", ["triton", "flex"])
def test_gpu_sliding_window_and_softcap(backend: str) -> None:
    _check_bf16(_plans()["deep_trie"](), backend, sliding_window=40, softcap=20.0, scale=0.15)


def test_gpu_triton_fp32_matches_reference() -> None:
    plan = _plans()["ragged_edges"]()
    q, k, v, grad = _inputs(plan, 8, 2, 64, torch.float32, 3)
    got = _run(lambda a, b, c: tree_attention(a, b, c, plan, backend="triton", return_lse=True), q, k, v, grad)
    exact = _run(lambda a, b, c: tree_attention(a, b, c, plan, backend="reference", return_lse=True), q, k, v, grad)
    for name, x, y in zip(["out", "lse", "dq", "dk", "dv"], got, exact):
        assert _relative(x, y) < 1e-5, f"{name}: {_relative(x, y):.2e}"


def test_gpu_triton_branch_isolation_is_bit_exact() -> None:
    plan = deep_trie_plan("cuda", scale=4)
    q, k, v, _ = _inputs(plan, 8, 2, 128, torch.bfloat16, 4)
    base = tree_attention(q, k, v, plan, backend="triton")
    offsets = plan.layout.sample_offsets.tolist()
    for sample in range(0, plan.num_samples, 3):
        inside = torch.zeros(plan.num_packed_tokens, dtype=torch.bool, device="cuda")
        inside[plan.unpack_map.gather_index[offsets[sample] : offsets[sample + 1]]] = True
        changed = [t.clone() for t in (q, k, v)]
        for tensor in changed:
            tensor[~inside] = torch.randn_like(tensor[~inside]) * 8
        out = tree_attention(changed[0], changed[1], changed[2], plan, backend="triton")
        assert torch.equal(out[inside], base[inside])


def test_gpu_long_prompt_32k() -> None:
    """A 32K prompt with four ragged responses: Triton against FlexAttention (outputs, gradients) and against an
    exact fp32 computation of sampled rows."""
    plan = prompt_groups_plan([32768], [[1, 700, 2048, 333]], device="cuda")
    q, k, v, grad = _inputs(plan, 8, 2, 128, torch.bfloat16, 5)
    results = {}
    for backend in ("triton", "flex"):
        call = functools.partial(tree_attention, plan=plan, backend=backend, return_lse=True)
        results[backend] = _run(lambda a, b, c, call=call: call(a, b, c), q, k, v, grad)
    for index in range(5):
        assert _relative(results["triton"][index], results["flex"][index]) < 1e-2
    rows = torch.cat([torch.arange(0, 64), torch.randint(0, plan.num_packed_tokens, (192,))]).cuda()
    tokens = torch.arange(plan.num_packed_tokens, device="cuda")
    visible = (tokens[None, :] <= rows[:, None]) & (rows[:, None] < plan.kv_visible_until.long()[None, :])
    keys, values = (t.float().repeat_interleave(4, dim=1) for t in (k, v))
    scores = torch.einsum("rhd,khd->hrk", q[rows].float(), keys) / 128**0.5
    probabilities = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
    exact_rows = torch.einsum("hrk,khd->rhd", probabilities, values)
    assert _relative(results["triton"][0][rows], exact_rows) < 1e-2


def test_gpu_flex_does_not_recompile_for_new_lengths() -> None:
    first = prompt_groups_plan([300, 77], [[0, 1, 37, 128, 255, 129], [64, 1, 5]], device="cuda")
    second = prompt_groups_plan([400], [[100, 200, 250, 3]], seed=9, device="cuda")
    assert first.num_packed_tokens != second.num_packed_tokens
    for plan in (first, second):
        q, k, v, grad = _inputs(plan, 16, 4, 128, torch.bfloat16, 6)
        context = torch._dynamo.config.patch(error_on_recompile=True) if plan is second else contextlib.nullcontext()
        with context:
            _run(
                lambda a, b, c, plan=plan: tree_attention(a, b, c, plan, backend="flex", return_lse=True), q, k, v, grad
            )


def test_gpu_auto_rule() -> None:
    bf16, fp16, fp32 = (
        torch.empty(8, 4, 64, device="cuda", dtype=dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)
    )
    assert choose_backend(bf16, 2) == "triton"
    assert choose_backend(fp16, 2, needs_grad=True) == "flex"
    assert choose_backend(fp32, 2) == "flex"
    assert choose_backend(bf16, 2, needs_grad=True, tree_levels=2) == "sdpa"
    assert choose_backend(fp16, 2, tree_levels=1) == "sdpa"
    assert choose_backend(fp32, 2, needs_grad=True, tree_levels=2) == "flex"
    assert choose_backend(bf16, 2, needs_grad=True, tree_levels=3) == "flex"
    assert choose_backend(bf16, 2, needs_grad=True, tree_levels=2, softcap=30.0) == "flex"
    assert choose_backend(bf16, 2, needs_grad=True, tree_levels=2, tokens_per_tree=5000) == "sdpa"
    assert choose_backend(bf16, 2, needs_grad=True, tree_levels=2, tokens_per_tree=1000) == "flex"
    plan = prompt_groups_plan([4000], [[400, 410]], device="cuda")
    q, k, v, _ = _inputs(plan, 8, 2, 64, torch.bfloat16, 3)
    torch.testing.assert_close(
        tree_attention(q, k, v, plan), tree_attention(q, k, v, plan, backend="sdpa"), rtol=0, atol=0
    )


def test_gpu_sdpa_deterministic_backward_is_repeatable() -> None:
    """deterministic=True takes FlashAttention-2's deterministic backward (cuDNN's reduces dQ with atomics)."""
    plan = _plans()["group_of_64"]()
    _check_bf16(plan, "sdpa", deterministic=True)
    q, k, v, grad = _inputs(plan, 16, 4, 128, torch.bfloat16, 5)
    runs = [
        _run(
            lambda a, b, c: tree_attention(a, b, c, plan, backend="sdpa", return_lse=True, deterministic=True),
            q,
            k,
            v,
            grad,
        )
        for _ in range(2)
    ]
    assert all(torch.equal(x, y) for x, y in zip(*runs)), "deterministic sdpa backward is not bitwise repeatable"


def test_gpu_sdpa_strided_inputs() -> None:
    """q/k/v as [H, T, D] storage seen as [T, H, D] (a layer's transposed views): cuDNN, and FA2 varlen for the
    ragged responses, give the contiguous inputs' results (bf16 noise of a different kernel config at most)."""
    plan = _plans()["ragged_edges"]()
    q, k, v, grad = _inputs(plan, 16, 4, 128, torch.bfloat16, 8)
    strided = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v)]
    assert not strided[0].is_contiguous()
    call = lambda a, b, c: tree_attention(a, b, c, plan, backend="sdpa", return_lse=True)
    for got, want in zip(_run(call, *strided, grad), _run(call, q, k, v, grad)):
        assert _relative(got, want) < 1e-2
