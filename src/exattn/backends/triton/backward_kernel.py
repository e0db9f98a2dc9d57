"""The fused backward kernels: delta preprocess, dK/dV, dQ. Deterministic: no atomics by default.

With P = exp(S - lse) recomputed tile by tile from the saved lse (base 2
inside), Z = keep / (1 - p) the dropout factor and delta = rowsum(dO * O):

    dV = (P Z)^T dO,   dS = P * ((dO V^T) Z - delta),   dQ = scale dS K,   dK = scale dS^T Q

`attention_dkdv_kernel` owns BLOCK_N keys of one (batch, K/V head) and sweeps
the query tiles of every query head of its group (GQA sums there, in a fixed
order). `attention_dq_kernel` owns BLOCK_M queries of one (batch, query head)
and sweeps their key tiles, forming its rows' delta from O and dO itself (the
preprocess's delta, for the dK/dV kernel, may live in dQ's bytes until it
writes them). Both walk only the tiles the band allows, split
into masked and full runs (tiles.tile_segments). A row with lse = -inf
(nothing allowed) uses lse = +inf, so its P is 0 and so are its gradients.
With ATOMIC_DQ the dK/dV kernel also adds dS K into a float32 dQ buffer with
atomics and the dQ kernel is skipped: fewer FLOPs, not bitwise reproducible.
With ACCUMULATE each program adds its finished tile to the float32 tile already
in DK/DVAL (DQ) instead of overwriting it: callers such as ring attention sum
the gradients of many calls in place. Each tile has one owner: deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .configs import COUNTS
from .tile_io import (
    head_slice, head_tile_pointers, load_head_tile, load_source_tile, load_tile, slice_offset, store_tile,
    tile_pointers, tile_source, tile_walk,
)
from .tiles import (
    dropout_keep, lse_in_base2, query_row_tile, recomputed_probabilities, row_slope, rule_masked_scores, score_mods,
    sequence_prefix, sequence_span, segment_ids, tile_segments, with_prefix_keys, with_prefix_rows, with_segment_tiles,
)


@triton.jit(do_not_specialize=COUNTS)
def attention_delta_kernel(
    O, DO, DELTA, CU_Q, o_strides, do_strides, heads_q, len_q, num_row_tiles, stats_head_stride,
    DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, VARLEN: tl.constexpr,
):
    """delta = rowsum(O * dO) in float32 into contiguous (B, Hq, Nq). Grid: (num_row_tiles * B * Hq,).

    VARLEN: b is a packed sequence (rows CU_Q[b]:CU_Q[b+1], batch strides 0) and DELTA is
    (Hq, total_q) with head stride stats_head_stride."""
    pid = tl.program_id(0)
    bh = pid // num_row_tiles
    rows = (pid % num_row_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    b = (bh // heads_q).to(tl.int64)
    h = (bh % heads_q).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    if VARLEN:
        start, len_q = sequence_span(CU_Q, b)
        O += start * o_strides[2]
        DO += start * do_strides[2]
    do = load_head_tile(DO, do_strides, b, h, rows, len_q, offs_dv, DV, BLOCK_DV)
    delta = row_delta(O, o_strides, do, b, h, rows, len_q, offs_dv, DV, BLOCK_DV)
    if VARLEN:
        delta_at = DELTA + h * stats_head_stride + start + rows
    else:
        delta_at = DELTA + bh.to(tl.int64) * len_q + rows
    tl.store(delta_at, delta, mask=rows < len_q)


@triton.jit
def row_delta(O, o_strides, do, b, h, rows, len_q, offs_dv, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    """rowsum(O * dO) in float32 for `rows` of the (b, h) slice, given their dO tile (0 outside)."""
    o = load_head_tile(O, o_strides, b, h, rows, len_q, offs_dv, DV, BLOCK_DV)
    return tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)


@triton.jit
def load_lse2(LSE, row_base, rows, len_q, CHECK_ROWS: tl.constexpr):
    """lse in base 2 with -inf -> +inf for `rows`; row_base = (b*Hq + h)*Nq."""
    if CHECK_ROWS:
        lse = tl.load(LSE + row_base + rows, mask=rows < len_q, other=float("-inf"))
    else:
        lse = tl.load(LSE + row_base + rows)
    return lse_in_base2(lse)


@triton.jit
def load_row_stats(LSE, DELTA, row_base, rows, len_q, CHECK_ROWS: tl.constexpr):
    """(lse in base 2 with -inf -> +inf, delta) for `rows`; row_base = (b*Hq + h)*Nq."""
    if CHECK_ROWS:
        delta = tl.load(DELTA + row_base + rows, mask=rows < len_q, other=0.0)
    else:
        delta = tl.load(DELTA + row_base + rows)
    return load_lse2(LSE, row_base, rows, len_q, CHECK_ROWS), delta


@triton.jit
def dkdv_segment(
    dk, dv, k, v, q_src, do_src, q_strides, do_strides, LSE, DELTA, DQ_ACC, dq_strides,
    tile_lo, tile_hi, cols, offs_m, offs_d, offs_dv, len_q, len_k, left, right, scale_log2,
    mask_base, mask_strides, seed, dropout_p, keep_scale, row_base, drop_base, drop_cols, mods,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, CHECK_BAND: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
):
    """Add the query tiles [tile_lo, tile_hi) of one query head into (dk, dv) (dk unscaled).

    row_base indexes the rows' lse and delta; drop_base and drop_cols place them in the dropout grid."""
    q_at, q_step = tile_walk(q_src, q_strides, tile_lo, BLOCK_M, offs_m, offs_d, USE_TMA)
    do_at, do_step = tile_walk(do_src, do_strides, tile_lo, BLOCK_M, offs_m, offs_dv, USE_TMA)
    for tile in tl.range(tile_lo, tile_hi):
        m0 = tile * BLOCK_M
        rows = m0 + offs_m
        q = load_source_tile(q_at, m0, rows, len_q, offs_d, D, BLOCK_D, CHECK_BAND, USE_TMA)
        do = load_source_tile(do_at, m0, rows, len_q, offs_dv, DV, BLOCK_DV, CHECK_BAND, USE_TMA)
        lse2, delta = load_row_stats(LSE, DELTA, row_base, rows, len_q, CHECK_BAND)
        if DOT_PRECISION == "ieee":
            # fp32: the forward's operand order, so a dot whose rounding depends on it (the
            # interpreter's BLAS) gives back the forward's scores and P's largest terms stay exact.
            s2t = tl.trans(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)) * scale_log2
        else:
            s2t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * scale_log2
        s2t, dcap = score_mods(s2t, rows[None, :], cols[:, None], len_q, len_k, mods, HAS_SOFTCAP, HAS_ALIBI)
        if CHECK_BAND or MASK_KIND != 0:
            s2t = rule_masked_scores(s2t, rows, cols, len_q, len_k, left, right, mask_base, mask_strides, mods,
                                     CHECK_BAND, HAS_LEFT, HAS_RIGHT, MASK_KIND, HAS_PREFIX, HAS_SEGMENTS, True)
        pt = recomputed_probabilities(s2t - lse2[None, :])
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = dropout_keep(seed, dropout_p, drop_base, rows[None, :], cols[:, None], drop_cols)
            dv = tl.dot(tl.where(keep, pt * keep_scale, 0.0).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dpt = tl.where(keep, dpt * keep_scale, 0.0)
        else:
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        if HAS_SOFTCAP:
            dst = dst * dcap
        dst = dst.to(q.dtype)
        dk = tl.dot(dst, q, dk, input_precision=DOT_PRECISION)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(dst), k, input_precision=DOT_PRECISION)
            tl.atomic_add(tile_pointers(DQ_ACC, dq_strides, rows, offs_d), dq,
                          mask=(rows[:, None] < len_q) & (offs_d[None, :] < D), sem="relaxed")
        if not USE_TMA:
            q_at += q_step
            do_at += do_step
    return dk, dv


