"""arctic-dedup: plan, pack and attend over deduplicated RL batches (torch + Triton, nothing model-specific)."""

from arctic_dedup.attention import TreeAttentionBackend, choose_backend, tree_attention, tree_attention_reference
from arctic_dedup.attention_meta import BlockSparsity, VarlenParams, block_sparsity, dense_tree_mask
from arctic_dedup.balance import (
    GroupSplitWarning,
    MicroBatch,
    PromptGroup,
    format_micro_batch_report,
    partition_for_data_parallel,
    partition_items,
    plan_micro_batches,
    prompt_groups,
)
from arctic_dedup.cost import DedupCost, ModelShape, dedup_cost, dedup_cost_of_plan
from arctic_dedup.errors import BatchLayoutError, PlanError
from arctic_dedup.facade import BatchStats, ReconstructionInfo, ZoRRoTrain, analyze_normal_batch_via_attention_mask
from arctic_dedup.forest import (
    ForestGrouping,
    ForestKernelConfig,
    ForestPlan,
    forest_decode,
    paged_decode,
    plan_forest,
    plan_paged,
)
from arctic_dedup.grouping import RowGroups, group_rows
from arctic_dedup.index_map import IndexMap
from arctic_dedup.layout import SampleLayout
from arctic_dedup.packing import gather_rows, pack, segment_sum_rows, unpack
from arctic_dedup.plan import Plan, PrefixTree, ResponseIndex, build_plan, build_plan_from_layout

__version__ = "0.1.0"

__all__ = [
    "BatchLayoutError",
    "BatchStats",
    "BlockSparsity",
    "DedupCost",
    "ForestGrouping",
    "ForestKernelConfig",
    "ForestPlan",
    "GroupSplitWarning",
    "IndexMap",
    "MicroBatch",
    "ModelShape",
    "Plan",
    "PlanError",
    "PrefixTree",
    "PromptGroup",
    "ReconstructionInfo",
    "ResponseIndex",
    "RowGroups",
    "SampleLayout",
    "TreeAttentionBackend",
    "VarlenParams",
    "ZoRRoTrain",
    "__version__",
    "analyze_normal_batch_via_attention_mask",
    "block_sparsity",
    "build_plan",
    "build_plan_from_layout",
    "choose_backend",
    "dedup_cost",
    "dedup_cost_of_plan",
    "dense_tree_mask",
    "forest_decode",
    "format_micro_batch_report",
    "gather_rows",
    "group_rows",
    "pack",
    "paged_decode",
    "partition_for_data_parallel",
    "partition_items",
    "plan_forest",
    "plan_micro_batches",
    "plan_paged",
    "prompt_groups",
    "segment_sum_rows",
    "tree_attention",
    "tree_attention_reference",
    "unpack",
]
