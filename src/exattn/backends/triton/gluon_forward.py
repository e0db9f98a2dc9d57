"""FA3-style attention forward for Hopper (sm_90), written in Gluon.

    gluon_forward(q, k, v, params) -> (out, lse)
    gluon_supports(q, k, v, mask, params) -> list of reasons it cannot serve (empty: it can)

Same contract as `passes.triton_forward` for the subset it serves: CUDA sm_90,
fp16/bf16, D = Dv in {64, 128}, no mask, no dropout, full attention or
bottom-right causal, GQA, any lengths; out in q's dtype, lse (B, Hq, Nq) float32
natural log; a row that sees no key gives 0 and lse = -inf.

One program owns 64 * CONSUMERS query rows of one (batch, query head), split
between warp roles (`gl.warp_specialize`):

- a producer warp issues TMA loads: the Q tile once, then K and V tiles into a
  ring of `STAGES` shared-memory slots, each slot guarded by a "ready"
  mbarrier (TMA bytes landed) and an "empty" one (all consumers done);
- CONSUMERS (2 or 3) consumer warpgroups, 64 rows each, run the online softmax of
  `exattn.algebra` in base 2 with intra-warpgroup overlap: the async wgmma
  S = Q K_j+1^T and the async wgmma O += P_j V_j are issued together, the
  softmax of tile j+1 runs while P_j V_j is on the tensor cores, and P is fed
  to the second wgmma from registers.

Row maxima are kept in raw score units, p = exp2(s * c - m * c) with
c = scale * log2(e) (one FMA per score; this needs scale > 0). Key tiles
above the causal diagonal are never loaded; only the diagonal / ragged tail
tiles apply an element mask; causal programs start with the longest rows.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...problem import UNBOUNDED, AttentionParams
from . import schedule
from .configs import ceil_div, gluon_device_reasons, multiprocessor_count, tma_compatible
from .passes import on_device, scalar_args
from .replay import run_kernel

ROWS = gl.constexpr(64)  # query rows per consumer warpgroup
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
WINDOWS = ((UNBOUNDED, UNBOUNDED), (UNBOUNDED, 0))
REGISTER_FILE = 65536  # 32-bit registers of one SM
PRODUCER_REGS: gl.constexpr = gl.constexpr(24)


def register_split(consumers: int) -> tuple[int, int]:
    """(cap at launch, consumer registers per thread) for `consumers` warpgroups and the producer's
    (padded to a warpgroup): the producer's `setmaxnreg.dec` frees what the consumers' `.inc` take."""
    maxnreg = REGISTER_FILE // (128 * (consumers + 1)) // 8 * 8
    return maxnreg, (maxnreg + (maxnreg - PRODUCER_REGS.value) // consumers) // 8 * 8


# Registers per thread of the two consumer warpgroups, and the cap at launch (12 warps * 168).
MAXNREG, _CONSUMER_REGS = register_split(2)
CONSUMER_REGS: gl.constexpr = gl.constexpr(_CONSUMER_REGS)


class GluonConfig(NamedTuple):
    """block_n keys per tile; `stages` K/V slots in the ring; pingpong: the consumer
    warpgroups take turns issuing their wgmmas (FA3's scheduler barrier), so one's softmax
    runs under the others' matmuls; consumers: warpgroups of 64 query rows per program
    (3 leave 160 registers each: enough at d = 64, spills at d = 128); persistent: one
    program per SM strides over the work tiles (the next tile's Q and K/V load while the
    consumers finish this one) instead of one program per tile, for full attention;
    one_key_loop: one loop over a warpgroup's key tiles, the diagonal / ragged ones branching to the
    mask, instead of a loop of full tiles and a loop of masked ones."""

    block_n: int
    stages: int
    pingpong: bool = False
    consumers: int = 2
    persistent: bool = False
    one_key_loop: bool = False


# d = 128 persistent: full attention 1.02-1.05x the one-program-per-tile grid, causal 0.86-0.95x;
# d = 64's three warpgroups leave no
# registers for it (two, persistent: 0.85-0.91x).
# one_key_loop (two runs each, bf16, 4k-16k): d = 64
# 1.01-1.04x, d = 128 0.98-1.00x. At d = 64 causal 4k it executes 4.7% fewer instructions at the same
# issue rate (Nsight Compute); the kernel is 4952 SASS instructions, not 6792.
CONFIGS = {64: GluonConfig(128, 2, consumers=3, one_key_loop=True), 128: GluonConfig(128, 2, persistent=True)}
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
# Which key tiles a step masks (`softmax_tile`): none, every one, those from the first not-full one on.
UNMASKED: gl.constexpr = gl.constexpr(0)
MASKED: gl.constexpr = gl.constexpr(1)
MASKED_FROM_FULL: gl.constexpr = gl.constexpr(2)


@gluon.constexpr_function
def wgmma_layout(n):
    """Register layout of a [64, n] wgmma accumulator of one 4-warp warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def key_tiles(m0, len_q, len_k, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr = 128):
    """(hi, full): rows [m0, m0 + BLOCK_M) see key tiles [0, hi); tiles [0, full) need no mask.
    Rows that do not exist see none: under full attention those past len_q (a ragged last tile's
    padding), under causal masking those before row 0 (where `tile_of` puts a ragged tile's padding).

    The kernel form of `masks.band_bounds` for window (-1, -1) and (-1, 0).
    """
    hi = gl.cdiv(len_k, BLOCK_N)
    full = len_k // BLOCK_N
    if CAUSAL:
        offset = len_k - len_q
        last = gl.minimum(m0 + BLOCK_M, len_q) - 1
        hi = gl.cdiv(gl.maximum(gl.minimum(last + offset + 1, len_k), 0), BLOCK_N)
        full = gl.minimum(full, gl.maximum(m0 + offset + 1, 0) // BLOCK_N)
    else:
        hi = gl.where(m0 < len_q, hi, 0)
        full = gl.minimum(full, hi)
    return hi, full


@gluon.jit
def as_box(smem, desc):
    """A [rows, D] slot seen as the [1, 1, rows, D] box of a (B, H, N, D) descriptor."""
    return smem._reinterpret(smem.dtype, desc.block_type.shape, desc.layout)


@gluon.jit
def program_id_again():
    """gl.program_id(0), read anew: values derived from it after a long loop are recomputed
    there instead of being kept (or spilled) across the loop."""
    return gl.inline_asm_elementwise("mov.u32 $0, %ctaid.x;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def load_kv_ring(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, ring0, num_tiles):
    """K_j and V_j of (b, hk), j < num_tiles, into ring slot (ring0 + j) % STAGES once every consumer freed it."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    for j in range(num_tiles):
        slot = (ring0 + j) % STAGES
        phase = ((ring0 + j) // STAGES) & 1
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(slot),
                                        as_box(k_smem.index(slot), k_desc))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(slot),
                                        as_box(v_smem.index(slot), v_desc))


@gluon.jit
def load_q(q_desc, q_smem, first_slot, ready, b, h, m0, BLOCKS: gl.constexpr):
    """BLOCKS row blocks of 64 from m0 of (b, h) into slots first_slot, ..., onto one barrier (a block
    before row 0, `tile_of`'s padding, loads row 0's)."""
    mbarrier.expect(ready, BLOCKS * q_desc.block_type.nbytes)
    for half in gl.static_range(BLOCKS):
        tma.async_copy_global_to_shared(q_desc, [b, h, gl.maximum(m0 + half * ROWS, 0), 0], ready,
                                        as_box(q_smem.index(first_slot + half), q_desc))


@gluon.jit
def load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, b, h, hk, m0, num_tiles):
    """Producer warp of one row block: Q rows m0 + [0, 64 * q_smem.shape[0]) of (b, h) once, then
    the K/V ring of (b, hk)."""
    q_bar, k_ready, k_empty, v_ready, v_empty, sched = bars
    load_q(q_desc, q_smem, 0, q_bar, b, h, m0, q_smem.shape[0])
    load_kv_ring(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, 0, num_tiles)


@gluon.jit
def longest_first(t, tiles_per_head, heads_per_group, CAUSAL: gl.constexpr):
    """(head, rank) of work tile t: head-major (neighbouring tiles share K/V in L2); causal: groups of
    heads_per_group heads, each group's tiles rank-major, so every head's longest tile (rank 0) starts
    before any of its shorter ones (`schedule.heads_per_group` sizes the groups)."""
    head = t // tiles_per_head
    rank = t % tiles_per_head
    if CAUSAL:
        local = t % (tiles_per_head * heads_per_group)
        head = t // (tiles_per_head * heads_per_group) * heads_per_group + local % heads_per_group
        rank = local // heads_per_group
    return head, rank


@gluon.jit
def tile_of(t, num_row_tiles, heads_q, group, heads_per_group, len_q, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """(b, h, hk, first row) of work tile t in `longest_first` order. Causal: the last rows see most
    keys, and the tiles are shifted back by whole 64-row blocks towards row len_q, so the padding of
    a ragged tile sits in the first tile, where it costs least (its blocks before row 0 load row 0's
    block, are masked, and store nothing)."""
    bh, tile_m = longest_first(t, num_row_tiles, heads_per_group, CAUSAL)
    first = tile_m * BLOCK_M
    if CAUSAL:
        first = (num_row_tiles - 1 - tile_m) * BLOCK_M - (num_row_tiles * BLOCK_M - len_q) // ROWS * ROWS
    h = bh % heads_q
    return bh // heads_q, h, h // group, first


@gluon.jit
def forward_load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, heads_q, batch_heads, group,
                           num_row_tiles, heads_per_group, len_q, len_k, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
                           PERSISTENT: gl.constexpr):
    """Producer warp: for each work tile of this program (PERSISTENT), or for tile program_id, its Q
    into a Q buffer (once the consumers stored the out it held), then its K/V through the ring."""
    if PERSISTENT:
        ring0 = 0
        for t in range(gl.program_id(0), num_row_tiles * batch_heads, gl.num_programs(0)):
            i = (t - gl.program_id(0)) // gl.num_programs(0)
            ring0 += load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, t, i, ring0, heads_q,
                               batch_heads, group, num_row_tiles, heads_per_group, len_q, len_k, CONSUMERS, CAUSAL,
                               PERSISTENT)
    else:
        load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, gl.program_id(0), 0, 0, heads_q, batch_heads,
                  group, num_row_tiles, heads_per_group, len_q, len_k, CONSUMERS, CAUSAL, PERSISTENT)


@gluon.jit
def load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, t, i, ring0, heads_q, batch_heads, group,
              num_row_tiles, heads_per_group, len_q, len_k, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
              PERSISTENT: gl.constexpr):
    """Work tile t, the i-th of this program: Q into buffer i % Q_BUFFERS, K/V from ring position ring0.
    Returns the number of key tiles."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    b, h, hk, m0 = tile_of(t, num_row_tiles, heads_q, group, heads_per_group, len_q, CONSUMERS * ROWS, CAUSAL)
    num_tiles, _ = key_tiles(m0, len_q, len_k, k_smem.shape[1], CAUSAL, CONSUMERS * ROWS)
    mbarrier.wait(q_empty.index(i % Q_BUFFERS), ((i // Q_BUFFERS) & 1) ^ 1)
    load_q(q_desc, q_smem, (i % Q_BUFFERS) * CONSUMERS, q_ready.index(i % Q_BUFFERS), b, h, m0, CONSUMERS)
    load_kv_ring(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, ring0, num_tiles)
    return num_tiles


@gluon.jit
def wait_ready(ready, j, STAGES: gl.constexpr):
    """Block until tile j's TMA bytes have landed in its slot."""
    mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)


@gluon.jit
def release(empty, j, STAGES: gl.constexpr):
    """This warpgroup is done with tile j's slot (the producer waits for every warpgroup)."""
    mbarrier.arrive(empty.index(j % STAGES), count=1)


@gluon.jit
def take_turn(sched, half: gl.constexpr, turn, PINGPONG: gl.constexpr):
    """Ping-pong: wait until the previous warpgroup has issued its wgmmas of this turn (round robin,
    warpgroup 0 leads; its first wait passes on the fresh barrier)."""
    if PINGPONG:
        mbarrier.wait(sched.index(half), (turn + (half == 0)) & 1)


@gluon.jit
def pass_turn(sched, half: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(sched.index((half + 1) % sched.shape[0]), count=1)


# Own combine functions: gl.max / gl.sum wrap triton.language's, which break
# under TRITON_INTERPRET=1 (set by the CPU test suite that compiles this kernel).
@gluon.jit
def larger(a, b):
    return gl.maximum(a, b)


@gluon.jit
def plus(a, b):
    return a + b


@gluon.jit
def paired_cast(x, dtype: gl.constexpr):
    """float32 x in dtype (rounded to nearest even, as `x.to(dtype)`), two elements per cvt: the
    one-element casts Triton emits come back from ptxas paired in swapped halves, one PRMT each."""
    if dtype == gl.bfloat16:
        y = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.bfloat16,
                                      is_pure=True, pack=2)
    elif dtype == gl.float16:
        y = gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.float16,
                                      is_pure=True, pack=2)
    else:
        y = x.to(dtype)
    return y


@gluon.jit
def masked_scores(s, rows, j, len_q, len_k, CAUSAL: gl.constexpr):
    """Scores s of key tile j, -inf where rows may not see the key (causal: bottom-right; else past len_k)."""
    BLOCK_N: gl.constexpr = s.shape[1]
    cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
    if CAUSAL:
        last_col = gl.minimum(rows + (len_k - len_q), len_k - 1)
        s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(last_col, 1), s, float("-inf"))
    else:
        s = gl.where(gl.expand_dims(cols < len_k, 0), s, float("-inf"))
    return s


@gluon.jit
def softmax_tile(s, m_i, l_i, rows, j, len_q, len_k, scale_log2, dtype: gl.constexpr,
                 p_layout: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, full_tiles=0):
    """Fold raw scores s of key tile j into (m_i, l_i); returns P (dot operand), new m, l, alpha.
    MASK: UNMASKED, MASKED, or MASKED_FROM_FULL (masked if j >= full_tiles)."""
    if MASK == MASKED:
        s = masked_scores(s, rows, j, len_q, len_k, CAUSAL)
    if MASK == MASKED_FROM_FULL:
        if j >= full_tiles:
            s = masked_scores(s, rows, j, len_q, len_k, CAUSAL)
    m_new = gl.maximum(m_i, gl.reduce(s, 1, larger))
    if MASK != UNMASKED:
        m_new = gl.where(m_new == float("-inf"), 0.0, m_new)
    m_scaled = m_new * scale_log2
    alpha = gl.exp2(m_i * scale_log2 - m_scaled)
    p = gl.exp2(s * scale_log2 - gl.expand_dims(m_scaled, 1))
    l_i = l_i * alpha + gl.reduce(p, 1, plus)
    p = gl.convert_layout(paired_cast(p, dtype), p_layout)
    return p, m_new, l_i, alpha


@gluon.jit
def pipelined_step(half: gl.constexpr, q, k_smem, v_smem, bars, s_regs, p, acc, m_i, l_i, rows, j, r,
                   len_q, len_k, scale_log2, p_layout: gl.constexpr, MASK: gl.constexpr,
                   CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, full_tiles=0):
    """Key tile j (ring position r): S_j = Q K_j^T and O += P_j-1 V_j-1 in flight together, softmax of
    S_j under the second.

    s_regs (the consumed S_j-1) is reused as the first wgmma's result registers.
    """
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars
    STAGES: gl.constexpr = k_smem.shape[0]
    wait_ready(k_ready, r, STAGES)
    wait_ready(v_ready, r - 1, STAGES)
    take_turn(sched, half, r, PINGPONG)
    s_tok = warpgroup_mma(q, k_smem.index(r % STAGES).permute((1, 0)), s_regs, use_acc=False, is_async=True)
    o_tok = warpgroup_mma(p, v_smem.index((r - 1) % STAGES), acc, is_async=True)
    pass_turn(sched, half, PINGPONG)
    s = warpgroup_mma_wait(1, deps=(s_tok,))
    release(k_empty, r, STAGES)
    p_new, m_i, l_i, alpha = softmax_tile(s, m_i, l_i, rows, j, len_q, len_k, scale_log2,
                                          v_smem.dtype, p_layout, MASK, CAUSAL, full_tiles)
    acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
    release(v_empty, r - 1, STAGES)
    alpha = gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))
    acc = acc * gl.expand_dims(alpha, 1)
    return s, p_new, acc, m_i, l_i


@gluon.jit
def attend_rows(half: gl.constexpr, q, k_smem, v_smem, bars, o_desc, LSE, b, h, m0, heads_q, ring0, len_q, len_k,
                scale_log2, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                ONE_KEY_LOOP: gl.constexpr):
    """Rows m0 + 64*half + [0, 64) of (b, h) against the key tiles at ring positions ring0, ...: writes
    their lse, and their out into q's slot (TMA store, waited for). Returns the number of key tiles
    loaded for the work tile; under causal these rows may see fewer (`skip_tiles`)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    DV: gl.constexpr = v_smem.shape[2]
    BLOCK_M: gl.constexpr = CONSUMERS * ROWS
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(DV)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars

    num_tiles, _ = key_tiles(m0, len_q, len_k, BLOCK_N, CAUSAL, BLOCK_M)
    if PINGPONG:  # every warpgroup takes its turn at every key tile
        own_tiles, full_tiles = key_tiles(m0, len_q, len_k, BLOCK_N, CAUSAL, BLOCK_M)
    else:
        own_tiles, full_tiles = key_tiles(m0 + half * ROWS, len_q, len_k, BLOCK_N, CAUSAL, ROWS)
    rows = m0 + half * ROWS + gl.arange(0, ROWS, layout=row_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    acc = gl.zeros([ROWS, DV], gl.float32, o_layout)
    if own_tiles > 0:
        wait_ready(k_ready, ring0, STAGES)
        take_turn(sched, half, ring0, PINGPONG)
        s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        s = warpgroup_mma(q, k_smem.index(ring0 % STAGES).permute((1, 0)), s, use_acc=False, is_async=True)
        pass_turn(sched, half, PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s,))
        release(k_empty, ring0, STAGES)
        p, m_i, l_i, alpha = softmax_tile(s, m_i, l_i, rows, 0, len_q, len_k, scale_log2,
                                          v_smem.dtype, p_layout, MASKED, CAUSAL)
        if ONE_KEY_LOOP:  # one code copy of the step: diagonal tiles branch to the mask
            for j in range(1, own_tiles):
                s, p, acc, m_i, l_i = pipelined_step(half, q, k_smem, v_smem, bars, s, p, acc, m_i, l_i, rows,
                                                     j, ring0 + j, len_q, len_k, scale_log2, p_layout,
                                                     MASKED_FROM_FULL, CAUSAL, PINGPONG, full_tiles)
        else:
            for j in range(1, full_tiles):
                s, p, acc, m_i, l_i = pipelined_step(half, q, k_smem, v_smem, bars, s, p, acc, m_i, l_i, rows,
                                                     j, ring0 + j, len_q, len_k, scale_log2, p_layout, UNMASKED,
                                                     CAUSAL, PINGPONG)
            for j in range(gl.maximum(full_tiles, 1), own_tiles):
                s, p, acc, m_i, l_i = pipelined_step(half, q, k_smem, v_smem, bars, s, p, acc, m_i, l_i, rows,
                                                     j, ring0 + j, len_q, len_k, scale_log2, p_layout, MASKED,
                                                     CAUSAL, PINGPONG)
        last = ring0 + own_tiles - 1
        wait_ready(v_ready, last, STAGES)
        acc = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        release(v_empty, last, STAGES)

    has_mass = l_i != 0.0  # NaN counts as mass, so NaN propagates
    safe_l = gl.where(has_mass, l_i, 1.0)
    lse = gl.where(has_mass, (m_i * scale_log2 + gl.log2(safe_l)) * LN2, float("-inf"))
    gl.store(LSE + (b * heads_q + h).to(gl.int64) * len_q + rows, lse, mask=(rows >= 0) & (rows < len_q))
    inv_l = gl.convert_layout(gl.where(has_mass, 1.0 / safe_l, 0.0), gl.SliceLayout(1, o_layout))
    o_smem = q  # Q's slot is free once the last S wgmma is done
    o_smem.store(paired_cast(acc * gl.expand_dims(inv_l, 1), o_smem.dtype))
    fence_async_shared()
    if m0 + half * ROWS >= 0:  # not a causal tile's padding block (`tile_of`)
        tma.async_copy_shared_to_global(o_desc, [b, h, m0 + half * ROWS, 0], as_box(o_smem, o_desc))
    skip_tiles(k_smem, bars, ring0 + own_tiles, ring0 + num_tiles)
    tma.store_wait(0)
    return num_tiles


@gluon.jit
def skip_tiles(k_smem, bars, first, end):
    """Hand back the ring slots of positions [first, end): key tiles of the work tile that this
    warpgroup's rows do not see (causal: the rows above the tile's last ones). Each waits until its
    tile has landed, so the arrival counts for that tile, not for the slot's previous one."""
    STAGES: gl.constexpr = k_smem.shape[0]
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars
    for r in range(first, end):
        wait_ready(k_ready, r, STAGES)
        release(k_empty, r, STAGES)
        wait_ready(v_ready, r, STAGES)
        release(v_empty, r, STAGES)


