"""Which tiles segment ids let meet: the O(N / block) tables the kernels skip tiles by.

    segment_tile_ranges(row_ids, col_ids, block_rows, block_cols) -> int32 (B, row blocks, 4)

For each block of `block_rows` rows, the column tiles [lo, hi) whose segment ids
can equal one of its own: exact where a batch entry's ids never decrease (packed
documents: a tile's ids lie in [least, greatest], and tiles are ordered), every
column tile elsewhere; and the tiles [full_lo, full_hi) whose ids all equal the
block's one id (empty where the block holds two ids, or ids decrease), which
need no segment mask. One kernel launch, on the device, no host sync (so a
replayed pass launches it like the attention kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import ceil_div
from .replay import run_kernel

BLOCKS_PER_PROGRAM = 4  # row blocks each program of `segment_ranges_kernel` serves
RANGE_FIELDS: tl.constexpr = tl.constexpr(4)  # a row of the table: lo, hi, full_lo, full_hi
CHUNK = 1024  # ids read at once by the sortedness scan


@triton.jit
def block_id_ranges(IDS, stride, n, first_block, BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    """Least and greatest id of blocks first_block + [0, BLOCKS) of BLOCK positions (over the positions
    below n; a block with none gives (2**31 - 1, -2**31 + 1))."""
    blocks = first_block + tl.arange(0, BLOCKS)
    at = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    ids = tl.load(IDS + at.to(tl.int64) * stride, mask=at < n, other=0)
    low = tl.min(tl.where(at < n, ids, 2147483647), 1)
    high = tl.max(tl.where(at < n, ids, -2147483647), 1)
    return low, high


@triton.jit
def never_decrease(IDS, stride, n, CHUNK: tl.constexpr):
    """Whether ids[i + 1] >= ids[i] for every i < n - 1."""
    drops = 0
    for start in range(0, n, CHUNK):
        at = start + tl.arange(0, CHUNK)
        here = tl.load(IDS + at.to(tl.int64) * stride, mask=at < n, other=0)
        after = tl.load(IDS + (at + 1).to(tl.int64) * stride, mask=at + 1 < n, other=0)
        drops += tl.sum(((after < here) & (at + 1 < n)).to(tl.int32), 0)
    return drops == 0


@triton.jit
def segment_ranges_kernel(ROW_IDS, COL_IDS, RANGES, row_strides, col_strides, n_rows, n_cols, row_blocks,
                          col_tiles, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                          BLOCKS: tl.constexpr, COL_CHUNK: tl.constexpr, CHUNK: tl.constexpr):
    """Grid (B, cdiv(row_blocks, BLOCKS)). RANGES: int32 (B, row_blocks, 4), [lo, hi) of column tiles
    and [full_lo, full_hi) of those holding the block's one id alone. Sorted ids leave a tile's
    least and greatest id non-decreasing in the tile, so the tiles of id X alone are those from the
    first whose least id is X to the last whose greatest id is X."""
    b = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCKS
    row_ids = ROW_IDS + b * row_strides[0]
    col_ids = COL_IDS + b * col_strides[0]
    row_lo, row_hi = block_id_ranges(row_ids, row_strides[1], n_rows, first, BLOCKS, BLOCK_ROWS)
    lo = tl.zeros([BLOCKS], tl.int32)
    hi = tl.zeros([BLOCKS], tl.int32)
    full_lo = tl.zeros([BLOCKS], tl.int32)
    full_hi = tl.zeros([BLOCKS], tl.int32)
    for tile0 in range(0, col_tiles, COL_CHUNK):
        col_lo, col_hi = block_id_ranges(col_ids, col_strides[1], n_cols, tile0, COL_CHUNK, BLOCK_COLS)
        exists = (tile0 + tl.arange(0, COL_CHUNK)) < col_tiles
        lo += tl.sum(((col_hi[None, :] < row_lo[:, None]) & exists[None, :]).to(tl.int32), 1)
        hi += tl.sum(((col_lo[None, :] <= row_hi[:, None]) & exists[None, :]).to(tl.int32), 1)
        full_lo += tl.sum(((col_lo[None, :] < row_lo[:, None]) & exists[None, :]).to(tl.int32), 1)
        full_hi += tl.sum(((col_hi[None, :] <= row_lo[:, None]) & exists[None, :]).to(tl.int32), 1)
    ordered = never_decrease(row_ids, row_strides[1], n_rows, CHUNK) & never_decrease(
        col_ids, col_strides[1], n_cols, CHUNK)
    lo = tl.where(ordered, lo, 0)
    hi = tl.where(ordered, hi, col_tiles)
    alone = ordered & (row_lo == row_hi) & (full_lo < full_hi)  # else an empty range at lo
    full_lo = tl.where(alone, full_lo, lo)
    full_hi = tl.where(alone, full_hi, lo)
    blocks = first + tl.arange(0, BLOCKS)
    out = RANGES + (b * row_blocks + blocks) * RANGE_FIELDS
    inside = blocks < row_blocks
    tl.store(out, lo, mask=inside)
    tl.store(out + 1, hi, mask=inside)
    tl.store(out + 2, full_lo, mask=inside)
    tl.store(out + 3, full_hi, mask=inside)


def segment_tile_ranges(row_ids: torch.Tensor, col_ids: torch.Tensor, block_rows: int, block_cols: int):
    """int32 (B, row blocks, 4): for each block of `block_rows` rows, the tiles of `block_cols` columns
    [lo, hi) whose id ranges can meet its own (every tile where a batch entry's ids ever decrease), and
    [full_lo, full_hi) those holding its one id alone (`segment_ranges_kernel`)."""
    batch, n_rows = row_ids.shape
    n_cols = col_ids.shape[1]
    row_blocks, col_tiles = ceil_div(n_rows, block_rows), ceil_div(n_cols, block_cols)
    ranges = torch.empty(batch, row_blocks, RANGE_FIELDS.value, dtype=torch.int32, device=row_ids.device)
    if ranges.numel() == 0:
        return ranges
    run_kernel(segment_ranges_kernel, (batch, ceil_div(row_blocks, BLOCKS_PER_PROGRAM)), row_ids, col_ids, ranges,
               row_ids.stride(), col_ids.stride(), n_rows, n_cols, row_blocks, col_tiles, BLOCK_ROWS=block_rows,
               BLOCK_COLS=block_cols, BLOCKS=BLOCKS_PER_PROGRAM, COL_CHUNK=32, CHUNK=CHUNK)
    return ranges

