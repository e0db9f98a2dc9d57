"""Split-KV decode for Hopper (sm_90) in Gluon, for contiguous caches.

    gluon_decode_forward(q, k_cache, v_cache, seqlens, scale, num_splits) -> (out, lse)
    gluon_decode_reasons(q, k_cache, v_cache, block_table, rules) -> why it cannot serve (empty: it can)

Same contract and split rule as `decode_kernel.decode_forward` (its partial results merged by
the same rule, in the split kernel where `merge_shape` allows, else by its combine kernel), for the
launches `plan_launch` marks (`DecodeConfig.gluon`): D = Dv = 128, up to 16 query rows (G * Nq) per
K/V head, fp16/bf16, contiguous caches, no score rule but a window (softcap, ALiBi and sinks run on
the Triton kernel; a window's splits cover the keys it leaves, as there). Lengths are clamped to
[0, Nmax] and, with `validate`, checked as there (`record_length`, `exattn.errors`).

What differs is how K/V bytes are asked for. The Triton kernel's software pipeline keeps two
64-key blocks of K and V in flight and issues a block's copies after the block's arithmetic.
Here each tensor has one 64-key slot, filled by one TMA copy (a block, 16 KB) that signals an
mbarrier, in the order cuDNN's decode kernel uses (seen in its SASS): wait for K_j (V_j may still
be in flight), read K_j's fragments into registers, issue K_{j+1} into the freed slot, S_j and its
softmax; wait for V_j, read its fragments, issue V_{j+1}, O += P_j V_j. The copies take no
registers for addresses: the kernel fits 128 registers, so 4 programs share an SM and B = 64,
Hk = 8 runs in one wave unsplit. Copied with `cp.async` instead (16-byte copies by every thread,
164 registers, 3 programs an SM), the same schedule read 0.960-1.000x this one at B = 1 and 8
(8k-128k, 5 interleaved rounds).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from . import decode_kernel
from .decode_kernel import BOUND, INDEX, KIND, LENGTH_BELOW_NQ, LENGTH_BEYOND_CACHE, PAGE_SIZE_FIELD, SLOT, VALUE
from .configs import ceil_div, gluon_device_reasons, multiprocessor_count, next_power_of_two, tma_compatible
from .gluon_forward import as_box, broadcast_reasons, larger, plus, tile_descriptor
from ...problem import UNBOUNDED
from .replay import run_kernel

BLOCK_N = 64
ROWS = 16  # query rows one program carries (G * Nq padded to the mma's 16)
HEAD_DIM = 128
# Registers a thread may take where a launch has more than 3 programs an SM: 4 then fit an SM's
# 65536. With one new token the kernel takes 128 uncapped; with Nq > 1, 144, and capped 16 bytes spill.
FOUR_PER_SM_REGISTERS = 128
# float32 partial outputs of the merge in the split kernel (`merge_shape`): 32 a thread, its rows
# spread over the 4 warps (the kernel stays at 128 registers with it at Nq = 1; with the cp.async copies
# before, more raised its 164).
MERGE_ELEMENTS = 4096
DTYPES = (torch.float16, torch.bfloat16)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


def gluon_decode_reasons(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table,
                         rules: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every reason `gluon_decode_forward` cannot serve these inputs (empty if it can); `rules`: the
    score rules in use, by name."""
    from . import gluon_written_for_this_triton

    reasons = gluon_device_reasons(q.device)
    others = [rule for rule in rules if rule != "window"]
    if others:
        reasons.append(f"score rules ({', '.join(others)}) run on the Triton decode kernel")
    if not gluon_written_for_this_triton():
        reasons.append("the Gluon kernels are written for Triton 3.6")
    if q.dtype not in DTYPES:
        reasons.append(f"dtype {q.dtype} is not float16 or bfloat16")
    if (q.shape[3], v_cache.shape[3]) != (HEAD_DIM, HEAD_DIM):
        reasons.append(f"head dims D={q.shape[3]}, Dv={v_cache.shape[3]}: need D = Dv = {HEAD_DIM}")
    rows = q.shape[1] // k_cache.shape[1] * q.shape[2]
    if rows > ROWS:
        reasons.append(f"{rows} query rows per K/V head (G * Nq): at most {ROWS}")
    if block_table is not None:
        reasons.append("paged caches run on the Triton kernel")
    if not tma_compatible(k_cache, v_cache):  # q is read by plain loads
        reasons.append("the caches' strides are not 16-byte aligned with a unit last stride")
    return reasons + broadcast_reasons(k_cache=k_cache, v_cache=v_cache)


