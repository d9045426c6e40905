"""Attention metadata derived from a plan: which keys each query may see, per token and per varlen segment.

In the packed stream (nodes in preorder, each node's tokens once) query ``q`` may attend to key ``k`` exactly when

    k <= q  and  q < kv_visible_until[k]

where ``kv_visible_until[k]`` is the end of the subtree of ``k``'s node: the key's own node (causally) and every
descendant node see it; siblings, cousins and other trees do not. One int32 per token describes the whole mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arctic_dedup.plan.index_map import ranges_to_index

__all__ = ["CrossAttentionLevel", "VarlenParams", "dense_tree_mask"]


def dense_tree_mask(kv_visible_until: torch.Tensor) -> torch.Tensor:
    """``[T, T]`` boolean mask (query rows, key columns) for small inputs and tests."""
    positions = torch.arange(kv_visible_until.shape[0], device=kv_visible_until.device)
    query = positions[:, None]
    key = positions[None, :]
    return (key <= query) & (query < kv_visible_until.long()[None, :])


@dataclass(frozen=True)
class CrossAttentionLevel:
    """Queries below one depth's nodes attending to those nodes' tokens (non-causal), as varlen sequences.

    For every node at this depth that has descendants, sequence ``s`` has queries = the node's whole subtree below
    it (``query_index[cu_seqlens_q[s]:cu_seqlens_q[s+1]]``, packed positions) and keys = the node's own tokens
    (``key_index[cu_seqlens_k[s]:cu_seqlens_k[s+1]]``).
    """

    depth: int
    query_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    key_index: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_k: int


@dataclass(frozen=True)
class VarlenParams:
    """Flash-attention varlen parameters for a tree: one causal self-attention call over the nodes
    (``cu_seqlens_nodes``), then one non-causal call per depth for descendants attending to ancestors; the partial
    results merge by log-sum-exp."""

    cu_seqlens_nodes: torch.Tensor
    max_seqlen_nodes: int
    cross_levels: tuple[CrossAttentionLevel, ...]


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = lengths.cumsum(0)
    return cu


def build_varlen_params(
    node_start: torch.Tensor, node_length: torch.Tensor, node_subtree_end: torch.Tensor, node_depth: torch.Tensor
) -> VarlenParams:
    node_end = node_start + node_length
    levels: list[CrossAttentionLevel] = []
    has_children = node_subtree_end > node_end
    max_depth = int(node_depth.max()) if node_depth.numel() else -1
    for depth in range(max_depth + 1):
        selected = torch.nonzero(has_children & (node_depth == depth)).squeeze(1)
        if selected.numel() == 0:
            continue
        query_lengths = node_subtree_end[selected] - node_end[selected]
        key_lengths = node_length[selected]
        levels.append(
            CrossAttentionLevel(
                depth=depth,
                query_index=ranges_to_index(node_end[selected], query_lengths),
                cu_seqlens_q=_cu_seqlens(query_lengths),
                max_seqlen_q=int(query_lengths.max()),
                key_index=ranges_to_index(node_start[selected], key_lengths),
                cu_seqlens_k=_cu_seqlens(key_lengths),
                max_seqlen_k=int(key_lengths.max()),
            )
        )
    return VarlenParams(
        cu_seqlens_nodes=_cu_seqlens(node_length),
        max_seqlen_nodes=int(node_length.max()) if node_length.numel() else 0,
        cross_levels=tuple(levels),
    )
