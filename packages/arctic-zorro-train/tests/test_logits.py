"""Logits modes (none / compute / memory), temperature, chunk sizes and fp32 logits give the same logprobs,
entropies and gradients; ``memory`` never materializes a [tokens, vocab] tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from arctic_zorro_train import token_logprobs


def _head_and_inputs(
    vocab: int = 50, hidden: int = 16, tokens: int = 23
) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    head = nn.Linear(hidden, vocab, bias=True)
    states = torch.randn(tokens, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    return head, states, labels


def _run(
    mode: str, chunk_size: int, temperature: float, fp32_logits: bool = False, hook_counts: list[int] | None = None
) -> dict[str, torch.Tensor]:
    head, states, labels = _head_and_inputs()
    if hook_counts is not None:
        # As DeepSpeed ZeRO-1/2 do: reduce each gradient when it is accumulated, which must happen once per backward.
        for parameter in head.parameters():
            parameter.register_post_accumulate_grad_hook(lambda _parameter: hook_counts.append(1))
    out = token_logprobs(
        states,
        labels,
        head,
        temperature=temperature,
        mode=mode,  # type: ignore[arg-type]
        calculate_entropy=True,
        chunk_size=chunk_size,
        fp32_logits=fp32_logits,
    )
    assert out.entropy is not None
    weights = torch.linspace(-1.0, 2.0, labels.numel())
    (out.logprobs * weights).sum().add((out.entropy * weights.flip(0)).sum()).backward()
    assert states.grad is not None and head.weight.grad is not None and head.bias.grad is not None
    return {
        "logprobs": out.logprobs.detach(),
        "entropy": out.entropy.detach(),
        "grad_states": states.grad,
        "grad_weight": head.weight.grad,
        "grad_bias": head.bias.grad,
    }


@pytest.mark.parametrize("mode", ["none", "compute", "memory"])
@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_modes_agree(mode: str, chunk_size: int, temperature: float) -> None:
    expected = _run("none", 1024, temperature)
    actual = _run(mode, chunk_size, temperature)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_memory_mode_for_zero3_sharded_heads_agrees(monkeypatch: pytest.MonkeyPatch, chunk_size: int) -> None:
    import arctic_zorro_train.logprobs as logprobs_module

    expected = _run("none", 1024, 0.8)
    monkeypatch.setattr(logprobs_module, "_needs_one_accumulation", lambda module: True)
    actual = _run("memory", chunk_size, 0.8)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_memory_mode_accumulates_hooked_head_gradients_once(chunk_size: int) -> None:
    expected = _run("none", 1024, 0.8)
    hook_counts: list[int] = []
    actual = _run("memory", chunk_size, 0.8, hook_counts=hook_counts)
    assert len(hook_counts) == 2  # weight and bias, once each
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_entropy_matches_its_definition() -> None:
    head, states, labels = _head_and_inputs()
    out = token_logprobs(states, labels, head, temperature=0.7, calculate_entropy=True)
    probabilities = torch.softmax(head(states).float() / 0.7, dim=-1)
    expected = -(probabilities * probabilities.log()).sum(-1)
    torch.testing.assert_close(out.entropy, expected)
    torch.testing.assert_close(out.logprobs, probabilities.log().gather(-1, labels[:, None]).squeeze(-1))


@pytest.mark.parametrize("mode", ["none", "compute", "memory"])
@pytest.mark.parametrize("fp32_logits", [False, True])
def test_float64_stays_float64(mode: str, fp32_logits: bool) -> None:
    """A float64 head and hidden states give float64 logprobs, entropies and gradients in every mode (nothing
    rounds through fp32, ``fp32_logits`` included), equal to the plain float64 computation."""
    head, states, labels = _head_and_inputs()
    head = head.double()
    states = states.detach().double().requires_grad_(True)
    weights = torch.linspace(-1.0, 2.0, labels.numel(), dtype=torch.float64)
    out = token_logprobs(
        states,
        labels,
        head,
        temperature=0.7,
        mode=mode,  # type: ignore[arg-type]
        calculate_entropy=True,
        chunk_size=5,
        fp32_logits=fp32_logits,
    )
    assert out.entropy is not None
    assert out.logprobs.dtype == out.entropy.dtype == torch.float64
    actual_grads = torch.autograd.grad((out.logprobs * weights).sum() + (out.entropy * weights.flip(0)).sum(), states)
    log_p = torch.log_softmax(head(states) / 0.7, dim=-1)
    expected_logprobs = log_p.gather(-1, labels[:, None]).squeeze(-1)
    expected_entropy = -(log_p.exp() * log_p).sum(-1)
    expected_grads = torch.autograd.grad(
        (expected_logprobs * weights).sum() + (expected_entropy * weights.flip(0)).sum(), states
    )
    torch.testing.assert_close(out.logprobs, expected_logprobs, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.entropy, expected_entropy, rtol=0, atol=1e-12)
    torch.testing.assert_close(actual_grads[0], expected_grads[0], rtol=0, atol=1e-12)
    assert token_logprobs(states[:0], labels[:0], head, mode=mode).logprobs.dtype == torch.float64  # type: ignore[arg-type]


def test_fp32_logits_run_the_head_in_fp32() -> None:
    head, states, labels = _head_and_inputs()
    head = head.to(torch.bfloat16)
    low = token_logprobs(states.detach().bfloat16(), labels, head)
    high = token_logprobs(states.detach().bfloat16(), labels, head, fp32_logits=True)
    assert high.logits is not None and high.logits.dtype == torch.float32
    assert low.logits is not None and low.logits.dtype == torch.bfloat16
    exact = torch.log_softmax(states.detach().bfloat16().float() @ head.weight.float().t() + head.bias.float(), -1)
    expected = exact.gather(-1, labels[:, None]).squeeze(-1)
    assert (high.logprobs - expected).abs().max() < (low.logprobs - expected).abs().max()


def test_memory_mode_never_builds_a_full_logits_tensor() -> None:
    head, states, labels = _head_and_inputs(vocab=64, tokens=40)
    largest = 0

    def track(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
        nonlocal largest
        largest = max(largest, output.shape[0])

    head.register_forward_hook(track)
    out = token_logprobs(states, labels, head, mode="memory", chunk_size=8, calculate_entropy=True)
    assert out.logits is None
    out.logprobs.sum().backward()
    assert largest == 8


def test_bad_arguments_are_explained() -> None:
    head, states, labels = _head_and_inputs()
    with pytest.raises(ValueError, match="logits mode"):
        token_logprobs(states, labels, head, mode="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(states, labels, head, temperature=0.0)
