"""FA3-style attention forward for Hopper (sm_90), written in Gluon.

    gluon_forward(q, k, v, params) -> (out, lse)
    gluon_supports(q, k, v, mask, params) -> list of reasons it cannot serve (empty: it can)

Same contract as `passes.triton_forward` for the subset it serves: CUDA sm_90,
fp16/bf16, D = Dv in {64, 128}, no mask, no dropout, any window (bottom-right),
GQA, any lengths, and every score rule (segment ids, prefix, softcap, ALiBi,
sinks) and packed variable-length batches (`Packing`: token-major (total, H, D)
tensors seen as (1, H, total, D), sequence b's rows from the offsets on the
device); out in q's dtype, lse (B, Hq, Nq) (packed: (Hq, total_q)) float32
natural log; a row that sees no key gives 0 and lse = -inf (with sinks: 0 and
the sink's logit).

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
c = scale * log2(e) (one FMA per score; this needs scale > 0); the rules are
applied in those units too (softcap / scale, slope / scale, sink / scale; the
softcap's tanh is the SFU's `tanh.approx.f32`). Key tiles outside the window,
the prefix and the segment ids' tile ranges (`segment_tables`) are never
loaded; only tiles that some row may not see whole (band edges, ragged tails,
document boundaries) apply an element mask; causal programs start with the
longest rows. The rules and packing are bits of one constexpr, RULES, so the
plain kernel compiles exactly as before.
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

from ...problem import UNBOUNDED, AttentionParams, ScoreRules
from . import schedule
from .configs import COUNTS, ceil_div, gluon_device_reasons, multiprocessor_count, tma_compatible
from .passes import on_device, scalar_args, with_positive_scale
from .segment_tables import RANGE_FIELDS, segment_tile_ranges
from .replay import run_kernel

ROWS = gl.constexpr(64)  # query rows per consumer warpgroup
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
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
    consumers finish this one) instead of one program per tile, for full attention, and with
    persistent_causal under causal masking too;
    one_key_loop: one loop over a warpgroup's key tiles, the diagonal / ragged ones branching to the
    mask, instead of a loop of full tiles and a loop of masked ones."""

    block_n: int
    stages: int
    pingpong: bool = False
    consumers: int = 2
    persistent: bool = False
    one_key_loop: bool = False
    persistent_causal: bool = False


# d = 128 persistent: full attention 1.02-1.05x the one-program-per-tile grid, causal 0.86-0.95x;
# d = 64's three warpgroups leave no
# registers for it (two, persistent: 0.85-0.91x).
# one_key_loop (two runs each, bf16, 4k-16k): d = 64
# 1.01-1.04x, d = 128 0.98-1.00x. At d = 64 causal 4k it executes 4.7% fewer instructions at the same
# issue rate (Nsight Compute); the kernel is 4952 SASS instructions, not 6792.
CONFIGS = {64: GluonConfig(128, 2, consumers=3, one_key_loop=True), 128: GluonConfig(128, 2, persistent=True)}
# Plain problems whose rows see at most SHORT_MEAN_KEYS keys on average (`forward_config`): a program
# of one work tile runs too few key tiles to hide its prologue and epilogue, so they take a persistent
# grid, causal included (its head groups sized for the stride: `schedule.strided_imbalance`), and one
# key loop; d = 64 with two consumer warpgroups and three K/V slots. H200, bf16, batch * N = 16k,
# kernel time against CONFIGS: d = 64 full 512 / 1k 1.27x / 1.12x (2k: 0.96x), causal 512 / 1k / 2k
# 1.44x / 1.19x / 1.08x (4k: 0.96x), with three slots 1.00x / 1.04x / 1.03x the two (causal; full
# 1.00x); d = 128 causal 512 / 1k / 2k 1.42x / 1.26x / 1.08x (4k: 0.98x), full 512 0.99x (its causal
# form parks 8 bytes on the stack; two key loops, without: 0.93-0.99x the one loop).
SHORT_CONFIGS = {64: GluonConfig(128, 3, one_key_loop=True, persistent=True, persistent_causal=True),
                 128: GluonConfig(128, 2, one_key_loop=True, persistent=True, persistent_causal=True)}
SHORT_MEAN_KEYS = 1024
# Packed sequences of unequal lengths (`forward_config`'s ragged), H200, bf16, 16k tokens of 39 documents
# of 64-1024 tokens, forward ms in three rounds against CONFIGS: the short schedule read 1.38x causal and
# 1.01x full at d = 64. At d = 128 it read 0.177-0.179 against 0.209-0.210 causal (1.17x), and with 64-key
# tiles (a warpgroup's last tile then ends at most 63 keys past its diagonal) 0.170 (1.23x), full 0.279-0.281
# against 0.285-0.287. Dense short problems keep 128-key tiles: 64 read 0.85-1.03x there.
RAGGED_SHORT_CONFIGS = {64: SHORT_CONFIGS[64], 128: SHORT_CONFIGS[128]._replace(block_n=64)}
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
KEY_TILE: gl.constexpr = gl.constexpr(128)  # keys per tile wherever a prefix or segment ids are in use
# The longest sequence the Gluon kernels serve with ALiBi: its distances, a tile's padding included, stay
# within `int_as_float`'s |n| < 2^22
FLOAT_POSITIONS = (1 << 22) - 2 * 128
INT_AS_FLOAT: gl.constexpr = gl.constexpr(0x4B400000)  # the bits of 1.5 * 2^23 (12582912.0)
# Bits of the kernel's RULES: score rules and packing (`rule_bits`). A right bound of the window is CAUSAL.
LEFT: gl.constexpr = gl.constexpr(1)  # the window's left bound
SOFTCAP: gl.constexpr = gl.constexpr(2)
ALIBI: gl.constexpr = gl.constexpr(4)
SINKS: gl.constexpr = gl.constexpr(8)
PREFIX: gl.constexpr = gl.constexpr(16)
SEGMENTS: gl.constexpr = gl.constexpr(32)
VARLEN: gl.constexpr = gl.constexpr(64)
RIGHT: gl.constexpr = gl.constexpr(128)  # a right bound other than 0 (causal's)
# Fields of a work tile's context (`work_context`).
LEN_Q: gl.constexpr = gl.constexpr(0)  # the sequence's query rows
LEN_K: gl.constexpr = gl.constexpr(1)  # its keys
Q_START: gl.constexpr = gl.constexpr(2)  # its first query row in the packed tensors (0 dense)
K_START: gl.constexpr = gl.constexpr(3)
DESC_BATCH: gl.constexpr = gl.constexpr(4)  # the batch coordinate of the descriptors (0 packed)
LEFT_ROWS: gl.constexpr = gl.constexpr(5)  # the window
RIGHT_ROWS: gl.constexpr = gl.constexpr(6)
CAP: gl.constexpr = gl.constexpr(7)  # softcap / scale
INV_CAP: gl.constexpr = gl.constexpr(8)
SLOPE: gl.constexpr = gl.constexpr(9)  # ALiBi slope / scale
PREFIX_KEYS: gl.constexpr = gl.constexpr(10)  # min(prefix, len_k)
KEY_IDS: gl.constexpr = gl.constexpr(11)  # the keys' segment ids, and their stride
KEY_IDS_STRIDE: gl.constexpr = gl.constexpr(12)
BLOCK_KEY_TILES: gl.constexpr = gl.constexpr(13)  # each 64-row block's row of `segment_tables`
# Which key tiles a step masks (`softmax_tile`): none, every one, those from the first not-full one on.
UNMASKED: gl.constexpr = gl.constexpr(0)
MASKED: gl.constexpr = gl.constexpr(1)
MASKED_FROM_FULL: gl.constexpr = gl.constexpr(2)


