"""The tiled backend as the dispatcher runs it: eagerly through `RecomputingAttention`, and under
`torch.compile` as torch custom ops, so `torch.compile(fullgraph=True)` can trace `attention`.

    exattn::tiled_forward(q, k, v, mask, *params) -> (out, lse)
    exattn::tiled_backward(dout, q, k, v, mask, out, lse, *params) -> (dq, dk, dv)

Each op is opaque to the compiler: a fake (meta) implementation gives output
shapes and dtypes, and `register_autograd` connects the forward op to the
backward op. `params` travels as plain ints and floats (the op schema has no
dataclasses): `scale, left, right, dropout_p, seed, block_m, block_n`, with
0 standing for "backend default" tile sizes. Under `torch.compile`, give an
explicit `seed` when `dropout_p > 0` (drawing one reads a tensor's value).
"""

from __future__ import annotations

import torch

from ..problem import AttentionParams, AttentionProblem, compute_dtype
from .autograd import RecomputingAttention
from .tiled import tiled_backward, tiled_forward

Tensor = torch.Tensor


def params_to_args(params: AttentionParams) -> tuple:
    left, right = params.window
    return (params.scale, left, right, params.dropout_p, params.seed,
            params.block_m or 0, params.block_n or 0)


def params_from_args(scale, left, right, dropout_p, seed, block_m, block_n) -> AttentionParams:
    return AttentionParams(
        scale=scale, window=(left, right), dropout_p=dropout_p, seed=seed,
        block_m=block_m or None, block_n=block_n or None,
    )


@torch.library.custom_op("exattn::tiled_forward", mutates_args=())
def tiled_forward_op(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, left: int, right: int,
    dropout_p: float, seed: int, block_m: int, block_n: int,
) -> tuple[Tensor, Tensor]:
    """out (B, Hq, Nq, Dv) in q's dtype, lse (B, Hq, Nq) in the compute dtype."""
    params = params_from_args(scale, left, right, dropout_p, seed, block_m, block_n)
    return tiled_forward(q, k, v, mask, params)


@tiled_forward_op.register_fake
def _(q, k, v, mask, scale, left, right, dropout_p, seed, block_m, block_n):
    out = q.new_empty((*q.shape[:3], v.shape[3]))
    lse = q.new_empty(q.shape[:3], dtype=compute_dtype(q.dtype))
    return out, lse


@torch.library.custom_op("exattn::tiled_backward", mutates_args=())
def tiled_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor, lse: Tensor,
    scale: float, left: int, right: int, dropout_p: float, seed: int, block_m: int, block_n: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (contiguous, in the dtypes of q, k, v)."""
    params = params_from_args(scale, left, right, dropout_p, seed, block_m, block_n)
    return tiled_backward(dout, q, k, v, mask, out, lse, params)


@tiled_backward_op.register_fake
def _(dout, q, k, v, mask, out, lse, scale, left, right, dropout_p, seed, block_m, block_n):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def setup_context(ctx, inputs, output) -> None:
    q, k, v, mask, *params = inputs
    out, lse = output
    ctx.has_mask = mask is not None
    ctx.params = params
    ctx.save_for_backward(q, k, v, out, lse, *([mask] if ctx.has_mask else []))


def backward(ctx, dout, _dlse):
    q, k, v, out, lse, *mask = ctx.saved_tensors
    mask = mask[0] if ctx.has_mask else None
    dq, dk, dv = tiled_backward_op(dout, q, k, v, mask, out, lse, *ctx.params)
    return dq, dk, dv, None, *([None] * len(ctx.params))


tiled_forward_op.register_autograd(backward, setup_context=setup_context)


def tiled_attention(q, k, v, mask, params: AttentionParams) -> tuple[Tensor, Tensor]:
    """(out, lse) through the custom op; differentiable in q, k, v; lse carries no gradient."""
    out, lse = tiled_forward_op(q, k, v, mask, *params_to_args(params))
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
        if torch.compiler.is_compiling():
            return tiled_attention(*args)  # the same passes, opaque to the compiler
        return RecomputingAttention.apply(*args, self)
