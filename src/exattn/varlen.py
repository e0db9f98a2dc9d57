"""`exattn.attention_varlen`: packed variable-length batches, token-major.

Sequence `b` owns query rows `cu_seqlens_q[b] : cu_seqlens_q[b+1]` of
`q: (total_q, Hq, D)` and key rows `cu_seqlens_k[b] : cu_seqlens_k[b+1]` of
`k: (total_k, Hk, D)`, `v: (total_k, Hk, Dv)`. Every rule of `attention`
applies per sequence, with its own lengths (causal and window bottom-right
within the sequence); no query attends a key of another sequence. Packed
`[A A A | B B]` queries against `[a a a a | b b]` keys, causal (`x` = allowed):

    key   a0 a1 a2 a3 b0 b1
    A0    x  x  .  .  .  .
    A1    x  x  x  .  .  .
    A2    x  x  x  x  .  .
    B0    .  .  .  .  x  .
    B1    .  .  .  .  x  x

The arguments are checked once, into a `VarlenProblem`. Backends:

- "tiled": per sequence, (1, H, N, d) views of the packed tensors run through
  the dense tiled passes (`backends/tiled.py`), one score tile at a time; a batch of
  many tiny sequences sharing query and key offsets as one sequence with segment ids
  (`one_sequence`).
- "naive": per sequence, the textbook formula in the input dtype.
- "triton": the fused kernels (`exattn.backends.triton.varlen`), which read the
  offsets on the device: no host sync, the grid sized by `max_seqlen_*`.

Dropout: weight `(b, h, i, j)` (local positions) is kept iff
`dropout_mask(seed, (B, Hq, max_seqlen_q, max_seqlen_k), p)[b, h, i, j]`. A dense
pass over sequence `b` reads that padded grid through
`AttentionParams.dropout_grid = (b, max_seqlen_q, max_seqlen_k)`.
"""

from __future__ import annotations

import bisect
import numbers
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple, overload

import torch

from .backends import AUTO_PRIORITY, BackendChoice, check_backend_name
from .backends.autograd import no_gradients, returned_with_lse, row_delta, wants_grad
from .backends.custom_ops import PACKED, define_attention_ops
from .backends.naive import NaiveBackend
from .backends.planned import keep_planned
from .backends.tiled import tiled_backward, tiled_forward
from .checked_calls import call_signature, keepable, known_call, remember
from .masks import lse_without_keys, sinks_grad
from .problem import (
    AttentionParams,
    AttentionProblem,
    HeadShapes,
    ScoreRules,
    check_bool,
    check_qkv,
    check_score_rules,
    check_tensor,
    compute_dtype,
    make_params,
)

PACKED_LAYOUT = "(total, heads, dim)"


@dataclass(frozen=True)
class VarlenProblem(HeadShapes):
    """Validated `attention_varlen` inputs.

    q: (total_q, Hq, D); k: (total_k, Hk, D); v: (total_k, Hk, Dv), any strides.
    cu_seqlens_q, cu_seqlens_k: int32 (B + 1,) on q's device.
    `params` is the `AttentionParams` every sequence shares (causal folded into
    `window`; `dropout_grid` None: each pass places sequence b on the padded
    (B, Hq, max_seqlen_q, max_seqlen_k) grid itself). `validated`: whether the
    offsets' values were checked (`validate=True`); if not, bad offsets are
    undefined behaviour. `rules`: None, or the `ScoreRules` (prefix (B,), ALiBi slopes
    (B, Hq), sinks (Hq,); no segment ids) that sequence b reads at row b.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    params: AttentionParams
    validated: bool
    rules: ScoreRules | None = None

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1

    @property
    def total_q(self) -> int:
        return self.q.shape[0]

    @property
    def total_k(self) -> int:
        return self.k.shape[0]

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.q.dtype)

    @property
    def mask(self) -> None:
        """Varlen takes no mask; None, so the dense backends' reason functions apply as they are."""
        return None


