"""The fused backward kernels: delta preprocess, dK/dV, dQ. Deterministic: no atomics by default.

With P = exp(S - lse) recomputed tile by tile from the saved lse (base 2
inside), Z = keep / (1 - p) the dropout factor and delta = rowsum(dO * O):

    dV = (P Z)^T dO,   dS = P * ((dO V^T) Z - delta),   dQ = scale dS K,   dK = scale dS^T Q

`attention_dkdv_kernel` owns BLOCK_N keys of one (batch, K/V head) and sweeps
the query tiles of every query head of its group (GQA sums there, in a fixed
order). `attention_dq_kernel` owns BLOCK_M queries of one (batch, query head)
and sweeps their key tiles. Both walk only the tiles the band allows, split
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

from .tiles import (
    LOG2E, dropout_keep, load_tile, masked_scores, query_row_tile, row_pointers, store_tile, tile_segments,
)


@triton.jit
def attention_delta_kernel(
    O, DO, DELTA, o_strides, do_strides, heads_q, len_q, num_row_tiles,
    DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """delta = rowsum(O * dO) in float32 into contiguous (B, Hq, Nq). Grid: (num_row_tiles * B * Hq,)."""
    pid = tl.program_id(0)
    bh = pid // num_row_tiles
    rows = (pid % num_row_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    b = (bh // heads_q).to(tl.int64)
    h = (bh % heads_q).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    r64 = rows[:, None].to(tl.int64)
    o = load_tile(O + b * o_strides[0] + h * o_strides[1] + r64 * o_strides[2] + offs_dv[None, :] * o_strides[3],
                  rows, len_q, offs_dv, DV, BLOCK_DV, True)
    do = load_tile(DO + b * do_strides[0] + h * do_strides[1] + r64 * do_strides[2] + offs_dv[None, :] * do_strides[3],
                   rows, len_q, offs_dv, DV, BLOCK_DV, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * len_q + rows, delta, mask=rows < len_q)


@triton.jit
def load_row_stats(LSE, DELTA, row_base, rows, len_q, CHECK_ROWS: tl.constexpr):
    """(lse in base 2 with -inf -> +inf, delta) for `rows`; row_base = (b*Hq + h)*Nq."""
    if CHECK_ROWS:
        lse = tl.load(LSE + row_base + rows, mask=rows < len_q, other=float("-inf"))
        delta = tl.load(DELTA + row_base + rows, mask=rows < len_q, other=0.0)
    else:
        lse = tl.load(LSE + row_base + rows)
        delta = tl.load(DELTA + row_base + rows)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    return lse2, delta


@triton.jit
def dkdv_segment(
    dk, dv, k, v, q_src, do_src, q_strides, do_strides, LSE, DELTA, DQ_ACC, dq_strides,
    tile_lo, tile_hi, cols, offs_m, offs_d, offs_dv, len_q, len_k, left, right, scale_log2,
    mask_base, mask_strides, seed, dropout_p, keep_scale, row_base,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, CHECK_BAND: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    """Add the query tiles [tile_lo, tile_hi) of one query head into (dk, dv) (dk unscaled)."""
    if not USE_TMA:
        q_ptrs, q_step = row_pointers(q_src, q_strides, tile_lo, BLOCK_M, offs_m, offs_d)
        do_ptrs, do_step = row_pointers(do_src, do_strides, tile_lo, BLOCK_M, offs_m, offs_dv)
    for tile in tl.range(tile_lo, tile_hi):
        m0 = tile * BLOCK_M
        rows = m0 + offs_m
        if USE_TMA:
            q = q_src.load([m0, 0])
            do = do_src.load([m0, 0])
        else:
            q = load_tile(q_ptrs, rows, len_q, offs_d, D, BLOCK_D, CHECK_BAND)
            do = load_tile(do_ptrs, rows, len_q, offs_dv, DV, BLOCK_DV, CHECK_BAND)
        lse2, delta = load_row_stats(LSE, DELTA, row_base, rows, len_q, CHECK_BAND)
        if DOT_PRECISION == "ieee":
            # fp32: the forward's operand order, so a dot whose rounding depends on it (the
            # interpreter's BLAS) gives back the forward's scores and P's largest terms stay exact.
            s2t = tl.trans(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)) * scale_log2
        else:
            s2t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * scale_log2
        if CHECK_BAND or MASK_KIND != 0:
            s2t = masked_scores(
                s2t, rows[None, :], cols[:, None], len_q, len_k, left, right, mask_base,
                mask_strides, CHECK_BAND, HAS_LEFT, HAS_RIGHT, MASK_KIND,
            )
        pt = tl.math.exp2(s2t - lse2[None, :])
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = dropout_keep(seed, dropout_p, row_base, rows[None, :], cols[:, None], len_k)
            dv = tl.dot(tl.where(keep, pt * keep_scale, 0.0).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dpt = tl.where(keep, dpt * keep_scale, 0.0)
        else:
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dst = (pt * (dpt - delta[None, :])).to(q.dtype)
        dk = tl.dot(dst, q, dk, input_precision=DOT_PRECISION)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(dst), k, input_precision=DOT_PRECISION)
            dq_ptrs = DQ_ACC + rows[:, None].to(tl.int64) * dq_strides[0] + offs_d[None, :] * dq_strides[1]
            tl.atomic_add(dq_ptrs, dq, mask=(rows[:, None] < len_q) & (offs_d[None, :] < D), sem="relaxed")
        if not USE_TMA:
            q_ptrs += q_step
            do_ptrs += do_step
    return dk, dv


@triton.jit
def dkdv_head(
    dk, dv, k, v, Q, DO, LSE, DELTA, DQ_ACC, MASK, q_strides, do_strides, dq_strides, mask_strides,
    b, h, heads_q, segments, cols, offs_m, offs_d, offs_dv, len_q, len_k, left, right,
    scale_log2, seed, dropout_p, keep_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    """Add every query tile of query head h: masked edge, full, masked diagonal / tail runs."""
    q_base = Q + b * q_strides[0] + h * q_strides[1]
    do_base = DO + b * do_strides[0] + h * do_strides[1]
    if USE_TMA:
        q_src = tl.make_tensor_descriptor(q_base, [len_q, D], [q_strides[2], 1], [BLOCK_M, BLOCK_D])
        do_src = tl.make_tensor_descriptor(do_base, [len_q, DV], [do_strides[2], 1], [BLOCK_M, BLOCK_DV])
    else:
        q_src = q_base
        do_src = do_base
    qs = (q_strides[2], q_strides[3])
    dos = (do_strides[2], do_strides[3])
    dq_base = DQ_ACC + b * dq_strides[0] + h * dq_strides[1]
    dqs = (dq_strides[2], dq_strides[3])
    mask_base = MASK + b * mask_strides[0] + h * mask_strides[1]
    ms = (mask_strides[2], mask_strides[3])
    row_base = (b * heads_q + h) * len_q
    lo, full_lo, full_hi, hi = segments
    dk, dv = dkdv_segment(
        dk, dv, k, v, q_src, do_src, qs, dos, LSE, DELTA, dq_base, dqs, lo, full_lo, cols, offs_m,
        offs_d, offs_dv, len_q, len_k, left, right, scale_log2, mask_base, ms, seed, dropout_p,
        keep_scale, row_base, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT,
        MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, ATOMIC_DQ,
    )
    dk, dv = dkdv_segment(
        dk, dv, k, v, q_src, do_src, qs, dos, LSE, DELTA, dq_base, dqs, full_lo, full_hi, cols,
        offs_m, offs_d, offs_dv, len_q, len_k, left, right, scale_log2, mask_base, ms, seed,
        dropout_p, keep_scale, row_base, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, False, HAS_LEFT,
        HAS_RIGHT, MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, ATOMIC_DQ,
    )
    dk, dv = dkdv_segment(
        dk, dv, k, v, q_src, do_src, qs, dos, LSE, DELTA, dq_base, dqs, full_hi, hi, cols, offs_m,
        offs_d, offs_dv, len_q, len_k, left, right, scale_log2, mask_base, ms, seed, dropout_p,
        keep_scale, row_base, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT,
        MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, ATOMIC_DQ,
    )
    return dk, dv


@triton.jit(do_not_specialize=["seed"])
def attention_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DVAL, DQ_ACC, MASK,
    q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides, dq_strides, mask_strides,
    heads_q, group, len_q, len_k, num_col_tiles, scale_log2, scale, left, right,
    dropout_p, keep_scale, seed,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """Grid: (num_col_tiles * B * Hk,). DK, DVAL: (B, Hk, Nk, D/Dv) in k's dtype (float32 with ACCUMULATE).

    DQ_ACC: float32 (B, Hq, Nq, D), written only with ATOMIC_DQ.
    """
    pid = tl.program_id(0)
    heads_k = heads_q // group
    bhk = pid // num_col_tiles
    n0 = (pid % num_col_tiles) * BLOCK_N
    b = (bhk // heads_k).to(tl.int64)
    hk = (bhk % heads_k).to(tl.int64)
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    c64 = cols[:, None].to(tl.int64)
    k = load_tile(K + b * k_strides[0] + hk * k_strides[1] + c64 * k_strides[2] + offs_d[None, :] * k_strides[3],
                  cols, len_k, offs_d, D, BLOCK_D, True)
    v = load_tile(V + b * v_strides[0] + hk * v_strides[1] + c64 * v_strides[2] + offs_dv[None, :] * v_strides[3],
                  cols, len_k, offs_dv, DV, BLOCK_DV, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, full_lo, full_hi, hi = tile_segments(
        n0, tl.minimum(n0 + BLOCK_N, len_k), len_k, len_q, right, left, BLOCK_M, HAS_RIGHT, HAS_LEFT
    )
    full_hi = tl.where(n0 + BLOCK_N <= len_k, full_hi, full_lo)  # a ragged key tile is masked throughout
    for g in range(0, group):
        dk, dv = dkdv_head(
            dk, dv, k, v, Q, DO, LSE, DELTA, DQ_ACC, MASK, q_strides, do_strides, dq_strides,
            mask_strides, b, hk * group + g, heads_q, (lo, full_lo, full_hi, hi), cols, offs_m,
            offs_d, offs_dv, len_q, len_k, left, right, scale_log2, seed, dropout_p, keep_scale,
            D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, HAS_LEFT, HAS_RIGHT, MASK_KIND, DROPOUT, USE_TMA,
            DOT_PRECISION, ATOMIC_DQ,
        )
    dk_ptrs = DK + b * dk_strides[0] + hk * dk_strides[1] + c64 * dk_strides[2] + offs_d[None, :] * dk_strides[3]
    dv_ptrs = DVAL + b * dv_strides[0] + hk * dv_strides[1] + c64 * dv_strides[2] + offs_dv[None, :] * dv_strides[3]
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
    mask_base, mask_strides, seed, dropout_p, keep_scale, row_base,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, CHECK_BAND: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Add the key tiles [tile_lo, tile_hi) into dq (unscaled)."""
    if not USE_TMA:
        k_ptrs, k_step = row_pointers(k_src, k_strides, tile_lo, BLOCK_N, offs_n, offs_d)
        v_ptrs, v_step = row_pointers(v_src, v_strides, tile_lo, BLOCK_N, offs_n, offs_dv)
    for tile in tl.range(tile_lo, tile_hi):
        n0 = tile * BLOCK_N
        cols = n0 + offs_n
        if USE_TMA:
            k = k_src.load([n0, 0])
            v = v_src.load([n0, 0])
        else:
            k = load_tile(k_ptrs, cols, len_k, offs_d, D, BLOCK_D, CHECK_BAND)
            v = load_tile(v_ptrs, cols, len_k, offs_dv, DV, BLOCK_DV, CHECK_BAND)
        s2 = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if CHECK_BAND or MASK_KIND != 0:
            s2 = masked_scores(
                s2, rows[:, None], cols[None, :], len_q, len_k, left, right, mask_base,
                mask_strides, CHECK_BAND, HAS_LEFT, HAS_RIGHT, MASK_KIND,
            )
        p = tl.math.exp2(s2 - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = dropout_keep(seed, dropout_p, row_base, rows[:, None], cols[None, :], len_k)
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        if not USE_TMA:
            k_ptrs += k_step
            v_ptrs += v_step
    return dq


@triton.jit(do_not_specialize=["seed"])
def attention_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, MASK,
    q_strides, k_strides, v_strides, do_strides, dq_strides, mask_strides,
    heads_q, group, len_q, len_k, num_row_tiles, scale_log2, scale, left, right,
    dropout_p, keep_scale, seed,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
    HEAVY_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """Grid: (num_row_tiles * B * Hq,). DQ: (B, Hq, Nq, D) in q's dtype (float32 with ACCUMULATE)."""
    b, h, hk, m0 = query_row_tile(tl.program_id(0), num_row_tiles, heads_q, group, BLOCK_M, HEAVY_FIRST)
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    r64 = rows[:, None].to(tl.int64)
    q = load_tile(Q + b * q_strides[0] + h * q_strides[1] + r64 * q_strides[2] + offs_d[None, :] * q_strides[3],
                  rows, len_q, offs_d, D, BLOCK_D, True)
    do = load_tile(DO + b * do_strides[0] + h * do_strides[1] + r64 * do_strides[2] + offs_dv[None, :] * do_strides[3],
                   rows, len_q, offs_dv, DV, BLOCK_DV, True)
    row_base = (b * heads_q + h) * len_q
    lse2, delta = load_row_stats(LSE, DELTA, row_base, rows, len_q, True)
    k_base = K + b * k_strides[0] + hk * k_strides[1]
    v_base = V + b * v_strides[0] + hk * v_strides[1]
    if USE_TMA:
        k_src = tl.make_tensor_descriptor(k_base, [len_k, D], [k_strides[2], 1], [BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_base, [len_k, DV], [v_strides[2], 1], [BLOCK_N, BLOCK_DV])
    else:
        k_src = k_base
        v_src = v_base
    ks = (k_strides[2], k_strides[3])
    vs = (v_strides[2], v_strides[3])
    mask_base = MASK + b * mask_strides[0] + h * mask_strides[1]
    ms = (mask_strides[2], mask_strides[3])
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, full_lo, full_hi, hi = tile_segments(
        m0, tl.minimum(m0 + BLOCK_M, len_q), len_q, len_k, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    # Masked edge tiles, full tiles (no per-element test), masked diagonal / tail tiles.
    dq = dq_segment(
        dq, q, do, lse2, delta, k_src, v_src, ks, vs, lo, full_lo, rows, offs_n, offs_d, offs_dv,
        len_q, len_k, left, right, scale_log2, mask_base, ms, seed, dropout_p, keep_scale, row_base,
        D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT, MASK_KIND, DROPOUT, USE_TMA,
        DOT_PRECISION,
    )
    dq = dq_segment(
        dq, q, do, lse2, delta, k_src, v_src, ks, vs, full_lo, full_hi, rows, offs_n, offs_d,
        offs_dv, len_q, len_k, left, right, scale_log2, mask_base, ms, seed, dropout_p, keep_scale,
        row_base, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, HAS_LEFT, HAS_RIGHT, MASK_KIND, DROPOUT,
        USE_TMA, DOT_PRECISION,
    )
    dq = dq_segment(
        dq, q, do, lse2, delta, k_src, v_src, ks, vs, full_hi, hi, rows, offs_n, offs_d, offs_dv,
        len_q, len_k, left, right, scale_log2, mask_base, ms, seed, dropout_p, keep_scale, row_base,
        D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT, MASK_KIND, DROPOUT, USE_TMA,
        DOT_PRECISION,
    )
    dq_ptrs = DQ + b * dq_strides[0] + h * dq_strides[1] + r64 * dq_strides[2] + offs_d[None, :] * dq_strides[3]
    dq = dq * scale
    if ACCUMULATE:
        dq += load_tile(dq_ptrs, rows, len_q, offs_d, D, BLOCK_D, True)
    store_tile(dq_ptrs, dq, rows, len_q, offs_d, D)
