"""Autograd over a fused backend's raw passes: the backward recomputes from the saved lse."""

from __future__ import annotations

import torch


class RecomputingAttention(torch.autograd.Function):
    """Saves q, k, v, out and lse (the dropout seed travels in params); no N x N tensor.

    `passes` is a backend with `forward(q, k, v, mask, params) -> (out, lse)` and
    `backward(dout, q, k, v, mask, out, lse, params) -> (dq, dk, dv)`.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, params, passes):
        out, lse = passes.forward(q, k, v, mask, params)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.params, ctx.passes = mask, params, passes
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.passes.backward(dout, q, k, v, ctx.mask, out, lse, ctx.params)
        return dq, dk, dv, None, None, None
