"""arctic-dedup: plan, pack and attend over deduplicated RL batches (torch + Triton, nothing model-specific)."""

from arctic_dedup.attention_meta import BlockSparsity, VarlenParams, block_sparsity, dense_tree_mask
from arctic_dedup.errors import BatchLayoutError, PlanError
from arctic_dedup.grouping import RowGroups, group_rows
from arctic_dedup.index_map import IndexMap
from arctic_dedup.layout import SampleLayout
from arctic_dedup.packing import gather_rows, pack, segment_sum_rows, unpack
from arctic_dedup.plan import Plan, PrefixTree, ResponseIndex, build_plan, build_plan_from_layout

__version__ = "0.1.0"

__all__ = [
    "BatchLayoutError",
    "BlockSparsity",
    "IndexMap",
    "Plan",
    "PlanError",
    "PrefixTree",
    "ResponseIndex",
    "RowGroups",
    "SampleLayout",
    "VarlenParams",
    "__version__",
    "block_sparsity",
    "build_plan",
    "build_plan_from_layout",
    "dense_tree_mask",
    "gather_rows",
    "group_rows",
    "pack",
    "segment_sum_rows",
    "unpack",
]
