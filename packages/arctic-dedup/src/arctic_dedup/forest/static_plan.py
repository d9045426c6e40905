"""A forest plan whose buffers keep their addresses from step to step, so ``forest_decode`` can run in CUDA graphs.

A CUDA graph replays the launches it captured with the arguments it captured: the grids, the integer arguments and
every address. ``StaticForestPlan`` is the plan of one padded batch size (like FlashInfer's CUDA-graph wrappers, one
per captured batch size): it owns copies of the step's block table, lengths and query offsets and every plan buffer,
allocated once; ``update`` refills them in place each step (outside the graph) and returns the same ``ForestPlan``
object, whose host-side sizes (work-item bounds, tile shapes, kernel config) depend only on the batch size. Rows
beyond the step's requests are padding: zero length, no query tokens, so they own no work items and no output rows,
and the decode programs beyond the step's real work items exit at once. A step that is not grouped runs the same
kernels with no groups (every request reads its own context), so a graph captured on a grouped step replays any
step of its size exactly.

``update`` can itself be captured in the graph (it never reads the device on the host, and its inputs can be the
caller's own persistent buffers): a replay then plans the step on the device with no host work. Its grouping can
still be switched off after capture through ``grouping_gate``, a device flag the captured launches read.
"""

from __future__ import annotations

import torch

from arctic_dedup._triton_support import Backend
from arctic_dedup.errors import PlanError
from arctic_dedup.forest.plan import (
    _check_inputs,
    _fill,
    _multiprocessors,
    _plan_buffers,
    _sizes,
    default_forest_config,
)
from arctic_dedup.forest.plan_types import (
    ForestGrouping,
    ForestKernelConfig,
    ForestPlan,
    ForestScratch,
    ForestWorkspace,
)

__all__ = ["StaticForestPlan"]

# Finds no groups (no step has 2**31 - 1 requests, the kernels' int32 limit): a step planned with it is per-request
# decode.
_NO_GROUPS = ForestGrouping(min_group_size=2**31 - 1)


