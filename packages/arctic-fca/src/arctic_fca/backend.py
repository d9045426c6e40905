"""vLLM glue, the only module that imports vLLM: FCA backends that wrap FlashAttention (CUDA) and CPU_ATTN (CPU).

Each FCA backend subclasses the platform's standard backend. Its metadata builder builds the standard metadata plus,
for decode steps (every request has at most ``max_query_len`` query tokens), a ``ForestPlan`` from the step's block
table. Its attention implementation runs ``forest_decode`` when a plan is present and the standard implementation
otherwise, so prefills, mixed and ineligible steps are exactly vLLM's standard attention. The KV cache is written by
the standard ``do_kv_cache_update`` before ``forward`` runs (these backends do not fuse the update into forward).

On CUDA the plan is built once per step by the metadata builder (three small launches over the block table with a
workspace kept by the planner, never waiting for the device) and read by every layer; a step where grouping finds
nothing runs each request as one work item of the same attention kernel, i.e. arctic's per-request paged decode.
On CPU the plan is read on the host (free there) and such a step goes to CPU_ATTN.

Full CUDA graphs (CUDA): the builder supports vLLM's full graphs of uniform decode batches (query length 1, or up to
``ARCTIC_FCA_MAX_QUERY_LEN`` with speculative decoding). Each batch size vLLM captures gets a ``StaticForestPlan``
at the warm-up runs before its capture (or at the capture, ``build_for_cudagraph_capture``); from then on every step
of that (padded) size is planned, outside the graph, into that plan's persistent buffers, and the captured
``forest_decode`` launches read them; the static plans share one scratch for their partial results. Whether a step
of a captured size uses FCA depends only on what is fixed for its graph (batch size, query length, the layers), never
on ``is_active()``: a paused FCA plans such steps with no groups (FCA's per-request decode, the same attention)
instead of switching backends under a graph that cannot switch. vLLM's warm-up runs before each capture compile every
kernel variant the captured sizes use, so decoding compiles nothing.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

import numpy
import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)

from arctic_dedup.forest import (
    ForestPlan,
    ForestScratch,
    ForestWorkspace,
    StaticForestPlan,
    forest_decode,
    plan_forest,
)
from arctic_fca.config import FcaConfig, is_active
from arctic_fca.stats import LOGGER_NAME, record_standard_step, record_step

__all__ = [
    "FcaCpuAttentionBackend",
    "FcaCpuAttentionImpl",
    "FcaCpuMetadata",
    "FcaCpuMetadataBuilder",
    "FcaFlashAttentionBackend",
    "FcaFlashAttentionImpl",
    "FcaFlashMetadata",
    "FcaFlashMetadataBuilder",
    "ForestPlanner",
    "flush_planner_stats",
]

logger = logging.getLogger(LOGGER_NAME)
# Every live planner of this process, so that a stats read can first record the steps a GPU planner still holds.
_planners: weakref.WeakSet[ForestPlanner] = weakref.WeakSet()


def flush_planner_stats() -> None:
    """Record the counters that GPU planners keep on the device between log intervals (waits for the device)."""
    for planner in list(_planners):
        planner.flush_stats()


def _no_window(window: Any) -> bool:
    return window is None or window == -1 or window == (-1, -1)


def _impl_supported(impl: Any) -> bool:
    """Layers FCA can run: plain causal decoder attention with no window, ALiBi, sinks or soft cap."""
    return (
        getattr(impl, "attn_type", AttentionType.DECODER) == AttentionType.DECODER
        and _no_window(getattr(impl, "sliding_window", None))
        and getattr(impl, "alibi_slopes", None) is None
        and getattr(impl, "sinks", None) is None
        and not getattr(impl, "logits_soft_cap", 0)
        and getattr(impl, "kv_sharing_target_layer_name", None) is None
    )


class ForestPlanner:
    """Builds one step's ``ForestPlan`` for one KV-cache group and records the step's stats."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig, on_cpu: bool) -> None:
        self.config = FcaConfig.from_env()
        self.grouping = self.config.grouping()
        self.block_size = int(kv_cache_spec.block_size)
        self.num_kv_heads = int(kv_cache_spec.num_kv_heads)
        self.head_size = int(kv_cache_spec.head_size)
        dtype = getattr(kv_cache_spec, "dtype", torch.bfloat16)
        self.bytes_per_block = (
            2 * self.block_size * self.num_kv_heads * self.head_size * torch.empty(0, dtype=dtype).element_size()
        )
        self.layer_names = list(layer_names)
        self.vllm_config = vllm_config
        self.on_cpu = on_cpu
        self._layers: dict[str, Any] | None = None
        self._workspace: ForestWorkspace | None = None
        # One persistent plan per captured (padded batch size, query length): a full CUDA graph reads its buffers.
        # Their decode calls run in stream order, so they share one scratch for their partial results.
        self.static_plans: dict[tuple[int, int], StaticForestPlan] = {}
        self._scratch = ForestScratch()
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._steps_since_log = 0
        _planners.add(self)

    def _attention_layers(self) -> dict[str, Any]:
        if self._layers is None:
            self._layers = get_layers_from_vllm_config(self.vllm_config, Attention, self.layer_names)
        return self._layers

    def _layer_facts(self) -> tuple[bool, int, int] | None:
        """(every layer supported, query heads, cache blocks) once the layers and their KV cache exist."""
        layers = self._attention_layers()
        if not layers:
            return None
        first = next(iter(layers.values()))
        cache = getattr(first, "kv_cache", None)
        # Some vLLM releases keep one cache per virtual engine in a list.
        if isinstance(cache, (list, tuple)) and cache:
            cache = cache[0]
        if not isinstance(cache, torch.Tensor) or cache.numel() == 0:
            return None
        supported = all(_impl_supported(layer.impl) for layer in layers.values())
        return supported, int(first.impl.num_heads), int(cache.shape[0])

    def _full_graph_sizes(self) -> tuple[int, ...]:
        """Token counts of the batches vLLM captures in full CUDA graphs (none when it captures no full graphs)."""
        compilation = getattr(self.vllm_config, "compilation_config", None)
        mode = getattr(compilation, "cudagraph_mode", None)
        if mode is None or not mode.has_full_cudagraphs():
            return ()
        return tuple(getattr(compilation, "cudagraph_capture_sizes", None) or ())

    def _workspace_for(self, num_cache_blocks: int, device: torch.device) -> ForestWorkspace:
        # The group finder's scratch is zero after every plan: one per KV cache, reused every step (stream order).
        workspace = self._workspace
        if workspace is None or workspace.num_cache_blocks != num_cache_blocks or workspace.device != device:
            workspace = self._workspace = ForestWorkspace(num_cache_blocks, device)
        return workspace

    def plan(self, metadata: CommonAttentionMetadata, capturing: bool = False) -> ForestPlan | None:
        """This step's plan, or ``None`` for standard attention; ``capturing``: vLLM captures a full CUDA graph of
        this batch (it gets a static plan, used by every later step of its size)."""
        num_requests = metadata.num_reqs
        facts = self._layer_facts()
        # Everything here is fixed for a captured graph's batches: the choice a graph captured stays right for it.
        fits = (
            facts is not None
            and facts[0]
            and metadata.max_query_len <= self.config.max_query_len
            and num_requests >= self.config.min_group_size
            and facts[1] % self.num_kv_heads == 0
        )
        if not fits or facts is None:
            record_standard_step()
            return None
        _, num_heads, num_cache_blocks = facts
        table = metadata.block_table_tensor[:num_requests]
        max_query_len = max(1, metadata.max_query_len)
        if not self.on_cpu:
            key = (num_requests, max_query_len)
            static = self.static_plans.get(key)
            # vLLM's warm-up runs of a size it captures come first: their eager calls record (and compile) the
            # launches that the capture then replays into the graph.
            if static is None and (capturing or num_requests * max_query_len in self._full_graph_sizes()):
                static = self.static_plans[key] = StaticForestPlan(
                    num_requests,
                    int(table.shape[1]),
                    block_size=self.block_size,
                    num_cache_blocks=num_cache_blocks,
                    max_query_len=max_query_len,
                    queries_per_kv=num_heads // self.num_kv_heads,
                    num_kv_heads=self.num_kv_heads,
                    device=table.device,
                    workspace=self._workspace_for(num_cache_blocks, table.device),
                    scratch=self._scratch,
                )
            if static is not None:
                return self._plan_static(static, metadata, record=not capturing)
        if not is_active():
            record_standard_step()
            return None
        plan = plan_forest(
            table,
            metadata.seq_lens[:num_requests],
            metadata.query_start_loc[: num_requests + 1],
            block_size=self.block_size,
            num_cache_blocks=num_cache_blocks,
            max_query_len=max_query_len,
            queries_per_kv=num_heads // self.num_kv_heads,
            num_kv_heads=self.num_kv_heads,
            grouping=self.grouping,
            workspace=None if self.on_cpu else self._workspace_for(num_cache_blocks, table.device),
        )
        if self.on_cpu:
            groups = int(plan.num_groups.item())
            self._steps_since_log += 1
            log = self._steps_since_log >= self.config.log_interval
            if log:
                self._steps_since_log = 0
            record_step(
                num_requests,
                groups,
                int(plan.num_grouped_requests.item()),
                int(plan.saved_block_reads.item()) * self.bytes_per_block,
                log=log,
            )
            return plan if groups > 0 else None
        self._defer_stats(num_requests, plan.stats)
        return plan

    def _plan_static(self, static: StaticForestPlan, metadata: CommonAttentionMetadata, record: bool) -> ForestPlan:
        num_requests = static.num_requests
        active = is_active()
        plan = static.update(
            metadata.block_table_tensor[:num_requests],
            metadata.seq_lens[:num_requests],
            metadata.query_start_loc[: num_requests + 1],
            grouping=self.grouping if active else None,
        )
        # A capture's dummy batch is no step of the user's.
        if not record:
            return plan
        if not active:
            record_standard_step()
            return plan
        # vLLM pads a graph's batch with requests that have no query tokens; the stats count the real ones.
        starts = metadata.query_start_loc_cpu[: num_requests + 1].numpy()
        real_requests = int(numpy.count_nonzero(starts[1:] > starts[:-1]))
        # The static plan's counters are overwritten next step: keep a copy until they are read.
        self._defer_stats(real_requests, plan.stats.clone())
        return plan

    def _defer_stats(self, num_requests: int, stats: torch.Tensor) -> None:
        # Reading the counters waits for the device: collect them and read a batch every log_interval steps.
        self._pending.append((num_requests, stats))
        if len(self._pending) >= self.config.log_interval:
            self.flush_stats()

    def flush_stats(self) -> None:
        pending, self._pending = self._pending, []
        for index, (requests, stats) in enumerate(pending):
            groups, grouped, saved = stats.tolist()
            record_step(requests, groups, grouped, saved * self.bytes_per_block, log=index == len(pending) - 1)


