"""The FCA step planner every FCA backend's metadata builder owns: one ``ForestPlan`` per decode step, read by every
layer of the step, and the step's stats.

On CUDA the plan is built once per step (three small launches over the block table with a workspace kept by the
planner, never waiting for the device); a request that no group takes runs as work items of the same attention kernel
(arctic's per-request paged decode), or, for a planner made with ``leave_ungrouped`` (FCA around FlashAttention), is
left out of the plan for the standard kernel. On CPU the plan is read on the host (free there) and
such a step goes to the standard backend. Each batch size vLLM captures in a full CUDA graph gets a
``StaticForestPlan`` (see ``arctic_fca.backend``), updated inside the step's forward (``PlanUpdate``): vLLM's graph
captures the update with the layers, so a replayed step plans on the device and FCA adds no host work to it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import numpy
import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata

from arctic_dedup.forest import ForestPlan, ForestScratch, ForestWorkspace, StaticForestPlan, plan_forest
from arctic_fca.config import FcaConfig, is_active
from arctic_fca.stats import LOGGER_NAME, record_standard_step, record_step, record_steps

__all__ = ["ForestPlanner", "PlanUpdate", "flush_planner_stats"]

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


class PlanUpdate:
    """One step's update of a static plan, run by the first FCA layer of the step's forward (later layers find it
    done), so that a CUDA graph capturing the forward captures the update too."""

    __slots__ = ("_run",)

    def __init__(self, run: Callable[[], None]) -> None:
        self._run: Callable[[], None] | None = run

    def __call__(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run()


class ForestPlanner:
    """Builds one step's ``ForestPlan`` for one KV-cache group and records the step's stats."""

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: VllmConfig,
        on_cpu: bool,
        leave_ungrouped: bool = False,
    ) -> None:
        self.config = FcaConfig.from_env()
        # The plans leave the ungrouped requests to the standard backend (``ForestPlan.leaves_ungrouped``).
        self.leave_ungrouped = leave_ungrouped and not on_cpu
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
        # Read by the static plans' (captured) grouping launches: 0 while FCA is paused.
        self._grouping_gate: torch.Tensor | None = None
        self._gate_open = True
        # The CUDA plans' counters, summed on the device (inside captured graphs too): steps with a group, groups,
        # grouped requests, saved block reads; the host counts the steps and their requests and reads the sums every
        # log_interval steps (a read waits for the device).
        self._totals: torch.Tensor | None = None
        self._totals_read: tuple[int, ...] = (0, 0, 0, 0)
        self._unread_steps = 0
        self._unread_requests = 0
        # After a capture (whose update, when it runs at all, is no step of the user's) the sums are read afresh.
        self._rebase_totals = False
        self._facts: tuple[bool, int, int] | None = None
        self._steps_since_log = 0
        _planners.add(self)

    def _attention_layers(self) -> dict[str, Any]:
        if self._layers is None:
            self._layers = get_layers_from_vllm_config(self.vllm_config, Attention, self.layer_names)
        return self._layers

    def _layer_facts(self) -> tuple[bool, int, int] | None:
        """(every layer supported, query heads, cache blocks) once the layers and their KV cache exist; fixed from
        then on, so read once."""
        if self._facts is None:
            self._facts = self._read_layer_facts()
        return self._facts

    def _read_layer_facts(self) -> tuple[bool, int, int] | None:
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
        """This step's plan, updated now, or ``None`` for standard attention (``plan_step`` with its update run)."""
        plan, update = self.plan_step(metadata, capturing)
        if update is not None:
            update()
        return plan

    def plan_step(
        self, metadata: CommonAttentionMetadata, capturing: bool = False
    ) -> tuple[ForestPlan | None, PlanUpdate | None]:
        """This step's plan (``None``: standard attention) and, for a static plan, the update that fills it for this
        step, to run on the device before the plan's first decode (the first FCA layer of the step's forward runs
        it). ``capturing``: vLLM captures a full CUDA graph of this batch (it gets a static plan, used by every later
        step of its size)."""
        if self._unread_steps >= self.config.log_interval:
            # Here, before this step adds anything: every counted step's counters are queued on the device (a
            # static plan's update runs in its step's forward, after this build), so the read matches the count.
            self.flush_stats()
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
            return None, None
        _, num_heads, num_cache_blocks = facts
        table = metadata.block_table_tensor
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
                    grouping_gate=self._gate(table.device),
                    leave_ungrouped=self.leave_ungrouped,
                )
                # Made here, outside any capture: a graph that captured their creation would zero them at replay.
                self._totals_on(table.device)
            if static is not None:
                return static.plan, self._static_update(static, metadata, record=not capturing)
        if not is_active():
            record_standard_step()
            return None, None
        plan = plan_forest(
            table[:num_requests],
            metadata.seq_lens[:num_requests],
            metadata.query_start_loc[: num_requests + 1],
            block_size=self.block_size,
            num_cache_blocks=num_cache_blocks,
            max_query_len=max_query_len,
            queries_per_kv=num_heads // self.num_kv_heads,
            num_kv_heads=self.num_kv_heads,
            grouping=self.grouping,
            workspace=None if self.on_cpu else self._workspace_for(num_cache_blocks, table.device),
            leave_ungrouped=self.leave_ungrouped,
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
            return (plan if groups > 0 else None), None
        self._add_to_totals(plan.stats)
        self._count_step(num_requests)
        return plan, None

    def _gate(self, device: torch.device) -> torch.Tensor:
        if self._grouping_gate is None:
            self._grouping_gate = torch.ones(1, dtype=torch.int32, device=device)
        return self._grouping_gate

    def _static_update(self, static: StaticForestPlan, metadata: CommonAttentionMetadata, record: bool) -> PlanUpdate:
        active = is_active()
        if active != self._gate_open:
            # In stream order before this step's update (replayed or not): grouping follows FCA's pause.
            static.grouping_gate.fill_(int(active))
            self._gate_open = active
        num_requests = static.num_requests

        def update() -> None:
            # vLLM's block table, lengths and query offsets are its persistent buffers: a graph that captures this
            # reads each later step's values.
            static.update(
                metadata.block_table_tensor[:num_requests],
                metadata.seq_lens[:num_requests],
                metadata.query_start_loc[: num_requests + 1],
                grouping=self.grouping,
            )
            self._add_to_totals(static.plan.stats)

        # A capture's dummy batch is no step of the user's: record what came before it, and read the sums afresh
        # before the next step (both wait for the device; captures happen at start-up).
        if not record:
            self.flush_stats()
            self._rebase_totals = True
        else:
            if self._rebase_totals and self._totals is not None:
                self._totals_read = tuple(int(value) for value in self._totals.tolist())
                self._rebase_totals = False
            if active:
                # vLLM pads a graph's batch with requests that have no query tokens; the stats count the real ones.
                starts = metadata.query_start_loc_cpu[: num_requests + 1].numpy()
                self._count_step(int(numpy.count_nonzero(starts[1:] > starts[:-1])))
            else:
                record_standard_step()
        return PlanUpdate(update)

    def _totals_on(self, device: torch.device) -> torch.Tensor:
        if self._totals is None:
            self._totals = torch.zeros(4, dtype=torch.int64, device=device)
        return self._totals

    def _add_to_totals(self, stats: torch.Tensor) -> None:
        """Add one plan's counters (groups, grouped requests, saved block reads) to the device sums; no host read."""
        totals = self._totals_on(stats.device)
        totals[:1].add_(stats[:1] > 0)
        totals[1:].add_(stats)

    def _count_step(self, num_requests: int) -> None:
        self._unread_steps += 1
        self._unread_requests += num_requests

    def flush_stats(self) -> None:
        """Record the steps counted since the last read with the device sums of their counters (waits for them)."""
        steps, requests = self._unread_steps, self._unread_requests
        if steps == 0 or self._totals is None:
            return
        self._unread_steps = self._unread_requests = 0
        totals = tuple(int(value) for value in self._totals.tolist())
        steps_grouped, groups, grouped, saved = (now - before for now, before in zip(totals, self._totals_read))
        self._totals_read = totals
        record_steps(steps, steps_grouped, requests, groups, grouped, saved * self.bytes_per_block, log=True)
