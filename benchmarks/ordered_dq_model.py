"""A timing model of the causal Gluon dK/dV grid with ordered dQ (no GPU).

Each program (one 128-key block of one head) sweeps the 64-row query tiles
from its diagonal to the end, one step per tile (every step costs 1). Its
writer warp adds each step's dQ tile only after the block after it has
(`dq_order.dq_rank`: causal turns run from the last block that sees a tile
down to block 0); a hand-off takes `h` steps, and the consumers run one
step ahead of the writer (one staging slot). Programs are dispatched in
launch order to the first free SM, one per SM (`gluon_backward`), in the
largest groups of heads that fit on the GPU at once (the kernel's groups are
at most that large), each group longest block first (`longest_first`) or
shortest first. Turns are iterated to a fixed point (at most 50 passes). It prints the makespan of each order
and of unordered (atomic) dQ, for the table's shapes (B * N = 16k, H = 16).

    python benchmarks/ordered_dq_model.py --handoffs 0.2,0.5,1.0
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from exattn.backends.triton.schedule import resident_heads_per_group  # noqa: E402


def launch_order(heads: int, blocks: int, sms: int, longest_first: bool) -> list[tuple[int, int]]:
    """(head, block) in launch order: the largest head groups that fit on `sms`
    (`schedule.resident_heads_per_group`), block-major inside a group."""
    group = max(resident_heads_per_group(heads, heads, blocks, sms), 1)
    ranks = range(blocks) if longest_first else range(blocks - 1, -1, -1)
    return [(head, block) for first in range(0, heads, group) for block in ranks
            for head in range(first, first + group)]


def makespan(seqlen: int, heads: int, handoff: float, order: list, sms: int, ordered: bool) -> float:
    """Finish time of the last program; turns taken from the previous pass until they settle."""
    tiles, blocks = seqlen // 64, seqlen // 128
    turns: dict = {}
    for _ in range(50):
        free, passed, finish = [0.0] * sms, {}, 0.0
        for head, block in order:
            start = heapq.heappop(free)
            computed = writer = start + 1.0  # the prologue: K, V and the first Q/dO tiles
            slot_free = start
            for tile in range(2 * block, tiles):
                computed = max(computed + 1.0, slot_free)
                first = min(blocks, -(-(tile + 1) // 2)) - 1
                turn = 0.0
                if ordered and block != first:
                    turn = passed.get((head, block + 1, tile), turns.get((head, block + 1, tile), 0.0))
                begins = max(computed, writer, turn)
                slot_free, writer = begins + 0.1, begins + handoff
                passed[(head, block, tile)] = writer
            end = max(computed, writer)
            finish = max(finish, end)
            heapq.heappush(free, end)
        if passed == turns:
            break
        turns = passed
    return finish


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", default="4096,8192,16384")
    p.add_argument("--handoffs", default="0.2,0.5,1.0", help="hand-off latencies, in steps")
    p.add_argument("--sms", type=int, default=132)
    args = p.parse_args(argv)
    for seqlen in map(int, args.seqlens.split(",")):
        heads = 16 * 16384 // seqlen
        blocks = seqlen // 128
        work = heads * sum(seqlen // 64 - 2 * block for block in range(blocks)) / args.sms
        for handoff in map(float, args.handoffs.split(",")):
            times = {name: makespan(seqlen, heads, handoff, launch_order(heads, blocks, args.sms, longest), args.sms,
                                    ordered)
                     for name, longest, ordered in (("longest first", True, True), ("shortest first", False, True),
                                                    ("atomic", True, False))}
            print(f"N={seqlen:5d} h={handoff:.1f}: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items())
                  + f", work/SMs {work:.0f}; ordered/atomic {times['longest first'] / times['atomic']:.3f}")


if __name__ == "__main__":
    main()
