"""dQ added in a fixed order inside the Gluon dK/dV kernel: a deterministic backward without a dQ kernel.

The dK/dV kernel's consumer warpgroups stage their float32 share of each dQ
tile in shared memory; its writer warp (`gluon_backward.dq_writer_partition`)
adds the staged tiles to the float32 dQ by TMA reductions. To make the sum's
order fixed, each dQ tile has an int32 semaphore in global memory that counts
the contributions added so far, and the writer, per staged tile:

    rank = dq_rank(...)                      # the order in which the sweeps reach the tile
    seen = load_early(semaphore)             # before the tile is staged
    wait_turn(semaphore, rank, seen)         # spins only if the turn has not come
    <TMA reductions of the tile's two halves> # rank 0: TMA stores (dQ starts unzeroed)
    settle_dq(semaphore)                     # once written in L2: semaphore += 1

The consumers never wait for a turn: they run ahead as far as the staging
slots allow. The order follows the sweeps, so a block waits only on blocks
that reach the tile before it: causal (Nk <= Nq), from the last key block
that sees a tile down to block 0 (a block starts its sweep two 64-row tiles
after its predecessor); full attention, rotated sweeps (`sweep_start`) and a
cyclic order, or (`gluon_backward.rotated_sweeps` false) unrotated sweeps in key-block
order. Either way every block a block may wait on must be resident at
once (`gluon_backward.ordered_dq_fits`).

The increment is relaxed: a release puts a GPU-wide memory barrier into every
step (0.65-0.96x the dK/dV + dQ kernel pair, against 0.90-1.05x without it, bf16,
N = 4k-16k). The writes it hands on are TMA
reductions already complete in L2, and the next contributor issues its own
only after it has seen the increment.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .gluon_forward import ROWS


@gluon.jit
def sweep_start(col_tile, num_col_tiles, tiles, ROTATE: gl.constexpr):
    """Where key block col_tile's sweep starts (`sweep_tile`). ROTATE (full attention with ordered
    dQ): spread over the tiles, so the key blocks reach a query tile one after another instead of
    all at once (and wait for one another)."""
    if ROTATE:
        return col_tile * tiles // num_col_tiles
    return col_tile * 0


@gluon.jit
def sweep_tile(j, lo, tiles, start, ROTATE: gl.constexpr):
    """Query tile of step j of a dK/dV sweep over tiles [lo, lo + tiles), per query head of the group;
    ROTATE: starting at lo + start and wrapping around."""
    if ROTATE:
        return lo + (start + j % tiles) % tiles
    return lo + j % tiles


@gluon.jit
def dq_rank(col_tile, t, num_col_tiles, num_row_tiles, offset, prefix_blocks, BLOCK_M: gl.constexpr,
            CAUSAL: gl.constexpr, ROTATE: gl.constexpr):
    """How many key blocks add into query tile t before key block col_tile: the order in which
    their sweeps reach t. Causal (no rotation, Nk <= Nq): later blocks start nearer t, so from the
    last block that sees t (at least the last of the `prefix_blocks` every row sees, whose sweeps
    start at tile 0) down to block 0; a window's left bound alone only ends that count early, and
    mixes of narrowing rules leave out the blocks that skip t (`gluon_backward.later_sweeps`). Full,
    ROTATE (at least one tile per block): cyclically down from the block whose sweep starts at t or
    last before it. Full, not rotated: every sweep starts at tile 0, and the blocks take turns in
    launch order (block 0 first)."""
    if CAUSAL:
        reaching = gl.maximum(gl.cdiv((t + 1) * BLOCK_M + offset, 2 * ROWS), prefix_blocks)
        return gl.minimum(num_col_tiles, reaching) - 1 - col_tile
    elif ROTATE:
        first = gl.minimum(num_col_tiles, gl.cdiv((t + 1) * num_col_tiles, num_row_tiles)) - 1
        return (first - col_tile + num_col_tiles) % num_col_tiles
    else:
        return col_tile + t * 0


@gluon.jit
def load_early(ptr):
    """A relaxed load of the int32 at ptr, issued now and waited for only where its value is used."""
    return gl.inline_asm_elementwise("ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def load_acquire(ptr):
    return gl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def wait_turn(semaphore, rank, seen):
    """Spin until `rank` earlier contributors have released the int32 semaphore (`seen`: its value
    loaded earlier, `load_early`), then order this thread's later bulk (async-proxy) global writes
    after what they wrote."""
    while seen != rank:
        seen = load_acquire(semaphore)
    gl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def bulk_writes_done():
    """Wait until this thread's bulk (TMA) stores and reductions are complete in global memory
    (`tma.store_wait` waits only until their shared-memory sources are read)."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def pass_turn(semaphore):
    """One thread of the partition adds 1 to the int32 semaphore: a relaxed reduction, no memory
    barrier (a release would wait for every outstanding access of the thread). The writes it
    publishes are TMA reductions already complete in L2 (`bulk_writes_done`), where the next
    contributor's reduction, issued only after it saw this increment, lands after them."""
    gl.atomic_add(semaphore, 1, sem="relaxed", scope="gpu")


@gluon.jit
def settle_dq(semaphore):
    """Once this thread's dQ reductions are complete in global memory, let the next contribution to
    their tile go (`pass_turn`)."""
    bulk_writes_done()
    gl.thread_barrier()
    pass_turn(semaphore)