@gluon.constexpr_function
def wgmma_layout(n):
    """Register layout of a [64, n] wgmma accumulator of one 4-warp warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def keys_left_of_diagonal(causal, rules):
    """Whether no row may see a key past its diagonal (causal, without a right bound beyond it or a prefix):
    ALiBi's distance is then diagonal - key, which splits at any reference key into a row term and a
    key term (`modified_scores`, `softmax_tile`)."""
    return bool(causal) and not rules & (RIGHT.value | PREFIX.value)


@gluon.constexpr_function
def splits_alibi(causal, rules, p_layout):
    """Whether the forward splits ALiBi's distance (`keys_left_of_diagonal`): not at d = 64 (P's wgmma 64
    wide), where the key term's registers would spill with the softcap or a window."""
    return bool(rules & ALIBI.value) and keys_left_of_diagonal(causal, rules) and p_layout.parent.instr_shape[1] != 64


@gluon.jit
def key_tiles(m0, len_q, len_k, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr = 128):
    """(hi, full): rows [m0, m0 + BLOCK_M) see key tiles [0, hi); tiles [0, full) need no mask. `key_range`
    for full or causal attention without rules (the Gluon backward's dQ pass)."""
    _, hi, _, full = key_range(m0, plain_context(len_q, len_k), BLOCK_N, CAUSAL, 0, BLOCK_M)
    return hi, full


@gluon.jit
def plain_context(len_q, len_k):
    """A work tile's context (`work_context`) without rules or packing."""
    return (len_q, len_k, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0)


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
def load_kv_ring(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, ring0, num_tiles,
                 first_tile=0, start=0):
    """K and V tiles first_tile + j of (b, hk), j < num_tiles, into ring slot (ring0 + j) % STAGES once every
    consumer freed it (rows counted from `start`: a packed sequence's first)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    for j in range(num_tiles):
        slot = (ring0 + j) % STAGES
        phase = ((ring0 + j) // STAGES) & 1
        row = start + (first_tile + j) * BLOCK_N
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, row, 0], k_ready.index(slot),
                                        as_box(k_smem.index(slot), k_desc))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, row, 0], v_ready.index(slot),
                                        as_box(v_smem.index(slot), v_desc))


@gluon.jit
def load_q(q_desc, q_smem, first_slot, ready, b, h, m0, BLOCKS: gl.constexpr, start=0):
    """BLOCKS row blocks of 64 from m0 of (b, h) into slots first_slot, ..., onto one barrier (a block
    before row 0, `tile_of`'s padding, loads row 0's; rows counted from `start`)."""
    mbarrier.expect(ready, BLOCKS * q_desc.block_type.nbytes)
    for half in gl.static_range(BLOCKS):
        tma.async_copy_global_to_shared(q_desc, [b, h, start + gl.maximum(m0 + half * ROWS, 0), 0], ready,
                                        as_box(q_smem.index(first_slot + half), q_desc))


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
def work_tile(t, num_row_tiles, heads_q, group, heads_per_group, CAUSAL: gl.constexpr):
    """(b, h, hk, row tile rank) of work tile t in `longest_first` order."""
    bh, tile_m = longest_first(t, num_row_tiles, heads_per_group, CAUSAL)
    h = bh % heads_q
    return bh // heads_q, h, h // group, tile_m


@gluon.jit
def first_row(tile_m, num_row_tiles, len_q, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """The first row of the rank-tile_m row tile. Causal: the last rows see most keys, and the tiles are
    shifted back by whole 64-row blocks towards row len_q, so the padding of a ragged tile sits in the
    first tile, where it costs least (its blocks before row 0 load row 0's block, are masked, and store
    nothing); a packed sequence shorter than the longest has whole tiles before row 0, which see no key."""
    first = tile_m * BLOCK_M
    if CAUSAL:
        first = (num_row_tiles - 1 - tile_m) * BLOCK_M - (num_row_tiles * BLOCK_M - len_q) // ROWS * ROWS
    return first


@gluon.jit
def tile_of(t, num_row_tiles, heads_q, group, heads_per_group, len_q, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """(b, h, hk, first row) of work tile t (`work_tile`, `first_row`)."""
    b, h, hk, tile_m = work_tile(t, num_row_tiles, heads_q, group, heads_per_group, CAUSAL)
    return b, h, hk, first_row(tile_m, num_row_tiles, len_q, BLOCK_M, CAUSAL)


@gluon.jit
def work_context(rules, b, h, len_q, len_k, scale_log2, RULES: gl.constexpr):
    """What the rules and the packing fix for (b, h), in raw score units (scores before the scale): a
    tuple indexed by LEN_Q, ..., BLOCK_KEY_TILES. `rules` is the kernel's (`gluon_forward_kernel`)."""
    (left, right, cap, ALIBI_PTR, alibi_sb, alibi_sh, PREFIX_PTR, SEG_Q, seg_q_sb, seg_q_sn, SEG_K, seg_k_sb,
     seg_k_sn, SEG_BLOCKS, CU_Q, CU_K) = rules
    q_start = 0
    k_start = 0
    coord_b = b
    row_blocks_of_b = gl.cdiv(len_q, ROWS)
    if RULES & VARLEN:
        q_start = gl.load(CU_Q + b)
        len_q = gl.load(CU_Q + b + 1) - q_start
        k_start = gl.load(CU_K + b)
        len_k = gl.load(CU_K + b + 1) - k_start
        coord_b = 0
    slope = 0.0
    if RULES & ALIBI:
        slope = gl.load(ALIBI_PTR + b * alibi_sb + h * alibi_sh).to(gl.float32) * (LOG2E / scale_log2)
    prefix = 0
    if RULES & PREFIX:
        prefix = gl.minimum(gl.load(PREFIX_PTR + b), len_k)
    return (len_q, len_k, q_start, k_start, coord_b, left, right, cap, 1.0 / cap, slope, prefix,
            SEG_K + b * seg_k_sb, seg_k_sn, SEG_BLOCKS + b * row_blocks_of_b * RANGE_FIELDS)


