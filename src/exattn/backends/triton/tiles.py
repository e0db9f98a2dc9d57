"""What one score tile may see, inside a kernel: the mirror of `exattn.masks` and `exattn.dropout`.

Scores are kept in base 2 (`s2 = q.k * scale * log2(e)`, bias * log2(e)), so
the kernels use `exp2`; every lse that leaves a kernel is natural log.

`tile_segments` splits the tiles of the other axis that the band allows into
three runs: `[lo, full_lo)` and `[full_hi, hi)` need element masks (band
edges, the diagonal, a ragged tail), `[full_lo, full_hi)` are entirely
allowed and run without any per-element test. Rows and columns may be laid
out either way round: every helper takes broadcastable `rows`/`cols`.
`finalize` is the epilogue of the kernels that keep (acc, m, l) summaries.
Where tiles lie in memory and how they are loaded is `tile_io`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .segment_tables import RANGE_FIELDS

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def cdiv(a, b: tl.constexpr):
    return (a + b - 1) // b


@triton.jit
def query_row_tile(pid, num_row_tiles, heads_q, group, BLOCK_M: tl.constexpr, HEAVY_FIRST: tl.constexpr):
    """(b, h, hk, m0) of program pid of a (num_row_tiles * B * Hq,) grid over query row tiles,
    b and h as int64; HEAVY_FIRST: each head's tiles in reverse (causal: most keys first)."""
    bh = pid // num_row_tiles
    tile_m = pid % num_row_tiles
    if HEAVY_FIRST:
        tile_m = num_row_tiles - 1 - tile_m
    b = (bh // heads_q).to(tl.int64)
    h = (bh % heads_q).to(tl.int64)
    return b, h, h // group, tile_m * BLOCK_M


@triton.jit
def sequence_span(CU, b):
    """(start, length) of packed sequence b, rows CU[b] : CU[b + 1] of int32 offsets; start as int64."""
    start = tl.load(CU + b)
    return start.to(tl.int64), tl.load(CU + b + 1) - start


@triton.jit
def tile_segments(
    start, stop, len_a, len_b, before, after,
    BLOCK: tl.constexpr, HAS_BEFORE: tl.constexpr, HAS_AFTER: tl.constexpr,
):
    """Tiles of axis b (length len_b, tiles of BLOCK) that items [start, stop) of axis a may see.

    Item i of a sees j of b iff i + off - before <= j <= i + off + after with
    off = len_b - len_a (`before`/`after` unbounded unless HAS_*). For query rows
    against keys pass (len_q, len_k, left, right); for key columns against query
    rows pass (len_k, len_q, right, left). Returns tile indices
    lo <= full_lo <= full_hi <= hi; tiles in [full_lo, full_hi) are allowed for
    every pair and lie inside len_b.
    """
    off = len_b - len_a
    last = stop - 1
    lo_item = 0
    hi_item = len_b
    full_lo = 0
    full_hi = len_b // BLOCK
    if HAS_BEFORE:
        lo_item = tl.maximum(start + off - before, 0)
        full_lo = cdiv(tl.maximum(last + off - before, 0), BLOCK)
    if HAS_AFTER:
        hi_item = tl.minimum(last + off + after + 1, len_b)
        full_hi = tl.minimum(full_hi, tl.maximum(start + off + after + 1, 0) // BLOCK)
    hi_item = tl.maximum(hi_item, 0)
    lo_item = tl.minimum(lo_item, hi_item)
    lo = lo_item // BLOCK
    hi = cdiv(hi_item, BLOCK)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def band_allows(rows, cols, len_q, len_k, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Bool tile: query `rows` and key `cols` exist and the key lies in the band of the query (broadcastable)."""
    allowed = (cols < len_k) & (rows < len_q)
    diag = rows + (len_k - len_q)
    if HAS_LEFT:
        allowed = allowed & (cols >= diag - left)
    if HAS_RIGHT:
        allowed = allowed & (cols <= diag + right)
    return allowed


@triton.jit
def tanh(x):
    """tanh from exp2 alone (the interpreter has no libdevice): its Taylor series to x^9 below |x| = 0.3
    (relative error < 6e-8), else 1 - 2 / (e^{2x} + 1); +-1 at +-inf, NaN stays NaN."""
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    far = 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)
    return tl.where(tl.abs(x) < 0.3, series, far)


@triton.jit
def score_mods(s2, rows, cols, len_q, len_k, mods, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Base-2 scores after softcap, then ALiBi (the SPEC's order), and d(capped)/d(raw) = 1 - tanh^2
    for the backward (1.0 without softcap). mods: the kernels' rule values, (softcap * log2 e,
    slope * log2 e, prefix, the fixed side's segment ids, the streamed side's ids pointer and stride)."""
    softcap2, slope2 = mods[0], mods[1]
    dcap = 1.0
    if HAS_SOFTCAP:
        capped = tanh(s2 / softcap2)
        dcap = 1.0 - capped * capped
        s2 = softcap2 * capped
    if HAS_ALIBI:
        s2 = s2 - slope2 * tl.abs(rows + (len_k - len_q) - cols).to(tl.float32)
    return s2, dcap


@triton.jit
def row_slope(ALIBI, alibi_strides, b, h, HAS_ALIBI: tl.constexpr):
    """ALiBi's slope of (b, h) times log2 e (0.0 without ALiBi)."""
    if HAS_ALIBI:
        return tl.load(ALIBI + b * alibi_strides[0] + h * alibi_strides[1]).to(tl.float32) * LOG2E
    else:
        return 0.0


@triton.jit
def sequence_prefix(PREFIX, b, HAS_PREFIX: tl.constexpr):
    """prefix[b] (0 without HAS_PREFIX): keys below it are allowed to every query of sequence b."""
    if HAS_PREFIX:
        return tl.load(PREFIX + b)
    else:
        return 0


@triton.jit
def add_sink(acc, m2, l, sink2):
    """Fold the virtual sink key (logit sink2 in base 2, value 0) into a running summary, as
    `exattn.algebra.merge` with the summary (sink2, 1, 0): a row with no allowed key ends at (sink2, 1, 0)."""
    m_new = tl.maximum(m2, sink2)
    alpha = tl.math.exp2(m2 - m_new)
    return acc * alpha[:, None], m_new, l * alpha + tl.math.exp2(sink2 - m_new)


@triton.jit
def masked_scores(
    s2, rows, cols, len_q, len_k, left, right, mask_base, mask_strides,
    CHECK_BAND: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr,
    prefix=0, HAS_PREFIX: tl.constexpr = False, seg_rows=0, seg_cols=0, HAS_SEGMENTS: tl.constexpr = False,
):
    """Base-2 scores with the user mask (1 = bool, 2 = additive bias) and, if CHECK_BAND, the band applied
    (keys j < prefix allowed whatever the band says, with HAS_PREFIX).

    mask_base points at the (b, h) slice of the (B, Hq, Nq, Nk) mask view;
    mask_strides are its (row, col) strides (0 for broadcast axes).
    """
    if MASK_KIND != 0:
        inside = (rows < len_q) & (cols < len_k)
        ptrs = mask_base + rows.to(tl.int64) * mask_strides[0] + cols.to(tl.int64) * mask_strides[1]
        if MASK_KIND == 1:
            keep = tl.load(ptrs, mask=inside, other=0)
            s2 = tl.where(keep != 0, s2, float("-inf"))
        else:
            bias = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
            s2 = s2 + bias * LOG2E
    if CHECK_BAND:
        allowed = band_allows(rows, cols, len_q, len_k, left, right, HAS_LEFT, HAS_RIGHT)
        if HAS_PREFIX:
            allowed = allowed | ((cols < prefix) & (cols < len_k))
        if HAS_SEGMENTS:
            allowed = allowed & (seg_rows == seg_cols)
        s2 = tl.where(allowed, s2, float("-inf"))
    return s2


@triton.jit
def rule_masked_scores(
    s2, rows, cols, len_q, len_k, left, right, mask_base, mask_strides, mods,
    CHECK_BAND: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_PREFIX: tl.constexpr, HAS_SEGMENTS: tl.constexpr, KEYS_FIXED: tl.constexpr,
):
    """`masked_scores` of a tile of query positions `rows` by key positions `cols` (1-D each) with the
    rules in `mods` (`score_mods`): the tile is (rows, cols), or (cols, rows) where the keys are the
    kernel's fixed side (KEYS_FIXED: the dK/dV kernel). The streamed side's segment ids are loaded here."""
    if KEYS_FIXED:
        row_pos, col_pos = rows[None, :], cols[:, None]
    else:
        row_pos, col_pos = rows[:, None], cols[None, :]
    if HAS_SEGMENTS:
        if KEYS_FIXED:
            seg_rows = tl.load(mods[4] + rows.to(tl.int64) * mods[5], mask=rows < len_q, other=-1)[None, :]
            seg_cols = mods[3][:, None]
        else:
            seg_rows = mods[3][:, None]
            seg_cols = tl.load(mods[4] + cols.to(tl.int64) * mods[5], mask=cols < len_k, other=-2)[None, :]
    else:
        seg_rows, seg_cols = 0, 0
    return masked_scores(s2, row_pos, col_pos, len_q, len_k, left, right, mask_base, mask_strides, CHECK_BAND,
                         HAS_LEFT, HAS_RIGHT, MASK_KIND, mods[2], HAS_PREFIX, seg_rows, seg_cols, HAS_SEGMENTS)


@triton.jit
def with_prefix_keys(segments, prefix, len_k, BLOCK_N: tl.constexpr):
    """A query tile's key-tile runs `tile_segments` gave, widened to the prefix keys [0, prefix):
    one masked run [lo, hi) (the band's full tiles are no longer known to be whole)."""
    lo, full_lo, full_hi, hi = segments
    lo = tl.where(prefix > 0, 0, lo)
    hi = tl.maximum(hi, cdiv(tl.minimum(prefix, len_k), BLOCK_N))
    return lo, hi, hi, hi


@triton.jit
def segment_ids(SEG, seg_strides, b, idx, n, other, HAS_SEGMENTS: tl.constexpr):
    """The segment ids of positions idx of batch entry b (`other` past n; 0 without HAS_SEGMENTS)."""
    if HAS_SEGMENTS:
        return tl.load(SEG + b * seg_strides[0] + idx.to(tl.int64) * seg_strides[1], mask=idx < n, other=other)
    else:
        return 0


@triton.jit
def with_segment_tiles(segments, RANGES, b, tile, num_tiles):
    """Runs narrowed to the tiles whose segment ids can match this tile's, the unmasked run to those
    holding its one id alone (RANGES: `segment_tile_ranges`, a row per tile)."""
    lo, full_lo, full_hi, hi = segments
    at = RANGES + (b * num_tiles + tile) * RANGE_FIELDS
    lo = tl.maximum(lo, tl.load(at))
    hi = tl.maximum(tl.minimum(hi, tl.load(at + 1)), lo)
    full_lo = tl.minimum(tl.maximum(tl.maximum(full_lo, tl.load(at + 2)), lo), hi)
    full_hi = tl.minimum(tl.maximum(tl.minimum(full_hi, tl.load(at + 3)), full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def with_prefix_rows(segments, n0, prefix, len_q, BLOCK_M: tl.constexpr):
    """A key tile's query-tile runs, widened to every query row when the tile holds prefix keys;
    one masked run."""
    lo, full_lo, full_hi, hi = segments
    sees_all = n0 < prefix
    lo = tl.where(sees_all, 0, lo)
    hi = tl.where(sees_all, cdiv(len_q, BLOCK_M), hi)
    return lo, hi, hi, hi


@triton.jit
def dropout_keep(seed, dropout_p, row_base, rows, cols, len_k):
    """Keep-mask `tl.rand(seed, ((b*Hq + h)*Nq + i)*Nk + j) >= p`; row_base = (b*Hq + h)*Nq (int64)."""
    offset = (row_base + rows.to(tl.int64)) * len_k + cols.to(tl.int64)
    return tl.rand(seed, offset) >= dropout_p


@triton.jit
def recomputed_probabilities(exponent):
    """P = exp2(s2 - lse2) recomputed in a backward pass, at most 1: the backward's scores round apart from
    the forward's (another operand order), and from |s| ~ 2^31 that gap could exceed 128 and make P
    overflow (inf, then NaN in dS). NaN propagates."""
    return tl.math.exp2(tl.minimum(exponent, 0.0, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def lse_in_base2(lse):
    """lse · log2 e, with a row of no keys (-inf) read as +inf: its scores' exp2(s2 - lse2) are all 0."""
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def finalize(acc, m2, l):
    """`exattn.algebra.finalize` of base-2 running summaries: (out, lse) = (acc / l, (m2 + log2 l) * ln 2),
    lse natural log; a row with l = 0 gives 0 and -inf (NaN counts as mass, so NaN propagates)."""
    has_mass = l != 0.0
    safe_l = tl.where(has_mass, l, 1.0)
    out = tl.where(has_mass[:, None], acc / safe_l[:, None], 0.0)
    lse = tl.where(has_mass, (m2 + tl.math.log2(safe_l)) * LN2, float("-inf"))
    return out, lse
