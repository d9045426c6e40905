"""Plain-torch fp32 reference twins of forest decode: per-request paged attention and group discovery (loops)."""

from __future__ import annotations

import math

import torch

__all__ = ["reference_forest_groups", "reference_paged_attention"]


def reference_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each request's query tokens over its paged KV, one request at a time, in fp32.

    Shapes: query ``[T, H_q, D]``; caches ``[num_blocks, block_size, H_kv, D]``; block_table ``[N, max_blocks]``;
    seq_lens ``[N]`` (including the query tokens); query_start_loc ``[N + 1]``. Returns (out ``[T, H_q, D]`` fp32,
    lse ``[T, H_q]`` fp32, natural log; rows of requests with no query tokens are absent from T).
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    table = block_table.cpu()
    key_cache, value_cache, query = key_cache.cpu(), value_cache.cpu(), query.cpu()
    for request, seq_len in enumerate(lengths):
        begin, end = starts[request], starts[request + 1]
        if end == begin or seq_len == 0:
            continue
        positions = torch.arange(seq_len)
        blocks = table[request, positions // block_size].long()
        within = positions % block_size
        keys = key_cache[blocks, within].float()
        values = value_cache[blocks, within].float()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        queries = query[begin:end].float()
        query_positions = seq_len - (end - begin) + torch.arange(end - begin)
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        visible = positions[None, :] <= query_positions[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        weights = torch.softmax(scores, dim=-1)
        out[begin:end] = torch.einsum("hqk,khd->qhd", weights, values)
        lse[begin:end] = row_lse.transpose(0, 1)
    return out, lse


def reference_forest_groups(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    *,
    min_group_size: int = 2,
    min_additional_prefix_blocks: int = 1,
    min_non_singleton_fraction: float = 0.0,
    max_non_singleton_groups: int = 0,
) -> tuple[list[int], list[int]]:
    """Group discovery written as loops: returns (leader per request, shared prefix blocks per request).

    A request's eligible blocks are the full blocks before its first query token. At depth ``d`` a request shares
    its block with ``count`` requests; it is cut at the depth maximizing ``(count - 1) * (d + 1)`` (first maximum);
    requests cut at the same physical block form a group led by the lowest index; the group's prefix is the number
    of leading eligible blocks that all members hold identically. Ungrouped requests lead themselves with prefix 0.
    """
    table = block_table.tolist()
    seq = seq_lens.tolist()
    starts = query_start_loc.tolist()
    num_requests = len(seq)
    eligible = [
        min(max(seq[i] - (starts[i + 1] - starts[i]), 0) // block_size, len(table[i])) for i in range(num_requests)
    ]
    counts: dict[int, int] = {}
    for i in range(num_requests):
        for d in range(eligible[i]):
            counts[table[i][d]] = counts.get(table[i][d], 0) + 1
    cut_key: list[int | None] = []
    for i in range(num_requests):
        best, key = 0, None
        for d in range(eligible[i]):
            shared = counts[table[i][d]]
            if shared >= min_group_size and d + 1 >= min_additional_prefix_blocks and (shared - 1) * (d + 1) > best:
                best, key = (shared - 1) * (d + 1), table[i][d]
        cut_key.append(key)
    members: dict[int, list[int]] = {}
    for i, key in enumerate(cut_key):
        if key is not None:
            members.setdefault(key, []).append(i)
    leader = list(range(num_requests))
    prefix = [0] * num_requests
    for group in members.values():
        head = group[0]
        shared_blocks = eligible[head]
        for i in group:
            common = 0
            while common < min(eligible[i], eligible[head]) and table[i][common] == table[head][common]:
                common += 1
            shared_blocks = min(shared_blocks, common)
        if len(group) >= min_group_size and shared_blocks >= min_additional_prefix_blocks:
            for i in group:
                leader[i], prefix[i] = head, shared_blocks
    num_groups = sum(1 for i in range(num_requests) if prefix[i] > 0 and leader[i] == i)
    num_grouped = sum(1 for p in prefix if p > 0)
    too_few = num_grouped < math.ceil(min_non_singleton_fraction * num_requests)
    too_many = max_non_singleton_groups > 0 and num_groups > max_non_singleton_groups
    if too_few or too_many:
        return list(range(num_requests)), [0] * num_requests
    return leader, prefix