@triton.jit
def dkdv_head(
    dk, dv, k, v, Q, DO, Q_DESC, DO_DESC, LSE, DELTA, DQ_ACC, MASK, q_strides, do_strides, dq_strides, mask_strides,
    b, h, heads_q, segments, cols, offs_m, offs_d, offs_dv, len_q, len_k, left, right,
    scale_log2, seed, dropout_p, keep_scale, q_start, stats_head_stride, drop_rows, drop_cols,
    ALIBI, alibi_strides, softcap2, prefix, seg_keys, seg_q_base, seg_q_stride,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, VARLEN: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
):
    """Add every query tile of query head h: masked edge, full, masked diagonal / tail runs."""
    qs, dos = (q_strides[2], q_strides[3]), (do_strides[2], do_strides[3])
    q_src = tile_source(Q, slice_offset(q_strides, b, h, q_start), qs, len_q, D, BLOCK_M, BLOCK_D, USE_TMA, Q_DESC)
    do_src = tile_source(DO, slice_offset(do_strides, b, h, q_start), dos, len_q, DV, BLOCK_M, BLOCK_DV, USE_TMA,
                         DO_DESC)
    dq_base, dqs = head_slice(DQ_ACC, dq_strides, b, h)
    mask_base, ms = head_slice(MASK, mask_strides, b, h)
    if VARLEN:
        dq_base += q_start * dqs[0]
        row_base = h * stats_head_stride + q_start
    else:
        row_base = (b * heads_q + h) * len_q
    drop_base = (b * heads_q + h) * drop_rows
    mods = (softcap2, row_slope(ALIBI, alibi_strides, b, h, HAS_ALIBI), prefix, seg_keys, seg_q_base, seg_q_stride)
    lo, full_lo, full_hi, hi = segments
    dk, dv = dkdv_segment(
        dk, dv, k, v, q_src, do_src, qs, dos, LSE, DELTA, dq_base, dqs, lo, full_lo, cols, offs_m,
        offs_d, offs_dv, len_q, len_k, left, right, scale_log2, mask_base, ms, seed, dropout_p,
        keep_scale, row_base, drop_base, drop_cols, mods, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT,
        MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, ATOMIC_DQ, HAS_SOFTCAP, HAS_ALIBI, HAS_PREFIX, HAS_SEGMENTS,
    )
    dk, dv = dkdv_segment(
        dk, dv, k, v, q_src, do_src, qs, dos, LSE, DELTA, dq_base, dqs, full_lo, full_hi, cols,
        offs_m, offs_d, offs_dv, len_q, len_k, left, right, scale_log2, mask_base, ms, seed,
        dropout_p, keep_scale, row_base, drop_base, drop_cols, mods, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, False, HAS_LEFT,
        HAS_RIGHT, MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, ATOMIC_DQ, HAS_SOFTCAP, HAS_ALIBI, HAS_PREFIX, HAS_SEGMENTS,
    )
    dk, dv = dkdv_segment(
        dk, dv, k, v, q_src, do_src, qs, dos, LSE, DELTA, dq_base, dqs, full_hi, hi, cols, offs_m,
        offs_d, offs_dv, len_q, len_k, left, right, scale_log2, mask_base, ms, seed, dropout_p,
        keep_scale, row_base, drop_base, drop_cols, mods, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT,
        MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, ATOMIC_DQ, HAS_SOFTCAP, HAS_ALIBI, HAS_PREFIX, HAS_SEGMENTS,
    )
    return dk, dv


