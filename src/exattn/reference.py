"""The float64 oracle: the textbook formula, materialized, in high precision."""

from __future__ import annotations

import torch

from .masks import apply_masks
from .problem import check_mask, check_qkv, check_scale, check_window


def dense_scores(q, k, scale, window, mask) -> torch.Tensor:
    """Masked scores (B, Hq, Nq, Nk) in q's dtype; K/V heads are shared by query-head groups."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    len_q, len_k = q.shape[2], k.shape[2]
    return apply_masks(scores, range(len_q), range(len_k), len_q, len_k, window, mask)


def softmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """Row softmax in the scores' dtype; a row with no allowed key gives zeros."""
    has_key = (scores > float("-inf")).any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~has_key, 0.0), dim=-1)
    return weights.masked_fill(~has_key, 0.0)


def apply_dropout(weights: torch.Tensor, keep: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    if keep is None:
        return weights
    return weights * keep.to(weights.dtype) / (1.0 - dropout_p)


def attention_ref(
    q, k, v, *, causal=False, window=None, mask=None, scale=None,
    dropout_mask=None, dropout_p=None, return_lse=False,
):
    """Float64 attention with every rule of the contract; materializes (B, Hq, Nq, Nk).

    q: (B, Hq, Nq, D), k: (B, Hk, Nk, D), v: (B, Hk, Nk, Dv).
    dropout_mask: bool keep-mask (B, Hq, Nq, Nk) from `exattn.dropout_mask`;
    kept weights are scaled by 1 / (1 - dropout_p), where dropout_p defaults to
    the mask's dropped fraction only if not given (pass it explicitly).
    Returns out (B, Hq, Nq, Dv) float64, and lse (B, Hq, Nq) float64 if asked.
    Differentiable, so it is also the gradient oracle.
    """
    check_qkv(q, k, v)
    left_right = check_window(window, causal)
    bias = check_mask(mask, q, k)
    scale = check_scale(scale, q.shape[3])
    q64, k64, v64 = (x.to(torch.float64) for x in (q, k, v))
    if bias is not None and bias.is_floating_point():
        bias = bias.to(torch.float64)
    scores = dense_scores(q64, k64, scale, left_right, bias)
    if dropout_mask is not None and dropout_p is None:
        raise ValueError("dropout_p must be given with dropout_mask")
    weights = apply_dropout(softmax_rows(scores), dropout_mask, dropout_p or 0.0)
    group = q.shape[1] // k.shape[1]
    out = torch.matmul(weights, v64.repeat_interleave(group, dim=1))
    if not return_lse:
        return out
    return out, torch.logsumexp(scores, dim=-1)


def max_abs_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| in float64; matching infinities count as exact, NaN propagates."""
    x, ref = x.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()
    same_inf = torch.isinf(x) & torch.isinf(ref) & (torch.sign(x) == torch.sign(ref))
    diff = torch.where(same_inf, torch.zeros_like(x), (x - ref).abs())
    if not diff.numel():
        return 0.0
    return float("nan") if torch.isnan(diff).any() else float(diff.max())
