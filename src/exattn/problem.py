"""Validation of the public arguments, done once, into an `AttentionProblem`.

Every entry point (`attention`, `sdpa`, `decode`, ring attention) checks its
inputs here; backends receive a problem they can trust.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
UNBOUNDED = -1


@dataclass(frozen=True)
class AttentionParams:
    """The non-tensor part of a problem: hashable, so kernels and custom ops can key on it.

    `window` is `(left, right)` with causal folded in (`-1` = unbounded).

    `dropout_grid` says where the dropout keep-mask of this problem is read.
    None (the default): at `(b, h, i, j)` of the problem's own `(B, Hq, Nq, Nk)`,
    i.e. Philox counter `((b * Hq + h) * Nq + i) * Nk + j`. `(first, rows, cols)`:
    at `(first + b, h, i, j)` of a larger `(first + B.., Hq, rows, cols)` grid
    (`rows >= Nq`, `cols >= Nk`), i.e. counter

        (((first + b) * Hq + h) * rows + i) * cols + j

    so a piece cut out of a padded problem draws the padded problem's mask. Packed
    variable-length batches use it: sequence `b` of `attention_varlen` reads
    `(B, Hq, max_seqlen_q, max_seqlen_k)` at batch index `b` (see `exattn.varlen`).
    """

    scale: float
    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)
    dropout_p: float = 0.0
    seed: int = 0
    block_m: int | None = None
    block_n: int | None = None
    dropout_grid: tuple[int, int, int] | None = None
    softcap: float = 0.0  # > 0: scores become softcap * tanh(score / softcap); 0: off

    @property
    def is_banded(self) -> bool:
        return self.window != (UNBOUNDED, UNBOUNDED)

    def dropout_layout(self, batch: int, len_q: int, len_k: int) -> tuple[range, int, int]:
        """Where a (batch, Hq, len_q, len_k) problem reads its keep-mask: the grid's batch
        indices of its batch entries, and the grid's (rows, cols); see `dropout_grid`."""
        first, rows, cols = self.dropout_grid or (0, len_q, len_k)
        return range(first, first + batch), rows, cols


class ScoreRules(NamedTuple):
    """The structured score rules of a problem, each O(B·H + B·N), each None when off.

    q_segment_ids: int32 (B, Nq) and k_segment_ids: int32 (B, Nk), both or neither
        (the same tensor when one (B, N) tensor was given): query i may attend key j
        only if q_segment_ids[b, i] == k_segment_ids[b, j].
    prefix: int32 (B,): keys j < prefix[b] are allowed whatever causal/window say.
    alibi_slopes: float32 (B, Hq) (a (Hq,) argument expanded, a view; stride 0 over B):
        adds -slope[b, h] * |i + Nk - Nq - j| to the score. No gradient.
    sinks: float32 (Hq,): a virtual key with logit sinks[h] and a zero value joins every
        row's softmax. The only differentiable rule (RecomputingAttention and the custom
        ops of `backends.custom_ops` pass it as an input of its own).
    (Slopes and sinks may be float64 when q is float64.) Values are never read at
    validation; the tiled backend reads max(prefix) and per-block segment-id ranges.

    Softcap is a float and lives in `AttentionParams.softcap`. The rule order is
    `exattn.masks.apply_score_rules`'s.
    """

    q_segment_ids: torch.Tensor | None = None
    k_segment_ids: torch.Tensor | None = None
    prefix: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None

    def in_use(self) -> list[str]:
        """The public names of the rules that are on, for messages ("segment_ids", ...)."""
        names = []
        if self.q_segment_ids is not None:
            names.append("segment_ids")
        names += [name for name in ("prefix", "alibi_slopes", "sinks") if getattr(self, name) is not None]
        return names

    def for_batch(self, b: int) -> ScoreRules:
        """The rules of batch entry b as a batch of one (packed sequences run one at a time)."""
        def row(x):
            return None if x is None else x[b:b + 1]

        return ScoreRules(row(self.q_segment_ids), row(self.k_segment_ids), row(self.prefix),
                          row(self.alibi_slopes), self.sinks)


