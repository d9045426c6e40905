"""The plain per-sample reference run that deduplicated results are compared with (logprobs, entropies, router logits
and the policy loss), the small GRPO-like batches it runs on, gradient errors and the float64 mode: the parity
harness"s runtime (``check_parity``, the guard"s self-check) and the tests" reference."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from arctic_zorro_train.families import resolve_architecture
from arctic_zorro_train.loss import ppo_policy_loss
from arctic_zorro_train.moe import collect_router_logits

__all__ = [
    "ReferenceOutputs",
    "Sample",
    "collect_grads",
    "float64_everywhere",
    "float64_recurrent_gated_delta_rule",
    "gradient_errors",
    "long_samples",
    "make_batch",
    "model_precision",
    "per_sample_reference",
    "reference_loss",
    "relative_error",
]


@dataclass(frozen=True)
class ReferenceOutputs:
    """Per-sample reference: logprobs / entropy ``[M]`` in sample order, router logits per MoE layer concatenated
    over samples (``[N, E]``, N = all valid tokens of all samples)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    router_logits: tuple[torch.Tensor, ...]


def _moe_routers(model: nn.Module) -> list[nn.Module]:
    table = resolve_architecture(model)
    return [module for module in model.modules() if type(module).__name__ in table.router_classes]


def per_sample_reference(
    model: nn.Module, batch: Mapping[str, torch.Tensor], response_length: int, temperature: float = 1.0
) -> ReferenceOutputs:
    """Run the plain model on each sample's valid tokens alone (its own position ids) and read the response
    tokens' logprobs and entropies: what a deduplicated forward must reproduce. Keeps the autograd graph."""
    logprobs: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    per_layer: list[list[torch.Tensor]] = []
    mask = batch["attention_mask"].bool()
    for row in range(mask.shape[0]):
        valid = mask[row]
        ids = batch["input_ids"][row][valid].unsqueeze(0)
        positions = batch["position_ids"][row][valid].unsqueeze(0)
        prompt = int(valid[: valid.shape[0] - response_length].sum())
        total = int(valid.sum())
        with collect_router_logits(_moe_routers(model)) as router_logits:
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        # fp32 softmax like the deduplicated run (float64 for a float64 model).
        scaled = logits[prompt - 1 : total - 1].to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        log_p = torch.log_softmax(scaled, dim=-1)
        logprobs.append(log_p.gather(-1, ids[0, prompt:total, None]).squeeze(-1))
        entropies.append(-(log_p.exp() * log_p).sum(-1))
        for layer, layer_logits in enumerate(router_logits):
            if layer == len(per_layer):
                per_layer.append([])
            per_layer[layer].append(layer_logits)
    return ReferenceOutputs(
        logprobs=torch.cat(logprobs),
        entropy=torch.cat(entropies),
        router_logits=tuple(torch.cat(layer) for layer in per_layer),
    )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` (absolute error when ``expected`` is zero)."""
    difference = float((actual.double() - expected.double()).norm())
    scale = float(expected.double().norm())
    return difference / scale if scale > 0 else difference


def gradient_errors(model: nn.Module, reference_grads: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Relative L2 error of every parameter gradient against ``reference_grads`` (name -> gradient)."""
    errors = {}
    for name, parameter in model.named_parameters():
        if name not in reference_grads:
            continue
        grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
        errors[name] = relative_error(grad, reference_grads[name])
    return errors


def collect_grads(model: nn.Module, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Clone every parameter's gradient (zeros where none)."""
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if names is None or name in names
    }


def float64_recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **unused: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token in float64 (the chunked fp32 kernels' reference twin).

    Same arguments and shapes as transformers' ``torch_chunk_gated_delta_rule`` (``[B, T, H, D]``). Its rounding
    does not depend on where a sequence is cut, so a prefix computed once and continued from its final state is
    bitwise the prefix of the whole-sequence run: the twin the tree's state passing is tested against.
    """
    out_dtype = query.dtype
    q, k, v, beta64, decay = (x.transpose(1, 2).double() for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    batch, heads, length, key_dim = k.shape
    state = (
        torch.zeros(batch, heads, key_dim, v.shape[-1], dtype=torch.float64, device=q.device)
        if initial_state is None
        else initial_state.double()
    )
    outputs = []
    for t in range(length):
        state = state * decay[:, :, t].exp()[..., None, None]
        predicted = (state * k[:, :, t, :, None]).sum(dim=-2)
        delta = (v[:, :, t] - predicted) * beta64[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((state * q[:, :, t, :, None]).sum(dim=-2))
    out = torch.stack(outputs, dim=2).transpose(1, 2).to(out_dtype)
    return out, (state if output_final_state else None)


def _float64_for_float32(value: Any) -> Any:
    return torch.float64 if value is torch.float32 else value


class _Float64Everywhere(TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        elif func in (torch.Tensor.to, torch.Tensor.type):
            args = [args[0], *(_float64_for_float32(value) for value in args[1:])]
        if kwargs:
            kwargs = {name: _float64_for_float32(value) for name, value in kwargs.items()}
        return func(*args, **(kwargs or {}))


@contextmanager
def float64_everywhere() -> Iterator[None]:
    """Within the block, every request for fp32 gives float64: ``.float()``, ``.to(torch.float32)``,
    ``dtype=torch.float32`` (casts, factories, ``softmax(dtype=...)``).

    transformers computes some pieces in fp32 whatever the model's dtype (RMSNorm, eager attention's softmax, RoPE,
    Gated DeltaNet's decay and chunked kernel, the MoE load-balancing loss): an upcast for bf16 models but a
    *downcast* for float64 ones, which would leave fp32 rounding in a float64 run. Inside this block a float64
    model computes everything in float64, the deduplicated run and the plain per-sample run alike, so the two agree
    to float64 rounding (at most 1.1e-14 relative in this package's tests, gradients with heavy cancellation
    included).

    Wrap forward and backward passes, not setup code that allocates fp32 buffers on purpose (an optimizer's state,
    a DeepSpeed engine's gradient partitions): those would come out float64 too.
    """
    with _Float64Everywhere():
        yield


def model_precision(model: nn.Module) -> AbstractContextManager[None]:
    """``float64_everywhere`` for a float64 model (a float64 run with no fp32 step), nothing otherwise."""
    return float64_everywhere() if next(model.parameters()).dtype == torch.float64 else nullcontext()


@dataclass(frozen=True)
class Sample:
    """One sample's valid prompt and response token ids (no padding)."""

    prompt: Sequence[int]
    response: Sequence[int]


def make_batch(
    samples: Sequence[Sample],
    *,
    extra_prompt_padding: int = 0,
    extra_response_padding: int = 0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A verl batch (left-padded prompts, right-padded responses) with random training fields."""
    prompt_width = max(len(s.prompt) for s in samples) + extra_prompt_padding
    response_width = max(len(s.response) for s in samples) + extra_response_padding
    batch_size = len(samples)
    input_ids = torch.zeros(batch_size, prompt_width + response_width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, sample in enumerate(samples):
        start = prompt_width - len(sample.prompt)
        input_ids[row, start:prompt_width] = torch.tensor(sample.prompt)
        mask[row, start:prompt_width] = 1
        input_ids[row, prompt_width : prompt_width + len(sample.response)] = torch.tensor(sample.response)
        mask[row, prompt_width : prompt_width + len(sample.response)] = 1
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, response_width)
    old = -torch.rand(shape, generator=generator) * 5.0
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp_min(0),
        "responses": input_ids[:, prompt_width:],
        "response_mask": mask[:, prompt_width:],
        "old_log_probs": old,
        "advantages": torch.randn(shape, generator=generator),
        "ref_log_prob": old + 0.1 * torch.randn(shape, generator=generator),
    }


def long_samples(seed: int = 7) -> list[Sample]:
    """A GRPO-like batch layout: prompt groups of three, two and one (non-contiguous), every sequence 25-32 tokens
    long, token ids in [1, 120). Long enough that fp32 rounding stays far below the 1e-5 parity bound."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(length: int) -> list[int]:
        return torch.randint(1, 120, (length,), generator=generator).tolist()

    first, second, third = tokens(20), tokens(16), tokens(24)
    return [
        Sample(first, tokens(12)),
        Sample(second, tokens(9)),
        Sample(first, tokens(10)),
        Sample(third, tokens(8)),
        Sample(second, tokens(12)),
        Sample(first, tokens(11)),
    ]


def reference_loss(
    model: Any, batch: Mapping[str, torch.Tensor], *, temperature: float = 1.0, kl_coef: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, logprobs, entropy) of the plain model run per sample, with ``DeduplicatedActor``'s loss: token-mean
    PPO clip loss, k1 KL, and the MoE aux loss when the config outputs router logits. The loss keeps its graph."""
    width = batch["responses"].shape[1]
    reference = per_sample_reference(model, batch, width, temperature)
    valid = batch["attention_mask"][:, -width:].bool()
    loss, _ = ppo_policy_loss(
        reference.logprobs,
        batch["old_log_probs"][valid],
        batch["advantages"][valid],
        batch["response_mask"][valid].float(),
        ref_logprobs=batch["ref_log_prob"][valid],
        kl_coef=kl_coef,
    )
    config = model.config.get_text_config()
    if reference.router_logits and getattr(config, "output_router_logits", False):
        modeling = sys.modules[type(model).__module__]
        aux = modeling.load_balancing_loss_func(reference.router_logits, config.num_experts, config.num_experts_per_tok)
        loss = loss + config.router_aux_loss_coef * aux
    return loss, reference.logprobs.detach(), reference.entropy.detach()
