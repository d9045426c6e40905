"""Reference twins: plain, obviously correct (and slow) versions of the fast ops, for tests.

Nothing here is used on a hot path. Each function mirrors a fast op elsewhere in the package.
"""

from __future__ import annotations

import torch

__all__ = [
    "reference_gather_rows",
    "reference_group_rows",
    "reference_segment_sum_rows",
    "reference_tree_mask",
]


def reference_gather_rows(src: torch.Tensor, gather_index: torch.Tensor, fill_value: float = 0.0) -> torch.Tensor:
    """Twin of ``gather_rows``: row by row, in float64."""
    rows = []
    source = src.double()
    for index in gather_index.tolist():
        rows.append(source[index] if index >= 0 else torch.full_like(source[0], fill_value))
    if not rows:
        return src.new_empty((0, *src.shape[1:]))
    return torch.stack(rows).to(src.dtype)


def reference_segment_sum_rows(src: torch.Tensor, gather_index: torch.Tensor, num_sources: int) -> torch.Tensor:
    """Twin of ``segment_sum_rows``: every source row gets the float64 sum of the rows that copy it."""
    out = torch.zeros((num_sources, *src.shape[1:]), dtype=torch.float64, device=src.device)
    for row, index in enumerate(gather_index.tolist()):
        if index >= 0:
            out[index] += src[row].double()
    return out.to(src.dtype)


def reference_group_rows(rows: torch.Tensor) -> list[list[int]]:
    """Twin of ``group_rows``: quadratic comparison; groups in order of first appearance, members ascending."""
    groups: list[list[int]] = []
    for row in range(rows.shape[0]):
        for group in groups:
            if torch.equal(rows[group[0]], rows[row]):
                group.append(row)
                break
        else:
            groups.append([row])
    return groups


def reference_tree_mask(packed_sequences: list[list[int]]) -> torch.Tensor:
    """Twin of ``dense_tree_mask`` from first principles: key k is visible to query q when some sample contains
    both packed positions with k at or before q. ``packed_sequences[b]`` lists sample b's packed positions in order.
    """
    total = 1 + max((max(seq) for seq in packed_sequences if seq), default=-1)
    mask = torch.zeros((total, total), dtype=torch.bool)
    for seq in packed_sequences:
        for i, query in enumerate(seq):
            for key in seq[: i + 1]:
                mask[query, key] = True
    return mask
