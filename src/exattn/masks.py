"""The one mask rule: which keys a query row may attend.

Alignment is bottom-right (FlashAttention 2.1+, KV caches). With
`offset = Nk - Nq`, query `i` may attend key `j` iff

    i + offset - left  <=  j  <=  i + offset + right

where `left`/`right` of -1 mean unbounded, and `causal` is `right = 0`.
For Nq = 3, Nk = 5, causal (`x` = allowed):

    key   0 1 2 3 4
    q0    x x x . .
    q1    x x x x .
    q2    x x x x x

A bool mask (True = attend) or an additive bias combines with the band, and
so do the structured rules (`ScoreRules`: segment ids, prefix, ALiBi; softcap
from the params). `apply_score_rules` is the one implementation of the rule
order; the tiled backend, the naive backend and the oracle all call it.
The sink is not a mask: it joins the softmax (`exattn.reference.softmax_rows`,
the tiled backend's finalize); `sinks_grad` is its gradient.
"""

from __future__ import annotations

import torch

from .problem import UNBOUNDED, ScoreRules

NEG_INF = float("-inf")


def band_bounds(rows: range, len_q: int, len_k: int, window: tuple[int, int]) -> tuple[int, int]:
    """The half-open key range [lo, hi) that any row in `rows` may attend."""
    left, right = window
    offset = len_k - len_q
    lo = 0 if left == UNBOUNDED else max(0, rows.start + offset - left)
    hi = len_k if right == UNBOUNDED else min(len_k, rows.stop - 1 + offset + right + 1)
    return lo, max(lo, hi)


def band_rows(cols: range, len_q: int, len_k: int, window: tuple[int, int]) -> tuple[int, int]:
    """The half-open query range [lo, hi) of rows that may attend any key in `cols`."""
    left, right = window
    offset = len_k - len_q
    lo = 0 if right == UNBOUNDED else max(0, cols.start - offset - right)
    hi = len_q if left == UNBOUNDED else min(len_q, cols.stop - 1 - offset + left + 1)
    return lo, max(lo, hi)


def key_intervals(
    rows: range, len_q: int, len_k: int, window: tuple[int, int], prefix: int = 0
) -> list[tuple[int, int]]:
    """Half-open key ranges that any row in `rows` may attend: the band's, and with a prefix
    (the largest prefix[b], `prefix`) also [0, prefix)."""
    lo, hi = band_bounds(rows, len_q, len_k, window)
    prefix = min(prefix, len_k)
    if prefix <= 0:
        return [(lo, hi)]
    if prefix >= lo:
        return [(0, max(prefix, hi))]
    return [(0, prefix), (lo, hi)]


def query_range(
    cols: range, len_q: int, len_k: int, window: tuple[int, int], prefix: int = 0
) -> tuple[int, int]:
    """The half-open query range of rows that may attend any key in `cols` (every row, if
    `cols` reaches into the prefix: the largest prefix[b], `prefix`)."""
    if cols.start < prefix:
        return 0, len_q
    return band_rows(cols, len_q, len_k, window)


def tile_is_inside_band(
    rows: range, cols: range, len_q: int, len_k: int, window: tuple[int, int]
) -> bool:
    """True when every (row, col) of the tile is allowed by the band."""
    left, right = window
    offset = len_k - len_q
    left_ok = left == UNBOUNDED or cols.start >= rows.stop - 1 + offset - left
    right_ok = right == UNBOUNDED or cols.stop - 1 <= rows.start + offset + right
    return left_ok and right_ok


def band_mask(
    rows: range, cols: range, len_q: int, len_k: int, window: tuple[int, int], device
) -> torch.Tensor | None:
    """Bool (len(rows), len(cols)) tile of allowed pairs, or None if all are allowed."""
    if tile_is_inside_band(rows, cols, len_q, len_k, window):
        return None
    left, right = window
    i = torch.arange(rows.start, rows.stop, device=device)[:, None] + (len_k - len_q)
    j = torch.arange(cols.start, cols.stop, device=device)[None, :]
    allowed = torch.ones(len(rows), len(cols), dtype=torch.bool, device=device)
    if left != UNBOUNDED:
        allowed &= j >= i - left
    if right != UNBOUNDED:
        allowed &= j <= i + right
    return allowed


