"""`exattn.decode`: attention of a few new tokens over a KV cache, split over the keys.

The key range of each sequence is cut into `num_splits` parts; each part is
summarized on its own and the partial states are merged with the merge
algebra (`exattn.algebra.merge_states`). The new tokens are the last Nq of
the `L = cache_seqlens[b]` valid keys; for Nq = 3, L = 6 (`x` = allowed):

    key   0 1 2 3 4 5
    t0    x x x x . .        query t sees keys j <= L - Nq + t
    t1    x x x x x .
    t2    x x x x x x

With `cache_leftpad` (FlashAttention's), sequence b's keys start at `cache_leftpad[b]`: the keys
before it (a batch of prompts padded on the left) are left out, positions unchanged.

Backends: "triton" (the split and combine kernels of
`backends/triton/decode_kernel.py`, CUDA), "tiled" (`tiled_forward` per split,
any device), "auto" (triton on CUDA, else tiled). Under `torch.compile` each path
runs as an opaque custom op, `exattn::decode_triton` or `exattn::decode_tiled` (`DECODE_OPS`).

Validation: the Triton path checks lengths, left paddings and page ids in its kernels and reports
through `exattn.errors` (no device sync); the tiled path reads them on the host.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, overload

import torch

from . import errors
from .algebra import NEG_INF, merge_stacked, merge_states
from .backends.tiled import tiled_forward
from .checked_calls import call_signature, known_call, remember
from .problem import (
    UNBOUNDED, AttentionParams, ScoreRules, check_bool, check_same_dtype_device, check_scale, check_score_rules, check_softcap,
    check_tensor, check_window, compute_dtype,
)

if TYPE_CHECKING:
    from .backends.triton.decode_kernel import DecodeConfig

DECODE_BACKENDS = ("auto", "triton", "tiled")


@dataclass(frozen=True)
class DecodeProblem:
    """Validated decode inputs.

    q: (B, Hq, Nq, D). Contiguous: k_cache (B, Hk, Nmax, D), v_cache (B, Hk, Nmax, Dv),
    block_table None. Paged: k_cache (num_pages, Hk, page_size, D), v_cache
    (num_pages, Hk, page_size, Dv), block_table int32 (B, max_pages).
    seqlens: int32 (B,) on q's device, not yet checked against Nq and the cache: `validate` says
    whether the backend does (`check_lengths`, or the kernels through `exattn.errors`).
    leftpad: int32 (B,) on q's device or None: each sequence's first key, checked likewise against
    [0, seqlens[b]].
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    seqlens: torch.Tensor
    block_table: torch.Tensor | None
    scale: float
    num_splits: int
    window_left: int = UNBOUNDED
    softcap: float = 0.0
    rules: ScoreRules | None = None
    validate: bool = True
    leftpad: torch.Tensor | None = None

    @property
    def key_span(self) -> int:
        """Keys of one sequence the kernels' splits may cover: the capacity, or with a window the keys
        it leaves (`DecodeRules.key_span`)."""
        if self.window_left == UNBOUNDED:
            return self.capacity
        return min(self.capacity, self.window_left + self.q.shape[2])

    @property
    def score_rules_in_use(self) -> list[str]:
        """The keywords beyond plain causal decoding that are on (`window`, `softcap`, ...)."""
        names = ["window"] if self.window_left != UNBOUNDED else []
        names += ["softcap"] if self.softcap else []
        names += ["cache_leftpad"] if self.leftpad is not None else []
        return names + ([] if self.rules is None else self.rules.in_use())

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[2] if self.paged else 1

    @property
    def capacity(self) -> int:
        """Keys a sequence can hold: Nmax, or max_pages * page_size."""
        if self.paged:
            return self.block_table.shape[1] * self.k_cache.shape[2]
        return self.k_cache.shape[2]


# ---------------------------------------------------------------- validation