class HeadShapes:
    """Head counts and dims of a problem whose q, k, v hold heads at dim 1 and features last:
    the dense (B, H, N, d) problem and the packed (total, H, d) one alike."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @property
    def heads_q(self) -> int:
        return self.q.shape[1]

    @property
    def heads_k(self) -> int:
        return self.k.shape[1]

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_k

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def value_dim(self) -> int:
        return self.v.shape[-1]


@dataclass(frozen=True)
class AttentionProblem(HeadShapes):
    """Validated attention inputs.

    q: (B, Hq, Nq, D); k: (B, Hk, Nk, D); v: (B, Hk, Nk, Dv).
    `mask` is None, or a bool / floating view broadcast to (B, Hq, Nq, Nk).
    `rules` is None (no segment ids, prefix, ALiBi or sinks) or a `ScoreRules`.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    params: AttentionParams
    rules: ScoreRules | None = None

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def len_q(self) -> int:
        return self.q.shape[2]

    @property
    def len_k(self) -> int:
        return self.k.shape[2]

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.q.dtype)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_accumulators(accumulate_into: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """None, or the `(dq, dk, dv)` a raw backward pass adds into: q, k, v's shapes and device,
    in the compute dtype (float32; float64 for float64 inputs)."""
    if accumulate_into is None:
        return None
    if not isinstance(accumulate_into, (tuple, list)) or len(accumulate_into) != 3:
        raise TypeError(f"accumulate_into must be None or a (dq, dk, dv) tuple, got {type(accumulate_into).__name__}")
    dtype = compute_dtype(q.dtype)
    for name, acc, x in zip(("dq", "dk", "dv"), accumulate_into, (q, k, v)):
        if not isinstance(acc, torch.Tensor):
            raise TypeError(f"accumulate_into {name} must be a torch.Tensor, got {type(acc).__name__}")
        if acc.shape != x.shape or acc.dtype != dtype or acc.device != x.device:
            raise ValueError(
                f"accumulate_into {name} must be {dtype} of shape {tuple(x.shape)} on {x.device}, "
                f"got {acc.dtype} of shape {tuple(acc.shape)} on {acc.device}"
            )
    return tuple(accumulate_into)


def check_float_tensor(name: str, x: object, min_dims: int = 0) -> torch.Tensor:
    """x if it is a float16/bfloat16/float32/float64 tensor of at least `min_dims` dims."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}"
        )
    if x.dim() < min_dims:
        raise ValueError(f"{name} must have at least {min_dims} dims, got shape {tuple(x.shape)}")
    return x


def check_tensor(name: str, x: object, ndim: int, layout: str = "(batch, heads, seq, dim)") -> torch.Tensor:
    check_float_tensor(name, x)
    if x.dim() != ndim:
        raise ValueError(
            f"{name} must have {ndim} dims {layout}, got shape {tuple(x.shape)}"
        )
    return x


def check_same_dtype_device(**tensors: torch.Tensor) -> None:
    (first_name, first), *rest = tensors.items()
    for name, x in rest:
        if x.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but {first_name} has {first.dtype}; "
                "q, k and v must share one dtype"
            )
    check_same_device(**tensors)


def check_same_device(**tensors: torch.Tensor) -> None:
    (first_name, first), *rest = tensors.items()
    for name, x in rest:
        if x.device != first.device:
            raise ValueError(
                f"{name} is on {x.device} but {first_name} is on {first.device}; "
                "all inputs must be on one device"
            )


def check_qkv(q: object, k: object, v: object) -> None:
    """Shapes (B, Hq, Nq, D), (B, Hk, Nk, D), (B, Hk, Nk, Dv), Hq % Hk == 0."""
    q, k, v = check_tensor("q", q, 4), check_tensor("k", k, 4), check_tensor("v", v, 4)
    check_same_dtype_device(q=q, k=k, v=v)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"batch sizes differ: q has {q.shape[0]}, k has {k.shape[0]}, v has {v.shape[0]}"
        )
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v has {v.shape[1]} heads but k has {k.shape[1]}; they must match")
    if k.shape[1] == 0:
        raise ValueError("k and v have no heads (dim 1 is 0): at least one key/value head is needed")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
        )
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"v has {v.shape[2]} keys but k has {k.shape[2]}; they must match")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k has head dim {k.shape[3]} but q has {q.shape[3]}; they must match")
    if q.shape[3] == 0 or v.shape[3] == 0:
        raise ValueError(f"head dims must be positive, got D={q.shape[3]}, Dv={v.shape[3]}")


def check_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    value = float(scale) if abs(scale) < 2**1024 else math.inf  # float() of a larger int overflows
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {scale}")
    return value


def check_bool(name: str, value: object) -> bool:
    """`value` if it is a bool, else a TypeError naming the argument and what was given."""
    if not isinstance(value, bool):
        given = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)[:60]
        raise TypeError(f"{name} must be a bool, got {given} ({type(value).__name__})")
    return value


def check_window(window: object, causal: object) -> tuple[int, int]:
    check_bool("causal", causal)
    if window is None:
        left, right = UNBOUNDED, UNBOUNDED
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"window must be a pair (left, right), got {window!r}")
        for side, value in zip(("left", "right"), window):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"window {side} must be an int, got {type(value).__name__}")
            if value < UNBOUNDED:
                raise ValueError(f"window {side} must be >= 0 or -1 (unbounded), got {value}")
        left, right = int(window[0]), int(window[1])
    if causal:
        right = 0
    return left, right


def check_mask(mask: object, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """A bool (True = may attend) or floating additive mask, broadcast to (B, Hq, Nq, Nk)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"mask must be bool (True = attend) or floating (additive), got {mask.dtype}")
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    if mask.requires_grad:
        raise ValueError(
            "mask requires grad, but gradients with respect to an additive bias are not "
            "supported; pass mask.detach()"
        )
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        return mask.expand(target)
    except RuntimeError:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to (B, Hq, Nq, Nk) = {target}"
        ) from None


