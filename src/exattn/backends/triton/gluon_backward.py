"""FA3-style attention backward for Hopper (sm_90), written in Gluon.

    gluon_backward(dout, q, k, v, out, lse, params, accumulate_into=None, rules=None) -> (dq, dk, dv)
    gluon_backward_supports(q, k, v, mask, params, dout=None, rules=None) -> reasons it cannot serve

Same contract as `passes.triton_backward` for the subset it serves (that of
`gluon_forward.gluon_supports`: sm_90, fp16/bf16, D = Dv in {64, 128}, no mask,
no dropout, any window (bottom-right), every score rule, GQA, any lengths,
TMA-compatible strides, packed batches). With P = exp(S - lse) recomputed
from the saved lse (base 2 inside) and delta = rowsum(O * dO):

    dV = P^T dO,   dS = P * (dO V^T - delta),   dK = scale dS^T Q,   dQ = scale dS K

The score rules and windows other than full or causal (`backward_rule_bits`)
recompute S' as the forward does (`rule_scores`: softcap, then ALiBi) and
multiply dS by the softcap's derivative 1 - tanh^2; each sweep covers the
tiles the window, prefix and segment-id tables let meet (`query_range`,
the forward's `key_range`), and a tile applies the element mask
(`allowed_pairs`) unless all its pairs are allowed (`all_allowed`). They
take the dQ kernel (not atomic or ordered dQ). The sinks reach the backward
through lse alone.

`gluon_dkdv_kernel`: one program owns 128 keys of one (batch, K/V head) and
sweeps the query tiles that can see them, for every query head of its GQA
group in a fixed order. A producer warp loads K and V once and streams Q, dO
and their rows of lse * log2(e) and delta through TMA into a ring of `stages`
slots ("ready" / "empty" mbarriers, as in the forward); two consumer warpgroups
of 64 keys each issue S^T = K Q^T and dP^T = V dO^T as asynchronous wgmmas,
exponentiate S^T while dP^T is on the tensor cores, form dS^T, and issue
dV += P^T dO and dK += dS^T Q with P^T and dS^T from registers (the other
warpgroup's wgmmas keep the tensor cores busy meanwhile).

`gluon_dq_kernel`: one program owns 128 query rows of one (batch, query head),
two consumer warpgroups of 64 rows; the producer loads Q and dO once and
streams K and V tiles (the forward's key range: causal tiles above the
diagonal are never loaded); per tile S = Q K^T and dP = dO V^T in flight
together, P under dP, dQ += dS K with dS from registers.

The TMA descriptors are made on the host over whole (B, H, N, D) tensors
(4-D boxes, zero fill past each head's last row), so no program writes or
fences one. With `in_registers` (d = 64) K and V (dK/dV) or Q and dO (dQ) are
read once into registers and the S and dP wgmmas take them from there, which
halves those wgmmas' shared-memory reads. One Triton kernel (`row_stats_kernel`)
forms delta and the base-2 lse, padded, before the two passes (and zeroes the
ordered dQ's semaphores); a packed sequence's rows start 16-byte aligned
(`stats_start`), so the producer loads them by TMA as for a dense batch.

Atomic and ordered dQ (`dq_path`; ordered: from ORDERED_DQ_MIN_LEN, where `ordered_dq_fits`):
no dQ kernel; the dK/dV kernel's consumers stage their dQ tiles in shared
memory and its writer warp adds them by TMA reductions, for ordered dQ in a
fixed order per tile (`dq_order.py`), whose first contribution is stored
instead (the float32 dQ is not zeroed first).

Each output element has one owner or a fixed summation order: reruns are
bitwise equal. A query row with lse = -inf (it sees no key) uses
+inf, so its P and its gradients are 0. With `accumulate_into` the finished
tiles are added to the float32 tensors given (ring attention).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...problem import UNBOUNDED, AttentionParams, check_accumulators
from . import schedule
from .configs import COUNTS, ceil_div, multiprocessor_count, tma_compatible
from .dq_order import dq_rank, load_early, settle_dq, sweep_start, sweep_tile, wait_turn
from .gluon_forward import (
    ALIBI,
    CAP,
    CONSUMER_REGS,
    DESC_BATCH,
    INV_CAP,
    K_START,
    KEY_IDS,
    KEY_IDS_STRIDE,
    KEY_TILE,
    LEFT,
    LEFT_ROWS,
    LEN_K,
    LEN_Q,
    MAXNREG,
    PREFIX,
    PREFIX_KEYS,
    PRODUCER_REGS,
    Q_START,
    RIGHT_ROWS,
    ROWS,
    SEGMENTS,
    SINKS,
    SLOPE,
    SOFTCAP,
    VARLEN,
    allowed_pairs,
    as_box,
    box_layout,
    broadcast_reasons,
    causal_heads_per_group,
    column_positions,
    fast_tanh,
    first_row,
    gluon_supports,
    int_as_float,
    key_range,
    key_tiles,
    keys_left_of_diagonal,
    load_kv_ring,
    load_q,
    longest_first,
    packed_view,
    paired_cast,
    plus,
    position_segments,
    program_id_again,
    release,
    row_segments,
    rule_arguments,
    rule_bits,
    rule_scores,
    segment_full_tiles,
    tile_descriptor,
    tile_of,
    wait_ready,
    wgmma_layout,
    work_context,
    work_tile,
)
from .passes import LOG2E, float32_within, grid_of, on_device, settings
from .replay import run_kernel
from .segment_tables import RANGE_FIELDS, segment_tile_ranges
from .tiles import lse_in_base2


class GluonBackwardConfig(NamedTuple):
    """dkdv_block_m: queries per step of the dK/dV sweep, with `dkdv_stages` Q/dO slots;
    dq_block_n: keys per step of the dQ sweep, with `dq_stages` K/V slots; in_registers:
    the resident tiles (K, V; Q, dO) are register operands of the S and dP wgmmas;
    dq_slots (atomic and ordered dQ): staged float32 dQ tiles between the consumers and
    the writer warp, so the consumers run that many steps ahead of a turn that has not come;
    alternate_dq (atomic and ordered dQ): each step's whole dQ tile comes from one consumer
    warpgroup, the two taking turns, instead of a column half from each (dS is then read from
    shared memory once a step, not twice)."""

    dkdv_block_m: int
    dkdv_stages: int
    dq_block_n: int
    dq_stages: int
    in_registers: bool = False
    dq_slots: int = 2
    alternate_dq: bool = False


# d = 64: 128-key dQ steps with register operands, 1.06-1.17x the 64x4/64x4 shared-memory tiles and the
# Triton backward from 4k (bf16 / fp16, N = 4k-16k).
CONFIGS = {64: GluonBackwardConfig(64, 4, 128, 2, in_registers=True), 128: GluonBackwardConfig(64, 4, 64, 4)}
# atomic and ordered dQ (added by TMA reductions from the dK/dV kernel): the dS and float32 dQ tiles
# take the shared memory of ring slots. d = 128: 3 Q/dO slots and 1 dQ slot read 1.03-1.10x 2 and 2
# (ordered, bf16, N = 4k / 16k; 4 dQ slots at d = 64: 0.98-1.01x 2).
# d = 64, whole dQ tiles by turns against column halves (bf16 / fp16, N = 4k-16k, two rounds): ordered
# 0.99-1.04x (all but one cell above 1), atomic 0.99-1.03x; at d = 128 the whole [64, 128] float32 tile spills (80-96 B).
# Score rules, windows other than full or causal and packing (`backward_rule_bits`) take CONFIGS' 64-row
# tiles, though ptxas parks up to 216 bytes of the mask's and the softcap's registers on the stack with
# them: packing and single rules read 1.01-1.24x the 32-row tiles (H200, bf16, 16k tokens, d = 128, and
# d = 64 without softcap). Softcap with ALiBi or segment ids (200-576 bytes) reads 0.50-0.85x there,
# and at d = 64 softcap's dQ kernel parks 544 bytes with its 128-key register tiles (0.60-0.68x): those
# take RULE_CONFIGS, 32-row query tiles with the ring as many bytes deep, which compile without spills.
RULE_CONFIGS = {64: GluonBackwardConfig(32, 8, 64, 4), 128: GluonBackwardConfig(32, 8, 64, 4)}
ATOMIC_CONFIGS = {64: GluonBackwardConfig(64, 4, 0, 0, in_registers=True, alternate_dq=True),
                  128: GluonBackwardConfig(64, 3, 0, 0, dq_slots=1)}
# Query lengths from which the deterministic backward adds dQ in order in the dK/dV kernel (where it
# fits): with the writer warp 1.02-1.09x the dK/dV + dQ kernel pair at d = 64 and 128, N = 4k and 16k,
# and within 3% of atomic dQ; bf16 at 512 and 1k (two rounds) 1.09-1.21x, every cell but d = 128 causal 512
# (each path read 0.65-0.71x cuDNN in one of its two rounds there, timed with the host in the loop).
# Shorter lengths: not compared.
ORDERED_DQ_MIN_LEN = 512
# Ordered dQ under full attention without the rotation (`rotated_sweeps`) from these query lengths, per
# head dim. d = 128, against the rotated order (same process, bf16 / fp16): 2k 0.96x, 4k 0.99x / level,
# 8k 1.02x / 1.03x, 16k 1.03-1.04x / 1.03x; d = 64: 4k 0.94x, 16k level.
UNROTATED_MIN_LEN = {128: 8192}
# dK and dV stored by TMA through the K and V tiles (`grad_outputs`) for sweeps shorter than these query
# rows (Nq * Hq / Hk), per head dim, else from registers. The tile stores make ptxas spill in the d = 128
# sweep: against register stores (bf16 / fp16, two rounds), d = 128 4k 1.03-1.06x (causal 1.00-1.02x),
# 8k 0.96-0.98x (0.97-0.99x), 16k 0.94-0.97x (0.98-1.00x); d = 64 0.99-1.03x, 19 of 24 cells above 1.
TMA_GRADS_MAX_ROWS = {128: 8192}


# ---------------------------------------------------------------- shared pieces


@builtin
def async_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA: add the shared-memory tile src into tensor_desc's box at coord (cp.reduce.async.bulk)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def slice_at(ptr, strides, b, h, first_row):
    """Where row first_row of the (b, h) slice of a (B, H, N, ...) tensor with these strides starts."""
    offset = gl.to_tensor(b).to(gl.int64) * strides[0] + gl.to_tensor(h).to(gl.int64) * strides[1]
    return ptr + offset + gl.to_tensor(first_row).to(gl.int64) * strides[2]


@gluon.jit
def row_offsets(row_stride, col_stride, like, first_row, n_rows):
    """(offsets, inside) of rows first_row + [0, R) of a tensor with these strides, in the shape and layout of
    `like` (R, C); inside: the rows in [0, n_rows)."""
    R: gl.constexpr = like.shape[0]
    C: gl.constexpr = like.shape[1]
    layout: gl.constexpr = like.type.layout
    rows = first_row + gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    dims = gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    offs = (gl.expand_dims(rows.to(gl.int64) * row_stride, 1)
            + gl.expand_dims(dims.to(gl.int64) * col_stride, 0))
    return offs, gl.expand_dims((rows >= 0) & (rows < n_rows), 1) & gl.expand_dims(dims < C, 0)


@gluon.jit
def load_rows(ptr, row_stride, col_stride, like, first_row, n_rows, other):
    """Rows first_row + [0, R) of ptr (`other` outside [0, n_rows)), with the shape and layout of `like` (R, C)."""
    offs, inside = row_offsets(row_stride, col_stride, like, first_row, n_rows)
    return gl.load(ptr + offs, mask=inside, other=other)


@gluon.jit
def store_rows(ptr, row_stride, col_stride, x, first_row, n_rows, ACCUMULATE: gl.constexpr):
    """x into rows first_row + [0, R) (those in [0, n_rows)) of ptr; with ACCUMULATE added to the float32 there."""
    offs, inside = row_offsets(row_stride, col_stride, x, first_row, n_rows)
    if ACCUMULATE:
        x = x + gl.load(ptr + offs, mask=inside, other=0.0)
    gl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=inside)


@gluon.jit
def store_tile(desc, smem, x, coord):
    """x into smem, a [rows, D] tile no wgmma reads any more, then by TMA into desc's tensor at
    coord (rows past its end clipped)."""
    smem.store(paired_cast(x, smem.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, coord, as_box(smem, desc))


# ---------------------------------------------------------------- dK / dV


@gluon.jit
def query_tiles(n0, len_q, len_k, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """(lo, full, hi): keys [n0, n0 + 128) are seen by query tiles [lo, hi); [full, hi) need no mask.

    The kernel form of `masks.band_rows` for window (-1, -1) and (-1, 0).
    """
    hi = gl.cdiv(len_q, BLOCK_M)
    lo = hi * 0
    full = lo
    if CAUSAL:
        offset = len_k - len_q
        lo = gl.minimum(gl.maximum(n0 - offset, 0) // BLOCK_M, hi)
        last_key = n0 + 2 * ROWS - 1
        full = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(last_key - offset, 0), BLOCK_M), lo), hi)
    return lo, full, hi


@gluon.jit
def query_range(n0, ctx, QUERY_TILES, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, RULES: gl.constexpr):
    """[lo, hi): the query tiles that can see keys [n0, n0 + 128) under the window (CAUSAL: a right
    bound), the prefix and (SEGMENTS) the key block's row of QUERY_TILES (`backward_rule_arguments`).
    The transpose of the forward's `key_range`."""
    len_q, len_k = ctx[LEN_Q], ctx[LEN_K]
    offset = len_k - len_q
    all_tiles = gl.cdiv(len_q, BLOCK_M)
    lo = 0
    hi = all_tiles
    if CAUSAL:  # row r sees key c only if c <= r + offset + right
        lo = gl.maximum(n0 - offset - ctx[RIGHT_ROWS], 0) // BLOCK_M
    if RULES & LEFT:  # ... and c >= r + offset - left
        last_key = gl.minimum(n0 + 2 * ROWS, len_k) - 1
        hi = gl.minimum(hi, gl.cdiv(gl.maximum(last_key - offset + ctx[LEFT_ROWS] + 1, 0), BLOCK_M))
    if RULES & PREFIX:
        in_prefix = n0 < ctx[PREFIX_KEYS]
        lo = gl.where(in_prefix, 0, lo)
        hi = gl.where(in_prefix, all_tiles, hi)
    if RULES & SEGMENTS:
        lo = gl.maximum(lo, gl.load(QUERY_TILES + n0 // KEY_TILE * RANGE_FIELDS))
        hi = gl.minimum(hi, gl.load(QUERY_TILES + n0 // KEY_TILE * RANGE_FIELDS + 1))
    hi = gl.where(n0 < len_k, gl.minimum(hi, all_tiles), 0)  # a packed sequence may end before n0
    return gl.minimum(lo, hi), hi


@gluon.jit
def all_allowed(r0, k0, NR: gl.constexpr, NK: gl.constexpr, ctx, one_segment, CAUSAL: gl.constexpr,
                RULES: gl.constexpr):
    """Whether every query of [r0, r0 + NR) exists and may see every key of [k0, k0 + NK) (`allowed_pairs`
    for a whole tile; one_segment: whether (SEGMENTS) the queries and the keys all hold one id, from the
    tables' full ranges)."""
    len_q, len_k = ctx[LEN_Q], ctx[LEN_K]
    diagonal = r0 + (len_k - len_q)  # the first query's
    exists = (r0 >= 0) & (r0 + NR <= len_q) & (k0 + NK <= len_k)
    allowed = exists
    if CAUSAL:
        allowed = allowed & (k0 + NK - 1 <= diagonal + ctx[RIGHT_ROWS])
    if RULES & LEFT:
        allowed = allowed & (k0 >= diagonal + NR - 1 - ctx[LEFT_ROWS])
    if RULES & PREFIX:
        allowed = allowed | (exists & (k0 + NK <= ctx[PREFIX_KEYS]))
    if RULES & SEGMENTS:
        allowed = allowed & one_segment
    return allowed


@gluon.jit
def rule_probabilities(s, lse2, q_pos, k_pos, ctx, scale_log2, RULES: gl.constexpr):
    """P = exp2(S' * scale_log2 - lse2) from raw scores s after the rules (`rule_scores`; lse2 broadcast
    against s), and the softcap's derivative. The softcap alone multiplies tanh(s / cap) by cap * scale_log2
    at once."""
    if RULES & SOFTCAP and not RULES & ALIBI:
        capped = fast_tanh(s * ctx[INV_CAP])
        return gl.exp2(capped * (scale_log2 * ctx[CAP]) - lse2), 1.0 - capped * capped
    s, slope_of_cap = rule_scores(s, q_pos + (ctx[LEN_K] - ctx[LEN_Q]), k_pos, ctx, RULES)
    return gl.exp2(s * scale_log2 - lse2), slope_of_cap


@gluon.jit
def key_block_of(pid, num_col_tiles, heads_per_group, CAUSAL: gl.constexpr):
    """(b * Hk + hk, first key) of dK/dV program pid, in `longest_first` order (causal: the first
    keys are seen by the most query tiles)."""
    bhk, col_tile = longest_first(pid, num_col_tiles, heads_per_group, CAUSAL)
    return bhk, col_tile * (2 * ROWS)


@gluon.jit
def key_block_sweep(heads_q, num_col_tiles, heads_per_group, len_q, len_k, group, rules, scale_log2,
                    BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, ROTATE: gl.constexpr, RULES: gl.constexpr):
    """(b, hk, n0, lo, full, tiles, start, place) of this dK/dV program: keys [n0, n0 + 128) of K/V head
    (b, hk), seen by query tiles [lo, lo + tiles), [full, lo + tiles) unmasked (`query_tiles`; with
    RULES, `query_range`, and each tile decides itself); its sweep over them starts at `start`
    (`sweep_tile`); place: `sequence_place`."""
    heads_k = heads_q // group
    bhk, n0 = key_block_of(gl.program_id(0), num_col_tiles, heads_per_group, CAUSAL)
    b = bhk // heads_k
    hk = bhk % heads_k
    if RULES == 0:
        lo, full, hi = query_tiles(n0, len_q, len_k, BLOCK_M, CAUSAL)
        place = (b, 0, 0, 0)
    else:
        ctx, QUERY_TILES = key_block_context(rules, b, hk * group, len_q, len_k, scale_log2, RULES)
        lo, hi = query_range(n0, ctx, QUERY_TILES, BLOCK_M, CAUSAL, RULES)
        full = hi
        place = sequence_place(b, ctx, RULES)
    tiles = gl.maximum(hi - lo, 0)
    start = sweep_start(n0 // (2 * ROWS), num_col_tiles, tiles, ROTATE)
    return b, hk, n0, lo, full, tiles, start, place


@gluon.jit
def key_block_context(rules, b, h, len_q, len_k, scale_log2, RULES: gl.constexpr):
    """(work context, the batch entry's row of the dK/dV kernel's segment-id table) of `query_range`."""
    ctx = work_context(rules, b, h, len_q, len_k, scale_log2, RULES)
    return ctx, rules[13] + b * gl.cdiv(len_k, KEY_TILE) * RANGE_FIELDS


@gluon.jit
def later_sweeps(col_tile, last, t, ctx, QUERY_TILES, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr,
                 RULES: gl.constexpr):
    """How many of the key blocks col_tile + 1 .. last sweep query tile t (`query_range`), counted 32 blocks
    a pass by the writer warp: the rank of col_tile's contribution to t where later blocks reach a tile
    first and none after `last` (`dq_rank`'s causal bound) does."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    count = 0
    for first in range(col_tile + 1, last + 1, 32):
        blocks = first + gl.arange(0, 32, layout=layout)
        exists = blocks <= last
        lo, hi = query_range(gl.where(exists, blocks, 0) * (2 * ROWS), ctx, QUERY_TILES, BLOCK_M, CAUSAL, RULES)
        count += gl.reduce((exists & (lo <= t) & (t < hi)).to(gl.int32), 0, plus)
    return count


@gluon.jit
def sequence_place(b, ctx, RULES: gl.constexpr):
    """(descriptor batch coordinate, first query row, first key row, first row of `row_stats`) of batch
    entry b: (b, 0, 0, 0), or for a packed sequence (VARLEN) (0, its offsets, its `stats_start`)."""
    place = (b, 0, 0, 0)
    if RULES & VARLEN:
        place = (ctx[DESC_BATCH], ctx[Q_START], ctx[K_START], stats_start(ctx[Q_START], b))
    return place


@gluon.jit
def stats_start(q_start, b):
    """The first row of packed sequence b (its queries from q_start) in `row_stats`' rows."""
    return (q_start // STATS_ALIGN + b) * STATS_ALIGN


@gluon.jit
def dkdv_load_partition(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem,
                        v_smem, lse_smem, delta_smem, bars, heads_q, num_col_tiles, heads_per_group, len_q,
                        len_q_pad, len_k, group, rules, scale_log2, CAUSAL: gl.constexpr, ROTATE: gl.constexpr,
                        RULES: gl.constexpr):
    """Producer warp: K, V once; then Q, lse and dO, delta of (head g, tile t) into slot j % STAGES."""
    kv_bar, q_ready, do_ready, empty = bars
    STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    _, hk, n0, lo, _, tiles, start, place = key_block_sweep(heads_q, num_col_tiles, heads_per_group, len_q, len_k,
                                                            group, rules, scale_log2, BLOCK_M, CAUSAL, ROTATE, RULES)
    b, q_start, k_start, stats_row = place
    bh0 = b * heads_q + hk * group
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for half in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, hk, k_start + n0 + half * ROWS, 0], kv_bar,
                                        as_box(k_smem.index(half), k_desc))
        tma.async_copy_global_to_shared(v_desc, [b, hk, k_start + n0 + half * ROWS, 0], kv_bar,
                                        as_box(v_smem.index(half), v_desc))
    for j in range(group * tiles):
        g = j // tiles
        first = sweep_tile(j, lo, tiles, start, ROTATE) * BLOCK_M
        stats_at = (bh0 + g) * len_q_pad + stats_row + first
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
        ready = q_ready.index(slot)
        mbarrier.expect(ready, q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, hk * group + g, q_start + first, 0], ready,
                                        as_box(q_smem.index(slot), q_desc))
        tma.async_copy_global_to_shared(lse_desc, [stats_at], ready, lse_smem.index(slot))
        ready = do_ready.index(slot)
        mbarrier.expect(ready, do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [b, hk * group + g, q_start + first, 0], ready,
                                        as_box(do_smem.index(slot), do_desc))
        tma.async_copy_global_to_shared(delta_desc, [stats_at], ready, delta_smem.index(slot))


@gluon.jit
def issue_s_and_dp(s_a, s_b, dp_a, dp_b, s_ready, dp_ready, j, STAGES: gl.constexpr, s_layout: gl.constexpr):
    """S = s_a s_b^T and dP = dp_a dp_b^T (b: shared-memory tiles of ring slot j % STAGES) as async
    wgmmas, each issued once its slot's TMA bytes landed; returns their tokens."""
    M: gl.constexpr = s_a.shape[0]
    N: gl.constexpr = s_b.shape[0]
    wait_ready(s_ready, j, STAGES)
    s_tok = warpgroup_mma(s_a, s_b.permute((1, 0)), gl.zeros([M, N], gl.float32, s_layout), use_acc=False,
                          is_async=True)
    wait_ready(dp_ready, j, STAGES)
    dp_tok = warpgroup_mma(dp_a, dp_b.permute((1, 0)), gl.zeros([M, N], gl.float32, s_layout), use_acc=False,
                           is_async=True)
    return s_tok, dp_tok


@gluon.jit
def share_ds(ds, ds_smem, ds_ready, j, HALF: gl.constexpr):
    """This warpgroup's dS^T rows of step j into the step's buffer (two, alternating), then signal them."""
    ds_smem.index((j % 2) * 2 + HALF).store(ds)
    fence_async_shared()
    gl.thread_barrier()
    release(ds_ready, j, 2)


@gluon.jit
def issue_dq(ds_smem, ds_ready, k_smem, j, FIRST_COL: gl.constexpr, COLS: gl.constexpr, BLOCK_M: gl.constexpr):
    """Once both warpgroups shared step j's dS^T: columns [FIRST_COL, FIRST_COL + COLS) of dS K over
    all 128 keys (two async wgmmas; returns their token)."""
    acc_layout: gl.constexpr = wgmma_layout(COLS)
    wait_ready(ds_ready, j, 2)
    buffer = (j % 2) * 2
    tok = warpgroup_mma(ds_smem.index(buffer).permute((1, 0)), k_smem.index(0).slice(FIRST_COL, COLS, dim=1),
                        gl.zeros([BLOCK_M, COLS], gl.float32, acc_layout), use_acc=False, is_async=True)
    return warpgroup_mma(ds_smem.index(buffer + 1).permute((1, 0)), k_smem.index(1).slice(FIRST_COL, COLS, dim=1),
                         tok, is_async=True)


@gluon.jit
def column_halves(x):
    """[R, C] -> its columns [0, C/2) and [C/2, C), each [R, C/2]."""
    R: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1]
    return gl.split(x.reshape([R, 2, C // 2]).permute((0, 2, 1)))


@gluon.jit
def stage_dq(dq, dq_smem, dq_bars, j, HALF: gl.constexpr, WHOLE: gl.constexpr):
    """This warpgroup's [BLOCK_M, D/2] dQ tile of step j (WHOLE: both halves, [BLOCK_M, D]) into
    staging slot j % SLOTS, once the writer warp has read what the slot held, then signal it
    (`dq_writer_partition`)."""
    staged, free = dq_bars
    SLOTS: gl.constexpr = staged.shape[0]
    slot = j % SLOTS
    mbarrier.wait(free.index(slot), ((j // SLOTS) & 1) ^ 1)
    if WHOLE:
        left, right = column_halves(dq)
        dq_smem.index(slot * 2).store(left)
        dq_smem.index(slot * 2 + 1).store(right)
    else:
        dq_smem.index(slot * 2 + HALF).store(dq)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(staged.index(slot), count=1)


@gluon.jit
def write_dq_half(dq_desc, coord, half_tile, first_write):
    """TMA: store the staged half tile into dQ if first_write (the tile's first contribution in a
    fixed order: dQ need not be zeroed), else add it there."""
    if first_write:
        tma.async_copy_shared_to_global(dq_desc, coord, as_box(half_tile, dq_desc))
    else:
        async_reduce_add(dq_desc, coord, as_box(half_tile, dq_desc))


@gluon.jit
def dq_writer_partition(dq_parts, SEM, heads_q, num_col_tiles, heads_per_group, len_q, len_k, group,
                        BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, ATOMIC_DQ: gl.constexpr,
                        ROTATE: gl.constexpr, rules, scale_log2, RULES: gl.constexpr):
    """Writer warp (ATOMIC_DQ; idle otherwise): adds each staged dQ tile, both its column halves,
    into the float32 dQ by TMA reductions and frees its slot once they have read it. With SEM, one
    tile after another in the order of `dq_rank` (`dq_order.py`), with the blocks that skip a tile left
    out of it (`later_sweeps`) under segment ids or a window's left bound with a prefix. Its sweep is the
    consumers' (`key_block_sweep` under the same rules)."""
    if ATOMIC_DQ:
        dq_smem, dq_desc, dq_bars = dq_parts[3], dq_parts[4], dq_parts[6]
        staged, free = dq_bars
        SLOTS: gl.constexpr = staged.shape[0]
        COLS: gl.constexpr = dq_smem.shape[2]
        ORDERED: gl.constexpr = SEM is not None
        b, hk, n0, lo, _, tiles, start, _ = key_block_sweep(heads_q, num_col_tiles, heads_per_group, len_q, len_k,
                                                            group, rules, scale_log2, BLOCK_M, CAUSAL, ROTATE, RULES)
        row_tiles = gl.cdiv(len_q, BLOCK_M)
        COUNTED: gl.constexpr = CAUSAL and ((RULES & SEGMENTS) != 0 or (RULES & LEFT != 0 and RULES & PREFIX != 0))
        prefix_blocks = 0
        if COUNTED or RULES & PREFIX:
            ctx, QUERY_TILES = key_block_context(rules, b, hk * group, len_q, len_k, scale_log2, RULES)
            if RULES & PREFIX:
                prefix_blocks = gl.cdiv(ctx[PREFIX_KEYS], 2 * ROWS)
        col_tile = n0 // (2 * ROWS)
        for j in range(group * tiles):
            t = sweep_tile(j, lo, tiles, start, ROTATE)
            head = hk * group + j // tiles
            slot = j % SLOTS
            if ORDERED:
                semaphore = SEM + (b * heads_q + head) * row_tiles + t
                seen = load_early(semaphore)
            mbarrier.wait(staged.index(slot), (j // SLOTS) & 1)
            first_write = False
            if ORDERED:
                rank = dq_rank(col_tile, t, num_col_tiles, row_tiles, len_k - len_q, prefix_blocks, BLOCK_M, CAUSAL,
                               ROTATE)
                if COUNTED:
                    rank = later_sweeps(col_tile, col_tile + rank, t, ctx, QUERY_TILES, BLOCK_M, CAUSAL, RULES)
                wait_turn(semaphore, rank, seen)
                first_write = rank == 0
            for half in gl.static_range(2):
                write_dq_half(dq_desc, [b, head, t * BLOCK_M, half * COLS], dq_smem.index(slot * 2 + half),
                              first_write)
            tma.store_wait(0)
            gl.thread_barrier()
            mbarrier.arrive(free.index(slot), count=1)
            if ORDERED:
                settle_dq(semaphore)
        tma.store_wait(0)


@gluon.jit
def finish_step(dv_tok, dk_tok, p_op, ds_op, empty, j):
    """(dv, dk) once step j's wgmmas completed (their register operands kept until then), and its
    Q/dO slot released."""
    STAGES: gl.constexpr = empty.shape[0]
    dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
    release(empty, j, STAGES)
    return dv, dk


@gluon.jit
def add_dq(dq_parts, dv_tok, dk_tok, p_op, ds_op, empty, j, FIRST_COL: gl.constexpr, COLS: gl.constexpr,
           HALF: gl.constexpr, WHOLE: gl.constexpr):
    """`finish_step`, with columns [FIRST_COL, FIRST_COL + COLS) of step j's scale * dS K issued
    beside dV and dK and staged for the writer warp (`stage_dq`)."""
    ds_smem, ds_ready, k_smem, dq_smem, _, scale, dq_bars, _ = dq_parts
    STAGES: gl.constexpr = empty.shape[0]
    dq_tok = issue_dq(ds_smem, ds_ready, k_smem, j, FIRST_COL, COLS, ds_smem.shape[2])
    dq, dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, dv_tok, dk_tok, p_op, ds_op))
    release(empty, j, STAGES)
    stage_dq(dq * scale, dq_smem, dq_bars, j, HALF, WHOLE)
    return dv, dk


@gluon.jit
def dkdv_step(k, v, q_smem, do_smem, lse_smem, delta_smem, bars, dk, dv, diagonal, t, j, full, scale_log2,
              s_layout: gl.constexpr, op_layout: gl.constexpr, CAUSAL: gl.constexpr, IN_REGISTERS: gl.constexpr,
              dq_parts, HALF: gl.constexpr, ATOMIC_DQ: gl.constexpr, ALTERNATE_DQ: gl.constexpr, keys,
              RULES: gl.constexpr):
    """One query tile t (ring slot of step j) into keys [first, first + 64) of (dk, dv); tiles t < full
    are masked (causal diagonal = first - (Nk - Nq)); with RULES, `key_block_probabilities` (keys: its
    `key_block_rules`). Returns (dk, dv, k, v).

    ATOMIC_DQ: also stage this step's scale * dS K for the writer warp, which adds it into the float32
    dQ: this warpgroup's column half, or with ALTERNATE_DQ the whole tile on its turns (j % 2 == HALF);
    dq_parts = (ds_smem, ds_ready, k_smem, dq_smem, dq_desc, scale, dq_bars, k_free) (`gluon_dkdv_kernel`).

    k, v: this warpgroup's keys, as shared-memory tiles or (IN_REGISTERS) as register operands. Register
    operands pass through the waits of their wgmmas and come back for the next step: held only as
    loop invariants, ptxas 12.8 gives their registers to dS^T (the next S^T then read dS^T, not K).
    """
    kv_bar, q_ready, do_ready, empty = bars
    STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    ROWS_: gl.constexpr = k.shape[0]
    D: gl.constexpr = q_smem.shape[2]
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    slot = j % STAGES
    q = q_smem.index(slot)
    do = do_smem.index(slot)
    s_tok, dp_tok = issue_s_and_dp(k, q, v, do, q_ready, do_ready, j, STAGES, s_layout)
    lse2 = lse_smem.index(slot).load(col_layout)
    if IN_REGISTERS:
        s, k = warpgroup_mma_wait(1, deps=(s_tok, k))
    else:
        s = warpgroup_mma_wait(1, deps=(s_tok,))
    if RULES == 0:
        p = gl.exp2(s * scale_log2 - gl.expand_dims(lse2, 0))
        if CAUSAL:
            if t < full:  # key n is seen by query m iff n - (Nk - Nq) - t * BLOCK_M <= m - t * BLOCK_M
                rows = gl.arange(0, ROWS_, layout=gl.SliceLayout(1, s_layout))
                seen = (gl.expand_dims(rows + (diagonal - t * BLOCK_M), 1)
                        <= gl.expand_dims(gl.arange(0, BLOCK_M, layout=col_layout), 0))
                p = gl.where(seen, p, 0.0)
    else:  # P^T to its operand now, and P^T times the softcap's derivative kept for dS^T
        p, slope_of_cap = key_block_probabilities(s, lse2, t, keys, scale_log2, CAUSAL, RULES,
                                                  backward_splits_alibi(CAUSAL, RULES, D))
        p_op = gl.convert_layout(p.to(q.dtype), op_layout)
        if RULES & SOFTCAP:
            p = p * slope_of_cap
    delta = delta_smem.index(slot).load(col_layout)
    if IN_REGISTERS:
        dp, v = warpgroup_mma_wait(0, deps=(dp_tok, v))
    else:
        dp = warpgroup_mma_wait(0, deps=(dp_tok,))
    ds = (p * (dp - gl.expand_dims(delta, 0))).to(q.dtype)
    if RULES == 0:
        p_op = gl.convert_layout(p.to(q.dtype), op_layout)
    ds_op = gl.convert_layout(ds, op_layout)
    dv_tok = warpgroup_mma(p_op, do, dv, is_async=True)
    dk_tok = warpgroup_mma(ds_op, q, dk, is_async=True)
    if ATOMIC_DQ:  # dS^T goes to shared memory while dV and dK are on the tensor cores
        share_ds(ds, dq_parts[0], dq_parts[1], j, HALF)
        if ALTERNATE_DQ:  # the whole tile by one warpgroup, the two taking turns. Only the owner waits
            # for the other's dS^T; the other overwrites this buffer at step j + 2 only after its own
            # wait as owner at step j + 1, which the owner's arrival there (after this dQ) releases.
            if j % 2 == HALF:
                dv, dk = add_dq(dq_parts, dv_tok, dk_tok, p_op, ds_op, empty, j, 0, D, HALF, True)
            else:
                dv, dk = finish_step(dv_tok, dk_tok, p_op, ds_op, empty, j)
        else:
            dv, dk = add_dq(dq_parts, dv_tok, dk_tok, p_op, ds_op, empty, j, HALF * (D // 2), D // 2, HALF, False)
    else:
        dv, dk = finish_step(dv_tok, dk_tok, p_op, ds_op, empty, j)
    return dk, dv, k, v


@gluon.jit
def key_block_rules(rules, b, first, len_q, len_k, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                    RULES: gl.constexpr):
    """What `key_block_probabilities` needs of keys [first, first + 64) of batch entry b, besides the
    query head's context: (key positions, their segment ids, first, the query ids and their stride, the
    query tiles [full_lo, full_hi) of the key block's one id alone (its row of QUERY_TILES))."""
    keys = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    SEG_K, seg_k_sb, seg_k_sn = rules[10], rules[11], rules[12]
    key_ids, _ = position_segments(keys, len_k, SEG_K + b * seg_k_sb, seg_k_sn, RULES)
    SEG_Q, seg_q_sb, seg_q_sn = rules[7], rules[8], rules[9]
    query_full = (0, 0)
    if RULES & SEGMENTS:
        at = rules[13] + (b * gl.cdiv(len_k, KEY_TILE) + first // KEY_TILE) * RANGE_FIELDS
        query_full = (gl.load(at + 2), gl.load(at + 3))
    return keys, key_ids, first, SEG_Q + b * seg_q_sb, seg_q_sn, query_full


@gluon.constexpr_function
def backward_splits_alibi(causal, rules, head_dim):
    """Whether the backward splits ALiBi's distance at a reference key (`keys_left_of_diagonal`,
    `left_alibi_probabilities`): at d = 64. H200, bf16, 16k causal, alternating processes: 1.05x there,
    0.99x at d = 128, which keeps the distance per score."""
    return bool(rules & ALIBI.value) and keys_left_of_diagonal(causal, rules) and head_dim == 64


@gluon.jit
def left_alibi_probabilities(s, lse2, keys_past, ctx, scale_log2, RULES: gl.constexpr):
    """`rule_probabilities` where no key lies past its query's diagonal (`keys_left_of_diagonal`), with
    ALiBi's distance split at a reference key: keys_past (the keys' distance past it, float32) is added per
    score, the row term is already in lse2 (`alibi_row_term`). Both broadcast against s."""
    slope_of_cap = 1.0
    if RULES & SOFTCAP:
        capped = fast_tanh(s * ctx[INV_CAP])
        s = ctx[CAP] * capped
        slope_of_cap = 1.0 - capped * capped
    return gl.exp2((keys_past * ctx[SLOPE] + s) * scale_log2 - lse2), slope_of_cap


@gluon.jit
def alibi_row_term(lse2, queries, first_key, ctx, scale_log2):
    """lse2 of `queries` plus ALiBi's row term in base 2: slope * (diagonal - first_key) * scale_log2."""
    diagonal_past = int_as_float(queries + (ctx[LEN_K] - ctx[LEN_Q]) - first_key)
    return lse2 + (ctx[SLOPE] * scale_log2) * diagonal_past


@gluon.jit
def key_block_probabilities(s, lse2, t, keys, scale_log2, CAUSAL: gl.constexpr, RULES: gl.constexpr,
                            SPLIT_ALIBI: gl.constexpr):
    """P^T (keys by queries, from raw S^T) of query tile t under the rules (`rule_probabilities`), 0 where
    `allowed_pairs` says no unless the whole tile is allowed; and the softcap's derivative. keys: the
    query head's context (`work_context`) and `key_block_rules`."""
    ctx, key_state = keys
    positions, key_ids, first, Q_IDS, q_ids_stride, query_full = key_state
    BLOCK_M: gl.constexpr = s.shape[1]
    queries = column_positions(s, t)
    q_pos = gl.expand_dims(queries, 0)
    k_pos = gl.expand_dims(positions, 1)
    if SPLIT_ALIBI:
        p, slope_of_cap = left_alibi_probabilities(
            s, gl.expand_dims(alibi_row_term(lse2, queries, first, ctx, scale_log2), 0),
            gl.expand_dims(int_as_float(positions - first), 1), ctx, scale_log2, RULES)
    else:
        p, slope_of_cap = rule_probabilities(s, gl.expand_dims(lse2, 0), q_pos, k_pos, ctx, scale_log2, RULES)
    one_segment = (t >= query_full[0]) & (t < query_full[1])
    if all_allowed(t * BLOCK_M, first, BLOCK_M, ROWS, ctx, one_segment, CAUSAL, RULES) == 0:
        q_ids = queries
        if RULES & SEGMENTS:
            q_ids = gl.load(Q_IDS + queries * q_ids_stride, mask=queries < ctx[LEN_Q], other=0)
        allowed = allowed_pairs(q_pos, k_pos, gl.expand_dims(q_ids, 0), gl.expand_dims(key_ids, 1), ctx, CAUSAL,
                                RULES)
        if RULES & VARLEN:  # the tile's rows past the sequence are the next one's
            allowed = allowed & (q_pos < ctx[LEN_Q])
        p = gl.where(allowed, p, 0.0)
    return p, slope_of_cap


@gluon.jit
def resident_operand(smem, acc_layout: gl.constexpr, IN_REGISTERS: gl.constexpr):
    """A resident [64, D] tile as the A operand of a wgmma with accumulator layout `acc_layout`:
    the shared-memory tile itself, or (IN_REGISTERS) its registers."""
    if IN_REGISTERS:
        return smem.load(gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
    else:
        return smem


@gluon.jit
def dkdv_compute_partition(half: gl.constexpr, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, bars,
                           DK, DV, dk_strides, dv_strides, dk_desc, dv_desc, heads_q, num_col_tiles, heads_per_group,
                           len_q, len_k, group, scale_log2, scale, CAUSAL: gl.constexpr, ACCUMULATE: gl.constexpr,
                           IN_REGISTERS: gl.constexpr, dq_parts, ATOMIC_DQ: gl.constexpr, ROTATE: gl.constexpr,
                           ALTERNATE_DQ: gl.constexpr, rules, RULES: gl.constexpr):
    """Consumer warpgroup `half`: keys n0 + 64*half + [0, 64); writes their dK and dV, by TMA
    through its K and V tiles if dk_desc is not None (and with ATOMIC_DQ stages their share of dQ,
    see `dkdv_step`)."""
    kv_bar = bars[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    s_layout: gl.constexpr = wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = wgmma_layout(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    b, hk, n0, lo, full, tiles, start, _ = key_block_sweep(heads_q, num_col_tiles, heads_per_group, len_q, len_k,
                                                           group, rules, scale_log2, BLOCK_M, CAUSAL, ROTATE, RULES)
    first = n0 + half * ROWS
    key_state = 0
    if RULES != 0:
        key_state = key_block_rules(rules, b, first, len_q, len_k, s_layout, BLOCK_M, RULES)
    dk = gl.zeros([ROWS, D], gl.float32, acc_layout)
    dv = gl.zeros([ROWS, D], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    k = resident_operand(k_smem.index(half), s_layout, IN_REGISTERS)
    v = resident_operand(v_smem.index(half), s_layout, IN_REGISTERS)
    group_context = 0
    if RULES != 0 and (RULES & ALIBI) == 0:  # every query head of the group has the same context
        group_context = work_context(rules, b, hk * group, len_q, len_k, scale_log2, RULES)
    for j in range(group * tiles):
        t = sweep_tile(j, lo, tiles, start, ROTATE)
        keys = 0
        if RULES & ALIBI:  # the query head's context: its slope
            keys = (work_context(rules, b, hk * group + j // tiles, len_q, len_k, scale_log2, RULES), key_state)
        elif RULES != 0:
            keys = (group_context, key_state)
        dk, dv, k, v = dkdv_step(k, v, q_smem, do_smem, lse_smem, delta_smem, bars, dk, dv,
                                 first - (len_k - len_q), t, j, full, scale_log2, s_layout, op_layout, CAUSAL,
                                 IN_REGISTERS, dq_parts, half, ATOMIC_DQ, ALTERNATE_DQ, keys, RULES)
    bhk, n0 = key_block_of(program_id_again(), num_col_tiles, heads_per_group, CAUSAL)
    first = n0 + half * ROWS
    heads_k = heads_q // group
    b = bhk // heads_k
    hk = bhk % heads_k
    if dk_desc is None:
        dk_at = DK + b.to(gl.int64) * dk_strides[0] + hk.to(gl.int64) * dk_strides[1]
        dv_at = DV + b.to(gl.int64) * dv_strides[0] + hk.to(gl.int64) * dv_strides[1]
        keys = len_k
        if RULES & VARLEN:  # the sequence's rows of the packed (1, Hk, total_k, D) views
            ctx = work_context(rules, b, hk * group, len_q, len_k, scale_log2, RULES)
            keys = ctx[LEN_K]
            dk_at = DK + hk.to(gl.int64) * dk_strides[1] + ctx[K_START].to(gl.int64) * dk_strides[2]
            dv_at = DV + hk.to(gl.int64) * dv_strides[1] + ctx[K_START].to(gl.int64) * dv_strides[2]
        store_rows(dk_at, dk_strides[2], dk_strides[3], dk * scale, first, keys, ACCUMULATE)
        store_rows(dv_at, dv_strides[2], dv_strides[3], dv, first, keys, ACCUMULATE)
    else:  # through this warpgroup's K and V tiles (not packed: a box would reach the next sequence)
        store_tile(dv_desc, v_smem.index(half), dv, [b, hk, first, 0])
        if ATOMIC_DQ:  # the other warpgroup's dQ wgmmas read this K tile too
            k_free = dq_parts[7]
            mbarrier.arrive(k_free, count=1)
            mbarrier.wait(k_free, 0)
        store_tile(dk_desc, k_smem.index(half), dk * scale, [b, hk, first, 0])
        tma.store_wait(0)


@gluon.jit(do_not_specialize=COUNTS)
def gluon_dkdv_kernel(
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, DK, DV, dk_strides, dv_strides, dk_desc, dv_desc,
    heads_q, group, len_q, len_q_pad, len_k, num_col_tiles, heads_per_group, dq_desc, SEM,
    scale_log2, scale, left, right, softcap, ALIBI_PTR, alibi_sb, alibi_sh, PREFIX_PTR, SEG_Q, seg_q_sb, seg_q_sn,
    SEG_K, seg_k_sb, seg_k_sn, QUERY_TILES, CU_Q, CU_K,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, ACCUMULATE: gl.constexpr, IN_REGISTERS: gl.constexpr,
    DQ_SLOTS: gl.constexpr, ROTATE: gl.constexpr, ALTERNATE_DQ: gl.constexpr, RULES: gl.constexpr,
):
    """Grid: (num_col_tiles * B * Hk,). Descriptors (`tile_descriptor`): q, do (B, Hq, Nq, D) with
    [1, 1, BLOCK_M, D] boxes, k, v (B, Hk, Nk, D) with [1, 1, 64, D] boxes; dq_desc: None, or
    (atomic_dq) a float32 (B, Hq, Nq, D) the kernel adds scale * dS K into, [1, 1, BLOCK_M, D/2] boxes.
    SEM: None, or with dq_desc zeroed int32, at least B * Hq * cdiv(Nq, BLOCK_M): one per dQ tile,
    so its contributions are added in a fixed order (`dq_rank`; every program of a causal head
    group, or of a full-attention head, must fit on the GPU at once: `ordered_dq_fits`), the first
    stored: dq_desc's tensor need not be zeroed (only rows no key block reaches). ROTATE (ordered,
    full attention, `rotated_sweeps`): the key blocks start their sweeps at spread query tiles.
    ALTERNATE_DQ: `GluonBackwardConfig.alternate_dq`.

    DK, DV: (B, Hk, Nk, D) in k's dtype, or float32 (any strides) with ACCUMULATE; strides (batch,
    head, row, col). Or (not with ACCUMULATE) these None and dk_desc, dv_desc descriptors over
    dK and dV with k_desc's boxes. lse_desc, delta_desc (`stats_descriptor`): contiguous
    (B * Hq, len_q_pad) float32 (`stats_rows`: a 1-D box never exceeds the tensor, B * Hq * len_q_pad
    < 2**31): lse * log2(e) with +inf where lse = -inf and in the padding; rowsum(O * dO), 0 in the
    padding; packed sequences (VARLEN) from their `stats_start`.

    RULES (`rule_bits`; not with dq_desc): the score rules, windows and packing of `gluon_forward_kernel`,
    whose arguments these are, except the segment-id table: QUERY_TILES (B, Nk / 128, 4), each key
    block's query tiles [lo, hi) by segment ids and [full_lo, full_hi) those of its one id alone
    (`backward_rule_arguments`). Packed: the tensors are (1, H, total, d)
    views, dK and dV stored from registers (DK, DV).
    """
    dtype: gl.constexpr = q_desc.dtype
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, D], dtype)
    stat_layout: gl.constexpr = lse_desc.layout
    rules = (left, right, softcap, ALIBI_PTR, alibi_sb, alibi_sh, PREFIX_PTR, SEG_Q, seg_q_sb, seg_q_sn, SEG_K,
             seg_k_sb, seg_k_sn, QUERY_TILES, CU_Q, CU_K)

    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], tile_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, ROWS, D], tile_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, ROWS, D], tile_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    bars = (kv_bar, q_ready, do_ready, empty)
    ATOMIC_DQ: gl.constexpr = dq_desc is not None
    dq_parts = 0
    if ATOMIC_DQ:  # dS^T halves (2 steps x 2 warpgroups); DQ_SLOTS slots of float32 dQ tiles (two halves)
        ds_smem = gl.allocate_shared_memory(dtype, [4, ROWS, BLOCK_M],
                                            gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_M], dtype))
        dq_smem = gl.allocate_shared_memory(gl.float32, [2 * DQ_SLOTS, BLOCK_M, D // 2],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_M, D // 2], gl.float32))
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        staged = gl.allocate_shared_memory(gl.int64, [DQ_SLOTS, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [DQ_SLOTS, 1], mbarrier.MBarrierLayout())
        k_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(k_free, count=2)  # both warpgroups past their last dQ wgmma
        mbarrier.init(ds_ready.index(0), count=2)
        mbarrier.init(ds_ready.index(1), count=2)
        for i in gl.static_range(DQ_SLOTS):
            mbarrier.init(staged.index(i), count=1 if ALTERNATE_DQ else 2)  # per warpgroup that stages
            mbarrier.init(free.index(i), count=1)  # the writer's
        dq_parts = (ds_smem, ds_ready, k_smem, dq_smem, dq_desc, scale, (staged, free), k_free)

    # Arguments written out in each tuple: a tuple bound to a name would turn the constexprs
    # into run-time values inside the partitions. Each partition derives its tiles from the
    # program id itself (values shared with the prologue would stay live across the sweep).
    gl.warp_specialize([
        (dkdv_compute_partition, (0, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, bars, DK, DV,
                                  dk_strides, dv_strides, dk_desc, dv_desc, heads_q, num_col_tiles, heads_per_group,
                                  len_q, len_k, group, scale_log2, scale, CAUSAL, ACCUMULATE, IN_REGISTERS, dq_parts,
                                  ATOMIC_DQ, ROTATE, ALTERNATE_DQ, rules, RULES)),
        (dkdv_compute_partition, (1, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, bars, DK, DV,
                                  dk_strides, dv_strides, dk_desc, dv_desc, heads_q, num_col_tiles, heads_per_group,
                                  len_q, len_k, group, scale_log2, scale, CAUSAL, ACCUMULATE, IN_REGISTERS, dq_parts,
                                  ATOMIC_DQ, ROTATE, ALTERNATE_DQ, rules, RULES)),
        (dkdv_load_partition, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem,
                               v_smem, lse_smem, delta_smem, bars, heads_q, num_col_tiles, heads_per_group, len_q,
                               len_q_pad, len_k, group, rules, scale_log2, CAUSAL, ROTATE, RULES)),
        (dq_writer_partition, (dq_parts, SEM, heads_q, num_col_tiles, heads_per_group, len_q, len_k, group, BLOCK_M,
                               CAUSAL, ATOMIC_DQ, ROTATE, rules, scale_log2, RULES)),
    ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------- dQ


@gluon.jit
def dq_step(q, do, k_smem, v_smem, bars, dq, lse2, delta, rows, j, r, len_q, len_k, scale_log2,
            s_layout: gl.constexpr, op_layout: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, row_rules,
            RULES: gl.constexpr):
    """Key tile j (ring position r, slot r % STAGES) into dq; MASK: the causal diagonal or the ragged last
    tile; with RULES, `row_block_probabilities` (row_rules: its `rows`).

    q, do: this warpgroup's rows, as shared-memory tiles or as register operands.
    """
    q_bar, k_ready, k_empty, v_ready, v_empty, sched = bars
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    k = k_smem.index(r % STAGES)
    v = v_smem.index(r % STAGES)
    s_tok, dp_tok = issue_s_and_dp(q, k, do, v, k_ready, v_ready, r, STAGES, s_layout)
    s = warpgroup_mma_wait(1, deps=(s_tok,))
    if RULES == 0:
        p = gl.exp2(s * scale_log2 - gl.expand_dims(lse2, 1))
        if MASK:
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            if CAUSAL:
                last_col = gl.minimum(rows + (len_k - len_q), len_k - 1)
                p = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(last_col, 1), p, 0.0)
            else:
                p = gl.where(gl.expand_dims(cols < len_k, 0), p, 0.0)
    else:  # P times the softcap's derivative: all dS needs of P
        p, slope_of_cap = row_block_probabilities(s, lse2, rows, j, row_rules, scale_log2, CAUSAL, RULES,
                                                  backward_splits_alibi(CAUSAL, RULES, k_smem.shape[2]))
        if RULES & SOFTCAP:
            p = p * slope_of_cap
    dp = warpgroup_mma_wait(0, deps=(dp_tok,))
    release(v_empty, r, STAGES)
    ds_op = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(k.dtype), op_layout)
    dq_tok = warpgroup_mma(ds_op, k, dq, is_async=True)
    dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
    release(k_empty, r, STAGES)
    return dq


@gluon.jit
def row_block_probabilities(s, lse2, rows, tile, row_rules, scale_log2, CAUSAL: gl.constexpr, RULES: gl.constexpr,
                            SPLIT_ALIBI: gl.constexpr):
    """P of `rows` and key tile `tile` (from raw S) under the rules (`rule_probabilities`), 0 where
    `allowed_pairs` says no unless the whole tile is allowed; and the softcap's derivative. row_rules: the
    context (`work_context`), the rows' segment ids, their `segment_full_tiles`, the first row."""
    ctx, row_ids, segment_full, first = row_rules
    BLOCK_N: gl.constexpr = s.shape[1]
    keys = column_positions(s, tile)
    q_pos = gl.expand_dims(rows, 1)
    k_pos = gl.expand_dims(keys, 0)
    if SPLIT_ALIBI:
        p, slope_of_cap = left_alibi_probabilities(
            s, gl.expand_dims(alibi_row_term(lse2, rows, tile * BLOCK_N, ctx, scale_log2), 1),
            gl.expand_dims(int_as_float(column_positions(s, 0)), 0), ctx, scale_log2, RULES)
    else:
        p, slope_of_cap = rule_probabilities(s, gl.expand_dims(lse2, 1), q_pos, k_pos, ctx, scale_log2, RULES)
    key_tile = tile * BLOCK_N // KEY_TILE  # the KEY_TILE keys around the tile
    one_segment = (key_tile >= segment_full[0]) & (key_tile < segment_full[1])
    if all_allowed(first, tile * BLOCK_N, ROWS, BLOCK_N, ctx, one_segment, CAUSAL, RULES) == 0:
        key_ids = keys
        if RULES & SEGMENTS:
            key_ids = gl.load(ctx[KEY_IDS] + keys * ctx[KEY_IDS_STRIDE], mask=keys < ctx[LEN_K], other=0)
        allowed = allowed_pairs(q_pos, k_pos, gl.expand_dims(row_ids, 1), gl.expand_dims(key_ids, 0), ctx, CAUSAL,
                                RULES)
        p = gl.where(allowed, p, 0.0)
    return p, slope_of_cap


@gluon.jit
def dq_compute_partition(half: gl.constexpr, q_smem, do_smem, k_smem, v_smem, bars, do_bar, do_desc, LSE,
                         lse_strides, O, o_strides, DQ, dq_strides, heads_q, num_row_tiles, heads_per_group, len_q,
                         len_k, scale_log2, scale, rules, CAUSAL: gl.constexpr, ACCUMULATE: gl.constexpr,
                         IN_REGISTERS: gl.constexpr, RULES: gl.constexpr):
    """Consumer warpgroup `half`: rows m0 + 64*half + [0, 64); loads its dO half, forms its rows' base-2
    lse and delta = rowsum(O * dO) from lse and O, writes its dQ rows."""
    q_bar = bars[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    acc_layout: gl.constexpr = wgmma_layout(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    b, heads, _, m0, ctx, place = dq_work(rules, num_row_tiles, heads_q, 1, heads_per_group, len_q, len_k,
                                          scale_log2, CAUSAL, RULES)
    coord_b, q_start, _, _ = place
    rows_q = len_q
    if RULES & VARLEN:
        rows_q = ctx[LEN_Q]
    first = m0 + half * ROWS
    mbarrier.expect(do_bar.index(half), do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(do_desc, [coord_b, heads, q_start + gl.maximum(first, 0), 0], do_bar.index(half),
                                    as_box(do_smem.index(half), do_desc))
    rows = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    lse = gl.load(slice_at(LSE, lse_strides, coord_b, heads, q_start) + rows.to(gl.int64) * lse_strides[2],
                  mask=(rows >= 0) & (rows < rows_q), other=float("-inf"))
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [4, 1], [1, 0])  # 16-byte loads
    out = load_rows(slice_at(O, o_strides, coord_b, heads, q_start), o_strides[2], o_strides[3],
                    gl.zeros([ROWS, D], gl.float32, rows_layout), first, rows_q, 0.0)
    lo = 0
    row_rules = 0
    if RULES == 0:
        num_tiles, full_tiles = key_tiles(m0, len_q, len_k, BLOCK_N, CAUSAL)
    else:
        lo, num_tiles, _, _ = key_range(m0, ctx, BLOCK_N, CAUSAL, RULES, 2 * ROWS)
        row_ids, _ = row_segments(rows, ctx, rules, b, RULES)
        row_rules = (ctx, row_ids, segment_full_tiles(ctx, first, RULES), first)
    dq = gl.zeros([ROWS, D], gl.float32, acc_layout)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(do_bar.index(half), 0)
    delta = gl.reduce(out.to(gl.float32) * do_smem.index(half).load(rows_layout).to(gl.float32), 1, plus)
    delta = gl.convert_layout(delta, gl.SliceLayout(1, s_layout))
    q = resident_operand(q_smem.index(half), s_layout, IN_REGISTERS)
    do = resident_operand(do_smem.index(half), s_layout, IN_REGISTERS)
    if RULES == 0:
        for j in range(full_tiles):
            dq = dq_step(q, do, k_smem, v_smem, bars, dq, lse2, delta, rows, j, j, len_q, len_k, scale_log2,
                         s_layout, op_layout, False, CAUSAL, row_rules, RULES)
        for j in range(full_tiles, num_tiles):
            dq = dq_step(q, do, k_smem, v_smem, bars, dq, lse2, delta, rows, j, j, len_q, len_k, scale_log2,
                         s_layout, op_layout, True, CAUSAL, row_rules, RULES)
    else:  # one loop; each tile decides whether it masks
        for j in range(lo, num_tiles):
            dq = dq_step(q, do, k_smem, v_smem, bars, dq, lse2, delta, rows, j, j - lo, len_q, len_k, scale_log2,
                         s_layout, op_layout, True, CAUSAL, row_rules, RULES)
    store_rows(slice_at(DQ, dq_strides, coord_b, heads, q_start), dq_strides[2], dq_strides[3], dq * scale, first,
               rows_q, ACCUMULATE)


@gluon.jit
def dq_work(rules, num_row_tiles, heads_q, group, heads_per_group, len_q, len_k, scale_log2, CAUSAL: gl.constexpr,
            RULES: gl.constexpr):
    """(b, h, hk, m0, ctx, place) of this dQ program: rows [m0, m0 + 128) of (b, h) (`tile_of`; packed: the
    sequence's rows), the context (`work_context`, 0 without RULES) and `sequence_place`."""
    if RULES == 0:
        b, h, hk, m0 = tile_of(gl.program_id(0), num_row_tiles, heads_q, group, heads_per_group, len_q, 2 * ROWS,
                               CAUSAL)
        ctx = 0
        place = (b, 0, 0, 0)
    else:
        b, h, hk, tile_m = work_tile(gl.program_id(0), num_row_tiles, heads_q, group, heads_per_group, CAUSAL)
        ctx = work_context(rules, b, h, len_q, len_k, scale_log2, RULES)
        m0 = first_row(tile_m, num_row_tiles, ctx[LEN_Q], 2 * ROWS, CAUSAL)
        place = sequence_place(b, ctx, RULES)
    return b, h, hk, m0, ctx, place


@gluon.jit
def dq_load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, place, h, hk, m0, first_tile,
                      num_tiles):
    """Producer warp of one row block: Q rows m0 + [0, 128) of (b, h) once, then K/V tiles first_tile + j,
    j < num_tiles, of (b, hk) through the ring (place: `sequence_place`)."""
    q_bar, k_ready, k_empty, v_ready, v_empty, sched = bars
    b, q_start, k_start, _ = place
    load_q(q_desc, q_smem, 0, q_bar, b, h, m0, q_smem.shape[0], q_start)
    load_kv_ring(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, 0, num_tiles, first_tile,
                 k_start)


@gluon.jit(do_not_specialize=COUNTS)
def gluon_dq_kernel(
    q_desc, k_desc, v_desc, do_desc, LSE, lse_strides, O, o_strides, DQ, dq_strides,
    heads_q, group, len_q, len_k, num_row_tiles, heads_per_group, scale_log2, scale,
    left, right, softcap, ALIBI_PTR, alibi_sb, alibi_sh, PREFIX_PTR, SEG_Q, seg_q_sb, seg_q_sn, SEG_K, seg_k_sb,
    seg_k_sn, SEG_BLOCKS, CU_Q, CU_K,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, ACCUMULATE: gl.constexpr, IN_REGISTERS: gl.constexpr,
    RULES: gl.constexpr,
):
    """Grid: (num_row_tiles * B * Hq,). Descriptors (`tile_descriptor`): q, do (B, Hq, Nq, D) with
    [1, 1, 64, D] boxes, k, v (B, Hk, Nk, D) with [1, 1, BLOCK_N, D] boxes.

    DQ: (B, Hq, Nq, D) in q's dtype, or float32 with ACCUMULATE. LSE: the forward's (B, Hq, Nq) natural-log
    lse, O its (B, Hq, Nq, D) output: the kernel reads no row statistics of `row_stats`, so those may live
    in DQ's bytes until it writes them.
    RULES and the arguments from `left`: those of `gluon_forward_kernel` (the key tiles are its
    `key_range`).
    """
    rules = (left, right, softcap, ALIBI_PTR, alibi_sb, alibi_sh, PREFIX_PTR, SEG_Q, seg_q_sb, seg_q_sn, SEG_K,
             seg_k_sb, seg_k_sn, SEG_BLOCKS, CU_Q, CU_K)
    _, h, hk, m0, ctx, place = dq_work(rules, num_row_tiles, heads_q, group, heads_per_group, len_q, len_k,
                                       scale_log2, CAUSAL, RULES)
    dtype: gl.constexpr = q_desc.dtype
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)

    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, D], row_layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, ROWS, D], row_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    do_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(do_bar.index(0), count=1)
    mbarrier.init(do_bar.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=2)
    bars = (q_bar, k_ready, k_empty, v_ready, v_empty, q_bar)  # the forward's tuple; no ping-pong barriers

    if RULES == 0:
        lo = 0
        hi, _ = key_tiles(m0, len_q, len_k, BLOCK_N, CAUSAL)
    else:
        lo, hi, _, _ = key_range(m0, ctx, BLOCK_N, CAUSAL, RULES, 2 * ROWS)
    # Arguments written out in each tuple: a tuple bound to a name would turn the constexprs
    # into run-time values inside the partitions.
    gl.warp_specialize([
        (dq_compute_partition, (0, q_smem, do_smem, k_smem, v_smem, bars, do_bar, do_desc, LSE, lse_strides, O,
                                o_strides, DQ, dq_strides, heads_q, num_row_tiles, heads_per_group, len_q, len_k,
                                scale_log2, scale, rules, CAUSAL, ACCUMULATE, IN_REGISTERS, RULES)),
        (dq_compute_partition, (1, q_smem, do_smem, k_smem, v_smem, bars, do_bar, do_desc, LSE, lse_strides, O,
                                o_strides, DQ, dq_strides, heads_q, num_row_tiles, heads_per_group, len_q, len_k,
                                scale_log2, scale, rules, CAUSAL, ACCUMULATE, IN_REGISTERS, RULES)),
        (dq_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, place, h, hk, m0, lo, hi - lo)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------- host

MAX_STATS = 2**31 - 1


def gluon_backward_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, params: AttentionParams,
                            dout: torch.Tensor | None = None, atomic_dq: bool = False, rules=None,
                            packing=None) -> list[str]:
    """Every reason `gluon_backward` cannot serve these inputs (empty if it can): those of the
    Gluon forward (`gluon_supports`), dout's strides, batch / head dims broadcast with stride 0,
    lse rows beyond 32-bit TMA coordinates, and (atomic_dq) a head dim without that variant, or score
    rules, a window other than full or causal or packing (`backward_rule_bits`: those take the dQ kernel)."""
    reasons = gluon_supports(q, k, v, mask, params, rules, packing)
    if atomic_dq and q.shape[-1] not in ATOMIC_CONFIGS:
        reasons.append(f"atomic_dq: D={q.shape[-1]}, the variant exists for D in {tuple(ATOMIC_CONFIGS)}")
    if atomic_dq and backward_rule_bits(params, rules, packing):
        reasons.append(f"atomic_dq: not with score rules, packing or window={params.window} (full or causal only)")
    if dout is not None and (dout.shape != q.shape or not tma_compatible(dout)):
        reasons.append(f"dout (shape {tuple(dout.shape)}, strides {dout.stride()}) must have q's shape "
                       "and TMA-compatible strides")
    if packing is not None:
        q, dout = (None if x is None else packed_view(x) for x in (q, dout))
    reasons += broadcast_reasons(dout=dout)
    rows = q.shape[0] * q.shape[1] * stats_rows(q.shape[2], packing)
    if rows > MAX_STATS:
        reasons.append(f"B * Hq * Nq = {rows} (padded) exceeds {MAX_STATS}")
    return reasons


def gluon_backward(dout, q, k, v, out, lse, params: AttentionParams, accumulate_into=None, atomic_dq=False,
                   rules=None, packing=None):
    """dq, dk, dv (in q, k, v's dtypes) for attention(q, k, v) with saved out and lse (B, Hq, Nq),
    natural log; with `accumulate_into` (float32 dq, dk, dv, any strides) added into those and returned.
    atomic_dq: the dK/dV kernel adds dQ with TMA reductions (no dQ kernel; not bitwise reproducible).
    rules: a `ScoreRules` (None: none); the sinks' gradient is the caller's (`exattn.masks.sinks_grad`).
    packing (`passes.Packing`, not with accumulate_into): token-major (total, H, d) tensors and lse
    (Hq, total_q), as `attention_varlen` has them."""
    reasons = gluon_backward_supports(q, k, v, None, params, dout, atomic_dq, rules, packing)
    if packing is not None and accumulate_into is not None:
        reasons.append("accumulate_into with packing is not supported")
    if reasons:
        raise ValueError("gluon_backward cannot serve these inputs: " + "; ".join(reasons))
    return run_gluon_backward(dout, q, k, v, out, lse, params, accumulate_into, atomic_dq, rules, packing)


def run_gluon_backward(dout, q, k, v, out, lse, params: AttentionParams, accumulate_into=None, atomic_dq=False,
                       rules=None, packing=None):
    """`gluon_backward` for inputs already checked with `gluon_backward_supports`."""
    accumulate_into = check_accumulators(accumulate_into, q, k, v)
    with on_device(q):
        if packing is None:
            return launch(dout, q, k, v, out, lse, params, accumulate_into, atomic_dq, rules)
        grads = tuple(torch.empty_like(x) for x in (q, k, v))
        views = (packed_view(x) for x in (dout, q, k, v, out))
        launch(*views, lse[None], params, None, False, rules, packing, tuple(packed_view(g) for g in grads), grads[0])
        return grads


def backward_rule_bits(params: AttentionParams, rules, packing=None) -> int:
    """The kernels' RULES (`rule_bits`) less the sinks, which reach the backward through lse alone."""
    return rule_bits(params, rules, packing) & ~SINKS.value


def backward_rule_arguments(q: torch.Tensor, k: torch.Tensor, params: AttentionParams, rules,
                            cfg: GluonBackwardConfig, packing=None) -> tuple[tuple, tuple]:
    """The arguments from `left` on of the dK/dV kernel and of the dQ kernel: the forward's
    (`rule_arguments`) less the sinks, the dK/dV kernel with its own segment-id table (each 128-key
    block's query tiles)."""
    forward = rule_arguments(q, k, params, rules, packing)
    dq_rules = forward[:6] + forward[7:]
    if rules is None or rules.q_segment_ids is None:
        return dq_rules, dq_rules
    q_ids, k_ids = rules.q_segment_ids, rules.k_segment_ids
    query_tiles = segment_tile_ranges(k_ids, q_ids, KEY_TILE.value, cfg.dkdv_block_m)
    return dq_rules[:13] + (query_tiles,) + dq_rules[14:], dq_rules


@triton.jit(do_not_specialize=COUNTS)
def row_stats_kernel(O, DO, LSE, LSE2, DELTA, SEM, CU_Q, o_strides, do_strides, lse_strides, heads_q, len_q, len_q_pad,
                     num_row_tiles, num_seqs, D: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (num_row_tiles * B * Hq,): BLOCK rows of one (b, h) into LSE2, DELTA (B * Hq, len_q_pad);
    SEM (None or int32 (B * Hq, num_row_tiles)): the tile's semaphore set to 0. CU_Q (None, or the
    int32 offsets of num_seqs packed sequences): O, DO, LSE are the (1, Hq, total, ...) views, b the
    sequence, whose rows go to its `stats_start` (the formula of the Gluon `stats_start`) and, past its
    end, +inf and 0 through its last BLOCK-row tile or up to the next sequence's first row."""
    bh = tl.program_id(0) // num_row_tiles
    b = bh // heads_q
    h = (bh % heads_q).to(tl.int64)
    rows = (tl.program_id(0) % num_row_tiles) * BLOCK + tl.arange(0, BLOCK)
    first = 0
    out_row = bh.to(tl.int64) * len_q_pad
    extent = len_q_pad
    in_batch = b.to(tl.int64)
    if CU_Q is not None:
        first = tl.load(CU_Q + b)
        len_q = tl.load(CU_Q + b + 1) - first
        start = (first // STATS_ALIGN + b) * STATS_ALIGN
        out_row = h * len_q_pad + start
        extent = tl.where(b == num_seqs - 1, len_q_pad, (tl.load(CU_Q + b + 1) // STATS_ALIGN + b + 1) * STATS_ALIGN)
        extent -= start
        in_batch = in_batch * 0
    inside = rows < len_q
    cols = tl.arange(0, D)
    r64 = (first + rows).to(tl.int64)[:, None]
    o = tl.load(O + in_batch * o_strides[0] + h * o_strides[1] + r64 * o_strides[2] + cols[None, :] * o_strides[3],
                mask=inside[:, None], other=0.0)
    do = tl.load(DO + in_batch * do_strides[0] + h * do_strides[1] + r64 * do_strides[2] + cols[None, :],
                 mask=inside[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(LSE + in_batch * lse_strides[0] + h * lse_strides[1] + (first + rows).to(tl.int64) * lse_strides[2],
                  mask=inside, other=float("-inf")).to(tl.float32)
    lse2 = lse_in_base2(lse)
    tl.store(LSE2 + out_row + rows, lse2, mask=rows < extent)
    tl.store(DELTA + out_row + rows, delta, mask=rows < extent)
    if SEM is not None:
        tl.store(SEM + tl.program_id(0), 0)


STATS_ROWS = 64  # rows per program of `row_stats_kernel`
# Packed sequences: each one's rows of `row_stats` start at a multiple of STATS_ALIGN (a 1-D TMA box
# starts 16-byte aligned), sequence b at (cu_seqlens_q[b] // STATS_ALIGN + b) * STATS_ALIGN (`stats_start`).
STATS_ALIGN: tl.constexpr = tl.constexpr(4)


def stats_rows(len_q: int, packing=None) -> int:
    """len_q_pad of `row_stats`: rows per head, len_q (dense) or the packed total rounded up to
    STATS_ROWS, with room for every packed sequence's aligned start and its last tile."""
    if packing is not None:
        len_q += STATS_ALIGN.value * packing.batch + STATS_ROWS
    return ceil_div(len_q, STATS_ROWS) * STATS_ROWS


def row_stats(lse: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, len_q_pad: int,
              semaphores: torch.Tensor | None = None, packing=None, within: torch.Tensor | None = None):
    """(lse2, delta), each (B * Hq, len_q_pad) float32: lse * log2(e) with +inf where lse = -inf
    (no key) and in the padding; delta = rowsum(out * dout) with 0 in the padding. One launch, which
    also zeroes `semaphores` (int32 (B * Hq, len_q_pad / STATS_ROWS), contiguous) if given. packing:
    lse (1, Hq, total_q) and out, dout their views; each sequence's rows from its `stats_start`."""
    batch, heads_q, len_q = lse.shape
    stats = float32_within(within, (2, batch * heads_q, len_q_pad), lse.device)  # one allocation, or none
    lse2, delta = stats[0], stats[1]
    block = STATS_ROWS
    row_tiles, seqs, cu_q = ceil_div(len_q_pad, block), batch, None
    if packing is not None:
        row_tiles, seqs, cu_q = ceil_div(packing.max_q, block), packing.batch, packing.cu_q
    assert semaphores is None or semaphores.shape == (batch * heads_q, row_tiles) and semaphores.is_contiguous()
    run_kernel(row_stats_kernel, grid_of(row_tiles, seqs * heads_q),
        out, dout, lse, lse2, delta, semaphores, cu_q, out.stride(), dout.stride(), lse.stride(), heads_q, len_q,
        len_q_pad, row_tiles, seqs, D=out.shape[-1], BLOCK=block, num_warps=4,
    )
    return lse2, delta


def stats_descriptor(stats: torch.Tensor, rows: int) -> TensorDescriptor:
    """Host TMA descriptor over the contiguous float32 rows of `row_stats`, seen as 1-D, [rows] boxes."""
    return TensorDescriptor(stats, [stats.numel()], [1], [rows], box_layout((rows,), torch.float32))


def dkdv_arguments(dout, q, k, v, lse2, delta, dk, dv, len_q_pad: int, cfg: GluonBackwardConfig, causal: bool,
                   dq_sum: torch.Tensor | None = None, semaphores: torch.Tensor | None = None,
                   accumulate: bool = False, sizes: tuple[int, int, int] | None = None) -> tuple:
    """Positional arguments of `gluon_dkdv_kernel` before scale_log2, and its grid; dq_sum: the
    float32 dQ the kernel adds into (atomic_dq, or ordered with `semaphores`), or None; accumulate:
    dk and dv are float32 accumulators to add into (`grad_outputs`); sizes: (B, max Nq, max Nk) of packed
    sequences, whose (1, H, total, d) views the tensors are (their dK and dV are stored from registers)."""
    batch, heads_q, len_q, dim = q.shape
    heads_k, len_k = k.shape[1], k.shape[2]
    if sizes is not None:
        batch, len_q, len_k = sizes
    col_tiles = ceil_div(len_k, 2 * ROWS.value)
    order = 1
    if causal:  # per K/V head: its group's Q and dO rows
        costs = schedule.causal_key_costs(len_q, len_k, 2 * ROWS.value, cfg.dkdv_block_m)
        qdo_bytes = 2 * len_q * dim * q.element_size() * (heads_q // heads_k)
        order = causal_heads_per_group(costs, batch * heads_k, qdo_bytes, q.device)
        if semaphores is not None:
            order = max(1, schedule.resident_heads_per_group(order, batch * heads_k, col_tiles,
                                                             resident_programs(q.device)))
    dq_desc = None if dq_sum is None else tile_descriptor(dq_sum, cfg.dkdv_block_m, dim // 2)
    grads = grad_outputs(dk, dv, accumulate or sizes is not None, len_q * (heads_q // heads_k))
    args = (tile_descriptor(q, cfg.dkdv_block_m), tile_descriptor(dout, cfg.dkdv_block_m),
            tile_descriptor(k, ROWS.value), tile_descriptor(v, ROWS.value),
            stats_descriptor(lse2, cfg.dkdv_block_m), stats_descriptor(delta, cfg.dkdv_block_m),
            *grads, heads_q, heads_q // heads_k, len_q, len_q_pad, len_k, col_tiles, order, dq_desc, semaphores)
    return args, grid_of(col_tiles, batch * heads_k)


def grad_outputs(dk: torch.Tensor, dv: torch.Tensor, accumulate: bool, sweep_rows: int) -> tuple:
    """(DK, DV, dk_strides, dv_strides, dk_desc, dv_desc) of `gluon_dkdv_kernel` for key blocks that
    sweep `sweep_rows` query rows: TMA descriptors with K's boxes, or pointers and strides when
    accumulating, when the strides do not allow TMA or from TMA_GRADS_MAX_ROWS; the others None."""
    too_long = sweep_rows >= TMA_GRADS_MAX_ROWS.get(dk.shape[-1], float("inf"))
    if accumulate or too_long or not tma_compatible(dk, dv):
        return dk, dv, dk.stride(), dv.stride(), None, None
    return None, None, None, None, tile_descriptor(dk, ROWS.value), tile_descriptor(dv, ROWS.value)


def resident_programs(device: torch.device) -> int:
    """dK/dV programs resident at once: one per SM (their shared memory allows no second)."""
    return multiprocessor_count(device) if device.type == "cuda" else 0


def dq_path(q: torch.Tensor, k: torch.Tensor, causal: bool, atomic_dq: bool, accumulating: bool) -> str:
    """How the backward forms dQ: "atomic" (the dK/dV kernel's TMA reductions, in any order),
    "ordered" (the same in a fixed order, `settings.ordered_dq`, from ORDERED_DQ_MIN_LEN query
    rows) or "kernel" (a dQ kernel)."""
    if atomic_dq:
        return "atomic"
    if settings.ordered_dq and q.shape[2] >= ORDERED_DQ_MIN_LEN and not accumulating and ordered_dq_fits(q, k, causal):
        return "ordered"
    return "kernel"


def rotated_sweeps(path: str, causal: bool, len_q: int, dim: int) -> bool:
    """Whether the dK/dV programs start their sweeps at spread query tiles (`dq_order.dq_rank`):
    ordered dQ under full attention, by `settings.rotated_dq_order`; None (auto): below
    UNROTATED_MIN_LEN."""
    if path != "ordered" or causal:
        return False
    if settings.rotated_dq_order is None:
        return len_q < UNROTATED_MIN_LEN.get(dim, float("inf"))
    return settings.rotated_dq_order


def ordered_dq_fits(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """Whether the dK/dV kernel can add dQ in a fixed order (`dq_rank`) without deadlock or
    serialized steps: one head's key blocks all resident at once (a causal head group is then
    capped to fit); causal with Nk <= Nq (key blocks start their sweeps at distinct tiles); full
    attention with at least one 64-row query tile per key block (distinct rotated starts)."""
    len_q, len_k = q.shape[2], k.shape[2]
    key_blocks = ceil_div(len_k, 2 * ROWS.value)
    if key_blocks > resident_programs(q.device):
        return False
    if causal:
        return len_k <= len_q
    return ceil_div(len_q, ATOMIC_CONFIGS[q.shape[-1]].dkdv_block_m) >= key_blocks


def dq_arguments(dout, q, k, v, out, lse, dq, cfg: GluonBackwardConfig, causal: bool,
                 sizes: tuple[int, int, int] | None = None) -> tuple:
    """Positional arguments of `gluon_dq_kernel` before scale_log2, and its grid (sizes: as `dkdv_arguments`)."""
    batch, heads_q, len_q, dim = q.shape
    heads_k, len_k = k.shape[1], k.shape[2]
    if sizes is not None:
        batch, len_q, len_k = sizes
    row_tiles = ceil_div(len_q, 2 * ROWS.value)
    order = 1
    if causal:  # per query head: its K and V rows
        costs = schedule.causal_row_costs(len_q, len_k, 2 * ROWS.value, cfg.dq_block_n)
        kv_bytes = 2 * len_k * dim * k.element_size() // (heads_q // heads_k)
        order = causal_heads_per_group(costs, batch * heads_q, kv_bytes, q.device)
    args = (tile_descriptor(q, ROWS.value), tile_descriptor(k, cfg.dq_block_n), tile_descriptor(v, cfg.dq_block_n),
            tile_descriptor(dout, ROWS.value), lse, lse.stride(), out, out.stride(), dq, dq.stride(), heads_q,
            heads_q // heads_k, len_q, len_k, row_tiles, order)
    return args, grid_of(row_tiles, batch * heads_q)


def kernel_options(cfg: GluonBackwardConfig, causal: bool, accumulate: bool, rules: int = 0) -> dict:
    """Constexpr arguments (less STAGES) and launch options shared by both kernels; rules: RULES
    (`backward_rule_bits`)."""
    return {"CAUSAL": causal, "ACCUMULATE": accumulate, "IN_REGISTERS": cfg.in_registers, "RULES": rules,
            "num_warps": 4, "maxnreg": MAXNREG}


def dq_accumulators(path: str, q: torch.Tensor, k: torch.Tensor, dq: torch.Tensor, causal: bool, accumulating: bool,
                    row_tiles: int, segments: bool = False):
    """(dq_sum, semaphores) for `dq_path`'s path: the float32 dQ the dK/dV kernel writes (None for a
    dQ kernel) and, for "ordered", int32 (B * Hq, row_tiles) semaphores for `row_stats` to zero (else
    None). Atomic: the caller's float32 dq itself when accumulating into TMA-compatible strides, else
    zeros. Ordered stores each tile's first contribution, so only the rows that see no key (causal,
    Nq > Nk) are zeroed; with segment ids, whose tiles no key block may sweep, all of it."""
    if path == "kernel":
        return None, None
    if path == "ordered":
        dq_sum = (torch.zeros if segments else torch.empty)(q.shape, dtype=torch.float32, device=q.device)
        if causal and q.shape[2] > k.shape[2]:
            dq_sum[:, :, : q.shape[2] - k.shape[2]].zero_()
        return dq_sum, torch.empty(q.shape[0] * q.shape[1], row_tiles, dtype=torch.int32, device=q.device)
    in_place = accumulating and tma_compatible(dq)
    return (dq if in_place else torch.zeros(q.shape, dtype=torch.float32, device=q.device)), None


def tile_config(bits: int, dq_in_dkdv: bool, dim: int) -> GluonBackwardConfig:
    """The tiles for `backward_rule_bits` bits: RULE_CONFIGS for softcap at d = 64 or with ALiBi or segment
    ids, else ATOMIC_CONFIGS for dQ added by the dK/dV kernel, else CONFIGS."""
    if bits & SOFTCAP.value and (dim == 64 or bits & (ALIBI.value | SEGMENTS.value)):
        return RULE_CONFIGS[dim]
    return (ATOMIC_CONFIGS if dq_in_dkdv else CONFIGS)[dim]


# Rules with which the Triton backward beats this one at d = 64 unless softcap is on (H200, bf16, 16k
# tokens, causal): segment ids 1.10x (ALiBi read 1.03x before `int_as_float`, 0.98x with it). Elsewhere
# this one reads 1.09-1.45x the Triton kernels at d = 64 (packing alone 0.96-1.16x), packing alone
# 1.22-1.97x at d = 128 (`gluon_backward_faster`).
TRITON_FASTER_AT_D64 = SEGMENTS.value
# Rules that only narrow a causal key block's sweep to a run of query tiles: the window's left bound, a
# prefix and segment ids. Under them the dK/dV kernel may form dQ in order, each block's turn at a tile
# counted from the later blocks that sweep it (`later_sweeps`).
NARROWING = gl.constexpr(LEFT.value | PREFIX.value | SEGMENTS.value)


def dq_in_dkdv_serves(bits: int, causal: bool) -> bool:
    """Whether the dK/dV kernel may form dQ (`dq_path`) under `backward_rule_bits` bits: without rules, with
    ALiBi alone under full attention, whose sweeps and tiles are the plain ones, and causal under any mix
    of the rules that only narrow the sweeps (NARROWING; `dq_rank`, and `later_sweeps` where they mix).
    H200, bf16, 16k tokens, backward against the dQ kernel: ALiBi full attention 1.12x (d = 128); causal,
    a 4k window 1.10x (d = 128) and 1.18x (d = 64), a 1024-key prefix 1.11x and 1.04x, segment ids
    (log-uniform 128-8192) 1.15x (d = 128), each with the ranks counted; causal ALiBi 0.98x and causal
    softcap 0.90x (192 bytes parked), which keep the dQ kernel."""
    return bits == 0 or (bits == ALIBI.value and not causal) or (causal and not bits & ~NARROWING.value)


def faster_than_triton(bits: int, dim: int) -> bool:
    """Whether this backward is measured faster than the Triton kernels for `backward_rule_bits` bits."""
    return dim != 64 or not bits & TRITON_FASTER_AT_D64 or bool(bits & SOFTCAP.value)


def launch(dout, q, k, v, out, lse, params: AttentionParams, accumulate_into, atomic_dq: bool, rules=None,
           packing=None, grads=None, scratch=None):
    """The passes over (B, H, N, D) tensors, or with `packing` the (1, H, total, D) views of packed ones
    (lse (1, Hq, total_q)), writing into `grads` (their views) if given. The row statistics live in the
    bytes of dq (or of `scratch`, the tensor behind grads[0]) where they fit and dq is made here: only
    the dK/dV kernel reads them, and dq is written after it (`passes.float32_within`)."""
    batch, heads_q, len_q, dim = q.shape
    len_k = k.shape[2]
    if 0 in (batch, heads_q, len_q, len_k):
        if accumulate_into is not None:
            return accumulate_into
        return tuple(x.zero_() for x in grads) if grads else tuple(torch.zeros_like(x) for x in (q, k, v))
    if accumulate_into is not None:
        dq, dk, dv = accumulate_into
    else:
        dq, dk, dv = grads or (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
        scratch = dq if grads is None else scratch
    causal = params.window[1] != UNBOUNDED
    bits = backward_rule_bits(params, rules, packing)
    path = dq_path(q, k, causal, atomic_dq, accumulate_into is not None) if dq_in_dkdv_serves(bits, causal) else "kernel"
    dq_in_dkdv = path != "kernel"
    cfg = tile_config(bits, dq_in_dkdv, dim)
    len_q_pad = stats_rows(len_q, packing)
    # semaphores: one per program of row_stats, which zeroes them; the dK/dV kernel uses the first
    # B * Hq * cdiv(Nq, BLOCK_M), one per dQ tile
    dq_sum, semaphores = dq_accumulators(path, q, k, dq, causal, accumulate_into is not None,
                                         len_q_pad // STATS_ROWS, bool(bits & SEGMENTS.value))
    lse2, delta = row_stats(lse, out, dout, len_q_pad, semaphores, packing, scratch)
    scalars = (params.scale * LOG2E, params.scale)
    dkdv_rules, dq_rules = backward_rule_arguments(q, k, params, rules, cfg, packing)
    options = kernel_options(cfg, causal, accumulate_into is not None, bits)
    sizes = None if packing is None else (packing.batch, packing.max_q, packing.max_k)
    args, grid = dkdv_arguments(dout, q, k, v, lse2, delta, dk, dv, len_q_pad, cfg, causal, dq_sum, semaphores,
                                accumulate_into is not None, sizes)
    run_kernel(gluon_dkdv_kernel, grid, *args, *scalars, *dkdv_rules, STAGES=cfg.dkdv_stages, DQ_SLOTS=cfg.dq_slots,
               ALTERNATE_DQ=cfg.alternate_dq, ROTATE=rotated_sweeps(path, causal, len_q, dim), **options)
    if not dq_in_dkdv:
        args, grid = dq_arguments(dout, q, k, v, out, lse, dq, cfg, causal, sizes)
        run_kernel(gluon_dq_kernel, grid, *args, *scalars, *dq_rules, STAGES=cfg.dq_stages, **options)
    elif dq_sum is not dq:
        dq.add_(dq_sum) if accumulate_into is not None else dq.copy_(dq_sum)
    return dq, dk, dv