@gluon.jit
def compute_partition(half: gl.constexpr, q_smem, k_smem, v_smem, bars, o_desc, LSE, heads_q, batch_heads,
                      group, num_row_tiles, heads_per_group, len_q, len_k, scale_log2, CAUSAL: gl.constexpr,
                      PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr, ONE_KEY_LOOP: gl.constexpr):
    """Consumer warpgroup `half`: rows 64*half + [0, 64) of each work tile of this program (PERSISTENT),
    or of tile program_id, Q from the buffer the producer filled (two, alternating); the buffer is
    handed back once the out is stored."""
    CONSUMERS: gl.constexpr = q_smem.shape[0] // bars[0].shape[0]
    if PERSISTENT:
        ring0 = 0
        for t in range(gl.program_id(0), num_row_tiles * batch_heads, gl.num_programs(0)):
            i = (t - gl.program_id(0)) // gl.num_programs(0)
            ring0 += attend_tile(half, q_smem, k_smem, v_smem, bars, o_desc, LSE, t, i, ring0, heads_q,
                                 batch_heads, group, num_row_tiles, heads_per_group, len_q, len_k, scale_log2,
                                 CONSUMERS, CAUSAL, PINGPONG, PERSISTENT, ONE_KEY_LOOP)
    else:
        attend_tile(half, q_smem, k_smem, v_smem, bars, o_desc, LSE, gl.program_id(0), 0, 0, heads_q, batch_heads,
                    group, num_row_tiles, heads_per_group, len_q, len_k, scale_log2, CONSUMERS, CAUSAL, PINGPONG,
                    PERSISTENT, ONE_KEY_LOOP)