@triton.jit(do_not_specialize=["seed", *COUNTS])
def attention_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DVAL, DQ_ACC, MASK, CU_Q, CU_K, ALIBI, PREFIX, SEG_Q, SEG_K, SEG_RANGES,
    Q_DESC, DO_DESC, q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides, dq_strides, mask_strides,
    alibi_strides, seg_q_strides, seg_k_strides, heads_q, group, len_q, len_k, num_col_tiles, stats_head_stride, softcap2, scale_log2,
    scale, left, right,
    dropout_p, keep_scale, seed,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, ACCUMULATE: tl.constexpr,
    VARLEN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_PREFIX: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr,
):
    """Grid: (num_col_tiles * B * Hk,). DK, DVAL: (B, Hk, Nk, D/Dv) in k's dtype (float32 with ACCUMULATE).

    DQ_ACC: float32 (B, Hq, Nq, D), written only with ATOMIC_DQ. VARLEN: as the forward kernel,
    with LSE and DELTA (Hq, total_q) of head stride stats_head_stride. Q_DESC, DO_DESC: the host's
    descriptors with USE_TMA = 2 (`tile_io`).
    """
    pid = tl.program_id(0)
    heads_k = heads_q // group
    bhk = pid // num_col_tiles
    n0 = (pid % num_col_tiles) * BLOCK_N
    b = (bhk // heads_k).to(tl.int64)
    hk = (bhk % heads_k).to(tl.int64)
    drop_rows = len_q
    drop_cols = len_k
    q_start = 0
    if VARLEN:
        q_start, len_q = sequence_span(CU_Q, b)
        k_start, len_k = sequence_span(CU_K, b)
        if n0 >= len_k:
            return
        K += k_start * k_strides[2]
        V += k_start * v_strides[2]
        DK += k_start * dk_strides[2]
        DVAL += k_start * dv_strides[2]
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = load_head_tile(K, k_strides, b, hk, cols, len_k, offs_d, D, BLOCK_D)
    v = load_head_tile(V, v_strides, b, hk, cols, len_k, offs_dv, DV, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, full_lo, full_hi, hi = tile_segments(
        n0, tl.minimum(n0 + BLOCK_N, len_k), len_k, len_q, right, left, BLOCK_M, HAS_RIGHT, HAS_LEFT
    )
    full_hi = tl.where(n0 + BLOCK_N <= len_k, full_hi, full_lo)  # a ragged key tile is masked throughout
    prefix = sequence_prefix(PREFIX, b, HAS_PREFIX)
    if HAS_PREFIX:
        lo, full_lo, full_hi, hi = with_prefix_rows((lo, full_lo, full_hi, hi), n0, prefix, len_q, BLOCK_M)
    if HAS_SEGMENTS:
        lo, full_lo, full_hi, hi = with_segment_tiles((lo, full_lo, full_hi, hi), SEG_RANGES, b, n0 // BLOCK_N,
                                                      num_col_tiles)
    seg_keys = segment_ids(SEG_K, seg_k_strides, b, cols, len_k, -2, HAS_SEGMENTS)
    for g in tl.range(0, group, num_stages=1):  # descriptors built per head: the pipeliner cannot predicate them
        dk, dv = dkdv_head(
            dk, dv, k, v, Q, DO, Q_DESC, DO_DESC, LSE, DELTA, DQ_ACC, MASK, q_strides, do_strides, dq_strides,
            mask_strides, b, hk * group + g, heads_q, (lo, full_lo, full_hi, hi), cols, offs_m,
            offs_d, offs_dv, len_q, len_k, left, right, scale_log2, seed, dropout_p, keep_scale,
            q_start, stats_head_stride, drop_rows, drop_cols, ALIBI, alibi_strides, softcap2, prefix, seg_keys,
            SEG_Q + b * seg_q_strides[0], seg_q_strides[1], D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, HAS_LEFT, HAS_RIGHT,
            MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, ATOMIC_DQ, VARLEN, HAS_SOFTCAP, HAS_ALIBI, HAS_PREFIX,
            HAS_SEGMENTS,
        )
    dk_ptrs = head_tile_pointers(DK, dk_strides, b, hk, cols, offs_d)
    dv_ptrs = head_tile_pointers(DVAL, dv_strides, b, hk, cols, offs_dv)
    dk = dk * scale
    if ACCUMULATE:
        dk += load_tile(dk_ptrs, cols, len_k, offs_d, D, BLOCK_D, True)
        dv += load_tile(dv_ptrs, cols, len_k, offs_dv, DV, BLOCK_DV, True)
    store_tile(dk_ptrs, dk, cols, len_k, offs_d, D)
    store_tile(dv_ptrs, dv, cols, len_k, offs_dv, DV)


@triton.jit
def dq_segment(
    dq, q, do, lse2, delta, k_src, v_src, k_strides, v_strides, tile_lo, tile_hi,
    rows, offs_n, offs_d, offs_dv, len_q, len_k, left, right, scale_log2,
    mask_base, mask_strides, seed, dropout_p, keep_scale, drop_base, drop_cols, mods,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, CHECK_BAND: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_PREFIX: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
):
    """Add the key tiles [tile_lo, tile_hi) into dq (unscaled)."""
    k_at, k_step = tile_walk(k_src, k_strides, tile_lo, BLOCK_N, offs_n, offs_d, USE_TMA)
    v_at, v_step = tile_walk(v_src, v_strides, tile_lo, BLOCK_N, offs_n, offs_dv, USE_TMA)
    for tile in tl.range(tile_lo, tile_hi):
        n0 = tile * BLOCK_N
        cols = n0 + offs_n
        k = load_source_tile(k_at, n0, cols, len_k, offs_d, D, BLOCK_D, CHECK_BAND, USE_TMA)
        v = load_source_tile(v_at, n0, cols, len_k, offs_dv, DV, BLOCK_DV, CHECK_BAND, USE_TMA)
        s2 = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s2, dcap = score_mods(s2, rows[:, None], cols[None, :], len_q, len_k, mods, HAS_SOFTCAP, HAS_ALIBI)
        if CHECK_BAND or MASK_KIND != 0:
            s2 = rule_masked_scores(s2, rows, cols, len_q, len_k, left, right, mask_base, mask_strides, mods,
                                    CHECK_BAND, HAS_LEFT, HAS_RIGHT, MASK_KIND, HAS_PREFIX, HAS_SEGMENTS, False)
        p = recomputed_probabilities(s2 - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = dropout_keep(seed, dropout_p, drop_base, rows[:, None], cols[None, :], drop_cols)
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * dcap
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        if not USE_TMA:
            k_at += k_step
            v_at += v_step
    return dq


@triton.jit(do_not_specialize=["seed", *COUNTS])
def attention_dq_kernel(
    Q, K, V, DO, O, LSE, DQ, MASK, CU_Q, CU_K, ALIBI, PREFIX, SEG_Q, SEG_K, SEG_RANGES, K_DESC, V_DESC,
    q_strides, k_strides, v_strides, do_strides, o_strides, dq_strides, mask_strides, alibi_strides, seg_q_strides, seg_k_strides,
    heads_q, group, len_q, len_k, num_row_tiles, stats_head_stride, softcap2, scale_log2, scale, left, right,
    dropout_p, keep_scale, seed,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
    HEAVY_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
    VARLEN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_PREFIX: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr,
):
    """Grid: (num_row_tiles * B * Hq,). DQ: (B, Hq, Nq, D) in q's dtype (float32 with ACCUMULATE).
    Forms its rows' delta from O and dO (the dK/dV kernel's delta may live in DQ's bytes).

    VARLEN: as the dK/dV kernel. K_DESC, V_DESC: the host's descriptors with USE_TMA = 2 (`tile_io`)."""
    b, h, hk, m0 = query_row_tile(tl.program_id(0), num_row_tiles, heads_q, group, BLOCK_M, HEAVY_FIRST)
    drop_rows = len_q
    drop_cols = len_k
    k_start = 0
    if VARLEN:
        q_start, len_q = sequence_span(CU_Q, b)
        k_start, len_k = sequence_span(CU_K, b)
        if m0 >= len_q:
            return
        Q += q_start * q_strides[2]
        DO += q_start * do_strides[2]
        O += q_start * o_strides[2]
        DQ += q_start * dq_strides[2]
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = load_head_tile(Q, q_strides, b, h, rows, len_q, offs_d, D, BLOCK_D)
    do = load_head_tile(DO, do_strides, b, h, rows, len_q, offs_dv, DV, BLOCK_DV)
    if VARLEN:
        row_base = h * stats_head_stride + q_start
    else:
        row_base = (b * heads_q + h) * len_q
    drop_base = (b * heads_q + h) * drop_rows
    mods = (softcap2, row_slope(ALIBI, alibi_strides, b, h, HAS_ALIBI), sequence_prefix(PREFIX, b, HAS_PREFIX),
            segment_ids(SEG_Q, seg_q_strides, b, rows, len_q, -1, HAS_SEGMENTS), SEG_K + b * seg_k_strides[0],
            seg_k_strides[1])
    lse2 = load_lse2(LSE, row_base, rows, len_q, True)
    delta = row_delta(O, o_strides, do, b, h, rows, len_q, offs_dv, DV, BLOCK_DV)
    ks, vs = (k_strides[2], k_strides[3]), (v_strides[2], v_strides[3])
    k_src = tile_source(K, slice_offset(k_strides, b, hk, k_start), ks, len_k, D, BLOCK_N, BLOCK_D, USE_TMA, K_DESC)
    v_src = tile_source(V, slice_offset(v_strides, b, hk, k_start), vs, len_k, DV, BLOCK_N, BLOCK_DV, USE_TMA, V_DESC)
    mask_base, ms = head_slice(MASK, mask_strides, b, h)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, full_lo, full_hi, hi = tile_segments(
        m0, tl.minimum(m0 + BLOCK_M, len_q), len_q, len_k, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    if HAS_PREFIX:
        lo, full_lo, full_hi, hi = with_prefix_keys((lo, full_lo, full_hi, hi), mods[2], len_k, BLOCK_N)
    if HAS_SEGMENTS:
        lo, full_lo, full_hi, hi = with_segment_tiles((lo, full_lo, full_hi, hi), SEG_RANGES, b, m0 // BLOCK_M,
                                                      num_row_tiles)
    # Masked edge tiles, full tiles (no per-element test), masked diagonal / tail tiles.
    dq = dq_segment(
        dq, q, do, lse2, delta, k_src, v_src, ks, vs, lo, full_lo, rows, offs_n, offs_d, offs_dv,
        len_q, len_k, left, right, scale_log2, mask_base, ms, seed, dropout_p, keep_scale, drop_base,
        drop_cols, mods, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT, MASK_KIND, DROPOUT, USE_TMA,
        DOT_PRECISION, HAS_SOFTCAP, HAS_ALIBI, HAS_PREFIX, HAS_SEGMENTS,
    )
    dq = dq_segment(
        dq, q, do, lse2, delta, k_src, v_src, ks, vs, full_lo, full_hi, rows, offs_n, offs_d,
        offs_dv, len_q, len_k, left, right, scale_log2, mask_base, ms, seed, dropout_p, keep_scale,
        drop_base, drop_cols, mods, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, HAS_LEFT, HAS_RIGHT, MASK_KIND, DROPOUT,
        USE_TMA, DOT_PRECISION, HAS_SOFTCAP, HAS_ALIBI, HAS_PREFIX, HAS_SEGMENTS,
    )
    dq = dq_segment(
        dq, q, do, lse2, delta, k_src, v_src, ks, vs, full_hi, hi, rows, offs_n, offs_d, offs_dv,
        len_q, len_k, left, right, scale_log2, mask_base, ms, seed, dropout_p, keep_scale, drop_base,
        drop_cols, mods, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT, MASK_KIND, DROPOUT, USE_TMA,
        DOT_PRECISION, HAS_SOFTCAP, HAS_ALIBI, HAS_PREFIX, HAS_SEGMENTS,
    )
    dq_ptrs = head_tile_pointers(DQ, dq_strides, b, h, rows, offs_d)
    dq = dq * scale
    if ACCUMULATE:
        dq += load_tile(dq_ptrs, rows, len_q, offs_d, D, BLOCK_D, True)
    store_tile(dq_ptrs, dq, rows, len_q, offs_d, D)
