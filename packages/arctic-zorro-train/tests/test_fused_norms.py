"""The fused Triton norms against the transformers modules they replace (``Qwen3_5RMSNorm``, ``Qwen3_5RMSNormGated``).

CPU tests run the kernels through Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is imported);
``gpu`` tests run them compiled on CUDA. Every new kernel output starts as NaN, so a skipped element fails.

* fp32: forward within 1e-6, gradients of x, gate and weight within 1e-5 relative L2, over widths 16 to 2560 (200 is
  not a power of two), 1/3/37 rows, 2D and 3D inputs, strided rows and a random upstream gradient.
* fp64: the kernels compute in float64, as the modules do inside ``float64_everywhere`` (where the package's
  exactness tests run): there forward and gradients agree to 1e-12; outside it the modules compute the norm in fp32
  (``x.float()``, ``gate.float()``), so they match to fp32 precision (1e-6).
* bf16: the outputs match the modules' bf16 outputs bit for bit on almost every element and within one bf16 ulp
  everywhere (the fp32 row sums run in another order, and GPU rsqrt differs from CPU's); the gated norm within two,
  as its normed value is rounded to bf16 before the product is: a one-ulp flip there can move the output by two
  (5 of 16.7M outputs on the H200, all in rows where that rounding flipped). That catches a missing bf16 rounding
  of the gated product, which moves about a quarter of the outputs by one ulp. Gradients: against the fp32 truth
  (the same module and values in fp32) the fused error may be at most twice the bf16 module's own, plus a small
  floor; and they equal, on almost every element, the fp32 gradients of the module's rounded forward (roundings
  kept, casts the identity backward) rounded to bf16, which pins the roundings the backward recomputes.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
if not (INTERPRETING or torch.cuda.is_available()):
    pytest.skip(
        "the fused norms run on CUDA or, on CPU, through Triton's interpreter: set TRITON_INTERPRET=1",
        allow_module_level=True,
    )
pytest.importorskip("triton", reason="the fused norms are Triton kernels: install triton")

from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated  # noqa: E402

from arctic_zorro_train.kernels import norms  # noqa: E402
from arctic_zorro_train.kernels.norms import (  # noqa: E402
    MAX_WIDTH,
    fused_norms_usable,
    gated_rms_norm,
    zero_centered_rms_norm,
)

EPS = 1e-6
WIDTHS = (16, 128, 256, 2560, 200)
KINDS = ("zero_centered", "gated")
# Fraction of bf16 outputs that must equal the module's bit for bit (measured: >= 0.9997; with the gated product's
# bf16 rounding dropped, about 0.75).
BF16_EXACT_FRACTION = 0.99
# bf16 gradients: fused error <= GRADIENT_NOISE_FACTOR * module error + GRADIENT_NOISE_FLOOR (relative L2).
GRADIENT_NOISE_FACTOR = 2.0
GRADIENT_NOISE_FLOOR = 1e-4
# Fraction of bf16 gradient elements that must equal the rounded-forward emulation's fp32 gradient rounded to bf16.
BF16_GRADIENT_EXACT_FRACTION = 0.99

on_cpu = pytest.mark.skipif(not INTERPRETING, reason="CPU tests run the kernels through TRITON_INTERPRET=1")
on_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETING, reason="needs a CUDA GPU (and TRITON_INTERPRET unset)"
)


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(norms, "poison_outputs", True)
    yield


def _module(kind: str, width: int, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    module = Qwen3_5RMSNorm(width, EPS) if kind == "zero_centered" else Qwen3_5RMSNormGated(width, EPS)
    module = module.to(device=device, dtype=dtype)
    _weight(module).data.normal_()
    return module


def _weight(module: torch.nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _fused(kind: str) -> Callable[..., torch.Tensor]:
    def run(module: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if kind == "zero_centered":
            return zero_centered_rms_norm(x, _weight(module), EPS)
        return gated_rms_norm(x, gate, _weight(module), EPS)

    return run


def _reference(kind: str) -> Callable[..., torch.Tensor]:
    def run(module: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return module(x) if kind == "zero_centered" else module(x, gate)

    return run


def _forward_backward(
    run: Callable[..., torch.Tensor],
    kind: str,
    module: torch.nn.Module,
    x: torch.Tensor,
    gate: torch.Tensor,
    upstream: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output and the gradients of ``(output * upstream).sum()`` for x, (gate,) weight."""
    out = run(module, x, gate)
    inputs = [x, _weight(module)] if kind == "zero_centered" else [x, gate, _weight(module)]
    return out.detach(), list(torch.autograd.grad(out, inputs, upstream))


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    difference = (actual.double() - expected.double()).norm()
    return float(difference / expected.double().norm().clamp_min(1e-30))


