"""Reference twins of the row ops behind pack / unpack: plain, obviously correct (and slow), for tests only."""

from __future__ import annotations

import torch

__all__ = ["reference_gather_rows", "reference_segment_sum_rows"]


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
