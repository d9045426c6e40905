"""The fused causal conv kernels against ``F.conv1d`` (forward and the gradients of x, weight and bias).

CPU tests run the kernels through Triton's interpreter (``TRITON_INTERPRET=1``, small shapes); without it they run
on CUDA. Every new output and partial buffer is poisoned with NaN, so an element a kernel skips fails. The ``gpu``
tests run the production shape (T=8704, C=8192, K=4) on CUDA. The reference is computed in a wider dtype than the
kernel's input (fp64 for fp32 and fp64, fp32 for bf16) with TF32 off, then rounded once to the compared dtype.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from arctic_zorro_train.kernels import causal_conv
from arctic_zorro_train.kernels.causal_conv import CausalConvTiles, causal_conv_usable, causal_depthwise_conv

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not (INTERPRETING or torch.cuda.is_available()):
    pytest.skip("needs TRITON_INTERPRET=1 (CPU, Triton's interpreter) or a CUDA GPU", allow_module_level=True)
if not causal_conv_usable(torch.empty(0, device="cpu" if INTERPRETING else "cuda")):
    pytest.skip("needs the `triton` package", allow_module_level=True)

DEVICE = torch.device("cpu" if INTERPRETING else "cuda")
TOKENS = (1, 2, 3, 5, 130)
CHANNELS = (1, 7, 128, 300)
WIDTHS = (1, 2, 3, 4)
FORWARD_TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}
GRADIENT_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
BFLOAT16_GRADIENT_TOLERANCE = 1e-2
# The production tiles (4-token backward tiles) take ~1 s per 130-token case in the interpreter: the shape sweep
# there runs coarser tiles that still split 130 tokens into several row tiles and backward row chunks; the default
# tiles get their own test and run everywhere on CUDA.
SWEEP_TILES = (
    CausalConvTiles(
        forward_block_t=64, forward_block_c=256, backward_block_t=32, backward_block_c=256, backward_tiles_per_program=2
    )
    if INTERPRETING
    else None
)


@pytest.fixture(autouse=True)
def _poison_new_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(causal_conv, "poison_outputs", True)


def conv1d_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype
) -> torch.Tensor:
    """``F.conv1d`` on the ``[1, C, T]`` layout in ``compute_dtype`` -> ``[T, C]`` in ``compute_dtype``."""
    num_tokens, num_channels = x.shape
    width = weight.shape[1]
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        out = F.conv1d(
            x.to(compute_dtype).t()[None],
            weight.to(compute_dtype)[:, None, :],
            None if bias is None else bias.to(compute_dtype),
            padding=width - 1,
            groups=num_channels,
        )
    return out[0, :, :num_tokens].t()


def relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def make_inputs(
    num_tokens: int,
    num_channels: int,
    width: int,
    with_bias: bool,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None = None,
    device: torch.device = DEVICE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    weight_dtype = dtype if weight_dtype is None else weight_dtype
    x = torch.randn(num_tokens, num_channels, device=device).to(dtype).requires_grad_()
    weight = torch.randn(num_channels, width, device=device).to(weight_dtype).requires_grad_()
    bias = torch.randn(num_channels, device=device).to(weight_dtype).requires_grad_() if with_bias else None
    return x, weight, bias


def gradients(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, upstream: torch.Tensor
) -> list[torch.Tensor]:
    inputs = [x, weight] if bias is None else [x, weight, bias]
    return list(torch.autograd.grad(out, inputs, upstream))


def reference_gradients(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, upstream: torch.Tensor, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Gradients of ``conv1d_reference`` in ``dtype``, taken on detached upcast leaves."""
    leaves = [tensor.detach().to(dtype).requires_grad_() for tensor in (x, weight)]
    bias_leaf = None if bias is None else bias.detach().to(dtype).requires_grad_()
    out = conv1d_reference(leaves[0], leaves[1], bias_leaf, dtype)
    return gradients(out, leaves[0], leaves[1], bias_leaf, upstream.to(dtype))


