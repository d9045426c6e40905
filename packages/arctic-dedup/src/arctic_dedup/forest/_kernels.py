# mypy: disable-error-code="no-untyped-def"
"""Triton kernels for forest cascade decode (``@triton.jit`` code only).

Planning (once per step, three launches, no host sync):

- ``plan_count_kernel``: one program per request; counts how many eligible table entries of the batch hold each
  physical block id (a histogram in a zeroed workspace).
- ``plan_cut_kernel``: one program per request; cuts it at the depth that saves the most block reads and claims the
  group of the cut block for the lowest request index (``atomic_max`` of ``N - request``).
- ``plan_group_kernel``: one program per request; verifies its prefix against its leader's row, joins the group
  (``atomic_min`` of the common run, ``atomic_add`` of the size gives the member's rank), clears its histogram
  entries; the last program to finish (a ticket counter) builds the tiles and work lists for the whole batch and
  clears the rest of the workspace, so the workspace is zero again for the next step.
- ``plan_paged_kernel``: the same finishing step for a plan without groups (the per-request kernel's work list).

Decode (per layer, two launches; three when the prefix and suffix passes are split):

- ``forest_attention_kernel``: one program per (work item, kv head). Work items are prefix splits of group tiles
  first (long, tensor-core tiles of the GQA heads of up to ``MEMBERS`` requests reading the shared prefix once), then
  suffix splits of requests (each request's own tokens, causal within its query tokens). A request whose whole
  context is one suffix item writes its output directly; every other item writes a normalized fp32 partial and its
  log-sum-exp (natural log, ``-inf`` for a row that saw no key).
  ``PASS`` 1 or 2 runs only the prefix or only the suffix items (a split launch: the prefix pass first, then the
  suffix pass on the same stream; ``PASS`` 0 runs both in one launch).
- ``forest_combine_kernel``: one program per (request, kv head, slice of head dims) that has partials; merges them
  by log-sum-exp. With ``EARLY`` every attention item releases a count per (request, kv head) it served after its
  stores, and a combine program merges once its request's count is complete (the last slice clears it).

Row ``r`` of a request's row block stands for query token ``r // G`` and query head ``kv_head * G + r % G``.

Integer arguments that change from step to step (batch sizes, counts, offsets, table widths) are marked
``do_not_specialize``: Triton would otherwise compile a new variant in the middle of a run whenever one of them first
becomes 1 or a multiple of 16. Strides stay specialised (fixed for a model, and their divisibility vectorises loads).

Every kernel takes ``PDL`` (programmatic dependent launch, sm_90+; 0: a plain launch, nothing emitted). With 1 a
program first lets the next launch of its stream be scheduled, then waits until the launch before it has finished
and its writes are visible, before any memory access: results are those of plain stream order, only the launch
gaps shrink. 2 waits first, then lets the next launch be scheduled (so the next launch starting implies that the
one before this one has finished); 3 (the attention kernel's suffix pass after a prefix pass launched with 2, which
it does not read; the early combine, which waits for its own request's items through ``ForestPlan.combine_ready``)
lets the next launch be scheduled and waits at the very end, so it runs beside the launch before it and its own
completion still implies that launch's.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LN_2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _follow_previous_launch(PDL: tl.constexpr):
    # With PDL 0 (the interpreter, other devices) nothing is emitted; the modes are in the module docstring.
    if PDL == 1:
        gdc_launch_dependents()
        gdc_wait()
    elif PDL == 2:
        gdc_wait()
        gdc_launch_dependents()
    elif PDL == 3:
        gdc_launch_dependents()


@triton.jit
def _end_after_previous_launch(PDL: tl.constexpr):
    if PDL == 3:
        gdc_wait()


@triton.jit
def _back_off():
    # A program waiting on a count sleeps a little between polls, leaving its multiprocessor's issue slots to the
    # attention programs beside it (sm_70+).
    tl.inline_asm_elementwise("nanosleep.u32 256; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


# ---------------------------------------------------------------------------------------------------- planning


@triton.jit
def _eligible_blocks(seq_lens_ptr, query_start_ptr, request, block_size, max_blocks):
    # Only full blocks that lie entirely before the request's first query token can be a prefix all queries see.
    seq_len = tl.load(seq_lens_ptr + request)
    query_len = tl.load(query_start_ptr + request + 1) - tl.load(query_start_ptr + request)
    return tl.minimum(tl.maximum(seq_len - query_len, 0) // block_size, max_blocks)


@triton.jit(do_not_specialize=["max_blocks", "num_cache_blocks"])
def plan_count_kernel(
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    counts_ptr,
    group_min_ptr,
    group_count_ptr,
    stride_table_row,
    max_blocks,
    num_cache_blocks,
    block_size,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,
):
    _follow_previous_launch(PDL)
    request = tl.program_id(0)
    eligible = _eligible_blocks(seq_lens_ptr, query_start_ptr, request, block_size, max_blocks)
    row = block_table_ptr + request.to(tl.int64) * stride_table_row
    for start in range(0, eligible, BLOCK_E):
        depth = start + tl.arange(0, BLOCK_E)
        valid = depth < eligible
        ids = tl.load(row + depth, mask=valid, other=-1)
        # Ids outside the cache are never counted, so they can never be shared (and never index out of bounds).
        known = valid & (ids >= 0) & (ids < num_cache_blocks)
        tl.atomic_add(counts_ptr + ids, 1, mask=known, sem="relaxed")
    # The group pass lowers these with atomics; a common run never exceeds max_blocks.
    tl.store(group_min_ptr + request, max_blocks)
    tl.store(group_count_ptr + request, 0)


@triton.jit(do_not_specialize=["max_blocks", "num_cache_blocks", "num_requests"])
def plan_cut_kernel(
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    counts_ptr,
    leader_slot_ptr,
    cut_key_ptr,
    stride_table_row,
    max_blocks,
    num_cache_blocks,
    block_size,
    num_requests,
    min_group_size,
    min_prefix_blocks,
    grouping_gate_ptr,
    BLOCK_E: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PDL: tl.constexpr,
):
    _follow_previous_launch(PDL)
    request = tl.program_id(0)
    eligible = _eligible_blocks(seq_lens_ptr, query_start_ptr, request, block_size, max_blocks)
    if HAS_GATE:
        # A gate of 0 cuts no request: the step runs with no groups (the same launches, so a captured graph replays
        # either way).
        eligible = tl.where(tl.load(grouping_gate_ptr) != 0, eligible, 0)
    row = block_table_ptr + request.to(tl.int64) * stride_table_row
    best = tl.zeros([], dtype=tl.int64)
    best_depth = tl.zeros([], dtype=tl.int32)
    for start in range(0, eligible, BLOCK_E):
        depth = start + tl.arange(0, BLOCK_E)
        valid = depth < eligible
        ids = tl.load(row + depth, mask=valid, other=-1)
        known = valid & (ids >= 0) & (ids < num_cache_blocks)
        shared = tl.load(counts_ptr + ids, mask=known, other=0)
        usable = known & (shared >= min_group_size) & (depth + 1 >= min_prefix_blocks)
        savings = tl.where(usable, (shared - 1).to(tl.int64) * (depth + 1), 0)
        chunk_best = tl.max(savings, 0)
        # The first depth reaching the chunk's maximum; a later chunk wins only with a strictly larger saving.
        chunk_depth = tl.min(tl.where(savings == chunk_best, depth, max_blocks), 0)
        best_depth = tl.where(chunk_best > best, chunk_depth, best_depth)
        best = tl.maximum(best, chunk_best)
    candidate = best > 0
    key = tl.load(row + best_depth, mask=candidate, other=-1)
    tl.store(cut_key_ptr + request, tl.where(candidate, key, -1).to(tl.int32))
    # The lowest request index cut at this block leads its group: the slot keeps the largest N - request.
    tl.atomic_max(leader_slot_ptr + key, num_requests - request, mask=candidate, sem="relaxed")


@triton.jit
def _split_tokens(total_tokens, target_items, granularity):
    split = (tl.maximum(total_tokens, 1) + target_items - 1) // target_items
    return (split + granularity - 1) // granularity * granularity


@triton.jit
def _item_count(lengths, split):
    # A remainder under an eighth of a split joins the last item instead of becoming an item of its own.
    return tl.where(lengths > 0, tl.maximum((lengths - split // 8 + split - 1) // split, 1), 0)


@triton.jit
def _finish_plan(
    seq_lens_ptr,
    leader_of_ptr,
    rank_of_ptr,
    group_min_ptr,
    group_count_ptr,
    first_tile_ptr,
    first_member_ptr,
    prefix_blocks_ptr,
    group_leader_ptr,
    tile_of_ptr,
    slot_in_tile_ptr,
    tile_leader_ptr,
    tile_prefix_blocks_ptr,
    tile_member_start_ptr,
    tile_member_count_ptr,
    member_list_ptr,
    work_start_ptr,
    split_tokens_ptr,
    stats_ptr,
    ready_ptr,
    standard_lens_ptr,
    ready_count,
    num_requests,
    block_size,
    min_group_size,
    min_prefix_blocks,
    min_grouped_requests,
    max_groups,
    prefix_target_items,
    suffix_target_items,
    granularity,
    GROUPED: tl.constexpr,
    MEMBERS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    LEAVE_UNGROUPED: tl.constexpr,
):
    requests = tl.arange(0, BLOCK_R)
    # The early combine's per-(request, kv head) counts start every decode call of this plan at zero.
    for ready_start in range(0, ready_count, BLOCK_R):
        tl.store(ready_ptr + ready_start + requests, 0, mask=ready_start + requests < ready_count)
    in_batch = requests < num_requests
    seq_lens = tl.load(seq_lens_ptr + requests, mask=in_batch, other=0)
    if GROUPED:
        # Written by other programs of this launch through L2 (atomics): read around L1.
        leader = tl.load(leader_of_ptr + requests, mask=in_batch, other=0, cache_modifier=".cg")
        rank = tl.load(rank_of_ptr + requests, mask=in_batch, other=-1, cache_modifier=".cg")
        candidate = in_batch & (rank >= 0)
        common = tl.load(group_min_ptr + leader, mask=candidate, other=0, cache_modifier=".cg")
        size = tl.load(group_count_ptr + leader, mask=candidate, other=0, cache_modifier=".cg")
        grouped = candidate & (size >= min_group_size) & (common >= min_prefix_blocks)
        is_leader = grouped & (leader == requests)
        num_groups = tl.sum(is_leader.to(tl.int32), 0)
        num_grouped = tl.sum(grouped.to(tl.int32), 0)
        keep = (num_grouped >= min_grouped_requests) & ((max_groups < 0) | (num_groups <= max_groups))
        # A select, not ``& keep``: Triton 3.9's interpreter gives a block-and-scalar ``&`` a non-bool mask dtype.
        grouped = tl.where(keep, grouped, False)
        is_leader = tl.where(keep, is_leader, False)
        leader = tl.where(grouped, leader, requests)
        prefix = tl.where(grouped, common, 0)
        # Tiles and member lists are laid out in the order of the leaders' request indices.
        group_tiles = tl.where(is_leader, (size + MEMBERS - 1) // MEMBERS, 0)
        group_members = tl.where(is_leader, size, 0)
        tl.store(first_tile_ptr + requests, tl.cumsum(group_tiles, 0) - group_tiles, mask=in_batch)
        tl.store(first_member_ptr + requests, tl.cumsum(group_members, 0) - group_members, mask=in_batch)
        tl.debug_barrier()
        first_tile = tl.load(first_tile_ptr + leader, mask=grouped, other=0)
        first_member = tl.load(first_member_ptr + leader, mask=grouped, other=0)
        tile = tl.where(grouped, first_tile + rank // MEMBERS, -1)
        slot = tl.where(grouped, rank % MEMBERS, 0)
        tl.store(member_list_ptr + first_member + rank, requests, mask=grouped)
        opens_tile = grouped & (slot == 0)
        tl.store(tile_leader_ptr + tile, leader, mask=opens_tile)
        tl.store(tile_prefix_blocks_ptr + tile, prefix, mask=opens_tile)
        tl.store(tile_member_start_ptr + tile, first_member + rank, mask=opens_tile)
        tl.store(tile_member_count_ptr + tile, tl.minimum(size - rank, MEMBERS), mask=opens_tile)
        num_tiles = tl.sum(group_tiles, 0)
        tl.debug_barrier()
        tile_prefix = tl.load(tile_prefix_blocks_ptr + requests, mask=requests < num_tiles, other=0)
        saved = tl.sum(prefix, 0) - tl.sum(tl.where(is_leader, prefix, 0), 0)
        num_groups = tl.sum(is_leader.to(tl.int32), 0)
        num_grouped = tl.sum(grouped.to(tl.int32), 0)
    else:
        grouped = tl.zeros([BLOCK_R], dtype=tl.int1)
        leader = requests
        prefix = tl.zeros([BLOCK_R], dtype=tl.int32)
        tile = tl.full([BLOCK_R], -1, dtype=tl.int32)
        slot = tl.zeros([BLOCK_R], dtype=tl.int32)
        tile_prefix = tl.zeros([BLOCK_R], dtype=tl.int32)
        saved = tl.zeros([], dtype=tl.int32)
        num_groups = tl.zeros([], dtype=tl.int32)
        num_grouped = tl.zeros([], dtype=tl.int32)

    tl.store(prefix_blocks_ptr + requests, prefix, mask=in_batch)
    tl.store(group_leader_ptr + requests, leader, mask=in_batch)
    tl.store(tile_of_ptr + requests, tile, mask=in_batch)
    tl.store(slot_in_tile_ptr + requests, slot, mask=in_batch)

    # Work items: owners 0..N-1 are tiles (prefix splits), owners N..2N-1 are requests (suffix splits).
    prefix_tokens = tile_prefix * block_size
    suffix_tokens = tl.where(in_batch, tl.maximum(seq_lens - prefix * block_size, 0), 0)
    if LEAVE_UNGROUPED:
        # The caller attends the ungrouped requests itself over these lengths (0 for a grouped request); they get
        # no work items here, so the decode writes only the grouped requests' rows.
        tl.store(standard_lens_ptr + requests, tl.where(grouped, 0, seq_lens), mask=in_batch)
        suffix_tokens = tl.where(grouped, suffix_tokens, 0)
    prefix_split = _split_tokens(tl.sum(prefix_tokens, 0), prefix_target_items, granularity)
    suffix_split = _split_tokens(tl.sum(suffix_tokens, 0), suffix_target_items, granularity)
    prefix_items = _item_count(prefix_tokens, prefix_split)
    suffix_items = _item_count(suffix_tokens, suffix_split)
    prefix_total = tl.sum(prefix_items, 0)
    tl.store(work_start_ptr + 1 + requests, tl.cumsum(prefix_items, 0), mask=in_batch)
    tl.store(work_start_ptr + 1 + num_requests + requests, prefix_total + tl.cumsum(suffix_items, 0), mask=in_batch)
    tl.store(work_start_ptr, 0)
    tl.store(split_tokens_ptr, prefix_split)
    tl.store(split_tokens_ptr + 1, suffix_split)
    tl.store(stats_ptr, num_groups)
    tl.store(stats_ptr + 1, num_grouped)
    tl.store(stats_ptr + 2, saved)


@triton.jit(
    do_not_specialize=[
        "ready_count",
        "max_blocks",
        "num_cache_blocks",
        "num_requests",
        "min_grouped_requests",
        "max_groups",
        "prefix_target_items",
        "suffix_target_items",
    ]
)
def plan_group_kernel(
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    counts_ptr,
    leader_slot_ptr,
    ticket_ptr,
    cut_key_ptr,
    leader_of_ptr,
    rank_of_ptr,
    group_min_ptr,
    group_count_ptr,
    first_tile_ptr,
    first_member_ptr,
    prefix_blocks_ptr,
    group_leader_ptr,
    tile_of_ptr,
    slot_in_tile_ptr,
    tile_leader_ptr,
    tile_prefix_blocks_ptr,
    tile_member_start_ptr,
    tile_member_count_ptr,
    member_list_ptr,
    work_start_ptr,
    split_tokens_ptr,
    stats_ptr,
    ready_ptr,
    standard_lens_ptr,
    ready_count,
    stride_table_row,
    max_blocks,
    num_cache_blocks,
    block_size,
    num_requests,
    min_group_size,
    min_prefix_blocks,
    min_grouped_requests,
    max_groups,
    prefix_target_items,
    suffix_target_items,
    granularity,
    MEMBERS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    LEAVE_UNGROUPED: tl.constexpr,
    PDL: tl.constexpr,
):
    _follow_previous_launch(PDL)
    request = tl.program_id(0)
    key = tl.load(cut_key_ptr + request)
    candidate = key >= 0
    leader = num_requests - tl.load(leader_slot_ptr + key, mask=candidate, other=num_requests - request)
    eligible = _eligible_blocks(seq_lens_ptr, query_start_ptr, request, block_size, max_blocks)
    limit = tl.minimum(eligible, _eligible_blocks(seq_lens_ptr, query_start_ptr, leader, block_size, max_blocks))
    row = block_table_ptr + request.to(tl.int64) * stride_table_row
    leader_row = block_table_ptr + leader.to(tl.int64) * stride_table_row
    common = limit
    for start in range(0, eligible, BLOCK_E):
        depth = start + tl.arange(0, BLOCK_E)
        valid = depth < eligible
        ids = tl.load(row + depth, mask=valid, other=-1)
        known = valid & (ids >= 0) & (ids < num_cache_blocks)
        compared = depth < limit
        leader_ids = tl.load(leader_row + depth, mask=compared, other=-1)
        common = tl.minimum(common, tl.min(tl.where(compared & ~(known & (ids == leader_ids)), depth, limit), 0))
        # The cut pass (the only reader of the histogram) has finished: clear this row's entries for the next step.
        tl.store(counts_ptr + ids, 0, mask=known)
    # Scalar atomics run on one thread in program order, so the acq_rel ticket below publishes all four.
    tl.atomic_min(group_min_ptr + leader, common, mask=candidate, sem="relaxed")
    rank = tl.atomic_add(group_count_ptr + leader, 1, mask=candidate, sem="relaxed")
    tl.atomic_xchg(leader_of_ptr + request, leader, sem="relaxed")
    tl.atomic_xchg(rank_of_ptr + request, tl.where(candidate, rank, -1), sem="relaxed")
    arrived = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if arrived == num_requests - 1:
        # Every program has read its leader slot before taking its ticket: clear the claimed slots (issued first so
        # the key loads overlap the finishing step's), the ticket last.
        requests = tl.arange(0, BLOCK_R)
        keys = tl.load(cut_key_ptr + requests, mask=requests < num_requests, other=-1)
        tl.store(leader_slot_ptr + keys, 0, mask=keys >= 0)
        _finish_plan(
            seq_lens_ptr,
            leader_of_ptr,
            rank_of_ptr,
            group_min_ptr,
            group_count_ptr,
            first_tile_ptr,
            first_member_ptr,
            prefix_blocks_ptr,
            group_leader_ptr,
            tile_of_ptr,
            slot_in_tile_ptr,
            tile_leader_ptr,
            tile_prefix_blocks_ptr,
            tile_member_start_ptr,
            tile_member_count_ptr,
            member_list_ptr,
            work_start_ptr,
            split_tokens_ptr,
            stats_ptr,
            ready_ptr,
            standard_lens_ptr,
            ready_count,
            num_requests,
            block_size,
            min_group_size,
            min_prefix_blocks,
            min_grouped_requests,
            max_groups,
            prefix_target_items,
            suffix_target_items,
            granularity,
            True,
            MEMBERS,
            BLOCK_R,
            LEAVE_UNGROUPED,
        )
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed")


@triton.jit(do_not_specialize=["ready_count", "num_requests", "suffix_target_items"])
def plan_paged_kernel(
    seq_lens_ptr,
    prefix_blocks_ptr,
    group_leader_ptr,
    tile_of_ptr,
    slot_in_tile_ptr,
    work_start_ptr,
    split_tokens_ptr,
    stats_ptr,
    ready_ptr,
    standard_lens_ptr,
    ready_count,
    num_requests,
    block_size,
    suffix_target_items,
    granularity,
    BLOCK_R: tl.constexpr,
    LEAVE_UNGROUPED: tl.constexpr,
    PDL: tl.constexpr,
):
    _follow_previous_launch(PDL)
    _finish_plan(
        seq_lens_ptr,
        seq_lens_ptr,
        seq_lens_ptr,
        seq_lens_ptr,
        seq_lens_ptr,
        seq_lens_ptr,
        seq_lens_ptr,
        prefix_blocks_ptr,
        group_leader_ptr,
        tile_of_ptr,
        slot_in_tile_ptr,
        tile_of_ptr,
        tile_of_ptr,
        tile_of_ptr,
        tile_of_ptr,
        tile_of_ptr,
        work_start_ptr,
        split_tokens_ptr,
        stats_ptr,
        ready_ptr,
        standard_lens_ptr,
        ready_count,
        num_requests,
        block_size,
        2,
        1,
        0,
        -1,
        1,
        suffix_target_items,
        granularity,
        False,
        1,
        BLOCK_R,
        LEAVE_UNGROUPED,
    )


# ---------------------------------------------------------------------------------------------------- decode


@triton.jit
def _attend_block(
    q,
    k_ptr,
    v_ptr,
    block_row_ptr,
    token_start,
    token_end,
    kv_head,
    query_position,
    m_i,
    l_i,
    acc,
    scale_log2,
    stride_k_block,
    stride_k_token,
    stride_k_head,
    stride_k_dim,
    stride_v_block,
    stride_v_token,
    stride_v_head,
    stride_v_dim,
    head_dim,
    PAGE: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    dims = tl.arange(0, HEAD_DIM)
    dim_ok = dims < head_dim
    # Block ids are loaded one step ahead: a K/V address that depends on a load of the same step stops Triton's
    # pipeliner from prefetching K/V (one tile in flight per program instead of num_stages - 1; seen in the sm_90
    # shared-memory size), so the ids arrive through the loop instead. The pipelined loop still issues each K/V copy
    # one step after the id load it depends on (sm_90 TTGIR), so a step takes at least one block-table round trip:
    # a program streams about BLOCK_N tokens per round trip. Ids carried two or three steps through the loop stop
    # the pipeliner again (one buffer per operand in the sm_90 build).
    next_tokens = token_start + tl.arange(0, BLOCK_N)
    next_pages = tl.load(block_row_ptr + next_tokens // PAGE, mask=next_tokens < token_end, other=0)
    for token_base in range(token_start, token_end, BLOCK_N):
        tokens = token_base + tl.arange(0, BLOCK_N)
        token_ok = tokens < token_end
        pages = next_pages.to(tl.int64)
        next_tokens = tokens + BLOCK_N
        next_pages = tl.load(block_row_ptr + next_tokens // PAGE, mask=next_tokens < token_end, other=0)
        within = (tokens % PAGE).to(tl.int64)
        k_rows = pages * stride_k_block + within * stride_k_token + kv_head * stride_k_head
        v_rows = pages * stride_v_block + within * stride_v_token + kv_head * stride_v_head
        load_mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + k_rows[:, None] + dims[None, :].to(tl.int64) * stride_k_dim, mask=load_mask, other=0.0)
        v = tl.load(v_ptr + v_rows[:, None] + dims[None, :].to(tl.int64) * stride_v_dim, mask=load_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = token_ok[None, :]
        if CAUSAL:
            visible = visible & (tokens[None, :] <= query_position[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # Rows that have seen no visible key yet keep m = -inf; shift them by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _finish_rows(m_i, l_i, acc):
    has_keys = l_i > 0.0
    safe_l = tl.where(has_keys, l_i, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(safe_l)) * LN_2, float("-inf"))
    return out, lse


@triton.jit
def _prefix_item(
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    query_start_ptr,
    tile_leader_ptr,
    tile_prefix_blocks_ptr,
    tile_member_start_ptr,
    tile_member_count_ptr,
    member_list_ptr,
    split_tokens_ptr,
    part_out_ptr,
    part_lse_ptr,
    ready_ptr,
    tile,
    item,
    item_count,
    work,
    kv_head,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_k_block,
    stride_k_token,
    stride_k_head,
    stride_k_dim,
    stride_v_block,
    stride_v_token,
    stride_v_head,
    stride_v_dim,
    stride_table_row,
    head_dim,
    num_kv_heads,
    G: tl.constexpr,
    QMAX: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EARLY: tl.constexpr,
):
    split_tokens = tl.load(split_tokens_ptr)
    leader = tl.load(tile_leader_ptr + tile).to(tl.int64)
    prefix_tokens = tl.load(tile_prefix_blocks_ptr + tile) * PAGE
    token_start = item * split_tokens
    token_end = tl.where(item == item_count - 1, prefix_tokens, token_start + split_tokens)
    member_start = tl.load(tile_member_start_ptr + tile)
    member_count = tl.load(tile_member_count_ptr + tile)

    rows = tl.arange(0, BLOCK_M)
    member_slot = rows // (QMAX * G)
    query_offset = (rows // G) % QMAX
    head = kv_head * G + rows % G
    member_ok = member_slot < member_count
    member = tl.load(member_list_ptr + member_start + member_slot, mask=member_ok, other=0).to(tl.int64)
    query_begin = tl.load(query_start_ptr + member, mask=member_ok, other=0)
    query_end = tl.load(query_start_ptr + member + 1, mask=member_ok, other=0)
    row_ok = member_ok & (query_offset < query_end - query_begin)
    token = (query_begin + query_offset).to(tl.int64)

    dims = tl.arange(0, HEAD_DIM)
    dim_ok = dims < head_dim
    q_offsets = token[:, None] * stride_q_token + head[:, None].to(tl.int64) * stride_q_head
    q = tl.load(
        q_ptr + q_offsets + dims[None, :].to(tl.int64) * stride_q_dim, mask=row_ok[:, None] & dim_ok[None, :], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i, l_i, acc = _attend_block(
        q,
        k_ptr,
        v_ptr,
        block_table_ptr + leader * stride_table_row,
        token_start,
        token_end,
        kv_head,
        token,
        m_i,
        l_i,
        acc,
        scale_log2,
        stride_k_block,
        stride_k_token,
        stride_k_head,
        stride_k_dim,
        stride_v_block,
        stride_v_token,
        stride_v_head,
        stride_v_dim,
        head_dim,
        PAGE,
        False,
        BLOCK_N,
        HEAD_DIM,
        UPCAST,
        DOT_PRECISION,
    )
    out, lse = _finish_rows(m_i, l_i, acc)
    row_index = ((work + tl.zeros([], dtype=tl.int64)) * num_kv_heads + kv_head) * BLOCK_M + rows
    tl.store(part_out_ptr + row_index[:, None] * head_dim + dims[None, :], out, mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(part_lse_ptr + row_index, lse, mask=row_ok)
    if EARLY:
        # Every thread's partial rows are stored before any count is released, then each member of the tile counts
        # this item done (its first row's lane).
        tl.debug_barrier()
        counts_member = member_ok & (rows % (QMAX * G) == 0)
        tl.atomic_add(ready_ptr + member * num_kv_heads + kv_head, 1, mask=counts_member, sem="release")


@triton.jit
def _suffix_item(
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    prefix_blocks_ptr,
    tile_of_ptr,
    split_tokens_ptr,
    out_ptr,
    lse_ptr,
    part_out_ptr,
    part_lse_ptr,
    ready_ptr,
    request,
    item,
    item_count,
    suffix_work,
    kv_head,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_k_block,
    stride_k_token,
    stride_k_head,
    stride_k_dim,
    stride_v_block,
    stride_v_token,
    stride_v_head,
    stride_v_dim,
    stride_table_row,
    stride_out_token,
    stride_out_head,
    stride_out_dim,
    stride_lse_token,
    stride_lse_head,
    head_dim,
    num_kv_heads,
    HAS_PREFIX: tl.constexpr,
    G: tl.constexpr,
    QMAX: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EARLY: tl.constexpr,
):
    split_tokens = tl.load(split_tokens_ptr + 1)
    seq_len = tl.load(seq_lens_ptr + request)
    query_begin = tl.load(query_start_ptr + request)
    query_len = tl.load(query_start_ptr + request + 1) - query_begin
    token_start = tl.load(prefix_blocks_ptr + request) * PAGE + item * split_tokens
    token_end = tl.where(item == item_count - 1, seq_len, token_start + split_tokens)

    rows = tl.arange(0, BLOCK_M)
    query_offset = rows // G
    head = kv_head * G + rows % G
    row_ok = (query_offset < query_len) & (rows < QMAX * G)
    token = (query_begin + query_offset).to(tl.int64)
    query_position = seq_len - query_len + query_offset

    dims = tl.arange(0, HEAD_DIM)
    dim_ok = dims < head_dim
    q_offsets = token[:, None] * stride_q_token + head[:, None].to(tl.int64) * stride_q_head
    q = tl.load(
        q_ptr + q_offsets + dims[None, :].to(tl.int64) * stride_q_dim, mask=row_ok[:, None] & dim_ok[None, :], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i, l_i, acc = _attend_block(
        q,
        k_ptr,
        v_ptr,
        block_table_ptr + request * stride_table_row,
        token_start,
        token_end,
        kv_head,
        query_position,
        m_i,
        l_i,
        acc,
        scale_log2,
        stride_k_block,
        stride_k_token,
        stride_k_head,
        stride_k_dim,
        stride_v_block,
        stride_v_token,
        stride_v_head,
        stride_v_dim,
        head_dim,
        PAGE,
        True,
        BLOCK_N,
        HEAD_DIM,
        UPCAST,
        DOT_PRECISION,
    )
    out, lse = _finish_rows(m_i, l_i, acc)
    direct = item_count == 1
    if HAS_PREFIX:
        direct = direct & (tl.load(tile_of_ptr + request) < 0)
    if direct:
        # The request's whole context was this one item: this is the final result (the combine skips it).
        out_offsets = token[:, None] * stride_out_token + head[:, None].to(tl.int64) * stride_out_head
        tl.store(
            out_ptr + out_offsets + dims[None, :].to(tl.int64) * stride_out_dim,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
        tl.store(lse_ptr + token * stride_lse_token + head.to(tl.int64) * stride_lse_head, lse, mask=row_ok)
    else:
        row_index = ((suffix_work + tl.zeros([], dtype=tl.int64)) * num_kv_heads + kv_head) * ROWS + rows
        tl.store(
            part_out_ptr + row_index[:, None] * head_dim + dims[None, :], out, mask=row_ok[:, None] & dim_ok[None, :]
        )
        tl.store(part_lse_ptr + row_index, lse, mask=row_ok)
        if EARLY:
            tl.debug_barrier()
            tl.atomic_add(ready_ptr + request * num_kv_heads + kv_head, 1, sem="release")


@triton.jit
def _run_item(
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    prefix_blocks_ptr,
    tile_of_ptr,
    tile_leader_ptr,
    tile_prefix_blocks_ptr,
    tile_member_start_ptr,
    tile_member_count_ptr,
    member_list_ptr,
    work_start_ptr,
    split_tokens_ptr,
    out_ptr,
    lse_ptr,
    prefix_part_out_ptr,
    prefix_part_lse_ptr,
    suffix_part_out_ptr,
    suffix_part_lse_ptr,
    ready_ptr,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_k_block,
    stride_k_token,
    stride_k_head,
    stride_k_dim,
    stride_v_block,
    stride_v_token,
    stride_v_head,
    stride_v_dim,
    stride_table_row,
    stride_out_token,
    stride_out_head,
    stride_out_dim,
    stride_lse_token,
    stride_lse_head,
    num_requests,
    head_dim,
    num_kv_heads,
    HAS_PREFIX: tl.constexpr,
    G: tl.constexpr,
    QMAX: tl.constexpr,
    PAGE: tl.constexpr,
    PREFIX_BLOCK_M: tl.constexpr,
    SUFFIX_BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    PREFIX_BLOCK_N: tl.constexpr,
    SUFFIX_BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PASS: tl.constexpr,
    EARLY: tl.constexpr,
    ends,
    prefix_total,
    work,
    kv_head,
):
    # One work item of the attention kernel: its owner (the number of owners whose items all end at or before it),
    # its place among the owner's items, then the prefix or suffix item itself.
    owner = tl.sum((ends <= work).to(tl.int32), 0)
    first = tl.load(work_start_ptr + owner)
    item = work - first
    item_count = tl.load(work_start_ptr + owner + 1) - first
    # The item's kind is a constexpr wherever the launch holds one kind (PASS 1: prefix items; PASS 2, or a plan
    # without groups: suffix items), so a split launch compiles only its own item kind (its own tiles and shared
    # memory); one launch of a plan with groups decides per program.
    if PASS == 1:
        is_prefix = True
    elif HAS_PREFIX and PASS == 0:
        is_prefix = owner < num_requests
    else:
        is_prefix = False
    if is_prefix:
        _prefix_item(
            q_ptr,
            k_ptr,
            v_ptr,
            block_table_ptr,
            query_start_ptr,
            tile_leader_ptr,
            tile_prefix_blocks_ptr,
            tile_member_start_ptr,
            tile_member_count_ptr,
            member_list_ptr,
            split_tokens_ptr,
            prefix_part_out_ptr,
            prefix_part_lse_ptr,
            ready_ptr,
            owner,
            item,
            item_count,
            work,
            kv_head,
            scale_log2,
            stride_q_token,
            stride_q_head,
            stride_q_dim,
            stride_k_block,
            stride_k_token,
            stride_k_head,
            stride_k_dim,
            stride_v_block,
            stride_v_token,
            stride_v_head,
            stride_v_dim,
            stride_table_row,
            head_dim,
            num_kv_heads,
            G,
            QMAX,
            PAGE,
            PREFIX_BLOCK_M,
            PREFIX_BLOCK_N,
            HEAD_DIM,
            UPCAST,
            DOT_PRECISION,
            EARLY,
        )
    else:
        _suffix_item(
            q_ptr,
            k_ptr,
            v_ptr,
            block_table_ptr,
            query_start_ptr,
            seq_lens_ptr,
            prefix_blocks_ptr,
            tile_of_ptr,
            split_tokens_ptr,
            out_ptr,
            lse_ptr,
            suffix_part_out_ptr,
            suffix_part_lse_ptr,
            ready_ptr,
            (owner - num_requests).to(tl.int64),
            item,
            item_count,
            work - prefix_total,
            kv_head,
            scale_log2,
            stride_q_token,
            stride_q_head,
            stride_q_dim,
            stride_k_block,
            stride_k_token,
            stride_k_head,
            stride_k_dim,
            stride_v_block,
            stride_v_token,
            stride_v_head,
            stride_v_dim,
            stride_table_row,
            stride_out_token,
            stride_out_head,
            stride_out_dim,
            stride_lse_token,
            stride_lse_head,
            head_dim,
            num_kv_heads,
            HAS_PREFIX,
            G,
            QMAX,
            PAGE,
            SUFFIX_BLOCK_M,
            ROWS,
            SUFFIX_BLOCK_N,
            HEAD_DIM,
            UPCAST,
            DOT_PRECISION,
            EARLY,
        )


@triton.jit(do_not_specialize=["num_requests"])
def forest_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    prefix_blocks_ptr,
    tile_of_ptr,
    tile_leader_ptr,
    tile_prefix_blocks_ptr,
    tile_member_start_ptr,
    tile_member_count_ptr,
    member_list_ptr,
    work_start_ptr,
    split_tokens_ptr,
    out_ptr,
    lse_ptr,
    prefix_part_out_ptr,
    prefix_part_lse_ptr,
    suffix_part_out_ptr,
    suffix_part_lse_ptr,
    ready_ptr,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_k_block,
    stride_k_token,
    stride_k_head,
    stride_k_dim,
    stride_v_block,
    stride_v_token,
    stride_v_head,
    stride_v_dim,
    stride_table_row,
    stride_out_token,
    stride_out_head,
    stride_out_dim,
    stride_lse_token,
    stride_lse_head,
    num_requests,
    head_dim,
    num_kv_heads,
    HAS_PREFIX: tl.constexpr,
    OWNERS_BLOCK: tl.constexpr,
    G: tl.constexpr,
    QMAX: tl.constexpr,
    PAGE: tl.constexpr,
    PREFIX_BLOCK_M: tl.constexpr,
    SUFFIX_BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    PREFIX_BLOCK_N: tl.constexpr,
    SUFFIX_BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PASS: tl.constexpr,
    EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    _follow_previous_launch(PDL)
    # The kv heads of one item are adjacent programs: they read neighbouring bytes of the same cache blocks.
    pid = tl.program_id(0)
    work = pid // num_kv_heads
    kv_head = pid % num_kv_heads
    # The owner is the number of owners whose items all end at or before this one: one vector load issued with the
    # totals (no dependent search chain); padding lanes load past every item.
    owners = tl.arange(0, OWNERS_BLOCK)
    ends = tl.load(work_start_ptr + 1 + owners, mask=owners < 2 * num_requests, other=2147483647)
    total_work = tl.load(work_start_ptr + 2 * num_requests)
    prefix_total = tl.load(work_start_ptr + num_requests)
    if PASS == 2:
        # Suffix pass of a split launch: this launch's programs start after the prefix items.
        work += prefix_total
    limit = total_work
    if PASS == 1:
        limit = prefix_total
    if work < limit:
        _run_item(
            q_ptr,
            k_ptr,
            v_ptr,
            block_table_ptr,
            query_start_ptr,
            seq_lens_ptr,
            prefix_blocks_ptr,
            tile_of_ptr,
            tile_leader_ptr,
            tile_prefix_blocks_ptr,
            tile_member_start_ptr,
            tile_member_count_ptr,
            member_list_ptr,
            work_start_ptr,
            split_tokens_ptr,
            out_ptr,
            lse_ptr,
            prefix_part_out_ptr,
            prefix_part_lse_ptr,
            suffix_part_out_ptr,
            suffix_part_lse_ptr,
            ready_ptr,
            scale_log2,
            stride_q_token,
            stride_q_head,
            stride_q_dim,
            stride_k_block,
            stride_k_token,
            stride_k_head,
            stride_k_dim,
            stride_v_block,
            stride_v_token,
            stride_v_head,
            stride_v_dim,
            stride_table_row,
            stride_out_token,
            stride_out_head,
            stride_out_dim,
            stride_lse_token,
            stride_lse_head,
            num_requests,
            head_dim,
            num_kv_heads,
            HAS_PREFIX,
            G,
            QMAX,
            PAGE,
            PREFIX_BLOCK_M,
            SUFFIX_BLOCK_M,
            ROWS,
            PREFIX_BLOCK_N,
            SUFFIX_BLOCK_N,
            HEAD_DIM,
            UPCAST,
            DOT_PRECISION,
            PASS,
            EARLY,
            ends,
            prefix_total,
            work,
            kv_head,
        )
    _end_after_previous_launch(PDL)


@triton.jit(do_not_specialize=["suffix_part_offset", "num_requests"])
def forest_combine_kernel(
    out_ptr,
    lse_ptr,
    query_start_ptr,
    tile_of_ptr,
    slot_in_tile_ptr,
    work_start_ptr,
    part_out_ptr,
    part_lse_ptr,
    ready_ptr,
    suffix_part_offset,
    stride_out_token,
    stride_out_head,
    stride_out_dim,
    stride_lse_token,
    stride_lse_head,
    num_requests,
    head_dim,
    num_kv_heads,
    dim_chunks,
    HAS_PREFIX: tl.constexpr,
    G: tl.constexpr,
    QMAX: tl.constexpr,
    PREFIX_BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
    EARLY: tl.constexpr,
    LOAD_CACHE: tl.constexpr,
    PDL: tl.constexpr,
):
    # With EARLY (PDL 3) nothing waits here: each program waits for its own request's items below, and for the
    # attention launch as a whole only at its end, so that this launch ending still implies that one ended.
    _follow_previous_launch(PDL)
    # One program per (request, kv head, slice of DIM_BLOCK head dims): narrower slices give more programs, each
    # loading all its partials in fewer rounds.
    pid = tl.program_id(0)
    dim_chunk = pid % dim_chunks
    request = pid // (num_kv_heads * dim_chunks)
    kv_head = (pid // dim_chunks) % num_kv_heads
    # Everything this program needs that depends only on the request is loaded in one round. An early combine reads
    # around L1 (LOAD_CACHE ".cg"): it runs beside the attention launch, which writes the partials it merges.
    suffix_first = tl.load(work_start_ptr + num_requests + request, cache_modifier=LOAD_CACHE)
    suffix_count = tl.load(work_start_ptr + num_requests + request + 1, cache_modifier=LOAD_CACHE) - suffix_first
    suffix_base = suffix_first - tl.load(work_start_ptr + num_requests, cache_modifier=LOAD_CACHE)
    query_begin = tl.load(query_start_ptr + request, cache_modifier=LOAD_CACHE)
    query_len = tl.load(query_start_ptr + request + 1, cache_modifier=LOAD_CACHE) - query_begin
    tile = tl.full([], -1, dtype=tl.int32)
    slot = tl.zeros([], dtype=tl.int32)
    if HAS_PREFIX:
        tile = tl.load(tile_of_ptr + request, cache_modifier=LOAD_CACHE)
        slot = tl.load(slot_in_tile_ptr + request, cache_modifier=LOAD_CACHE)
    # A request whose context was one suffix item was written by the attention kernel itself; one with no items at
    # all is padding or was left to the caller (``ForestPlan.leaves_ungrouped``): its rows are not written.
    needed = (tile >= 0) | (suffix_count > 1)
    if needed:
        prefix_first = tl.zeros([], dtype=tl.int32)
        prefix_count = tl.zeros([], dtype=tl.int32)
        if tile >= 0:
            prefix_first = tl.load(work_start_ptr + tile, cache_modifier=LOAD_CACHE)
            prefix_count = tl.load(work_start_ptr + tile + 1, cache_modifier=LOAD_CACHE) - prefix_first
        ready_at = ready_ptr + request * num_kv_heads + kv_head
        if EARLY and PDL != 0:
            # Every item of this request (its tile's prefix items and its own suffix items) adds one once its
            # partial is stored; the acquire makes those partials visible here. Without dependent launches (the
            # interpreter, plain launches) this launch starts after the attention launch ended: nothing to wait for.
            done = tl.atomic_add(ready_at, 0, sem="acquire")
            while done < prefix_count + suffix_count:
                _back_off()
                done = tl.atomic_add(ready_at, 0, sem="acquire")
        rows = tl.arange(0, ROWS)
        query_offset = rows // G
        head = kv_head * G + rows % G
        row_ok = (query_offset < query_len) & (rows < QMAX * G)
        dims = dim_chunk * DIM_BLOCK + tl.arange(0, DIM_BLOCK)
        dim_ok = dims < head_dim

        run_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        run_sum = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, DIM_BLOCK], dtype=tl.float32)
        # Every partial of a chunk is loaded at once, so a long list of splits costs few round trips.
        for chunk_start in range(0, prefix_count + suffix_count, CHUNK):
            index = chunk_start + tl.arange(0, CHUNK)
            item_ok = index < prefix_count + suffix_count
            from_prefix = index < prefix_count
            prefix_row = ((prefix_first + index).to(tl.int64) * num_kv_heads + kv_head) * PREFIX_BLOCK_M + slot * (
                QMAX * G
            )
            suffix_row = (
                suffix_part_offset + ((suffix_base + index - prefix_count).to(tl.int64) * num_kv_heads + kv_head) * ROWS
            )
            base = tl.where(from_prefix, prefix_row, suffix_row)
            row_index = base[:, None] + rows[None, :]
            mask = item_ok[:, None] & row_ok[None, :]
            part_lse = tl.load(part_lse_ptr + row_index, mask=mask, other=float("-inf"), cache_modifier=LOAD_CACHE)
            part = tl.load(
                part_out_ptr + row_index[:, :, None] * head_dim + dims[None, None, :],
                mask=mask[:, :, None] & dim_ok[None, None, :],
                other=0.0,
                cache_modifier=LOAD_CACHE,
            )
            new_max = tl.maximum(run_max, tl.max(part_lse, 0))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            old_scale = tl.exp(run_max - shift)
            part_scale = tl.exp(part_lse - shift[None, :])
            run_sum = run_sum * old_scale + tl.sum(part_scale, 0)
            # A partial with lse = -inf saw no key; its (unwritten) output must not reach the sum, even as 0 * NaN.
            weighted = tl.where(part_scale[:, :, None] > 0.0, part * part_scale[:, :, None], 0.0)
            acc = acc * old_scale[:, None] + tl.sum(weighted, 0)
            run_max = new_max

        has_keys = run_sum > 0.0
        safe_sum = tl.where(has_keys, run_sum, 1.0)
        out = acc / safe_sum[:, None]
        lse = tl.where(has_keys, run_max + tl.log(safe_sum), float("-inf"))
        token = (query_begin + query_offset).to(tl.int64)
        out_offsets = token[:, None] * stride_out_token + head[:, None].to(tl.int64) * stride_out_head
        tl.store(
            out_ptr + out_offsets + dims[None, :].to(tl.int64) * stride_out_dim,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
        lse_offsets = token * stride_lse_token + head.to(tl.int64) * stride_lse_head
        # The first slice of head dims writes the lse (a select: see the note on ``keep`` in ``_finish_plan``).
        tl.store(lse_ptr + lse_offsets, lse, mask=tl.where(dim_chunk == 0, row_ok, False))
        if EARLY:
            # The request's last combine program to arrive (one per slice of head dims) clears its count for the
            # next decode call; every other slice has already read it complete.
            arrived = tl.atomic_add(ready_at, 1, sem="relaxed")
            if arrived == prefix_count + suffix_count + dim_chunks - 1:
                tl.atomic_xchg(ready_at, 0, sem="relaxed")
    _end_after_previous_launch(PDL)
