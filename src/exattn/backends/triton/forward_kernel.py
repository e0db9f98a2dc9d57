"""The fused forward kernel: one pass over K/V per query tile, (acc, m, l) on chip.

Each program owns BLOCK_M query rows of one (batch, query head). It walks the
key tiles the band allows (tiles.tile_segments): masked edge tiles, then the
full tiles with no per-element test, then the masked diagonal / tail tiles,
folding each into the running summary exactly as `exattn.algebra.merge`
does (max, rescale by exp2(m_old - m_new), add), in base 2 with
scale * log2(e) folded into the scores. The epilogue is `algebra.finalize`:
out = acc / l, lse = (m + log2 l) * ln 2, and a row with l = 0 gives 0 and -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .configs import COUNTS
from .tile_io import (
    head_slice, load_source_tile, load_tile, slice_offset, store_tile, tile_pointers, tile_source, tile_walk,
)
from .tiles import (
    LOG2E, add_sink, dropout_keep, finalize, query_row_tile, row_slope, rule_masked_scores, score_mods,
    sequence_prefix, segment_ids, sequence_span, tile_segments, with_prefix_keys, with_segment_tiles,
)


@triton.jit
def forward_segment(
    acc, m_i, l_i, q, k_src, v_src, k_strides, v_strides, tile_lo, tile_hi,
    rows, offs_n, offs_d, offs_dv, len_q, len_k, left, right, scale_log2,
    mask_base, mask_strides, seed, dropout_p, keep_scale, drop_base, drop_cols, mods,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, CHECK_BAND: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
):
    """Fold key tiles [tile_lo, tile_hi) into (acc, m_i, l_i); CHECK_BAND masks every element."""
    k_at, k_step = tile_walk(k_src, k_strides, tile_lo, BLOCK_N, offs_n, offs_d, USE_TMA)
    v_at, v_step = tile_walk(v_src, v_strides, tile_lo, BLOCK_N, offs_n, offs_dv, USE_TMA)
    for tile in tl.range(tile_lo, tile_hi, warp_specialize=WARP_SPECIALIZE):
        n0 = tile * BLOCK_N
        cols = n0 + offs_n
        k = load_source_tile(k_at, n0, cols, len_k, offs_d, D, BLOCK_D, CHECK_BAND, USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if CHECK_BAND or MASK_KIND != 0 or HAS_SOFTCAP or HAS_ALIBI:
            s2, _ = score_mods(qk * scale_log2, rows[:, None], cols[None, :], len_q, len_k, mods, HAS_SOFTCAP,
                               HAS_ALIBI)
            s2 = rule_masked_scores(s2, rows, cols, len_q, len_k, left, right, mask_base, mask_strides, mods,
                                    CHECK_BAND, HAS_LEFT, HAS_RIGHT, MASK_KIND, HAS_PREFIX, HAS_SEGMENTS, False)
            m_new = tl.maximum(m_i, tl.max(s2, 1))
            # A row with no allowed key so far shifts by 0 but keeps m = -inf, so that its later keys
            # are shifted by their own maximum (a shift of 0 would underflow very negative scores).
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s2 - m_shift[:, None])
        else:
            # Unmasked tile: max commutes with the positive scale, so the scaling
            # and the shift are one fused multiply-add per score.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
            m_shift = m_new
            p = tl.math.exp2(qk * scale_log2 - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = dropout_keep(seed, dropout_p, drop_base, rows[:, None], cols[None, :], drop_cols)
            p = tl.where(keep, p * keep_scale, 0.0)
        v = load_source_tile(v_at, n0, cols, len_k, offs_dv, DV, BLOCK_DV, CHECK_BAND, USE_TMA)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
        if not USE_TMA:
            k_at += k_step
            v_at += v_step
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["seed", *COUNTS])
def attention_forward_kernel(
    Q, K, V, O, LSE, MASK, CU_Q, CU_K, SINKS, ALIBI, PREFIX, SEG_Q, SEG_K, SEG_RANGES, Q_DESC, K_DESC, V_DESC,
    q_strides, k_strides, v_strides, o_strides,
    mask_strides, alibi_strides, seg_q_strides, seg_k_strides, heads_q, group, len_q, len_k, num_row_tiles, lse_head_stride, softcap2,
    scale_log2, left, right, dropout_p, keep_scale, seed, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
    HEAVY_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    VARLEN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_PREFIX: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
):
    """Grid: (num_row_tiles * B * Hq,). Strides are (batch, head, row, col) tuples.

    O: (B, Hq, Nq, Dv) in q's dtype; LSE: contiguous (B, Hq, Nq) float32, natural log.
    VARLEN: b is a packed sequence, rows CU_Q[b]:CU_Q[b+1] of Q and O (batch strides 0) and
    CU_K[b]:CU_K[b+1] of K and V; len_q, len_k are the longest lengths (the dropout grid's),
    and LSE is (Hq, total_q) with head stride lse_head_stride. Score rules: softcap2 = softcap * log2 e
    (HAS_SOFTCAP), ALiBi slopes at ALIBI with (batch, head) strides (HAS_ALIBI), one sink logit a query
    head at SINKS (HAS_SINKS). Q_DESC, K_DESC, V_DESC: the host's descriptors with USE_TMA = 2 (`tile_io`).
    """
    b, h, hk, m0 = query_row_tile(tl.program_id(0), num_row_tiles, heads_q, group, BLOCK_M, HEAVY_FIRST)
    drop_rows = len_q
    drop_cols = len_k
    q_start = 0
    k_start = 0
    if VARLEN:
        q_start, len_q = sequence_span(CU_Q, b)
        k_start, len_k = sequence_span(CU_K, b)
        if m0 >= len_q:
            return
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_rc = (q_strides[2], q_strides[3])
    kv_strides = (k_strides[2], k_strides[3])
    vv_strides = (v_strides[2], v_strides[3])
    q_offset = slice_offset(q_strides, b, h, q_start)
    if USE_TMA:
        q_src = tile_source(Q, q_offset, q_rc, len_q, D, BLOCK_M, BLOCK_D, USE_TMA, Q_DESC)
        q = load_source_tile(q_src, m0, rows, len_q, offs_d, D, BLOCK_D, True, USE_TMA)
    else:
        q = load_tile(tile_pointers(Q + q_offset, q_rc, rows, offs_d), rows, len_q, offs_d, D, BLOCK_D, True)
    k_src = tile_source(K, slice_offset(k_strides, b, hk, k_start), kv_strides, len_k, D, BLOCK_N, BLOCK_D, USE_TMA,
                        K_DESC)
    v_src = tile_source(V, slice_offset(v_strides, b, hk, k_start), vv_strides, len_k, DV, BLOCK_N, BLOCK_DV, USE_TMA,
                        V_DESC)
    mask_base, mask_rc = head_slice(MASK, mask_strides, b, h)
    drop_base = (b * heads_q + h) * drop_rows
    mods = (softcap2, row_slope(ALIBI, alibi_strides, b, h, HAS_ALIBI), sequence_prefix(PREFIX, b, HAS_PREFIX),
            segment_ids(SEG_Q, seg_q_strides, b, rows, len_q, -1, HAS_SEGMENTS), SEG_K + b * seg_k_strides[0],
            seg_k_strides[1])

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    row_stop = tl.minimum(m0 + BLOCK_M, len_q)
    lo, full_lo, full_hi, hi = tile_segments(
        m0, row_stop, len_q, len_k, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    if HAS_PREFIX:
        lo, full_lo, full_hi, hi = with_prefix_keys((lo, full_lo, full_hi, hi), mods[2], len_k, BLOCK_N)
    if HAS_SEGMENTS:
        lo, full_lo, full_hi, hi = with_segment_tiles((lo, full_lo, full_hi, hi), SEG_RANGES, b, m0 // BLOCK_M,
                                                      num_row_tiles)
    if WARP_SPECIALIZE:
        # One loop only (the compiler's warp specialization needs it): every tile masked.
        acc, m_i, l_i = forward_segment(
            acc, m_i, l_i, q, k_src, v_src, kv_strides, vv_strides, lo, hi, rows, offs_n, offs_d,
            offs_dv, len_q, len_k, left, right, scale_log2, mask_base, mask_rc, seed, dropout_p,
            keep_scale, drop_base, drop_cols, mods, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT,
            MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, True, HAS_SOFTCAP, HAS_ALIBI, HAS_PREFIX, HAS_SEGMENTS,
        )
    else:
        acc, m_i, l_i = forward_segment(
            acc, m_i, l_i, q, k_src, v_src, kv_strides, vv_strides, lo, full_lo, rows, offs_n, offs_d,
            offs_dv, len_q, len_k, left, right, scale_log2, mask_base, mask_rc, seed, dropout_p,
            keep_scale, drop_base, drop_cols, mods, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT,
            MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, False, HAS_SOFTCAP, HAS_ALIBI, HAS_PREFIX, HAS_SEGMENTS,
        )
        acc, m_i, l_i = forward_segment(
            acc, m_i, l_i, q, k_src, v_src, kv_strides, vv_strides, full_lo, full_hi, rows, offs_n,
            offs_d, offs_dv, len_q, len_k, left, right, scale_log2, mask_base, mask_rc, seed,
            dropout_p, keep_scale, drop_base, drop_cols, mods, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, HAS_LEFT,
            HAS_RIGHT, MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, False, HAS_SOFTCAP, HAS_ALIBI, HAS_PREFIX, HAS_SEGMENTS,
        )
        acc, m_i, l_i = forward_segment(
            acc, m_i, l_i, q, k_src, v_src, kv_strides, vv_strides, full_hi, hi, rows, offs_n, offs_d,
            offs_dv, len_q, len_k, left, right, scale_log2, mask_base, mask_rc, seed, dropout_p,
            keep_scale, drop_base, drop_cols, mods, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT,
            MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, False, HAS_SOFTCAP, HAS_ALIBI, HAS_PREFIX, HAS_SEGMENTS,
        )

    if HAS_SINKS:
        acc, m_i, l_i = add_sink(acc, m_i, l_i, tl.load(SINKS + h).to(tl.float32) * LOG2E)
    out, lse = finalize(acc, m_i, l_i)
    o_base, o_rc = head_slice(O, o_strides, b, h)
    if VARLEN:
        o_base += q_start * o_rc[0]
    store_tile(tile_pointers(o_base, o_rc, rows, offs_dv), out, rows, len_q, offs_dv, DV)
    if VARLEN:
        lse_at = LSE + h * lse_head_stride + q_start + rows
    else:
        lse_at = LSE + (b * heads_q + h) * len_q + rows
    tl.store(lse_at, lse, mask=rows < len_q)
