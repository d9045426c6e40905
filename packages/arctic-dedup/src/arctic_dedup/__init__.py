"""arctic-dedup: plan, pack and attend over deduplicated RL batches (torch + Triton, nothing model-specific).

The names below are what a user needs; the types and tuning knobs behind them stay importable from their modules
(``arctic_dedup.plan``, ``arctic_dedup.packing``, ``arctic_dedup.attention``, ``arctic_dedup.forest``,
``arctic_dedup.balance``, ``arctic_dedup.cost``, ``arctic_dedup.plan.layout``).
"""

import importlib.metadata

from arctic_dedup.attention import tree_attention, tree_attention_reference
from arctic_dedup.balance import partition_for_data_parallel, plan_micro_batches, prompt_groups
from arctic_dedup.cost import ModelShape, dedup_cost, dedup_cost_of_plan
from arctic_dedup.errors import BatchLayoutError, PlanError
from arctic_dedup.facade import ZoRRoTrain, analyze_normal_batch_via_attention_mask
from arctic_dedup.forest import forest_decode, paged_decode, plan_forest
from arctic_dedup.packing import pack, unpack
from arctic_dedup.plan import Plan, build_plan, build_plan_from_layout
from arctic_dedup.plan.layout import SampleLayout

try:
    __version__: str = importlib.metadata.version("arctic-dedup")
except importlib.metadata.PackageNotFoundError:
    # Sources on PYTHONPATH without an install (``nox -s gpu_tests``): the version's one source, pyproject.toml.
    import tomllib
    from pathlib import Path

    __version__ = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["version"]

__all__ = [
    "BatchLayoutError",
    "ModelShape",
    "Plan",
    "PlanError",
    "SampleLayout",
    "ZoRRoTrain",
    "__version__",
    "analyze_normal_batch_via_attention_mask",
    "build_plan",
    "build_plan_from_layout",
    "dedup_cost",
    "dedup_cost_of_plan",
    "forest_decode",
    "pack",
    "paged_decode",
    "partition_for_data_parallel",
    "plan_forest",
    "plan_micro_batches",
    "prompt_groups",
    "tree_attention",
    "tree_attention_reference",
    "unpack",
]
