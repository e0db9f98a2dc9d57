"""The causal work-tile order (`exattn.backends.triton.schedule`): tile costs against the masks,
and the group size against the list schedule it is chosen by."""

from __future__ import annotations

import pytest
import torch

from exattn.backends.triton import schedule

GEOMETRIES = [(300, 300, 64, 128), (1000, 1000, 128, 128), (257, 900, 128, 64), (900, 257, 192, 128),
              (1, 300, 128, 128), (64, 64, 64, 128)]


def seen(len_q, len_k):
    """Bottom-right causal: query i sees key j iff j <= i + Nk - Nq."""
    return torch.arange(len_k)[None, :] <= torch.arange(len_q)[:, None] + (len_k - len_q)


@pytest.mark.parametrize("len_q,len_k,block_m,block_n", GEOMETRIES)
def test_row_costs_count_key_tiles_up_to_the_last_seen_key(len_q, len_k, block_m, block_n):
    allowed = seen(len_q, len_k)
    expected = []
    for start in range(0, len_q, block_m):
        cols = allowed[start:start + block_m].any(0).nonzero()
        expected.append(0 if len(cols) == 0 else int(cols.max()) // block_n + 1)
    assert schedule.causal_row_costs(len_q, len_k, block_m, block_n) == tuple(reversed(expected))


@pytest.mark.parametrize("len_q,len_k,block_m,block_n", GEOMETRIES)
def test_key_costs_count_query_tiles_from_the_first_that_sees_them(len_q, len_k, block_m, block_n):
    allowed = seen(len_q, len_k)
    tiles = -(-len_q // block_m)
    expected = []
    for start in range(0, len_k, block_n):
        rows = allowed[:, start:start + block_n].any(1).nonzero()
        expected.append(0 if len(rows) == 0 else tiles - int(rows.min()) // block_m)
    assert schedule.causal_key_costs(len_q, len_k, block_n, block_m) == tuple(expected)


def test_makespan_is_list_scheduling_in_order():
    overhead = schedule.TILE_OVERHEAD
    assert schedule.makespan([5, 1, 1, 1], 2) == 5 + overhead  # the short ones share the other SM
    assert schedule.makespan([1, 1, 1, 5], 2) == 1 + 5 + 2 * overhead  # the long one starts last
    assert schedule.makespan([3, 3], 8) == 3 + overhead
    assert schedule.makespan([], 4) == 0


def test_grouped_costs_run_each_groups_heads_rank_major():
    assert schedule.grouped_costs((3, 2, 1), 4, 2) == [3, 3, 2, 2, 1, 1] * 2
    assert schedule.grouped_costs((3, 2, 1), 2, 1) == [3, 2, 1, 3, 2, 1]


@pytest.mark.parametrize("len_q,heads,programs", [(4096, 64, 132), (2048, 128, 132), (8192, 32, 132)])
def test_head_groups_shorten_the_causal_tail(len_q, heads, programs):
    costs = schedule.causal_row_costs(len_q, len_q, 128, 128)
    size = schedule.heads_per_group(costs, heads, programs, 1 << 20)
    assert heads % size == 0 and size > 1
    grouped = schedule.makespan(schedule.grouped_costs(costs, heads, size), programs)
    head_major = schedule.makespan(schedule.grouped_costs(costs, heads, 1), programs)
    ideal = sum(cost + schedule.TILE_OVERHEAD for cost in costs) * heads / programs
    assert grouped < head_major and grouped <= 1.03 * ideal, (grouped, head_major, ideal)


def test_strided_makespan_runs_each_programs_tiles_back_to_back():
    overhead = schedule.TILE_OVERHEAD
    assert schedule.strided_makespan([5, 1, 1, 1], 2) == 5 + 1 + 2 * overhead  # program 0: tiles 0 and 2
    assert schedule.strided_makespan([1, 1, 1, 5], 2) == 1 + 5 + 2 * overhead
    assert schedule.strided_makespan([3, 3], 8) == 3 + overhead
    assert schedule.strided_makespan([], 4) == 0


@pytest.mark.parametrize("len_q,heads", [(512, 512), (1024, 256), (2048, 128), (512, 1024)])
def test_persistent_head_groups_balance_the_stride(len_q, heads):
    """A persistent grid's group size is chosen for its stride (d = 128, 16k tokens, 132 SMs)."""
    costs = schedule.causal_row_costs(len_q, len_q, 128, 128)
    head_bytes = 2 * len_q * 128 * 2
    ideal = sum(cost + schedule.TILE_OVERHEAD for cost in costs) * heads / 132

    def strided_span(size):
        return schedule.strided_makespan(schedule.grouped_costs(costs, heads, size), 132)

    strided = strided_span(schedule.heads_per_group(costs, heads, 132, head_bytes, strided=True))
    listed = strided_span(schedule.heads_per_group(costs, heads, 132, head_bytes))
    assert strided <= 1.04 * ideal and strided <= listed, (strided, listed, ideal)


@pytest.mark.parametrize("len_q,heads", [(1024, 16384), (512, 32768), (2048, 8192)])
def test_persistent_head_groups_balance_huge_grids(len_q, heads):
    """Beyond MAX_SIMULATED_TILES head-major order would leave some programs 1.16-1.43x the mean work
    whatever the grid's size; a prefix of the order is simulated instead."""
    costs = schedule.causal_row_costs(len_q, len_q, 128, 128)
    assert len(costs) * heads > schedule.MAX_SIMULATED_TILES
    size = schedule.heads_per_group(costs, heads, 132, 1 << 12, strided=True)
    whole = schedule.grouped_costs(costs, heads, size)
    ideal = sum(cost + schedule.TILE_OVERHEAD for cost in whole) / 132
    assert schedule.strided_makespan(whole, 132) <= 1.02 * ideal
    head_major = schedule.grouped_costs(costs, heads, 1)
    assert schedule.strided_makespan(head_major, 132) > 1.15 * ideal


def test_list_schedule_groups_unbalance_a_stride():
    """Why the stride has its own choice: at 512 the list schedule's groups leave some programs a third
    more work than the mean."""
    costs = schedule.causal_row_costs(512, 512, 128, 128)
    size = schedule.heads_per_group(costs, 512, 132, 2 * 512 * 128 * 2)
    ideal = sum(cost + schedule.TILE_OVERHEAD for cost in costs) * 512 / 132
    assert schedule.strided_makespan(schedule.grouped_costs(costs, 512, size), 132) > 1.3 * ideal


def test_head_groups_respect_the_l2_share_and_huge_grids():
    costs = schedule.causal_row_costs(4096, 4096, 128, 128)
    assert schedule.heads_per_group(costs, 64, 132, schedule.L2_SHARE) == 1  # one head fills the share
    many = schedule.MAX_SIMULATED_TILES // len(costs) + 1
    assert schedule.heads_per_group(costs, many, 132, 1) == 1


@pytest.mark.parametrize("wanted,batch_heads,per_head,resident,expected", [
    (6, 12, 32, 132, 4),   # 4 heads of 32 key blocks fit in 132 programs; 4 divides 12
    (6, 10, 32, 132, 2),   # 4 does not divide 10, 3 neither: 2
    (1, 12, 32, 132, 1),   # never more than asked for
    (6, 12, 128, 132, 1),  # one head at a time
    (6, 12, 256, 132, 0),  # not even one head
])
def test_resident_heads_per_group_is_the_largest_fitting_divisor(wanted, batch_heads, per_head, resident, expected):
    assert schedule.resident_heads_per_group(wanted, batch_heads, per_head, resident) == expected
