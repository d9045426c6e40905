"""What every FCA backend adds to the vLLM backend it wraps: its metadata builder plans each step
(``ForestMetadataBuilder``: the standard metadata plus the step's ``ForestPlan``, vLLM's full CUDA graphs of uniform
decode batches), its attention implementation runs ``forest_decode`` where the step has a plan
(``ForestAttentionImpl``), and the standard backend runs everything else.

A builder that sets ``leaves_ungrouped_to_standard`` plans steps whose ungrouped requests (no prefix shared with
another request of the batch) go to the standard kernel itself: each layer first runs the standard forward over the
batch with those requests' lengths (``ForestPlan.standard_seq_lens``, 0 for a grouped request, so the standard kernel
reads no key of a grouped request), then ``forest_decode`` writes the grouped requests' rows. A batch with nothing
shared then costs the standard kernel plus FCA's empty launches; both run on the device inside a captured graph."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any, ClassVar, TypeVar

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

from arctic_dedup.forest import ForestPlan, forest_decode
from arctic_fca.config import FcaConfig
from arctic_fca.planner import ForestPlanner, PlanUpdate

__all__ = [
    "ForestAttentionImpl",
    "ForestMetadataBuilder",
    "paged_cache_views",
    "replace_plan",
    "run_forest",
    "standard_metadata",
    "with_plan",
]

Metadata = TypeVar("Metadata")


def with_plan(
    metadata_class: Callable[..., Metadata], base: Any, plan: ForestPlan | None, update: PlanUpdate | None = None
) -> Metadata:
    """``base`` (a standard backend's metadata dataclass) as ``metadata_class``, its subclass with ``fca`` (the step's
    plan) and ``fca_update`` (the plan's update, run by the first layer) fields. Built every step: copies ``base``'s
    attributes, not its fields one by one through the constructor."""
    if not hasattr(base, "__dict__"):
        fields_of_base = {field.name: getattr(base, field.name) for field in fields(base)}
        return metadata_class(**fields_of_base, fca=plan, fca_update=update)
    metadata: Any = object.__new__(metadata_class)  # type: ignore[arg-type]
    metadata.__dict__.update(base.__dict__)
    metadata.fca = plan
    metadata.fca_update = update
    return metadata  # type: ignore[no-any-return]


def replace_plan(metadata: Metadata, plan: ForestPlan) -> Metadata:
    return replace(metadata, fca=plan)  # type: ignore[type-var]


def paged_cache_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """FlashAttention's and Triton attention's KV cache as ``forest_decode`` reads it.

    Both backends (vLLM 0.26 through 0.33) pack K and V of a token into one row: logical shape
    ``[blocks, H_kv, block, 2 * D]``, whatever the physical stride order (NHD or HND). Returns views
    ``[blocks, block, H_kv, D]`` of the key and the value halves, or ``None`` for a row packed otherwise (per-token
    quantized caches store a scale after each half).
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        return None
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


def standard_metadata(metadata: Any) -> Any:
    """The step's metadata for the standard forward over the requests its plan leaves out (a copy whose lengths are
    ``plan.standard_seq_lens``); made by the step's first layer and kept on ``metadata`` for the others."""
    standard = getattr(metadata, "fca_standard", None)
    if standard is None:
        standard = copy.copy(metadata)
        standard.seq_lens = metadata.fca.standard_seq_lens
        standard.fca = standard.fca_update = None
        if getattr(standard, "use_cascade", False):
            # vLLM's cascade split the lengths at the batch's common prefix; these lengths are whole contexts.
            standard.use_cascade = False
            standard.scheduler_metadata = None
        metadata.fca_standard = standard
    return standard


def forest_fits(query: torch.Tensor, key_cache: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether ``forest_decode`` can read this layer: the cache in the query's dtype (not quantized), the output
    ``[T, H_q, D]``."""
    return key_cache.dtype == query.dtype and output.dim() == 3


def run_forest(
    impl: Any,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: Any,
    output: torch.Tensor,
) -> None:
    """Run forest decode into ``output`` (for a layer whose tensors fit the plan: ``forest_fits``)."""
    num_tokens = metadata.num_actual_tokens
    forest_decode(
        query[:num_tokens],
        key_cache,
        value_cache,
        metadata.fca,
        impl.scale,
        out=output[:num_tokens],
        backend="auto",
    )


class ForestMetadataBuilder(AttentionMetadataBuilder):
    """What FCA adds to a standard metadata builder; an FCA builder lists it before the standard one among its bases,
    names its metadata class (the standard one plus an ``fca`` field) in ``fca_metadata_class`` and sets
    ``plans_on_cpu`` where the plan is read on the host (vLLM's CPU build)."""

    fca_metadata_class: ClassVar[type]
    plans_on_cpu: ClassVar[bool] = False
    # The standard kernel attends the requests no group takes (see the module's docstring).
    leaves_ungrouped_to_standard: ClassVar[bool] = False
    # vLLM reuses one KV-cache group's metadata for another group of the same spec by swapping in its block table
    # (update_block_table); the plan was made from the first table, so every group builds its own.
    supports_update_block_table: bool = False

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.forest_planner = ForestPlanner(
            kv_cache_spec,
            layer_names,
            vllm_config,
            on_cpu=self.plans_on_cpu,
            leave_ungrouped=self.leaves_ungrouped_to_standard,
        )
        self._capturing = False
        # A speculator that refreshes draft metadata inside its graph (update_draft_decode_metadata) would keep the
        # previous step's plan: FCA's metadata is only right when build() runs.
        self.supports_draft_decode_metadata_update = False

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec: Any) -> AttentionCGSupport:
        # FCA captures uniform decode batches (every request ARCTIC_FCA_MAX_QUERY_LEN or fewer query tokens, all the
        # same); every other batch runs the standard backend, so the support is never more than the standard's own.
        fca = (
            AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
            if FcaConfig.from_env().max_query_len == 1
            else AttentionCGSupport.UNIFORM_BATCH
        )
        standard = super().get_cudagraph_support(vllm_config, kv_cache_spec)
        return fca if fca.value <= standard.value else standard

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> Any:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        plan, update = self.forest_planner.plan_step(common_attn_metadata, capturing=self._capturing)
        return with_plan(self.fca_metadata_class, base, plan, update)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> Any:
        """The metadata of a batch vLLM captures in a full CUDA graph: its plan is the static plan of its size."""
        self._capturing = True
        try:
            metadata = super().build_for_cudagraph_capture(common_attn_metadata)
        finally:
            self._capturing = False
        if isinstance(metadata, self.fca_metadata_class):
            return metadata
        # A standard builder that builds capture metadata without calling build(): plan here instead.
        plan, update = self.forest_planner.plan_step(common_attn_metadata, capturing=True)
        return with_plan(self.fca_metadata_class, metadata, plan, update)


class ForestAttentionImpl(AttentionImpl):
    """What FCA adds to a standard attention implementation (listed before it among an FCA impl's bases):
    ``forest_decode`` when the step has a plan and the layer's cache fits it, the standard forward otherwise."""

    head_size: int

    def forest_inputs(
        self, layer: Any, kv_cache: torch.Tensor, attn_metadata: Any
    ) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
        """The key cache, value cache and metadata ``forest_decode`` reads this layer with, or ``None`` where it cannot
        read the layer's cache: here FlashAttention's and Triton attention's packed cache, viewed in place."""
        caches = paged_cache_views(kv_cache, self.head_size)
        return None if caches is None else (*caches, attn_metadata)

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if getattr(attn_metadata, "fca", None) is not None and output_scale is None and output_block_scale is None:
            # The step's first FCA layer fills a static plan for the step (inside a captured graph: at each replay).
            update = getattr(attn_metadata, "fca_update", None)
            if update is not None:
                update()
            inputs = self.forest_inputs(layer, kv_cache, attn_metadata)
            if inputs is not None and forest_fits(query, inputs[0], output):
                if attn_metadata.fca.leaves_ungrouped:
                    # The requests no group takes: the standard kernel, over their lengths only.
                    super().forward(
                        layer, query, key, value, kv_cache, standard_metadata(attn_metadata), output, None, None
                    )
                run_forest(self, query, *inputs, output)
                return output
        return super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
