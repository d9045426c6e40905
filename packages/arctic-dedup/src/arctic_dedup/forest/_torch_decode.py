"""The torch path of forest decode (vLLM's CPU build, CI): batched gathers and masked attention, no per-request loop.

Everything that depends only on the plan (which cache slots each group's shared prefix and each request's own suffix
occupy, padded to the longest with a validity mask; which query rows each group and request holds; the causal
visibility of the query tokens) is built once per plan on the host (``TorchDecodeIndex``) and kept on the plan, so
the model's layers after the first only gather and attend: one batched attention over every group's prefix, one over
every request's suffix, one log-sum-exp merge. Math in fp32, as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from arctic_dedup.forest.plan_types import ForestPlan
from arctic_dedup.lse import merge_attention_states

__all__ = ["TorchDecodeIndex", "build_torch_decode_index", "forest_decode_torch"]


@dataclass(frozen=True)
class TorchKeySlots:
    """Padded cache slots of a batch of items: slot ``[i, k]`` is ``cache[blocks[i, k], offsets[i, k]]``.

    ``hidden [I, 1, G * Q, K]``: which slots each of the item's query rows (GQA heads of a kv head by ``Q`` padded
    query tokens) must not see (padding, and keys after a query token); ``[I, 1, 1, K]`` (padding only) where every
    row sees every key. Padding points at position 0 of the item's
    block-table row, a token of its context, except for an item whose row holds no token (a request of length 0):
    there it reads whatever the cache holds (NaN included), so ``zero_padding`` asks for padding values to be zeroed
    (``valid [I, K]``) before use.
    """

    blocks: torch.Tensor
    offsets: torch.Tensor
    hidden: torch.Tensor
    valid: torch.Tensor
    zero_padding: bool


@dataclass(frozen=True)
class TorchQueryRows:
    """Padded query rows of a batch of items: ``rows [I * Q]`` (flat, padding repeats a real row) and ``written
    [R]``, the flat positions of the real ones, in the order of ``TorchDecodeIndex.rows`` (``None``: all of them,
    no padding)."""

    rows: torch.Tensor
    written: torch.Tensor | None
    width: int


@dataclass(frozen=True)
class TorchDecodeIndex:
    """Host-built gather indices of one plan for the torch path.

    ``rows [R]``: the query rows the call writes (only the grouped requests' where the plan leaves the others to the
    caller). Suffix items are the requests with query tokens, each over its
    tokens after its group's prefix, causal within its query tokens: first the grouped requests, group by group (in
    request order within a group), then the others. Prefix items (``None`` when no request is grouped) are the
    groups with query tokens, each over its leader's shared prefix for all its members' rows, so their rows are the
    first ``len(prefix rows)`` of ``rows``, in the same order.
    """

    rows: torch.Tensor
    suffix_keys: TorchKeySlots
    suffix_queries: TorchQueryRows
    prefix_keys: TorchKeySlots | None
    prefix_queries: TorchQueryRows | None


def _key_slots(
    table_rows: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    query_positions: np.ndarray | None,
    block: int,
    queries_per_kv: int,
    device: torch.device,
) -> TorchKeySlots:
    """Slots of the keys ``starts[i] <= position < ends[i]`` of block-table row ``table_rows[i]``; with
    ``query_positions [I, Q]`` a query row sees the slots at or before its position, else every slot."""
    lengths = np.maximum(ends - starts, 0)
    within = np.arange(lengths.max(initial=0))
    valid = within[None, :] < lengths[:, None]
    positions = np.where(valid, starts[:, None] + within[None, :], 0)
    blocks = np.take_along_axis(table_rows, positions // block, axis=1)
    if query_positions is None:
        hidden = ~valid[:, None, None, :]
    else:
        visible = valid[:, None, :] & (positions[:, None, :] <= query_positions[:, :, None])
        # Rows are (GQA head, query token) pairs, head-major, as _attend lays the queries out.
        hidden = np.tile(~visible, (1, queries_per_kv, 1))[:, None]
    zero_padding = bool((~valid).any()) and bool((ends <= 0).any())
    return TorchKeySlots(
        _tensor(blocks, device),
        _tensor(positions % block, device),
        _tensor(hidden, device),
        _tensor(valid, device),
        zero_padding,
    )


def _query_rows(real_rows: np.ndarray, item_of_row: np.ndarray, items: int, device: torch.device) -> TorchQueryRows:
    """Items holding ``real_rows`` (sorted by ``item_of_row``) -> each item's rows padded to the most any holds."""
    counts = np.bincount(item_of_row, minlength=items)
    firsts = np.cumsum(counts) - counts
    width = int(counts.max(initial=0))
    written = item_of_row * width + np.arange(len(real_rows)) - firsts[item_of_row]
    padded = np.repeat(real_rows[firsts] if len(real_rows) else real_rows, width)
    padded[written] = real_rows
    identity = len(written) == items * width
    return TorchQueryRows(_tensor(padded, device), None if identity else _tensor(written, device), width)


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def build_torch_decode_index(plan: ForestPlan, device: torch.device) -> TorchDecodeIndex:
    """Read the plan on the host once and lay out every layer's gathers (see ``TorchDecodeIndex``)."""
    block, queries_per_kv = plan.block_size, plan.queries_per_kv
    table = plan.block_table.cpu().numpy().astype(np.int64)
    starts = plan.query_start_loc.cpu().numpy().astype(np.int64)
    seq_lens = plan.seq_lens.cpu().numpy().astype(np.int64)
    prefix_blocks = plan.prefix_blocks.cpu().numpy().astype(np.int64)
    leaders = plan.group_leader.cpu().numpy().astype(np.int64)
    counts = starts[1:] - starts[:-1]

    active = np.flatnonzero(counts > 0)
    if plan.leaves_ungrouped:
        # The caller attends the ungrouped requests (ForestPlan.leaves_ungrouped): their rows are not written here.
        active = active[prefix_blocks[active] > 0]
    grouped = prefix_blocks[active] > 0
    group_leaders, group_of = np.unique(leaders[active[grouped]], return_inverse=True)
    # Grouped requests first, group by group (stable: request order within a group), then the ungrouped ones.
    order = np.concatenate([active[grouped][np.argsort(group_of, kind="stable")], active[~grouped]])
    request_counts = counts[order]
    firsts = np.cumsum(request_counts) - request_counts
    rows = np.repeat(starts[order] - firsts, request_counts) + np.arange(request_counts.sum())
    item_of_row = np.repeat(np.arange(len(order)), request_counts)
    suffix_queries = _query_rows(rows, item_of_row, len(order), device)
    query_positions = (seq_lens[order] - counts[order])[:, None] + np.arange(suffix_queries.width)[None, :]
    suffix_keys = _key_slots(
        table[order], prefix_blocks[order] * block, seq_lens[order], query_positions, block, queries_per_kv, device
    )

    prefix_keys = prefix_queries = None
    if len(group_leaders):
        group_of_row = np.repeat(np.sort(group_of, kind="stable"), request_counts[: len(group_of)])
        prefix_queries = _query_rows(rows[: len(group_of_row)], group_of_row, len(group_leaders), device)
        ends = prefix_blocks[group_leaders] * block
        prefix_keys = _key_slots(table[group_leaders], np.zeros_like(ends), ends, None, block, queries_per_kv, device)
    return TorchDecodeIndex(_tensor(rows, device), suffix_keys, suffix_queries, prefix_keys, prefix_queries)