def assert_within_one_bfloat16_ulp(
    actual: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Each element of ``actual`` is ``expected`` (the fp32 result rounded to bf16) or a neighbouring bf16 value, up
    to fp32 accumulation error: where the K + 1 terms cancel, the fp32 sums of the kernel and the reference (both
    off by up to (K + 1) * 2^-24 * sum |terms|, K <= 4) can straddle a bf16 rounding boundary more than one bf16 ulp
    away, so ``2^-20 * sum |terms|`` is allowed on top. A bf16 rounding inside the sum is still far outside."""
    assert actual.dtype == expected.dtype == torch.bfloat16
    actual_float, expected_float = actual.float(), expected.float()
    magnitude = torch.maximum(actual_float.abs(), expected_float.abs())
    _, exponent = torch.frexp(magnitude)
    # magnitude lies in [2^(e-1), 2^e): bf16 values there are 2^(e-8) apart (floored at the smallest subnormal).
    ulp = torch.ldexp(torch.ones_like(magnitude), (exponent - 8).clamp_min(-133))
    terms = conv1d_reference(x.abs(), weight.abs(), None if bias is None else bias.abs(), torch.float32)
    excess = (actual_float - expected_float).abs() - ulp - terms * 2.0**-20
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"{int((excess > 0).sum())} elements differ by more than one bf16 ulp; worst: got "
        f"{actual_float.flatten()[worst].item()}, expected {expected_float.flatten()[worst].item()}"
    )


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(("num_tokens", "num_channels", "width"), list(itertools.product(TOKENS, CHANNELS, WIDTHS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_matches_conv1d(num_tokens: int, num_channels: int, width: int, with_bias: bool, dtype: torch.dtype) -> None:
    check_against_conv1d(num_tokens, num_channels, width, with_bias, dtype, SWEEP_TILES)


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 8])
def test_default_tiles_match_conv1d(width: int) -> None:
    check_against_conv1d(130, 300, width, True, torch.float32, None)


def check_against_conv1d(
    num_tokens: int,
    num_channels: int,
    width: int,
    with_bias: bool,
    dtype: torch.dtype,
    tiles: CausalConvTiles | None,
) -> None:
    x, weight, bias = make_inputs(num_tokens, num_channels, width, with_bias, dtype)
    out = causal_depthwise_conv(x, weight, bias, tiles=tiles)
    expected = conv1d_reference(x, weight, bias, torch.float64)
    assert out.shape == (num_tokens, num_channels) and out.dtype == dtype
    tolerance = FORWARD_TOLERANCE[dtype]
    torch.testing.assert_close(out, expected.to(dtype), rtol=tolerance, atol=tolerance)

    upstream = torch.randn_like(out)
    names = ["x", "weight", "bias"]
    expected_grads = reference_gradients(x, weight, bias, upstream, torch.float64)
    for name, grad, expected_grad in zip(names, gradients(out, x, weight, bias, upstream), expected_grads):
        assert grad.shape == expected_grad.shape and grad.dtype == dtype, name
        assert relative_l2(grad, expected_grad) < GRADIENT_TOLERANCE[dtype], name


def _column_slice(tensor: torch.Tensor) -> torch.Tensor:
    """Channels contiguous, rows further apart than C (a slice of a fused projection's output)."""
    wide = torch.randn(tensor.shape[0], tensor.shape[1] + 5, dtype=tensor.dtype, device=tensor.device)
    wide[:, 2 : 2 + tensor.shape[1]] = tensor
    return wide[:, 2 : 2 + tensor.shape[1]]


def _transposed(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.t().contiguous().t()


def _every_other_column(tensor: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(tensor, 2, dim=1)[:, ::2]


@pytest.mark.parametrize("make_view", [_column_slice, _transposed, _every_other_column])
def test_non_contiguous_views(make_view: Callable[[torch.Tensor], torch.Tensor]) -> None:
    num_tokens, num_channels, width = 70, 24, 4
    x_data = torch.randn(num_tokens, num_channels, dtype=torch.float64, device=DEVICE)
    weight_data = torch.randn(num_channels, width, dtype=torch.float64, device=DEVICE)
    upstream_data = torch.randn(num_tokens, num_channels, dtype=torch.float64, device=DEVICE)
    x = make_view(x_data).requires_grad_()
    weight = _transposed(weight_data).requires_grad_()
    bias = torch.randn(num_channels, 2, dtype=torch.float64, device=DEVICE)[:, 1].requires_grad_()
    upstream = make_view(upstream_data)
    assert not (x.is_contiguous() or weight.is_contiguous() or bias.is_contiguous() or upstream.is_contiguous())

    out = causal_depthwise_conv(x, weight, bias)
    torch.testing.assert_close(out, conv1d_reference(x, weight, bias, torch.float64), rtol=1e-12, atol=1e-12)
    expected_grads = reference_gradients(x, weight, bias, upstream, torch.float64)
    for grad, expected_grad in zip(gradients(out, x, weight, bias, upstream), expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16_weight", "fp32_weight"])
@pytest.mark.parametrize(("num_tokens", "num_channels", "width"), [(130, 300, 4), (5, 7, 3), (67, 128, 2)])
def test_bfloat16_within_one_ulp_and_gradients_near_fp32_truth(
    num_tokens: int, num_channels: int, width: int, weight_dtype: torch.dtype
) -> None:
    x, weight, bias = make_inputs(num_tokens, num_channels, width, True, torch.bfloat16, weight_dtype)
    out = causal_depthwise_conv(x, weight, bias)
    assert out.dtype == torch.bfloat16
    expected = conv1d_reference(x, weight, bias, torch.float32).to(torch.bfloat16)
    assert_within_one_bfloat16_ulp(out, expected, x.detach(), weight.detach(), None if bias is None else bias.detach())

    upstream = torch.randn_like(out)
    grads = gradients(out, x, weight, bias, upstream)
    truth = reference_gradients(x, weight, bias, upstream, torch.float32)
    for name, grad, expected_grad, leaf in zip(["x", "weight", "bias"], grads, truth, [x, weight, bias]):
        assert leaf is not None and grad.dtype == leaf.dtype, name
        assert relative_l2(grad, expected_grad) < BFLOAT16_GRADIENT_TOLERANCE, name


def test_partial_sums_over_many_row_chunks_are_exact_and_deterministic() -> None:
    # Small tiles: 130 tokens make 5 backward row chunks of 2 x 16 tokens and 40 channels 3 channel blocks.
    tiles = CausalConvTiles(
        forward_block_t=16, forward_block_c=16, backward_block_t=16, backward_block_c=16, backward_tiles_per_program=2
    )
    x, weight, bias = make_inputs(130, 40, 4, True, torch.float64)
    out = causal_depthwise_conv(x, weight, bias, tiles=tiles)
    torch.testing.assert_close(out, conv1d_reference(x, weight, bias, torch.float64), rtol=1e-12, atol=1e-12)
    upstream = torch.randn_like(out)
    grads = gradients(out, x, weight, bias, upstream)
    for grad, expected_grad in zip(grads, reference_gradients(x, weight, bias, upstream, torch.float64)):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    again = gradients(causal_depthwise_conv(x, weight, bias, tiles=tiles), x, weight, bias, upstream)
    for grad, repeated in zip(grads, again):
        assert torch.equal(grad, repeated)


def test_no_tokens() -> None:
    x, weight, bias = make_inputs(0, 8, 4, True, torch.float32)
    assert bias is not None
    out = causal_depthwise_conv(x, weight, bias)
    assert out.shape == (0, 8)
    grad_x, grad_weight, grad_bias = gradients(out, x, weight, bias, torch.zeros_like(out))
    assert grad_x.shape == (0, 8)
    assert torch.equal(grad_weight, torch.zeros_like(weight)) and torch.equal(grad_bias, torch.zeros_like(bias))


def _bad_arguments() -> list[object]:
    x = torch.randn(6, 4, device=DEVICE)
    weight = torch.randn(4, 3, device=DEVICE)
    bias = torch.randn(4, device=DEVICE)
    cases: list[tuple[str, dict[str, torch.Tensor | None], str]] = [
        ("x_not_2d", {"x": x[None], "weight": weight, "bias": bias}, r"x must be \[T, C\]"),
        ("conv1d_weight", {"x": x, "weight": weight[:, None, :], "bias": bias}, r"conv\.weight\.squeeze\(1\)"),
        ("weight_channels", {"x": x, "weight": weight[:3], "bias": bias}, r"weight must be \[C, K\] = \[4, K\]"),
        ("too_wide", {"x": x, "weight": torch.randn(4, 9, device=DEVICE), "bias": bias}, "must be 1 to 8, got 9"),
        ("empty_width", {"x": x, "weight": weight[:, :0], "bias": bias}, "must be 1 to 8, got 0"),
        ("bias_shape", {"x": x, "weight": weight, "bias": bias[:3]}, r"bias must be \[C\] = \[4\]"),
        ("integer_x", {"x": x.long(), "weight": weight, "bias": bias}, "x must be float16, bfloat16"),
        ("bias_dtype", {"x": x, "weight": weight, "bias": bias.double()}, r"bias\.to\(weight\.dtype\)"),
        ("device", {"x": x, "weight": weight.to("meta"), "bias": bias}, r"weight\.to\(x\.device\)"),
    ]
    return [pytest.param(arguments, message, id=name) for name, arguments, message in cases]


@pytest.mark.parametrize(("arguments", "message"), _bad_arguments())
def test_rejects_bad_arguments(arguments: dict[str, torch.Tensor | None], message: str) -> None:
    x, weight, bias = arguments["x"], arguments["weight"], arguments["bias"]
    assert x is not None and weight is not None
    with pytest.raises(ValueError, match=message):
        causal_depthwise_conv(x, weight, bias)


def test_rejects_bad_tiles() -> None:
    x, weight, bias = make_inputs(4, 4, 2, True, torch.float32)
    with pytest.raises(ValueError, match="power of two, got 48"):
        causal_depthwise_conv(x, weight, bias, tiles=CausalConvTiles(forward_block_c=48))


def test_usable_only_on_cuda_or_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert causal_conv_usable(torch.empty(1))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not causal_conv_usable(torch.empty(1))
    assert not causal_conv_usable(torch.empty(1, device="meta"))
    if torch.cuda.is_available():
        assert causal_conv_usable(torch.empty(1, device="cuda"))
    monkeypatch.setattr(causal_conv, "_TRITON_AVAILABLE", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not causal_conv_usable(torch.empty(1))


GPU_TOKENS, GPU_CHANNELS, GPU_WIDTH = 8704, 8192, 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_float32_production_shape() -> None:
    device = torch.device("cuda")
    x, weight, bias = make_inputs(GPU_TOKENS, GPU_CHANNELS, GPU_WIDTH, True, torch.float32, device=device)
    out = causal_depthwise_conv(x, weight, bias)
    torch.testing.assert_close(out, conv1d_reference(x, weight, bias, torch.float64).float(), rtol=1e-6, atol=1e-6)
    upstream = torch.randn_like(out)
    grads = gradients(out, x, weight, bias, upstream)
    for name, grad, expected_grad in zip(
        ["x", "weight", "bias"], grads, reference_gradients(x, weight, bias, upstream, torch.float64)
    ):
        assert relative_l2(grad, expected_grad) < GRADIENT_TOLERANCE[torch.float32], name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16_weight", "fp32_weight"])
def test_gpu_bfloat16_production_shape(weight_dtype: torch.dtype) -> None:
    device = torch.device("cuda")
    x, weight, bias = make_inputs(GPU_TOKENS, GPU_CHANNELS, GPU_WIDTH, True, torch.bfloat16, weight_dtype, device)
    out = causal_depthwise_conv(x, weight, bias)
    expected = conv1d_reference(x, weight, bias, torch.float32).to(torch.bfloat16)
    assert_within_one_bfloat16_ulp(out, expected, x.detach(), weight.detach(), None if bias is None else bias.detach())
    upstream = torch.randn_like(out)
    grads = gradients(out, x, weight, bias, upstream)
    truth = reference_gradients(x, weight, bias, upstream, torch.float32)
    for name, grad, expected_grad in zip(["x", "weight", "bias"], grads, truth):
        assert relative_l2(grad, expected_grad) < BFLOAT16_GRADIENT_TOLERANCE, name
    repeated = gradients(causal_depthwise_conv(x, weight, bias), x, weight, bias, upstream)
    for name, grad, again in zip(["x", "weight", "bias"], grads, repeated):
        assert torch.equal(grad, again), f"{name} gradient is not deterministic"
