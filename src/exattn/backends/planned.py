"""A fused backend's passes for one checked call signature (`exattn.checked_calls`), with the replay plans
of their launches in hand (`backends/triton/replay.py`).

The checked signature covers what the forward's replay is keyed on (the tensors' layouts and alignment,
the parameters it fixes), so a kept call runs the forward's plan without the replay's own signature,
and the backward's plan keyed on dout's layout alone (out and lse come from that forward plan).
A plan whose replay state changed since it was taken (`KeptPlan.current`) is not used.
"""

from __future__ import annotations

from typing import Any

from ..checked_calls import tensor_layout

MAX_BACKWARD_PLANS = 8  # per signature: the dout layouts a training loop brings


def planned_passes(passes, q, k, v, params) -> PlannedPasses | None:
    """`passes` with the plan their forward replays for these arguments, or None (no plan: the backend
    does not replay, or has not recorded these arguments, or will not replay them)."""
    plan_for = getattr(passes.forward, "plan_for", None)
    plan = None if plan_for is None else plan_for(q, k, v, None, params)
    return None if plan is None else PlannedPasses(passes, plan)


class PlannedPasses:
    """`forward` and `backward` as `RecomputingAttention` calls them, through the kept plans."""

    def __init__(self, passes, forward_plan):
        self.passes = passes
        self.forward_plan = forward_plan
        self.backward_plans: dict[tuple, Any] = {}

    def forward(self, q, k, v, mask, params):
        if self.forward_plan.current():
            return self.forward_plan.plan.run([q, k, v])
        return self.passes.forward(q, k, v, mask, params)

    def backward(self, dout, q, k, v, mask, out, lse, params):
        key = tensor_layout(dout)
        kept = self.backward_plans.get(key)
        if kept is not None and kept.current():
            return kept.plan.run([dout, q, k, v, out, lse])
        grads = self.passes.backward(dout, q, k, v, mask, out, lse, params)
        plan_for = getattr(self.passes.backward, "plan_for", None)
        kept = None if plan_for is None else plan_for(dout, q, k, v, mask, out, lse, params)
        if kept is not None:
            if len(self.backward_plans) >= MAX_BACKWARD_PLANS:
                self.backward_plans.clear()
            self.backward_plans[key] = kept
        return grads