# ---------------------------------------------------------------- validation


def check_offsets(name: str, offsets: object, q: torch.Tensor) -> torch.Tensor:
    """What can be checked of `cu_seqlens_*` without reading its values."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 offsets (B + 1,), got {type(offsets).__name__}")
    if offsets.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] == 0:
        raise ValueError(f"{name} must be 1-D of shape (B + 1,) with B >= 0, got shape {tuple(offsets.shape)}")
    if offsets.device != q.device:
        raise ValueError(f"{name} is on {offsets.device} but q is on {q.device}; offsets must be on q's device")
    return offsets


def check_max_seqlen(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
    if not 0 <= value < 2**31:
        raise ValueError(f"{name} must be in [0, 2**31) (int32 offsets), got {value}")
    return int(value)


def offsets_to_host(offsets: torch.Tensor) -> list[int]:
    """The offsets as Python ints: one device-to-host copy (a sync on a GPU)."""
    return offsets.tolist()


# Offsets tensors whose values passed `check_offset_values`: (id, total, max_seqlen) -> (a weak reference to
# the tensor, its version counter then). `check_offsets_once` skips them while the tensor is alive and unchanged.
CHECKED_OFFSETS: dict[tuple[int, int, int], tuple[weakref.ref, int]] = {}
MAX_CHECKED = 256


def check_offsets_once(name: str, offsets: torch.Tensor, total: int, total_name: str, max_seqlen: int,
                       max_name: str) -> None:
    """`check_offset_values` unless this very tensor passed it for the same total and max_seqlen and has
    not been written since (torch's version counter: every in-place torch op on it or a view counts; a
    write that bypasses torch, such as a custom kernel's, does not). The layers of one model step share one
    offsets tensor, so only the first reads it to the host (a device sync on a GPU)."""
    key = (id(offsets), total, max_seqlen)
    seen = CHECKED_OFFSETS.get(key)
    if seen is not None and seen[0]() is offsets and seen[1] == offsets._version:
        return
    check_offset_values(name, offsets_to_host(offsets), total, total_name, max_seqlen, max_name)
    if len(CHECKED_OFFSETS) >= MAX_CHECKED:
        CHECKED_OFFSETS.clear()
    CHECKED_OFFSETS[key] = (weakref.ref(offsets), offsets._version)


def check_both_offsets_once(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, max_q: int,
                            max_k: int) -> None:
    check_offsets_once("cu_seqlens_q", cu_q, total_q, "total_q", max_q, "max_seqlen_q")
    check_offsets_once("cu_seqlens_k", cu_k, total_k, "total_k", max_k, "max_seqlen_k")


def check_offset_values(name: str, offsets: list[int], total: int, total_name: str,
                        max_seqlen: int, max_name: str) -> None:
    """The rules that need the offsets' values: start at 0, non-decreasing, end at the total,
    no sequence longer than max_seqlen."""
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {offsets[0]}")
    for b in range(len(offsets) - 1):
        length = offsets[b + 1] - offsets[b]
        if length < 0:
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{b + 1}] = {offsets[b + 1]} "
                f"< {name}[{b}] = {offsets[b]}"
            )
        if length > max_seqlen:
            raise ValueError(
                f"{max_name} = {max_seqlen} must be at least the longest sequence, got sequence {b} "
                f"of length {length} ({name}[{b + 1}] - {name}[{b}])"
            )
    if offsets[-1] != total:
        raise ValueError(f"{name} must end at {total_name} = {total}, got {name}[-1] = {offsets[-1]}")


def make_varlen_problem(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, window=None,
    scale=None, dropout_p=0.0, seed=None, block_m=None, block_n=None, validate=True,
    prefix=None, softcap=0.0, alibi_slopes=None, sinks=None,
) -> VarlenProblem:
    """Check every argument of `attention_varlen` (the offsets' values only if `validate`)."""
    q, k, v = (check_tensor(name, x, 3, PACKED_LAYOUT) for name, x in (("q", q), ("k", k), ("v", v)))
    # The dense rules (dtypes, devices, heads, dims) on (1, H, total, d) views: one copy of them.
    check_qkv(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)))
    cu_q, cu_k = check_offsets("cu_seqlens_q", cu_seqlens_q, q), check_offsets("cu_seqlens_k", cu_seqlens_k, q)
    if cu_k.shape[0] != cu_q.shape[0]:
        raise ValueError(
            f"cu_seqlens_k has {cu_k.shape[0]} entries but cu_seqlens_q has {cu_q.shape[0]}; "
            "both must be (B + 1,) for the same B"
        )
    max_q, max_k = check_max_seqlen("max_seqlen_q", max_seqlen_q), check_max_seqlen("max_seqlen_k", max_seqlen_k)
    batch = cu_q.shape[0] - 1
    for x, total_name, max_name, most in ((q, "total_q", "max_seqlen_q", max_q), (k, "total_k", "max_seqlen_k", max_k)):
        if x.shape[0] > batch * most:
            raise ValueError(
                f"{total_name} = {x.shape[0]} rows cannot be packed into B = {batch} sequences of at most "
                f"{max_name} = {most} rows; {max_name} must be at least the longest sequence"
            )
    check_bool("validate", validate)
    if validate and torch.compiler.is_compiling():
        raise ValueError("validate=True reads the offsets to the host, which torch.compile cannot trace: "
                         "pass validate=False there (and check the offsets outside the compiled code)")
    if validate:
        check_both_offsets_once(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
    params = make_params(
        q.shape[2], causal=causal, window=window, scale=scale, dropout_p=dropout_p, seed=seed,
        block_m=block_m, block_n=block_n, softcap=softcap,
    )
    rules = check_score_rules(
        batch=batch, heads_q=q.shape[1], len_q=max_q, len_k=max_k, device=q.device, dtype=q.dtype,
        prefix=prefix, alibi_slopes=alibi_slopes, sinks=sinks,
    )
    return VarlenProblem(q, k, v, cu_q, cu_k, max_q, max_k, params, validate, rules)


# ---------------------------------------------------------------- per-sequence views


def sequence_view(x: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows of a packed (total, H, d) tensor as a dense (1, H, n, d) view (no copy)."""
    return x[rows].transpose(0, 1).unsqueeze(0)


def sequences(offsets_q: list[int], offsets_k: list[int]):
    """(b, query rows, key rows) of every sequence with queries and keys, from the offsets read to the
    host (`offsets_to_host`: a sync on a GPU, acceptable for the PyTorch paths, which loop on the host
    anyway). A sequence with no queries or no keys is skipped: its rows keep zeros, lse -inf, zero grads."""
    for b in range(len(offsets_q) - 1):
        rows_q = slice(offsets_q[b], offsets_q[b + 1])
        rows_k = slice(offsets_k[b], offsets_k[b + 1])
        if rows_q.stop > rows_q.start and rows_k.stop > rows_k.start:
            yield b, rows_q, rows_k


def sequence_params(params: AttentionParams, b: int, max_q: int, max_k: int) -> AttentionParams:
    """Sequence b's params: its keep-mask read at batch b of the (B, Hq, max_q, max_k) grid."""
    return replace(params, dropout_grid=(b, max_q, max_k))


# ---------------------------------------------------------------- the tiled passes


def sequence_rules(rules: ScoreRules | None, b: int) -> ScoreRules | None:
    """Sequence b's rules: row b of the prefix and the slopes, the shared sinks."""
    return None if rules is None else rules.for_batch(b)


def empty_lse(rules: ScoreRules | None, heads_q: int, total_q: int, dtype, device) -> torch.Tensor:
    """(Hq, total_q) lse of rows with no allowed key: -inf, or sinks[h] with sinks."""
    lse = torch.empty((heads_q, total_q), dtype=dtype, device=device)
    return lse_without_keys(lse, None if rules is None else rules.sinks, head_dim=0)


# The tiled passes run a packed batch as one sequence with segment ids (`one_sequence`) where its sequences
# number at least ONE_SEQUENCE_TILE_COST times the tiles that form computes (`one_sequence_tiles`), else
# sequence by sequence. Causal forward + backward, 8k tokens, H = 8, d = 64, float32, 2-core CPU, 128-row
# tiles: sequences of 16 / 32 tokens 266 -> 125 / 172 -> 129 ms; left to the loop by this rule: 64 tokens
# 144 -> 121 ms, 96 tokens 120 -> 173 ms, log-uniform 16-128 145 -> 197 ms, 8-64 199 -> 186 ms (docs/varlen.md).
ONE_SEQUENCE_TILE_COST = 2.5
ONE_SEQUENCE_TILES = 128


class OneSequence(NamedTuple):
    """A packed batch as one (1, H, total, d) sequence: its params and its rules with segment ids."""

    params: AttentionParams
    rules: ScoreRules


def one_sequence_tiles(offsets: list[int], block_m: int, block_n: int, causal: bool) -> int:
    """The tiles the one-sequence form computes: for each row tile, the key tiles from the start of the
    sequence holding its first row to the end of the one holding its last (to the diagonal under causal)."""
    count, total = 0, offsets[-1]
    for first_row in range(0, total, block_m):
        last_row = min(first_row + block_m, total) - 1
        start = offsets[bisect.bisect_right(offsets, first_row) - 1]
        stop = offsets[bisect.bisect_left(offsets, last_row + 1)]
        if causal:
            stop = min(stop, last_row + 1)
        count += (stop + block_n - 1) // block_n - start // block_n
    return count


def one_sequence(offsets_q: list[int], offsets_k: list[int], total_q: int, params: AttentionParams,
                 rules: ScoreRules | None, device: torch.device) -> OneSequence | None:
    """The batch as one sequence where that serves it and is measured faster (ONE_SEQUENCE_TILE_COST):
    queries and keys share offsets that cover the tokens in order, no dropout (its keep-mask is read per
    sequence), no prefix and no per-sequence ALiBi slopes; else None."""
    lengths = [stop - start for start, stop in zip(offsets_q, offsets_q[1:])]
    if (offsets_q != offsets_k or offsets_q[0] != 0 or offsets_q[-1] != total_q or total_q == 0
            or min(lengths) < 0 or params.dropout_p > 0):
        return None
    rules = rules or ScoreRules()
    if rules.prefix is not None or (rules.alibi_slopes is not None and rules.alibi_slopes.stride(0) != 0):
        return None
    tiles = replace(params, block_m=params.block_m or ONE_SEQUENCE_TILES, block_n=params.block_n or ONE_SEQUENCE_TILES)
    causal = params.window[1] == 0
    if sum(n > 0 for n in lengths) < ONE_SEQUENCE_TILE_COST * one_sequence_tiles(offsets_q, tiles.block_m,
                                                                                  tiles.block_n, causal):
        return None
    ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                  torch.tensor(lengths)).to(device)[None]
    slopes = None if rules.alibi_slopes is None else rules.alibi_slopes[:1]
    return OneSequence(tiles, ScoreRules(ids, ids, alibi_slopes=slopes, sinks=rules.sinks))


EVERY = slice(None)  # every row of a packed tensor: the batch as one sequence


def tiled_plan(cu_q, cu_k, q, params: AttentionParams, rules: ScoreRules | None):
    """(host offsets of queries, of keys, the batch as one sequence or None) for the tiled passes."""
    offsets_q, offsets_k = offsets_to_host(cu_q), offsets_to_host(cu_k)
    return offsets_q, offsets_k, one_sequence(offsets_q, offsets_k, q.shape[0], params, rules, q.device)


def tiled_varlen_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, params: AttentionParams,
                         rules: ScoreRules | None = None):
    """out (total_q, Hq, Dv) in q's dtype, lse (Hq, total_q) in the compute dtype."""
    offsets_q, offsets_k, whole = tiled_plan(cu_q, cu_k, q, params, rules)
    if whole is not None:
        out, lse = tiled_forward(*(sequence_view(x, EVERY) for x in (q, k, v)), None, whole.params, whole.rules)
        return out[0].transpose(0, 1).contiguous(), lse[0]
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = empty_lse(rules, q.shape[1], q.shape[0], compute_dtype(q.dtype), q.device)
    for b, rows_q, rows_k in sequences(offsets_q, offsets_k):
        out_b, lse_b = tiled_forward(
            sequence_view(q, rows_q), sequence_view(k, rows_k), sequence_view(v, rows_k), None,
            sequence_params(params, b, max_q, max_k), sequence_rules(rules, b),
        )
        sequence_view(out, rows_q).copy_(out_b)
        lse[:, rows_q] = lse_b[0]
    return out, lse


