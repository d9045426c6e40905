"""Triton backend (forward and backward) against the reference; on CPU through the Triton interpreter."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tree_attention_cases import CPU_CASES, Case, deep_trie_plan, make_inputs, prompt_groups_plan, random_tree_plan

from arctic_dedup._triton_support import interpreting, triton_available
from arctic_dedup.attention import _launch, tree_attention
from arctic_dedup.attention._launch import TritonConfig
from arctic_dedup.attention.function import triton_tree_attention
from arctic_dedup.attention.metadata import prepare_tree_attention

pytestmark = pytest.mark.skipif(
    not (triton_available() and (interpreting() or torch.cuda.is_available())),
    reason="needs triton with a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
OPTIONS = [{}, {"sliding_window": 5}, {"softcap": 2.5, "scale": 0.4}]
OPTION_IDS = ["plain", "window", "softcap"]


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_launch, "poison_outputs", True)


def _compare(
    plan,  # type: ignore[no-untyped-def]
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    *,
    config: TritonConfig | None = None,
    deterministic: bool = True,
    use_lse_in_loss: bool = False,
    seed: int = 0,
    **options,
) -> None:
    q, k, v = make_inputs(plan, num_q_heads, num_kv_heads, head_dim, seed=seed, requires_grad=True)
    scale = options.pop("scale", head_dim**-0.5)
    metadata = prepare_tree_attention(
        plan,
        backends=("triton",),
        head_dim=head_dim,
        dtype=q.dtype,
        sliding_windows=(options.get("sliding_window"),),
        triton_config=config,
    )
    out, lse = triton_tree_attention(
        q, k, v, metadata, scale=scale, deterministic=deterministic, config=config, **options
    )
    ref, ref_lse = tree_attention(q, k, v, plan, backend="reference", scale=scale, return_lse=True, **options)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    generator = torch.Generator().manual_seed(seed + 1)
    weight = torch.randn(out.shape, generator=generator).to(out.device)
    lse_weight = torch.randn(lse.shape, generator=generator).to(out.device) if use_lse_in_loss else None

    def loss(output: torch.Tensor, log_sum_exp: torch.Tensor) -> torch.Tensor:
        total = (output * weight).sum()
        return total + (log_sum_exp * lse_weight).sum() if lse_weight is not None else total

    grads = torch.autograd.grad(loss(out, lse), (q, k, v))
    expected = torch.autograd.grad(loss(ref, ref_lse), (q, k, v))
    for name, got, want in zip("qkv", grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_triton_matches_reference(case: Case, options: dict) -> None:
    _compare(case.build(), **options)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("deterministic", [True, False])
def test_triton_gqa_groups_and_atomic_dq(num_kv_heads: int, deterministic: bool) -> None:
    config = TritonConfig(block_m=16, block_n=32, bwd_block_m=32, bwd_block_n=16, dq_block_m=16, dq_block_n=32)
    _compare(deep_trie_plan(), 4, num_kv_heads, config=TritonConfig(**{**config.__dict__, "atomic_dq": True}),
             deterministic=deterministic)  # fmt: skip


@pytest.mark.parametrize(
    "blocks",
    [(16, 16, 16, 16, 16, 16), (32, 16, 16, 32, 32, 16), (16, 64, 64, 16, 16, 64)],
    ids=["16", "mixed", "wide"],
)
def test_triton_block_sizes(blocks: tuple[int, ...]) -> None:
    names = ("block_m", "block_n", "bwd_block_m", "bwd_block_n", "dq_block_m", "dq_block_n")
    config = TritonConfig(**dict(zip(names, blocks)))
    _compare(CPU_CASES[5].build(), config=config, sliding_window=9)


def test_triton_lse_gradient_and_head_dim_32() -> None:
    _compare(CPU_CASES[6].build(), 2, 1, 32, use_lse_in_loss=True, softcap=4.0)


def test_triton_bf16_within_reference_noise() -> None:
    plan = deep_trie_plan()
    q, k, v = make_inputs(plan, 4, 2, 16, torch.bfloat16, seed=3)
    out = tree_attention(q, k, v, plan, backend="triton")
    exact = tree_attention(q.float(), k.float(), v.float(), plan, backend="reference")
    ref_bf16 = tree_attention(q, k, v, plan, backend="reference")
    assert out.dtype == torch.bfloat16
    ours = (out.float() - exact).abs().max()
    noise = (ref_bf16.float() - exact).abs().max()
    assert ours <= 2 * noise + 1e-3, (ours, noise)


def test_triton_deterministic_backward_is_bitwise_repeatable() -> None:
    plan = CPU_CASES[5].build()
    q, k, v = make_inputs(plan, 4, 2, 16, requires_grad=True)
    runs = []
    for _ in range(2):
        out = tree_attention(q, k, v, plan, backend="triton", deterministic=True)
        runs.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_triton_branch_isolation_is_bit_exact() -> None:
    plan = deep_trie_plan()
    q, k, v = make_inputs(plan, 2, 1, 16, seed=7)
    base = tree_attention(q, k, v, plan, backend="triton")
    generator = torch.Generator().manual_seed(8)
    for sample in range(0, plan.num_samples, 4):
        begin, end = plan.layout.sample_offsets[sample : sample + 2].tolist()
        inside = torch.zeros(plan.num_packed_tokens, dtype=torch.bool)
        inside[plan.unpack_map.gather_index[begin:end]] = True
        changed = [t.clone() for t in (q, k, v)]
        for tensor in changed:
            tensor[~inside] = torch.randn(tensor[~inside].shape, generator=generator) * 10
        out = tree_attention(changed[0], changed[1], changed[2], plan, backend="triton")
        assert torch.equal(out[inside], base[inside])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), window=st.sampled_from([None, 1, 3, 12]))
def test_triton_random_trees(seed: int, window: int | None) -> None:
    plan = random_tree_plan(seed, max_segment=7)
    _compare(plan, 2, 1, 16, seed=seed, sliding_window=window)


# The backward launch options the benchmark's --bwd-sweep compares; each must stay exact in fp32. Every entry
# starts from all options off (``_SMALL_TILES``), so it means what it lists whatever the defaults are.
_ATOMIC = {"atomic_dq": True, "split_atomic_dq": True, "fold_statistics": True, "dp_first": True}
BACKWARD_VARIANTS = {
    "plain": {},
    "fold": {"fold_statistics": True},
    "fold_dp_first": {"fold_statistics": True, "dp_first": True},
    "atomic_fold": {"atomic_dq": True, "fold_statistics": True},
    "atomic_split": {"atomic_dq": True, "split_atomic_dq": True, "fold_statistics": True, "dp_first": True},
    "atomic_unsplit": {**_ATOMIC, "split_atomic_dq": False},
}
_OPTIONS_OFF = {"atomic_dq": False, "fold_statistics": False, "dp_first": False, "split_atomic_dq": False}
_SMALL_TILES = TritonConfig(
    block_m=16, block_n=16, bwd_block_m=16, bwd_block_n=32, dq_block_m=32, dq_block_n=16, num_warps=1, **_OPTIONS_OFF
)


def _ragged_plan():  # type: ignore[no-untyped-def]
    # Prompts and responses whose lengths are multiples of no block size; an empty response.
    return prompt_groups_plan([37, 5], [[0, 19, 3, 41], [7]])


@pytest.mark.parametrize("variant", list(BACKWARD_VARIANTS))
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(2, 64), (1, 128)], ids=["gqa2_d64", "mqa_d128"])
def test_triton_backward_variants(variant: str, num_kv_heads: int, head_dim: int) -> None:
    config = replace(_SMALL_TILES, **BACKWARD_VARIANTS[variant])
    _compare(_ragged_plan(), 4, num_kv_heads, head_dim, config=config, deterministic=not config.atomic_dq)


@pytest.mark.parametrize(
    "variant", ["fold_dp_first", "atomic_split", "atomic_unsplit"]
)  # fmt: skip
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_triton_backward_variants_window_softcap_lse(variant: str, options: dict) -> None:
    config = replace(_SMALL_TILES, **BACKWARD_VARIANTS[variant])
    _compare(deep_trie_plan(), 4, 2, 32, config=config, deterministic=not config.atomic_dq, use_lse_in_loss=True,
             **options)  # fmt: skip


@pytest.mark.parametrize(
    "variant", ["fold_dp_first", "atomic_split", "atomic_unsplit"]
)  # fmt: skip
def test_triton_backward_variants_gpu_tiles(variant: str) -> None:
    """The tile shapes the H200 runs (64 query rows, 128 keys) on a plan longer than one key block."""
    config = replace(_SMALL_TILES, bwd_block_m=64, bwd_block_n=128, dq_block_m=64, dq_block_n=64,
                     **BACKWARD_VARIANTS[variant])  # fmt: skip
    plan = prompt_groups_plan([150], [[1, 70, 33]])
    _compare(plan, 4, 2, 64, config=config, deterministic=not config.atomic_dq)


def test_triton_deterministic_ignores_atomic_variant() -> None:
    """deterministic=True never takes the atomic path, whatever the config asks for: bitwise repeatable."""
    config = replace(_SMALL_TILES, **BACKWARD_VARIANTS["atomic_split"])
    plan = _ragged_plan()
    q, k, v = make_inputs(plan, 4, 2, 32, requires_grad=True)
    metadata = prepare_tree_attention(plan, backends=("triton",), head_dim=32, dtype=q.dtype, triton_config=config)
    runs = []
    for _ in range(2):
        out, _ = triton_tree_attention(q, k, v, metadata, scale=0.2, deterministic=True, config=config)
        runs.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_triton_default_config_is_the_measured_winner() -> None:
    """CUDA bf16 d<=128 defaults: forward 128x128 / 2 stages, backward 64x128 with folded statistics; atomic dQ
    (split) unless deterministic. fp32 and d=256 keep every backward option off."""
    config = _launch.default_triton_config(128, torch.device("cuda"))
    assert (config.block_m, config.block_n, config.num_stages) == (128, 128, 2)
    assert (config.bwd_block_m, config.bwd_block_n, config.bwd_num_stages) == (64, 128, 2)
    assert config.atomic_dq and config.split_atomic_dq and config.fold_statistics and config.dp_first
    for other in (_launch.default_triton_config(128, torch.device("cuda"), torch.float32),
                  _launch.default_triton_config(256, torch.device("cuda"))):  # fmt: skip
        assert not (other.atomic_dq or other.fold_statistics or other.dp_first or other.split_atomic_dq)
