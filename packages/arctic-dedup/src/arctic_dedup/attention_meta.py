"""Attention metadata derived from a plan: which keys each query may see, per token and per block.

In the packed stream (nodes in preorder, each node's tokens once) query ``q`` may attend to key ``k`` exactly when

    k <= q  and  q < kv_visible_until[k]

where ``kv_visible_until[k]`` is the end of the subtree of ``k``'s node: the key's own node (causally) and every
descendant node see it; siblings, cousins and other trees do not. One int32 per token describes the whole mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arctic_dedup.index_map import ranges_to_index

__all__ = ["BlockSparsity", "CrossAttentionLevel", "VarlenParams", "block_sparsity", "dense_tree_mask"]


def dense_tree_mask(kv_visible_until: torch.Tensor) -> torch.Tensor:
    """``[T, T]`` boolean mask (query rows, key columns) for small inputs and tests."""
    positions = torch.arange(kv_visible_until.shape[0], device=kv_visible_until.device)
    query = positions[:, None]
    key = positions[None, :]
    return (key <= query) & (query < kv_visible_until.long()[None, :])


@dataclass(frozen=True)
class BlockSparsity:
    """Block-level view of the tree mask for blocked kernels (FlexAttention-style, one batch and head).

    Query block ``i`` covers tokens ``[i*block_m, (i+1)*block_m)``; key block ``j`` covers ``[j*block_n, ...)``.
    ``kv_num_blocks[i]`` key blocks need the element mask (listed ascending in ``kv_indices[i, :kv_num_blocks[i]]``);
    ``full_kv_num_blocks[i]`` key blocks are entirely visible (``full_kv_indices``). ``q_*`` is the transpose, for
    the backward pass over key blocks. Index rows are padded past their count with the last valid index (or 0).
    """

    block_m: int
    block_n: int
    num_tokens: int
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: torch.Tensor
    full_q_indices: torch.Tensor

    @property
    def num_query_blocks(self) -> int:
        return int(self.kv_num_blocks.shape[0])

    @property
    def num_key_blocks(self) -> int:
        return int(self.q_num_blocks.shape[0])

    def visited_fraction(self) -> float:
        """Share of the ``[query block, key block]`` grid a blocked kernel visits (host sync; for reports)."""
        visited = int(self.kv_num_blocks.sum()) + int(self.full_kv_num_blocks.sum())
        return visited / max(1, self.num_query_blocks * self.num_key_blocks)


def _compact(block_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a boolean ``[rows, cols]`` block matrix -> (count ``[rows]``, ascending indices ``[rows, cols]``)."""
    counts = block_mask.sum(dim=1, dtype=torch.int32)
    cols = block_mask.shape[1]
    column = torch.arange(cols, device=block_mask.device)
    # Selected columns first (ascending), the rest after them; then repeat the last selected index as padding.
    key = torch.where(block_mask, column, cols + column)
    indices = torch.argsort(key, dim=1, stable=True)
    last_valid = indices.gather(1, (counts.long() - 1).clamp_min(0)[:, None])
    beyond = column[None, :] >= counts[:, None]
    indices = torch.where(beyond, last_valid, indices)
    return counts, indices.to(torch.int32)


def block_sparsity(kv_visible_until: torch.Tensor, block_m: int = 128, block_n: int = 128) -> BlockSparsity:
    """Classify every (query block, key block) pair as skipped, partial (element mask) or full.

    Conservative: a block marked partial may turn out empty after the element mask; a block marked full or skipped
    is exact. Cost: a ``[T/block_m, T/block_n]`` boolean matrix on the plan's device.
    """
    num_tokens = int(kv_visible_until.shape[0])
    device = kv_visible_until.device
    until = kv_visible_until.long()
    num_q = max(1, -(-num_tokens // block_m))
    num_k = max(1, -(-num_tokens // block_n))
    padded = torch.full((num_k * block_n,), -1, dtype=torch.long, device=device)
    padded[:num_tokens] = until
    per_block = padded.view(num_k, block_n)
    until_max = per_block.max(dim=1).values
    # Padding positions must not lower the minimum: give them +inf.
    until_min = torch.where(per_block < 0, torch.iinfo(torch.long).max, per_block).min(dim=1).values
    key_first = torch.arange(num_k, device=device) * block_n
    key_last = torch.clamp(key_first + block_n, max=num_tokens) - 1
    query_first = torch.arange(num_q, device=device) * block_m
    query_last = torch.clamp(query_first + block_m, max=num_tokens) - 1
    any_visible = (key_first[None, :] <= query_last[:, None]) & (until_max[None, :] > query_first[:, None])
    # A key block cut short by the end of the stream is never "full": kernels that pad T up to a block multiple
    # would otherwise let the padding keys in.
    complete_key_block = key_first + block_n <= num_tokens
    all_visible = (
        complete_key_block[None, :]
        & (key_last[None, :] <= query_first[:, None])
        & (until_min[None, :] > query_last[:, None])
    )
    partial = any_visible & ~all_visible
    kv_num, kv_idx = _compact(partial)
    full_kv_num, full_kv_idx = _compact(all_visible)
    q_num, q_idx = _compact(partial.t())
    full_q_num, full_q_idx = _compact(all_visible.t())
    return BlockSparsity(
        block_m=block_m,
        block_n=block_n,
        num_tokens=num_tokens,
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=full_kv_num,
        full_kv_indices=full_kv_idx,
        q_num_blocks=q_num,
        q_indices=q_idx,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_idx,
    )


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
