# mypy: disable-error-code="no-untyped-def"
"""Triton kernels for tree attention (``@triton.jit`` code only; checks, allocation and grids live in ``_launch``).

Layout: q/k/v/o/do are ``[T, H, D]`` with unit stride along D; lse and delta are ``[Hq, T]`` fp32. Block tables
come from ``_tables.build_kernel_tables`` on ``kv_visible_until`` (prepared once per plan), padded so that every
block listed as *full* lies inside ``[0, T)`` (its loads need no bounds mask); *partial* blocks carry the element
mask, which also masks rows past ``T``.
Scores live in the log2 domain: ``s2 = q.k * scale * log2(e)`` (after the softcap), so ``exp2`` replaces ``exp``.

Backward ``FOLD`` (a launch option): the row statistics enter the matrix products as accumulator initial values,
``dP - delta = dot(dO, V^T, acc=-delta)`` and, without a softcap, ``q.k - lse / scale = dot(q, K^T, acc=-lse / scale)``
so that ``p = exp2(acc * scale * log2(e))``; the ``stats`` buffer then holds ``lse / scale`` (``lse * log2(e)`` with a
softcap, where the score is not linear in ``q.k``). In the dK/dV kernel queries lie along the columns of the
transposed tiles, so each thread would otherwise keep ``BLOCK_M / 4`` values of each statistic in registers.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _scores(
    q,
    kT,
    scale,
    softcap,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``q [M, D] @ kT [D, N]`` -> (log2-domain scores, ``1 - tanh^2`` for the softcap derivative; without a
    softcap the second value is unused and just aliases the scores)."""
    dots = tl.dot(q, kT, input_precision=DOT_PRECISION)
    if SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): stable at both ends (exp overflow gives 1, underflow gives -1).
        tanh = 1.0 - 2.0 / (tl.exp2(dots * (2.0 * LOG2E * scale / softcap)) + 1.0)
        scores = tanh * (softcap * LOG2E)
        derivative = 1.0 - tanh * tanh
    else:
        scores = dots * (scale * LOG2E)
        derivative = scores
    return scores, derivative


@triton.jit
def _tree_mask(
    offs_m,
    offs_n,
    until_ptr,
    pos_ptr,
    pos_m,
    num_tokens,
    window,
    WINDOW: tl.constexpr,
):
    """``[M, N]``: key ``n`` visible to query ``m`` (tree rule, optional logical sliding window, both in range)."""
    in_range = offs_n < num_tokens
    until = tl.load(until_ptr + offs_n, mask=in_range, other=0)
    visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_m[:, None] < until[None, :])
    if WINDOW:
        pos_n = tl.load(pos_ptr + offs_n, mask=in_range, other=0)
        visible = visible & ((pos_m[:, None] - pos_n[None, :]) < window)
    return visible


