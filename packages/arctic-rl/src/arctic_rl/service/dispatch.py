"""How one request is spread over several engines and their answers put back together: prompts in contiguous
chunks over the sampling replicas, a batch's rows over the data-parallel ranks (whole prompt groups, balanced by
deduplicated tokens), and per-row results back into the request's row order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from arctic_rl.errors import BatchValidationError

__all__ = ["contiguous_chunks", "merge_rows", "split_for_data_parallel"]


def contiguous_chunks(count: int, parts: int) -> list[tuple[int, slice]]:
    """``(part, chunk)`` for every non-empty one of ``parts`` contiguous, near-equal chunks of ``count`` items: the
    chunks' answers concatenated in part order keep the items' order."""
    bounds = [round(i * count / parts) for i in range(parts + 1)]
    return [(part, slice(bounds[part], bounds[part + 1])) for part in range(parts) if bounds[part + 1] > bounds[part]]


def split_for_data_parallel(batch: Mapping[str, torch.Tensor], num_ranks: int) -> list[list[int]]:
    """Each data-parallel rank's sample indices (ascending), whole prompt groups balanced by deduplicated tokens."""
    from arctic_dedup.balance import partition_for_data_parallel
    from arctic_rl.engines.policy_forward import batch_prompt_groups

    if num_ranks == 1:
        return [list(range(int(batch["input_ids"].shape[0])))]
    groups = batch_prompt_groups(batch)
    if len(groups) < num_ranks:
        raise BatchValidationError(
            "input_ids",
            f"the batch has {len(groups)} distinct prompts and training runs {num_ranks} data-parallel ranks; every "
            f"rank needs at least one whole prompt group. Send at least {num_ranks} prompts per step.",
        )
    return partition_for_data_parallel(groups, num_ranks)


def merge_rows(
    rows: int, shares: Sequence[Sequence[int]], results: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Per-row results of the ranks (``results[i]`` answers the rows ``shares[i]``, in that order) as one
    ``[rows, ...]`` tensor per key, in the request's row order."""
    merged: dict[str, torch.Tensor] = {}
    for share, result in zip(shares, results, strict=True):
        index = torch.tensor(share, dtype=torch.long)
        for key, value in result.items():
            if key not in merged:
                merged[key] = torch.zeros((rows, *value.shape[1:]), dtype=value.dtype)
            merged[key][index] = value
    return merged