@gluon.jit
def record_length(ERRORS, DOORBELL, b, given, len_q, capacity):
    """`decode_kernel._check_sequence` for a contiguous cache, written again in Gluon: a length
    outside [Nq, capacity]."""
    if given < len_q:
        claim_record(ERRORS, DOORBELL, LENGTH_BELOW_NQ, b, given, len_q)
    if given > capacity:
        claim_record(ERRORS, DOORBELL, LENGTH_BEYOND_CACHE, b, given, capacity)


@gluon.jit
def claim_record(ERRORS, DOORBELL, kind: gl.constexpr, b, value, bound):
    """`decode_kernel._record` in Gluon: the first violation on the device claims the record and sets
    the host's doorbell."""
    if gl.atomic_cas(ERRORS, 0, 1) == 0:
        gl.store(ERRORS + KIND, kind)
        gl.store(ERRORS + INDEX, b)
        gl.store(ERRORS + SLOT, 0)
        gl.store(ERRORS + VALUE, value)
        gl.store(ERRORS + BOUND, bound)
        gl.store(ERRORS + PAGE_SIZE_FIELD, 0)
        gl.store(DOORBELL, 1)


@gluon.jit
def issue_block(desc, slot, ready, b, hk, n0, hi):
    """One TMA copy of keys n0 .. n0 + BLOCK_N of (b, hk) into `slot`, signalling `ready`; none from hi on."""
    if n0 < hi:
        mbarrier.expect(ready, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [b, hk, n0, 0], ready, as_box(slot, desc))


@gluon.jit
def fragments(slot, ready, phase, layout: gl.constexpr, transpose: gl.constexpr):
    """`slot` read into registers once its copy landed; the barrier and fence free it for the next copy."""
    mbarrier.wait(ready, phase)
    if transpose:
        values = slot.permute((1, 0)).load(layout)
    else:
        values = slot.load(layout)
    gl.thread_barrier()
    fence_async_shared()
    return values


@gluon.jit
def zero_rows_from(slot, ready, phase, keep, layout: gl.constexpr):
    """Rows keep .. of `slot` set to 0 once its copy landed, 16 rows at a time: the copy of a
    sequence's last block brings keys past its length (stale cache slots, maybe NaN), and P = 0
    there would not cancel a NaN of V."""
    mbarrier.wait(ready, phase)
    CHUNK: gl.constexpr = 16
    ROWS: gl.constexpr = slot.shape[0]
    rows = gl.arange(0, CHUNK, gl.SliceLayout(1, layout))
    for first in gl.static_range(0, ROWS, CHUNK):
        chunk = slot.slice(first, CHUNK)
        values = chunk.load(layout)
        chunk.store(gl.where((first + rows < keep)[:, None], values, gl.zeros_like(values)))
    gl.thread_barrier()


