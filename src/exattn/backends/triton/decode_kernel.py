"""Triton kernels for split-KV decoding over contiguous or paged KV caches.

Two passes (flash-decoding):

1. `decode_split_kernel`, grid (B * Hk, num_splits, row blocks). A program
   streams one split of one sequence's keys for one K/V head and carries the
   online-softmax state (m, l, acc) of the G * Nq query rows of that head's
   group (G = Hq // Hk), so each K/V byte is read once. It writes the split's
   normalized partial output (fp32) and lse (natural log). An empty split
   (a sequence shorter than the split grid) writes 0 and -inf.
2. `decode_combine_kernel`, grid (B * Hk, G * Nq), merges the splits of a row
   (`_merge_splits`) with the rule of `exattn.algebra.merge_states`, each split
   read as the summary (m, l, u) = (lse_s, 1, out_s):

       m = max_s lse_s  (-inf stands in as 0),   w_s = exp(lse_s - m)
       out = sum_s w_s out_s / sum_s w_s,        lse = m + log sum_s w_s

   online over loads of up to MERGE_ELEMENTS partial outputs; a row whose
   splits are all empty gives out 0, lse -inf.

With one split the first pass writes the final output directly. With
`config.merge_in_split` there is no second pass: each split program, after its
stores, counts its arrival on its group's counter (atomic, acquire-release), and
the last to arrive merges the group's splits by the same rule and resets the
counter to 0.

Split rule, per sequence of length L: `chunk = ceil(ceil(L / S) / BLOCK_N) * BLOCK_N`,
split s covers keys [s * chunk, min((s + 1) * chunk, L)). Row r of a group is
query head `hk * G + r // Nq`, token `t = r % Nq`; it sees keys j <= L - Nq + t.
Paged caches: key j of sequence b is row `j % PAGE_SIZE` of page
`block_table[b, j // PAGE_SIZE]`.

Score rules (`DecodeRules`), applied to the base-2 scores in the SPEC's order: softcap, then ALiBi
(`tiles.score_mods`, the distance `L - Nq + t - j`), then the causal rule and the window's left
bound (`j >= L - Nq + t - left`). With a window the splits cover only the keys some row may see,
`[start, L)` with `start = floor((L - Nq - left) / BLOCK_N) * BLOCK_N` (at least 0), by the split
rule above (`chunk = ceil(ceil((L - start) / S) / BLOCK_N) * BLOCK_N`): a 4k window over a 128k
cache reads about 4k keys. A sequence's left padding (`cache_leftpad`, FlashAttention's) leaves out
its keys `j < leftpad` the same way: the splits cover `[start, L)` from the block holding the first
key, and the keys before it are neither loaded nor allowed. The sinks join the softmax once, in the
pass that writes the final result (the split kernel's epilogue with one split, else the merge): a
virtual split of lse `sinks[h]` and output 0.

Inputs are never trusted for addresses: each length is clamped to `[0, capacity]`, each left padding
to `[0, L]` and each page id to `[0, num_pages)` before use. With VALIDATE the kernels also record the
first violation (`exattn.errors`): a length below Nq or beyond the cache and a left padding outside
`[0, L]` (split 0 of each sequence), and a page id out of range (each split the page slots of its share
of `[0, L)` by the split rule without a window, so every page a sequence uses is checked); the
programs of K/V head 0 check.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import errors
from ...problem import UNBOUNDED
from .configs import ceil_div, next_power_of_two, padded_dim
from .replay import run_kernel, stream_counters
from .tiles import LOG2E as LOG2E_IN_KERNELS
from .tiles import add_sink, finalize, score_mods

LOG2E = 1.4426950408889634
KIND: tl.constexpr = tl.constexpr(errors.KIND)
INDEX: tl.constexpr = tl.constexpr(errors.INDEX)
SLOT: tl.constexpr = tl.constexpr(errors.SLOT)
VALUE: tl.constexpr = tl.constexpr(errors.VALUE)
BOUND: tl.constexpr = tl.constexpr(errors.BOUND)
PAGE_SIZE_FIELD: tl.constexpr = tl.constexpr(errors.PAGE_SIZE)
LENGTH_BELOW_NQ: tl.constexpr = tl.constexpr(errors.LENGTH_BELOW_NQ)
LENGTH_BEYOND_CACHE: tl.constexpr = tl.constexpr(errors.LENGTH_BEYOND_CACHE)
PAGE_OUT_OF_RANGE: tl.constexpr = tl.constexpr(errors.PAGE_OUT_OF_RANGE)
LEFTPAD_OUT_OF_RANGE: tl.constexpr = tl.constexpr(errors.LEFTPAD_OUT_OF_RANGE)
NO_SLOT: tl.constexpr = tl.constexpr(2**31 - 1)
CHECK_SLOTS: tl.constexpr = tl.constexpr(64)  # page ids one validation load reads
MAX_ROWS = 64  # query rows (G * Nq) one program carries; more rows add row blocks


class DecodeConfig(NamedTuple):
    """merge_in_split: with several splits, the last split of each group to finish merges the
    group's partial results (`_merge_splits`) instead of a second kernel (`plan_launch` decides).
    gluon: on sm_90, the Gluon split kernel (`gluon_decode.py`) serves the launch where it can."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    merge_in_split: bool = False
    gluon: bool = False