def tiled_varlen_backward(dout, q, k, v, cu_q, cu_k, max_q: int, max_k: int, out, lse, params: AttentionParams,
                          rules: ScoreRules | None = None):
    """dq, dk, dv in the dtypes of q, k, v, recomputed per sequence from the saved lse."""
    dtype = compute_dtype(q.dtype)
    grads = tuple(torch.zeros(x.shape, dtype=dtype, device=x.device) for x in (q, k, v))
    dq, dk, dv = grads
    offsets_q, offsets_k, whole = tiled_plan(cu_q, cu_k, q, params, rules)
    if whole is not None:
        tiled_backward(*(sequence_view(x, EVERY) for x in (dout, q, k, v)), None, sequence_view(out, EVERY),
                       lse.unsqueeze(0), whole.params,
                       accumulate_into=tuple(sequence_view(g, EVERY) for g in grads), rules=whole.rules)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    for b, rows_q, rows_k in sequences(offsets_q, offsets_k):
        tiled_backward(
            sequence_view(dout, rows_q), sequence_view(q, rows_q), sequence_view(k, rows_k),
            sequence_view(v, rows_k), None, sequence_view(out, rows_q), lse[:, rows_q].unsqueeze(0),
            sequence_params(params, b, max_q, max_k),
            accumulate_into=(sequence_view(dq, rows_q), sequence_view(dk, rows_k), sequence_view(dv, rows_k)),
            rules=sequence_rules(rules, b),
        )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class VarlenPasses(NamedTuple):
    """A varlen backend's raw passes (no autograd), the hook's interface:

        forward(q, k, v, cu_q, cu_k, max_q, max_k, params[, rules]) -> (out, lse)
        backward(dout, q, k, v, cu_q, cu_k, max_q, max_k, out, lse, params[, rules=rules]) -> (dq, dk, dv)

    (`rules` is passed only when the problem has score rules: the tiled passes take it.)

    out (total_q, Hq, Dv) in q's dtype; lse (Hq, total_q), natural log, float32 (the
    tiled pass: the compute dtype), -inf for rows with no allowed key; dq, dk, dv in the
    dtypes of q, k, v.
    """

    forward: Callable
    backward: Callable


