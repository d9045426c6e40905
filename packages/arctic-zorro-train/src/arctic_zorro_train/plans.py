"""Plans for verl-style batches: deduplicated (shared prefixes packed once) or not (every sample its own tree)."""

from __future__ import annotations

import torch

from arctic_dedup import Plan, build_plan
from arctic_dedup.plan import PrefixSharing

__all__ = ["plan_batch", "responses_to_padded"]


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

    ``arctic_dedup.build_plan`` with ``deduplicate=False`` mapped to ``sharing="none"``: the non-deduplicated packed
    stream (the baseline), with the same conventions.
    """
    return build_plan(
        input_ids, response_length, attention_mask, position_ids, sharing=sharing if deduplicate else "none"
    )


def responses_to_padded(values: torch.Tensor, plan: Plan, response_width: int, fill_value: float = 0.0) -> torch.Tensor:
    """Packed per-response-token values ``[M]`` (original sample order) -> ``[B, response_width]``, left-aligned."""
    lengths = plan.layout.response_lengths
    offsets = plan.responses.offsets
    sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths)
    column = torch.arange(values.shape[0], device=values.device) - offsets[sample]
    out = values.new_full((lengths.numel(), response_width), fill_value)
    return out.index_put((sample, column), values)
