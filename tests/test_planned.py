"""The passes a checked call keeps with their replay plans (`exattn.backends.planned`), over stand-in
passes on the CPU: kept plans give what the passes give, skip the passes' own replay signature, and are
left alone once stale. (On the GPU, tests/test_checked_calls.py runs exattn's own passes through them.)"""

from __future__ import annotations

import torch
from test_replay import Kernel, inputs

from exattn.backends.planned import MAX_BACKWARD_PLANS, PlannedPasses, planned_passes
from exattn.backends.triton import replay


class Passes:
    """A fused backend's stand-in: out = q + k (lse = k), gradients (dout + q, dout + out, lse)."""

    def __init__(self):
        self.forward_kernel, self.backward_kernel = Kernel(), Kernel()
        self.calls = {"forward": 0, "backward": 0}

        @replay.replayable()
        def forward(q, k, v, mask, params):
            self.calls["forward"] += 1
            out, lse = torch.empty_like(q), torch.empty_like(k)
            replay.run_kernel(self.forward_kernel, (1,), q, k, out, -1)
            replay.run_kernel(self.forward_kernel, (1,), k, torch.zeros_like(k), lse, -1)
            return out, lse

        @replay.replayable()
        def backward(dout, q, k, v, mask, out, lse, params):
            self.calls["backward"] += 1
            dq, dk = torch.empty_like(q), torch.empty_like(k)
            replay.run_kernel(self.backward_kernel, (1,), dout, q, dq, -1)
            replay.run_kernel(self.backward_kernel, (1,), dout, out, dk, -1)
            return dq, dk, lse

        self.forward, self.backward = forward, backward


def fresh():
    replay.clear()
    return Passes()


def qkv():
    return (*inputs(), torch.randn(10))


def planned_forward():
    """(stand-in passes, their PlannedPasses, q, k, v, out, lse) after one recorded forward."""
    passes = fresh()
    q, k, v = qkv()
    passes.forward(q, k, v, None, "params")
    planned = planned_passes(passes, q, k, v, None, "params")
    return passes, planned, q, k, v, *planned.forward(q, k, v, None, "params")


def test_nothing_is_planned_before_the_passes_recorded_or_without_plans():
    passes = fresh()
    assert planned_passes(passes, *qkv(), None, "params") is None
    assert planned_passes(type("Plain", (), {"forward": staticmethod(lambda *a: None)}), *qkv(), None, "params") is None


def test_the_forward_plan_runs_without_the_passes_and_the_backward_plan_is_keyed_on_dout():
    passes = fresh()
    passes.forward(*qkv(), None, "params")
    planned = planned_passes(passes, *qkv(), None, "params")
    assert isinstance(planned, PlannedPasses)
    q, k, v = qkv()
    out, lse = planned.forward(q, k, v, None, "params")
    assert torch.equal(out, q + k) and torch.equal(lse, k) and passes.calls["forward"] == 1
    for step in range(3):
        dout = torch.randn(10)
        dq, dk, same_lse = planned.backward(dout, q, k, v, None, out, lse, "params")
        assert torch.equal(dq, dout + q) and torch.equal(dk, dout + out) and same_lse is lse
    assert passes.calls["backward"] == 1, "the first call records and takes the plan, the others run it"
    strided = torch.randn(20)[::2]
    dq, _, _ = planned.backward(strided, q, k, v, None, out, lse, "params")
    assert torch.equal(dq, strided + q) and passes.calls["backward"] == 2 and len(planned.backward_plans) == 2


def test_stale_plans_give_way_to_the_passes():
    passes, planned, q, k, v, out, lse = planned_forward()
    for _ in range(2):
        planned.backward(torch.randn(10), q, k, v, None, out, lse, "params")
    replay.clear()
    calls = dict(passes.calls)
    out, lse = planned.forward(q, k, v, None, "params")
    dout = torch.randn(10)
    dq, _, _ = planned.backward(dout, q, k, v, None, out, lse, "params")
    assert torch.equal(out, q + k) and torch.equal(dq, dout + q)
    assert passes.calls == {"forward": calls["forward"] + 1, "backward": calls["backward"] + 1}


def test_backward_plans_are_bounded():
    _, planned, q, k, v, out, lse = planned_forward()
    for step in range(MAX_BACKWARD_PLANS + 2):
        dout = torch.randn(10 * (step + 2))[:: step + 2]
        planned.backward(dout, q, k, v, None, out, lse, "params")
        planned.backward(dout, q, k, v, None, out, lse, "params")
    assert 0 < len(planned.backward_plans) <= MAX_BACKWARD_PLANS
