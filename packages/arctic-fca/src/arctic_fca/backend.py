"""FCA's CUDA backends: one wraps vLLM's FlashAttention (float16/bfloat16, registered as ``CUSTOM``), one wraps vLLM's
Triton attention (float32 too, registered over ``TRITON_ATTN``, which is vLLM's float32 default on CUDA).

Each subclasses the standard backend and adds the same two pieces (``arctic_fca.forest_step``): a metadata builder
that adds the step's ``ForestPlan`` to the standard metadata for decode steps (``arctic_fca.planner``), and an
attention implementation that runs ``forest_decode`` when a plan is present and the standard implementation
otherwise, so prefills, mixed and ineligible steps are exactly vLLM's standard attention. Both standard backends keep
K and V of a token in one packed cache row (vLLM 0.26 through 0.33), which ``forest_decode`` reads in place, written
by the standard ``do_kv_cache_update`` before ``forward`` runs (neither fuses the update into forward).
``forest_decode`` computes in float32, with exact float32 dot products for float32 inputs.

A model's dtype is known only after the plugin registers its backends, and vLLM validates the selected backend against
it, so each dtype has its backend name: ``CUSTOM`` (FlashAttention's dtypes; a float32 model is refused with a message
naming ``TRITON_ATTN``) and ``TRITON_ATTN`` (every dtype Triton attention runs, float32 included).

Full CUDA graphs: the builders support vLLM's full graphs of uniform decode batches (query length 1, or up to
``ARCTIC_FCA_MAX_QUERY_LEN`` with speculative decoding), never more than the standard builder's own support. Each
batch size vLLM captures gets a ``StaticForestPlan`` at the warm-up runs before its capture (or at the capture,
``build_for_cudagraph_capture``); from then on every step of that (padded) size is planned into that plan's
persistent buffers by the step's first FCA layer (``fca_update`` in the metadata), from vLLM's persistent block
table, lengths and query offsets, so the captured graph replays the planning with the layers and the host does no FCA
work for a replayed step; the static plans share one scratch for their partial results. Whether a step of a captured
size uses FCA depends only on what is fixed for its graph (batch size, query length, the layers), never on
``is_active()``: a paused FCA plans such steps with no groups (FCA's per-request decode, the same attention; the
captured planning reads a device flag) instead of switching backends under a graph that cannot switch.
vLLM's warm-up runs before each capture compile every kernel variant the captured sizes use, so decoding compiles
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from arctic_dedup.forest import ForestPlan
from arctic_fca.forest_step import ForestAttentionImpl, ForestMetadataBuilder
from arctic_fca.planner import PlanUpdate

__all__ = [
    "FcaFlashAttentionBackend",
    "FcaFlashAttentionImpl",
    "FcaFlashMetadata",
    "FcaFlashMetadataBuilder",
    "FcaTritonAttentionBackend",
    "FcaTritonAttentionImpl",
    "FcaTritonMetadata",
    "FcaTritonMetadataBuilder",
]

# vLLM's reason when a backend does not run the model's dtype (vllm 0.26 through 0.33).
_DTYPE_REASON = "dtype not supported"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------------- FlashAttention


@dataclass
class FcaFlashMetadata(FlashAttentionMetadata):
    fca: ForestPlan | None = None
    fca_update: PlanUpdate | None = None
    # The standard forward's metadata for the requests the plan leaves out (forest_step.standard_metadata).
    fca_standard: FlashAttentionMetadata | None = None


class FcaFlashMetadataBuilder(ForestMetadataBuilder, FlashAttentionMetadataBuilder):
    fca_metadata_class = FcaFlashMetadata
    # FlashAttention's decode reads an unshared context at the read-rate bound: it keeps the requests no group takes.
    leaves_ungrouped_to_standard = True


class FcaFlashAttentionImpl(ForestAttentionImpl, FlashAttentionImpl):
    pass


class FcaFlashAttentionBackend(FlashAttentionBackend):
    supports_kv_cache_update_bypass: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[FcaFlashAttentionImpl]:
        return FcaFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FcaFlashMetadataBuilder]:
        return FcaFlashMetadataBuilder

    @classmethod
    def validate_configuration(cls, *args: Any, **kwargs: Any) -> list[str]:
        """FlashAttention's reasons to refuse a configuration, the dtype's reason saying which FCA backend runs it."""
        reasons: list[str] = super().validate_configuration(*args, **kwargs)
        dtype = _dtype_name(kwargs.get("dtype"))
        supported = " and ".join(map(_dtype_name, cls.supported_dtypes))
        explained = (
            f"FCA's CUSTOM backend wraps FlashAttention, which runs {supported}, not {dtype}: for {dtype} select "
            "attention_config={'backend': 'TRITON_ATTN'} (or --attention-backend TRITON_ATTN), with ARCTIC_FCA=1 "
            "that is FCA around vLLM's Triton attention"
        )
        return [explained if reason == _DTYPE_REASON else reason for reason in reasons]


# ---------------------------------------------------------------------------------------------------- Triton attention


@dataclass
class FcaTritonMetadata(TritonAttentionMetadata):
    fca: ForestPlan | None = None
    fca_update: PlanUpdate | None = None


class FcaTritonMetadataBuilder(ForestMetadataBuilder, TritonAttentionMetadataBuilder):
    fca_metadata_class = FcaTritonMetadata


class FcaTritonAttentionImpl(ForestAttentionImpl, TritonAttentionImpl):
    pass


class FcaTritonAttentionBackend(TritonAttentionBackend):
    """Registered over ``TRITON_ATTN`` (its name stays ``TRITON_ATTN``): selecting that backend, or leaving a float32
    model on vLLM's default, runs FCA."""

    @staticmethod
    def get_impl_cls() -> type[FcaTritonAttentionImpl]:
        return FcaTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FcaTritonMetadataBuilder]:
        return FcaTritonMetadataBuilder
