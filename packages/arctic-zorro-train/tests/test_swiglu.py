"""The fused SwiGLU against ``F.silu(gate) * up`` (what transformers' MLPs run), forward and backward.

CPU tests run the kernels through Triton's interpreter; ``gpu`` tests compiled on CUDA. New outputs start as NaN.
fp32 and float64 to their rounding; bf16 bit for bit (the kernel rounds where torch rounds: ``silu(gate)`` before
the product, ``grad * up`` before silu's derivative), allowing a sliver of one-ulp differences where the fp32
``sigmoid`` of the two implementations differs in its last bit.
"""

from __future__ import annotations

import os

import pytest
import torch

import arctic_zorro_train.kernels.swiglu as swiglu_module
from arctic_zorro_train.kernels.reference import swiglu_reference
from arctic_zorro_train.kernels.swiglu import swiglu

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("the Triton kernels need TRITON_INTERPRET=1 or a CUDA GPU", allow_module_level=True)

on_cpu = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tests run under the interpreter")
BF16_EXACT_FRACTION = 0.999


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(swiglu_module, "poison_outputs", True)


def _run(function, gate: torch.Tensor, up: torch.Tensor, upstream: torch.Tensor):  # type: ignore[no-untyped-def]
    gate = gate.detach().clone().requires_grad_()
    up = up.detach().clone().requires_grad_()
    out = function(gate, up)
    grad_gate, grad_up = torch.autograd.grad(out, (gate, up), upstream)
    return out.detach(), grad_gate, grad_up


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(sum(shape))
    values = [3 * torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(3)]
    return tuple(value.to(device=device, dtype=dtype) for value in values)


@on_cpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("shape", [(1,), (7, 3), (2, 5, 2049)])
def test_matches_torch(dtype: torch.dtype, tolerance: float, shape: tuple[int, ...]) -> None:
    gate, up, upstream = _inputs(shape, dtype)
    fused = _run(swiglu, gate, up, upstream)
    expected = _run(swiglu_reference, gate, up, upstream)
    for actual, wanted in zip(fused, expected, strict=True):
        assert actual.dtype == wanted.dtype and actual.shape == wanted.shape
        torch.testing.assert_close(actual, wanted, rtol=tolerance, atol=tolerance)


def _assert_bf16_like_torch(gate: torch.Tensor, up: torch.Tensor, upstream: torch.Tensor) -> None:
    fused = _run(swiglu, gate, up, upstream)
    expected = _run(swiglu_reference, gate, up, upstream)
    for actual, wanted in zip(fused, expected, strict=True):
        assert actual.dtype == torch.bfloat16
        assert float((actual == wanted).float().mean()) >= BF16_EXACT_FRACTION
        ulps = (actual.view(torch.int16).int() - wanted.view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1


@on_cpu
def test_bf16_rounds_where_torch_rounds() -> None:
    _assert_bf16_like_torch(*_inputs((64, 300), torch.bfloat16))


@on_cpu
def test_non_contiguous_inputs() -> None:
    gate, up, upstream = _inputs((8, 40), torch.float32)
    fused = _run(swiglu, gate[:, ::2], up.t().contiguous().t()[:, ::2], upstream[:, ::2])
    expected = _run(swiglu_reference, gate[:, ::2], up[:, ::2], upstream[:, ::2])
    for actual, wanted in zip(fused, expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=1e-6)


def test_mismatched_inputs_say_what_to_pass() -> None:
    with pytest.raises(ValueError, match="gate_proj"):
        swiglu(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="cast them"):
        swiglu(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_cuda_like_torch() -> None:
    _assert_bf16_like_torch(*_inputs((8704, 9216), torch.bfloat16, "cuda"))