@gluon.jit
def attend_tile(half: gl.constexpr, q_smem, k_smem, v_smem, bars, o_desc, LSE, t, i, ring0, heads_q, batch_heads,
                group, num_row_tiles, heads_per_group, len_q, len_k, scale_log2, CONSUMERS: gl.constexpr,
                CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr, ONE_KEY_LOOP: gl.constexpr):
    """Work tile t, the i-th of this program, its key tiles from ring position ring0: `attend_rows` with
    Q from buffer i % Q_BUFFERS, handed back after. Returns the number of key tiles."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars
    b, h, _, m0 = tile_of(t, num_row_tiles, heads_q, group, heads_per_group, len_q, CONSUMERS * ROWS, CAUSAL)
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    wait_ready(q_ready, i, Q_BUFFERS)
    num_tiles = attend_rows(half, q_smem.index((i % Q_BUFFERS) * CONSUMERS + half), k_smem, v_smem, bars, o_desc, LSE,
                            b, h, m0, heads_q, ring0, len_q, len_k, scale_log2, CONSUMERS, CAUSAL, PINGPONG,
                            ONE_KEY_LOOP)
    release(q_empty, i, Q_BUFFERS)
    return num_tiles


@gluon.jit
def gluon_forward_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE, heads_q, batch_heads, group, len_q, len_k, num_row_tiles, heads_per_group,
    scale_log2,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PERSISTENT: gl.constexpr, ONE_KEY_LOOP: gl.constexpr,
):
    """Grid: (programs,): one per work tile, or (PERSISTENT) fewer, each striding over the
    num_row_tiles * B * Hq work tiles (`tile_of`; heads_per_group: the causal order's group size).
    Descriptors (`tile_descriptor`): q, o (B, Hq, Nq, D) with [1, 1, 64, D] boxes, k, v (B, Hk, Nk, D)
    with [1, 1, BLOCK_N, D] boxes; o in q's dtype. LSE: contiguous (B, Hq, Nq) float32, natural log.
    """
    dtype: gl.constexpr = q_desc.dtype
    D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)

    Q_BUFFERS: gl.constexpr = 2 if PERSISTENT else 1  # the next tile's Q loads under this one's
    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFFERS * CONSUMERS, ROWS, D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sched = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(sched.index(i), count=1)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched)

    # Arguments written out in each tuple (so one list per consumer count): a tuple bound to a
    # name would turn the constexprs into run-time values inside the partitions.
    if CONSUMERS == 2:
        gl.warp_specialize([
            (compute_partition, (0, q_smem, k_smem, v_smem, bars, o_desc, LSE, heads_q, batch_heads, group,
                                 num_row_tiles, heads_per_group, len_q, len_k, scale_log2, CAUSAL, PINGPONG,
                                 PERSISTENT, ONE_KEY_LOOP)),
            (compute_partition, (1, q_smem, k_smem, v_smem, bars, o_desc, LSE, heads_q, batch_heads, group,
                                 num_row_tiles, heads_per_group, len_q, len_k, scale_log2, CAUSAL, PINGPONG,
                                 PERSISTENT, ONE_KEY_LOOP)),
            (forward_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, heads_q, batch_heads,
                                      group, num_row_tiles, heads_per_group, len_q, len_k, CONSUMERS, CAUSAL,
                                      PERSISTENT)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (compute_partition, (0, q_smem, k_smem, v_smem, bars, o_desc, LSE, heads_q, batch_heads, group,
                                 num_row_tiles, heads_per_group, len_q, len_k, scale_log2, CAUSAL, PINGPONG,
                                 PERSISTENT, ONE_KEY_LOOP)),
            (compute_partition, (1, q_smem, k_smem, v_smem, bars, o_desc, LSE, heads_q, batch_heads, group,
                                 num_row_tiles, heads_per_group, len_q, len_k, scale_log2, CAUSAL, PINGPONG,
                                 PERSISTENT, ONE_KEY_LOOP)),
            (compute_partition, (2, q_smem, k_smem, v_smem, bars, o_desc, LSE, heads_q, batch_heads, group,
                                 num_row_tiles, heads_per_group, len_q, len_k, scale_log2, CAUSAL, PINGPONG,
                                 PERSISTENT, ONE_KEY_LOOP)),
            (forward_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, heads_q, batch_heads,
                                      group, num_row_tiles, heads_per_group, len_q, len_k, CONSUMERS, CAUSAL,
                                      PERSISTENT)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


def tma_strides(x: torch.Tensor) -> list[int]:
    """x's strides, with the stride of each dimension of size 1 made TMA-valid (torch may report
    any stride there; it is never stepped, but the descriptor checks it)."""
    strides = list(x.stride())
    for i in reversed(range(x.dim() - 1)):
        if x.shape[i] == 1:
            strides[i] = strides[i + 1] * x.shape[i + 1]
    return strides


def tile_descriptor(x: torch.Tensor, rows: int, cols: int | None = None) -> TensorDescriptor:
    """Host TMA descriptor over (B, H, N, D) x with [1, 1, rows, cols or D] boxes (zero fill past row N)."""
    block = (1, 1, rows, cols or x.shape[-1])
    return TensorDescriptor(x, list(x.shape), tma_strides(x), list(block), box_layout(block, x.dtype))


@functools.cache
def box_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a TMA box (cached: it is on every launch's host path)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), GL_DTYPES[dtype])


def broadcast_reasons(**tensors) -> list[str]:
    """The reason, if any, that host TMA descriptors cannot cover these (B, H, N, D) tensors: a batch
    or head dimension broadcast with stride 0."""
    broadcast = [name for name, x in tensors.items() if x is not None
                 and any(n > 1 and stride == 0 for n, stride in zip(x.shape[:2], x.stride()[:2]))]
    if broadcast:
        return [f"{', '.join(broadcast)} broadcast (stride 0) over batch or heads: TMA needs real strides"]
    return []


def gluon_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask,
                   params: AttentionParams) -> list[str]:
    """Every reason `gluon_forward` cannot serve these inputs (empty if it can)."""
    reasons = gluon_device_reasons(q.device)
    if q.dtype not in DTYPES:
        reasons.append(f"dtype {q.dtype} is not float16 or bfloat16")
    if q.shape[-1] != v.shape[-1] or q.shape[-1] not in HEAD_DIMS:
        reasons.append(f"head dims D={q.shape[-1]}, Dv={v.shape[-1]}: need D = Dv in {HEAD_DIMS}")
    if mask is not None:
        reasons.append("a user mask is not supported")
    if params.dropout_p > 0:
        reasons.append(f"dropout_p={params.dropout_p} is not supported (only 0)")
    if params.window not in WINDOWS:
        reasons.append(f"window={params.window} is not supported (full attention or causal only)")
    if not (math.isfinite(params.scale) and params.scale > 0):
        reasons.append(f"scale={params.scale} must be positive and finite")
    if params.block_m is not None or params.block_n is not None:
        reasons.append(f"tiles are fixed; got block_m={params.block_m}, block_n={params.block_n}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        reasons.append(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if not tma_compatible(q, k, v):
        reasons.append("strides are not TMA-compatible (16-byte aligned base and rows, unit last stride)")
    return reasons + broadcast_reasons(q=q, k=k, v=v)


def gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams):
    """out (B, Hq, Nq, D) in q's dtype and lse (B, Hq, Nq) float32, natural log."""
    reasons = gluon_supports(q, k, v, None, params)
    if reasons:
        raise ValueError("gluon_forward cannot serve these inputs: " + "; ".join(reasons))
    return run_gluon_forward(q, k, v, params)


