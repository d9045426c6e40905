"""The plan: a prefix tree over one micro-batch, built once and read by every layer (see README.md)."""

from arctic_dedup.plan.build import (
    Plan,
    PrefixSharing,
    PrefixTree,
    ResponseIndex,
    build_plan,
    build_plan_from_layout,
)

__all__ = ["Plan", "PrefixSharing", "PrefixTree", "ResponseIndex", "build_plan", "build_plan_from_layout"]