def check_int_tensor(name: str, x: object, shape: tuple[int | None, ...], q: torch.Tensor) -> torch.Tensor:
    """An int32 tensor on q's device whose shape matches `shape` (None = any size)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {x.dtype}")
    if x.dim() != len(shape) or any(n is not None and n != m for n, m in zip(shape, x.shape)):
        expected = tuple("any" if n is None else n for n in shape)
        raise ValueError(f"{name} must have shape {expected}, got {tuple(x.shape)}")
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all inputs must be on one device")
    return x


def check_cache_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paged: bool) -> None:
    batch, heads_q, _, head_dim = q.shape
    lead = "num_pages" if paged else "batch"
    if not paged and k.shape[0] != batch:
        raise ValueError(f"k_cache has batch {k.shape[0]} but q has {batch}; they must match")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v_cache has {lead} {v.shape[0]} but k_cache has {k.shape[0]}; they must match")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v_cache has {v.shape[1]} heads but k_cache has {k.shape[1]}; they must match")
    if k.shape[1] == 0:
        raise ValueError("k_cache and v_cache have no heads (dim 1 is 0): at least one key/value head is needed")
    if heads_q % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({heads_q}) must be a multiple of k_cache heads ({k.shape[1]})"
        )
    if v.shape[2] != k.shape[2]:
        what = "page size" if paged else "length"
        raise ValueError(f"v_cache has {what} {v.shape[2]} but k_cache has {k.shape[2]}; they must match")
    if k.shape[3] != head_dim:
        raise ValueError(f"k_cache has head dim {k.shape[3]} but q has {head_dim}; they must match")
    if head_dim == 0 or v.shape[3] == 0:
        raise ValueError(f"head dims must be positive, got D={head_dim}, Dv={v.shape[3]}")
    if paged and k.shape[2] == 0:
        raise ValueError("k_cache page size must be positive, got 0")
    if paged and k.shape[0] == 0 and batch:
        raise ValueError("k_cache holds no pages (num_pages = 0), but every sequence needs at least Nq keys")


def check_num_splits(num_splits: object) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int, got {type(num_splits).__name__}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 picks a number), got {num_splits}")
    return num_splits


def check_lengths(problem: DecodeProblem) -> None:
    """The tiled path's check of lengths and used pages, on the host (one device sync; the
    tiled path syncs anyway). The Triton path checks in its kernels (`exattn.errors`)."""
    lens, len_q, capacity = problem.seqlens, problem.q.shape[2], problem.capacity
    if lens.numel() == 0:
        return
    leftpad_ok = torch.ones_like(lens, dtype=torch.bool) if problem.leftpad is None else (
        (problem.leftpad >= 0) & (problem.leftpad <= lens))
    stats = [lens.min(), lens.max(), leftpad_ok.all()]
    if problem.paged and problem.block_table.numel():
        used = used_pages(problem)
        table = problem.block_table
        stats += [torch.where(used, table, 0).min(), torch.where(used, table, 0).max()]
    low, high, leftpads_ok, *pages = torch.stack(stats).tolist()
    if not leftpads_ok:
        b = int(torch.nonzero(~leftpad_ok)[0])
        raise ValueError(errors.leftpad_out_of_range(b, int(problem.leftpad[b]), int(lens[b])))
    if low < len_q:
        b = int(torch.nonzero(lens < len_q)[0])
        raise ValueError(errors.length_below_queries(b, int(lens[b]), len_q))
    if high > capacity:
        b = int(torch.nonzero(lens > capacity)[0])
        page_size = problem.page_size if problem.paged else 0
        raise ValueError(errors.length_beyond_cache(b, int(lens[b]), capacity, page_size))
    num_pages = problem.k_cache.shape[0]
    if pages and (pages[0] < 0 or pages[1] >= num_pages):
        bad = used_pages(problem) & ((problem.block_table < 0) | (problem.block_table >= num_pages))
        b, p = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(errors.page_out_of_range(b, p, int(problem.block_table[b, p]), num_pages))


def used_pages(problem: DecodeProblem) -> torch.Tensor:
    """Bool (B, max_pages): page slot p of sequence b holds some of its keys."""
    slots = torch.arange(problem.block_table.shape[1], device=problem.q.device)
    return slots[None, :] * problem.page_size < problem.seqlens[:, None]


def make_decode_problem(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, validate,
                        window=None, softcap=0.0, alibi_slopes=None, sinks=None, cache_leftpad=None) -> DecodeProblem:
    q = check_tensor("q", q, 4)
    k_cache, v_cache = check_tensor("k_cache", k_cache, 4), check_tensor("v_cache", v_cache, 4)
    check_same_dtype_device(q=q, k_cache=k_cache, v_cache=v_cache)
    batch, len_q = q.shape[0], q.shape[2]
    if len_q == 0:
        raise ValueError("q must hold at least one new token (Nq >= 1), got Nq = 0")
    paged = block_table is not None
    if paged:
        check_int_tensor("block_table", block_table, (batch, None), q)
    check_cache_shapes(q, k_cache, v_cache, paged)
    capacity = block_table.shape[1] * k_cache.shape[2] if paged else k_cache.shape[2]
    if capacity < len_q and batch:
        raise ValueError(f"the cache holds {capacity} keys per sequence, fewer than Nq = {len_q}: "
                         "no length is valid")
    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    check_int_tensor("cache_seqlens", cache_seqlens, (batch,), q)
    if cache_leftpad is not None:
        check_int_tensor("cache_leftpad", cache_leftpad, (batch,), q)
    check_bool("validate", validate)
    rules = check_score_rules(batch=batch, heads_q=q.shape[1], len_q=len_q, len_k=capacity, device=q.device,
                              dtype=q.dtype, alibi_slopes=alibi_slopes, sinks=sinks)
    return DecodeProblem(
        q=q, k_cache=k_cache, v_cache=v_cache, seqlens=cache_seqlens, block_table=block_table,
        scale=check_scale(scale, q.shape[3]), num_splits=check_num_splits(num_splits),
        window_left=check_window(window, True)[0], softcap=check_softcap(softcap), rules=rules, validate=validate,
        leftpad=cache_leftpad,
    )


# ---------------------------------------------------------------- planning

# An under-filled launch takes a second program per SM once its splits keep this many key blocks
# (`plan_splits`). Split sweep, contiguous and paged, two passes: B = 1
# at 8k / 16k (3 / 7 blocks) 32 splits 2.40 / 3.01 TB/s against 16 splits 2.37 / 2.94, 16-key pages
# 2.32 / 2.91 against 2.26 / 2.84; B = 4 at 2k (4 blocks) 8 splits 2.45 against 4 splits 2.38;
# B = 1 at 4k (1 block) 16 splits.
MIN_BLOCKS_SATURATING = 3


def plan_splits(
    batch: int, heads_k: int, max_seqlen: int, num_sms: int, *, row_blocks: int = 1,
    block_n: int = 64, saturating_per_sm: int = 2, resident_per_sm: int = 3,
    min_blocks_per_split: int = 2, min_blocks_saturating: int = MIN_BLOCKS_SATURATING,
    min_blocks_when_full: int = 16, max_splits: int = 128,
) -> int:
    """How many key splits one decode launch should use. Pure function.

    `batch * heads_k * row_blocks` programs exist without splitting. With
    fewer than `saturating_per_sm` per SM, HBM is not saturated, and the programs
    on one SM share its bandwidth: waves are counted in one program per SM, up to
    `saturating_per_sm` per SM once each split then keeps `min_blocks_saturating`
    key blocks (shorter splits cost more in partial results and per-program
    latency than a second program per SM gains). With more, what matters
    is the partial last wave of the programs resident at once (`resident_per_sm`,
    which the kernel configuration's shared memory and registers allow). With
    `waves(s) = programs * s / slots`, a split count's efficiency is
    `waves / ceil(waves)` (1.0 = whole waves, no idle SMs at the tail). The plan
    is the smallest s whose efficiency is within 5% of the best, among the s
    that leave each split at least `min_blocks_per_split` key blocks of `block_n`
    (`min_blocks_when_full` once the unsplit launch saturates HBM: then a split
    only evens out the last wave, and short splits cost more in partial results
    than they gain). Measured on the H200: B = 64, Hk = 8 is 512 programs, 1.3 resident waves
    unsplit; 3 splits make 3.9 waves and lift 128k from 3.97 to 4.37 TB/s, but
    at 1k keys cost 7% (3.27 vs 3.51 TB/s unsplit). B = 1 at 1k: 8 splits of 2
    blocks read 0.56 TB/s, 4 splits of 4 blocks 0.46. With 2 stages (4 resident
    per SM, `plan_launch`) B = 64 is 0.97 waves unsplit, and 1 split read 4.54 /
    4.61 / 4.56-4.65 TB/s at 8k / 32k / 128k, 2-3 splits 4.42-4.45 / 4.57-4.60 /
    4.62-4.64. Under-filled, Hk = 8:
    B = 1 reads most with 16 splits (one program per SM) at 2k-4k (4k: 1.56 TB/s
    against 1.42 with 32, 1.37 with 24) and with 32 from 8k (MIN_BLOCKS_SATURATING).
    """
    for name, value in (("batch", batch), ("heads_k", heads_k), ("max_seqlen", max_seqlen),
                        ("num_sms", num_sms), ("row_blocks", row_blocks)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    programs = batch * heads_k * row_blocks
    full = programs >= num_sms * saturating_per_sm
    key_blocks = math.ceil(max_seqlen / block_n)
    if full:
        slots = num_sms * resident_per_sm
        most = max(1, min(max_splits, key_blocks // min_blocks_when_full))
    else:
        deep = key_blocks // max(1, num_sms * saturating_per_sm // programs) >= min_blocks_saturating
        slots = num_sms * (saturating_per_sm if deep else 1)
        most = max(1, min(max_splits, key_blocks // min_blocks_per_split, slots // programs))

    def efficiency(splits: int) -> float:
        waves = programs * splits / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if efficiency(s) >= 0.95 * best)


def split_chunk(longest: int, num_splits: int, align: int) -> int:
    """Keys per split: ceil(longest / num_splits), rounded up to a multiple of `align`."""
    chunk = math.ceil(longest / num_splits)
    return math.ceil(chunk / align) * align


# ---------------------------------------------------------------- backends

def triton_reasons(problem: DecodeProblem) -> list[str]:
    """Why the Triton decode kernel cannot serve this problem (empty: it can).

    The device, dtype and head-dim rules are those of the Triton backend; every score rule
    `decode` takes runs in the kernels.
    """
    from .backends.triton import kernel_reasons, size_reasons

    q = problem.q
    return list(kernel_reasons(q.device, q.dtype, None, ())) + size_reasons(q.shape[3], problem.v_cache.shape[3])


def choose_decode_backend(problem: DecodeProblem, backend: object) -> str:
    if not isinstance(backend, str) or backend not in DECODE_BACKENDS:
        raise ValueError(f"backend must be one of {DECODE_BACKENDS}, got {backend!r}")
    if backend == "tiled":
        return "tiled"
    reasons = triton_reasons(problem)
    if backend == "triton" and reasons:
        raise ValueError(f"backend 'triton' cannot serve these inputs: {'; '.join(reasons)}")
    if backend == "auto" and (reasons or not problem.q.is_cuda):
        return "tiled"
    return "triton"


# Under-filled launches over at least this many keys run the Gluon split kernel on sm_90
# (`gluon_decode.py`, its load schedule; contiguous caches only). 5 interleaved rounds, the plan's
# splits: at 8k 1.078x (B = 1) and 1.028x (B = 8) the Triton kernel;
# from 32k (B = 1 and 8) 0.9995-1.018x the Gluon kernel it replaced, which read 1.001-1.010x the
# Triton kernel. Below 32k paged caches (the Triton kernel) would fall
# under 0.95x contiguous: B = 1 16-key pages read 0.968-0.983x the Triton kernel's contiguous speed
# at 8k-16k, so 0.90-0.92x a 1.078x faster contiguous path.
GLUON_MIN_KEYS = 32768

# A launch that fills the GPU (B = 64, Hk = 8: 512 programs) of at most GLUON_FULL_MAX_ROWS rows runs
# the Gluon kernel from GLUON_FULL_MIN_KEYS keys, with the Triton kernel's splits: both fit 4
# programs an SM, so B = 64 runs unsplit in one wave. Against that Triton wave, 5 interleaved rounds
# on two machines: Nq = 1 1.017x at 1k, 1.010-1.014x at 2k,
# 1.006-1.010x at 4k, 1.006x at 8k-16k, 1.004x at 32k, 0.998-1.002x at 64k-128k; Nq = 2 (8 rows) 1.001x at 8k;
# Nq = 4 (16 rows, capped at 128 registers) 0.993 / 0.999x at 4k / 32k, so 16 rows stay on Triton.
# From 2k: with the Gluon kernel at 1k, 16-key and 256-key pages (the
# Triton kernel) read 0.951-0.966x contiguous.
GLUON_FULL_MIN_KEYS = 2048
GLUON_FULL_MAX_ROWS = 8

# Sequences of at most this many key blocks are short: each split's few blocks are a chain of
# dependent loads (length, page index, K/V), so more and shorter splits pay (`plan_launch`).
SHORT_KEY_BLOCKS = 16


@functools.lru_cache(maxsize=256)  # pure: a decode step's layers reuse one plan
def plan_launch(batch: int, heads_k: int, rows: int, head_dim: int, value_dim: int, max_seqlen: int,
                num_sms: int, saturating_per_sm: int = 2, capacity: int | None = None) -> tuple[DecodeConfig, int]:
    """The split kernel's configuration and split count for `rows` = G * Nq query rows per K/V
    head, for contiguous and paged caches alike, reading at most `max_seqlen` keys of a sequence
    from a cache of `capacity` keys (default max_seqlen; a window reads fewer). Pure function. A launch that saturates HBM
    unsplit (at least `saturating_per_sm` programs per SM) takes the configuration with more
    resident programs (`default_config(..., fills_gpu=True)`), and `plan_splits` counts its waves.
    A short sequence (at most SHORT_KEY_BLOCKS key blocks) on an under-filled GPU takes
    that configuration too, split as finely as one wave of its resident programs allows
    (down to one key block a split), where `plan_splits` would split it at all. Measured
    at 1k keys (B = 1: 16 splits of one block 0.60 TB/s contiguous, 0.55 with 16-key
    pages, against 0.56 / 0.47 with 8 splits of 2 blocks and 3 stages; B = 8: 8 splits
    2.24 / 2.10 against 4 splits 2.23 / 1.99); at 2k-4k
    (B = 1 and 8) 2 stages read 1-10% less than 3 with the plan's splits, and at 8k
    (B = 1) 64 splits with 2 stages 2-9% less than the plan.
    A split launch of more programs than SMs merges its splits in the split kernel
    (`merge_in_split`): B = 8, 1k-8k, 1.02-1.05x the combine kernel, 32k-128k level; B = 1
    with 32 splits (32k) 1.04x; with 16 splits (one program per SM; 1k-16k) 0.93-0.98x.
    An under-filled launch over at least
    GLUON_MIN_KEYS keys at D = Dv = 128 with at most 16 rows is marked for the Gluon split kernel
    (`gluon`), a full one of at most GLUON_FULL_MAX_ROWS rows from GLUON_FULL_MIN_KEYS keys; it
    takes the same splits, and on sm_90
    serves them where `gluon_decode_reasons` allows. A window's launch is marked as a plain one over
    the same cache (by `capacity`): at B = 8 a 4k window over 32k and 128k caches read 0.997-0.998x the
    plain Gluon kernel over as many keys through the Gluon kernel, 0.959-0.964x through the Triton one.
    """
    from .backends.triton.decode_kernel import default_config, resident_per_sm

    row_blocks = math.ceil(rows / default_config(rows, head_dim, value_dim).block_m)
    programs = batch * heads_k * row_blocks
    fills_gpu = programs >= num_sms * saturating_per_sm
    config = default_config(rows, head_dim, value_dim, fills_gpu)
    splits = plan_splits(batch, heads_k, max_seqlen, num_sms, row_blocks=row_blocks, block_n=config.block_n,
                         saturating_per_sm=saturating_per_sm, resident_per_sm=resident_per_sm(config))
    key_blocks = math.ceil(max_seqlen / config.block_n)
    if not (fills_gpu or splits == 1 or key_blocks > SHORT_KEY_BLOCKS):
        config = default_config(rows, head_dim, value_dim, fills_gpu=True)
        splits = max(1, min(key_blocks, num_sms * resident_per_sm(config) // programs))
    merge_in_split = splits > 1 and programs * splits > num_sms
    gluon = gluon_marks(fills_gpu, capacity or max_seqlen, rows, head_dim, value_dim)
    return config._replace(merge_in_split=merge_in_split, gluon=gluon), splits


def gluon_marks(fills_gpu: bool, max_seqlen: int, rows: int, head_dim: int, value_dim: int) -> bool:
    """Whether a launch `plan_launch` plans is marked for the Gluon split kernel."""
    if rows > (GLUON_FULL_MAX_ROWS if fills_gpu else 16) or head_dim != 128 or value_dim != 128:
        return False
    return max_seqlen >= (GLUON_FULL_MIN_KEYS if fills_gpu else GLUON_MIN_KEYS)


def triton_plan(problem: DecodeProblem) -> tuple[DecodeConfig, int]:
    """The split kernel's configuration and split count (`problem.num_splits`, or planned if 0), planned
    for the keys a sequence may use (with a window, those it leaves) of its cache."""
    from .backends.triton.configs import multiprocessor_count

    q = problem.q
    num_sms = multiprocessor_count(q.device) if q.is_cuda else 1
    heads_k = problem.k_cache.shape[1]
    rows = (q.shape[1] // heads_k) * q.shape[2]
    config, planned = plan_launch(q.shape[0], heads_k, rows, q.shape[3], problem.v_cache.shape[3], problem.key_span,
                                  num_sms, capacity=problem.capacity)
    return config, problem.num_splits or planned


def run_triton(problem: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon split kernel where the plan marks the launch and it serves the inputs, else the
    Triton kernels. Validated: first raises what earlier calls' kernels recorded
    (`errors.raise_recorded`: a host read, no sync), then the kernels check this call's inputs."""
    return run_triton_op(*decode_op_args(problem))


def run_triton_op(*op_args) -> tuple[torch.Tensor, torch.Tensor]:
    """`run_triton` for the arguments of `decode_op_args`."""
    raise_recorded(op_args[0], op_args[-1])
    return launch_triton(*op_args)


def raise_recorded(q: torch.Tensor, validate: bool) -> None:
    if validate:
        errors.raise_recorded(q.device)
        errors.device_record(q.device)  # made before any recording, so a replay writes to it too


def run_kept(signature, known, q, k_cache, v_cache, cache_seqlens, block_table, sinks, leftpad, validate):
    """A call whose signature `decode` checked before: `known` is (the checked options, the kept replay plan
    of its launches or None, the device's error doorbell when validated and kept), the plan taken once there
    is one (`checked_calls`)."""
    options, kept, doorbell = known
    if kept is not None and kept.current():
        if doorbell is not None and doorbell.value:
            errors.raise_recorded(q.device)
        tensors = [q, k_cache, v_cache, cache_seqlens]
        tensors += [x for x in (block_table, sinks, leftpad) if x is not None]
        return kept.plan.run(tensors)
    op_args = (q, k_cache, v_cache, cache_seqlens, block_table, None, sinks, leftpad, *options, validate)
    result = run_triton_op(*op_args)
    kept = replayed_plan_and_launch().plan_for(*op_args)
    if kept is not None:
        remember(signature, (options, kept, errors.device_record(q.device).rung if validate else None))
    return result


def launch_triton(*op_args) -> tuple[torch.Tensor, torch.Tensor]:
    """`run_triton`'s launches for the arguments of `decode_op_args`, replayed for a signature seen
    before (`backends/triton/replay.py`)."""
    return replayed_plan_and_launch()(*op_args)


@functools.cache
def replayed_plan_and_launch():
    from .backends.triton import replay_key, replays
    from .backends.triton.replay import replayable

    return replayable(replay_key, lambda q, *rest: replays(q, 0.0))(plan_and_launch)


def plan_and_launch(q, k_cache, v_cache, seqlens, block_table, alibi_slopes, sinks, leftpad, scale, num_splits,
                    window_left, softcap, validate) -> tuple[torch.Tensor, torch.Tensor]:
    from .backends.triton import decode_kernel
    from .backends.triton.passes import settings

    problem = problem_from_op_args(q, k_cache, v_cache, seqlens, block_table, alibi_slopes, sinks, leftpad, scale,
                                   num_splits, window_left, softcap, validate)
    config, num_splits = triton_plan(problem)
    if config.gluon and settings.use_gluon:
        from .backends.triton.gluon_decode import gluon_decode_forward, gluon_decode_reasons

        if not gluon_decode_reasons(problem.q, problem.k_cache, problem.v_cache, problem.block_table,
                                    problem.score_rules_in_use):
            return gluon_decode_forward(problem.q, problem.k_cache, problem.v_cache, problem.seqlens,
                                        problem.scale, num_splits, validate=problem.validate,
                                        window_left=problem.window_left)
    rules = problem.rules or ScoreRules()
    kernel_rules = decode_kernel.DecodeRules(problem.window_left, problem.softcap, rules.alibi_slopes, rules.sinks,
                                             problem.leftpad)
    return decode_kernel.decode_forward(
        problem.q, problem.k_cache, problem.v_cache, problem.seqlens, problem.block_table,
        problem.scale, num_splits, config, kernel_rules, problem.validate,
    )


def split_keys(problem: DecodeProblem, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [lo, hi) of every sequence, (B, Hk, hi - lo, D|Dv).

    Paged: `lo` is a multiple of the page size; slots past a sequence's length
    read page 0 (those keys are masked out)."""
    if not problem.paged:
        return problem.k_cache[:, :, lo:hi], problem.v_cache[:, :, lo:hi]
    size = problem.page_size
    slots = slice(lo // size, math.ceil(hi / size))
    pages = torch.where(used_pages(problem)[:, slots], problem.block_table[:, slots], 0).long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        return cache[pages].transpose(1, 2).flatten(2, 3)[:, :, : hi - lo]

    return gather(problem.k_cache), gather(problem.v_cache)


def split_mask(problem: DecodeProblem, lo: int, hi: int) -> torch.Tensor:
    """What the new tokens may see of keys [lo, hi): bool (B, 1, Nq, n) (lengths, causal, window, left
    padding), or with ALiBi the float bias (B, Hq, Nq, n), -inf where not allowed."""
    lens, len_q = problem.seqlens, problem.q.shape[2]
    token = torch.arange(len_q, device=lens.device)
    key = torch.arange(lo, hi, device=lens.device)
    position = lens[:, None, None, None] - len_q + token[None, None, :, None]  # the token's own key
    allowed = key <= position
    if problem.window_left != UNBOUNDED:
        allowed &= key >= position - problem.window_left
    if problem.leftpad is not None:
        allowed &= key >= problem.leftpad[:, None, None, None]
    if problem.rules is None or problem.rules.alibi_slopes is None:
        return allowed
    slopes = problem.rules.alibi_slopes.to(compute_dtype(problem.q.dtype))[:, :, None, None]
    return (-slopes * (position - key).abs()).masked_fill(~allowed, float("-inf"))


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the virtual sink key (logit sinks[h], value 0) into the merged splits, once."""
    sink_lse = sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse)
    return merge_states(out, lse, torch.zeros_like(out), sink_lse)


# Elements one batch of splits may hold in `run_tiled`: scores (B * Hq * Nq a key) or keys and values
# (B * Hk * (D + Dv) a key), whichever is more, over the keys of the splits taken together
SPLIT_ELEMENTS = 1 << 22


def run_tiled(problem: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """`tiled_forward` on the splits, as many at once as SPLIT_ELEMENTS allows (folded into the batch, so
    each is still summarized alone; a mask carries the lengths, the causal rule, the window and ALiBi),
    each such batch of two or more merged by `merge_stacked` and the batches by `merge_states` in the
    compute dtype, then the sinks. The keys every sequence holds are read in place; where some sequence
    holds none (past its length, before its left padding) the splits take copies with those slots zeroed
    (`key_ranges`). Syncs once to read the lengths' range and the longest left padding. Validated, it
    checks lengths, left paddings and pages on the host first (`check_lengths`); either way it reads them
    clamped as the kernels do (`clamped`)."""
    if problem.validate:
        check_lengths(problem)
    problem = clamped(problem)
    q, lens = problem.q, problem.seqlens
    batch, heads_q, len_q, dim = q.shape
    heads_k, dim_v = problem.v_cache.shape[1], problem.v_cache.shape[3]
    first_key = lens.new_zeros(()) if problem.leftpad is None else problem.leftpad.max()
    shortest, longest, first_key = torch.stack([*lens.aminmax(), first_key]).tolist()
    chunk = max(1, split_chunk(longest, max(1, problem.num_splits), problem.page_size))  # 0 keys: no split
    per_key = batch * max(heads_q * len_q, heads_k * (dim + dim_v))
    params = AttentionParams(scale=problem.scale, softcap=problem.softcap)
    q_acc = q.to(compute_dtype(q.dtype))
    out = lse = None
    for start, stop, in_use in key_ranges(longest, first_key, shortest, problem.page_size):
        range_chunk = min(chunk, math.ceil((stop - start) / problem.page_size) * problem.page_size)
        together = max(1, SPLIT_ELEMENTS // max(1, per_key * range_chunk))
        for lo in range(start, stop, together * range_chunk):
            hi = min(lo + together * range_chunk, stop)
            states = split_states(problem, q_acc, lo, hi, range_chunk, in_use, params)
            merged = merge_stacked(*states, 1) if states[1].shape[1] > 1 else (states[0][:, 0], states[1][:, 0])
            out, lse = merged if out is None else merge_states(out, lse, *merged)
    if out is None:  # no sequence holds a key
        out = q_acc.new_zeros(batch, heads_q, len_q, dim_v)
        lse = q_acc.new_full((batch, heads_q, len_q), NEG_INF)
    if problem.rules is not None and problem.rules.sinks is not None:
        out, lse = add_sinks(out, lse, problem.rules.sinks)
    return out.to(q.dtype), lse


def key_ranges(longest: int, first_key: int, shortest: int, align: int) -> list[tuple[int, int, bool]]:
    """Keys [0, longest) as ranges (start, stop, every sequence holds them), cut at multiples of `align`
    (a paged cache's page size): the keys from the last left padding (`first_key`) to the shortest
    length, which every sequence holds, and the edges around them."""
    held_from = math.ceil(first_key / align) * align
    held_to = shortest // align * align
    if held_from >= held_to:
        return [(0, longest, False)] if longest else []
    ranges = ((0, held_from, False), (held_from, held_to, True), (held_to, longest, False))
    return [(start, stop, held) for start, stop, held in ranges if stop > start]


def split_states(problem: DecodeProblem, q_acc: torch.Tensor, lo: int, hi: int, chunk: int, in_use: bool,
                 params: AttentionParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, S, Hq, Nq, Dv), lse (B, S, Hq, Nq)) of keys [lo, hi) cut into S splits of `chunk` keys,
    the last one padded with masked keys: one `tiled_forward` with the splits folded into the batch.
    in_use: every sequence holds keys [lo, hi). Where some does not, its stale slots are zeroed in copies
    of the keys and values, unless the mask is boolean and the stale values are finite (`finite_at`): the
    mask then sets a stale key's score to -inf whatever it holds, and its value weighs exactly 0 in place
    (a bias, ALiBi's, would add -inf to a score that may be inf or NaN)."""
    batch, heads_q, len_q, _ = q_acc.shape
    parts = math.ceil((hi - lo) / chunk)
    k, v = split_keys(problem, lo, hi)
    slots = torch.arange(lo, lo + parts * chunk, device=q_acc.device).view(parts, chunk)
    stale = (slots >= hi) | (slots >= problem.seqlens[:, None, None])  # (B, S, chunk): padding, past a length
    if problem.leftpad is not None:  # or before a sequence's first key
        stale |= slots < problem.leftpad[:, None, None]
    mask = split_mask(problem, lo, hi).expand(batch, heads_q, len_q, hi - lo)
    padding = parts * chunk - (hi - lo)
    if padding:
        mask = torch.nn.functional.pad(mask, (0, padding), value=False if mask.dtype == torch.bool else NEG_INF)
    mask_parts = mask.unflatten(3, (parts, chunk)).permute(0, 3, 1, 2, 4).flatten(0, 1)
    q_parts = q_acc.unsqueeze(1).expand(batch, parts, *q_acc.shape[1:]).flatten(0, 1)
    read_in_place = not padding and (in_use or mask.dtype == torch.bool and finite_at(stale.flatten(1), v))
    k, v = (folded_keys(x, None if read_in_place else stale, parts, chunk) for x in (k, v))
    out, lse = tiled_forward(q_parts, k, v, mask_parts, params)
    return out.unflatten(0, (batch, parts)), lse.unflatten(0, (batch, parts))


def finite_at(slots: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether x (B, H, n, D) holds only finite numbers at the bool (B, n) `slots` (one reduction, no copy;
    a host sync). A sum that overflows counts as not finite."""
    return bool(torch.isfinite(x.sum((1, 3), dtype=torch.float32)[slots]).all())


def folded_keys(x: torch.Tensor, stale: torch.Tensor | None, parts: int, chunk: int) -> torch.Tensor:
    """Keys (or values) (B, H, n, D) as (B * S, H, chunk, D), split s of sequence b at b * S + s, the
    `stale` slots (B, S, chunk) zero (they may hold NaN, which a bias keeps; None: none is). One split
    without stale slots stays a view."""
    batch, heads, n, dim = x.shape
    if parts == 1 and n == chunk:
        return x if stale is None else x.masked_fill(stale[:, :, None, :, None].flatten(0, 1), 0)
    whole = n // chunk
    folded = torch.empty(batch, parts, heads, chunk, dim, dtype=x.dtype, device=x.device)
    by_split = folded.permute(0, 2, 1, 3, 4)  # (B, H, S, chunk, D), a view
    by_split[:, :, :whole].copy_(x[:, :, : whole * chunk].unflatten(2, (whole, chunk)))
    if whole < parts:
        by_split[:, :, whole, : n - whole * chunk].copy_(x[:, :, whole * chunk:])
    if stale is not None:
        folded.masked_fill_(stale[:, :, None, :, None], 0)
    return folded.flatten(0, 1)


def clamped(problem: DecodeProblem) -> DecodeProblem:
    """The problem with lengths clamped to [0, capacity], left paddings to [0, length] and page ids to
    [0, num_pages), as the kernels read them: with validate=False nothing outside the caches is read either."""
    table = problem.block_table
    if table is not None:
        table = table.clamp(0, problem.k_cache.shape[0] - 1)
    seqlens = problem.seqlens.clamp(0, problem.capacity)
    leftpad = problem.leftpad
    if leftpad is not None:
        leftpad = torch.minimum(leftpad.clamp_min(0), seqlens)
    return dataclasses.replace(problem, seqlens=seqlens, block_table=table, leftpad=leftpad)


# ---------------------------------------------------------------- torch.compile

def define_decode_op(backend: str, run):
    """`exattn::decode_<backend>`: `run` over a validated `DecodeProblem`'s arguments (`decode_op_args`) as
    one opaque op for `torch.compile` (no backward: decoding has none), returning out (B, Hq, Nq, Dv) in
    q's dtype and lse (B, Hq, Nq) float32."""

    def impl(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
        block_table: torch.Tensor | None, alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None,
        leftpad: torch.Tensor | None, scale: float, num_splits: int, window_left: int, softcap: float,
        validate: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return run(q, k_cache, v_cache, seqlens, block_table, alibi_slopes, sinks, leftpad, scale, num_splits,
                   window_left, softcap, validate)

    op = torch.library.custom_op(f"exattn::decode_{backend}", impl, mutates_args=())

    @op.register_fake
    def _(q, k_cache, v_cache, *args):
        return q.new_empty(*q.shape[:3], v_cache.shape[3]), q.new_empty(q.shape[:3], dtype=torch.float32)

    return op


def problem_from_op_args(q, k_cache, v_cache, seqlens, block_table, alibi_slopes, sinks, leftpad, scale, num_splits,
                         window_left, softcap, validate) -> DecodeProblem:
    """The `DecodeProblem` of `decode_op_args`' arguments."""
    rules = ScoreRules(alibi_slopes=alibi_slopes, sinks=sinks)
    return DecodeProblem(
        q=q, k_cache=k_cache, v_cache=v_cache, seqlens=seqlens, block_table=block_table, scale=scale,
        num_splits=num_splits, window_left=window_left, softcap=softcap, rules=rules if rules.in_use() else None,
        validate=validate, leftpad=leftpad,
    )


def decode_op_args(problem: DecodeProblem) -> tuple:
    rules = problem.rules or ScoreRules()
    return (problem.q, problem.k_cache, problem.v_cache, problem.seqlens, problem.block_table, rules.alibi_slopes,
            rules.sinks, problem.leftpad, problem.scale, problem.num_splits, problem.window_left, problem.softcap,
            problem.validate)


def run_tiled_op(*op_args) -> tuple[torch.Tensor, torch.Tensor]:
    """`run_tiled` for the arguments of `decode_op_args`, lse in float32 as `decode` returns it."""
    out, lse = run_tiled(problem_from_op_args(*op_args))
    return out, lse.to(torch.float32)


DECODE_OPS = {"triton": define_decode_op("triton", run_triton_op), "tiled": define_decode_op("tiled", run_tiled_op)}


def refuse_gradients(**tensors) -> None:
    """decode has no backward pass: a tensor that requires grad, with grad mode on, is refused rather than
    given an output that silently carries no gradient."""
    for name, x in tensors.items():
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise ValueError(f"decode computes no gradient, but {name} requires grad: call it under "
                             f"torch.no_grad() or pass {name}.detach() (exattn.attention is differentiable)")


# ---------------------------------------------------------------- public entry point

@overload
def decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
    cache_seqlens: torch.Tensor | None = ..., block_table: torch.Tensor | None = ...,
    scale: float | None = ..., num_splits: int = ..., return_lse: Literal[False] = ...,
    backend: str = ..., validate: bool = ..., window: tuple[int, int] | None = ..., softcap: float = ...,
    alibi_slopes: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
    cache_leftpad: torch.Tensor | None = ...,
) -> torch.Tensor: ...


@overload
def decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
    cache_seqlens: torch.Tensor | None = ..., block_table: torch.Tensor | None = ...,
    scale: float | None = ..., num_splits: int = ..., return_lse: Literal[True],
    backend: str = ..., validate: bool = ..., window: tuple[int, int] | None = ..., softcap: float = ...,
    alibi_slopes: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
    cache_leftpad: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def decode(
    q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, scale=None,
    num_splits=0, return_lse=False, backend="auto", validate=True, window=None, softcap=0.0,
    alibi_slopes=None, sinks=None, cache_leftpad=None,
):
    """Attention of Nq new tokens over a KV cache (split-KV, exact).

    Args:
        q: (B, Hq, Nq, D), the new tokens' queries (Nq >= 1, typically 1).
        k_cache, v_cache: contiguous (B, Hk, Nmax, D) and (B, Hk, Nmax, Dv), or
            paged (num_pages, Hk, page_size, D) and (num_pages, Hk, page_size, Dv)
            when `block_table` is given. Hq % Hk == 0. Any strides.
        cache_seqlens: int32 (B,), valid keys per sequence (default: the whole
            cache). The new tokens are the last Nq of them: query t sees keys
            j <= cache_seqlens[b] - Nq + t.
        block_table: int32 (B, max_pages), sequence b's pages in order.
        scale: score scale, default D ** -0.5.
        num_splits: cut each sequence's keys into this many parts, summarized
            independently and merged exactly; 0 lets the backend choose.
        return_lse: also return lse (B, Hq, Nq), natural log, float32.
        backend: "auto" (triton on CUDA, else tiled), "triton" or "tiled".
        validate: check each length against [Nq, capacity], each left padding against [0, length]
            and each used page id against
            [0, num_pages), without a device sync on the Triton path: its kernels record the
            first violation, and it surfaces as a ValueError naming the sequence at the first
            validated call that starts after that kernel finished, or at
            `exattn.check_errors()` (`exattn.errors`). The tiled path checks on the host, before
            computing. False skips the checks (CUDA graphs, the hot decode loop): an invalid length
            or page id then gives meaningless output for that sequence. Either way lengths are
            read clamped to [0, capacity] and page ids to [0, num_pages), so nothing outside the
            caches is read. Validated calls can be captured in CUDA graphs too (after one
            validated call on that device outside the capture): replays record, and
            `check_errors()` after them raises.
        window: (left, right) as in `attention`, around each new token's own position
            L - Nq + t (decoding is causal, so only `left` narrows what a token sees). The
            Triton kernels read only the key blocks some token's window reaches.
        softcap, alibi_slopes, sinks: as in `attention` (ALiBi's distance is between the
            token's position and the key's; the sink joins each row's softmax once, and lse
            includes it). All four run in the Triton decode kernels and on the tiled backend.
        cache_leftpad: int32 (B,), where each sequence's keys start (FlashAttention's name): keys
            j < cache_leftpad[b] are left out, as the left padding of a batch of prompts; what a
            token may see of the rest is unchanged (its position stays cache_seqlens[b] - Nq + t, and
            ALiBi's distances and the window count from it). Each must lie in [0, cache_seqlens[b]];
            a token that sees no key gets zeros (and lse -inf, or the sink's). Those slots may hold
            anything, NaN included: they are never read (a paged cache's block_table still names
            valid pages there). Runs in the Triton decode kernels (not the Gluon one) and on the
            tiled backend.

    Under `torch.compile` (fullgraph=True, any mode, "reduce-overhead" included, dynamic shapes too)
    the Triton path runs as the opaque custom op `exattn::decode_triton`. validate=True needs no sync
    there either; inside replayed CUDA graphs (mode="reduce-overhead") nothing runs on the host, so
    errors recorded by replays surface at `check_errors()` or the next eager validated call. The
    tiled path runs as `exattn::decode_tiled`, which reads the lengths on the host when it runs.

    No backward pass: with grad mode on, a q, cache or sinks that requires grad is refused (ValueError);
    call it under torch.no_grad(), or use `exattn.attention`, which is differentiable.

    Returns:
        out (B, Hq, Nq, Dv) in q's dtype, or (out, lse) if return_lse.
    """
    check_bool("return_lse", return_lse)
    signature = None
    if cache_seqlens is not None and alibi_slopes is None and not torch.compiler.is_compiling():
        tensors = (q, k_cache, v_cache, cache_seqlens, block_table, sinks, cache_leftpad)
        signature = call_signature("decode", tensors, window, (scale, num_splits, validate, softcap, backend))
        known = known_call(signature)
        if known is not None:
            if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad
                                            or (sinks is not None and sinks.requires_grad)):
                refuse_gradients(q=q, k_cache=k_cache, v_cache=v_cache, sinks=sinks)
            out, lse = run_kept(signature, known, *tensors, validate)
            return (out, lse.to(torch.float32)) if return_lse else out
    problem = make_decode_problem(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, validate,
                                  window, softcap, alibi_slopes, sinks, cache_leftpad)
    if torch.is_grad_enabled():
        refuse_gradients(q=q, k_cache=k_cache, v_cache=v_cache, sinks=sinks)
    name = choose_decode_backend(problem, backend)
    if name == "triton" and q.numel() > 0:
        remember(signature, ((problem.scale, problem.num_splits, problem.window_left, problem.softcap), None, None))
    if q.numel() == 0:  # no batch or no query head: nothing to attend
        out, lse = q.new_empty(*q.shape[:3], v_cache.shape[3]), q.new_empty(q.shape[:3], dtype=torch.float32)
    elif torch.compiler.is_compiling():
        out, lse = DECODE_OPS[name](*decode_op_args(problem))
    else:
        out, lse = run_triton(problem) if name == "triton" else run_tiled(problem)
    if not return_lse:
        return out
    return out, lse.to(torch.float32)
