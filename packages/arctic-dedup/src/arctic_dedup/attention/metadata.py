"""Tree-attention metadata: what the backends derive from a plan, prepared once and read by every layer.

FlashInfer's plan/run split: ``prepare_tree_attention(plan, ...)`` builds, for the backends and sliding windows a
model will use, the Triton and FlexAttention block tables (per block size and window) and the ``sdpa`` backend's
attention calls, and returns them in one immutable ``TreeAttentionMetadata``. ``tree_attention(..., metadata=...)``
only reads it; nothing is cached behind the caller's back. Without ``metadata`` a call prepares what it needs for
itself and drops it afterwards, which is right for a single call and wasteful for a model's layers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from arctic_dedup.attention._tables import KernelTables, build_kernel_tables
from arctic_dedup.attention.auto import BACKENDS, ConcreteBackend
from arctic_dedup.attention.sdpa_calls import SdpaCalls, build_sdpa_calls
from arctic_dedup.attention.triton_config import TritonConfig, default_triton_config
from arctic_dedup.errors import PlanError

if TYPE_CHECKING:
    from arctic_dedup.plan import Plan

__all__ = ["FLEX_BLOCK_SIZE", "TableKey", "TreeAttentionMetadata", "prepare_tree_attention"]

# FlexAttention's tile: its block tables are 128 x 128.
FLEX_BLOCK_SIZE = 128

# (block_m, block_n, sliding_window) of one set of block tables.
TableKey = tuple[int, int, int | None]


@dataclass(frozen=True, eq=False)
class TreeAttentionMetadata:
    """One plan's tree-attention preparation. Immutable; build it with ``prepare_tree_attention``.

    ``backends``: the backends it was prepared for; ``block_tables``: block tables per ``(block_m, block_n,
    sliding_window)`` (Triton's tile sizes, FlexAttention's 128 x 128); ``sdpa_calls``: the ``sdpa`` backend's calls
    (None unless prepared for ``sdpa``).
    """

    plan: Plan
    backends: frozenset[ConcreteBackend]
    block_tables: Mapping[TableKey, KernelTables]
    sdpa_calls: SdpaCalls | None

    def tables(self, block_m: int, block_n: int, sliding_window: int | None) -> KernelTables:
        """The block tables of one tile size and window; a clear error when they were not prepared."""
        key = (block_m, block_n, sliding_window)
        tables = self.block_tables.get(key)
        if tables is None:
            raise PlanError(
                f"the tree-attention metadata holds block tables for (block_m, block_n, sliding_window) in "
                f"{sorted(self.block_tables, key=str)}, not {key}. Prepare it for this call's backend, head dim, "
                "dtype and window: prepare_tree_attention(plan, backends=..., head_dim=..., dtype=..., "
                "sliding_windows=...)."
            )
        return tables

    def calls(self) -> SdpaCalls:
        """The ``sdpa`` backend's calls; a clear error when the metadata was not prepared for ``sdpa``."""
        if self.sdpa_calls is None:
            raise PlanError(
                f"the tree-attention metadata was prepared for {sorted(self.backends)}, not 'sdpa'; pass "
                "backends=(..., 'sdpa') to prepare_tree_attention."
            )
        return self.sdpa_calls


def _triton_tile_sizes(config: TritonConfig) -> set[tuple[int, int]]:
    return {
        (config.block_m, config.block_n),
        (config.bwd_block_m, config.bwd_block_n),
        (config.dq_block_m, config.dq_block_n),
    }


def prepare_tree_attention(
    plan: Plan,
    *,
    backends: Iterable[ConcreteBackend],
    head_dim: int,
    dtype: torch.dtype,
    sliding_windows: Iterable[int | None] = (None,),
    triton_config: TritonConfig | None = None,
) -> TreeAttentionMetadata:
    """Prepare ``plan`` for ``tree_attention`` with the given concrete backends (``choose_backend`` turns
    ``"auto"`` into one), head dim, input dtype and sliding windows (every window a layer will pass; ``None`` is
    full attention). ``triton_config``: the Triton tile sizes, ``default_triton_config(head_dim, device, dtype)``
    when None. Builds on the plan's device; only the ``sdpa`` calls read the tree on the host (one sync)."""
    chosen = frozenset(backends)
    unknown = chosen - set(BACKENDS)
    if unknown:
        raise ValueError(f"backends must be concrete backends out of {BACKENDS}, got {sorted(unknown)}.")
    windows = tuple(dict.fromkeys(sliding_windows))
    tile_sizes: set[tuple[int, int]] = set()
    if "triton" in chosen:
        config = triton_config or default_triton_config(head_dim, plan.device, dtype)
        tile_sizes |= _triton_tile_sizes(config)
    if "flex" in chosen:
        tile_sizes.add((FLEX_BLOCK_SIZE, FLEX_BLOCK_SIZE))
    tables: dict[TableKey, KernelTables] = {}
    with torch.no_grad():
        for block_m, block_n in sorted(tile_sizes):
            for window in windows:
                tables[(block_m, block_n, window)] = build_kernel_tables(
                    plan.kv_visible_until, plan.position_ids, block_m, block_n, window
                )
    return TreeAttentionMetadata(
        plan=plan,
        backends=chosen,
        block_tables=MappingProxyType(tables),
        sdpa_calls=build_sdpa_calls(plan) if "sdpa" in chosen else None,
    )