def check_dropout(dropout_p: object, seed: object) -> tuple[float, int]:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if seed is None:
        seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64)) if dropout_p > 0 else 0
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return float(dropout_p), int(seed)


def check_block(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int or None, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def check_softcap(softcap: object) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (> 0, or 0 for off), got {type(softcap).__name__}")
    if not softcap >= 0 or softcap == float("inf"):
        raise ValueError(f"softcap must be a finite float > 0, or 0 for off, got {softcap}")
    return float(softcap)


def check_rule_tensor(name: str, x: object, dtypes: tuple[torch.dtype, ...], shapes: list[tuple[int, ...]],
                      device: torch.device, layout: str) -> torch.Tensor:
    """A rule tensor of one of `dtypes` (the first is the contract's), one of `shapes`, on `device`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(str(d) for d in dtypes)} {layout}, got {x.dtype}")
    if not any(len(x.shape) == len(shape) and all(a == b for a, b in zip(x.shape, shape)) for shape in shapes):
        expected = " or ".join(str(tuple(shape)) for shape in shapes)
        raise ValueError(f"{name} must have shape {layout} = {expected}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}; it must be on q's device")
    return x


def check_segment_ids(segment_ids: object, batch: int, len_q: int, len_k: int, device):
    """(q_ids (B, Nq), k_ids (B, Nk)) int32, from a pair or one (B, N) tensor when Nq == Nk."""
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(f"segment_ids must be one (B, N) tensor or a pair (q_ids, k_ids), "
                             f"got a sequence of {len(segment_ids)}")
        pair = segment_ids
    elif isinstance(segment_ids, torch.Tensor):
        if len_q != len_k:
            raise ValueError(f"segment_ids as one tensor needs Nq == Nk, got Nq = {len_q}, Nk = {len_k}; "
                             "pass a pair (q_ids (B, Nq), k_ids (B, Nk))")
        pair = (segment_ids, segment_ids)
    else:
        raise TypeError(f"segment_ids must be an int32 tensor (B, N) or a pair of them, "
                        f"got {type(segment_ids).__name__}")
    checked = []
    for side, ids, length in (("q", pair[0], len_q), ("k", pair[1], len_k)):
        name = f"segment_ids ({side} ids)"
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] != batch:
            raise ValueError(f"{name}: segment ids of the wrong batch: {ids.shape[0]} rows, "
                             f"but the batch B is {batch}")
        checked.append(check_rule_tensor(name, ids, (torch.int32,), [(batch, length)], device,
                                         f"(B, N{side})"))
    return tuple(checked)


def check_score_rules(
    *, batch: int, heads_q: int, len_q: int, len_k: int, device, dtype: torch.dtype,
    segment_ids=None, prefix=None, alibi_slopes=None, sinks=None,
) -> ScoreRules | None:
    """The rule tensors, checked and normalized (prefix an int32 (B,) tensor, slopes (B, Hq));
    None when every rule is off. Values are not read (no device sync).

    Segment ids and a prefix tensor must be int32 (int64 is refused, not converted).
    Slopes and sinks are float32; with float64 q (`dtype`) float64 is accepted too, so the
    float64 path (and gradcheck of sinks) runs in high precision throughout.
    """
    floats = (torch.float32, torch.float64) if dtype == torch.float64 else (torch.float32,)
    q_ids = k_ids = None
    if segment_ids is not None:
        q_ids, k_ids = check_segment_ids(segment_ids, batch, len_q, len_k, device)
    if prefix is not None:
        if isinstance(prefix, bool):
            raise TypeError("prefix must be an int or an int32 tensor (B,), got bool")
        if isinstance(prefix, int):
            if prefix < 0:
                raise ValueError(f"prefix must be >= 0, got {prefix}")
            prefix = torch.full((batch,), min(prefix, 2**31 - 1), dtype=torch.int32, device=device)
        else:
            prefix = check_rule_tensor("prefix", prefix, (torch.int32,), [(batch,)], device, "(B,)")
    if alibi_slopes is not None:
        alibi_slopes = check_rule_tensor("alibi_slopes", alibi_slopes, floats,
                                         [(heads_q,), (batch, heads_q)], device, "(Hq,) or (B, Hq)")
        if alibi_slopes.requires_grad:
            raise ValueError("alibi_slopes requires grad, but slopes get no gradient (as in "
                             "FlashAttention); pass alibi_slopes.detach()")
        alibi_slopes = alibi_slopes.expand(batch, heads_q)
    if sinks is not None:
        sinks = check_rule_tensor("sinks", sinks, floats, [(heads_q,)], device, "(Hq,)")
    rules = ScoreRules(q_ids, k_ids, prefix, alibi_slopes, sinks)
    return rules if rules.in_use() else None


def make_params(
    head_dim: int, *, causal=False, window=None, scale=None, dropout_p=0.0, seed=None,
    block_m=None, block_n=None, dropout_grid: tuple[int, int, int] | None = None, softcap=0.0,
) -> AttentionParams:
    """The checked non-tensor arguments: causal folded into the window, scale defaulted to
    head_dim ** -0.5, a seed drawn when dropout_p > 0 and none is given."""
    left_right = check_window(window, causal)
    dropout_p, seed = check_dropout(dropout_p, seed)
    return AttentionParams(
        scale=check_scale(scale, head_dim),
        window=left_right,
        dropout_p=dropout_p,
        seed=seed,
        block_m=check_block("block_m", block_m),
        block_n=check_block("block_n", block_n),
        dropout_grid=dropout_grid,
        softcap=check_softcap(softcap),
    )


def make_problem(
    q, k, v, *, causal=False, window=None, mask=None, scale=None,
    dropout_p=0.0, seed=None, block_m=None, block_n=None,
    segment_ids=None, prefix=None, softcap=0.0, alibi_slopes=None, sinks=None,
) -> AttentionProblem:
    check_qkv(q, k, v)
    params = make_params(
        q.shape[3], causal=causal, window=window, scale=scale, dropout_p=dropout_p, seed=seed,
        block_m=block_m, block_n=block_n, softcap=softcap,
    )
    rules = check_score_rules(
        batch=q.shape[0], heads_q=q.shape[1], len_q=q.shape[2], len_k=k.shape[2], device=q.device,
        dtype=q.dtype, segment_ids=segment_ids, prefix=prefix, alibi_slopes=alibi_slopes, sinks=sinks,
    )
    return AttentionProblem(q=q, k=k, v=v, mask=check_mask(mask, q, k), params=params, rules=rules)
