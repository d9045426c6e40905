"""Reference twins of the planner's pieces: row grouping and the tree mask, plain and slow, for tests only."""

from __future__ import annotations

import torch

__all__ = ["reference_group_rows", "reference_tree_mask"]


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
