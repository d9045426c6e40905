"""Random decode batches over a paged KV cache laid out the way vLLM's prefix cache lays out sampled responses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DecodeBatch", "make_decode_batch"]


@dataclass(frozen=True)
class DecodeBatch:
    """Inputs of one decode step. Caches ``[num_blocks, block_size, H_kv, D]``; tables padded with block 0."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    unique_tokens: int
    total_tokens: int


def make_decode_batch(
    prefix_lens: list[int],
    suffix_lens: list[list[int]],
    *,
    query_lens: list[list[int]] | None = None,
    root_blocks: int = 0,
    block_size: int = 16,
    num_kv_heads: int = 2,
    queries_per_kv: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    shuffle: bool = False,
    spare_blocks: int = 3,
    head_major_cache: bool = False,
    seed: int = 0,
) -> DecodeBatch:
    """Build a decode batch: group ``g`` has ``len(suffix_lens[g])`` requests sharing a prompt of ``prefix_lens[g]``.

    The prompt's full blocks are shared physical blocks; its partial last block, the response (``suffix_lens``
    tokens) and the step's query tokens (``query_lens``, default 1; their KV is already in the cache) live in each
    request's own blocks. ``root_blocks`` leading blocks are shared by every group (a system prompt: nested sharing).
    Physical block ids are shuffled; ``shuffle`` also shuffles the request order; ``head_major_cache`` stores the
    cache as ``[num_blocks, H_kv, block_size, D]`` and returns a permuted (strided) view.
    """
    generator = torch.Generator().manual_seed(seed)
    if query_lens is None:
        query_lens = [[1] * len(group) for group in suffix_lens]
    requests: list[tuple[list[int], int, int]] = []
    next_block = 0
    root_ids = list(range(root_blocks))
    next_block += root_blocks
    unique_tokens = 0
    for prefix_len, suffixes, queries in zip(prefix_lens, suffix_lens, query_lens, strict=True):
        full = prefix_len // block_size
        if full < root_blocks:
            raise ValueError(f"prefix of {prefix_len} tokens is shorter than root_blocks={root_blocks} blocks")
        shared = root_ids + list(range(next_block, next_block + full - root_blocks))
        next_block += full - root_blocks
        unique_tokens += prefix_len
        for suffix_len, query_len in zip(suffixes, queries, strict=True):
            seq_len = prefix_len + suffix_len + query_len
            own = -(-seq_len // block_size) - full
            blocks = shared + list(range(next_block, next_block + own))
            next_block += own
            requests.append((blocks, seq_len, query_len))
            unique_tokens += suffix_len + query_len
    unique_tokens -= root_blocks * block_size * (len(prefix_lens) - 1)
    num_blocks = next_block + spare_blocks + 1
    # Block 0 stays unused padding (vLLM's null block); real ids are a permutation of 1..num_blocks-1.
    physical = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    order = torch.randperm(len(requests), generator=generator).tolist() if shuffle else list(range(len(requests)))
    requests = [requests[i] for i in order]
    max_blocks = max(len(blocks) for blocks, _, _ in requests) + 1
    table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    for row, (blocks, _, _) in enumerate(requests):
        table[row, : len(blocks)] = torch.tensor([physical[b] for b in blocks], dtype=torch.int32)
    seq_lens = torch.tensor([seq for _, seq, _ in requests], dtype=torch.int32)
    counts = torch.tensor([q for _, _, q in requests], dtype=torch.int32)
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(counts, 0)
    num_heads = num_kv_heads * queries_per_kv
    # Values are drawn on the target device so large benchmark caches need no host copy.
    values = torch.Generator(device=device).manual_seed(seed)
    query = torch.randn(int(counts.sum()), num_heads, head_dim, generator=values, device=device, dtype=dtype)
    if head_major_cache:
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        key_cache = torch.randn(shape, generator=values, device=device, dtype=dtype).permute(0, 2, 1, 3)
        value_cache = torch.randn(shape, generator=values, device=device, dtype=dtype).permute(0, 2, 1, 3)
    else:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        key_cache = torch.randn(shape, generator=values, device=device, dtype=dtype)
        value_cache = torch.randn(shape, generator=values, device=device, dtype=dtype)
    return DecodeBatch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=table.to(device),
        seq_lens=seq_lens.to(device),
        query_start_loc=query_start_loc.to(device),
        max_query_len=max(q for _, _, q in requests),
        unique_tokens=unique_tokens,
        total_tokens=int(seq_lens.sum()),
    )