def _with_plan(metadata_class: type, base: Any, plan: ForestPlan | None) -> Any:
    return metadata_class(**{field.name: getattr(base, field.name) for field in fields(base)}, fca=plan)


def replace_metadata(metadata: Any, plan: ForestPlan) -> Any:
    return replace(metadata, fca=plan)


def _run_forest(
    impl: Any,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: Any,
    output: torch.Tensor,
) -> bool:
    """Run forest decode into ``output``; False (nothing written) when this layer's tensors do not fit the plan."""
    if key_cache.dtype != query.dtype or output.dim() != 3:
        return False
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
    return True


# ---------------------------------------------------------------------------------------------------- CUDA


@dataclass
class FcaFlashMetadata(FlashAttentionMetadata):
    fca: ForestPlan | None = None


class FcaFlashMetadataBuilder(FlashAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.forest_planner = ForestPlanner(kv_cache_spec, layer_names, vllm_config, on_cpu=False)
        self._capturing = False

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec: Any) -> AttentionCGSupport:
        # FCA captures uniform decode batches (every request ARCTIC_FCA_MAX_QUERY_LEN or fewer query tokens, all the
        # same); every other batch runs FlashAttention, so the support is never more than FlashAttention's own.
        fca = (
            AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
            if FcaConfig.from_env().max_query_len == 1
            else AttentionCGSupport.UNIFORM_BATCH
        )
        flash = super().get_cudagraph_support(vllm_config, kv_cache_spec)
        return fca if fca.value <= flash.value else flash

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> FcaFlashMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        plan = self.forest_planner.plan(common_attn_metadata, capturing=self._capturing)
        return _with_plan(FcaFlashMetadata, base, plan)  # type: ignore[no-any-return]

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> FcaFlashMetadata:
        """The metadata of a batch vLLM captures in a full CUDA graph: its plan is the static plan of its size."""
        self._capturing = True
        try:
            metadata = super().build_for_cudagraph_capture(common_attn_metadata)
        finally:
            self._capturing = False
        if isinstance(metadata, FcaFlashMetadata):
            return metadata
        # A FlashAttention release that builds capture metadata without calling build(): plan here instead.
        plan = self.forest_planner.plan(common_attn_metadata, capturing=True)
        return _with_plan(FcaFlashMetadata, metadata, plan)  # type: ignore[no-any-return]


