# mypy: disable-error-code="no-untyped-def"
"""Triton kernels for forest cascade decode (``@triton.jit`` code only).

Three kernels share one partial-result format: for every query row a normalized partial output ``o`` (fp32) and
its log-sum-exp in natural log (``-inf`` when the row saw no key).

- ``prefix_attention_kernel``: one program per (prefix work item, kv head). A work item is one split of one group
  tile's shared prefix; the tile packs the GQA query heads of up to ``MEMBERS`` requests as the rows of one matrix,
  so the prefix is read once for all of them and the products run on tensor cores.
- ``suffix_attention_kernel``: one program per (suffix work item, kv head). A work item is one split of one
  request's own tokens (from its group's prefix end, or from 0, to its sequence length), causal within the new
  query tokens. With no prefix this is the per-request paged decode kernel.
- ``combine_kernel``: one program per (request, kv head); merges the request's prefix and suffix partials by
  log-sum-exp and writes the output and the LSE.

Row ``r`` of a request's row block stands for query token ``r // G`` and query head ``kv_head * G + r % G``.
"""

import triton
import triton.language as tl

LN_2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _find_owner(starts_ptr, work, NUM_OWNERS: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    # Largest owner index o in [0, NUM_OWNERS) with starts[o] <= work; owners with no work share their start with
    # the next owner, so the largest such index is the one that owns the item.
    low = 0
    high = NUM_OWNERS
    for _ in tl.static_range(SEARCH_STEPS):
        middle = (low + high) // 2
        start = tl.load(starts_ptr + middle)
        take = start <= work
        low = tl.where(take, middle, low)
        high = tl.where(take, high, middle)
    return low


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
    for token_base in range(token_start, token_end, BLOCK_N):
        tokens = token_base + tl.arange(0, BLOCK_N)
        token_ok = tokens < token_end
        pages = tl.load(block_row_ptr + tokens // PAGE, mask=token_ok, other=0).to(tl.int64)
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
def _finish_partial(m_i, l_i, acc):
    has_keys = l_i > 0.0
    safe_l = tl.where(has_keys, l_i, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(safe_l)) * LN_2, float("-inf"))
    return out, lse


@triton.jit
def prefix_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    query_start_ptr,
    tile_leader_ptr,
    tile_members_ptr,
    tile_prefix_blocks_ptr,
    work_start_ptr,
    split_tokens_ptr,
    part_out_ptr,
    part_lse_ptr,
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
    NUM_TILES: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    MEMBERS: tl.constexpr,
    G: tl.constexpr,
    QMAX: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    total_work = tl.load(work_start_ptr + NUM_TILES)
    if work < total_work:
        tile = _find_owner(work_start_ptr, work, NUM_TILES, SEARCH_STEPS)
        split = work - tl.load(work_start_ptr + tile)
        split_tokens = tl.load(split_tokens_ptr)
        leader = tl.load(tile_leader_ptr + tile).to(tl.int64)
        prefix_tokens = tl.load(tile_prefix_blocks_ptr + tile) * PAGE
        token_start = split * split_tokens
        token_end = tl.minimum(token_start + split_tokens, prefix_tokens)

        rows = tl.arange(0, BLOCK_M)
        rows_per_member = QMAX * G
        member_slot = rows // rows_per_member
        query_offset = (rows // G) % QMAX
        head = kv_head * G + rows % G
        member = tl.load(tile_members_ptr + tile * MEMBERS + member_slot, mask=member_slot < MEMBERS, other=-1)
        member_ok = member >= 0
        safe_member = tl.where(member_ok, member, 0).to(tl.int64)
        query_begin = tl.load(query_start_ptr + safe_member, mask=member_ok, other=0)
        query_end = tl.load(query_start_ptr + safe_member + 1, mask=member_ok, other=0)
        row_ok = member_ok & (query_offset < query_end - query_begin)
        token = (query_begin + query_offset).to(tl.int64)

        dims = tl.arange(0, HEAD_DIM)
        dim_ok = dims < head_dim
        q_offsets = token[:, None] * stride_q_token + head[:, None].to(tl.int64) * stride_q_head
        q = tl.load(
            q_ptr + q_offsets + dims[None, :].to(tl.int64) * stride_q_dim,
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
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
        out, lse = _finish_partial(m_i, l_i, acc)
        item = (work + tl.zeros([], dtype=tl.int64)) * num_kv_heads + kv_head
        row_index = item * BLOCK_M + rows
        tl.store(
            part_out_ptr + row_index[:, None] * head_dim + dims[None, :],
            out,
            mask=row_ok[:, None] & dim_ok[None, :],
        )
        tl.store(part_lse_ptr + row_index, lse, mask=row_ok)


@triton.jit
def suffix_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    start_blocks_ptr,
    work_start_ptr,
    split_tokens_ptr,
    part_out_ptr,
    part_lse_ptr,
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
    NUM_REQUESTS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    G: tl.constexpr,
    QMAX: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    total_work = tl.load(work_start_ptr + NUM_REQUESTS)
    if work < total_work:
        request = _find_owner(work_start_ptr, work, NUM_REQUESTS, SEARCH_STEPS).to(tl.int64)
        split = work - tl.load(work_start_ptr + request)
        split_tokens = tl.load(split_tokens_ptr)
        seq_len = tl.load(seq_lens_ptr + request)
        query_begin = tl.load(query_start_ptr + request)
        query_len = tl.load(query_start_ptr + request + 1) - query_begin
        token_start = tl.load(start_blocks_ptr + request) * PAGE + split * split_tokens
        token_end = tl.minimum(token_start + split_tokens, seq_len)

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
            q_ptr + q_offsets + dims[None, :].to(tl.int64) * stride_q_dim,
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
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
        out, lse = _finish_partial(m_i, l_i, acc)
        item = (work + tl.zeros([], dtype=tl.int64)) * num_kv_heads + kv_head
        row_index = item * BLOCK_M + rows
        tl.store(
            part_out_ptr + row_index[:, None] * head_dim + dims[None, :],
            out,
            mask=row_ok[:, None] & dim_ok[None, :],
        )
        tl.store(part_lse_ptr + row_index, lse, mask=row_ok)


@triton.jit
def _merge_partial(part_out_ptr, part_lse_ptr, row_index, row_ok, dims, dim_ok, head_dim, run_max, run_sum, acc):
    lse = tl.load(part_lse_ptr + row_index, mask=row_ok, other=float("-inf"))
    part = tl.load(
        part_out_ptr + row_index[:, None] * head_dim + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0
    )
    new_max = tl.maximum(run_max, lse)
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    old_scale = tl.exp(run_max - shift)
    part_scale = tl.exp(lse - shift)
    run_sum = run_sum * old_scale + part_scale
    # A partial with lse = -inf saw no key; its (unwritten) output must not reach the sum, even as 0 * NaN.
    acc = acc * old_scale[:, None] + tl.where(part_scale[:, None] > 0.0, part * part_scale[:, None], 0.0)
    return new_max, run_sum, acc


@triton.jit
def combine_kernel(
    out_ptr,
    lse_ptr,
    query_start_ptr,
    tile_of_ptr,
    slot_in_tile_ptr,
    prefix_work_start_ptr,
    prefix_part_out_ptr,
    prefix_part_lse_ptr,
    suffix_work_start_ptr,
    suffix_part_out_ptr,
    suffix_part_lse_ptr,
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
    PREFIX_BLOCK_M: tl.constexpr,
    SUFFIX_BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    request = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    query_begin = tl.load(query_start_ptr + request)
    query_len = tl.load(query_start_ptr + request + 1) - query_begin
    rows = tl.arange(0, BLOCK_R)
    query_offset = rows // G
    head = kv_head * G + rows % G
    row_ok = (query_offset < query_len) & (rows < QMAX * G)
    dims = tl.arange(0, HEAD_DIM)
    dim_ok = dims < head_dim

    run_max = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)

    if HAS_PREFIX:
        tile = tl.load(tile_of_ptr + request)
        if tile >= 0:
            slot = tl.load(slot_in_tile_ptr + request)
            first = tl.load(prefix_work_start_ptr + tile)
            last = tl.load(prefix_work_start_ptr + tile + 1)
            for work in range(first, last):
                item = (work + tl.zeros([], dtype=tl.int64)) * num_kv_heads + kv_head
                row_index = item * PREFIX_BLOCK_M + slot * (QMAX * G) + rows
                run_max, run_sum, acc = _merge_partial(
                    prefix_part_out_ptr,
                    prefix_part_lse_ptr,
                    row_index,
                    row_ok,
                    dims,
                    dim_ok,
                    head_dim,
                    run_max,
                    run_sum,
                    acc,
                )

    first = tl.load(suffix_work_start_ptr + request)
    last = tl.load(suffix_work_start_ptr + request + 1)
    for work in range(first, last):
        item = (work + tl.zeros([], dtype=tl.int64)) * num_kv_heads + kv_head
        row_index = item * SUFFIX_BLOCK_M + rows
        run_max, run_sum, acc = _merge_partial(
            suffix_part_out_ptr,
            suffix_part_lse_ptr,
            row_index,
            row_ok,
            dims,
            dim_ok,
            head_dim,
            run_max,
            run_sum,
            acc,
        )

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
    tl.store(lse_ptr + token * stride_lse_token + head.to(tl.int64) * stride_lse_head, lse, mask=row_ok)
