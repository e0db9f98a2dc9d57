"""The merge algebra of attention states.

A block of keys, seen from one query row, is summarized by `(m, l, u)`:

    m = max_j s_j,   l = sum_j exp(s_j - m),   u = sum_j exp(s_j - m) v_j

Two summaries merge after both are rescaled to their shared maximum:

    m = max(m_a, m_b)
    l = l_a exp(m_a - m) + l_b exp(m_b - m)
    u = u_a exp(m_a - m) + u_b exp(m_b - m)

and `finalize` gives `out = u / l`, `lse = m + log l`. The empty block
`(-inf, 0, 0)` is the identity. Rescaling always subtracts a *finite* shared
maximum (0 stands in when both are -inf), so `-inf - (-inf)` never occurs.
Tiling, split-KV decoding and ring attention all go through these functions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .problem import check_float_tensor, check_same_device

NEG_INF = float("-inf")
LOG2_E = 1.4426950408889634


class BlockSummary(NamedTuple):
    """m: (...,) block max score; l: (...,) denominator; u: (..., Dv) numerator."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 - the paper's name
    u: torch.Tensor


def finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """The shared maximum used for rescaling: -inf (an empty block) becomes 0."""
    return m.masked_fill(m == NEG_INF, 0.0)


def exp_(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in place, as 2 ** (x log2 e): PyTorch's CPU exp2 is several times faster than exp.

    In float32, results down to the smallest normal (2**-126) are flushed to 0: they are 2**-102
    below the weight of 1 every row holds and change no sum, and as subnormal inputs they slow
    the CPU's matrix products about 100x (ALiBi over long rows gives many of them). The flush is
    one fused pass (`threshold_`, which keeps NaN), not a comparison and a masked fill: that pair
    took a quarter of a tiled forward on the 2-core Xeon of the CPU tables."""
    x.mul_(LOG2_E)
    if x.dtype == torch.float32:
        torch.nn.functional.threshold_(x, -126.0, NEG_INF)
    return x.exp2_()


def empty_summary(shape: tuple[int, ...], value_dim: int, dtype, device) -> BlockSummary:
    """The identity of `merge`: `m = -inf, l = 0, u = 0` for rows of `shape`."""
    return BlockSummary(
        m=torch.full(shape, NEG_INF, dtype=dtype, device=device),
        l=torch.zeros(shape, dtype=dtype, device=device),
        u=torch.zeros(*shape, value_dim, dtype=dtype, device=device),
    )


def summarize(
    scores: torch.Tensor, values: torch.Tensor, numerator_weights: torch.Tensor | None = None
) -> BlockSummary:
    """Summary of one block of keys.

    scores: (..., n) with -inf for masked keys. values: either one row of
    values per score row, (..., n, Dv), or values shared by the rows of the
    second-to-last score axis, as in `scores (B, H, Nq, n)` with
    `values (B, H, n, Dv)` or `(n, Dv)`.
    numerator_weights: optional (..., n) factors applied to `u` only, as
    dropout does (keep / (1 - p)): the denominator stays that of the softmax.
    Returns m, l of shape (...,) and u of shape (..., Dv), in the scores' dtype.
    """
    check_block(scores, values, numerator_weights)
    return summarize_(scores.clone(), values, numerator_weights)


def summarize_(
    scores: torch.Tensor, values: torch.Tensor, numerator_weights: torch.Tensor | None = None
) -> BlockSummary:
    """`summarize` that overwrites `scores` with the block's weights (the hot path)."""
    if scores.shape[-1]:
        m = scores.amax(dim=-1)
    else:
        m = scores.new_full(scores.shape[:-1], NEG_INF)
    weights = exp_(scores.sub_(finite_or_zero(m)[..., None]))
    l = weights.sum(dim=-1)  # noqa: E741
    if numerator_weights is not None:
        weights.mul_(numerator_weights)
    values = values.to(weights.dtype)
    if values.dim() == weights.dim() + 1:
        u = torch.matmul(weights.unsqueeze(-2), values).squeeze(-2)
    else:
        u = torch.matmul(weights, values)
    return BlockSummary(m=m, l=l, u=u)


def merge(a: BlockSummary, b: BlockSummary) -> BlockSummary:
    """Combine two summaries of disjoint key blocks. Associative and commutative.

    Shapes broadcast and dtypes promote as in ordinary arithmetic.
    """
    a, b = check_summary("a", a), check_summary("b", b)
    check_broadcast(a=a.u, b=b.u)
    return merged(a, b)


def merged(a: BlockSummary, b: BlockSummary) -> BlockSummary:
    """`merge` of summaries already checked."""
    dtype = torch.promote_types(a.u.dtype, b.u.dtype)
    rows = torch.broadcast_shapes(a.m.shape, b.m.shape)
    values = torch.broadcast_shapes(a.u.shape, b.u.shape)
    start = BlockSummary(
        a.m.to(dtype).expand(rows).clone(),
        a.l.to(dtype).expand(rows).clone(),
        a.u.to(dtype).expand(values).clone(),
    )
    return merge_(start, b)


def merge_(a: BlockSummary, b: BlockSummary) -> BlockSummary:
    """`merge` that overwrites `a`'s tensors with the result and returns them (the hot path)."""
    m = torch.maximum(a.m, b.m)
    shared = finite_or_zero(m)
    alpha, beta = torch.exp(a.m - shared), torch.exp(b.m - shared)
    a.l.mul_(alpha).addcmul_(b.l, beta)
    a.u.mul_(alpha[..., None]).addcmul_(b.u, beta[..., None])
    a.m.copy_(m)
    return a


def absorb_(
    state: BlockSummary, scores: torch.Tensor, values: torch.Tensor,
    numerator_weights: torch.Tensor | None = None,
) -> BlockSummary:
    """`merge_(state, summarize_(scores, values, numerator_weights))` in one pass (the hot path).

    The block's weights are taken against the new shared maximum directly, so
    its own summary is never formed. scores: (..., r, n), overwritten with the
    weights; values: (..., n, Dv), shared by the r rows; `state` holds (..., r)
    and (..., r, Dv) contiguous tensors and is updated in place and returned.
    """
    if not scores.shape[-1]:
        return state
    m = torch.maximum(state.m, scores.amax(dim=-1))
    shared = finite_or_zero(m)
    alpha = exp_(state.m.sub_(shared))
    weights = exp_(scores.sub_(shared[..., None]))
    state.l.mul_(alpha).add_(weights.sum(dim=-1))
    add_weighted_values_(state.u.mul_(alpha[..., None]), weights, values, numerator_weights)
    state.m.copy_(m)
    return state


def summarize_into_(
    state: BlockSummary, scores: torch.Tensor, values: torch.Tensor,
    numerator_weights: torch.Tensor | None = None,
) -> BlockSummary:
    """`summarize_(scores, values, numerator_weights)` written into `state`'s tensors, whatever they held:
    `absorb_` into an empty state without its rescaling (the first key block of a row, the hot path).
    Shapes as `absorb_`; scores have at least one column and are overwritten with the weights."""
    torch.amax(scores, dim=-1, out=state.m)
    weights = exp_(scores.sub_(finite_or_zero(state.m)[..., None]))
    torch.sum(weights, dim=-1, out=state.l)
    add_weighted_values_(state.u, weights, values, numerator_weights, beta=0.0)
    return state


def add_weighted_values_(numerator: torch.Tensor, weights: torch.Tensor, values: torch.Tensor,
                         numerator_weights: torch.Tensor | None, beta: float = 1.0) -> None:
    """numerator = beta * numerator + (weights * numerator_weights) @ values, in place through one batched
    GEMM (numerator (..., r, Dv) contiguous, weights (..., r, n), overwritten when numerator_weights is given)."""
    if numerator_weights is not None:
        weights.mul_(numerator_weights)
    numerator.view(-1, *numerator.shape[-2:]).baddbmm_(weights.reshape(-1, *weights.shape[-2:]),
                                                       values.to(weights.dtype).reshape(-1, *values.shape[-2:]),
                                                       beta=beta)


def finalize(s: BlockSummary) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)` = `(u / l, m + log l)`; a row with `l = 0` gives zeros and -inf."""
    return finalized(check_summary("s", s))


def finalized(s: BlockSummary) -> tuple[torch.Tensor, torch.Tensor]:
    """`finalize` of a summary already checked."""
    m = s.m.to(torch.promote_types(s.m.dtype, s.l.dtype), copy=True)
    u = s.u.to(torch.promote_types(s.u.dtype, s.l.dtype), copy=True)
    return finalize_(BlockSummary(m, s.l, u))


def finalize_(s: BlockSummary) -> tuple[torch.Tensor, torch.Tensor]:
    """`finalize` that overwrites `s.u` with out and `s.m` with lse and returns them (the hot path)."""
    inverse_l = s.l.reciprocal().masked_fill_(s.l == 0, 0.0)  # NaN counts as mass, so NaN propagates
    out = s.u.mul_(inverse_l[..., None])
    lse = s.m.add_(s.l.log())  # log 0 = -inf
    return out, lse


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two normalized states: out (..., Dv), lse (...,) natural log.

        lse = log(exp(lse_a) + exp(lse_b))
        out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)

    Computed in float32 (float64 if either input is float64); `out` comes back
    in out_a's dtype, `lse` in float32 (float64 for float64 inputs). A state
    with lse = -inf is the identity.
    """
    for side, (out, lse) in (("a", (out_a, lse_a)), ("b", (out_b, lse_b))):
        check_state(f"out_{side}", out, f"lse_{side}", lse)
    check_broadcast(out_a=out_a, out_b=out_b)
    acc = torch.float64 if torch.float64 in (out_a.dtype, lse_a.dtype) else torch.float32
    out, lse = finalized(merged(as_summary(out_a, lse_a, acc), as_summary(out_b, lse_b, acc)))
    return out.to(out_a.dtype), lse


def merge_stacked(out: torch.Tensor, lse: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_states` of the normalized states stacked along `dim` (>= 0, ahead of out's value dim), in one
    reduction: `m = max lse`, `l = sum exp(lse - m)`, `u = sum exp(lse - m) out`, then `finalize_`.
    out (..., Dv) in any float dtype and lse in float32 or float64, which the sums take; out comes back in
    its dtype. States of lse = -inf weigh nothing; all of them give zeros and -inf."""
    if not 0 <= dim < lse.dim():
        raise ValueError(f"dim must index lse's {lse.dim()} dims from 0; got {dim}")
    m = lse.amax(dim)
    weights = torch.exp(lse - finite_or_zero(m).unsqueeze(dim))
    u = torch.sum(weights.unsqueeze(-1) * out.to(weights.dtype), dim)
    merged, lse = finalize_(BlockSummary(m, weights.sum(dim), u))
    return merged.to(out.dtype), lse


def as_summary(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> BlockSummary:
    """A normalized state as a summary: `(m, l, u) = (lse, 1, out)`; empty if lse = -inf."""
    lse = lse.to(dtype)
    return BlockSummary(lse, (lse != NEG_INF).to(dtype), out.to(dtype))


# ---------------------------------------------------------------- checks of the public functions' arguments

def broadcasts_to(name: str, shape: tuple[int, ...], target: tuple[int, ...], what: str) -> None:
    try:
        fits = torch.broadcast_shapes(shape, target) == torch.Size(target)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"{name} {tuple(shape)} do not broadcast to {what} {tuple(target)}")


def check_broadcast(**tensors: torch.Tensor) -> None:
    """Two tensors whose shapes must broadcast together (the two sides of a merge)."""
    (a_name, a), (b_name, b) = tensors.items()
    try:
        torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        raise ValueError(f"{a_name} {tuple(a.shape)} and {b_name} {tuple(b.shape)} do not broadcast together") from None
    check_same_device(**tensors)


def check_block(scores: object, values: object, numerator_weights: object) -> None:
    """`summarize`'s arguments: scores (..., n); values (..., n, Dv) per score row or shared by the rows of
    scores' second-to-last axis; numerator_weights broadcasting to scores."""
    scores, values = check_float_tensor("scores", scores, 1), check_float_tensor("values", values, 2)
    check_same_device(scores=scores, values=values)
    if values.shape[-2] != scores.shape[-1]:
        raise ValueError(f"values has {values.shape[-2]} keys (dim -2) but scores has {scores.shape[-1]} (dim -1)")
    if values.dim() == scores.dim() + 1:
        broadcasts_to("values' leading dims", values.shape[:-2], scores.shape[:-1], "the score rows")
    elif scores.dim() < 2 or values.dim() > scores.dim():
        raise ValueError(f"values of shape {tuple(values.shape)} match neither (..., n, Dv) per row nor "
                         f"(..., n, Dv) shared by the rows of scores {tuple(scores.shape)}")
    else:
        broadcasts_to("values' leading dims", values.shape[:-2], scores.shape[:-2], "the scores' batch dims")
    if numerator_weights is not None:
        weights = check_float_tensor("numerator_weights", numerator_weights)
        check_same_device(scores=scores, numerator_weights=weights)
        broadcasts_to("numerator_weights' dims", weights.shape, scores.shape, "those of scores")


def check_summary(name: str, s: object) -> BlockSummary:
    """A `BlockSummary` (or any (m, l, u) triple): m and l (...,), u (..., Dv), on one device."""
    if not isinstance(s, tuple) or len(s) != 3:
        raise TypeError(f"{name} must be a BlockSummary (m, l, u), got {type(s).__name__}")
    m, l, u = (check_float_tensor(f"{name}.{field}", x, dims) for field, x, dims in zip("mlu", s, (0, 0, 1)))  # noqa: E741
    if l.shape != m.shape or u.shape[:-1] != m.shape:
        raise ValueError(f"{name}: m {tuple(m.shape)}, l {tuple(l.shape)} and u {tuple(u.shape)} must be "
                         "(...,), (...,) and (..., Dv) over the same rows")
    check_same_device(**{f"{name}.m": m, f"{name}.l": l, f"{name}.u": u})
    return BlockSummary(m, l, u)


def check_state(out_name: str, out: object, lse_name: str, lse: object) -> None:
    """A normalized state: out (..., Dv) and lse (...,) over the same rows, on one device."""
    out, lse = check_float_tensor(out_name, out, 1), check_float_tensor(lse_name, lse)
    if lse.shape != out.shape[:-1]:
        raise ValueError(f"{lse_name} has shape {tuple(lse.shape)} but {out_name} {tuple(out.shape)} needs "
                         f"{tuple(out.shape[:-1])} (its rows)")
    check_same_device(**{out_name: out, lse_name: lse})
