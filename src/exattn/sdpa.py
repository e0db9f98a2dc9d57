"""`exattn.sdpa`: the signature and semantics of `torch.nn.functional.scaled_dot_product_attention`.

SDPA aligns `is_causal` to the TOP-LEFT corner (query `i` sees key `j <= i`),
while exattn's causal rule is bottom-right (`j <= i + Nk - Nq`). Both are
expressed with exattn's one band rule, without building a mask:

    Nq <= Nk:  keys j >= Nq are never visible, so top-left causal over Nk keys
               is bottom-right causal over the first Nq keys (k, v sliced).
    Nq >  Nk:  top-left causal is the band's right bound Nq - Nk:
               j <= i + (Nk - Nq) + (Nq - Nk) = i.

Differences from SDPA (docs/integrations.md explains each):

1. Dropout draws its keep-mask from exattn's counter-based Philox stream
   (seeded from torch's default generator), not SDPA's: same distribution,
   different random numbers.
2. `dropout_p` must be in [0, 1) (SDPA also accepts 1.0).
3. A floating `attn_mask` cannot require grad (SDPA differentiates it).
4. A floating `attn_mask` of any float dtype is accepted and added in the
   compute dtype (SDPA wants bool, float32 or the query's dtype).
5. fp16/bf16 inputs accumulate in float32; float64 stays float64.
6. With `enable_gqa=True`, key and value must have the same number of heads.
7. Bad inputs raise ValueError/TypeError naming the argument (SDPA raises
   RuntimeError).
8. Nested tensors are not supported.
9. The backend is exattn's "auto" (Triton on a supported GPU, else tiled);
   `torch.nn.attention.sdpa_kernel` contexts have no effect.

As in SDPA, a row with nothing to attend gives zeros.
"""

from __future__ import annotations

import math

import torch

from .attention import attention
from .problem import check_bool, check_same_dtype_device, check_tensor


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for `torch.nn.functional.scaled_dot_product_attention`; no N x N weight matrix.

    Args:
        query: (..., Hq, L, E). key: (..., H, S, E). value: (..., H, S, Ev).
            Batch dims (and, without enable_gqa, head dims) broadcast; 2-D
            inputs (L, E) are allowed, as in SDPA.
        attn_mask: bool (True = attend) or float (added to the scores),
            broadcastable to (..., Hq, L, S). May not be given with is_causal.
        dropout_p: dropout on the weights, in [0, 1); exattn's Philox stream.
        is_causal: top-left aligned: query i sees key j iff j <= i.
        scale: score scale, default E ** -0.5.
        enable_gqa: allow Hq != H with Hq % H == 0; query head h reads
            key/value head h // (Hq // H).

    Returns:
        (..., Hq, L, Ev) in the query's dtype; rows with nothing to attend are 0.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_input(name, x)
    check_same_dtype_device(query=query, key=key, value=value)
    check_lengths(query, key, value)
    check_bool("is_causal", is_causal)
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask must be None when is_causal=True (as in SDPA); got both")
    lead, heads_q, heads_kv = batch_layout(query, key, value, enable_gqa)
    batch = math.prod(lead)
    q = as_4d(query, lead, heads_q, batch)
    k, v = (as_4d(x, lead, heads_kv, batch) for x in (key, value))
    mask = mask_4d(attn_mask, lead, heads_q, query.shape[-2], key.shape[-2], batch)
    k, v, band = top_left_causal(q, k, v) if is_causal else (k, v, {})
    out = attention(q, k, v, mask=mask, scale=scale, dropout_p=dropout_p, **band)
    out_batch = (*lead, heads_q) if max(query.dim(), key.dim(), value.dim()) >= 3 else ()
    return out.reshape(*out_batch, *out.shape[-2:])


def check_input(name: str, x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dims (..., seq, dim), got shape {tuple(x.shape)}")
    check_tensor(name, x, x.dim())


def check_lengths(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"key has head dim {key.shape[-1]} but query has {query.shape[-1]}; they must match"
        )
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(f"value has {value.shape[-2]} keys but key has {key.shape[-2]}; they must match")


def heads(x: torch.Tensor) -> int:
    return x.shape[-3] if x.dim() >= 3 else 1


def batch_layout(query, key, value, enable_gqa: object) -> tuple[tuple[int, ...], int, int]:
    """(leading batch dims, query heads, key/value heads) after broadcasting, as SDPA does."""
    check_bool("enable_gqa", enable_gqa)
    shapes = [tuple(x.shape[:-3]) for x in (query, key, value)]
    hq, hk, hv = heads(query), heads(key), heads(value)
    try:
        lead = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        raise ValueError(
            f"batch dims of query {shapes[0]}, key {shapes[1]} and value {shapes[2]} do not broadcast"
        ) from None
    if enable_gqa:
        if hk != hv:
            raise ValueError(f"with enable_gqa, key ({hk}) and value ({hv}) must have the same number of heads")
        if hk == 0:
            raise ValueError("with enable_gqa, key and value have no heads (dim -3 is 0): at least one is needed")
        if hq % hk != 0:
            raise ValueError(f"with enable_gqa, query heads ({hq}) must be a multiple of key/value heads ({hk})")
        return lead, hq, hk
    if not all(h in (1, max(hq, hk, hv)) for h in (hq, hk, hv)):
        raise ValueError(
            f"query has {hq} heads, key {hk} and value {hv}: without enable_gqa they must be "
            "equal or 1 (broadcast); pass enable_gqa=True for grouped-query attention"
        )
    heads_q = max(hq, hk, hv)
    return lead, heads_q, hk if hk == hv else heads_q


def as_4d(x: torch.Tensor, lead: tuple[int, ...], heads_out: int, batch: int) -> torch.Tensor:
    """(..., H, N, D) broadcast to (*lead, heads_out, N, D), flattened to (batch, heads_out, N, D)."""
    n, d = x.shape[-2:]
    return x.expand(*lead, heads_out, n, d).reshape(batch, heads_out, n, d)


def mask_4d(mask, lead, heads_q: int, len_q: int, len_k: int, batch: int):
    """The user's mask as (batch, Hq, L, S), a broadcast view where the layout allows."""
    if mask is None:
        return None
    check_attn_mask(mask)
    target = (*lead, heads_q, len_q, len_k)
    try:
        mask = mask.expand(target)
    except RuntimeError:
        raise ValueError(
            f"attn_mask of shape {tuple(mask.shape)} does not broadcast to (..., Hq, L, S) = {target}"
        ) from None
    return mask.reshape(batch, heads_q, len_q, len_k)


def check_attn_mask(mask: object) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = attend) or floating (added), got {mask.dtype}")
    if mask.requires_grad:
        raise ValueError("attn_mask requires grad; exattn does not differentiate the mask: pass attn_mask.detach()")


def top_left_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(k, v, band arguments) that make exattn's bottom-right rule give SDPA's top-left causal mask."""
    len_q, len_k = q.shape[2], k.shape[2]
    if len_q <= len_k:
        return k[:, :, :len_q], v[:, :, :len_q], {"causal": True}
    return k, v, {"window": (-1, len_q - len_k)}
