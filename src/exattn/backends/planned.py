"""A fused backend's passes for one checked call signature (`exattn.checked_calls`), with the replay plans
of their launches in hand (`backends/triton/replay.py`).

The checked signature covers what the forward's replay is keyed on (the tensors' layouts and alignment,
the parameters it fixes), so a kept call runs the forward's plan without the replay's own signature,
and the backward's plan keyed on dout's layout alone (out and lse come from that forward plan).
A plan whose replay state changed since it was taken (`KeptPlan.current`) is not used.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checked_calls import remember, tensor_layout

MAX_BACKWARD_PLANS = 8  # per signature: the dout layouts a training loop brings


def planned_passes(passes, *forward_args) -> PlannedPasses | None:
    """`passes` with the plan their forward replays for these arguments, or None (no plan: the backend
    does not replay, or has not recorded these arguments, or will not replay them)."""
    plan_for = getattr(passes.forward, "plan_for", None)
    plan = None if plan_for is None else plan_for(*forward_args)
    return None if plan is None else PlannedPasses(passes, plan)


def keep_planned(signature, params, passes, *forward_args) -> None:
    """After a kept call ran `passes`: keep them for `signature` with their forward's plan, once it exists."""
    if type(passes) is not PlannedPasses:
        planned = planned_passes(passes, *forward_args)
        if planned is not None:
            remember(signature, (params, planned))


def tensors_of(args: tuple) -> list[torch.Tensor]:
    """The tensors among a pass's arguments, in order: the inputs its plan runs on (the passes take
    tensors as arguments of their own, never inside a tuple)."""
    return [x for x in args if isinstance(x, torch.Tensor)]


class PlannedPasses:
    """`forward(*args)` and `backward(dout, *args)` as the attention Functions call them, through the kept
    plans (dense: `forward(q, k, v, mask, params)`; packed: `forward(q, k, v, cu_q, cu_k, max_q, max_k,
    params)`)."""

    def __init__(self, passes, forward_plan):
        self.passes = passes
        self.forward_plan = forward_plan
        self.backward_plans: dict[tuple, Any] = {}

    def forward(self, *args):
        if self.forward_plan.current():
            return self.forward_plan.plan.run(tensors_of(args))
        return self.passes.forward(*args)

    def backward(self, dout, *args):
        key = tensor_layout(dout)
        kept = self.backward_plans.get(key)
        if kept is not None and kept.current():
            return kept.plan.run(tensors_of((dout, *args)))
        grads = self.passes.backward(dout, *args)
        plan_for = getattr(self.passes.backward, "plan_for", None)
        kept = None if plan_for is None else plan_for(dout, *args)
        if kept is not None:
            if len(self.backward_plans) >= MAX_BACKWARD_PLANS:
                self.backward_plans.clear()
            self.backward_plans[key] = kept
        return grads
