"""The float64 oracle: the textbook formula, materialized, in high precision."""

from __future__ import annotations

import torch

from .masks import apply_score_rules
from .problem import (
    ScoreRules,
    check_mask,
    check_qkv,
    check_scale,
    check_score_rules,
    check_softcap,
    check_window,
)


def dense_scores(q, k, scale, window, mask, rules: ScoreRules | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Scores (B, Hq, Nq, Nk) in q's dtype after every rule (`masks.apply_score_rules`);
    K/V heads are shared by query-head groups."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    len_q, len_k = q.shape[2], k.shape[2]
    return apply_score_rules(scores, range(len_q), range(len_k), len_q, len_k, window, mask, rules, softcap)


def with_sink(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """(B, Hq, Nq, Nk [+ 1]): the sink's logit sinks[h] as one more key, if there are sinks."""
    if sinks is None:
        return scores
    column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], dim=-1)


def softmax_rows(scores: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Row softmax (B, Hq, Nq, Nk) in the scores' dtype; a row with no allowed key (and no
    finite sink) gives zeros. With sinks, the sink joins every row's denominator (its
    value is 0, so its weight is dropped from the result)."""
    scores = with_sink(scores, sinks)
    has_key = (scores > float("-inf")).any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~has_key, 0.0), dim=-1)
    weights = weights.masked_fill(~has_key, 0.0)
    return weights if sinks is None else weights[..., :-1]


def row_lse(scores: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """(B, Hq, Nq): logsumexp of each row's scores, the sink included."""
    return torch.logsumexp(with_sink(scores, sinks), dim=-1)


def apply_dropout(weights: torch.Tensor, keep: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    if keep is None:
        return weights
    return weights * keep.to(weights.dtype) / (1.0 - dropout_p)


def attention_ref(
    q, k, v, *, causal=False, window=None, mask=None, scale=None,
    dropout_mask=None, dropout_p=None, return_lse=False,
    segment_ids=None, prefix=None, softcap=0.0, alibi_slopes=None, sinks=None,
):
    """Float64 attention with every rule of the contract; materializes (B, Hq, Nq, Nk).

    q: (B, Hq, Nq, D), k: (B, Hk, Nk, D), v: (B, Hk, Nk, Dv).
    segment_ids, prefix, softcap, alibi_slopes, sinks: as in `exattn.attention`
    (rule order: `exattn.masks.apply_score_rules`, then the softmax with the sink).
    dropout_mask: bool keep-mask (B, Hq, Nq, Nk) from `exattn.dropout_mask`;
    kept weights are scaled by 1 / (1 - dropout_p), where dropout_p defaults to
    the mask's dropped fraction only if not given (pass it explicitly).
    Returns out (B, Hq, Nq, Dv) float64, and lse (B, Hq, Nq) float64 if asked.
    Differentiable, so it is also the gradient oracle (in q, k, v and sinks; a sinks
    tensor that requires grad gets its gradient in its own dtype).
    """
    check_qkv(q, k, v)
    left_right = check_window(window, causal)
    bias = check_mask(mask, q, k)
    scale = check_scale(scale, q.shape[3])
    softcap = check_softcap(softcap)
    rules = check_score_rules(
        batch=q.shape[0], heads_q=q.shape[1], len_q=q.shape[2], len_k=k.shape[2], device=q.device,
        dtype=q.dtype, segment_ids=segment_ids, prefix=prefix, alibi_slopes=alibi_slopes, sinks=sinks,
    )
    q64, k64, v64 = (x.to(torch.float64) for x in (q, k, v))
    if bias is not None and bias.is_floating_point():
        bias = bias.to(torch.float64)
    scores = dense_scores(q64, k64, scale, left_right, bias, rules, softcap)
    if dropout_mask is not None and dropout_p is None:
        raise ValueError("dropout_p must be given with dropout_mask")
    sinks64 = None if rules is None or rules.sinks is None else rules.sinks.to(torch.float64)
    weights = apply_dropout(softmax_rows(scores, sinks64), dropout_mask, dropout_p or 0.0)
    group = q.shape[1] // k.shape[1]
    out = torch.matmul(weights, v64.repeat_interleave(group, dim=1))
    if not return_lse:
        return out
    return out, row_lse(scores, sinks64)


def max_abs_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| in float64; matching infinities count as exact, NaN propagates."""
    x, ref = x.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()
    same_inf = torch.isinf(x) & torch.isinf(ref) & (torch.sign(x) == torch.sign(ref))
    diff = torch.where(same_inf, torch.zeros_like(x), (x - ref).abs())
    if not diff.numel():
        return 0.0
    return float("nan") if torch.isnan(diff).any() else float(diff.max())