def _gather(cache: torch.Tensor, slots: TorchKeySlots) -> torch.Tensor:
    """``[I, K, H_kv, D]`` fp32 of the slots (padding: finite values of the context, or 0)."""
    values = cache[slots.blocks, slots.offsets].float()
    if slots.zero_padding:
        values = values.masked_fill(~slots.valid[:, :, None, None], 0.0)
    return values


def _attend(
    query: torch.Tensor,
    queries: TorchQueryRows,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: TorchKeySlots,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each item's query rows over its key slots -> (out ``[R, H_q, D]``, lse ``[R, H_q]``) of the
    real rows (``queries.written`` order), fp32; a row that sees no key gets out 0 and lse ``-inf``."""
    keys = _gather(key_cache, slots).permute(0, 2, 3, 1)
    values = _gather(value_cache, slots).transpose(1, 2)
    items, num_kv_heads, head_dim, _ = keys.shape
    width = queries.width
    # [I, Q, H_kv, G, D] -> [I, H_kv, G * Q, D]: each kv head's rows are its GQA heads' query tokens.
    rows = query[queries.rows].float().view(items, width, num_kv_heads, -1, head_dim)
    rows = rows.permute(0, 2, 3, 1, 4).reshape(items, num_kv_heads, -1, head_dim)
    scores = torch.matmul(rows, keys) * scale
    scores = scores.masked_fill(slots.hidden, float("-inf"))
    # Softmax by hand (one exp for the weights and the lse); a row that sees no key has maximum -inf: shift it by
    # 0 so its weights are exp(-inf) = 0, its sum 0, its lse log(0) = -inf, and its output 0 / 1 = 0.
    maximum = scores.amax(dim=-1, keepdim=True)
    maximum = torch.where(torch.isinf(maximum), 0.0, maximum)
    weights = torch.exp(scores - maximum)
    total = weights.sum(dim=-1, keepdim=True)
    lse = (torch.log(total) + maximum).squeeze(-1)
    # A row that sees a key has total >= 1 (its maximum's weight is 1), so the clamp only touches empty rows.
    out = torch.matmul(weights, values) / total.clamp(min=1.0)
    out = out.view(items, num_kv_heads, -1, width, head_dim).permute(0, 3, 1, 2, 4).reshape(items * width, -1, head_dim)
    lse = lse.view(items, num_kv_heads, -1, width).permute(0, 3, 1, 2).reshape(items * width, -1)
    if queries.written is None:
        return out, lse
    return out[queries.written], lse[queries.written]


def forest_decode_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: ForestPlan,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """The torch path of ``forest_decode`` (same arguments, checked by the caller); writes ``out`` and ``lse`` rows
    of query tokens only."""
    # Indices are in the plan's block-table coordinates and its block size (the caller checked the cache against
    # both); a persistent plan drops them at every update (StaticForestPlan.update).
    key = (plan.block_size, query.device)
    index = plan.torch_indices.get(key)
    if index is None:
        index = plan.torch_indices[key] = build_torch_decode_index(plan, query.device)
    if index.rows.numel() == 0:
        return
    merged_out, merged_lse = _attend(query, index.suffix_queries, key_cache, value_cache, index.suffix_keys, scale)
    if index.prefix_keys is not None and index.prefix_queries is not None:
        prefix_out, prefix_lse = _attend(query, index.prefix_queries, key_cache, value_cache, index.prefix_keys, scale)
        # The grouped rows lead, in the prefix items' order; the others keep their suffix state (their whole context).
        grouped = len(prefix_lse)
        grouped_out, grouped_lse = merge_attention_states(
            merged_out[:grouped], merged_lse[:grouped], prefix_out, prefix_lse
        )
        merged_out[:grouped] = grouped_out
        merged_lse[:grouped] = grouped_lse
    out[index.rows] = merged_out.to(out.dtype)
    lse[index.rows] = merged_lse