def _bf16_ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    def ordered(values: torch.Tensor) -> torch.Tensor:
        # Sign-magnitude bits -> integers that grow with the value (+0 and -0 both map to 0).
        bits = values.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -32768 - bits, bits)

    return (ordered(actual) - ordered(expected)).abs()


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(shape, dtype=dtype, device=device).requires_grad_()
    gate = torch.randn(shape, dtype=dtype, device=device).requires_grad_()
    return x, gate


def _assert_matches_module(
    kind: str,
    module: torch.nn.Module,
    x: torch.Tensor,
    gate: torch.Tensor,
    forward_tolerance: float,
    grad_tolerance: float = 1e-5,
) -> None:
    upstream = torch.randn(x.shape, dtype=x.dtype, device=x.device)
    out, grads = _forward_backward(_fused(kind), kind, module, x, gate, upstream)
    expected_out, expected_grads = _forward_backward(_reference(kind), kind, module, x, gate, upstream)
    assert out.dtype == expected_out.dtype and out.shape == expected_out.shape
    torch.testing.assert_close(out, expected_out, rtol=forward_tolerance, atol=forward_tolerance)
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert grad.dtype == expected.dtype and grad.shape == expected.shape
        assert _relative_error(grad, expected) <= grad_tolerance


@on_cpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", [1, 3, 37])
@pytest.mark.parametrize("layout", ["2d", "3d"])
def test_fp32_matches_module(kind: str, width: int, rows: int, layout: str) -> None:
    module = _module(kind, width, torch.float32)
    shape = (rows, width) if layout == "2d" else (rows, 2, width)
    x, gate = _inputs(shape, torch.float32)
    _assert_matches_module(kind, module, x, gate, forward_tolerance=1e-6)


@on_cpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width", [128, 200])
def test_strided_rows(kind: str, width: int) -> None:
    module = _module(kind, width, torch.float32)
    # Rows that are a slice of wider rows (a view, read in place), for a 2D and a 3D input.
    wide = torch.randn(37, width + 24, requires_grad=True)
    wide_gate = torch.randn(37, width + 24, requires_grad=True)
    _assert_matches_module(kind, module, wide[:, :width], wide_gate[:, 3 : width + 3], forward_tolerance=1e-6)
    wide_3d = torch.randn(5, 3, width + 8, requires_grad=True)
    _assert_matches_module(kind, module, wide_3d[..., 8:], wide_3d[..., :width], forward_tolerance=1e-6)
    # A last dimension that is not contiguous (copied first).
    transposed = torch.randn(width, 7, requires_grad=True)
    _assert_matches_module(
        kind, module, transposed.t(), torch.randn(7, width, requires_grad=True), forward_tolerance=1e-6
    )


@on_cpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width", [16, 200])
@pytest.mark.parametrize("weight_dtype", [torch.float64, torch.float32])
def test_fp64_matches_module(kind: str, width: int, weight_dtype: torch.dtype) -> None:
    module = _module(kind, width, weight_dtype)
    x, gate = _inputs((37, width), torch.float64)
    _assert_matches_module(kind, module, x, gate, forward_tolerance=1e-6)


