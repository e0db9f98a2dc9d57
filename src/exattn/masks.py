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

A bool mask (True = attend) or an additive bias combines with the band.
"""

from __future__ import annotations

import torch

from .problem import UNBOUNDED


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


def apply_masks(
    scores: torch.Tensor,
    rows: range,
    cols: range,
    len_q: int,
    len_k: int,
    window: tuple[int, int],
    mask_tile: torch.Tensor | None,
) -> torch.Tensor:
    """Set disallowed pairs of `scores` (..., rows, cols) to -inf and add the bias, in place.

    `mask_tile` is the user mask sliced to this tile, broadcastable to `scores`.
    Returns `scores`.
    """
    if mask_tile is not None:
        if mask_tile.dtype == torch.bool:
            scores.masked_fill_(~mask_tile, float("-inf"))
        else:
            scores.add_(mask_tile)
    band = band_mask(rows, cols, len_q, len_k, window, scores.device)
    if band is not None:
        scores.masked_fill_(~band, float("-inf"))
    return scores