@triton.jit
def _forward_blocks(
    acc,
    l_i,
    m_i,
    q,
    k_head_ptr,
    v_head_ptr,
    stride_kt,
    stride_vt,
    index_row_ptr,
    count,
    offs_m,
    pos_m,
    until_ptr,
    pos_ptr,
    num_tokens,
    scale,
    softcap,
    window,
    MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    for j in range(count):
        block = tl.load(index_row_ptr + j).to(tl.int64)
        offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        kT_ptrs = k_head_ptr + offs_n[None, :] * stride_kt + offs_d[:, None]
        v_ptrs = v_head_ptr + offs_n[:, None] * stride_vt + offs_d[None, :]
        if MASKED:
            in_range = offs_n < num_tokens
            kT = tl.load(kT_ptrs, mask=in_range[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
        else:
            kT = tl.load(kT_ptrs)
            v = tl.load(v_ptrs)
        if UPCAST:
            kT = kT.to(tl.float32)
            v = v.to(tl.float32)
        s, _ = _scores(q, kT, scale, softcap, SOFTCAP, DOT_PRECISION)
        if MASKED:
            visible = _tree_mask(offs_m, offs_n, until_ptr, pos_ptr, pos_m, num_tokens, window, WINDOW)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Only in a partial tile can a row have seen no visible key yet (m = -inf): shift it by 0 so exp2 gives 0,
        # not NaN. In a full tile every element is visible and every row maximum is finite.
        m_shift = m_new
        if MASKED:
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        # Accumulating inside tl.dot keeps the accumulator in the matrix unit's registers (no extra add).
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def tree_attention_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    full_num_ptr,
    full_idx_ptr,
    part_num_ptr,
    part_idx_ptr,
    order_ptr,
    until_ptr,
    pos_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_index,
    num_tokens,
    scale,
    softcap,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Heads vary fastest in launch order and blocks come heaviest first (order is sorted by work): the last wave
    # is short, and programs running together share K/V through L2.
    q_block = tl.load(order_ptr + tl.program_id(1)).to(tl.int64)
    head = tl.program_id(0).to(tl.int64)
    kv_head = head // GROUP
    offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < num_tokens
    q = tl.load(
        q_ptr + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    pos_m = tl.load(pos_ptr + offs_m, mask=row_ok, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh
    acc, l_i, m_i = _forward_blocks(
        acc, l_i, m_i, q, k_head_ptr, v_head_ptr, stride_kt, stride_vt,
        full_idx_ptr + q_block * stride_index, tl.load(full_num_ptr + q_block),
        offs_m, pos_m, until_ptr, pos_ptr, num_tokens, scale, softcap, window,
        False, SOFTCAP, WINDOW, UPCAST, DOT_PRECISION, BLOCK_N, HEAD_DIM,
    )  # fmt: skip
    acc, l_i, m_i = _forward_blocks(
        acc, l_i, m_i, q, k_head_ptr, v_head_ptr, stride_kt, stride_vt,
        part_idx_ptr + q_block * stride_index, tl.load(part_num_ptr + q_block),
        offs_m, pos_m, until_ptr, pos_ptr, num_tokens, scale, softcap, window,
        True, SOFTCAP, WINDOW, UPCAST, DOT_PRECISION, BLOCK_N, HEAD_DIM,
    )  # fmt: skip
    # Every real query sees at least itself, so l > 0 on rows that are stored; padded rows divide by 1.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe)) / LOG2E
    out_ptrs = out_ptr + offs_m[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + head * num_tokens + offs_m, lse, mask=row_ok)


@triton.jit
def tree_attention_bwd_preprocess_kernel(
    out_ptr,
    dout_ptr,
    delta_ptr,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    num_tokens,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """``delta[h, t] = sum_d out[t, h, d] * dout[t, h, d]`` in fp32."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < num_tokens
    out = tl.load(
        out_ptr + offs_m[:, None] * stride_ot + head * stride_oh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    dout = tl.load(
        dout_ptr + offs_m[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    delta = tl.sum(out.to(tl.float32) * dout.to(tl.float32), 1)
    tl.store(delta_ptr + head * num_tokens + offs_m, delta, mask=row_ok)


@triton.jit
def _dp_minus_delta(v, do, delta, FOLD: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_M: tl.constexpr):  # fmt: skip
    """``(dO V^T)^T - delta`` as ``[N, M]``; with ``FOLD`` delta is the product's initial accumulator."""
    if FOLD:
        return tl.dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], tl.float32) - delta[None, :],
                      input_precision=DOT_PRECISION)  # fmt: skip
    return tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION) - delta[None, :]


@triton.jit
def _dkdv_blocks(
    dk,
    dv,
    k,
    v,
    k_low,
    k_high,
    q_head_ptr,
    do_head_ptr,
    dq_head_ptr,
    lse_head_ptr,
    delta_head_ptr,
    stride_qt,
    stride_dot,
    stride_dqt,
    index_row_ptr,
    count,
    offs_n,
    until_ptr,
    pos_ptr,
    num_tokens,
    scale,
    softcap,
    window,
    MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    FOLD: tl.constexpr,
    DP_FIRST: tl.constexpr,
    DQ_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        key_ok = offs_n < num_tokens
        until_n = tl.load(until_ptr + offs_n, mask=key_ok, other=0)
        pos_n = tl.load(pos_ptr + offs_n, mask=key_ok, other=0)
    for i in range(count):
        block = tl.load(index_row_ptr + i).to(tl.int64)
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        qT_ptrs = q_head_ptr + offs_m[None, :] * stride_qt + offs_d[:, None]
        do_ptrs = do_head_ptr + offs_m[:, None] * stride_dot + offs_d[None, :]
        row_ok = offs_m < num_tokens
        if MASKED:
            qT = tl.load(qT_ptrs, mask=row_ok[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            qT = tl.load(qT_ptrs)
            do = tl.load(do_ptrs)
        if UPCAST:
            qT = qT.to(tl.float32)
            do = do.to(tl.float32)
        stat = tl.load(lse_head_ptr + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(delta_head_ptr + offs_m, mask=row_ok, other=0.0)
        # Transposed scores [N, M]: keys are rows here, so dK and dV accumulate without a transpose.
        if FOLD and not SOFTCAP:
            shifted = tl.dot(k, qT, tl.zeros([BLOCK_N, BLOCK_M], tl.float32) - stat[None, :],
                             input_precision=DOT_PRECISION)  # fmt: skip
            log2_pT = shifted * (scale * LOG2E)
            dcap = log2_pT
        else:
            sT, dcap = _scores(k, qT, scale, softcap, SOFTCAP, DOT_PRECISION)
            lse2 = stat if FOLD else stat * LOG2E
            log2_pT = sT - lse2[None, :]
        if DP_FIRST:
            # Both products of the step before any exponential (the flash-attention 2 order): the fp32 tiles live
            # one after the other instead of next to an in-flight dV product's operand.
            dpT_minus_delta = _dp_minus_delta(v, do, delta, FOLD, DOT_PRECISION, BLOCK_N, BLOCK_M)
        pT = tl.exp2(log2_pT)
        if MASKED:
            visible = (offs_n[:, None] <= offs_m[None, :]) & (offs_m[None, :] < until_n[:, None])
            if WINDOW:
                pos_m = tl.load(pos_ptr + offs_m, mask=row_ok, other=0)
                visible = visible & ((pos_m[None, :] - pos_n[:, None]) < window)
            pT = tl.where(visible, pT, 0.0)
        pT_low = pT.to(do.dtype)
        if not DP_FIRST:
            dv = tl.dot(pT_low, do, dv, input_precision=DOT_PRECISION)
            dpT_minus_delta = _dp_minus_delta(v, do, delta, FOLD, DOT_PRECISION, BLOCK_N, BLOCK_M)
        dsT = pT * dpT_minus_delta
        if SOFTCAP:
            dsT = dsT * dcap
        if DP_FIRST:
            dv = tl.dot(pT_low, do, dv, input_precision=DOT_PRECISION)
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=DOT_PRECISION)
        if ATOMIC_DQ:
            ds = tl.trans(dsT.to(k.dtype))
            dq_rows = dq_head_ptr + offs_m[:, None] * stride_dqt
            if DQ_SPLIT:
                # Two [M, D/2] products and atomic adds: half the fp32 tile (and its layout change) live at a time.
                half = tl.arange(0, HEAD_DIM // 2)
                rows_ok = row_ok[:, None] & (half[None, :] >= 0)
                dq = tl.dot(ds, k_low, input_precision=DOT_PRECISION) * scale
                tl.atomic_add(dq_rows + half[None, :], dq, mask=rows_ok, sem="relaxed")
                dq = tl.dot(ds, k_high, input_precision=DOT_PRECISION) * scale
                tl.atomic_add(dq_rows + HEAD_DIM // 2 + half[None, :], dq, mask=rows_ok, sem="relaxed")
            else:
                dq = tl.dot(ds, k, input_precision=DOT_PRECISION) * scale
                dq_mask = row_ok[:, None] & (offs_d[None, :] >= 0)
                tl.atomic_add(dq_rows + offs_d[None, :], dq, mask=dq_mask, sem="relaxed")
    return dk, dv


@triton.jit
def tree_attention_bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    dk_ptr,
    dv_ptr,
    full_num_ptr,
    full_idx_ptr,
    part_num_ptr,
    part_idx_ptr,
    order_ptr,
    until_ptr,
    pos_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    stride_index,
    num_tokens,
    scale,
    softcap,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    FOLD: tl.constexpr,
    DP_FIRST: tl.constexpr,
    DQ_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (key block, kv head): dK and dV summed over the whole query-head group, no atomics."""
    key_block = tl.load(order_ptr + tl.program_id(1)).to(tl.int64)
    kv_head = tl.program_id(0).to(tl.int64)
    offs_n = key_block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < num_tokens
    k = tl.load(
        k_ptr + offs_n[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=key_ok[:, None], other=0.0
    )
    v = tl.load(
        v_ptr + offs_n[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=key_ok[:, None], other=0.0
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    k_low = k
    k_high = k
    if ATOMIC_DQ and DQ_SPLIT:
        half = tl.arange(0, HEAD_DIM // 2)
        k_half_ptrs = k_ptr + offs_n[:, None] * stride_kt + kv_head * stride_kh + half[None, :]
        k_low = tl.load(k_half_ptrs, mask=key_ok[:, None], other=0.0)
        k_high = tl.load(k_half_ptrs + HEAD_DIM // 2, mask=key_ok[:, None], other=0.0)
        if UPCAST:
            k_low = k_low.to(tl.float32)
            k_high = k_high.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    full_row = full_idx_ptr + key_block * stride_index
    part_row = part_idx_ptr + key_block * stride_index
    full_count = tl.load(full_num_ptr + key_block)
    part_count = tl.load(part_num_ptr + key_block)
    for member in range(GROUP):
        head = kv_head * GROUP + member
        q_head_ptr = q_ptr + head * stride_qh
        do_head_ptr = do_ptr + head * stride_doh
        dq_head_ptr = dq_ptr + head * stride_dqh
        lse_head_ptr = lse_ptr + head * num_tokens
        delta_head_ptr = delta_ptr + head * num_tokens
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, k_low, k_high, q_head_ptr, do_head_ptr, dq_head_ptr, lse_head_ptr, delta_head_ptr,
            stride_qt, stride_dot, stride_dqt, full_row, full_count, offs_n, until_ptr, pos_ptr,
            num_tokens, scale, softcap, window,
            False, SOFTCAP, WINDOW, UPCAST, ATOMIC_DQ, FOLD, DP_FIRST, DQ_SPLIT, DOT_PRECISION,
            BLOCK_M, BLOCK_N, HEAD_DIM,
        )  # fmt: skip
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, k_low, k_high, q_head_ptr, do_head_ptr, dq_head_ptr, lse_head_ptr, delta_head_ptr,
            stride_qt, stride_dot, stride_dqt, part_row, part_count, offs_n, until_ptr, pos_ptr,
            num_tokens, scale, softcap, window,
            True, SOFTCAP, WINDOW, UPCAST, ATOMIC_DQ, FOLD, DP_FIRST, DQ_SPLIT, DOT_PRECISION,
            BLOCK_M, BLOCK_N, HEAD_DIM,
        )  # fmt: skip
    dk = dk * scale
    tl.store(
        dk_ptr + offs_n[:, None] * stride_dkt + kv_head * stride_dkh + offs_d[None, :],
        dk.to(dk_ptr.dtype.element_ty),
        mask=key_ok[:, None],
    )
    tl.store(
        dv_ptr + offs_n[:, None] * stride_dvt + kv_head * stride_dvh + offs_d[None, :],
        dv.to(dv_ptr.dtype.element_ty),
        mask=key_ok[:, None],
    )


@triton.jit
def _dq_blocks(
    dq,
    q,
    do,
    stat,
    delta,
    k_head_ptr,
    v_head_ptr,
    stride_kt,
    stride_vt,
    index_row_ptr,
    count,
    offs_m,
    pos_m,
    until_ptr,
    pos_ptr,
    num_tokens,
    scale,
    softcap,
    window,
    MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    FOLD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    for j in range(count):
        block = tl.load(index_row_ptr + j).to(tl.int64)
        offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        kT_ptrs = k_head_ptr + offs_n[None, :] * stride_kt + offs_d[:, None]
        vT_ptrs = v_head_ptr + offs_n[None, :] * stride_vt + offs_d[:, None]
        if MASKED:
            in_range = offs_n < num_tokens
            kT = tl.load(kT_ptrs, mask=in_range[None, :], other=0.0)
            vT = tl.load(vT_ptrs, mask=in_range[None, :], other=0.0)
        else:
            kT = tl.load(kT_ptrs)
            vT = tl.load(vT_ptrs)
        if UPCAST:
            kT = kT.to(tl.float32)
            vT = vT.to(tl.float32)
        if FOLD and not SOFTCAP:
            shifted = tl.dot(q, kT, tl.zeros([BLOCK_M, BLOCK_N], tl.float32) - stat[:, None],
                             input_precision=DOT_PRECISION)  # fmt: skip
            p = tl.exp2(shifted * (scale * LOG2E))
            dcap = p
        else:
            s, dcap = _scores(q, kT, scale, softcap, SOFTCAP, DOT_PRECISION)
            p = tl.exp2(s - stat[:, None])
        if MASKED:
            visible = _tree_mask(offs_m, offs_n, until_ptr, pos_ptr, pos_m, num_tokens, window, WINDOW)
            p = tl.where(visible, p, 0.0)
        if FOLD:
            ds = p * tl.dot(do, vT, tl.zeros([BLOCK_M, BLOCK_N], tl.float32) - delta[:, None],
                            input_precision=DOT_PRECISION)  # fmt: skip
        else:
            dp = tl.dot(do, vT, input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * dcap
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def tree_attention_bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    full_num_ptr,
    full_idx_ptr,
    part_num_ptr,
    part_idx_ptr,
    order_ptr,
    until_ptr,
    pos_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_index,
    num_tokens,
    scale,
    softcap,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    FOLD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (query block, query head): dQ over the block's key lists, a fixed order, no atomics."""
    q_block = tl.load(order_ptr + tl.program_id(1)).to(tl.int64)
    head = tl.program_id(0).to(tl.int64)
    kv_head = head // GROUP
    offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < num_tokens
    q = tl.load(
        q_ptr + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    do = tl.load(
        do_ptr + offs_m[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    stat = tl.load(lse_ptr + head * num_tokens + offs_m, mask=row_ok, other=0.0)
    if not FOLD:
        stat = stat * LOG2E
    delta = tl.load(delta_ptr + head * num_tokens + offs_m, mask=row_ok, other=0.0)
    pos_m = tl.load(pos_ptr + offs_m, mask=row_ok, other=0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh
    dq = _dq_blocks(
        dq, q, do, stat, delta, k_head_ptr, v_head_ptr, stride_kt, stride_vt,
        full_idx_ptr + q_block * stride_index, tl.load(full_num_ptr + q_block),
        offs_m, pos_m, until_ptr, pos_ptr, num_tokens, scale, softcap, window,
        False, SOFTCAP, WINDOW, UPCAST, FOLD, DOT_PRECISION, BLOCK_M, BLOCK_N, HEAD_DIM,
    )  # fmt: skip
    dq = _dq_blocks(
        dq, q, do, stat, delta, k_head_ptr, v_head_ptr, stride_kt, stride_vt,
        part_idx_ptr + q_block * stride_index, tl.load(part_num_ptr + q_block),
        offs_m, pos_m, until_ptr, pos_ptr, num_tokens, scale, softcap, window,
        True, SOFTCAP, WINDOW, UPCAST, FOLD, DOT_PRECISION, BLOCK_M, BLOCK_N, HEAD_DIM,
    )  # fmt: skip
    tl.store(
        dq_ptr + offs_m[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :],
        (dq * scale).to(dq_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )
