"""Plans for verl-style batches: deduplicated (shared prefixes packed once) or not (every sample its own tree)."""

from __future__ import annotations

from dataclasses import replace

import torch

from arctic_dedup import Plan, SampleLayout, build_plan_from_layout
from arctic_dedup.plan import PrefixSharing

__all__ = ["plan_batch", "responses_to_padded"]


def _unshared_plan(layout: SampleLayout) -> Plan:
    """A plan where no two samples share a token: each sample is one root node (packed varlen, no padding).

    Offsetting every sample's ids by ``sample * (max_id + 1)`` makes all prompts distinct for the planner; the real
    ids are put back afterwards (only the tree structure and maps are taken from the planner).
    """
    stride = int(layout.token_ids.max()) + 1
    distinct = layout.token_ids + layout.token_sample() * stride
    plan = build_plan_from_layout(replace(layout, token_ids=distinct), sharing="prompt")
    token_ids = layout.token_ids[plan.pack_map.gather_index]
    return replace(
        plan,
        layout=layout,
        token_ids=token_ids,
        responses=replace(plan.responses, labels=token_ids[plan.responses.token_index]),
    )


def plan_batch(
    input_ids: torch.Tensor,
    response_length: int,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    sharing: PrefixSharing = "prompt",
    deduplicate: bool = True,
) -> Plan:
    """The plan of a padded ``[B, S]`` batch whose last ``response_length`` columns are the responses.

    ``deduplicate=False`` gives the non-deduplicated packed stream (the baseline), with the same conventions.
    """
    layout = SampleLayout.from_padded(input_ids, response_length, attention_mask, position_ids)
    if not deduplicate:
        return _unshared_plan(layout)
    return build_plan_from_layout(layout, sharing=sharing)


def responses_to_padded(values: torch.Tensor, plan: Plan, response_width: int, fill_value: float = 0.0) -> torch.Tensor:
    """Packed per-response-token values ``[M]`` (original sample order) -> ``[B, response_width]``, left-aligned."""
    lengths = plan.layout.response_lengths
    offsets = plan.responses.offsets
    sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths)
    column = torch.arange(values.shape[0], device=values.device) - offsets[sample]
    out = values.new_full((lengths.numel(), response_width), fill_value)
    return out.index_put((sample, column), values)