def default_config(rows: int, head_dim: int, value_dim: int, fills_gpu: bool = False) -> DecodeConfig:
    """Tile sizes for G * Nq = `rows` query rows per K/V head.

    An under-filled GPU keeps two K/V blocks in flight per program (3 stages). A
    launch that fills the GPU without splitting (`fills_gpu`) keeps one (2 stages),
    so that more programs are resident (`resident_per_sm`) and fewer waves run:
    at B = 64, Hk = 8 (512 programs) on the H200, 1k keys 3.82 vs 3.44 TB/s with 3
    stages, 8k 4.40 vs 4.29, 128k 4.52-4.53 vs 4.44 (a sweep of the stage count); with
    fewer programs 2 stages read 4-6% less.
    """
    block_m = min(MAX_ROWS, padded_dim(rows))
    widest = max(padded_dim(head_dim), padded_dim(value_dim))
    block_n = 64 if widest <= 128 else 32
    return DecodeConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2 if fills_gpu else 3)


def resident_per_sm(config: DecodeConfig) -> int:
    """Split programs one H200 SM holds at once. At D = 128, 3 stages take 72 KB of
    shared memory (3 fit in 228 KB); 2 stages take 39 KB, and 4 fit in 64 K registers
    at 128 registers a thread (`register_cap`)."""
    return 4 if config.num_stages <= 2 else 3


REGISTERS_PER_SM = 65536


def register_cap(config: DecodeConfig) -> int | None:
    """Registers a thread may take (Triton's `maxnreg`) where registers bound `resident_per_sm`
    (2 stages; None where shared memory does). Uncapped, the 2-stage kernel took 142 and left
    3 programs an SM: B = 64 read 0.81-0.89x of the capped kernel's bandwidth on the H200."""
    if config.num_stages > 2:
        return None
    per_thread = REGISTERS_PER_SM // (resident_per_sm(config) * 32 * config.num_warps)
    return per_thread // 8 * 8


