"""The plan as the ``sdpa`` backend's attention calls: host integers, built once per plan (one device sync)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from arctic_dedup.plan import Plan

__all__ = ["SdpaCalls", "SdpaCross", "SdpaRun", "build_sdpa_calls"]


@dataclass(frozen=True)
class SdpaRun:
    """Causal self-attention of consecutive nodes that have no descendant tokens (sibling responses, or nodes on
    their own), or of one node that has: rows ``[start, stop)``, one batched call. Equal lengths: a view of the
    packed stream. Ragged: FlashAttention-2 varlen over the rows on CUDA (``cu_seqlens`` set), a padded batch
    elsewhere (``padded_rows`` ``[n, longest]``, padding repeats a node's last row; ``real_positions``: the real
    rows among the ``n * longest``)."""

    start: int
    lengths: tuple[int, ...]
    padded_rows: torch.Tensor | None = None
    real_positions: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None

    @property
    def stop(self) -> int:
        return self.start + sum(self.lengths)


@dataclass(frozen=True)
class SdpaCross:
    """The queries of a node's descendants (rows ``[query_start, query_stop)``, contiguous in preorder) against the
    node's keys (rows ``[key_start, key_stop)``): one non-causal call, since every descendant sees the whole node."""

    query_start: int
    query_stop: int
    key_start: int
    key_stop: int


@dataclass(frozen=True)
class SdpaCalls:
    runs: tuple[SdpaRun, ...]
    crosses: tuple[SdpaCross, ...]
    # Cross calls per query row at most (the tree depth): 1 for prompt trees.
    max_crosses_per_row: int


def _make_run(start: int, lengths: list[int], device: torch.device) -> SdpaRun:
    if len(set(lengths)) == 1:
        return SdpaRun(start, tuple(lengths))
    offsets = torch.tensor([0, *itertools.accumulate(lengths)])
    if _ragged_runs_use_varlen(device):
        return SdpaRun(start, tuple(lengths), cu_seqlens=offsets.to(torch.int32).to(device))
    steps = torch.arange(max(lengths))
    lengths_tensor = torch.tensor(lengths)
    padded_rows = start + offsets[:-1, None] + torch.minimum(steps[None, :], lengths_tensor[:, None] - 1)
    real = (steps[None, :] < lengths_tensor[:, None]).flatten()
    return SdpaRun(start, tuple(lengths), padded_rows.to(device), torch.nonzero(real).flatten().to(device))


def build_sdpa_calls(plan: Plan) -> SdpaCalls:
    """The plan as ``backend='sdpa'`` runs it (host integers; one device sync). Built once per plan by
    ``prepare_tree_attention``. Nodes are in preorder, which is the packed order, so a node's descendants are the
    rows between its end and its subtree's end, and consecutive nodes are consecutive rows."""
    tree = plan.tree
    stacked = torch.stack([tree.node_start, tree.node_length, tree.node_subtree_end, tree.node_depth])
    start, length, subtree_end, depth = stacked.tolist()
    device = plan.kv_visible_until.device
    runs: list[SdpaRun] = []
    crosses: list[SdpaCross] = []
    pending: list[int] = []  # consecutive nodes without descendant tokens, batched into one run

    def flush() -> None:
        if pending:
            runs.append(_make_run(start[pending[0]], [length[node] for node in pending], device))
            pending.clear()

    for node in range(len(start)):
        if length[node] == 0:
            continue
        node_stop = start[node] + length[node]
        if subtree_end[node] > node_stop:
            flush()
            runs.append(SdpaRun(start[node], (length[node],)))
            crosses.append(SdpaCross(node_stop, subtree_end[node], start[node], node_stop))
        else:
            pending.append(node)
    flush()
    return SdpaCalls(tuple(runs), tuple(crosses), max(depth, default=0))


def _ragged_runs_use_varlen(device: torch.device) -> bool:
    """Ragged runs on CUDA take FlashAttention-2 varlen (no padding, no gather); torch has no CPU varlen kernel."""
    return device.type == "cuda"