TILED_PASSES = VarlenPasses(tiled_varlen_forward, tiled_varlen_backward)


def triton_varlen_passes() -> VarlenPasses:
    from .backends.triton.varlen import triton_varlen_backward, triton_varlen_forward

    return VarlenPasses(triton_varlen_forward, triton_varlen_backward)


VARLEN_PASSES = {"tiled": lambda: TILED_PASSES, "triton": triton_varlen_passes}
# Under torch.compile: exattn::tiled_varlen_* and exattn::triton_varlen_* (backends/custom_ops.py).
VARLEN_OPS = {name: define_attention_ops(f"{name}_varlen", PACKED, load) for name, load in VARLEN_PASSES.items()}


class VarlenAttention(torch.autograd.Function):
    """Saves q, k, v, out, lse and the offsets (no N x N tensor); no gradient into the offsets.
    `sinks` is `rules.sinks` again, an input of its own so that it gets its gradient."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, params, passes, rules=None, sinks=None):
        extra = {} if rules is None else {"rules": rules}
        out, lse = passes.forward(q, k, v, cu_q, cu_k, max_q, max_k, params, **extra)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.max_q, ctx.max_k, ctx.params, ctx.passes, ctx.rules = max_q, max_k, params, passes, rules
        return returned_with_lse(ctx, out, lse)

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return no_gradients(ctx)
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        rules = ctx.rules
        extra = {} if rules is None else {"rules": rules}
        dq, dk, dv = ctx.passes.backward(dout, q, k, v, cu_q, cu_k, ctx.max_q, ctx.max_k, out, lse, ctx.params,
                                         **extra)
        if rules is None:
            return dq, dk, dv, None, None, None, None, None, None
        dsinks = None
        if rules.sinks is not None and ctx.needs_input_grad[10]:
            # lse (Hq, total_q), delta (total_q, Hq) -> (Hq, total_q)
            dsinks = sinks_grad(rules.sinks, lse, row_delta(dout, out, lse.dtype).transpose(0, 1), head_dim=0)
        return dq, dk, dv, None, None, None, None, None, None, None, dsinks


# ---------------------------------------------------------------- naive


def naive_varlen(problem: VarlenProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the naive backend (textbook formula, input dtype); plain autograd."""
    q, k, v, params = problem.q, problem.k, problem.v, problem.params
    out = q.new_zeros(problem.total_q, problem.heads_q, problem.value_dim)
    lse = empty_lse(problem.rules, problem.heads_q, problem.total_q, torch.float32, q.device)
    for b, rows_q, rows_k in sequences(offsets_to_host(problem.cu_seqlens_q), offsets_to_host(problem.cu_seqlens_k)):
        dense = AttentionProblem(
            sequence_view(q, rows_q), sequence_view(k, rows_k), sequence_view(v, rows_k), None,
            sequence_params(params, b, problem.max_seqlen_q, problem.max_seqlen_k), sequence_rules(problem.rules, b),
        )
        out_b, lse_b = NaiveBackend().run(dense)
        out[rows_q] = out_b[0].transpose(0, 1)
        lse[:, rows_q] = lse_b[0]
    return out, lse