@triton.jit
def _key_base(n0, hi, b, BT, stride_tb, stride_tp, last_page,
              BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Batch index (contiguous) or page indices (paged) of keys n0 .. n0 + BLOCK_N (n0 a multiple
    of BLOCK_N), int32: a scalar, or one per key when a block spans pages. Keys at or past hi
    (their K/V loads are masked) read the slot of key max(hi - 1, 0), a slot of the table:
    no mask on these loads (masked, 32-key pages read 0.88-0.91x at B = 1 2k-4k). Page ids are
    clamped to [0, last_page]."""
    if PAGED:
        row = BT + b.to(tl.int64) * stride_tb
        last_slot = tl.maximum(hi - 1, 0) // PAGE_SIZE
        if PAGE_SIZE % BLOCK_N == 0:
            base = tl.load(row + tl.minimum(n0 // PAGE_SIZE, last_slot) * stride_tp)
        else:
            keys = tl.arange(0, BLOCK_N)
            if BLOCK_N % PAGE_SIZE == 0:  # the per-key part is the same for every block
                slots = n0 // PAGE_SIZE + keys // PAGE_SIZE
            else:
                slots = (n0 + keys) // PAGE_SIZE
            base = tl.load(row + tl.minimum(slots, last_slot) * stride_tp)
        base = tl.minimum(tl.maximum(base, 0), last_page)
    else:
        base = b
    return base


@triton.jit
def _key_offsets(base, n0, stride_base, stride_n,
                 BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """int64 element offsets of keys n0 .. n0 + BLOCK_N (n0 a multiple of BLOCK_N) from their head's
    origin: base * stride_base + n * stride_n (contiguous) or + (n % PAGE_SIZE) * stride_n (paged)."""
    keys = tl.arange(0, BLOCK_N).to(tl.int64)
    if not PAGED:  # scalar + the same per-key part for every block
        return (base.to(tl.int64) * stride_base + tl.cast(n0, tl.int64) * stride_n) + keys * stride_n
    start = _wide_product(base, stride_base)
    if PAGE_SIZE % BLOCK_N == 0:
        return (start + tl.cast(n0 % PAGE_SIZE, tl.int64) * stride_n) + keys * stride_n
    if BLOCK_N % PAGE_SIZE == 0:
        return start + (keys % PAGE_SIZE) * stride_n
    return start + ((n0 + keys) % PAGE_SIZE) * stride_n


@triton.jit
def _key_tile(head, base, n0, key_ok, cols, stride_base, stride_n, stride_col, N_COLS: tl.constexpr,
              BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Rows n0 .. n0 + BLOCK_N of one K/V head's cache (`head`: its origin; base: `_key_base`), columns
    `cols`; zero where not key_ok and past N_COLS."""
    rows = _key_offsets(base, n0, stride_base, stride_n, BLOCK_N, PAGED, PAGE_SIZE)
    return tl.load(head + rows[:, None] + cols[None, :] * stride_col,
                   mask=key_ok[:, None] & (cols[None, :] < N_COLS), other=0.0)


@triton.jit
def _wide_product(index, stride):
    """index * stride in int64 for a non-negative int32 index: one 32 x 32 -> 64-bit multiply
    when the stride fits 32 bits (a sign-extended product takes four)."""
    stride = tl.zeros([], tl.int32) + stride  # a tensor also where the launch made a stride of 1 a constant
    if tl.constexpr(stride.dtype.primitive_bitwidth) <= 32:
        wide = index.to(tl.uint32, bitcast=True).to(tl.uint64) * stride.to(tl.uint32, bitcast=True).to(tl.uint64)
        return wide.to(tl.int64, bitcast=True)
    return index.to(tl.int64) * stride


@triton.jit
def _split_range(start, length, split, num_splits, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) of split `split` of the keys [start, length) (start a multiple of BLOCK_N)."""
    chunk = tl.cdiv(tl.cdiv(length - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    return lo, tl.minimum(lo + chunk, length)


@triton.jit
def _row_slopes(ALIBI, stride_ab, stride_ah, b, head, row_ok, HAS_ALIBI: tl.constexpr):
    """ALiBi's slope of each row's (b, head) times log2 e, a (BLOCK_M, 1) column (0.0 without ALiBi)."""
    if HAS_ALIBI:
        at = ALIBI + b.to(tl.int64) * stride_ab + head.to(tl.int64) * stride_ah
        return (tl.load(at, mask=row_ok, other=0.0).to(tl.float32) * LOG2E_IN_KERNELS)[:, None]
    else:
        return 0.0


@triton.jit
def _score_rules(s2, keys, last_key, window_left, first_key, softcap2, slopes,
                 HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                 HAS_LEFTPAD: tl.constexpr):
    """Base-2 scores of `keys` for rows whose own key is `last_key`: softcap, then ALiBi
    (`tiles.score_mods` at distance last_key - key), then -inf where the causal rule, the
    window's left bound or the sequence's first key (`first_key`, its left padding) leaves the key out."""
    if HAS_SOFTCAP or HAS_ALIBI:
        s2, _ = score_mods(s2, last_key[:, None], keys[None, :], 0, 0, (softcap2, slopes), HAS_SOFTCAP, HAS_ALIBI)
    allowed = keys[None, :] <= last_key[:, None]
    if HAS_WINDOW:
        allowed = allowed & (keys[None, :] >= last_key[:, None] - window_left)
    if HAS_LEFTPAD:
        allowed = allowed & (keys[None, :] >= first_key)
    return tl.where(allowed, s2, float("-inf"))


@triton.jit
def _record(ERRORS, DOORBELL, kind, b, slot, value, bound, page_size):
    """The first violation on the device claims the record (`exattn.errors`), fills it in and
    sets the host's doorbell; later ones find the flag taken."""
    if tl.atomic_cas(ERRORS, 0, 1) == 0:
        tl.store(ERRORS + KIND, kind)
        tl.store(ERRORS + INDEX, b)
        tl.store(ERRORS + SLOT, slot)
        tl.store(ERRORS + VALUE, value)
        tl.store(ERRORS + BOUND, bound)
        tl.store(ERRORS + PAGE_SIZE_FIELD, page_size)
        tl.store(DOORBELL, 1)


@triton.jit
def _check_pages(ERRORS, DOORBELL, row, b, lo, hi, stride_tp, num_pages, PAGE_SIZE: tl.constexpr):
    """Record the first page id out of [0, num_pages) among the slots of keys [lo, hi) of table row `row`."""
    end = tl.cdiv(hi, PAGE_SIZE)
    for first in range(lo // PAGE_SIZE, end, CHECK_SLOTS):
        slots = first + tl.arange(0, CHECK_SLOTS)
        used = slots < end
        pages = tl.load(row + slots * stride_tp, mask=used, other=0)
        bad = tl.min(tl.where(used & ((pages < 0) | (pages >= num_pages)), slots, NO_SLOT))
        if bad != NO_SLOT:
            page = tl.sum(tl.where(slots == bad, pages, 0))
            _record(ERRORS, DOORBELL, PAGE_OUT_OF_RANGE, b, bad, page, num_pages, 0)


@triton.jit
def _check_sequence(ERRORS, DOORBELL, BT, stride_tb, stride_tp, b, hk, given, length, given_first, split, num_splits,
                    len_q, capacity, num_pages, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    HAS_LEFTPAD: tl.constexpr):
    """The programs of K/V head 0 (first row block) record sequence b's length `given` if outside
    [Nq, capacity] and its left padding `given_first` if outside [0, given] (split 0), and, paged, any
    bad page id of this split's share of [0, length) (the split rule without a window)."""
    checks = (hk == 0) & (tl.program_id(2) == 0)
    if checks & (split == 0):
        if given < len_q:
            _record(ERRORS, DOORBELL, LENGTH_BELOW_NQ, b, 0, given, len_q, 0)
        if given > capacity:
            _record(ERRORS, DOORBELL, LENGTH_BEYOND_CACHE, b, 0, given, capacity, PAGE_SIZE if PAGED else 0)
        if HAS_LEFTPAD:
            if (given_first < 0) | (given_first > given):
                _record(ERRORS, DOORBELL, LEFTPAD_OUT_OF_RANGE, b, 0, given_first, given, 0)
    if PAGED:
        lo, hi = _split_range(0, length, split, num_splits, BLOCK_N)
        if checks:
            _check_pages(ERRORS, DOORBELL, BT + b.to(tl.int64) * stride_tb, b, lo, hi, stride_tp, num_pages, PAGE_SIZE)


@triton.jit
def decode_split_kernel(
    Q, K, V, SEQLENS, BT, OUT, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_tb, stride_tp,
    heads_k, group, len_q, num_splits, qk_scale, capacity, num_pages,
    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    FINAL_OUT=None, FINAL_LSE=None, ARRIVALS=None,
    MERGE_ROWS: tl.constexpr = 0, MERGE_SPLITS: tl.constexpr = 0,
    window_left=0, softcap2=0.0, ALIBI=None, stride_ab=0, stride_ah=0, SINKS=None,
    HAS_WINDOW: tl.constexpr = False, HAS_SOFTCAP: tl.constexpr = False, HAS_ALIBI: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False, LEFTPAD=None, HAS_LEFTPAD: tl.constexpr = False,
    ERRORS=None, DOORBELL=None, VALIDATE: tl.constexpr = False,
):
    """capacity: keys a sequence can hold; num_pages: pages of a paged cache. softcap2 = softcap * log2 e;
    ALIBI: slopes (B, Hq) with strides (stride_ab, stride_ah). HAS_SINKS: this launch writes the final
    result (one split, or merged here) and folds in the sinks. LEFTPAD: int32 (B,), each sequence's first
    key (HAS_LEFTPAD). VALIDATE: record violations at
    ERRORS / DOORBELL (`exattn.errors`)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // heads_k
    hk = pid % heads_k
    given = tl.load(SEQLENS + b)
    length = tl.minimum(tl.maximum(given, 0), capacity)
    start = 0
    if HAS_WINDOW:  # key blocks before every row's window are not split over, nor read
        start = tl.maximum(length - len_q - window_left, 0) // BLOCK_N * BLOCK_N
    given_first = 0
    first_key = 0
    if HAS_LEFTPAD:  # nor those before the sequence's first key
        given_first = tl.load(LEFTPAD + b)
        first_key = tl.minimum(tl.maximum(given_first, 0), length)
        start = tl.maximum(start, first_key // BLOCK_N * BLOCK_N)
    lo, hi = _split_range(start, length, split, num_splits, BLOCK_N)

    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group * len_q
    head = hk * group + rows // len_q
    token = rows % len_q
    last_key = length - len_q + token
    slopes = _row_slopes(ALIBI, stride_ab, stride_ah, b, head, row_ok, HAS_ALIBI)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_ptrs = (Q + b.to(tl.int64) * stride_qb + head[:, None].to(tl.int64) * stride_qh
              + token[:, None] * stride_qt + d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    k_head = K + hk.to(tl.int64) * stride_kh
    v_head = V + hk.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # The page indices of the next block are read one iteration ahead, so that the
    # software pipeliner can keep several K/V blocks in flight for paged caches too.
    base = _key_base(lo, hi, b, BT, stride_tb, stride_tp, num_pages - 1, BLOCK_N, PAGED, PAGE_SIZE)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        key_ok = offs < hi
        if HAS_LEFTPAD:  # the padding's slots are never loaded (they may hold NaN)
            key_ok = key_ok & (offs >= first_key)
        next_base = _key_base(n0 + BLOCK_N, hi, b, BT, stride_tb, stride_tp, num_pages - 1, BLOCK_N, PAGED,
                              PAGE_SIZE)
        k = _key_tile(k_head, base, n0, key_ok, d, stride_kb, stride_kn, stride_kd, HEAD_DIM, BLOCK_N, PAGED, PAGE_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        s = _score_rules(s, offs, last_key, window_left, first_key, softcap2, slopes, HAS_WINDOW, HAS_SOFTCAP,
                         HAS_ALIBI, HAS_LEFTPAD)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _key_tile(v_head, base, n0, key_ok, dv, stride_vb, stride_vn, stride_vd, VALUE_DIM, BLOCK_N, PAGED,
                      PAGE_SIZE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new
        base = next_base

    if HAS_SINKS and MERGE_ROWS == 0:
        sink2 = tl.load(SINKS + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E_IN_KERNELS
        acc, m_i, l_i = add_sink(acc, m_i, l_i, sink2)
    out, lse = finalize(acc, m_i, l_i)
    out_row = ((b * heads_k * group + head).to(tl.int64) * len_q + token) * num_splits + split
    tl.store(OUT + out_row[:, None] * VALUE_DIM + dv[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < VALUE_DIM))
    tl.store(LSE + out_row, lse, mask=row_ok)
    if VALIDATE:
        _check_sequence(ERRORS, DOORBELL, BT, stride_tb, stride_tp, b, hk, given, length, given_first, split,
                        num_splits, len_q, capacity, num_pages, BLOCK_N, PAGED, PAGE_SIZE, HAS_LEFTPAD)
    if MERGE_ROWS > 0:
        # The last split of this group to arrive merges them all; its arrival (after a barrier
        # behind every thread's stores) acquires the other splits' results.
        tl.debug_barrier()
        arrivals = ARRIVALS + pid * tl.num_programs(2) + tl.program_id(2)
        if tl.atomic_add(arrivals, 1, sem="acq_rel") == num_splits - 1:
            tl.atomic_xchg(arrivals, 0)
            _merge_splits(OUT, LSE, FINAL_OUT, FINAL_LSE, SINKS, b, hk, heads_k, group, len_q, num_splits,
                          tl.program_id(2) * BLOCK_M, VALUE_DIM, BLOCK_DV, MERGE_ROWS, MERGE_SPLITS, HAS_SINKS)


@triton.jit
def _merge_splits(PART_OUT, PART_LSE, OUT, LSE, SINKS, b, hk, heads_k, group, len_q, num_splits, row0,
                  VALUE_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, MERGE_ROWS: tl.constexpr,
                  MERGE_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """`merge_states` of the splits' summaries (lse_s, 1, out_s) for rows row0 + [0, MERGE_ROWS),
    MERGE_SPLITS splits a load; HAS_SINKS: starting from the sink's (sinks[h], 1, 0)."""
    rows = row0 + tl.arange(0, MERGE_ROWS)
    row_ok = rows < group * len_q
    head = hk * group + rows // len_q
    final_row = (b * heads_k * group + head).to(tl.int64) * len_q + rows % len_q
    s = tl.arange(0, MERGE_SPLITS)
    dv = tl.arange(0, BLOCK_DV)
    if HAS_SINKS:
        m = tl.load(SINKS + head, mask=row_ok, other=0.0).to(tl.float32)
        total = tl.full([MERGE_ROWS], 1.0, tl.float32)
    else:
        m = tl.full([MERGE_ROWS], float("-inf"), tl.float32)
        total = tl.zeros([MERGE_ROWS], tl.float32)
    acc = tl.zeros([MERGE_ROWS, BLOCK_DV], tl.float32)
    for s0 in range(0, num_splits, MERGE_SPLITS):
        part = final_row[:, None] * num_splits + s0 + s[None, :]
        ok = row_ok[:, None] & (s0 + s[None, :] < num_splits)
        part_lse = tl.load(PART_LSE + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
        part_out = tl.load(PART_OUT + part[:, :, None] * VALUE_DIM + dv[None, None, :],
                           mask=ok[:, :, None] & (dv[None, None, :] < VALUE_DIM), other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(part_lse, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(part_lse - m_safe[:, None])
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * part_out, 1)
        total = total * alpha + tl.sum(w, 1)
        m = m_new
    has_mass = total != 0.0
    safe_total = tl.where(has_mass, total, 1.0)
    out = tl.where(has_mass[:, None], acc / safe_total[:, None], 0.0)
    lse = tl.where(has_mass, tl.where(m == float("-inf"), 0.0, m) + tl.log(safe_total), float("-inf"))
    tl.store(OUT + final_row[:, None] * VALUE_DIM + dv[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < VALUE_DIM))
    tl.store(LSE + final_row, lse, mask=row_ok)


@triton.jit
def decode_combine_kernel(OUT_PART, LSE_PART, OUT, LSE, SINKS, heads_k, group, len_q, num_splits,
                          VALUE_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, MERGE_SPLITS: tl.constexpr,
                          HAS_SINKS: tl.constexpr = False):
    """Row program_id(1) of K/V head group program_id(0): its splits merged (and the sink, HAS_SINKS)."""
    pid = tl.program_id(0)
    _merge_splits(OUT_PART, LSE_PART, OUT, LSE, SINKS, pid // heads_k, pid % heads_k, heads_k,
                  group, len_q, num_splits, tl.program_id(1), VALUE_DIM, BLOCK_DV, 1, MERGE_SPLITS, HAS_SINKS)


MERGE_ELEMENTS = 16384  # float32 partial outputs one merge load holds: 32 splits of 4 rows at Dv = 128
def arrival_counters(count: int, device: torch.device) -> torch.Tensor:
    """int32 zeros for one launch, one per split group: the last split of a group to arrive merges it
    and sets its count back to zero, so the counters are kept per stream (`replay.stream_counters`)."""
    return stream_counters(count, device)


def splits_per_load(rows: int, num_splits: int, value_dim: int) -> int:
    """Splits whose partial outputs for `rows` rows one merge load holds (a power of two)."""
    budget = max(1, MERGE_ELEMENTS // (rows * padded_dim(value_dim)))
    return min(next_power_of_two(num_splits), next_power_of_two(budget + 1) // 2)


class DecodeRules(NamedTuple):
    """The score rules of a decode launch, each off by default. window_left: keys a token sees before its
    own (UNBOUNDED: all); softcap: > 0, or 0 for off; alibi_slopes: float32 (B, Hq) (any strides);
    sinks: float32 (Hq,); leftpad: int32 (B,), each sequence's first key (FlashAttention's `cache_leftpad`)."""

    window_left: int = UNBOUNDED
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    leftpad: torch.Tensor | None = None

    def key_span(self, capacity: int, len_q: int) -> int:
        """Keys of one sequence the splits may cover: the capacity, or with a window the keys the
        window leaves (its first block rounded down to a block start: up to one block more)."""
        if self.window_left == UNBOUNDED:
            return capacity
        return min(capacity, self.window_left + len_q)

    def split_arguments(self, final: bool) -> dict:
        """The split kernel's rule arguments (none for plain decoding: its launch stays as it is);
        the sinks only where the launch writes the final result (`final`)."""
        args = {}
        if self.window_left != UNBOUNDED:
            args.update(window_left=self.window_left, HAS_WINDOW=True)
        if self.softcap:
            args.update(softcap2=self.softcap * LOG2E, HAS_SOFTCAP=True)
        if self.alibi_slopes is not None:
            stride_ab, stride_ah = self.alibi_slopes.stride()
            args.update(ALIBI=self.alibi_slopes, stride_ab=stride_ab, stride_ah=stride_ah, HAS_ALIBI=True)
        if self.sinks is not None and final:
            args.update(SINKS=self.sinks, HAS_SINKS=True)
        if self.leftpad is not None:
            args.update(LEFTPAD=self.leftpad.contiguous(), HAS_LEFTPAD=True)
        return args


NO_RULES = DecodeRules()


def max_useful_splits(keys: int, config: DecodeConfig, window: bool = False) -> int:
    """Splits beyond one per key block of the `keys` a sequence may use are always empty (a window's
    first block is rounded down: one block more)."""
    return max(1, min(ceil_div(keys, config.block_n) + window, 65535))


def decode_forward(q, k_cache, v_cache, seqlens, block_table, scale, num_splits, config=None,
                   rules: DecodeRules = NO_RULES, validate: bool = False):
    """Raw split-KV decode; no autograd, no host sync.

    q: (B, Hq, Nq, D). Contiguous caches (B, Hk, Nmax, D|Dv) with block_table None,
    or paged caches (num_pages, Hk, page_size, D|Dv) with block_table int32 (B, max_pages).
    seqlens: int32 (B,), each in [Nq, capacity]; a length outside [0, capacity] is read as clamped
    into it, a page id outside [0, num_pages) likewise. num_splits >= 1. rules: the score rules.
    validate: record lengths outside [Nq, capacity], left paddings outside [0, length] and page ids out
    of range (`exattn.errors`).
    Returns out (B, Hq, Nq, Dv) in q's dtype and lse (B, Hq, Nq) float32.
    """
    batch, heads_q, len_q, head_dim = q.shape
    heads_k, value_dim = k_cache.shape[1], v_cache.shape[3]
    group = heads_q // heads_k
    config = config or default_config(group * len_q, head_dim, value_dim)
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[2] if paged else k_cache.shape[2]
    span = rules.key_span(capacity, len_q)
    num_splits = min(num_splits, max_useful_splits(span, config, span < capacity))
    seqlens = seqlens.contiguous()
    out, lse, part_out, part_lse = split_outputs(q, value_dim, num_splits)
    table = block_table if paged else seqlens
    table_strides = block_table.stride() if paged else (0, 0)
    grid = (batch * heads_k, num_splits, ceil_div(group * len_q, config.block_m))
    merge = {}
    if config.merge_in_split and num_splits > 1:
        merge_rows = min(config.block_m, next_power_of_two(group * len_q))
        merge = dict(FINAL_OUT=out, FINAL_LSE=lse, ARRIVALS=arrival_counters(grid[0] * grid[2], q.device),
                     MERGE_ROWS=merge_rows, MERGE_SPLITS=splits_per_load(merge_rows, num_splits, value_dim))
    run_kernel(decode_split_kernel, grid,
        q, k_cache, v_cache, seqlens, table, part_out, part_lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *table_strides,
        heads_k, group, len_q, num_splits, scale * LOG2E, capacity, k_cache.shape[0] if paged else 1,
        HEAD_DIM=head_dim, VALUE_DIM=value_dim,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_D=padded_dim(head_dim),
        BLOCK_DV=padded_dim(value_dim),
        PAGED=paged, PAGE_SIZE=k_cache.shape[2] if paged else 1,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=register_cap(config), **merge,
        **rules.split_arguments(final=num_splits == 1 or bool(merge)), **validation_arguments(q.device, validate),
    )
    if num_splits > 1 and not merge:
        combine_splits(part_out, part_lse, out, lse, heads_k, rules.sinks)
    return out, lse


def validation_arguments(device: torch.device, validate: bool) -> dict:
    """The kernels' arguments that record violations (`exattn.errors`); none without `validate`."""
    if not validate:
        return {}
    state = errors.device_record(device)
    return dict(ERRORS=state.record, DOORBELL=state.doorbell, VALIDATE=True)


def split_outputs(q: torch.Tensor, value_dim: int, num_splits: int):
    """out (B, Hq, Nq, Dv) in q's dtype and lse (B, Hq, Nq) float32, and where the split kernel writes:
    the same tensors for one split, else float32 partials (B, Hq, Nq, splits[, Dv])."""
    batch, heads_q, len_q, _ = q.shape
    out = torch.empty(batch, heads_q, len_q, value_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads_q, len_q, dtype=torch.float32, device=q.device)
    if num_splits == 1:
        return out, lse, out, lse
    rows = batch * heads_q * len_q * num_splits
    lse_room = ceil_div(rows, 4) * 4  # part_out 16-byte aligned after part_lse, in one allocation
    part = torch.empty(lse_room + rows * value_dim, dtype=torch.float32, device=q.device)
    part_lse = part[:rows].view(batch, heads_q, len_q, num_splits)
    part_out = part[lse_room:].view(batch, heads_q, len_q, num_splits, value_dim)
    return out, lse, part_out, part_lse


def combine_splits(part_out, part_lse, out, lse, heads_k: int, sinks: torch.Tensor | None = None) -> None:
    """`decode_combine_kernel` over `split_outputs`' partials: out and lse of every row, with the sinks
    (float32 (Hq,)) folded in where given."""
    batch, heads_q, len_q, num_splits, value_dim = part_out.shape
    group = heads_q // heads_k
    run_kernel(decode_combine_kernel, (batch * heads_k, group * len_q),
        part_out, part_lse, out, lse, sinks, heads_k, group, len_q, num_splits,
        VALUE_DIM=value_dim, BLOCK_DV=padded_dim(value_dim),
        MERGE_SPLITS=splits_per_load(1, num_splits, value_dim), HAS_SINKS=sinks is not None, num_warps=4,
    )
