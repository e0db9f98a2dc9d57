"""The local attention calls of one ring step, and the causal structure they carry.

In one step a rank attends its queries (segments of the full sequence) to
the keys of one other rank (segments too). Globally, causal attention lets
query i see key j iff j <= i + (Nk - Nq). Between a query segment and a key
segment this becomes a threshold in local coordinates: row a sees column b
iff b - a <= t. Such a block is nothing (t <= -rows), everything
(t >= cols - 1), or a band expressed, after trimming the rows that see
nothing and the columns nobody sees, by the bottom-right window
`(-1, right)` of the mask rule (`exattn.masks`) with `right >= 0`.

For zigzag with equal query and key lengths, every step collapses to one
call (a diagonal step is ordinary causal over the whole shard; a step
from an earlier rank sees the first key chunk fully; a step from a later rank
is seen fully by the second query chunk), which `step_blocks` finds by
trying to cover all segment pairs with a single threshold.
"""

from __future__ import annotations

from typing import NamedTuple

from ..problem import UNBOUNDED
from .layout import Segment

FULL = (UNBOUNDED, UNBOUNDED)


class Block(NamedTuple):
    """One local attention call: shard rows x shard columns under `window`."""

    rows: slice
    cols: slice
    window: tuple[int, int]


def clamp(t: int, rows: int, cols: int) -> int:
    """Thresholds that select the same pairs of a rows x cols block are equal after clamping."""
    return min(max(t, -rows), cols - 1)


def band_block(row0: int, rows: int, col0: int, cols: int, t: int) -> Block | None:
    """The call for rows [row0, row0+rows) x cols [col0, col0+cols) where row a sees column b iff b - a <= t."""
    if rows <= 0 or cols <= 0 or t <= -rows:
        return None
    if t >= cols - 1:
        return Block(slice(row0, row0 + rows), slice(col0, col0 + cols), FULL)
    first_row = max(0, -t)
    last_col = min(cols, rows + t)
    right = t + rows - last_col
    return Block(slice(row0 + first_row, row0 + rows), slice(col0, col0 + last_col), (UNBOUNDED, right))


def threshold(qs: Segment, ks: Segment, offset: int) -> int:
    """Row a of `qs` sees column b of `ks` iff b - a <= threshold."""
    return offset + qs.start - ks.start


def sees_any(qs: Segment, ks: Segment, offset: int) -> bool:
    return clamp(threshold(qs, ks, offset), qs.length, ks.length) > -qs.length


def single_threshold(q_segs, k_segs, offset: int, row0: int, col0: int) -> int | None:
    """A threshold over the whole rectangle that reproduces every segment pair, if one exists."""
    pairs = [(qs, ks, (ks.local - col0) - (qs.local - row0)) for qs in q_segs for ks in k_segs]
    candidates = [threshold(qs, ks, offset) + shift for qs, ks, shift in pairs]
    for t in candidates:
        if all(
            clamp(threshold(qs, ks, offset), qs.length, ks.length) == clamp(t - shift, qs.length, ks.length)
            for qs, ks, shift in pairs
        ):
            return t
    return None


def step_blocks(q_segs: list[Segment], k_segs: list[Segment], offset: int | None) -> list[Block]:
    """The calls that attend queries `q_segs` to keys `k_segs`; `offset = Nk - Nq` when causal, else None."""
    len_q = sum(s.length for s in q_segs)
    len_k = sum(s.length for s in k_segs)
    if offset is None:
        return [Block(slice(0, len_q), slice(0, len_k), FULL)] if len_q and len_k else []
    seen = [(qs, ks) for qs in q_segs for ks in k_segs if sees_any(qs, ks, offset)]
    if not seen:
        return []
    rows = [qs for qs in q_segs if any(qs is a for a, _ in seen)]
    cols = [ks for ks in k_segs if any(ks is b for _, b in seen)]
    row0, row1 = rows[0].local, rows[-1].local + rows[-1].length
    col0, col1 = cols[0].local, cols[-1].local + cols[-1].length
    inner_q = [s for s in q_segs if row0 <= s.local < row1]
    inner_k = [s for s in k_segs if col0 <= s.local < col1]
    t = single_threshold(inner_q, inner_k, offset, row0, col0)
    if t is not None:
        return [band_block(row0, row1 - row0, col0, col1 - col0, t)]
    blocks = [band_block(qs.local, qs.length, ks.local, ks.length, threshold(qs, ks, offset)) for qs, ks in seen]
    return [b for b in blocks if b is not None]
