"""The fused backends as torch custom ops, so `torch.compile(fullgraph=True)` traces through them.

One factory, `define_attention_ops`, wraps a backend's raw passes into an op pair:

    exattn::<name>_forward(q, k, v, *layout, *params, *rules) -> (out, lse)
    exattn::<name>_backward(dout, q, k, v, *layout, out, lse, *params, *rules) -> (dq, dk, dv)

`layout` is `mask` for dense problems (`DENSE`) and `cu_seqlens_q, cu_seqlens_k,
max_seqlen_q, max_seqlen_k` for packed ones (`PACKED`). `params` travels as plain
ints and floats (a schema has no dataclasses): `scale, left, right, dropout_p, seed,
block_m, block_n, softcap`, with 0 standing for "backend default" tile sizes; `rules`
as optional tensors, the fields of `ScoreRules` in order. Each op is opaque to the
compiler: a fake (meta) implementation gives the output shapes, dtypes and (contiguous)
strides, and `register_autograd` connects the forward op to the backward op. The sinks'
gradient is computed in the autograd formula from out and lse (`masks.sinks_grad`).

Registered here: "tiled" and "triton" (dense, `DENSE_OPS`); `exattn.varlen` registers
"tiled_varlen" and "triton_varlen". Eager calls do not dispatch through the ops (that
costs host time): the backends' `run` uses them only under `torch.compile`. There, give
an explicit `seed` when `dropout_p > 0` (drawing one reads a tensor's value).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..masks import sinks_grad
from ..problem import AttentionParams, AttentionProblem, ScoreRules, compute_dtype
from .autograd import row_delta

Tensor = torch.Tensor

PARAMS_SCHEMA = ("float scale, SymInt left, SymInt right, float dropout_p, SymInt seed, SymInt block_m, "
                 "SymInt block_n, float softcap=0.0")
PARAM_COUNT = 8
RULE_COUNT = len(ScoreRules._fields)
RULES_SCHEMA = ", ".join(f"Tensor? {name}=None" for name in ScoreRules._fields)
TRAILING_DEFAULTS = (0.0, *ScoreRules())  # softcap and the rules
SAVED = object()  # marks a saved tensor among the arguments the autograd formula keeps on ctx


def params_to_args(params: AttentionParams) -> tuple:
    """The op arguments of `params`: scale, left, right, dropout_p, seed, block_m, block_n, softcap."""
    if params.dropout_grid is not None:
        raise ValueError("the attention custom ops take no dropout_grid; run such a piece through the raw passes")
    left, right = params.window
    return (params.scale, left, right, params.dropout_p, params.seed,
            params.block_m or 0, params.block_n or 0, params.softcap)


@functools.lru_cache(maxsize=256, typed=True)  # an op call's host path: a model's layers repeat one set
def params_from_args(scale, left, right, dropout_p, seed, block_m, block_n, softcap) -> AttentionParams:
    return AttentionParams(
        scale=scale, window=(left, right), dropout_p=dropout_p, seed=seed,
        block_m=block_m or None, block_n=block_n or None, softcap=softcap,
    )


def rules_from_args(tensors) -> ScoreRules | None:
    if all(x is None for x in tensors):
        return None
    rules = ScoreRules(*tensors)
    return rules if rules.in_use() else None


class Layout(NamedTuple):
    """Where a family of ops finds its sequences.

    args: the schema of the arguments between v and the params.
    heads_at: the query heads' dim in lse: 1 in dense (B, Hq, Nq), 0 in packed (Hq, total_q).
    """

    args: str
    heads_at: int

    @property
    def count(self) -> int:
        return self.args.count(",") + 1

    def lse_shape(self, q: Tensor) -> list[int]:
        """q's rows (every dim but the last) with the query heads (dim 1) moved to `heads_at`."""
        rows = list(q.shape[:-1])
        rows.insert(self.heads_at, rows.pop(1))
        return rows


DENSE = Layout("Tensor? mask", heads_at=1)
PACKED = Layout("Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k", heads_at=0)


@dataclass(frozen=True)
class AttentionOps:
    """One backend's forward and backward custom ops over one layout."""

    forward: Callable
    backward: Callable

    def attend(self, q, k, v, layout_args: tuple, params: AttentionParams,
               rules: ScoreRules | None) -> tuple[Tensor, Tensor]:
        """(out, lse) through the forward op; differentiable in q, k, v and the sinks; lse carries
        no gradient."""
        out, lse = self.forward(q, k, v, *layout_args, *params_to_args(params), *(rules or ScoreRules()))
        return out, lse.detach()


def split_args(args: tuple, layout: Layout) -> tuple[tuple, AttentionParams, ScoreRules | None]:
    """(layout args, params, rules) of the op arguments after q, k, v (in the backward, less out and lse).
    The dispatcher leaves out trailing arguments equal to their defaults: they are put back here."""
    count = layout.count
    missing = count + PARAM_COUNT + RULE_COUNT - len(args)
    args = (*args, *TRAILING_DEFAULTS[len(TRAILING_DEFAULTS) - missing:])
    params = params_from_args(*args[count:count + PARAM_COUNT])
    return tuple(args[:count]), params, rules_from_args(args[count + PARAM_COUNT:])