def prefix_mask(cols: range, prefix: torch.Tensor, batch_view: tuple[int, ...]) -> torch.Tensor:
    """Bool (B, 1.., 1, len(cols)): key j < prefix[b]."""
    j = torch.arange(cols.start, cols.stop, device=prefix.device)
    return (j[None, :] < prefix[:, None]).view(*batch_view, 1, len(cols))


def segment_mask(rows: range, cols: range, rules: ScoreRules, batch_view: tuple[int, ...]) -> torch.Tensor:
    """Bool (B, 1.., len(rows), len(cols)): the query's and the key's segment ids are equal."""
    q_ids = rules.q_segment_ids[:, rows.start:rows.stop]
    k_ids = rules.k_segment_ids[:, cols.start:cols.stop]
    return (q_ids[:, :, None] == k_ids[:, None, :]).view(*batch_view, len(rows), len(cols))


def alibi_distance(rows: range, cols: range, len_q: int, len_k: int, dtype, device) -> torch.Tensor:
    """(len(rows), len(cols)): |i + Nk - Nq - j|, the distance ALiBi's slopes multiply."""
    i = torch.arange(rows.start, rows.stop, device=device)[:, None] + (len_k - len_q)
    j = torch.arange(cols.start, cols.stop, device=device)[None, :]
    return (i - j).abs_().to(dtype)


