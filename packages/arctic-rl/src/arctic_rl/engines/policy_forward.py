"""The response-token forward both DeepSpeed engines run, and how they cut a batch into micro-batches.

Two forwards give the same numbers: ZoRRO (the model patched by arctic-zorro-train runs each shared prompt once)
and the plain padded forward of the unpatched model. Both return per-response-token log-probs ``[b, R]`` aligned with
``batch["responses"]`` (0 where ``response_mask`` is 0), computed in fp32 from logits divided by the temperature.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from arctic_dedup.balance import PromptGroup, partition_items, plan_micro_batches, prompt_groups
from arctic_dedup.plan.layout import SampleLayout, default_position_ids

__all__ = [
    "EngineMicroBatches",
    "ResponseOutputs",
    "batch_prompt_groups",
    "forward_responses",
    "plan_engine_micro_batches",
    "select_samples",
]

Batch = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class ResponseOutputs:
    """log_probs ``[b, R]`` fp32 (0 at padding), entropy ``[b, R]`` or None."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None


def _position_ids(batch: Batch) -> torch.Tensor:
    position_ids = batch.get("position_ids")
    return default_position_ids(batch["attention_mask"]) if position_ids is None else position_ids


def forward_responses(
    model_call: Callable[..., Any],
    batch: Batch,
    *,
    zorro: bool,
    temperature: float,
    calculate_entropy: bool,
) -> ResponseOutputs:
    """Run ``model_call`` (a DeepSpeed engine or module; patched by ZoRRO when ``zorro``) on a padded batch.

    The batch's tensors must already be on the model's device. Keeps the autograd graph when grad is enabled.
    """
    responses = batch["responses"]
    width = int(responses.shape[1])
    mask = batch["response_mask"].bool()
    position_ids = _position_ids(batch)
    if zorro:
        output = model_call(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=position_ids,
            responses=responses,
            temperature=temperature,
            calculate_entropy=calculate_entropy,
        )
        log_probs = output.padded(output.logprobs, width)
        entropy = output.padded(output.entropy, width) if calculate_entropy else None
    else:
        # Only the last R + 1 positions are needed: position P - 1 + t predicts response token t.
        output = model_call(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=width + 1,
        )
        logits = output.logits[:, :-1, :]
        scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        all_log_probs = torch.log_softmax(scaled, dim=-1)
        log_probs = all_log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        entropy = -(all_log_probs.exp() * all_log_probs).sum(-1) if calculate_entropy else None
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    return ResponseOutputs(
        log_probs=torch.where(mask, log_probs, zero),
        entropy=None if entropy is None else torch.where(mask, entropy, zero),
    )


def batch_prompt_groups(batch: Batch) -> list[PromptGroup]:
    """The padded batch's prompt groups, by arctic-dedup's one definition of samples that share a prompt: what the
    service's data-parallel split and the engines' micro-batches both keep whole."""
    layout = SampleLayout.from_padded(
        batch["input_ids"], int(batch["responses"].shape[1]), batch["attention_mask"], batch.get("position_ids")
    )
    return prompt_groups(layout)


@dataclass(frozen=True)
class EngineMicroBatches:
    """Sample indices of each micro-batch (ascending inside one), and the batch's token counts without and with
    deduplication (prompt tokens counted once per sample / once per micro-batch group)."""

    samples: tuple[tuple[int, ...], ...]
    base_tokens: int
    dedup_tokens: int


def _cap_samples(groups: Sequence[PromptGroup], max_samples: int) -> list[list[PromptGroup]]:
    # First-fit decreasing by sample count; a group with more samples than the cap is cut into cap-sized parts.
    pieces: list[PromptGroup] = []
    for group in groups:
        for start in range(0, len(group.samples), max_samples):
            pieces.append(
                PromptGroup(
                    samples=group.samples[start : start + max_samples],
                    prompt_length=group.prompt_length,
                    response_lengths=group.response_lengths[start : start + max_samples],
                )
            )
    pieces.sort(key=lambda piece: -len(piece.samples))
    bins: list[list[PromptGroup]] = []
    for piece in pieces:
        for contents in bins:
            if sum(len(other.samples) for other in contents) + len(piece.samples) <= max_samples:
                contents.append(piece)
                break
        else:
            bins.append([piece])
    return bins


def plan_engine_micro_batches(
    batch: Batch,
    *,
    token_budget: int,
    num_micro_batches: int | None = None,
    max_samples: int | None = None,
    deduplicated: bool = True,
) -> EngineMicroBatches:
    """Cut a padded batch into micro-batches without splitting a prompt group (arctic-dedup's balancing).

    ``num_micro_batches`` set: that many micro-batches (fewer when the batch has fewer prompt groups), balanced by
    deduplicated tokens. Otherwise as many as the ``token_budget`` (deduplicated tokens per micro-batch) needs; a
    group larger than the budget is split with a warning. ``max_samples`` caps the samples of one micro-batch.
    ``deduplicated=False`` (ZoRRO off: every sample runs its own prompt copy) plans each sample as its own group,
    so budgets and balance count the tokens the model really runs and ``dedup_tokens == base_tokens``.
    """
    groups = batch_prompt_groups(batch)
    if not deduplicated:
        groups = [
            PromptGroup(samples=(sample,), prompt_length=group.prompt_length, response_lengths=(length,))
            for group in groups
            for sample, length in zip(group.samples, group.response_lengths, strict=True)
        ]
    if num_micro_batches is not None:
        parts = partition_items([group.dedup_tokens for group in groups], num_micro_batches)
        grouped = [[groups[index] for index in part] for part in parts if part]
    else:
        planned = plan_micro_batches(groups, token_budget)
        grouped = [_restrict_groups(groups, set(micro_batch.samples)) for micro_batch in planned]
    if max_samples is not None:
        grouped = [capped for contents in grouped for capped in _cap_samples(contents, max_samples)]
    samples = tuple(tuple(sorted(sample for group in contents for sample in group.samples)) for contents in grouped)
    return EngineMicroBatches(
        samples=samples,
        base_tokens=sum(group.base_tokens for group in groups),
        dedup_tokens=sum(group.dedup_tokens for contents in grouped for group in contents),
    )


def _restrict_groups(groups: Sequence[PromptGroup], members: set[int]) -> list[PromptGroup]:
    # The prompt groups (or the parts of split groups) a planned micro-batch holds.
    restricted = []
    for group in groups:
        kept = [i for i, sample in enumerate(group.samples) if sample in members]
        if kept:
            restricted.append(
                PromptGroup(
                    samples=tuple(group.samples[i] for i in kept),
                    prompt_length=group.prompt_length,
                    response_lengths=tuple(group.response_lengths[i] for i in kept),
                )
            )
    return restricted


def select_samples(batch: Batch, samples: Sequence[int], device: torch.device) -> dict[str, torch.Tensor]:
    """The rows ``samples`` of every ``[B, ...]`` tensor of the batch (all on one device), on ``device``."""
    index = torch.tensor(list(samples), dtype=torch.long, device=batch["input_ids"].device)
    return {name: value.index_select(0, index).to(device) for name, value in batch.items()}
