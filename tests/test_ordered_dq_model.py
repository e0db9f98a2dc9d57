"""benchmarks/ordered_dq_model.py: the timing model of ordered dQ turns in the causal dK/dV grid."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ordered_dq_model as model  # noqa: E402


@pytest.mark.parametrize("longest_first", [True, False])
def test_launch_order_has_every_block_once_in_groups_that_fit(longest_first):
    order = model.launch_order(heads=6, blocks=4, sms=9, longest_first=longest_first)
    assert sorted(order) == [(h, b) for h in range(6) for b in range(4)]
    assert {h for h, _ in order[:8]} == {0, 1}  # groups of 2 heads: 8 programs fit on 9 SMs
    assert [b for _, b in order[:2]] == ([0, 0] if longest_first else [3, 3])


def test_turns_cost_time_only_through_their_hand_offs():
    order = model.launch_order(heads=8, blocks=8, sms=16, longest_first=True)
    work = 8 * sum(16 - 2 * block for block in range(8)) / 16
    atomic = model.makespan(1024, 8, 0.5, order, 16, ordered=False)
    nearly_free = model.makespan(1024, 8, 1e-6, order, 16, ordered=True)
    assert atomic >= work
    assert nearly_free == pytest.approx(model.makespan(1024, 8, 1e-6, order, 16, ordered=False), rel=1e-3)
    assert model.makespan(1024, 8, 1.0, order, 16, ordered=True) > model.makespan(1024, 8, 0.5, order, 16,
                                                                                  ordered=True) > atomic
