"""Where a kernel's tiles lie in memory, and their loads and stores with the boundary masks.

Every view a kernel gets is a base pointer and a (batch, head, row, col) strides
tuple. A kernel reads the (b, h) slice of a view through pointers (USE_TMA = 0) or a
tensor descriptor (unit column stride): one it builds over the slice (USE_TMA = 1,
`tl.make_tensor_descriptor`, which needs scratch memory per program), or one the host
built over the whole tensor as a 2-D (rows, row stride) matrix (USE_TMA = 2,
`passes.host_descriptor`: no scratch), where the slice starts at row `offset // row
stride`, column `offset % row stride`. The ways meet in `tile_source`, `tile_walk` and
`load_source_tile`. Rows past the slice's end read zero (USE_TMA < 2) or the rows that
follow it in memory (USE_TMA = 2: the kernels mask them in the tiles that reach them),
columns past the head dim (a padded BLOCK; not with USE_TMA = 2) zero; neither is ever
written.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def head_slice(X, strides, b, h):
    """Base pointer of the (b, h) slice of a (B, H, rows, cols) view, and the slice's (row, col) strides."""
    return X + b * strides[0] + h * strides[1], (strides[2], strides[3])


@triton.jit
def slice_offset(strides, b, h, start):
    """Element offset of row `start` of the (b, h) slice of a (B, H, rows, cols) view."""
    return b * strides[0] + h * strides[1] + start * strides[2]


@triton.jit
def tile_source(
    X, offset, row_col, n_rows, N_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    USE_TMA: tl.constexpr, X_DESC,
):
    """What a kernel reads the (n_rows, N_COLS) slice at element `offset` of X (row stride row_col[0])
    through: X_DESC, the host's descriptor over X, with the slice's (row, column) in it (USE_TMA = 2);
    a descriptor of BLOCK_ROWS x BLOCK_COLS blocks over the slice (USE_TMA = 1); else its base pointer."""
    if USE_TMA == 2:
        return X_DESC, (offset // row_col[0]).to(tl.int32), (offset % row_col[0]).to(tl.int32)
    elif USE_TMA == 1:
        return tl.make_tensor_descriptor(X + offset, [n_rows, N_COLS], [row_col[0], 1], [BLOCK_ROWS, BLOCK_COLS])
    else:
        return X + offset


@triton.jit
def tile_pointers(base, row_col, rows, cols):
    """Pointers to the (rows, cols) tile of a slice at `base` with (row, col) strides `row_col`."""
    return base + rows[:, None].to(tl.int64) * row_col[0] + cols[None, :] * row_col[1]


@triton.jit
def head_tile_pointers(X, strides, b, h, rows, cols):
    """Pointers to the (rows, cols) tile of the (b, h) slice of a (B, H, rows, cols) view."""
    rows64 = rows[:, None].to(tl.int64)
    return X + b * strides[0] + h * strides[1] + rows64 * strides[2] + cols[None, :] * strides[3]


@triton.jit
def row_pointers(src, strides, tile_lo, BLOCK: tl.constexpr, offs, offs_col):
    """Pointers to rows `tile_lo * BLOCK + offs`, columns `offs_col`, of a (rows, cols) slice
    with (row, col) `strides`, and the 64-bit step to the same rows of the next tile."""
    start = (tile_lo * BLOCK + offs).to(tl.int64)
    ptrs = src + start[:, None] * strides[0] + offs_col[None, :] * strides[1]
    return ptrs, tl.full([], BLOCK, tl.int64) * strides[0]


@triton.jit
def tile_walk(src, row_col, tile_lo, BLOCK: tl.constexpr, offs, offs_col, USE_TMA: tl.constexpr):
    """Where a walk over the BLOCK-row tiles tile_lo, tile_lo + 1, ... of a `tile_source` reads, and its
    step: the descriptor itself (USE_TMA; step 0, never taken), else `row_pointers`."""
    if USE_TMA:
        return src, 0
    else:
        return row_pointers(src, row_col, tile_lo, BLOCK, offs, offs_col)


@triton.jit
def load_tile(
    ptrs, rows, n_rows, cols, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr, CHECK_ROWS: tl.constexpr,
):
    """Load a (rows, cols) tile; zero outside n_rows (if CHECK_ROWS) and outside N_COLS (padded dims)."""
    if CHECK_ROWS:
        if N_COLS == BLOCK_COLS:
            return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS), other=0.0)
    else:
        if N_COLS == BLOCK_COLS:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=cols[None, :] < N_COLS, other=0.0)


@triton.jit
def load_source_tile(
    at, row0, rows, n_rows, cols, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr, CHECK_ROWS: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """The tile of rows `rows` = row0 + arange(BLOCK_ROWS) where a `tile_walk` stands: a descriptor load
    at row0 (USE_TMA), else `load_tile` from the pointers `at`."""
    if USE_TMA == 2:
        return at[0].load([at[1] + row0, at[2]])
    elif USE_TMA == 1:
        return at.load([row0, 0])
    else:
        return load_tile(at, rows, n_rows, cols, N_COLS, BLOCK_COLS, CHECK_ROWS)


@triton.jit
def load_head_tile(X, strides, b, h, rows, n_rows, cols, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """The (rows, cols) tile of the (b, h) slice of a (B, H, n_rows, N_COLS) view, zero outside it."""
    return load_tile(head_tile_pointers(X, strides, b, h, rows, cols), rows, n_rows, cols, N_COLS, BLOCK_COLS, True)


@triton.jit
def store_tile(ptrs, value, rows, n_rows, cols, N_COLS: tl.constexpr):
    """Store a (rows, cols) tile, cast to the destination's dtype, inside n_rows x N_COLS."""
    tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS))
