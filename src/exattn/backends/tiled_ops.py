"""The tiled backend as the dispatcher runs it: eagerly through `RecomputingAttention`, and under
`torch.compile` as torch custom ops, so `torch.compile(fullgraph=True)` can trace `attention`.

    exattn::tiled_forward(q, k, v, mask, *params, *rules) -> (out, lse)
    exattn::tiled_backward(dout, q, k, v, mask, out, lse, *params, *rules) -> (dq, dk, dv)

Each op is opaque to the compiler: a fake (meta) implementation gives output
shapes and dtypes, and `register_autograd` connects the forward op to the
backward op. `params` travels as plain ints and floats (the op schema has no
dataclasses): `scale, left, right, dropout_p, seed, block_m, block_n, softcap`, with
0 standing for "backend default" tile sizes; `rules` as optional tensors, the fields
of `ScoreRules` in order (all None by default). The sinks' gradient is computed in the
autograd formula from out and lse (`masks.sinks_grad`), so the backward op is unchanged. Under `torch.compile`, give an
explicit `seed` when `dropout_p > 0` (drawing one reads a tensor's value).
"""

from __future__ import annotations

import torch

from ..masks import sinks_grad
from ..problem import AttentionParams, AttentionProblem, ScoreRules, compute_dtype
from .autograd import RecomputingAttention, row_delta
from .tiled import tiled_backward, tiled_forward

Tensor = torch.Tensor


def params_to_args(params: AttentionParams) -> tuple:
    left, right = params.window
    return (params.scale, left, right, params.dropout_p, params.seed,
            params.block_m or 0, params.block_n or 0, params.softcap)


PARAM_COUNT = 8
RULE_COUNT = len(ScoreRules._fields)


def params_from_args(scale, left, right, dropout_p, seed, block_m, block_n, softcap) -> AttentionParams:
    return AttentionParams(
        scale=scale, window=(left, right), dropout_p=dropout_p, seed=seed,
        block_m=block_m or None, block_n=block_n or None, softcap=softcap,
    )


def rules_from_args(*tensors) -> ScoreRules | None:
    rules = ScoreRules(*tensors)
    return rules if rules.in_use() else None


@torch.library.custom_op("exattn::tiled_forward", mutates_args=())
def tiled_forward_op(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, left: int, right: int,
    dropout_p: float, seed: int, block_m: int, block_n: int, softcap: float = 0.0,
    q_segment_ids: Tensor | None = None, k_segment_ids: Tensor | None = None,
    prefix: Tensor | None = None, alibi_slopes: Tensor | None = None, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """out (B, Hq, Nq, Dv) in q's dtype, lse (B, Hq, Nq) in the compute dtype."""
    params = params_from_args(scale, left, right, dropout_p, seed, block_m, block_n, softcap)
    rules = rules_from_args(q_segment_ids, k_segment_ids, prefix, alibi_slopes, sinks)
    return tiled_forward(q, k, v, mask, params, rules)


@tiled_forward_op.register_fake
def _(q, k, v, mask, *args, **kwargs):
    out = q.new_empty((*q.shape[:3], v.shape[3]))
    lse = q.new_empty(q.shape[:3], dtype=compute_dtype(q.dtype))
    return out, lse


@torch.library.custom_op("exattn::tiled_backward", mutates_args=())
def tiled_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor, lse: Tensor,
    scale: float, left: int, right: int, dropout_p: float, seed: int, block_m: int, block_n: int,
    softcap: float = 0.0, q_segment_ids: Tensor | None = None, k_segment_ids: Tensor | None = None,
    prefix: Tensor | None = None, alibi_slopes: Tensor | None = None, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (contiguous, in the dtypes of q, k, v)."""
    params = params_from_args(scale, left, right, dropout_p, seed, block_m, block_n, softcap)
    rules = rules_from_args(q_segment_ids, k_segment_ids, prefix, alibi_slopes, sinks)
    return tiled_backward(dout, q, k, v, mask, out, lse, params, rules=rules)


@tiled_backward_op.register_fake
def _(dout, q, k, v, *args, **kwargs):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def setup_context(ctx, inputs, output) -> None:
    q, k, v, mask, *rest = inputs
    params, rules = rest[:PARAM_COUNT], rest[PARAM_COUNT:]
    out, lse = output
    ctx.params, ctx.rule_slots = params, [x is not None for x in rules]
    present = [x for x in (mask, *rules) if x is not None]
    ctx.has_mask = mask is not None
    ctx.save_for_backward(q, k, v, out, lse, *present)


def backward(ctx, dout, _dlse):
    q, k, v, out, lse, *present = ctx.saved_tensors
    mask = present.pop(0) if ctx.has_mask else None
    rules = [present.pop(0) if slot else None for slot in ctx.rule_slots]
    dq, dk, dv = tiled_backward_op(dout, q, k, v, mask, out, lse, *ctx.params, *rules)
    sinks = rules[-1]
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[4 + PARAM_COUNT + RULE_COUNT - 1]:
        dsinks = sinks_grad(sinks, lse, row_delta(dout, out, lse.dtype))
    return dq, dk, dv, None, *([None] * PARAM_COUNT), *([None] * (RULE_COUNT - 1)), dsinks


tiled_forward_op.register_autograd(backward, setup_context=setup_context)


def tiled_attention(q, k, v, mask, params: AttentionParams, rules: ScoreRules | None = None) -> tuple[Tensor, Tensor]:
    """(out, lse) through the custom op; differentiable in q, k, v and the sinks; lse carries
    no gradient."""
    out, lse = tiled_forward_op(q, k, v, mask, *params_to_args(params), *(rules or ScoreRules()))
    return out, lse.detach()


class TiledBackend:
    """Pure PyTorch tiles; serves every input the contract allows, on any device."""

    name = "tiled"
    forward = staticmethod(tiled_forward)
    backward = staticmethod(tiled_backward)

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        return []

    def run(self, problem: AttentionProblem) -> tuple[torch.Tensor, torch.Tensor]:
        args = (problem.q, problem.k, problem.v, problem.mask, problem.params)
        rules = problem.rules
        if torch.compiler.is_compiling():
            return tiled_attention(*args, rules)  # the same passes, opaque to the compiler
        if rules is None:
            return RecomputingAttention.apply(*args, self)
        return RecomputingAttention.apply(*args, self, rules, rules.sinks)