@on_cpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width", [16, 200])
def test_fp64_inside_float64_everywhere_is_exact(kind: str, width: int) -> None:
    """Where the exactness tests run (``float64_everywhere``: transformers' fp32 casts keep float64), the kernels
    compute in float64 too: forward and gradients to float64 rounding."""
    from arctic_zorro_train.testing import float64_everywhere

    module = _module(kind, width, torch.float64)
    x, gate = _inputs((37, width), torch.float64)
    with float64_everywhere():
        _assert_matches_module(kind, module, x, gate, forward_tolerance=1e-12, grad_tolerance=1e-12)


def _assert_bf16_matches_module(
    kind: str, module: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor, upstream: torch.Tensor
) -> None:
    out, grads = _forward_backward(_fused(kind), kind, module, x, gate, upstream)
    module_out, module_grads = _forward_backward(_reference(kind), kind, module, x, gate, upstream)
    assert out.dtype == module_out.dtype == torch.bfloat16
    assert int(_bf16_ulp_distance(out, module_out).max()) <= (1 if kind == "zero_centered" else 2)
    assert float((out == module_out).float().mean()) >= BF16_EXACT_FRACTION

    truth_module = copy.deepcopy(module).float()
    truth_x = x.detach().float().requires_grad_()
    truth_gate = gate.detach().float().requires_grad_()
    _, truth_grads = _forward_backward(_reference(kind), kind, truth_module, truth_x, truth_gate, upstream.float())
    for grad, module_grad, truth in zip(grads, module_grads, truth_grads, strict=True):
        assert grad.dtype == module_grad.dtype
        fused_error = _relative_error(grad, truth)
        module_error = _relative_error(module_grad, truth)
        assert fused_error <= GRADIENT_NOISE_FACTOR * module_error + GRADIENT_NOISE_FLOOR, (fused_error, module_error)


@on_cpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width", [128, 256, 2560, 200])
def test_bf16_matches_module(kind: str, width: int) -> None:
    module = _module(kind, width, torch.bfloat16)
    x, gate = _inputs((37, 2, width), torch.bfloat16)
    _assert_bf16_matches_module(kind, module, x, gate, torch.randn(x.shape, dtype=torch.bfloat16))


@on_cpu
def test_gated_fp32_weight_with_bf16_input() -> None:
    # fp32 master weights: the product is fp32 (no bf16 rounding), the output bf16.
    module = _module("gated", 128, torch.float32)
    x, gate = _inputs((37, 4, 128), torch.bfloat16)
    _assert_bf16_matches_module("gated", module, x, gate, torch.randn(x.shape, dtype=torch.bfloat16))