def define_attention_ops(name: str, layout: Layout, load_passes: Callable[[], object]) -> AttentionOps:
    """Register `exattn::<name>_forward` and `exattn::<name>_backward` over a backend's raw passes.

    `load_passes()` returns an object with

        forward(q, k, v, *layout_args, params, rules=rules) -> (out, lse)
        backward(dout, q, k, v, *layout_args, out, lse, params, rules=rules) -> (dq, dk, dv)

    and is called when an op runs, so a backend whose module needs triton is imported only then.
    """
    count = layout.count
    load_passes = functools.cache(load_passes)

    def forward_impl(q, k, v, *args):
        layout_args, params, rules = split_args(args, layout)
        out, lse = load_passes().forward(q, k, v, *layout_args, params, rules=rules)
        return out.contiguous(), lse.contiguous()  # the fake's strides

    def forward_fake(q, k, v, *args):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        return out, q.new_empty(layout.lse_shape(q), dtype=compute_dtype(q.dtype))

    def backward_impl(dout, q, k, v, *args):
        out, lse = args[count:count + 2]
        layout_args, params, rules = split_args(args[:count] + args[count + 2:], layout)
        grads = load_passes().backward(dout, q, k, v, *layout_args, out, lse, params, rules=rules)
        return tuple(g.contiguous() for g in grads)

    def backward_fake(dout, q, k, v, *args):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    forward_op = define_op(
        f"{name}_forward", f"(Tensor q, Tensor k, Tensor v, {layout.args}, {PARAMS_SCHEMA}, {RULES_SCHEMA}) -> "
        "(Tensor, Tensor)", forward_impl, forward_fake)
    backward_op = define_op(
        f"{name}_backward", f"(Tensor dout, Tensor q, Tensor k, Tensor v, {layout.args}, Tensor out, Tensor lse, "
        f"{PARAMS_SCHEMA}, {RULES_SCHEMA}) -> (Tensor, Tensor, Tensor)", backward_impl, backward_fake)
    backward, setup_context = autograd_formula(backward_op, layout)
    torch.library.register_autograd(forward_op, backward, setup_context=setup_context, lib=LIBRARY)
    return AttentionOps(forward_op, backward_op)


# The ops are registered through a `torch.library.Library` rather than `torch.library.custom_op`,
# whose per-call Python wrapper (it checks that no output aliases an argument) made a small tiled
# forward op cost 28 µs beyond its pass on the CPU of the CPU tables, against 17 through the library.
LIBRARY = torch.library.Library("exattn", "FRAGMENT")


def define_op(name: str, schema: str, impl: Callable, fake: Callable):
    """`exattn::<name>` with this schema: `impl` on every device, `fake` for tracing."""
    LIBRARY.define(name + schema)
    LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    op = getattr(torch.ops.exattn, name).default
    torch.library.register_fake(op, fake, lib=LIBRARY)
    return op


def autograd_formula(backward_op, layout: Layout) -> tuple[Callable, Callable]:
    """(backward, setup_context) for a forward op: the backward op gives dq, dk, dv, `sinks_grad` the
    sinks' gradient (the last argument); every other argument gets none."""

    def setup_context(ctx, inputs, output):
        q, k, v, *rest = inputs
        out, lse = output
        ctx.rest = [SAVED if isinstance(x, Tensor) else x for x in rest]
        ctx.save_for_backward(q, k, v, out, lse, *(x for x in rest if isinstance(x, Tensor)))

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        tensors = iter(saved)
        rest = [next(tensors) if x is SAVED else x for x in ctx.rest]
        count = layout.count
        dq, dk, dv = backward_op(dout, q, k, v, *rest[:count], out, lse, *rest[count:])
        sinks, dsinks = rest[-1], None
        if sinks is not None and ctx.needs_input_grad[-1]:
            delta = row_delta(dout, out, lse.dtype).movedim(1, layout.heads_at)
            dsinks = sinks_grad(sinks, lse, delta, head_dim=layout.heads_at)
        return dq, dk, dv, *([None] * (len(rest) - 1)), dsinks

    return backward, setup_context


def tiled_passes():
    from .tiled_ops import TiledBackend

    return TiledBackend


def triton_passes():
    from .triton import TritonBackend

    return TritonBackend


DENSE_OPS = {
    "tiled": define_attention_ops("tiled", DENSE, tiled_passes),
    "triton": define_attention_ops("triton", DENSE, triton_passes),
}


def compiled_attention(backend: str, problem: AttentionProblem) -> tuple[Tensor, Tensor]:
    """(out, lse) of a dense problem through `backend`'s custom ops (the path under `torch.compile`)."""
    return DENSE_OPS[backend].attend(problem.q, problem.k, problem.v, (problem.mask,), problem.params, problem.rules)