class FcaFlashAttentionImpl(FlashAttentionImpl):
    def forward(  # type: ignore[override]
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
            # Same view as FlashAttention's: (blocks, kv heads, block, 2 * D) -> 2 x (blocks, block, kv heads, D).
            key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
            if _run_forest(self, query, key_cache, value_cache, attn_metadata, output):
                return output
        return super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )


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


# ---------------------------------------------------------------------------------------------------- CPU


@dataclass
class FcaCpuMetadata(CPUAttentionMetadata):
    fca: ForestPlan | None = None


class FcaCpuMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.forest_planner = ForestPlanner(kv_cache_spec, layer_names, vllm_config, on_cpu=True)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> FcaCpuMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return _with_plan(FcaCpuMetadata, base, self.forest_planner.plan(common_attn_metadata))  # type: ignore[no-any-return]


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


class FcaCpuAttentionImpl(CPUAttentionBackendImpl):
    _layouts: ClassVar[dict[tuple[str, int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor] | None]] = {}

    def _plain_caches(self, layer: Any, kv_cache: torch.Tensor, plan: ForestPlan) -> tuple[Any, ...] | None:
        """Token-major copies ``[used_blocks, block, H_kv, D]`` of the blocks this step reads, and the plan on them."""
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
        used_lengths = torch.div(plan.seq_lens + block_size - 1, block_size, rounding_mode="floor")
        columns = torch.arange(plan.block_table.shape[1])
        used = columns[None, :] < used_lengths[:, None]
        blocks, compact = torch.unique(plan.block_table[used].long(), return_inverse=True)
        table = torch.zeros_like(plan.block_table)
        table[used] = compact.to(table.dtype)
        tiles = kv_cache.view(num_blocks, num_kv_heads, 2, block_size * head_size)[blocks]
        shape = (len(blocks), num_kv_heads, block_size, head_size)
        key_cache = tiles[:, :, 0][..., key_positions].view(shape).permute(0, 2, 1, 3)
        value_cache = tiles[:, :, 1][..., value_positions].view(shape).permute(0, 2, 1, 3)
        return key_cache, value_cache, replace(plan, block_table=table)

    def forward(  # type: ignore[override]
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        plan = getattr(attn_metadata, "fca", None)
        if plan is not None and output_scale is None and output_block_scale is None:
            caches = self._plain_caches(layer, kv_cache, plan)
            if caches is not None:
                key_cache, value_cache, compact_plan = caches
                metadata = replace_metadata(attn_metadata, compact_plan)
                if _run_forest(self, query, key_cache, value_cache, metadata, output):
                    return output
        return super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )


class FcaCpuAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[FcaCpuAttentionImpl]:
        return FcaCpuAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FcaCpuMetadataBuilder]:
        return FcaCpuMetadataBuilder