# ---------------------------------------------------------------- the Triton hook and dispatch


def triton_reasons(problem: VarlenProblem) -> list[str]:
    """Every reason the Triton varlen kernels cannot serve this problem (empty if they can):
    the dense kernels' limits (device, dtype, dims, tiles)."""
    from .backends.triton import problem_reasons, triton_importable

    if not triton_importable():
        return ["triton is not installed"]
    return problem_reasons(problem)


def triton_auto_reasons(problem: VarlenProblem) -> list[str]:
    """Why "auto" passes triton over although it could run by name (the CPU interpreter)."""
    from .backends.triton import TritonBackend

    return TritonBackend().auto_reasons(problem)


def choose_varlen_backend(problem: VarlenProblem, name: str = "auto") -> BackendChoice:
    """Resolve `name` for this problem, or raise ValueError listing every reason.
    "auto" walks triton then tiled, as `attention` does; tiled and naive serve everything."""
    check_backend_name(name)
    candidates = AUTO_PRIORITY if name == "auto" else (name,)
    rejected: dict[str, list[str]] = {}
    for candidate in candidates:
        reasons = triton_reasons(problem) if candidate == "triton" else []
        if name == "auto" and candidate == "triton":
            reasons = reasons + triton_auto_reasons(problem)
        if not reasons:
            return BackendChoice(candidate, rejected)
        rejected[candidate] = reasons
    details = "; ".join(f"{n}: {', '.join(r)}" for n, r in rejected.items())
    raise ValueError(f"backend {name!r} cannot serve these inputs ({details})")