def _straight_through_round(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value`` rounded to ``dtype`` (kept in fp32) in the forward and the identity in the backward, as a cast is."""
    return value + (value.to(dtype).float() - value).detach()


def _rounded_forward_gradients(
    kind: str, module: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor, upstream: torch.Tensor
) -> list[torch.Tensor]:
    """fp32 gradients of the module's low-precision forward: its roundings kept, its casts the identity backward."""
    weight = _weight(module).detach().float().requires_grad_()
    x32 = x.detach().float().requires_grad_()
    gate32 = gate.detach().float().requires_grad_()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    if kind == "zero_centered":
        out = normed * (1.0 + weight)
        inputs = [x32, weight]
    else:
        product_dtype = torch.promote_types(_weight(module).dtype, x.dtype)
        product = _straight_through_round(weight * _straight_through_round(normed, x.dtype), product_dtype)
        out = product * F.silu(gate32)
        inputs = [x32, gate32, weight]
    return list(torch.autograd.grad(out, inputs, upstream.float()))


@on_cpu
@pytest.mark.parametrize(
    ("kind", "weight_dtype"),
    [("zero_centered", torch.bfloat16), ("gated", torch.bfloat16), ("gated", torch.float32)],
)
@pytest.mark.parametrize("width", [128, 200])
def test_bf16_gradients_follow_the_rounded_forward(kind: str, weight_dtype: torch.dtype, width: int) -> None:
    module = _module(kind, width, weight_dtype)
    x, gate = _inputs((37, 4, width), torch.bfloat16)
    upstream = torch.randn(x.shape, dtype=torch.bfloat16)
    _, grads = _forward_backward(_fused(kind), kind, module, x, gate, upstream)
    for grad, expected in zip(grads, _rounded_forward_gradients(kind, module, x, gate, upstream), strict=True):
        if grad.dtype == torch.bfloat16:
            assert float((grad == expected.to(grad.dtype)).float().mean()) >= BF16_GRADIENT_EXACT_FRACTION
        else:
            # An fp32 weight's gradient: the rows are summed in another order.
            assert _relative_error(grad, expected) <= 1e-5


@on_cpu
@pytest.mark.parametrize("kind", KINDS)
def test_weight_gradient_is_deterministic(kind: str) -> None:
    module = _module(kind, 200, torch.float32)
    x, gate = _inputs((37, 3, 200), torch.float32)
    upstream = torch.randn(x.shape)
    _, first = _forward_backward(_fused(kind), kind, module, x, gate, upstream)
    _, second = _forward_backward(_fused(kind), kind, module, x, gate, upstream)
    for one, other in zip(first, second, strict=True):
        assert torch.equal(one, other)


@on_cpu
@pytest.mark.parametrize("kind", KINDS)
def test_no_rows(kind: str) -> None:
    module = _module(kind, 128, torch.float32)
    x, gate = _inputs((0, 3, 128), torch.float32)
    out, grads = _forward_backward(_fused(kind), kind, module, x, gate, torch.randn(x.shape))
    assert out.shape == x.shape
    assert all(torch.equal(grad, torch.zeros_like(grad)) for grad in grads)


@on_cpu
def test_mismatched_inputs_are_rejected() -> None:
    x = torch.randn(4, 128)
    weight = torch.randn(128)
    with pytest.raises(ValueError, match=r"expected x \[\.\.\., D\] and weight \[D\]"):
        zero_centered_rms_norm(x, torch.randn(64), EPS)
    with pytest.raises(ValueError, match="gate must have x's shape"):
        gated_rms_norm(x, torch.randn(4, 64), weight, EPS)
    with pytest.raises(ValueError, match="x must be one of"):
        zero_centered_rms_norm(x.to(torch.int32), weight, EPS)
    with pytest.raises(ValueError, match="gate must be one of"):
        gated_rms_norm(x, torch.randn(4, 128).to(torch.complex64), weight, EPS)
    with pytest.raises(ValueError, match="float64 weight needs float64 x"):
        gated_rms_norm(x, torch.randn(4, 128), weight.double(), EPS)
    with pytest.raises(ValueError, match=f"1 to {MAX_WIDTH} elements"):
        zero_centered_rms_norm(torch.randn(1, MAX_WIDTH + 1), torch.randn(MAX_WIDTH + 1), EPS)


def test_usable_on_cuda_or_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_tensor = torch.zeros(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused_norms_usable(cpu_tensor)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not fused_norms_usable(cpu_tensor)
    if torch.cuda.is_available():
        assert fused_norms_usable(cpu_tensor.cuda())


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(
    ("kind", "shape"),
    [("zero_centered", (4096, 2560)), ("zero_centered", (4096, 16, 256)), ("gated", (4096, 32, 128))],
)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_bf16_on_gpu(kind: str, shape: tuple[int, ...], weight_dtype: torch.dtype) -> None:
    module = _module(kind, shape[-1], weight_dtype, device="cuda")
    x, gate = _inputs(shape, torch.bfloat16, device="cuda")
    _assert_bf16_matches_module(kind, module, x, gate, torch.randn(shape, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(("kind", "width"), [("zero_centered", 2560), ("zero_centered", 200), ("gated", 128)])
def test_fp32_on_gpu(kind: str, width: int) -> None:
    module = _module(kind, width, torch.float32, device="cuda")
    x, gate = _inputs((1000, 3, width), torch.float32, device="cuda")
    # GPU rsqrt and exp are a few ulp off torch's: the bound is relative, 1e-5.
    _assert_matches_module(kind, module, x, gate, forward_tolerance=1e-5)
