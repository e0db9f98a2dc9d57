"""The local attention calls of one ring step, and the causal / window structure they carry.

In one step a rank attends its queries (segments of the full sequence) to
the keys of one other rank (segments too). Globally, causal attention and a
window let query i see key j iff `Nk - Nq - left <= j - i <= Nk - Nq + right`
(`exattn.masks`, bottom-right aligned; causal is right = 0). Between a query
segment and a key segment this becomes a band in local coordinates: row a
sees column b iff `lo <= b - a <= hi` (None = unbounded). Such a block is
nothing, everything, or a band expressed, after trimming the rows that see
nothing and the columns nobody sees, by a bottom-right `window=(left, right)`
of the mask rule, each side >= 0 or -1.

For zigzag with equal query and key lengths and causal attention, every step
collapses to one call (a diagonal step is ordinary causal over the whole
shard; a step from an earlier rank sees the first key chunk fully; a step from
a later rank is seen fully by the second query chunk), which `step_blocks`
finds by trying to cover all segment pairs with a single band.

A prefix (keys before global position P allowed to every query) adds one full
call over the step's keys before P and leaves the band to the keys after it
(`prefix_step_blocks`): the two sets are disjoint, so each pair is merged once.
"""

from __future__ import annotations

from itertools import product
from typing import NamedTuple

from ..problem import UNBOUNDED
from .layout import Segment

FULL = (UNBOUNDED, UNBOUNDED)


class Block(NamedTuple):
    """One local attention call: shard rows x shard columns under `window`, for the batch entries `batch`."""

    rows: slice
    cols: slice
    window: tuple[int, int]
    batch: slice = slice(None)


Band = tuple  # (lo, hi): row a sees column b iff lo <= b - a <= hi; None = unbounded


def global_band(len_q: int, len_k: int, window: tuple[int, int]) -> Band | None:
    """The band of global positions that `window` (causal folded in) allows; None = everything."""
    left, right = window
    offset = len_k - len_q
    lo = None if left == UNBOUNDED else offset - left
    hi = None if right == UNBOUNDED else offset + right
    return None if lo is None and hi is None else (lo, hi)


def normalized(band: Band, rows: int, cols: int) -> tuple[int, int] | None:
    """The band clamped to a rows x cols block: equal results select equal pairs; None = empty."""
    lo, hi = band
    lo = -(rows - 1) if lo is None else max(lo, -(rows - 1))
    hi = cols - 1 if hi is None else min(hi, cols - 1)
    if rows <= 0 or cols <= 0 or lo > hi or hi < -(rows - 1) or lo > cols - 1:
        return None
    return lo, hi


def shifted(band: Band, shift: int) -> Band:
    return tuple(None if x is None else x + shift for x in band)


def band_block(row0: int, rows: int, col0: int, cols: int, band: Band) -> Block | None:
    """The call for rows [row0, row0+rows) x cols [col0, col0+cols) where row a sees column b iff lo <= b - a <= hi."""
    clamped = normalized(band, rows, cols)
    if clamped is None:
        return None
    lo, hi = clamped
    if lo == -(rows - 1) and hi == cols - 1:
        return Block(slice(row0, row0 + rows), slice(col0, col0 + cols), FULL)
    a0, a1 = max(0, -hi), min(rows - 1, cols - 1 - lo)
    c0, c1 = max(0, a0 + lo), min(cols - 1, a1 + hi)
    n_rows, n_cols = a1 - a0 + 1, c1 - c0 + 1
    lo, hi = lo + a0 - c0, hi + a0 - c0
    offset = n_cols - n_rows
    right = UNBOUNDED if hi >= n_cols - 1 else hi - offset
    left = UNBOUNDED if lo <= -(n_rows - 1) else offset - lo
    return Block(slice(row0 + a0, row0 + a1 + 1), slice(col0 + c0, col0 + c1 + 1), (left, right))


def pair_band(qs: Segment, ks: Segment, band: Band) -> Band:
    """Row a of `qs` sees column b of `ks` iff the returned band holds b - a."""
    return shifted(band, qs.start - ks.start)


def sees_any(qs: Segment, ks: Segment, band: Band) -> bool:
    return normalized(pair_band(qs, ks, band), qs.length, ks.length) is not None


def single_band(q_segs, k_segs, band: Band, row0: int, col0: int) -> Band | None:
    """A band over the whole rectangle that reproduces every segment pair, if one exists."""
    pairs = [(qs, ks, (ks.local - col0) - (qs.local - row0)) for qs in q_segs for ks in k_segs]
    local = [(pair_band(qs, ks, band), shift) for qs, ks, shift in pairs]
    los = dict.fromkeys([None] + [None if b[0] is None else b[0] + s for b, s in local])
    his = dict.fromkeys([None] + [None if b[1] is None else b[1] + s for b, s in local])
    for candidate in product(los, his):
        if all(
            normalized(b, qs.length, ks.length) == normalized(shifted(candidate, -shift), qs.length, ks.length)
            for (qs, ks, shift), (b, _) in zip(pairs, local)
        ):
            return candidate
    return None


def step_blocks(q_segs: list[Segment], k_segs: list[Segment], band: Band | None) -> list[Block]:
    """The calls that attend queries `q_segs` to keys `k_segs` under the global `band` (None: all pairs)."""
    len_q = sum(s.length for s in q_segs)
    len_k = sum(s.length for s in k_segs)
    if band is None:
        return [Block(slice(0, len_q), slice(0, len_k), FULL)] if len_q and len_k else []
    seen = [(qs, ks) for qs in q_segs for ks in k_segs if sees_any(qs, ks, band)]
    if not seen:
        return []
    rows = [qs for qs in q_segs if any(qs is a for a, _ in seen)]
    cols = [ks for ks in k_segs if any(ks is b for _, b in seen)]
    row0, row1 = min(s.local for s in rows), max(s.local + s.length for s in rows)
    col0, col1 = min(s.local for s in cols), max(s.local + s.length for s in cols)
    inner_q = [s for s in q_segs if row0 <= s.local < row1 and s.length]
    inner_k = [s for s in k_segs if col0 <= s.local < col1 and s.length]
    candidate = single_band(inner_q, inner_k, band, row0, col0)
    if candidate is not None:
        block = band_block(row0, row1 - row0, col0, col1 - col0, candidate)
        return [] if block is None else [block]
    blocks = [band_block(qs.local, qs.length, ks.local, ks.length, pair_band(qs, ks, band)) for qs, ks in seen]
    return [b for b in blocks if b is not None]


def after(segment: Segment, position: int) -> Segment:
    """The part of `segment` at global positions >= `position` (possibly empty)."""
    skip = min(max(position - segment.start, 0), segment.length)
    return Segment(segment.local + skip, segment.start + skip, segment.length - skip)


def prefix_step_blocks(q_segs: list[Segment], k_segs: list[Segment], band: Band | None, prefix: int,
                       batch: slice = slice(None)) -> list[Block]:
    """`step_blocks` where keys at global positions < `prefix` are also allowed to every query: a full
    call over those keys of each segment, and the band's calls over the keys after them (disjoint)."""
    if band is None or prefix <= 0:
        return [b._replace(batch=batch) for b in step_blocks(q_segs, k_segs, band)]
    len_q = sum(s.length for s in q_segs)
    rest = [after(s, prefix) for s in k_segs]
    blocks = [Block(slice(0, len_q), slice(s.local, r.local), FULL, batch)
              for s, r in zip(k_segs, rest) if r.local > s.local and len_q]
    return blocks + [b._replace(batch=batch) for b in step_blocks(q_segs, [r for r in rest if r.length], band)]
