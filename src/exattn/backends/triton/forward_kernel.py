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

from .tiles import LN2, dropout_keep, load_tile, masked_scores, query_row_tile, row_pointers, store_tile, tile_segments


@triton.jit
def forward_segment(
    acc, m_i, l_i, q, k_src, v_src, k_strides, v_strides, tile_lo, tile_hi,
    rows, offs_n, offs_d, offs_dv, len_q, len_k, left, right, scale_log2,
    mask_base, mask_strides, seed, dropout_p, keep_scale, drop_base,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, CHECK_BAND: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """Fold key tiles [tile_lo, tile_hi) into (acc, m_i, l_i); CHECK_BAND masks every element."""
    if not USE_TMA:
        k_ptrs, k_step = row_pointers(k_src, k_strides, tile_lo, BLOCK_N, offs_n, offs_d)
        v_ptrs, v_step = row_pointers(v_src, v_strides, tile_lo, BLOCK_N, offs_n, offs_dv)
    for tile in tl.range(tile_lo, tile_hi, warp_specialize=WARP_SPECIALIZE):
        n0 = tile * BLOCK_N
        cols = n0 + offs_n
        if USE_TMA:
            k = k_src.load([n0, 0])
        else:
            k = load_tile(k_ptrs, cols, len_k, offs_d, D, BLOCK_D, CHECK_BAND)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if CHECK_BAND or MASK_KIND != 0:
            s2 = masked_scores(
                qk * scale_log2, rows[:, None], cols[None, :], len_q, len_k, left, right, mask_base,
                mask_strides, CHECK_BAND, HAS_LEFT, HAS_RIGHT, MASK_KIND,
            )
            m_new = tl.maximum(m_i, tl.max(s2, 1))
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s2 - m_new[:, None])
        else:
            # Unmasked tile: max commutes with the positive scale, so the scaling
            # and the shift are one fused multiply-add per score.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
            p = tl.math.exp2(qk * scale_log2 - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = dropout_keep(seed, dropout_p, drop_base, rows[:, None], cols[None, :], len_k)
            p = tl.where(keep, p * keep_scale, 0.0)
        if USE_TMA:
            v = v_src.load([n0, 0])
        else:
            v = load_tile(v_ptrs, cols, len_k, offs_dv, DV, BLOCK_DV, CHECK_BAND)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
        if not USE_TMA:
            k_ptrs += k_step
            v_ptrs += v_step
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["seed"])
def attention_forward_kernel(
    Q, K, V, O, LSE, MASK, q_strides, k_strides, v_strides, o_strides, mask_strides,
    heads_q, group, len_q, len_k, num_row_tiles, scale_log2, left, right, dropout_p, keep_scale, seed,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
    HEAVY_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """Grid: (num_row_tiles * B * Hq,). Strides are (batch, head, row, col) tuples.

    O: (B, Hq, Nq, Dv) in q's dtype; LSE: contiguous (B, Hq, Nq) float32, natural log.
    """
    b, h, hk, m0 = query_row_tile(tl.program_id(0), num_row_tiles, heads_q, group, BLOCK_M, HEAVY_FIRST)
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_base = Q + b * q_strides[0] + h * q_strides[1]
    k_base = K + b * k_strides[0] + hk * k_strides[1]
    v_base = V + b * v_strides[0] + hk * v_strides[1]
    if USE_TMA:
        q_desc = tl.make_tensor_descriptor(q_base, [len_q, D], [q_strides[2], 1], [BLOCK_M, BLOCK_D])
        q = q_desc.load([m0, 0])
        k_src = tl.make_tensor_descriptor(k_base, [len_k, D], [k_strides[2], 1], [BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_base, [len_k, DV], [v_strides[2], 1], [BLOCK_N, BLOCK_DV])
    else:
        q_ptrs = q_base + rows[:, None].to(tl.int64) * q_strides[2] + offs_d[None, :] * q_strides[3]
        q = load_tile(q_ptrs, rows, len_q, offs_d, D, BLOCK_D, True)
        k_src = k_base
        v_src = v_base
    kv_strides = (k_strides[2], k_strides[3])
    vv_strides = (v_strides[2], v_strides[3])
    mask_base = MASK + b * mask_strides[0] + h * mask_strides[1]
    mask_rc = (mask_strides[2], mask_strides[3])
    drop_base = (b * heads_q + h) * len_q

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    row_stop = tl.minimum(m0 + BLOCK_M, len_q)
    lo, full_lo, full_hi, hi = tile_segments(
        m0, row_stop, len_q, len_k, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    if WARP_SPECIALIZE:
        # One loop only (the compiler's warp specialization needs it): every tile masked.
        acc, m_i, l_i = forward_segment(
            acc, m_i, l_i, q, k_src, v_src, kv_strides, vv_strides, lo, hi, rows, offs_n, offs_d,
            offs_dv, len_q, len_k, left, right, scale_log2, mask_base, mask_rc, seed, dropout_p,
            keep_scale, drop_base, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT,
            MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, True,
        )
    else:
        acc, m_i, l_i = forward_segment(
            acc, m_i, l_i, q, k_src, v_src, kv_strides, vv_strides, lo, full_lo, rows, offs_n, offs_d,
            offs_dv, len_q, len_k, left, right, scale_log2, mask_base, mask_rc, seed, dropout_p,
            keep_scale, drop_base, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT,
            MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, False,
        )
        acc, m_i, l_i = forward_segment(
            acc, m_i, l_i, q, k_src, v_src, kv_strides, vv_strides, full_lo, full_hi, rows, offs_n,
            offs_d, offs_dv, len_q, len_k, left, right, scale_log2, mask_base, mask_rc, seed,
            dropout_p, keep_scale, drop_base, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, HAS_LEFT,
            HAS_RIGHT, MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, False,
        )
        acc, m_i, l_i = forward_segment(
            acc, m_i, l_i, q, k_src, v_src, kv_strides, vv_strides, full_hi, hi, rows, offs_n, offs_d,
            offs_dv, len_q, len_k, left, right, scale_log2, mask_base, mask_rc, seed, dropout_p,
            keep_scale, drop_base, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT,
            MASK_KIND, DROPOUT, USE_TMA, DOT_PRECISION, False,
        )

    has_mass = l_i != 0.0  # NaN counts as mass, so NaN propagates
    safe_l = tl.where(has_mass, l_i, 1.0)
    out = tl.where(has_mass[:, None], acc / safe_l[:, None], 0.0)
    lse = tl.where(has_mass, (m_i + tl.math.log2(safe_l)) * LN2, float("-inf"))
    o_ptrs = (O + b * o_strides[0] + h * o_strides[1]
              + rows[:, None].to(tl.int64) * o_strides[2] + offs_dv[None, :] * o_strides[3])
    store_tile(o_ptrs, out, rows, len_q, offs_dv, DV)
    tl.store(LSE + (b * heads_q + h) * len_q + rows, lse, mask=rows < len_q)
