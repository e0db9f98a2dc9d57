"""Autograd over a fused backend's raw passes: the backward recomputes from the saved lse."""

from __future__ import annotations

import torch

from ..masks import sinks_grad


class RecomputingAttention(torch.autograd.Function):
    """Saves q, k, v, out and lse (the dropout seed travels in params); no N x N tensor.

    `passes` is a backend with `forward(q, k, v, mask, params[, rules]) -> (out, lse)` and
    `backward(dout, q, k, v, mask, out, lse, params[, rules=rules]) -> (dq, dk, dv)`;
    `rules` (a `ScoreRules`) is passed only when it is not None, so backends without
    score rules keep their signatures. `sinks` is `rules.sinks` again, as an input of its
    own so that autograd gives it its gradient (`masks.sinks_grad`); the other rules get none.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, params, passes, rules=None, sinks=None):
        extra = {} if rules is None else {"rules": rules}
        out, lse = passes.forward(q, k, v, mask, params, **extra)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.params, ctx.passes, ctx.rules = mask, params, passes, rules
        ctx.inputs = 6 if rules is None else 8
        return returned_with_lse(ctx, out, lse)

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return no_gradients(ctx)
        q, k, v, out, lse = ctx.saved_tensors
        extra = {} if ctx.rules is None else {"rules": ctx.rules}
        dq, dk, dv = ctx.passes.backward(dout, q, k, v, ctx.mask, out, lse, ctx.params, **extra)
        grads = [dq, dk, dv] + [None] * (ctx.inputs - 3)
        if ctx.rules is not None and ctx.rules.sinks is not None and ctx.needs_input_grad[7]:
            grads[7] = sinks_grad(ctx.rules.sinks, lse, row_delta(dout, out, lse.dtype))
        return tuple(grads)


def returned_with_lse(ctx, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) as an attention Function's forward returns them: lse carries no gradient, and the
    backward receives None for it rather than a zero tensor of its size that the engine would make and
    fill every backward."""
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    return out, lse


def no_gradients(ctx) -> tuple[None, ...]:
    """The backward's result where no gradient reached out (its dout is None): none for any input."""
    return (None,) * len(ctx.needs_input_grad)


def row_delta(dout: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rowsum(dO * O) over the last dim, in `dtype`."""
    return (dout.to(dtype) * out.to(dtype)).sum(-1)


def recomputing_attention(problem, passes) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `problem` through a fused backend's passes: `RecomputingAttention` where a gradient
    is wanted, else the forward pass alone (no autograd node to build: less host time per call)."""
    return fused_attention(passes, problem.q, problem.k, problem.v, problem.mask, problem.params, problem.rules)


def fused_attention(passes, q, k, v, mask, params, rules=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`recomputing_attention` of a problem's parts."""
    if not wants_grad(q, k, v, None if rules is None else rules.sinks):
        return passes.forward(q, k, v, mask, params) if rules is None else passes.forward(
            q, k, v, mask, params, rules=rules)
    if rules is None:
        return RecomputingAttention.apply(q, k, v, mask, params, passes)
    return RecomputingAttention.apply(q, k, v, mask, params, passes, rules, rules.sinks)


def wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)
