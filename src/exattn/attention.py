"""`exattn.attention`: the public entry point."""

from __future__ import annotations

from typing import Literal, overload

import torch

from .backends import BackendChoice, choose_backend, get_backend
from .backends.autograd import fused_attention
from .backends.planned import keep_planned
from .checked_calls import call_signature, keepable, known_call, remember
from .problem import check_bool, make_problem

FUSED_BACKENDS = ("triton", "tiled")  # run through their passes (`fused_attention`)


def problem_from_args(q, k, v, causal, window, mask, scale, dropout_p, seed, block_m, block_n, **rules):
    return make_problem(
        q, k, v, causal=causal, window=window, mask=mask, scale=scale,
        dropout_p=dropout_p, seed=seed, block_m=block_m, block_n=block_n, **rules,
    )


@overload
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
    window: tuple[int, int] | None = ..., mask: torch.Tensor | None = ...,
    scale: float | None = ..., dropout_p: float = ..., seed: int | None = ...,
    return_lse: Literal[False] = ..., backend: str = ...,
    block_m: int | None = ..., block_n: int | None = ...,
    segment_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = ...,
    prefix: int | torch.Tensor | None = ..., softcap: float = ...,
    alibi_slopes: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
) -> torch.Tensor: ...


@overload
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
    window: tuple[int, int] | None = ..., mask: torch.Tensor | None = ...,
    scale: float | None = ..., dropout_p: float = ..., seed: int | None = ...,
    return_lse: Literal[True], backend: str = ...,
    block_m: int | None = ..., block_n: int | None = ...,
    segment_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = ...,
    prefix: int | torch.Tensor | None = ..., softcap: float = ...,
    alibi_slopes: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def attention(
    q, k, v, *, causal=False, window=None, mask=None, scale=None, dropout_p=0.0,
    seed=None, return_lse=False, backend="auto", block_m=None, block_n=None,
    segment_ids=None, prefix=None, softcap=0.0, alibi_slopes=None, sinks=None,
):
    """Exact softmax attention without an N x N matrix (except `backend="naive"`).

    Args:
        q: (B, Hq, Nq, D). k: (B, Hk, Nk, D). v: (B, Hk, Nk, Dv); Hq % Hk == 0,
            query head h reads K/V head h // (Hq // Hk). Any strides.
        causal: bottom-right aligned: query i sees key j iff j <= i + Nk - Nq.
        window: (left, right), each >= 0 or -1 (unbounded): key j is allowed iff
            i + Nk - Nq - left <= j <= i + Nk - Nq + right. Combines with causal.
        mask: bool (True = attend) or additive float, broadcastable to (B, Hq, Nq, Nk).
        scale: score scale, default D ** -0.5.
        dropout_p: dropout on the normalized weights, in [0, 1).
        seed: int in [0, 2**63) keying the Philox keep-mask (`exattn.dropout_mask`);
            None draws one from torch's default generator.
        return_lse: also return lse (B, Hq, Nq), natural log, float32, -inf
            for rows with no allowed key (whose output is 0).
        backend: "auto", "triton", "tiled" or "naive" (see `explain_backend`).
        block_m, block_n: query and key tile sizes; None lets the backend choose.
        segment_ids: int32 (B, N) when Nq == Nk, or a pair (q_ids (B, Nq), k_ids (B, Nk)):
            query i may attend key j only if their ids are equal (packed documents).
        prefix: int or int32 (B,): keys j < prefix[b] are allowed whatever causal and
            window say (segment ids and a bool mask still apply).
        softcap: float > 0, or 0 for off: the score becomes softcap * tanh(score / softcap),
            before ALiBi and the additive mask.
        alibi_slopes: float32 (Hq,) or (B, Hq): adds -slope * |i + Nk - Nq - j|. No
            gradient (a slopes tensor that requires grad is refused).
        sinks: float32 (Hq,), differentiable: a virtual key with logit sinks[h] and value 0
            joins every row's softmax; lse includes it, and a row with no allowed key
            gives zeros and lse = sinks[h].
        (float64 slopes and sinks are accepted with float64 q.) Rule order: scale * q.k,
        softcap, + ALiBi, + additive mask, then allowed iff (causal/window or j < prefix)
        and equal segment ids and the bool mask; softmax with the sink; dropout.

    Returns:
        out (B, Hq, Nq, Dv) in q's dtype, or (out, lse) if return_lse.
    """
    check_bool("return_lse", return_lse)
    signature = None
    if (mask is None and segment_ids is None and prefix is None and alibi_slopes is None and sinks is None
            and keepable(dropout_p, seed)):
        signature = call_signature("attention", (q, k, v), window,
                                   (causal, scale, dropout_p, seed, block_m, block_n, softcap, backend))
        known = known_call(signature)
        if known is not None:
            params, passes = known
            out, lse = fused_attention(passes, q, k, v, None, params)
            keep_planned(signature, params, passes, q, k, v, None, params)
            return (out, lse.to(torch.float32)) if return_lse else out
    problem = problem_from_args(
        q, k, v, causal, window, mask, scale, dropout_p, seed, block_m, block_n, segment_ids=segment_ids,
        prefix=prefix, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
    )
    choice = choose_backend(problem, backend)
    runner = get_backend(choice.name)
    if choice.name in FUSED_BACKENDS:
        remember(signature, (problem.params, runner))
    out, lse = runner.run(problem)
    return (out, lse.to(torch.float32)) if return_lse else out


def explain_backend(
    q, k, v, *, causal=False, window=None, mask=None, scale=None, dropout_p=0.0,
    seed=None, backend="auto", block_m=None, block_n=None,
    segment_ids=None, prefix=None, softcap=0.0, alibi_slopes=None, sinks=None,
) -> BackendChoice:
    """Which backend `attention` would run for these arguments, and why the others were passed over."""
    problem = problem_from_args(
        q, k, v, causal, window, mask, scale, dropout_p, seed, block_m, block_n, segment_ids=segment_ids,
        prefix=prefix, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
    )
    return choose_backend(problem, backend)