def add_alibi_(scores: torch.Tensor, slopes: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """scores (B, *heads, r, c) -= slopes (B, Hq) outer distance (r, c), in place: one rank-1
    update (addr_) when the scores flatten to (B * Hq, r * c), a broadcast otherwise."""
    try:
        flat = scores.view(-1, distance.numel())
    except RuntimeError:
        return scores.addcmul_(slopes.view(*scores.shape[:-2], 1, 1), distance, value=-1.0)
    flat.addr_(slopes.reshape(-1), distance.reshape(-1), alpha=-1.0)
    return scores


def one_minus_square(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = 1 - x^2 in one pass: softcap's d(capped)/d(raw) from its tanh."""
    return torch.addcmul(torch.ones((), dtype=x.dtype, device=x.device), x, x, value=-1.0, out=out)


def softcap_(scores: torch.Tensor, softcap: float, scratch: torch.Tensor,
             softcap_grad: torch.Tensor | None = None) -> torch.Tensor:
    """scores = softcap * tanh(scores / softcap) in place; softcap_grad, if given, receives 1 - tanh^2.

    tanh(x) = e / (e + 2) with e = expm1(2x): under half the time of torch's CPU tanh, and as exact
    near 0 (no cancellation); 2x is clamped at 88, where expm1 stays finite in float32 and tanh
    rounds to 1 in float64. scratch: a tile of scores' shape to overwrite (softcap_grad may be it).
    """
    e = scores.mul_(2.0 / softcap).clamp_max_(88.0).expm1_()
    tanh = e.div_(torch.add(e, 2.0, out=scratch))
    if softcap_grad is not None:
        one_minus_square(tanh, out=softcap_grad)
    return tanh.mul_(softcap)


def apply_score_rules(
    scores: torch.Tensor,
    rows: range,
    cols: range,
    len_q: int,
    len_k: int,
    window: tuple[int, int],
    mask_tile: torch.Tensor | None,
    rules: ScoreRules | None = None,
    softcap: float = 0.0,
    softcap_grad: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every score rule, in the contract's order, on a tile of scores `scale * q k^T`:

        softcap:  s = softcap * tanh(s / softcap)           (if softcap > 0)
        ALiBi:    s -= slope[b, h] * |i + Nk - Nq - j|      (rules.alibi_slopes)
        bias:     s += mask_tile                            (a floating mask)
        allowed iff (band(i, j) or j < prefix[b]) and q_ids[b, i] == k_ids[b, j]
                    and mask_tile (a bool mask); a pair not allowed gets -inf.

    (The sink joins later, in the softmax.) scores: (B, *heads, len(rows), len(cols)), the
    heads flattening to Hq in query-head order: (B, Hq, ...) dense, (B, Hk, G, ...) stacked
    GQA tiles. `mask_tile` is the user mask sliced to this tile, broadcastable to `scores`;
    `rules` holds the full (B, N) / (B,) / (B, Hq) tensors, sliced here to the tile.
    softcap_grad: optional tensor of scores' shape that receives d softcap(s) / d s =
    1 - tanh(s / softcap)^2 (the backward pass's chain factor).

    In place, unless autograd records `scores` (the oracle, the naive backend): then out of
    place. Returns the scores.
    """
    inplace = not (torch.is_grad_enabled() and scores.requires_grad)
    batch_view = (scores.shape[0], *(1 for _ in scores.shape[1:-2]))
    if softcap > 0:
        if inplace:
            scores = scores.div_(softcap).tanh_()
            if softcap_grad is not None:
                one_minus_square(scores, out=softcap_grad)
            scores = scores.mul_(softcap)
        else:
            tanh = torch.tanh(scores / softcap)
            if softcap_grad is not None:
                softcap_grad.copy_(1.0 - tanh.detach() ** 2)
            scores = tanh * softcap
    if rules is not None and rules.alibi_slopes is not None:
        slopes = rules.alibi_slopes.to(scores.dtype)
        distance = alibi_distance(rows, cols, len_q, len_k, scores.dtype, scores.device)
        scores = add_alibi_(scores, slopes, distance) if inplace else scores - slopes.view(
            *scores.shape[:-2], 1, 1) * distance
    if mask_tile is not None and mask_tile.is_floating_point():
        scores = scores.add_(mask_tile) if inplace else scores + mask_tile
    disallowed = []
    if mask_tile is not None and mask_tile.dtype == torch.bool:
        disallowed.append(~mask_tile)
    band = band_mask(rows, cols, len_q, len_k, window, scores.device)
    if band is not None:
        if rules is not None and rules.prefix is not None:
            band = band | prefix_mask(cols, rules.prefix, batch_view)
        disallowed.append(~band)
    if rules is not None and rules.q_segment_ids is not None:
        disallowed.append(~segment_mask(rows, cols, rules, batch_view))
    for off in disallowed:
        scores = scores.masked_fill_(off, NEG_INF) if inplace else scores.masked_fill(off, NEG_INF)
    return scores


def apply_masks(scores, rows, cols, len_q, len_k, window, mask_tile) -> torch.Tensor:
    """`apply_score_rules` with the band and the user mask only."""
    return apply_score_rules(scores, rows, cols, len_q, len_k, window, mask_tile)


def lse_without_keys(lse: torch.Tensor, sinks: torch.Tensor | None, head_dim: int) -> torch.Tensor:
    """Fill `lse` (heads on `head_dim`) for rows that see no key: -inf, or their head's sink."""
    if sinks is None:
        return lse.fill_(NEG_INF)
    heads = [1] * lse.dim()
    heads[head_dim] = -1
    return lse.copy_(sinks.detach().to(lse.dtype).reshape(heads).expand_as(lse))


def sinks_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, head_dim: int = 1) -> torch.Tensor:
    """d loss / d sinks, float32 (Hq,), from the saved lse (which includes the sink).

    With P_sink = exp(sinks[h] - lse) the sink's weight in a row and
    delta = rowsum(dO * O) = sum_j P_j dP_j, the sink (value 0, dP_sink = 0) gets

        d sinks[h] = sum over rows of h of  P_sink * (dP_sink - delta)  =  -sum P_sink * delta

    lse, delta: the same shape, with the query heads on `head_dim` ((B, Hq, Nq) dense,
    (Hq, total_q) packed). A row with lse = -inf (no key and a -inf sink) adds 0.
    """
    shape = [1] * lse.dim()
    shape[head_dim] = -1
    dtype = torch.promote_types(lse.dtype, delta.dtype)
    weight = torch.exp(sinks.to(dtype).view(shape) - lse.to(dtype))
    weight = weight.masked_fill(lse == NEG_INF, 0.0)
    dims = [d for d in range(lse.dim()) if d != head_dim]
    return (-(weight * delta.to(dtype)).sum(dims)).to(sinks.dtype)
