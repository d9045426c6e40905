"""Forest cascade decode: shared-prefix paged decode attention for batches of sampled responses."""

from arctic_dedup.forest.decode import forest_decode, paged_decode
from arctic_dedup.forest.plan import (
    ForestGrouping,
    ForestKernelConfig,
    ForestPlan,
    ForestScratch,
    ForestWorkspace,
    plan_forest,
    plan_paged,
)
from arctic_dedup.forest.reference import reference_forest_groups, reference_paged_attention
from arctic_dedup.forest.static_plan import StaticForestPlan

__all__ = [
    "ForestGrouping",
    "ForestKernelConfig",
    "ForestPlan",
    "ForestScratch",
    "ForestWorkspace",
    "StaticForestPlan",
    "forest_decode",
    "paged_decode",
    "plan_forest",
    "plan_paged",
    "reference_forest_groups",
    "reference_paged_attention",
]