def run_varlen(problem: VarlenProblem, backend: str = "auto", signature=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) from the chosen backend; lse (Hq, total_q) may be float64 for float64 inputs. A fused
    backend's choice is kept for `signature` (`exattn.checked_calls`)."""
    name = choose_varlen_backend(problem, backend).name
    if name == "naive":
        return naive_varlen(problem)
    packing = (problem.cu_seqlens_q, problem.cu_seqlens_k, problem.max_seqlen_q, problem.max_seqlen_k)
    if torch.compiler.is_compiling():
        return VARLEN_OPS[name].attend(problem.q, problem.k, problem.v, packing, problem.params, problem.rules)
    passes = VARLEN_PASSES[name]()
    remember(signature, (problem.params, passes))
    return varlen_attention(passes, problem.q, problem.k, problem.v, packing, problem.params, problem.rules)


def varlen_attention(passes, q, k, v, packing: tuple, params: AttentionParams,
                     rules: ScoreRules | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) through a backend's passes: `VarlenAttention` where a gradient is wanted, else the
    forward pass alone (no autograd node)."""
    if not wants_grad(q, k, v, None if rules is None else rules.sinks):
        extra = {} if rules is None else {"rules": rules}
        return passes.forward(q, k, v, *packing, params, **extra)
    if rules is None:
        return VarlenAttention.apply(q, k, v, *packing, params, passes)
    return VarlenAttention.apply(q, k, v, *packing, params, passes, rules, rules.sinks)


def run_kept(signature: tuple, known: tuple, q, k, v, cu_q, cu_k, max_q: int, max_k: int,
             validate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A call whose signature was checked before: only the offsets' values are checked again (once per
    offsets tensor), then the kept passes run, and keep their forward's replay plan."""
    params, passes = known
    if validate:
        check_both_offsets_once(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
    packing = (cu_q, cu_k, max_q, max_k)
    out, lse = varlen_attention(passes, q, k, v, packing, params)
    keep_planned(signature, params, passes, q, k, v, *packing, params)
    return out, lse


# ---------------------------------------------------------------- public entry points


@overload
def attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = ...,
    window: tuple[int, int] | None = ..., scale: float | None = ..., dropout_p: float = ...,
    seed: int | None = ..., return_lse: Literal[False] = ..., backend: str = ...,
    block_m: int | None = ..., block_n: int | None = ..., validate: bool = ...,
    prefix: int | torch.Tensor | None = ..., softcap: float = ...,
    alibi_slopes: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
) -> torch.Tensor: ...