@gluon.jit
def merge_splits(PART_OUT, PART_LSE, OUT, LSE, first_row, rows_valid, num_splits,
                 HEAD_DIM: gl.constexpr, MERGE_ROWS: gl.constexpr, MERGE_SPLITS: gl.constexpr):
    """`decode_kernel._merge_splits` written in Gluon (a Gluon kernel cannot call a triton.jit
    function), every split in one load (`merge_shape`): rows first_row + [0, rows_valid) (one K/V
    head's group, consecutive rows of OUT) from (lse_s, out_s)."""
    tile: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [4, 1, 1], [2, 1, 0])  # rows, splits, dims
    row_split: gl.constexpr = gl.SliceLayout(2, tile)
    row_dim: gl.constexpr = gl.SliceLayout(1, tile)
    rows = gl.arange(0, MERGE_ROWS, gl.SliceLayout(1, row_split))
    splits = gl.arange(0, MERGE_SPLITS, gl.SliceLayout(0, row_split))
    dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, row_dim))
    part = (first_row + rows).to(gl.int64)[:, None] * num_splits + splits[None, :]
    ok = (rows < rows_valid)[:, None] & (splits < num_splits)[None, :]
    part_lse = gl.load(PART_LSE + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
    part_out = gl.load(PART_OUT + gl.expand_dims(part, 2) * HEAD_DIM + dims[None, None, :],
                       mask=gl.expand_dims(ok, 2), other=0.0, cache_modifier=".cg")
    m = gl.reduce(part_lse, 1, larger)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    weight = gl.exp(part_lse - m_safe[:, None])
    total = gl.reduce(weight, 1, plus)
    acc = gl.reduce(gl.expand_dims(weight, 2) * part_out, 1, plus)
    has_mass = total != 0.0
    safe_total = gl.where(has_mass, total, 1.0)
    gl.store(LSE + first_row + rows, gl.where(has_mass, m_safe + gl.log(safe_total), float("-inf")),
             mask=rows < rows_valid)
    scale = gl.convert_layout(gl.where(has_mass, 1.0 / safe_total, 0.0), gl.SliceLayout(1, row_dim))
    out_rows = gl.arange(0, MERGE_ROWS, gl.SliceLayout(1, row_dim))
    gl.store(OUT + (first_row + out_rows).to(gl.int64)[:, None] * HEAD_DIM + dims[None, :],
             (acc * scale[:, None]).to(OUT.dtype.element_ty), mask=(out_rows < rows_valid)[:, None])


@gluon.jit
def attend_block(q, slots, k_desc, v_desc, phase, b, hk, n0, hi, keys, last_key, window_left, m_i, l_i, acc,
                 qk_scale, operand_b: gl.constexpr, tile: gl.constexpr, CUT: gl.constexpr,
                 HAS_WINDOW: gl.constexpr):
    """The online-softmax state (m_i, l_i, acc) after keys n0 .. n0 + BLOCK_N, whose K and V are in
    flight to `slots`; each slot takes the next block's copy once read. CUT: the block runs past hi,
    and V's rows from hi are set to 0 first (outside the loop over whole blocks, which then keeps
    to 128 registers). HAS_WINDOW: keys before last_key - window_left are left out too."""
    k_slot, v_slot, k_ready, v_ready = slots
    BLOCK_N: gl.constexpr = k_slot.shape[0]
    mma: gl.constexpr = acc.type.layout
    if CUT:
        zero_rows_from(v_slot, v_ready, phase, hi - n0, tile)
    k = fragments(k_slot, k_ready, phase, operand_b, True)
    issue_block(k_desc, k_slot, k_ready, b, hk, n0 + BLOCK_N, hi)
    s = mma_v2(q, k, gl.zeros([q.shape[0], BLOCK_N], gl.float32, mma)) * qk_scale
    allowed = (n0 + keys)[None, :] <= last_key[:, None]
    if HAS_WINDOW:
        allowed = allowed & ((n0 + keys)[None, :] >= last_key[:, None] - window_left)
    s = gl.where(allowed, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.reduce(s, 1, larger))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + gl.reduce(p, 1, plus)
    p = gl.convert_layout(p.to(q.dtype), q.type.layout)
    v = fragments(v_slot, v_ready, phase, operand_b, False)
    issue_block(v_desc, v_slot, v_ready, b, hk, n0 + BLOCK_N, hi)
    return m_new, l_i, mma_v2(p, v, acc * alpha[:, None])


@gluon.jit
def gluon_decode_split_kernel(
    Q, k_desc, v_desc, SEQLENS, OUT, LSE,
    stride_qb, stride_qh, stride_qt,
    heads_k, group, len_q, num_splits, qk_scale, capacity,
    ROWS: gl.constexpr,
    FINAL_OUT=None, FINAL_LSE=None, ARRIVALS=None,
    MERGE_ROWS: gl.constexpr = 0, MERGE_SPLITS: gl.constexpr = 0,
    window_left=0, HAS_WINDOW: gl.constexpr = False,
    ERRORS=None, DOORBELL=None, VALIDATE: gl.constexpr = False,
):
    """Descriptors (`tile_descriptor`): k, v (B, Hk, Nmax, D) with [1, 1, BLOCK_N, D] boxes; capacity = Nmax.
    HAS_WINDOW: a token sees window_left keys before its own."""
    D: gl.constexpr = k_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = k_desc.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    operand_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    operand_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])

    # The split rule of decode_kernel.decode_split_kernel, written again in Gluon (a Gluon kernel
    # cannot call a triton.jit function).
    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // heads_k
    hk = pid % heads_k
    given = gl.load(SEQLENS + b)
    length = gl.minimum(gl.maximum(given, 0), capacity)
    if VALIDATE:
        checks = (hk == 0) & (split == 0)  # one program a sequence
        if checks:
            record_length(ERRORS, DOORBELL, b, given, len_q, capacity)
    start = 0
    if HAS_WINDOW:  # key blocks before every row's window are not split over, nor read
        start = gl.maximum(length - len_q - window_left, 0) // BLOCK_N * BLOCK_N
    chunk = gl.cdiv(gl.cdiv(length - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = gl.minimum(lo + chunk, length)

    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
    k_slot = gl.allocate_shared_memory(dtype, [BLOCK_N, D], kv_layout)
    v_slot = gl.allocate_shared_memory(dtype, [BLOCK_N, D], kv_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(k_ready, count=1)
    mbarrier.init(v_ready, count=1)
    fence_async_shared()
    issue_block(k_desc, k_slot, k_ready, b, hk, lo, hi)
    issue_block(v_desc, v_slot, v_ready, b, hk, lo, hi)

    cols = gl.arange(0, D, gl.SliceLayout(0, tile))
    q_rows = gl.arange(0, ROWS, gl.SliceLayout(1, tile))
    q_ptrs = (Q + b.to(gl.int64) * stride_qb + (hk * group + q_rows // len_q).to(gl.int64)[:, None] * stride_qh
              + (q_rows % len_q)[:, None] * stride_qt + cols[None, :])
    q = gl.convert_layout(gl.load(q_ptrs, mask=(q_rows < group * len_q)[:, None], other=0.0), operand_a)

    rows = gl.arange(0, ROWS, gl.SliceLayout(1, mma))
    keys = gl.arange(0, BLOCK_N, gl.SliceLayout(0, mma))
    last_key = length - len_q + rows % len_q
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, mma))
    acc = gl.zeros([ROWS, D], gl.float32, mma)
    slots = (k_slot, v_slot, k_ready, v_ready)
    full_end = lo + (hi - lo) // BLOCK_N * BLOCK_N
    phase = 0
    for n0 in range(lo, full_end, BLOCK_N):
        m_i, l_i, acc = attend_block(q, slots, k_desc, v_desc, phase, b, hk, n0, hi, keys, last_key, window_left,
                                     m_i, l_i, acc, qk_scale, operand_b, tile, False, HAS_WINDOW)
        phase ^= 1
    if full_end < hi:  # the sequence's last block, cut by its length
        m_i, l_i, acc = attend_block(q, slots, k_desc, v_desc, phase, b, hk, full_end, hi, keys, last_key,
                                     window_left, m_i, l_i, acc, qk_scale, operand_b, tile, True, HAS_WINDOW)

    has_mass = l_i != 0.0
    safe_l = gl.where(has_mass, l_i, 1.0)
    out = gl.where(has_mass[:, None], acc / safe_l[:, None], 0.0)
    lse = gl.where(has_mass, (m_i + gl.log2(safe_l)) * LN2, float("-inf"))
    out_cols = gl.arange(0, D, gl.SliceLayout(0, mma))
    head = hk * group + rows // len_q
    out_row = ((b * heads_k * group + head).to(gl.int64) * len_q + rows % len_q) * num_splits + split
    row_ok = rows < group * len_q
    gl.store(OUT + out_row[:, None] * D + out_cols[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None])
    gl.store(LSE + out_row, lse, mask=row_ok)
    if MERGE_ROWS > 0:
        # As in decode_kernel.decode_split_kernel: the last split of the group to arrive merges them.
        gl.thread_barrier()
        if gl.atomic_add(ARRIVALS + pid, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            gl.atomic_xchg(ARRIVALS + pid, 0)
            merge_splits(OUT, LSE, FINAL_OUT, FINAL_LSE, (b * heads_k + hk) * group * len_q, group * len_q,
                         num_splits, D, MERGE_ROWS, MERGE_SPLITS)


def merge_shape(rows: int, num_splits: int) -> tuple[int, int] | None:
    """(MERGE_ROWS, MERGE_SPLITS) where the last split of a group of `rows` query rows merges the
    group in the split kernel: its splits' partial outputs fit one load of MERGE_ELEMENTS. Else None,
    and the combine kernel merges (at B = 1, 32 splits merged in four loads read 0.98x it)."""
    shape = (max(next_power_of_two(rows), 4), next_power_of_two(num_splits))
    return shape if num_splits > 1 and shape[0] * shape[1] * HEAD_DIM <= MERGE_ELEMENTS else None


def register_cap(programs: int, device: torch.device) -> dict:
    """The launch option that keeps 4 programs an SM where a launch has more than 3 an SM."""
    more_than_three = device.type == "cuda" and programs > 3 * multiprocessor_count(device)
    return {"maxnreg": FOUR_PER_SM_REGISTERS} if more_than_three else {}


def gluon_decode_forward(q, k_cache, v_cache, seqlens, scale, num_splits, merge_in_split=True, validate=False,
                         window_left=UNBOUNDED):
    """`decode_kernel.decode_forward` for inputs `gluon_decode_reasons` accepts (contiguous caches).
    `merge_in_split`: merge in the split kernel where `merge_shape` allows; `validate`, `window_left`: as
    there (`DecodeRules.window_left`)."""
    batch, heads_q, len_q, head_dim = q.shape
    heads_k = k_cache.shape[1]
    num_splits = min(num_splits, ceil_div(k_cache.shape[2], BLOCK_N), 65535)
    out, lse, part_out, part_lse = decode_kernel.split_outputs(q, head_dim, num_splits)
    shape = merge_shape(heads_q // heads_k * len_q, num_splits) if merge_in_split else None
    merge = {} if shape is None else dict(
        FINAL_OUT=out, FINAL_LSE=lse, ARRIVALS=decode_kernel.arrival_counters(batch * heads_k, q.device),
        MERGE_ROWS=shape[0], MERGE_SPLITS=shape[1])
    cap = register_cap(batch * heads_k * num_splits, q.device)
    window = {} if window_left == UNBOUNDED else dict(window_left=window_left, HAS_WINDOW=True)
    run_kernel(gluon_decode_split_kernel, (batch * heads_k, num_splits),
        q, tile_descriptor(k_cache, BLOCK_N), tile_descriptor(v_cache, BLOCK_N), seqlens.contiguous(),
        part_out, part_lse, *q.stride()[:3],
        heads_k, heads_q // heads_k, len_q, num_splits, scale * decode_kernel.LOG2E, k_cache.shape[2],
        ROWS=ROWS, num_warps=4, **cap, **merge, **window, **decode_kernel.validation_arguments(q.device, validate),
    )
    if num_splits > 1 and not merge:
        decode_kernel.combine_splits(part_out, part_lse, out, lse, heads_k)
    return out, lse