def run_gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams):
    """`gluon_forward` for inputs already checked with `gluon_supports`."""
    with on_device(q):
        return launch(q, k, v, params)


def launch(q, k, v, params: AttentionParams):
    batch, heads_q, len_q, dim = q.shape
    len_k = k.shape[2]
    out = torch.empty(batch, heads_q, len_q, dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads_q, len_q, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or len_k == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    causal = params.window == (UNBOUNDED, 0)
    args, grid = forward_arguments(q, k, v, out, lse, scalar_args(params)["scale_log2"], causal)
    run_kernel(gluon_forward_kernel, grid, *args, **kernel_constants(dim, causal))
    return out, lse


def forward_arguments(q, k, v, out, lse, scale_log2: float, causal: bool, programs: int | None = None) -> tuple:
    """Positional arguments of `gluon_forward_kernel`, and its grid: `programs` (default: one per
    work tile, or on a persistent grid one per SM) striding over the work tiles."""
    batch, heads_q, len_q, dim = q.shape
    heads_k, len_k = k.shape[1], k.shape[2]
    cfg = CONFIGS[dim]
    row_tiles = ceil_div(len_q, cfg.consumers * ROWS.value)
    work = row_tiles * batch * heads_q
    if programs is None:
        programs = min(work, multiprocessor_count(q.device)) if persistent_grid(cfg, causal) else work
    order = 1
    if causal:
        costs = schedule.causal_row_costs(len_q, len_k, cfg.consumers * ROWS.value, cfg.block_n)
        kv_bytes = 2 * len_k * dim * k.element_size() // (heads_q // heads_k)  # per query head
        order = causal_heads_per_group(costs, batch * heads_q, kv_bytes, q.device)
    args = (tile_descriptor(q, ROWS.value), tile_descriptor(k, cfg.block_n), tile_descriptor(v, cfg.block_n),
            tile_descriptor(out, ROWS.value), lse, heads_q, batch * heads_q, heads_q // heads_k, len_q, len_k,
            row_tiles, order, scale_log2)
    return args, (programs,)


def causal_heads_per_group(rank_costs: tuple[int, ...], batch_heads: int, head_bytes: int,
                           device: torch.device) -> int:
    """`schedule.heads_per_group` for this device's SMs (1, head-major, off CUDA: compile tests)."""
    if device.type != "cuda":
        return 1
    return schedule.heads_per_group(rank_costs, batch_heads, multiprocessor_count(device), head_bytes)


def persistent_grid(cfg: GluonConfig, causal: bool) -> bool:
    """Whether the grid is persistent: `cfg.persistent`, for full attention only (causal programs of
    one tile each, longest rows first, measured faster)."""
    return cfg.persistent and not causal


def kernel_constants(dim: int, causal: bool) -> dict:
    """Constexpr arguments and launch options of the kernel for head dim `dim`."""
    cfg = CONFIGS[dim]
    if cfg.consumers not in (2, 3):
        raise ValueError(f"GluonConfig.consumers must be 2 or 3, got {cfg.consumers}")
    maxnreg, consumer_regs = register_split(cfg.consumers)
    return dict(STAGES=cfg.stages, CAUSAL=causal, PINGPONG=cfg.pingpong, PERSISTENT=persistent_grid(cfg, causal),
                ONE_KEY_LOOP=cfg.one_key_loop,
                CONSUMERS=cfg.consumers, CONSUMER_REGS=consumer_regs, num_warps=4, maxnreg=maxnreg)
