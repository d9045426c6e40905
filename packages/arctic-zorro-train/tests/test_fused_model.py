"""The fused kernels in place: a patched hybrid model with ``fused_kernels="always"`` (Triton's interpreter on CPU)
still equals the plain transformers model run per sample, and the fused kernels really ran.

float64 like ``test_gated_delta.py`` (in fp32 transformers' chunked Gated DeltaNet kernel does not reproduce itself
to 1e-5 when only the chunk alignment moves), so the kernels run in float64 here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from zorro_cases import Sample, compare_with_reference, float64_model, fresh_model, make_batch

import arctic_zorro_train.fused as fused
from arctic_dedup._triton_support import interpreting
from arctic_zorro_train import ZorroSettings
from arctic_zorro_train.errors import ZorroPatchError

pytestmark = pytest.mark.skipif(not interpreting(), reason="runs the Triton kernels through TRITON_INTERPRET=1")

SAMPLES = [
    Sample([5, 6, 7, 8, 9, 10, 11], [12, 13]),
    Sample([5, 6, 7, 8, 9, 10, 11], [14]),
    Sample([20, 21, 22], [23, 24, 25, 26, 27]),
    Sample([5, 6, 7, 8, 9, 10, 11], [12, 30, 31]),
]


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts the calls of the fused kernels (wrapping them where the patched layers import them from)."""
    import arctic_zorro_train.kernels.causal_conv as causal_conv
    import arctic_zorro_train.kernels.norms as norms
    import arctic_zorro_train.kernels.swiglu as swiglu

    calls: Counter[str] = Counter()

    def counting(module: Any, name: str) -> None:
        kernel: Callable[..., torch.Tensor] = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls[name] += 1
            return kernel(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counting(norms, "zero_centered_rms_norm")
    counting(norms, "gated_rms_norm")
    counting(causal_conv, "causal_depthwise_conv")
    counting(swiglu, "swiglu")
    yield calls


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_fused_hybrid_matches_the_per_sample_reference(family: str, kernel_calls: Counter[str]) -> None:
    overrides: dict[str, Any] = {"output_router_logits": False} if family == "qwen3_next" else {}
    model = float64_model(family, **overrides)
    compare_with_reference(model, make_batch(SAMPLES, extra_prompt_padding=2), fused_kernels="always")
    # Every kind ran: decoder and q/k norms, the Gated DeltaNet layers' gated norms and conv, the MLPs' SwiGLU.
    assert kernel_calls["zero_centered_rms_norm"] > 0
    assert kernel_calls["gated_rms_norm"] > 0
    assert kernel_calls["causal_depthwise_conv"] > 0
    assert kernel_calls["swiglu"] > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_memory_logits_with_the_fused_logprob_kernels(temperature: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense fp32 model, "memory" logits with the fused log-prob chunk kernels (small chunks, so a sample's
    responses span several): logprobs, entropy, loss and gradients within 1e-5 of plain transformers per sample."""
    import arctic_zorro_train.kernels.logprobs as logprob_kernels

    calls: Counter[str] = Counter()
    for name in ("logprob_statistics", "logprob_logits_gradient"):
        kernel = getattr(logprob_kernels, name)

        def wrapper(*args: Any, _kernel: Callable[..., Any] = kernel, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(logprob_kernels, name, wrapper)
    model = fresh_model("qwen3")
    options = {"fused_kernels": "always", "logits_optimization": "memory", "logits_chunk_size": 3}
    compare_with_reference(model, make_batch(SAMPLES, extra_prompt_padding=2), temperature=temperature, **options)
    assert calls["logprob_statistics"] > 0 and calls["logprob_logits_gradient"] > 0


def test_never_keeps_the_transformers_code(kernel_calls: Counter[str]) -> None:
    model = float64_model("qwen3_5")
    compare_with_reference(model, make_batch(SAMPLES[:2]), fused_kernels="never", check_grads=False)
    assert sum(kernel_calls.values()) == 0


def test_auto_leaves_cpu_tensors_to_the_transformers_code(kernel_calls: Counter[str]) -> None:
    model = float64_model("qwen3_5")
    compare_with_reference(model, make_batch(SAMPLES[:2]), check_grads=False)
    assert sum(kernel_calls.values()) == 0


def test_always_without_the_interpreter_says_how_to_fix_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # what interpreting() reads
    with pytest.raises(ZorroPatchError, match="fused_kernels='auto'"):
        fused.use_fused_kernels("always", torch.zeros(1))


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="fused_kernels must be one of"):
        ZorroSettings(fused_kernels="sometimes")  # type: ignore[arg-type]