@gluon.jit
def segment_key_range(ctx, first, last):
    """[lo, hi) of the key tiles whose segment ids can meet those of rows first..last (their 64-row
    blocks' rows of `segment_tables`)."""
    SEG_BLOCKS = ctx[BLOCK_KEY_TILES]
    lo = gl.load(SEG_BLOCKS + first // ROWS * RANGE_FIELDS)
    hi = gl.load(SEG_BLOCKS + first // ROWS * RANGE_FIELDS + 1)
    for block in range(first // ROWS + 1, last // ROWS + 1):
        lo = gl.minimum(lo, gl.load(SEG_BLOCKS + block * RANGE_FIELDS))
        hi = gl.maximum(hi, gl.load(SEG_BLOCKS + block * RANGE_FIELDS + 1))
    return lo, hi


@gluon.jit
def segment_full_tiles(ctx, first, RULES: gl.constexpr):
    """[full_lo, full_hi): the key tiles whose ids all equal the one id of the 64 rows from `first` (a
    multiple of 64; rows outside the sequence take the nearest block's), so no segment masks them; every
    tile without SEGMENTS."""
    full_lo = 0
    full_hi = 2147483647
    if RULES & SEGMENTS:
        block = gl.minimum(gl.maximum(first, 0), gl.maximum(ctx[LEN_Q] - 1, 0)) // ROWS
        at = ctx[BLOCK_KEY_TILES] + block * RANGE_FIELDS
        full_lo = gl.load(at + 2)
        full_hi = gl.load(at + 3)
    return full_lo, full_hi


@gluon.jit
def key_range(m0, ctx, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, RULES: gl.constexpr,
              BLOCK_M: gl.constexpr = 128):
    """(lo, hi, full_lo, full_hi): rows [m0, m0 + BLOCK_M) of the sequence see key tiles [lo, hi), and
    every row sees every key of tiles [full_lo, full_hi) (band, prefix and segment ids aside: `needs_mask`).
    Rows that do not exist see none: those past len_q, and those before row 0 (`first_row`'s padding).
    The kernel form of `tiles.tile_segments` with `with_prefix_keys` and `with_segment_tiles`; CAUSAL: the
    window has a right bound (0 for causal), LEFT in RULES: a left one."""
    len_q, len_k = ctx[LEN_Q], ctx[LEN_K]
    left, right = ctx[LEFT_ROWS], ctx[RIGHT_ROWS]
    first = gl.maximum(m0, 0)
    last = gl.minimum(m0 + BLOCK_M, len_q) - 1
    offset = len_k - len_q
    lo_key = 0
    hi_key = len_k
    full_lo = 0
    full_hi = len_k // BLOCK_N
    if RULES & LEFT:
        lo_key = gl.maximum(first + offset - left, 0)
        full_lo = gl.cdiv(gl.maximum(last + offset - left, 0), BLOCK_N)
    if CAUSAL:
        hi_key = gl.minimum(last + offset + right + 1, len_k)
        full_hi = gl.minimum(full_hi, gl.maximum(m0 + offset + right + 1, 0) // BLOCK_N)
    hi_key = gl.maximum(hi_key, 0)
    lo = gl.minimum(lo_key, hi_key) // BLOCK_N
    hi = gl.cdiv(hi_key, BLOCK_N)
    if RULES & PREFIX:
        prefix = ctx[PREFIX_KEYS]
        lo = gl.where(prefix > 0, 0, lo)
        hi = gl.maximum(hi, gl.cdiv(prefix, BLOCK_N))
    if RULES & SEGMENTS:
        seg_lo, seg_hi = segment_key_range(ctx, gl.minimum(first, len_q - 1), gl.minimum(gl.maximum(last, first),
                                                                                           len_q - 1))
        lo = gl.maximum(lo, seg_lo * (KEY_TILE // BLOCK_N))
        hi = gl.minimum(hi, seg_hi * (KEY_TILE // BLOCK_N))
    hi = gl.where(first <= last, hi, 0)
    lo = gl.minimum(lo, hi)
    full_lo = gl.minimum(gl.maximum(full_lo, lo), hi)
    full_hi = gl.minimum(gl.maximum(full_hi, full_lo), hi)
    return lo, hi, full_lo, full_hi


@gluon.jit
def forward_load_partition(loads, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr,
                           RULES: gl.constexpr):
    """Producer warp: for each work tile of this program (PERSISTENT), or for tile program_id, its Q
    into a Q buffer (once the consumers stored the out it held), then its K/V through the ring."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, heads_q, batch_heads, group, num_row_tiles,
     heads_per_group, len_q, len_k, scale_log2, rules) = loads
    if PERSISTENT:
        ring0 = 0
        for t in range(gl.program_id(0), num_row_tiles * batch_heads, gl.num_programs(0)):
            i = (t - gl.program_id(0)) // gl.num_programs(0)
            ring0 += load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, t, i, ring0, heads_q,
                               group, num_row_tiles, heads_per_group, len_q, len_k, scale_log2, rules, CONSUMERS,
                               CAUSAL, RULES)
    else:
        load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, gl.program_id(0), 0, 0, heads_q, group,
                  num_row_tiles, heads_per_group, len_q, len_k, scale_log2, rules, CONSUMERS, CAUSAL, RULES)


@gluon.jit
def load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, t, i, ring0, heads_q, group, num_row_tiles,
              heads_per_group, len_q, len_k, scale_log2, rules, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
              RULES: gl.constexpr):
    """Work tile t, the i-th of this program: Q into buffer i % Q_BUFFERS, K/V from ring position ring0.
    Returns the number of key tiles."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    BLOCK_M: gl.constexpr = CONSUMERS * ROWS
    b, h, hk, tile_m = work_tile(t, num_row_tiles, heads_q, group, heads_per_group, CAUSAL)
    ctx = work_context(rules, b, h, len_q, len_k, scale_log2, RULES)
    m0 = first_row(tile_m, num_row_tiles, ctx[LEN_Q], BLOCK_M, CAUSAL)
    lo, hi, _, _ = key_range(m0, ctx, k_smem.shape[1], CAUSAL, RULES, BLOCK_M)
    mbarrier.wait(q_empty.index(i % Q_BUFFERS), ((i // Q_BUFFERS) & 1) ^ 1)
    load_q(q_desc, q_smem, (i % Q_BUFFERS) * CONSUMERS, q_ready.index(i % Q_BUFFERS), ctx[DESC_BATCH], h, m0, CONSUMERS,
           ctx[Q_START])
    load_kv_ring(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, ctx[DESC_BATCH], hk, ring0, hi - lo,
                 lo, ctx[K_START])
    return hi - lo


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
def smaller(a, b):
    return gl.minimum(a, b)


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
def fast_tanh(x):
    """tanh on the SFU (one MUFU.TANH; absolute error below 2^-10.7): the softcap's."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def column_positions(s, tile):
    """Positions of the columns of score tile s, the tile-th of its width: the keys of S, the queries of S^T."""
    BLOCK_N: gl.constexpr = s.shape[1]
    return tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))


@gluon.jit
def modified_scores(s, rows, tile, ctx, p_layout: gl.constexpr, CAUSAL: gl.constexpr, RULES: gl.constexpr):
    """Raw scores s of key tile `tile` after the softcap, then ALiBi (`rule_scores`). Where ALiBi's distance
    splits (`splits_alibi`), it adds only slope * (key - the tile's first key) here: `softmax_tile`
    subtracts the row term slope * (diagonal - that key). At d = 64 (P's wgmma is 64 wide) ALiBi's
    positions convert to float32 once per row and column rather than its distance once per score, which
    measured faster there (not at d = 128)."""
    if RULES & SOFTCAP and not RULES & ALIBI:  # tanh(s / cap) alone: `attend_rows` folds the cap into the scale
        return fast_tanh(s * ctx[INV_CAP])
    if splits_alibi(CAUSAL, RULES, p_layout):
        s, _ = rule_scores(s, 0, 0, ctx, RULES & SOFTCAP)
        return gl.expand_dims(int_as_float(column_positions(s, 0)), 0) * ctx[SLOPE] + s
    diagonal = rows + (ctx[LEN_K] - ctx[LEN_Q])
    keys = column_positions(s, tile)
    if p_layout.parent.instr_shape[1] == 64:
        diagonal, keys = diagonal.to(gl.float32), keys.to(gl.float32)
    s, _ = rule_scores(s, gl.expand_dims(diagonal, 1), gl.expand_dims(keys, 0), ctx, RULES)
    return s


@gluon.jit
def int_as_float(n):
    """int32 n, |n| < 2^22, as float32 (exact), by adding it to the bits of 1.5 * 2^23 and
    subtracting that float: an integer and a float add on full-rate pipes, where I2F runs at a quarter of
    their rate on Hopper, beside exp2's MUFU. Floats pass through."""
    if n.dtype.is_floating():
        return n
    return (n + INT_AS_FLOAT).to(gl.float32, bitcast=True) - 12582912.0


@gluon.jit
def rule_scores(s, diagonal, k_pos, ctx, RULES: gl.constexpr):
    """Raw scores s of keys k_pos for queries whose own key position is `diagonal` (q + Nk - Nq; each
    broadcast against s, in either orientation) after the softcap, then ALiBi (the SPEC's order), in raw
    units: softcap / scale and slope / scale (`work_context`); and the softcap's derivative 1 - tanh^2
    (1.0 without one)."""
    slope_of_cap = 1.0
    if RULES & SOFTCAP:
        capped = fast_tanh(s * ctx[INV_CAP])
        s = ctx[CAP] * capped
        slope_of_cap = 1.0 - capped * capped
    if RULES & ALIBI:
        s = s - ctx[SLOPE] * gl.abs(int_as_float(diagonal - k_pos))
    return s, slope_of_cap


@gluon.jit
def masked_scores(s, rows, tile, ctx, row_ids, CAUSAL: gl.constexpr, RULES: gl.constexpr):
    """Scores s of key tile `tile`, -inf where rows may not see the key (`allowed_pairs`)."""
    len_q, len_k = ctx[LEN_Q], ctx[LEN_K]
    keys = column_positions(s, tile)
    cols = gl.expand_dims(keys, 0)
    if RULES == 0:
        if CAUSAL:
            last_col = gl.minimum(rows + (len_k - len_q), len_k - 1)
            s = gl.where(cols <= gl.expand_dims(last_col, 1), s, float("-inf"))
        else:
            s = gl.where(cols < len_k, s, float("-inf"))
    else:
        key_ids = keys
        if RULES & SEGMENTS:
            key_ids = gl.load(ctx[KEY_IDS] + keys * ctx[KEY_IDS_STRIDE], mask=keys < len_k, other=0)
        allowed = allowed_pairs(gl.expand_dims(rows, 1), cols, gl.expand_dims(row_ids, 1),
                                gl.expand_dims(key_ids, 0), ctx, CAUSAL, RULES)
        s = gl.where(allowed, s, float("-inf"))
    return s


@gluon.jit
def allowed_pairs(q_pos, k_pos, q_ids, k_ids, ctx, CAUSAL: gl.constexpr, RULES: gl.constexpr):
    """Whether query q_pos may see key k_pos (all broadcast, either orientation): the key exists and lies
    inside the window (bottom-right; CAUSAL: a right bound) or the prefix, and (SEGMENTS) q_ids = k_ids."""
    diagonal = q_pos + (ctx[LEN_K] - ctx[LEN_Q])
    allowed = k_pos < ctx[LEN_K]
    if CAUSAL:
        allowed = allowed & (k_pos <= diagonal + ctx[RIGHT_ROWS])
    if RULES & LEFT:
        allowed = allowed & (k_pos >= diagonal - ctx[LEFT_ROWS])
    if RULES & PREFIX:
        allowed = allowed | (k_pos < ctx[PREFIX_KEYS])
    if RULES & SEGMENTS:
        allowed = allowed & (q_ids == k_ids)
    return allowed


@gluon.jit
def needs_mask(tile, full_lo, full_hi, ctx, segment_full, RULES: gl.constexpr):
    """Whether some row of the warpgroup may not see some key of tile `tile`: outside the band's full
    tiles and the prefix's, or (SEGMENTS) outside segment_full, the tiles of the rows' one id alone
    (`segment_full_tiles`)."""
    masked = (tile < full_lo) | (tile >= full_hi)
    if RULES & PREFIX:
        masked = masked & (tile >= ctx[PREFIX_KEYS] // KEY_TILE)
    if RULES & SEGMENTS:
        masked = masked | (tile < segment_full[0]) | (tile >= segment_full[1])
    return masked


@gluon.jit
def softmax_tile(s, m_i, l_i, rows, tile, ctx, row_ids, bounds, scale_log2, dtype: gl.constexpr,
                 p_layout: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, RULES: gl.constexpr):
    """Fold raw scores s of key tile `tile` into (m_i, l_i); returns P (dot operand), new m, l, alpha.
    MASK: UNMASKED, MASKED, or MASKED_FROM_FULL (masked where `needs_mask` says, bounds =
    (full_lo, full_hi, `segment_full_tiles`))."""
    s = modified_scores(s, rows, tile, ctx, p_layout, CAUSAL, RULES)
    if MASK == MASKED:
        s = masked_scores(s, rows, tile, ctx, row_ids, CAUSAL, RULES)
    if MASK == MASKED_FROM_FULL:
        if needs_mask(tile, bounds[0], bounds[1], ctx, bounds[2], RULES):
            s = masked_scores(s, rows, tile, ctx, row_ids, CAUSAL, RULES)
    tile_max = gl.reduce(s, 1, larger)
    if splits_alibi(CAUSAL, RULES, p_layout):  # ALiBi's row term (`modified_scores`)
        row_term = ctx[SLOPE] * int_as_float(rows + (ctx[LEN_K] - ctx[LEN_Q]) - tile * s.shape[1])
        tile_max = tile_max - row_term
    m_new = gl.maximum(m_i, tile_max)
    m_shift = m_new
    if MASK != UNMASKED:  # no allowed key yet: shift by 0, keep m = -inf (`forward_kernel.forward_segment`)
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    m_scaled = m_shift * scale_log2
    alpha = gl.exp2(m_i * scale_log2 - m_scaled)
    shift = m_scaled
    if splits_alibi(CAUSAL, RULES, p_layout):
        shift = m_scaled + row_term * scale_log2
    p = gl.exp2(s * scale_log2 - gl.expand_dims(shift, 1))
    l_i = l_i * alpha + gl.reduce(p, 1, plus)
    p = gl.convert_layout(paired_cast(p, dtype), p_layout)
    return p, m_new, l_i, alpha


@gluon.jit
def pipelined_step(half: gl.constexpr, q, k_smem, v_smem, bars, s_regs, p, acc, m_i, l_i, rows, tile, r, ctx,
                   row_ids, bounds, scale_log2, p_layout: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr,
                   PINGPONG: gl.constexpr, RULES: gl.constexpr):
    """Key tile `tile` (ring position r): S = Q K^T and O += P_prev V_prev in flight together, softmax of
    S under the second.

    s_regs (the consumed previous S) is reused as the first wgmma's result registers.
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
    p_new, m_i, l_i, alpha = softmax_tile(s, m_i, l_i, rows, tile, ctx, row_ids, bounds, scale_log2, v_smem.dtype,
                                          p_layout, MASK, CAUSAL, RULES)
    acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
    release(v_empty, r - 1, STAGES)
    alpha = gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))
    acc = acc * gl.expand_dims(alpha, 1)
    return s, p_new, acc, m_i, l_i


@gluon.jit
def row_segments(rows, ctx, rules, b, RULES: gl.constexpr):
    """The segment ids of `rows` (SEGMENTS), and their (least, greatest) over the rows that exist."""
    SEG_Q, seg_q_sb, seg_q_sn = rules[7], rules[8], rules[9]
    return position_segments(rows, ctx[LEN_Q], SEG_Q + b * seg_q_sb, seg_q_sn, RULES)


@gluon.jit
def position_segments(positions, n, IDS, stride, RULES: gl.constexpr):
    """The segment ids at `positions` of a sequence of n (SEGMENTS; ids at IDS, `stride` apart), and their
    (least, greatest) over the positions in [0, n)."""
    ids = positions
    id_range = (0, 0)
    if RULES & SEGMENTS:
        exists = (positions >= 0) & (positions < n)
        ids = gl.load(IDS + positions * stride, mask=exists, other=0)
        id_range = (gl.reduce(gl.where(exists, ids, 2147483647), 0, smaller),
                    gl.reduce(gl.where(exists, ids, -2147483647), 0, larger))
    return ids, id_range


@gluon.jit
def with_sink(acc, m_i, l_i, SINKS_PTR, h, scale_log2):
    """Fold the virtual sink key (logit sinks[h], value 0) into the summary, as `exattn.algebra.merge`
    with (sink, 1, 0), in raw units: a row with no allowed key ends at (sink, 1, 0)."""
    sink = gl.load(SINKS_PTR + h).to(gl.float32) * (LOG2E / scale_log2)
    m_new = gl.maximum(m_i, sink)
    alpha = gl.exp2((m_i - m_new) * scale_log2)
    l_i = l_i * alpha + gl.exp2((sink - m_new) * scale_log2)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    return acc, m_new, l_i


@gluon.jit
def attend_rows(half: gl.constexpr, q, k_smem, v_smem, bars, o_desc, O, LSE, lse_stride, b, h, m0, heads_q, ring0,
                ctx, rules, SINKS_PTR, scale_log2, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
                PINGPONG: gl.constexpr, ONE_KEY_LOOP: gl.constexpr, RULES: gl.constexpr):
    """Rows m0 + 64*half + [0, 64) of (b, h) against the key tiles at ring positions ring0, ...: writes
    their lse, and their out into q's slot (TMA store, waited for), or, for a packed sequence's last
    ragged block, straight from registers. Returns the number of key tiles loaded for the work tile;
    under causal these rows may see fewer (`skip_tiles`)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    DV: gl.constexpr = v_smem.shape[2]
    BLOCK_M: gl.constexpr = CONSUMERS * ROWS
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(DV)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars
    len_q = ctx[LEN_Q]
    if RULES & SOFTCAP and not RULES & ALIBI:  # scores in units of the cap (`modified_scores`)
        scale_log2 = scale_log2 * ctx[CAP]

    lo, hi, _, _ = key_range(m0, ctx, BLOCK_N, CAUSAL, RULES, BLOCK_M)
    if PINGPONG:  # every warpgroup takes its turn at every key tile
        _, own_hi, full_lo, full_hi = key_range(m0, ctx, BLOCK_N, CAUSAL, RULES, BLOCK_M)
    else:
        _, own_hi, full_lo, full_hi = key_range(m0 + half * ROWS, ctx, BLOCK_N, CAUSAL, RULES, ROWS)
    own_tiles = gl.maximum(own_hi - lo, 0)
    rows = m0 + half * ROWS + gl.arange(0, ROWS, layout=row_layout)
    row_ids, _ = row_segments(rows, ctx, rules, b, RULES)
    bounds = (full_lo, full_hi, segment_full_tiles(ctx, m0 + half * ROWS, RULES))
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
        p, m_i, l_i, alpha = softmax_tile(s, m_i, l_i, rows, lo, ctx, row_ids, bounds, scale_log2, v_smem.dtype,
                                          p_layout, MASKED, CAUSAL, RULES)
        if ONE_KEY_LOOP:  # one code copy of the step: tiles that need it branch to the mask
            for j in range(1, own_tiles):
                s, p, acc, m_i, l_i = pipelined_step(half, q, k_smem, v_smem, bars, s, p, acc, m_i, l_i, rows,
                                                     lo + j, ring0 + j, ctx, row_ids, bounds, scale_log2,
                                                     p_layout, MASKED_FROM_FULL, CAUSAL, PINGPONG, RULES)
        else:
            gl.static_assert((RULES | VARLEN) == VARLEN, "score rules take the one key loop")
            for j in range(1, full_hi):
                s, p, acc, m_i, l_i = pipelined_step(half, q, k_smem, v_smem, bars, s, p, acc, m_i, l_i, rows,
                                                     j, ring0 + j, ctx, row_ids, bounds, scale_log2, p_layout, UNMASKED,
                                                     CAUSAL, PINGPONG, RULES)
            for j in range(gl.maximum(full_hi, 1), own_tiles):
                s, p, acc, m_i, l_i = pipelined_step(half, q, k_smem, v_smem, bars, s, p, acc, m_i, l_i, rows,
                                                     j, ring0 + j, ctx, row_ids, bounds, scale_log2, p_layout, MASKED,
                                                     CAUSAL, PINGPONG, RULES)
        last = ring0 + own_tiles - 1
        wait_ready(v_ready, last, STAGES)
        acc = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        release(v_empty, last, STAGES)
    if RULES & SINKS:
        acc, m_i, l_i = with_sink(acc, m_i, l_i, SINKS_PTR, h, scale_log2)

    has_mass = l_i != 0.0  # NaN counts as mass, so NaN propagates
    safe_l = gl.where(has_mass, l_i, 1.0)
    lse = gl.where(has_mass, (m_i * scale_log2 + gl.log2(safe_l)) * LN2, float("-inf"))
    q_start = ctx[Q_START]
    gl.store(LSE + (ctx[DESC_BATCH] * heads_q + h).to(gl.int64) * lse_stride + q_start + rows, lse,
             mask=(rows >= 0) & (rows < len_q))
    inv_l = gl.convert_layout(gl.where(has_mass, 1.0 / safe_l, 0.0), gl.SliceLayout(1, o_layout))
    out = acc * gl.expand_dims(inv_l, 1)
    row0 = m0 + half * ROWS
    if (row0 >= 0) & (row0 < len_q):  # not a causal tile's padding block (`first_row`), nor past the rows
        if RULES & VARLEN:
            if row0 + ROWS > len_q:  # a TMA box would write into the next sequence
                store_ragged_rows(O, out, q_start, row0, len_q, heads_q, h)
            else:
                store_rows(q, out, o_desc, ctx[DESC_BATCH], h, q_start + row0)
        else:
            store_rows(q, out, o_desc, ctx[DESC_BATCH], h, row0)
    skip_tiles(k_smem, bars, ring0 + own_tiles, ring0 + hi - lo)
    tma.store_wait(0)
    return hi - lo


@gluon.jit
def store_rows(o_smem, out, o_desc, b, h, row):
    """out into rows row + [0, 64) of (b, h) by TMA, through o_smem (Q's slot: free once the last S
    wgmma is done); `attend_rows` waits for the store."""
    o_smem.store(paired_cast(out, o_smem.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, row, 0], as_box(o_smem, o_desc))


@gluon.jit
def store_ragged_rows(O, out, q_start, row0, len_q, heads_q, h):
    """Rows row0 + [0, 64) of out (those below len_q) into the packed (total_q, Hq, Dv) O."""
    DV: gl.constexpr = out.shape[1]
    rows = gl.expand_dims(row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out.type.layout)), 1)
    cols = gl.expand_dims(gl.arange(0, DV, layout=gl.SliceLayout(0, out.type.layout)), 0)
    at = ((q_start + rows).to(gl.int64) * heads_q + h) * DV + cols
    gl.store(O + at, paired_cast(out, O.dtype.element_ty), mask=rows + cols * 0 < len_q)


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
def compute_partition(half: gl.constexpr, work, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                      PERSISTENT: gl.constexpr, ONE_KEY_LOOP: gl.constexpr, RULES: gl.constexpr):
    """Consumer warpgroup `half`: rows 64*half + [0, 64) of each work tile of this program (PERSISTENT),
    or of tile program_id, Q from the buffer the producer filled (two, alternating); the buffer is
    handed back once the out is stored. `work`: the kernel's run-time values (`gluon_forward_kernel`)."""
    (q_smem, k_smem, v_smem, bars, o_desc, O, LSE, lse_stride, heads_q, batch_heads, group, num_row_tiles,
     heads_per_group, len_q, len_k, scale_log2, rules, SINKS_PTR) = work
    CONSUMERS: gl.constexpr = q_smem.shape[0] // bars[0].shape[0]
    if PERSISTENT:
        ring0 = 0
        for t in range(gl.program_id(0), num_row_tiles * batch_heads, gl.num_programs(0)):
            i = (t - gl.program_id(0)) // gl.num_programs(0)
            ring0 += attend_tile(half, q_smem, k_smem, v_smem, bars, o_desc, O, LSE, lse_stride, t, i, ring0,
                                 heads_q, group, num_row_tiles, heads_per_group, len_q, len_k, scale_log2, rules,
                                 SINKS_PTR, CONSUMERS, CAUSAL, PINGPONG, ONE_KEY_LOOP, RULES)
    else:
        attend_tile(half, q_smem, k_smem, v_smem, bars, o_desc, O, LSE, lse_stride, gl.program_id(0), 0, 0, heads_q,
                    group, num_row_tiles, heads_per_group, len_q, len_k, scale_log2, rules, SINKS_PTR, CONSUMERS,
                    CAUSAL, PINGPONG, ONE_KEY_LOOP, RULES)


@gluon.jit
def attend_tile(half: gl.constexpr, q_smem, k_smem, v_smem, bars, o_desc, O, LSE, lse_stride, t, i, ring0, heads_q,
                group, num_row_tiles, heads_per_group, len_q, len_k, scale_log2, rules, SINKS_PTR,
                CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, ONE_KEY_LOOP: gl.constexpr,
                RULES: gl.constexpr):
    """Work tile t, the i-th of this program, its key tiles from ring position ring0: `attend_rows` with
    Q from buffer i % Q_BUFFERS, handed back after. Returns the number of key tiles."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched = bars
    b, h, _, tile_m = work_tile(t, num_row_tiles, heads_q, group, heads_per_group, CAUSAL)
    ctx = work_context(rules, b, h, len_q, len_k, scale_log2, RULES)
    m0 = first_row(tile_m, num_row_tiles, ctx[LEN_Q], CONSUMERS * ROWS, CAUSAL)
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    wait_ready(q_ready, i, Q_BUFFERS)
    num_tiles = attend_rows(half, q_smem.index((i % Q_BUFFERS) * CONSUMERS + half), k_smem, v_smem, bars, o_desc, O,
                            LSE, lse_stride, b, h, m0, heads_q, ring0, ctx, rules, SINKS_PTR, scale_log2, CONSUMERS,
                            CAUSAL, PINGPONG, ONE_KEY_LOOP, RULES)
    release(q_empty, i, Q_BUFFERS)
    return num_tiles


@gluon.jit(do_not_specialize=COUNTS)
def gluon_forward_kernel(
    q_desc, k_desc, v_desc, o_desc, O, LSE, lse_stride, heads_q, batch_heads, group, len_q, len_k, num_row_tiles,
    heads_per_group, scale_log2, left, right, softcap, ALIBI_PTR, alibi_sb, alibi_sh, SINKS_PTR, PREFIX_PTR,
    SEG_Q, seg_q_sb, seg_q_sn, SEG_K, seg_k_sb, seg_k_sn, SEG_BLOCKS, CU_Q, CU_K,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PERSISTENT: gl.constexpr, ONE_KEY_LOOP: gl.constexpr, RULES: gl.constexpr,
):
    """Grid: (programs,): one per work tile, or (PERSISTENT) fewer, each striding over the
    num_row_tiles * B * Hq work tiles (`work_tile`; heads_per_group: the causal order's group size).
    Descriptors (`tile_descriptor`): q, o (B, Hq, Nq, D) with [1, 1, 64, D] boxes, k, v (B, Hk, Nk, D)
    with [1, 1, BLOCK_N, D] boxes; o in q's dtype. LSE: (B, Hq, Nq) float32, natural log, rows
    lse_stride apart. RULES (bits, `rule_bits`): the window's left bound, a right bound other than 0
    (CAUSAL: any right bound), softcap (raw units: softcap / scale), ALiBi slopes (B, Hq) at ALIBI_PTR,
    sinks (Hq,), prefix (B,), segment
    ids (B, Nq) and (B, Nk) with their 64-row blocks' key-tile ranges SEG_BLOCKS (`segment_tables`),
    and VARLEN: sequence b owns rows CU_Q[b]:CU_Q[b+1] of the
    (1, Hq, total_q, D) views (CU_K: of K/V), len_q and len_k being the longest, O the packed out.
    """
    dtype: gl.constexpr = q_desc.dtype
    D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    gl.static_assert((BLOCK_N == KEY_TILE) | ((RULES & (PREFIX | SEGMENTS)) == 0),
                     "a prefix and segment ids take key tiles of KEY_TILE rows (`needs_mask`, `segment_tables`)")
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
    rules = (left, right, softcap, ALIBI_PTR, alibi_sb, alibi_sh, PREFIX_PTR, SEG_Q, seg_q_sb, seg_q_sn, SEG_K,
             seg_k_sb, seg_k_sn, SEG_BLOCKS, CU_Q, CU_K)

    # Run-time values travel as one tuple; the constexprs are written out in each entry (a constexpr
    # inside a tuple bound to a name would reach the partitions as a run-time value).
    work = (q_smem, k_smem, v_smem, bars, o_desc, O, LSE, lse_stride, heads_q, batch_heads, group, num_row_tiles,
            heads_per_group, len_q, len_k, scale_log2, rules, SINKS_PTR)
    loads = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, heads_q, batch_heads, group, num_row_tiles,
             heads_per_group, len_q, len_k, scale_log2, rules)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (compute_partition, (0, work, CAUSAL, PINGPONG, PERSISTENT, ONE_KEY_LOOP, RULES)),
            (compute_partition, (1, work, CAUSAL, PINGPONG, PERSISTENT, ONE_KEY_LOOP, RULES)),
            (forward_load_partition, (loads, CONSUMERS, CAUSAL, PERSISTENT, RULES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (compute_partition, (0, work, CAUSAL, PINGPONG, PERSISTENT, ONE_KEY_LOOP, RULES)),
            (compute_partition, (1, work, CAUSAL, PINGPONG, PERSISTENT, ONE_KEY_LOOP, RULES)),
            (compute_partition, (2, work, CAUSAL, PINGPONG, PERSISTENT, ONE_KEY_LOOP, RULES)),
            (forward_load_partition, (loads, CONSUMERS, CAUSAL, PERSISTENT, RULES)),
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


def gluon_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, params: AttentionParams,
                   rules=None, packing=None) -> list[str]:
    """Every reason `gluon_forward` cannot serve these inputs (empty if it can). packing: q, k, v are
    packed token-major (total, H, d) (`passes.Packing`)."""
    if packing is not None:
        q, k, v = (packed_view(x) for x in (q, k, v))
    reasons = gluon_device_reasons(q.device)
    if q.dtype not in DTYPES:
        reasons.append(f"dtype {q.dtype} is not float16 or bfloat16")
    if q.shape[-1] != v.shape[-1] or q.shape[-1] not in HEAD_DIMS:
        reasons.append(f"head dims D={q.shape[-1]}, Dv={v.shape[-1]}: need D = Dv in {HEAD_DIMS}")
    if mask is not None:
        reasons.append("a user mask is not supported")
    if params.dropout_p > 0:
        reasons.append(f"dropout_p={params.dropout_p} is not supported (only 0)")
    if not (math.isfinite(params.scale) and params.scale > 0):
        reasons.append(f"scale={params.scale} must be positive and finite")
    if params.block_m is not None or params.block_n is not None:
        reasons.append(f"tiles are fixed; got block_m={params.block_m}, block_n={params.block_n}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        reasons.append(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    longest = max(q.shape[2], k.shape[2])
    if rules is not None and rules.alibi_slopes is not None and longest > FLOAT_POSITIONS:
        reasons.append(f"ALiBi takes positions in float32, exact up to {FLOAT_POSITIONS} rows and keys; "
                       f"got {longest}")
    if k.shape[2] == 0 and rules is not None and rules.sinks is not None:
        reasons.append("no keys: sinks alone are the Triton kernel's")
    if not tma_compatible(q, k, v):
        reasons.append("strides are not TMA-compatible (16-byte aligned base and rows, unit last stride)")
    return reasons + broadcast_reasons(q=q, k=k, v=v)


def packed_view(x: torch.Tensor) -> torch.Tensor:
    """A packed (total, H, d) tensor as the (1, H, total, d) view the descriptors cover."""
    return x.unsqueeze(0).transpose(1, 2)


def gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams, rules=None,
                  packing=None):
    """out (B, Hq, Nq, D) in q's dtype and lse (B, Hq, Nq) float32, natural log; with `packing`, out
    (total_q, Hq, D) and lse (Hq, total_q). rules: a `ScoreRules` (None: none)."""
    reasons = gluon_supports(q, k, v, None, params, rules, packing)
    if reasons:
        raise ValueError("gluon_forward cannot serve these inputs: " + "; ".join(reasons))
    return run_gluon_forward(q, k, v, params, rules, packing)


def run_gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams, rules=None,
                      packing=None):
    """`gluon_forward` for inputs already checked with `gluon_supports`."""
    with on_device(q):
        return launch(q, k, v, params, rules, packing)


def launch(q, k, v, params: AttentionParams, rules, packing):
    q, params = with_positive_scale(q, params)  # the kernel scales each tile's row maximum of raw scores
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if packing is None:
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        views = (q, k, v, out)
    else:
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        views = tuple(packed_view(x) for x in (q, k, v, out))
    if out.numel() == 0 or k.numel() == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    causal = params.window[1] != UNBOUNDED
    bits = rule_bits(params, rules, packing)
    cfg = launch_config(q, k, causal, bits, packing)
    args, grid = forward_arguments(*views, lse, scalar_args(params)["scale_log2"], causal, packing=packing,
                                   rule_tensors=rule_arguments(views[0], views[1], params, rules, packing), cfg=cfg)
    run_kernel(gluon_forward_kernel, grid, *args, **kernel_constants(q.shape[-1], causal, bits, cfg))
    return out, lse


def launch_config(q: torch.Tensor, k: torch.Tensor, causal: bool, rules: int, packing) -> GluonConfig:
    """`forward_config` for q and k as `launch` takes them: (B, H, N, D), or packed (total, H, D), whose
    sequences all have the longest one's length where the totals say so."""
    if packing is None:
        return forward_config(q.shape[-1], q.shape[-2], k.shape[-2], causal, rules)
    return forward_config(q.shape[-1], packing.max_q, packing.max_k, causal, rules, not packing.equal_lengths(q, k))


def forward_config(dim: int, len_q: int, len_k: int, causal: bool, rules: int, ragged: bool = False) -> GluonConfig:
    """The kernel's schedule: SHORT_CONFIGS[dim] for a problem without score rules (packing aside: the
    lengths are then the longest sequence's) whose rows see at most SHORT_MEAN_KEYS keys on average,
    else CONFIGS[dim]. ragged: packed sequences of unequal lengths, whose short schedule is
    RAGGED_SHORT_CONFIGS[dim] (equal ones are the dense problem)."""
    short = RAGGED_SHORT_CONFIGS if ragged else SHORT_CONFIGS
    if rules & ~VARLEN.value or dim not in short:
        return CONFIGS[dim]
    mean_keys = len_k - len_q // 2 if causal else len_k
    return short[dim] if mean_keys <= SHORT_MEAN_KEYS else CONFIGS[dim]


def rule_bits(params: AttentionParams, rules, packing) -> int:
    """The kernel's RULES: a bit for each score rule in use, the window's left bound, a right bound other
    than causal's, and packing."""
    on = dict(left=params.window[0] != UNBOUNDED, right=params.window[1] not in (UNBOUNDED, 0),
              softcap=params.softcap > 0, varlen=packing is not None)
    if rules is not None:
        on.update(alibi=rules.alibi_slopes is not None, sinks=rules.sinks is not None,
                  prefix=rules.prefix is not None, segments=rules.q_segment_ids is not None)
    bit = dict(left=LEFT, right=RIGHT, softcap=SOFTCAP, alibi=ALIBI, sinks=SINKS, prefix=PREFIX, segments=SEGMENTS,
               varlen=VARLEN)
    return sum(bit[name].value for name, is_on in on.items() if is_on)


def rule_arguments(q, k, params: AttentionParams, rules, packing) -> tuple:
    """The kernel's arguments from `left` to `CU_K` (placeholders where a rule is off): the window in
    rows, the softcap in raw units, and the rules' tensors with their strides."""
    left, right = (max(bound, 0) for bound in params.window)
    softcap = params.softcap / params.scale if params.softcap > 0 else 0.0
    rules = rules or ScoreRules()
    alibi, sinks, prefix, seg_q, seg_k = (rules.alibi_slopes, rules.sinks, rules.prefix, rules.q_segment_ids,
                                          rules.k_segment_ids)
    seg_blocks = segment_tables(seg_q, seg_k) if seg_q is not None else None
    cu_q, cu_k = (packing.cu_q, packing.cu_k) if packing is not None else (None, None)
    placeholder = q

    def given(x):
        return placeholder if x is None else x

    def strides(x):
        return (0, 0) if x is None else x.stride()

    return (left, right, softcap, given(alibi), *strides(alibi), given(sinks), given(prefix), given(seg_q),
            *strides(seg_q), given(seg_k), *strides(seg_k), given(seg_blocks), given(cu_q), given(cu_k))


def segment_tables(q_ids: torch.Tensor, k_ids: torch.Tensor) -> torch.Tensor:
    """int32 (B, Nq / 64, 4): each 64-row block's key tiles [lo, hi) whose ids can meet its own, and
    [full_lo, full_hi) those of its one id alone (`segment_tile_ranges`). On the device, O(B * N / 64)."""
    return segment_tile_ranges(q_ids, k_ids, ROWS.value, KEY_TILE.value)


def forward_arguments(q, k, v, out, lse, scale_log2: float, causal: bool, programs: int | None = None,
                      packing=None, rule_tensors: tuple | None = None, cfg: GluonConfig | None = None) -> tuple:
    """Positional arguments of `gluon_forward_kernel`, and its grid: `programs` (default: one per
    work tile, or on a persistent grid one per SM) striding over the work tiles. q, k, v, out are
    (B, H, N, D), or with `packing` the (1, H, total, D) views of the packed tensors; rule_tensors:
    `rule_arguments` (default: no rule); cfg: the schedule (default CONFIGS[D])."""
    heads_q, dim = q.shape[1], q.shape[3]
    heads_k = k.shape[1]
    if packing is None:
        batch, len_q, len_k, lse_stride = q.shape[0], q.shape[2], k.shape[2], q.shape[2]
    else:
        batch, len_q, len_k, lse_stride = packing.batch, packing.max_q, packing.max_k, q.shape[2]
    cfg = cfg or CONFIGS[dim]
    row_tiles = ceil_div(len_q, cfg.consumers * ROWS.value)
    work = row_tiles * batch * heads_q
    strided = persistent_grid(cfg, causal)
    if programs is None:
        programs = min(work, multiprocessor_count(q.device)) if strided else work
    order = 1
    if causal:
        costs = schedule.causal_row_costs(len_q, len_k, cfg.consumers * ROWS.value, cfg.block_n)
        kv_bytes = 2 * len_k * dim * k.element_size() // (heads_q // heads_k)  # per query head
        order = causal_heads_per_group(costs, batch * heads_q, kv_bytes, q.device, programs if strided else None)
    if rule_tensors is None:
        rule_tensors = rule_arguments(q, k, AttentionParams(scale=1.0), None, None)
    args = (tile_descriptor(q, ROWS.value), tile_descriptor(k, cfg.block_n), tile_descriptor(v, cfg.block_n),
            tile_descriptor(out, ROWS.value), out, lse, lse_stride, heads_q, batch * heads_q, heads_q // heads_k,
            len_q, len_k, row_tiles, order, scale_log2, *rule_tensors)
    return args, (programs,)


def causal_heads_per_group(rank_costs: tuple[int, ...], batch_heads: int, head_bytes: int,
                           device: torch.device, persistent_programs: int | None = None) -> int:
    """`schedule.heads_per_group` for a grid list-scheduled on this device's SMs, or for
    `persistent_programs` striding over the tiles (1, head-major, off CUDA: compile tests)."""
    if device.type != "cuda":
        return 1
    if persistent_programs is not None:
        return schedule.heads_per_group(rank_costs, batch_heads, persistent_programs, head_bytes, strided=True)
    return schedule.heads_per_group(rank_costs, batch_heads, multiprocessor_count(device), head_bytes)


def persistent_grid(cfg: GluonConfig, causal: bool) -> bool:
    """Whether the grid is persistent: `cfg.persistent`, for full attention, and under causal masking
    with `cfg.persistent_causal` (else causal programs of one tile each, longest rows first, measured
    faster)."""
    return cfg.persistent and (not causal or cfg.persistent_causal)


def kernel_constants(dim: int, causal: bool, rules: int = 0, cfg: GluonConfig | None = None) -> dict:
    """Constexpr arguments and launch options of the kernel for head dim `dim`, RULES `rules`
    (`rule_bits`; any takes the one key loop) and schedule `cfg` (default CONFIGS[dim])."""
    cfg = cfg or CONFIGS[dim]
    if cfg.consumers not in (2, 3):
        raise ValueError(f"GluonConfig.consumers must be 2 or 3, got {cfg.consumers}")
    maxnreg, consumer_regs = register_split(cfg.consumers)
    return dict(STAGES=cfg.stages, CAUSAL=causal, PINGPONG=cfg.pingpong, PERSISTENT=persistent_grid(cfg, causal),
                ONE_KEY_LOOP=takes_one_key_loop(cfg, rules), RULES=rules,
                CONSUMERS=cfg.consumers, CONSUMER_REGS=consumer_regs, num_warps=4, maxnreg=maxnreg)


def takes_one_key_loop(cfg: GluonConfig, rules: int) -> bool:
    """Whether the kernel runs one key loop: `cfg.one_key_loop`, or any score rule (packing alone keeps
    the loop of full tiles and the loop of masked ones: its full tiles start at key tile 0)."""
    return cfg.one_key_loop or (rules | VARLEN.value) != VARLEN.value