@overload
def attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = ...,
    window: tuple[int, int] | None = ..., scale: float | None = ..., dropout_p: float = ...,
    seed: int | None = ..., return_lse: Literal[True], backend: str = ...,
    block_m: int | None = ..., block_n: int | None = ..., validate: bool = ...,
    prefix: int | torch.Tensor | None = ..., softcap: float = ...,
    alibi_slopes: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, window=None,
    scale=None, dropout_p=0.0, seed=None, return_lse=False, backend="auto", block_m=None,
    block_n=None, validate=True, prefix=None, softcap=0.0, alibi_slopes=None, sinks=None,
):
    """Exact softmax attention over a packed batch of variable-length sequences.

    Args:
        q: (total_q, Hq, D). k: (total_k, Hk, D). v: (total_k, Hk, Dv); Hq % Hk == 0,
            query head h reads K/V head h // (Hq // Hk). Any strides (e.g. q = qkv[:, 0]).
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,) on q's device, starting at 0,
            non-decreasing, ending at total_q / total_k: sequence b owns query rows
            cu_seqlens_q[b]:cu_seqlens_q[b+1] and key rows cu_seqlens_k[b]:cu_seqlens_k[b+1].
            Zero-length sequences are allowed.
        max_seqlen_q, max_seqlen_k: Python ints >= the longest query / key sequence.
        causal: per sequence, bottom-right aligned: local query i sees local key j iff
            j <= i + Nk_b - Nq_b.
        window: (left, right), each >= 0 or -1 (unbounded), per sequence:
            i + Nk_b - Nq_b - left <= j <= i + Nk_b - Nq_b + right. Combines with causal.
        scale: score scale, default D ** -0.5.
        dropout_p: dropout on the normalized weights, in [0, 1). Weight (b, h, i, j) is kept iff
            exattn.dropout_mask(seed, (B, Hq, max_seqlen_q, max_seqlen_k), dropout_p)[b, h, i, j].
        seed: int in [0, 2**63); None draws one from torch's default generator.
        return_lse: also return lse (Hq, total_q), natural log, float32, -inf for rows
            with no allowed key (whose output is 0).
        backend: "auto", "triton", "tiled" or "naive" (see `explain_varlen_backend`).
        block_m, block_n: query and key tile sizes; None lets the backend choose.
        validate: check the offsets' values (may sync with the device; a tensor already
            checked for the same totals and not written since is not read again). False
            skips those checks (CUDA graphs; required under torch.compile); offsets that
            break the rules are then undefined behaviour. The "tiled" and "naive" paths read the
            offsets to the host anyway (they loop over sequences there), so only the fused
            path can be graph-captured.
        prefix: int or int32 (B,): local keys j < prefix[b] are allowed whatever causal and
            window say.
        softcap: float > 0, or 0 for off: score -> softcap * tanh(score / softcap).
        alibi_slopes: float32 (Hq,) or (B, Hq): adds -slope * |i + Nk_b - Nq_b - j| (local
            positions). No gradient.
        sinks: float32 (Hq,), differentiable: a virtual key of logit sinks[h] and value 0 in
            every row's softmax; lse includes it (rows with no key: zeros, lse = sinks[h]).
        These follow `exattn.attention`'s rule order, per sequence; segment ids are not
        taken here (the offsets already keep sequences apart).

    Returns:
        out (total_q, Hq, Dv) in q's dtype, or (out, lse) if return_lse. Differentiable
        in q, k, v.
    """
    check_bool("return_lse", return_lse)
    signature = None
    if prefix is None and alibi_slopes is None and sinks is None and keepable(dropout_p, seed):
        signature = call_signature(
            "attention_varlen", (q, k, v, cu_seqlens_q, cu_seqlens_k), window,
            (max_seqlen_q, max_seqlen_k, causal, scale, dropout_p, seed, block_m, block_n, validate, softcap, backend),
        )
        known = known_call(signature)
        if known is not None:
            out, lse = run_kept(signature, known, q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                int(max_seqlen_k), validate)  # as `check_max_seqlen` gave them
            return (out, lse.to(torch.float32)) if return_lse else out
    problem = make_varlen_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        window=window, scale=scale, dropout_p=dropout_p, seed=seed, block_m=block_m,
        block_n=block_n, validate=validate, prefix=prefix, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks,
    )
    out, lse = run_varlen(problem, backend, signature)
    if not return_lse:
        return out
    return out, lse.to(torch.float32)


def explain_varlen_backend(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, window=None,
    scale=None, dropout_p=0.0, seed=None, backend="auto", block_m=None, block_n=None, validate=True,
    prefix=None, softcap=0.0, alibi_slopes=None, sinks=None,
) -> BackendChoice:
    """Which backend `attention_varlen` would run for these arguments, and why the others were passed over."""
    problem = make_varlen_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        window=window, scale=scale, dropout_p=dropout_p, seed=seed, block_m=block_m,
        block_n=block_n, validate=validate, prefix=prefix, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks,
    )
    return choose_varlen_backend(problem, backend)
