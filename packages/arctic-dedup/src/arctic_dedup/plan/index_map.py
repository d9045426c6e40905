"""Row index maps: ``out[i] = src[gather_index[i]]`` plus the transpose needed to run the map backwards."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["IndexMap", "ranges_to_index"]


def ranges_to_index(starts: torch.Tensor, lengths: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Concatenate the integer ranges ``[starts[i], starts[i] + lengths[i])`` into one ``[sum(lengths)]`` tensor."""
    starts = starts.long()
    lengths = lengths.long()
    if total is None:
        total = int(lengths.sum())
    owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=total)
    range_begin = torch.cumsum(lengths, 0) - lengths
    return starts[owner] + torch.arange(total, device=lengths.device) - range_begin[owner]


@dataclass(frozen=True)
class IndexMap:
    """A gather from ``num_sources`` rows to ``num_outputs`` rows, and its transpose in CSR form.

    gather_index ``[num_outputs]`` int64: the source row of every output row, or -1 (the output row is a fill
    value). copies_offsets ``[num_sources + 1]`` and copies_index ``[nnz]``: for source row ``s``, the output rows
    that copy it are ``copies_index[copies_offsets[s]:copies_offsets[s + 1]]`` (ascending). The transpose lets the
    backward pass sum the copies of each source row without atomics, so it is deterministic, and lets the forward
    read each source row once and write all its copies. fill_index ``[num_outputs - nnz]``: the output rows with no
    source (ascending).
    """

    gather_index: torch.Tensor
    num_sources: int
    copies_offsets: torch.Tensor
    copies_index: torch.Tensor
    max_copies: int
    fill_index: torch.Tensor

    @property
    def num_outputs(self) -> int:
        return int(self.gather_index.shape[0])

    @staticmethod
    def build(gather_index: torch.Tensor, num_sources: int) -> IndexMap:
        gather_index = gather_index.long()
        valid = gather_index >= 0
        # Invalid outputs sort after every real source and are cut off below.
        sort_key = torch.where(valid, gather_index, num_sources)
        order = torch.argsort(sort_key, stable=True)
        counts = torch.bincount(gather_index[valid], minlength=num_sources)
        offsets = torch.zeros(num_sources + 1, dtype=torch.long, device=gather_index.device)
        offsets[1:] = counts.cumsum(0)
        nnz = int(offsets[-1])
        max_copies = int(counts.max()) if num_sources > 0 else 0
        return IndexMap(
            gather_index=gather_index,
            num_sources=num_sources,
            copies_offsets=offsets,
            copies_index=order[:nnz],
            max_copies=max_copies,
            fill_index=order[nnz:],
        )
