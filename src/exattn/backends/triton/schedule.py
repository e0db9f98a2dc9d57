"""The order of causal work tiles: how many heads start their longest tiles together.

A grid of one program per tile runs as list scheduling: a free SM takes the
next program id. Causal tiles differ in length (query rows near the end see
more keys), so the order decides how long the last SMs run alone. Head-major
order, each head's longest tile first, ends on the last head's long tiles: at
N = 4k, d = 128 on 132 SMs, about 6% of the SM time idles in that tail.

`heads_per_group` heads form a group; a group's tiles run rank-major (every
head's longest tile, then every head's second longest, ...), and the groups
follow one another, so the SMs stay on a few heads at a time (their K/V shared
in L2) while the last tiles of the grid are short ones. The group size is
chosen by simulating the list schedule (`makespan`) for each size whose heads'
K/V fit in `L2_SHARE`. The kernels' `longest_first` reads this order.

A persistent grid (one program per SM, program p running tiles p, p + P, ...)
is not list-scheduled: its group size is chosen by simulating that striding
(`strided_imbalance`), where the list schedule's choice can leave some programs
with a third more work than others. The stride meets the order's pattern the
same way however many heads follow, so head-major order is no fallback there:
a prefix of the order is simulated instead.
"""

from __future__ import annotations

import functools
import heapq

L2_SHARE = 24 << 20  # bytes of K/V (or Q/dO) that the heads of one group may keep in L2
TILE_OVERHEAD = 1  # a tile's fixed cost (loads before its first step, the stores after), in steps
MAX_SIMULATED_TILES = 1 << 16  # beyond this the tail is a small part of the run: plain head-major order


def makespan(costs, programs: int) -> int:
    """When the last of `programs` SMs finishes tiles of these costs, taken in order by whichever SM is free."""
    finish = [0] * min(programs, len(costs))
    for cost in costs:
        heapq.heapreplace(finish, finish[0] + cost + TILE_OVERHEAD)
    return max(finish, default=0)


def strided_makespan(costs, programs: int) -> int:
    """When the last of `programs` persistent programs finishes, program p running tiles p, p + programs, ..."""
    return max((sum(costs[p::programs]) + TILE_OVERHEAD * len(range(p, len(costs), programs))
                for p in range(min(programs, len(costs)))), default=0)


def strided_imbalance(rank_costs: tuple[int, ...], batch_heads: int, heads_per_group: int, programs: int) -> float:
    """`strided_makespan` over the mean work per program, for the first heads of `grouped_costs` (whole
    groups, at most MAX_SIMULATED_TILES tiles: the stride meets the order's pattern the same way after)."""
    heads = min(batch_heads, max(1, MAX_SIMULATED_TILES // len(rank_costs) // heads_per_group) * heads_per_group)
    costs = grouped_costs(rank_costs, heads, heads_per_group)
    return strided_makespan(costs, programs) * programs / (sum(costs) + TILE_OVERHEAD * len(costs))


def grouped_costs(rank_costs: tuple[int, ...], batch_heads: int, heads_per_group: int) -> list[int]:
    """The costs of all batch_heads * len(rank_costs) tiles in the order `longest_first` gives them
    (rank_costs[r]: the cost of every head's r-th longest tile; heads_per_group divides batch_heads)."""
    group = [cost for cost in rank_costs for _ in range(heads_per_group)]
    return group * (batch_heads // heads_per_group)


@functools.lru_cache(maxsize=512)
def heads_per_group(rank_costs: tuple[int, ...], batch_heads: int, programs: int, head_bytes: int,
                    strided: bool = False) -> int:
    """The group size (a divisor of batch_heads, 1 = head-major) whose simulated schedule ends first;
    the smallest such (L2 locality) within 0.5%. head_bytes: what one head's tiles read in common;
    strided: the grid is persistent (`strided_imbalance`), else list-scheduled (`makespan`)."""
    if programs < 1 or not rank_costs or (not strided and len(rank_costs) * batch_heads > MAX_SIMULATED_TILES):
        return 1
    largest = max(1, L2_SHARE // max(head_bytes, 1))
    sizes = [g for g in range(1, min(largest, batch_heads) + 1) if batch_heads % g == 0]
    if strided:
        spans = {g: strided_imbalance(rank_costs, batch_heads, g, programs) for g in sizes}
    else:
        spans = {g: makespan(grouped_costs(rank_costs, batch_heads, g), programs) for g in sizes}
    best = min(spans.values())
    return min(g for g, span in spans.items() if span <= best * 1.005)


def resident_heads_per_group(heads_per_group: int, batch_heads: int, programs_per_head: int, resident: int) -> int:
    """The largest divisor of batch_heads, at most heads_per_group, whose group's programs
    (programs_per_head each) can all be resident at once; 0 if one head's cannot."""
    fitting = min(heads_per_group, resident // max(programs_per_head, 1))
    return max((g for g in range(1, fitting + 1) if batch_heads % g == 0), default=0)


@functools.lru_cache(maxsize=512)
def causal_row_costs(len_q: int, len_k: int, block_m: int, block_n: int) -> tuple[int, ...]:
    """Key tiles that each block_m query row tile sees under bottom-right causal, longest first
    (the kernels' `key_tiles`)."""
    costs = []
    for tile_m in reversed(range(-(-len_q // block_m))):
        last_row = min((tile_m + 1) * block_m, len_q) - 1
        keys = max(min(last_row + len_k - len_q + 1, len_k), 0)
        costs.append(-(-keys // block_n))
    return tuple(costs)


@functools.lru_cache(maxsize=512)
def causal_key_costs(len_q: int, len_k: int, block_n: int, block_m: int) -> tuple[int, ...]:
    """Query tiles that see each block_n key tile under bottom-right causal, first keys first (the
    Gluon dK/dV kernel's `query_tiles`)."""
    tiles = -(-len_q // block_m)
    return tuple(tiles - min(max(n0 - (len_k - len_q), 0) // block_m, tiles) for n0 in range(0, len_k, block_n))
