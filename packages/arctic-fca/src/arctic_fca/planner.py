"""The FCA step planner every FCA backend's metadata builder owns: one ``ForestPlan`` per decode step, read by every
layer of the step, and the step's stats.

On CUDA the plan is built once per step (three small launches over the block table with a workspace kept by the
planner, never waiting for the device); a step where grouping finds nothing runs each request as one work item of the
same attention kernel, i.e. arctic's per-request paged decode. On CPU the plan is read on the host (free there) and
such a step goes to the standard backend. Each batch size vLLM captures in a full CUDA graph gets a
``StaticForestPlan`` (see ``arctic_fca.backend``).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy
import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata

from arctic_dedup.forest import ForestPlan, ForestScratch, ForestWorkspace, StaticForestPlan, plan_forest
from arctic_fca.config import FcaConfig, is_active
from arctic_fca.stats import LOGGER_NAME, record_standard_step, record_step

__all__ = ["ForestPlanner", "flush_planner_stats"]

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
        # Reference sliding-window models (R-SWA, vLLM 0.26+) let generated tokens see only a window past the prompt.
        model_config = getattr(self.vllm_config, "model_config", None)
        windowed = getattr(model_config, "rswa_window", None) is not None
        supported = not windowed and all(_impl_supported(layer.impl) for layer in layers.values())
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
