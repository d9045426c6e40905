"""Exact grouping of equal rows: hash every row, group by hash, then verify every member against its group's first.

Hash collisions can merge different rows; the verification catches that and falls back to an exact sort-based
grouping, so the result is always exact. Everything is vectorized on the rows' device (no O(B^2) loops).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from arctic_dedup.plan.layout import SampleLayout

__all__ = ["RowGroups", "group_prompts", "group_rows", "hash_int64"]

# Odd 64-bit multipliers (as signed int64) for a splitmix64-style finalizer.
_MIX_1 = 0x5851F42D4C957F2D
_MIX_2 = 0x14057B7EF767814F
_GOLDEN = 0x1E3779B97F4A7C15


def _as_signed_int64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def hash_int64(values: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Scramble int64 values (wrapping arithmetic); equal inputs give equal outputs. Same shape as ``values``."""
    x = values.long() ^ _as_signed_int64(seed * _GOLDEN + 0x2545F4914F6CDD1D)
    x = (x ^ (x >> 31)) * _MIX_1
    x = (x ^ (x >> 29)) * _MIX_2
    return x ^ (x >> 32)


@dataclass(frozen=True)
class RowGroups:
    """Groups of equal rows, listed in order of first appearance.

    group_index ``[B]``: the group of every row; first_member ``[G]``: the first row of each group;
    group_sizes ``[G]``.
    """

    group_index: torch.Tensor
    first_member: torch.Tensor
    group_sizes: torch.Tensor

    @property
    def num_groups(self) -> int:
        return int(self.first_member.shape[0])

    def members(self) -> list[list[int]]:
        """Each group's rows, ascending (one host transfer)."""
        order = torch.argsort(self.group_index, stable=True)
        sizes = self.group_sizes.tolist()
        return [chunk.tolist() for chunk in torch.split(order, sizes)] if sizes else []


def _relabel_by_first_appearance(inverse: torch.Tensor, num_labels: int) -> RowGroups:
    rows = inverse.shape[0]
    row_ids = torch.arange(rows, device=inverse.device)
    first = torch.full((num_labels,), rows, dtype=torch.long, device=inverse.device)
    first = first.scatter_reduce(0, inverse, row_ids, reduce="amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(num_labels, device=inverse.device)
    group_index = rank[inverse]
    sizes = torch.bincount(group_index, minlength=num_labels)
    return RowGroups(group_index=group_index, first_member=first[order], group_sizes=sizes)


def group_rows(rows: torch.Tensor, seed: int = 0) -> RowGroups:
    """Group identical rows of an integer matrix ``[B, W]`` exactly.

    Rows are equal when every column is equal. Groups come in order of first appearance; members need not be
    contiguous. Cost: one hash pass over the matrix, one sort of ``B`` hashes, one verification pass.
    """
    if rows.dim() != 2:
        raise ValueError(f"group_rows expects a [B, W] matrix, got shape {tuple(rows.shape)}")
    num_rows, width = rows.shape
    if num_rows == 0:
        empty = torch.empty(0, dtype=torch.long, device=rows.device)
        return RowGroups(empty, empty, empty)
    column_salt = hash_int64(torch.arange(width, device=rows.device), seed=seed + 1)
    row_hash = hash_int64(rows.long() ^ column_salt, seed=seed).sum(dim=1)
    unique_hash, inverse = torch.unique(row_hash, return_inverse=True)
    groups = _relabel_by_first_appearance(inverse, int(unique_hash.shape[0]))
    representative = rows[groups.first_member[groups.group_index]]
    if bool((representative == rows).all()):
        return groups
    # A hash collision merged different rows: fall back to an exact lexicographic grouping.
    unique_rows, inverse = torch.unique(rows, dim=0, return_inverse=True)
    return _relabel_by_first_appearance(inverse, int(unique_rows.shape[0]))


def group_prompts(layout: SampleLayout, padded_prompts: torch.Tensor | None = None) -> RowGroups:
    """The samples of ``layout`` that share a prompt: the one definition of "the same prompt" for every planner,
    balancer and facade in these packages (and arctic-rl's, which builds on them).

    Two samples share a prompt when their prompts have the same valid token ids, position ids and length.
    ``padded_prompts`` ``[B, P]`` (a padded batch's prompt block): they must also hold the same ids at padding, for
    a caller that copies the padded block of a group's first sample for all of them (the seed facade).
    """
    key = layout.prompt_key_rows()
    if padded_prompts is not None:
        key = torch.cat([key, padded_prompts.long().to(key.device)], dim=1)
    return group_rows(key)
