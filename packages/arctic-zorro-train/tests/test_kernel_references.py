"""The fused kernels' plain-torch twins (``arctic_zorro_train.kernels.reference``) are what they claim: the norms
equal transformers' modules bit for bit, the conv an explicit float64 sum over the taps."""

from __future__ import annotations

import pytest
import torch

from arctic_zorro_train.kernels.reference import (
    causal_depthwise_conv_reference,
    gated_rms_norm_reference,
    zero_centered_rms_norm_reference,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_twins_equal_the_transformers_modules(dtype: torch.dtype) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    x, gate = torch.randn(2, 5, 48).to(dtype), torch.randn(2, 5, 48).to(dtype)
    plain = Qwen3_5RMSNorm(48, eps=1e-6).to(dtype)
    gated = Qwen3_5RMSNormGated(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        plain.weight.normal_()
        gated.weight.normal_()
        assert torch.equal(zero_centered_rms_norm_reference(x, plain.weight, 1e-6), plain(x))
        assert torch.equal(gated_rms_norm_reference(x, gate, gated.weight, 1e-6), gated(x, gate))


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_twin_is_the_sum_over_taps(width: int, with_bias: bool) -> None:
    tokens, channels = 7, 3
    x = torch.randn(tokens, channels, dtype=torch.float64)
    weight = torch.randn(channels, width, dtype=torch.float64)
    bias = torch.randn(channels, dtype=torch.float64) if with_bias else None
    expected = torch.zeros(tokens, channels, dtype=torch.float64) if bias is None else bias.expand(tokens, -1).clone()
    for t in range(tokens):
        for tap in range(width):
            source = t - (width - 1) + tap
            if source >= 0:
                expected[t] += weight[:, tap] * x[source]
    torch.testing.assert_close(causal_depthwise_conv_reference(x, weight, bias), expected, rtol=1e-12, atol=1e-12)


def test_swiglu_twin_is_the_mlp_product() -> None:
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5MLP

    from arctic_zorro_train.kernels.reference import swiglu_reference

    mlp = Qwen3_5MLP(Qwen3_5TextConfig(hidden_size=16, intermediate_size=24), 24)
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = mlp(x)
        actual = mlp.down_proj(swiglu_reference(mlp.gate_proj(x), mlp.up_proj(x)))
    assert torch.equal(actual, expected)
