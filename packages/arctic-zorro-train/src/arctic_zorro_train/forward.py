"""The deduplicated forward: one pass of the backbone over the packed stream, then per-response-token outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from arctic_dedup import Plan
from arctic_zorro_train.context import CONTEXT_KWARG, build_context, layer_attention
from arctic_zorro_train.errors import ZorroPatchError
from arctic_zorro_train.fused import use_fused_kernels
from arctic_zorro_train.logprobs import LogitsMode, token_logprobs
from arctic_zorro_train.moe import collect_router_logits, router_statistics
from arctic_zorro_train.patch_record import get_patch
from arctic_zorro_train.plans import plan_batch, responses_to_padded

__all__ = ["ZorroOutput", "zorro_forward", "zorro_model_forward"]


@dataclass(frozen=True)
class ZorroOutput:
    """Outputs over the valid response tokens of every sample, in the original sample order (``M`` tokens).

    logprobs ``[M]`` and entropy ``[M]`` (or None) in fp32 (float64 for a float64 model); logits ``[M, V]``
    (logits mode ``"none"`` only) are the raw logits predicting each response token; response_offsets ``[B+1]``:
    sample ``b`` owns ``[response_offsets[b], response_offsets[b+1])``. MoE models also give aux_loss (scalar, the
    load-balancing loss of the non-deduplicated batch, not yet scaled by ``router_aux_loss_coef``), expert_load
    ``[L, E]`` and router_probability ``[L, E]`` (same dtype as logprobs).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    logits: torch.Tensor | None
    response_offsets: torch.Tensor
    plan: Plan
    aux_loss: torch.Tensor | None = None
    expert_load: torch.Tensor | None = None
    router_probability: torch.Tensor | None = None

    def padded(self, values: torch.Tensor, response_width: int, fill_value: float = 0.0) -> torch.Tensor:
        """Packed ``[M]`` values -> ``[B, response_width]`` (verl's response layout)."""
        return responses_to_padded(values, self.plan, response_width, fill_value)


def _empty_mask(device: torch.device) -> torch.Tensor:
    # transformers returns a 4D attention mask as-is, so no [T, T] mask is ever built for the packed stream.
    return torch.ones((1, 1, 0, 0), dtype=torch.bool, device=device)


def _compute_dtype(backbone: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype the attention layers compute in: autocast's when it is on, else the embedding weights'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    embeddings: Any = backbone.embed_tokens
    dtype: torch.dtype = embeddings.weight.dtype
    return dtype


def zorro_forward(
    model: nn.Module,
    plan: Plan,
    *,
    temperature: float | None = None,
    calculate_entropy: bool = False,
    logits_mode: LogitsMode | None = None,
) -> ZorroOutput:
    """Run a patched model once over ``plan``'s packed stream. Settings default to the patch's."""
    patch = get_patch(model)
    # A train()/eval() switch may have dropped patched layer forwards (transformers 5.25's kernelize): without them
    # the Gated DeltaNet layers would run over the packed stream as one sequence.
    patch.reinstall_layer_forwards()
    settings = patch.settings
    config = patch.text_config
    conv_width = getattr(config, "linear_conv_kernel_dim", None) if patch.linear_attention_modules else None
    grad_possible = torch.is_grad_enabled() and any(p.requires_grad for p in patch.backbone.parameters())
    context = build_context(
        plan,
        attention_backend=settings.attention_backend,
        attention=layer_attention(config, _compute_dtype(patch.backbone, plan.device), grad_possible),
        conv_width=conv_width,
        needs_reconstruct=patch.needs_reconstruct,
    )
    device = plan.device
    with collect_router_logits(patch.routers) as router_logits:
        outputs = patch.backbone(
            input_ids=plan.token_ids.unsqueeze(0),
            position_ids=plan.position_ids.unsqueeze(0),
            attention_mask=_empty_mask(device),
            use_cache=False,
            **{CONTEXT_KWARG: context},
        )
    hidden = outputs[0].squeeze(0)  # a view both ways (outputs[0][0]'s backward zero-fills [1, T, d] and copies)
    responses = plan.responses
    mode = settings.logits_mode if logits_mode is None else logits_mode
    # Only the "memory" mode has fused log-prob kernels: the other modes never ask (so "always" cannot refuse them).
    fused = mode == "memory" and use_fused_kernels(settings.fused_kernels, hidden)
    tokens = token_logprobs(
        hidden.index_select(0, responses.predictor_index),
        responses.labels,
        patch.lm_head,
        temperature=settings.temperature if temperature is None else temperature,
        mode=mode,
        calculate_entropy=calculate_entropy,
        chunk_size=settings.logits_chunk_size,
        fp32_logits=settings.fp32_logits,
        fused=fused,
    )
    statistics = None
    if patch.routers:
        statistics = router_statistics(
            router_logits, plan.multiplicity, num_experts=config.num_experts, top_k=config.num_experts_per_tok
        )
    return ZorroOutput(
        logprobs=tokens.logprobs,
        entropy=tokens.entropy,
        logits=tokens.logits,
        response_offsets=responses.offsets,
        plan=plan,
        aux_loss=None if statistics is None else statistics.aux_loss,
        expert_load=None if statistics is None else statistics.expert_load,
        router_probability=None if statistics is None else statistics.router_probability,
    )


# Keyword arguments of a plain transformers forward that a deduplicated forward accepts and ignores.
_IGNORED_KWARGS = frozenset({"use_cache", "return_dict", "output_attentions", "output_hidden_states", "logits_to_keep"})


def zorro_model_forward(
    model: nn.Module,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    responses: torch.Tensor | None = None,
    response_length: int | None = None,
    temperature: float | None = None,
    calculate_entropy: bool = False,
    plan: Plan | None = None,
    **kwargs: Any,
) -> ZorroOutput:
    """The forward a patched model's ``model(...)`` runs: plan the padded batch, then ``zorro_forward``.

    The response width is ``response_length``, else ``responses.shape[1]``, else the patch's ``response_length``.
    """
    unknown = set(kwargs) - _IGNORED_KWARGS
    if unknown:
        raise TypeError(
            f"the deduplicated forward got unexpected keyword arguments {sorted(unknown)}; it takes input_ids, "
            "attention_mask, position_ids, responses, response_length, temperature, calculate_entropy and plan."
        )
    patch = get_patch(model)
    if plan is None:
        if input_ids is None:
            raise ValueError("pass input_ids [B, S] (or a prebuilt plan=...).")
        width = response_length
        if width is None and responses is not None:
            width = int(responses.shape[1])
        if width is None:
            width = patch.settings.response_length
        if width is None:
            raise ZorroPatchError(
                "the response width is unknown: pass response_length=R or responses=[B, R], or patch with "
                "Qwen3ModelOncePatcher(model).patch(response_len=R, ...)."
            )
        plan = plan_batch(
            input_ids,
            width,
            attention_mask,
            position_ids,
            sharing=patch.settings.sharing,
            deduplicate=patch.settings.deduplicate,
        )
    return zorro_forward(model, plan, temperature=temperature, calculate_entropy=calculate_entropy)