class StaticForestPlan:
    """The persistent plan of one batch size: ``update`` each step, then ``forest_decode`` with ``plan`` per layer.

    Args:
        num_requests: the batch size the plan is for (a captured graph's padded size); steps may have fewer rows.
        max_blocks: block-table width of every step.
        block_size, num_cache_blocks, max_query_len, queries_per_kv, num_kv_heads: as in ``plan_forest``.
        device: where the buffers live.
        config: kernel config (``default_forest_config`` for ``num_requests`` when ``None``).
        workspace: the group finder's scratch; plans that share one must be updated in stream order.
        scratch: where the decode calls take their partial buffers; static plans whose decode calls run in stream
            order (one model's captured batch sizes) share one, so they hold one buffer between them.
        grouping_gate: int32 ``[1]`` on ``device``: while it holds 0, ``update`` finds no groups (the same launches,
            so it also switches grouping off in graphs that captured ``update``); plans may share one. A new gate
            holding 1 when ``None``.
        leave_ungrouped: as in ``plan_forest``: the decode attends only the grouped requests, the caller the others
            over ``plan.standard_seq_lens`` (refilled by every ``update``).
    """

    def __init__(
        self,
        num_requests: int,
        max_blocks: int,
        *,
        block_size: int,
        num_cache_blocks: int,
        max_query_len: int,
        queries_per_kv: int,
        num_kv_heads: int,
        device: torch.device | str,
        config: ForestKernelConfig | None = None,
        workspace: ForestWorkspace | None = None,
        scratch: ForestScratch | None = None,
        grouping_gate: torch.Tensor | None = None,
        leave_ungrouped: bool = False,
    ) -> None:
        device = torch.device(device)
        if grouping_gate is None:
            grouping_gate = torch.ones(1, dtype=torch.int32, device=device)
        elif (
            grouping_gate.shape != (1,)
            or grouping_gate.dtype != torch.int32
            or grouping_gate.device.type != device.type
            or (device.index is not None and grouping_gate.device.index != device.index)
        ):
            raise PlanError(
                f"grouping_gate must be an int32 tensor of shape [1] on {device}, got {grouping_gate.dtype} of shape "
                f"{tuple(grouping_gate.shape)} on {grouping_gate.device}."
            )
        self.grouping_gate = grouping_gate
        if num_requests < 1 or max_blocks < 1 or num_cache_blocks < 1:
            raise PlanError(
                f"num_requests, max_blocks and num_cache_blocks must be >= 1, got {num_requests}, {max_blocks} and "
                f"{num_cache_blocks}."
            )
        if config is None:
            config = default_forest_config(num_requests, num_kv_heads, _multiprocessors(device, ForestKernelConfig()))
        self.block_size = block_size
        self.num_cache_blocks = num_cache_blocks
        self.workspace = workspace
        self._sizes = _sizes(num_requests, device, max_query_len, queries_per_kv, num_kv_heads, config, True)
        self._block_table = torch.zeros(num_requests, max_blocks, dtype=torch.int32, device=device)
        self._seq_lens = torch.zeros(num_requests, dtype=torch.int32, device=device)
        self._query_start_loc = torch.zeros(num_requests + 1, dtype=torch.int32, device=device)
        self._views = _plan_buffers(num_requests, num_kv_heads, device)
        self._views["combine_ready"].zero_()
        self._views["standard_seq_lens"].zero_()
        self.leave_ungrouped = leave_ungrouped
        plan_views = {name: view for name, view in self._views.items() if name != "standard_seq_lens"}
        self.plan = ForestPlan(
            block_table=self._block_table,
            seq_lens=self._seq_lens,
            query_start_loc=self._query_start_loc,
            block_size=block_size,
            max_query_len=max_query_len,
            queries_per_kv=queries_per_kv,
            num_kv_heads=num_kv_heads,
            members_per_tile=self._sizes.members_per_tile,
            prefix_block_m=self._sizes.prefix_block_m,
            max_prefix_work=self._sizes.max_prefix_work,
            max_suffix_work=self._sizes.max_suffix_work,
            shares=True,
            config=config,
            leaves_ungrouped=leave_ungrouped,
            standard_seq_lens=self._views["standard_seq_lens"] if leave_ungrouped else None,
            persistent=True,
            scratch=scratch if scratch is not None else ForestScratch(),
            **plan_views,
        )

    @property
    def num_requests(self) -> int:
        return self.plan.num_requests

    @property
    def max_blocks(self) -> int:
        return int(self._block_table.shape[1])

    def update(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        *,
        grouping: ForestGrouping | None,
        backend: Backend = "auto",
    ) -> ForestPlan:
        """Plan this step into the persistent buffers and return ``plan`` (the same object every step).

        Args:
            block_table: ``[R, max_blocks]`` with ``R <= num_requests``; rows ``R..`` of the plan become padding.
            seq_lens: ``[R]``; query_start_loc: ``[R + 1]``, as in ``plan_forest``.
            grouping: the step's grouping rule; ``None`` plans the step with no groups (same kernels).
            backend: as in ``plan_forest``.
        """
        plan = self.plan
        _check_inputs(
            block_table,
            seq_lens,
            query_start_loc,
            self.block_size,
            plan.max_query_len,
            plan.queries_per_kv,
            plan.num_kv_heads,
        )
        rows, width = block_table.shape
        if rows > self.num_requests or width != self.max_blocks or block_table.device != self._block_table.device:
            raise PlanError(
                f"this static plan holds up to {self.num_requests} requests of {self.max_blocks} blocks on "
                f"{self._block_table.device}, got a block table of {rows} x {width} on {block_table.device}; use the "
                "static plan of the step's padded batch size (or a new one for this table width)."
            )
        plan.torch_indices.clear()
        self._block_table[:rows].copy_(block_table)
        self._seq_lens[:rows].copy_(seq_lens)
        self._query_start_loc[: rows + 1].copy_(query_start_loc)
        if rows < self.num_requests:
            self._block_table[rows:].zero_()
            self._seq_lens[rows:].zero_()
            self._query_start_loc[rows + 1 :].copy_(
                self._query_start_loc[rows : rows + 1].expand(self.num_requests - rows)
            )
        _fill(
            self._block_table,
            self._seq_lens,
            self._query_start_loc,
            self._views,
            self._sizes,
            block_size=self.block_size,
            num_cache_blocks=self.num_cache_blocks,
            grouping=grouping if grouping is not None else _NO_GROUPS,
            config=plan.config,
            workspace=self.workspace,
            backend=backend,
            grouping_gate=self.grouping_gate,
            leave_ungrouped=self.leave_ungrouped,
        )
        return plan
