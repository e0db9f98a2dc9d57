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
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .configs import ceil_div, next_power_of_two, padded_dim
from .tiles import finalize

LOG2E = 1.4426950408889634
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
def _key_base(n0, hi, b, BT, stride_tb, stride_tp,
              BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Batch index (contiguous) or page indices (paged) of keys n0 .. n0 + BLOCK_N (n0 a multiple
    of BLOCK_N), int32: a scalar, or one per key when a block spans pages. Keys at or past hi
    (their K/V loads are masked) read the slot of key hi - 1, a page of the sequence (hi >= 1):
    no mask on these loads (masked, 32-key pages read 0.88-0.91x at B = 1 2k-4k)."""
    if PAGED:
        row = BT + b.to(tl.int64) * stride_tb
        last_slot = (hi - 1) // PAGE_SIZE
        if PAGE_SIZE % BLOCK_N == 0:
            base = tl.load(row + tl.minimum(n0 // PAGE_SIZE, last_slot) * stride_tp)
        else:
            keys = tl.arange(0, BLOCK_N)
            if BLOCK_N % PAGE_SIZE == 0:  # the per-key part is the same for every block
                slots = n0 // PAGE_SIZE + keys // PAGE_SIZE
            else:
                slots = (n0 + keys) // PAGE_SIZE
            base = tl.load(row + tl.minimum(slots, last_slot) * stride_tp)
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
def decode_split_kernel(
    Q, K, V, SEQLENS, BT, OUT, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_tb, stride_tp,
    heads_k, group, len_q, num_splits, qk_scale,
    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    FINAL_OUT=None, FINAL_LSE=None, ARRIVALS=None,
    MERGE_ROWS: tl.constexpr = 0, MERGE_SPLITS: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // heads_k
    hk = pid % heads_k
    length = tl.load(SEQLENS + b)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, length)

    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group * len_q
    head = hk * group + rows // len_q
    token = rows % len_q
    last_key = length - len_q + token
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
    base = _key_base(lo, hi, b, BT, stride_tb, stride_tp, BLOCK_N, PAGED, PAGE_SIZE)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        key_ok = offs < hi
        next_base = _key_base(n0 + BLOCK_N, hi, b, BT, stride_tb, stride_tp, BLOCK_N, PAGED, PAGE_SIZE)
        k = _key_tile(k_head, base, n0, key_ok, d, stride_kb, stride_kn, stride_kd, HEAD_DIM, BLOCK_N, PAGED, PAGE_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        s = tl.where(offs[None, :] <= last_key[:, None], s, float("-inf"))
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

    out, lse = finalize(acc, m_i, l_i)
    out_row = ((b * heads_k * group + head).to(tl.int64) * len_q + token) * num_splits + split
    tl.store(OUT + out_row[:, None] * VALUE_DIM + dv[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < VALUE_DIM))
    tl.store(LSE + out_row, lse, mask=row_ok)
    if MERGE_ROWS > 0:
        # The last split of this group to arrive merges them all; its arrival (after a barrier
        # behind every thread's stores) acquires the other splits' results.
        tl.debug_barrier()
        arrivals = ARRIVALS + pid * tl.num_programs(2) + tl.program_id(2)
        if tl.atomic_add(arrivals, 1, sem="acq_rel") == num_splits - 1:
            tl.atomic_xchg(arrivals, 0)
            _merge_splits(OUT, LSE, FINAL_OUT, FINAL_LSE, b, hk, heads_k, group, len_q, num_splits,
                          tl.program_id(2) * BLOCK_M, VALUE_DIM, BLOCK_DV, MERGE_ROWS, MERGE_SPLITS)


@triton.jit
def _merge_splits(PART_OUT, PART_LSE, OUT, LSE, b, hk, heads_k, group, len_q, num_splits, row0,
                  VALUE_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, MERGE_ROWS: tl.constexpr,
                  MERGE_SPLITS: tl.constexpr):
    """`merge_states` of the splits' summaries (lse_s, 1, out_s) for rows row0 + [0, MERGE_ROWS),
    MERGE_SPLITS splits a load."""
    rows = row0 + tl.arange(0, MERGE_ROWS)
    row_ok = rows < group * len_q
    final_row = (b * heads_k * group + hk * group + rows // len_q).to(tl.int64) * len_q + rows % len_q
    s = tl.arange(0, MERGE_SPLITS)
    dv = tl.arange(0, BLOCK_DV)
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
def decode_combine_kernel(OUT_PART, LSE_PART, OUT, LSE, heads_k, group, len_q, num_splits,
                          VALUE_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, MERGE_SPLITS: tl.constexpr):
    """Row program_id(1) of K/V head group program_id(0): its splits merged."""
    pid = tl.program_id(0)
    _merge_splits(OUT_PART, LSE_PART, OUT, LSE, pid // heads_k, pid % heads_k, heads_k,
                  group, len_q, num_splits, tl.program_id(1), VALUE_DIM, BLOCK_DV, 1, MERGE_SPLITS)


MERGE_ELEMENTS = 16384  # float32 partial outputs one merge load holds: 32 splits of 4 rows at Dv = 128
_ARRIVALS: dict = {}


def arrival_counters(count: int, device: torch.device) -> torch.Tensor:
    """int32 zeros, one per split group, kept per (device, stream) and never freed (a captured
    CUDA graph keeps their address); the kernel leaves them zero. Calls on one stream run in
    order, so they never share counters while running."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    kept = _ARRIVALS.setdefault(key, [])
    if not kept or kept[-1].numel() < count:
        kept.append(torch.zeros(max(count, 4096), dtype=torch.int32, device=device))
    return kept[-1]


def splits_per_load(rows: int, num_splits: int, value_dim: int) -> int:
    """Splits whose partial outputs for `rows` rows one merge load holds (a power of two)."""
    budget = max(1, MERGE_ELEMENTS // (rows * padded_dim(value_dim)))
    return min(next_power_of_two(num_splits), next_power_of_two(budget + 1) // 2)


def max_useful_splits(capacity: int, config: DecodeConfig) -> int:
    """Splits beyond one per key block are always empty."""
    return max(1, min(ceil_div(capacity, config.block_n), 65535))


def decode_forward(q, k_cache, v_cache, seqlens, block_table, scale, num_splits, config=None):
    """Raw split-KV decode on trusted inputs; no autograd, no host sync.

    q: (B, Hq, Nq, D). Contiguous caches (B, Hk, Nmax, D|Dv) with block_table None,
    or paged caches (num_pages, Hk, page_size, D|Dv) with block_table int32 (B, max_pages).
    seqlens: int32 (B,), each in [Nq, capacity]. num_splits >= 1.
    Returns out (B, Hq, Nq, Dv) in q's dtype and lse (B, Hq, Nq) float32.
    """
    batch, heads_q, len_q, head_dim = q.shape
    heads_k, value_dim = k_cache.shape[1], v_cache.shape[3]
    group = heads_q // heads_k
    config = config or default_config(group * len_q, head_dim, value_dim)
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[2] if paged else k_cache.shape[2]
    num_splits = min(num_splits, max_useful_splits(capacity, config))
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
    decode_split_kernel[grid](
        q, k_cache, v_cache, seqlens, table, part_out, part_lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *table_strides,
        heads_k, group, len_q, num_splits, scale * LOG2E,
        HEAD_DIM=head_dim, VALUE_DIM=value_dim,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_D=padded_dim(head_dim),
        BLOCK_DV=padded_dim(value_dim),
        PAGED=paged, PAGE_SIZE=k_cache.shape[2] if paged else 1,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=register_cap(config), **merge,
    )
    if num_splits > 1 and not merge:
        combine_splits(part_out, part_lse, out, lse, heads_k)
    return out, lse


def split_outputs(q: torch.Tensor, value_dim: int, num_splits: int):
    """out (B, Hq, Nq, Dv) in q's dtype and lse (B, Hq, Nq) float32, and where the split kernel writes:
    the same tensors for one split, else float32 partials (B, Hq, Nq, splits[, Dv])."""
    batch, heads_q, len_q, _ = q.shape
    out = torch.empty(batch, heads_q, len_q, value_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads_q, len_q, dtype=torch.float32, device=q.device)
    if num_splits == 1:
        return out, lse, out, lse
    part_out = torch.empty(batch, heads_q, len_q, num_splits, value_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads_q, len_q, num_splits, dtype=torch.float32, device=q.device)
    return out, lse, part_out, part_lse


def combine_splits(part_out, part_lse, out, lse, heads_k: int) -> None:
    """`decode_combine_kernel` over `split_outputs`' partials: out and lse of every row."""
    batch, heads_q, len_q, num_splits, value_dim = part_out.shape
    group = heads_q // heads_k
    decode_combine_kernel[(batch * heads_k, group * len_q)](
        part_out, part_lse, out, lse, heads_k, group, len_q, num_splits,
        VALUE_DIM=value_dim, BLOCK_DV=padded_dim(value_dim),
        MERGE_SPLITS=splits_per_load(1, num_splits, value_dim), num_warps=4,
    )
