"""The torch path of forest decode (vLLM's CPU build, CI): batched gathers and masked attention, no per-request loop.

Everything that depends only on the plan (which cache slots each group's shared prefix and each request's own suffix
occupy, padded to the longest with a validity mask; which query rows each group and request holds; the causal
visibility of the query tokens) is built once per plan on the host (``TorchDecodeIndex``) and kept on the plan, so
the model's layers after the first only gather and attend: one batched attention over every group's prefix, one over
every request's suffix, one log-sum-exp merge. Math in fp32, as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arctic_dedup.forest.plan_types import ForestPlan
from arctic_dedup.lse import merge_attention_states

__all__ = ["TorchDecodeIndex", "build_torch_decode_index", "forest_decode_torch"]


@dataclass(frozen=True)
class TorchKeySlots:
    """Padded cache slots of a batch of key ranges: slot ``[i, j]`` is ``cache[blocks[i, j], offsets[i, j]]``.

    ``visible [I, Q, K]`` says which slots each of the item's ``Q`` query rows attends to (padding never). Padding
    points at position 0 of the item's block-table row, a token of its context, except for an item whose row holds
    no token (a request of length 0): there it reads whatever the cache holds (NaN included), so ``zero_padding``
    asks for padding values to be zeroed before use.
    """

    blocks: torch.Tensor
    offsets: torch.Tensor
    valid: torch.Tensor
    visible: torch.Tensor
    zero_padding: bool


@dataclass(frozen=True)
class TorchQueryRows:
    """Padded query rows of a batch of items: ``rows [I, Q]`` (padding repeats a real row), ``written [R]`` the
    flat indices (into ``I * Q``) of the real ones in the order of ``TorchDecodeIndex.rows``."""

    rows: torch.Tensor
    written: torch.Tensor


@dataclass(frozen=True)
class TorchDecodeIndex:
    """Host-built gather indices of one plan for the torch path.

    ``rows [R]``: the query rows the call writes (the requests' query tokens, in request order). Suffix items are
    the requests with query tokens, each over its tokens after its group's prefix, causal within its query tokens;
    prefix items (``None`` when no request is grouped) are the groups with query tokens, each over its leader's
    shared prefix for all its members' rows; ``prefix_slots [R_p]`` places the prefix items' rows among ``rows``.
    """

    rows: torch.Tensor
    suffix_keys: TorchKeySlots
    suffix_queries: TorchQueryRows
    prefix_keys: TorchKeySlots | None
    prefix_queries: TorchQueryRows | None
    prefix_slots: torch.Tensor | None


def _key_slots(
    table_rows: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, query_positions: torch.Tensor | None, block: int
) -> TorchKeySlots:
    """Slots of the keys ``starts[i] <= position < ends[i]`` of block-table row ``table_rows[i]``; with
    ``query_positions [I, Q]`` a slot is visible to a query row at or after its position, else to every row."""
    lengths = (ends - starts).clamp(min=0)
    width = int(lengths.max()) if lengths.numel() else 0
    within = torch.arange(width, dtype=torch.int64)
    valid = within[None, :] < lengths[:, None]
    positions = torch.where(valid, starts[:, None] + within[None, :], 0)
    blocks = table_rows.gather(1, positions // block).long()
    offsets = positions % block
    if query_positions is None:
        visible = valid[:, None, :]
    else:
        visible = valid[:, None, :] & (positions[:, None, :] <= query_positions[:, :, None])
    zero_padding = bool((~valid).any()) and bool((ends <= 0).any())
    return TorchKeySlots(blocks, offsets, valid, visible, zero_padding)


def _query_rows(first_rows: torch.Tensor, counts: torch.Tensor) -> tuple[TorchQueryRows, torch.Tensor]:
    """Items whose rows are ``first_rows[i] + j`` for ``j < counts[i]`` (requests: one run each) -> their padded
    rows and, flat in item order, the rows themselves."""
    width = int(counts.max()) if counts.numel() else 0
    within = torch.arange(width, dtype=torch.int64)
    real = within[None, :] < counts[:, None]
    rows = first_rows[:, None] + torch.where(real, within[None, :], 0)
    flat = real.flatten().nonzero().squeeze(1)
    return TorchQueryRows(rows, flat), rows.flatten()[flat]


def build_torch_decode_index(plan: ForestPlan) -> TorchDecodeIndex:
    """Read the plan on the host once and lay out every layer's gathers (see ``TorchDecodeIndex``)."""
    block = plan.block_size
    table = plan.block_table.cpu()
    starts = plan.query_start_loc.cpu().long()
    seq_lens = plan.seq_lens.cpu().long()
    prefix_blocks = plan.prefix_blocks.cpu().long()
    leaders = plan.group_leader.cpu().long()
    counts = starts[1:] - starts[:-1]

    active = (counts > 0).nonzero().squeeze(1)
    suffix_queries, rows = _query_rows(starts[active], counts[active])
    query_positions = seq_lens[active, None] - counts[active, None] + torch.arange(suffix_queries.rows.shape[1])
    suffix_keys = _key_slots(table[active], prefix_blocks[active] * block, seq_lens[active], query_positions, block)

    prefix_keys = prefix_queries = prefix_slots = None
    grouped = active[prefix_blocks[active] > 0]
    if grouped.numel():
        group_leaders, group_of = torch.unique(leaders[grouped], return_inverse=True)
        # Each group's rows are its members' rows in request order: sort the members by group, stably.
        order = torch.sort(group_of, stable=True).indices
        members, member_group = grouped[order], group_of[order]
        member_rows = torch.repeat_interleave(starts[members], counts[members]) + _runs(counts[members])
        row_group = torch.repeat_interleave(member_group, counts[members])
        group_counts = torch.bincount(row_group, minlength=len(group_leaders))
        group_first = torch.cumsum(group_counts, 0) - group_counts
        rank = torch.arange(len(member_rows)) - group_first[row_group]
        width = int(group_counts.max())
        padded_rows = member_rows[group_first][:, None].expand(-1, width).clone()
        padded_rows[row_group, rank] = member_rows
        written = row_group * width + rank
        prefix_queries = TorchQueryRows(padded_rows, written)
        ends = prefix_blocks[group_leaders] * block
        prefix_keys = _key_slots(table[group_leaders], torch.zeros_like(ends), ends, None, block)
        slot_of_row = torch.full((int(starts[-1]) + 1,), -1, dtype=torch.int64)
        slot_of_row[rows] = torch.arange(len(rows))
        prefix_slots = slot_of_row[member_rows]

    device = plan.block_table.device

    def moved(slots: TorchKeySlots) -> TorchKeySlots:
        return TorchKeySlots(
            slots.blocks.to(device),
            slots.offsets.to(device),
            slots.valid.to(device),
            slots.visible.to(device),
            slots.zero_padding,
        )

    return TorchDecodeIndex(
        rows=rows.to(device),
        suffix_keys=moved(suffix_keys),
        suffix_queries=TorchQueryRows(suffix_queries.rows.to(device), suffix_queries.written.to(device)),
        prefix_keys=None if prefix_keys is None else moved(prefix_keys),
        prefix_queries=None
        if prefix_queries is None
        else TorchQueryRows(prefix_queries.rows.to(device), prefix_queries.written.to(device)),
        prefix_slots=None if prefix_slots is None else prefix_slots.to(device),
    )


def _runs(counts: torch.Tensor) -> torch.Tensor:
    """``0..counts[0]-1, 0..counts[1]-1, ...`` (flat)."""
    firsts = torch.cumsum(counts, 0) - counts
    return torch.arange(int(counts.sum())) - torch.repeat_interleave(firsts, counts)


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
    keys = _gather(key_cache, slots)
    values = _gather(value_cache, slots)
    items, width = queries.rows.shape
    num_kv_heads, head_dim = keys.shape[2], keys.shape[3]
    rows = query[queries.rows.flatten()].float().view(items, width, num_kv_heads, -1, head_dim)
    scores = torch.einsum("iqhgd,ikhd->ihgqk", rows, keys) * scale
    scores = scores.masked_fill(~slots.visible[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("ihgqk,ikhd->iqhgd", weights, values).reshape(items * width, -1, head_dim)
    flat_lse = lse.permute(0, 3, 1, 2).reshape(items * width, -1)
    return out[queries.written], flat_lse[queries.written]


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
        index = plan.torch_indices[key] = build_torch_decode_index(plan)
    if index.rows.numel() == 0:
        return
    merged_out, merged_lse = _attend(query, index.suffix_queries, key_cache, value_cache, index.suffix_keys, scale)
    if index.prefix_keys is not None and index.prefix_queries is not None and index.prefix_slots is not None:
        prefix_out, prefix_lse = _attend(query, index.prefix_queries, key_cache, value_cache, index.prefix_keys, scale)
        # Ungrouped rows merge with an empty prefix (lse -inf, out 0): exactly their suffix state.
        grouped_out = torch.zeros_like(merged_out)
        grouped_lse = torch.full_like(merged_lse, float("-inf"))
        grouped_out[index.prefix_slots] = prefix_out
        grouped_lse[index.prefix_slots] = prefix_lse
        merged_out, merged_lse = merge_attention_states(merged_out, merged_lse, grouped_out, grouped_lse)
    out[index.rows] = merged_out.to(out.dtype)
    lse[index.rows] = merged_lse
