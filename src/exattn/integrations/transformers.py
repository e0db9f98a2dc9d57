"""exattn as a HuggingFace transformers attention implementation.

    import exattn.integrations.transformers      # registers "exattn"
    model = AutoModel.from_pretrained(path, attn_implementation="exattn")

Two registrations, because transformers builds the attention mask per
implementation name (`ALL_MASK_ATTENTION_FUNCTIONS`) and gives an
unregistered name no mask at all (padding would be silently ignored):

- `exattn_mask` (mask interface): the bool mask SDPA gets, (B, 1, Nq, Nk),
  True = attend, built by transformers' own `sdpa_mask`; except that a plain
  causal mask without padding, whose queries are the last Nq keys (a prefill,
  or new tokens over a KV cache), becomes None, and the attention function
  applies exattn's bottom-right causal rule instead of a mask.
- `exattn_attention_forward` (attention interface): runs `exattn.decode` for
  a few new tokens over a longer cache (no mask, causal or Nq = 1, no dropout,
  no gradient), else `exattn.attention` with the mask, the module's `scaling`,
  the `dropout` transformers passes, and K/V heads shared across query heads
  (GQA) without copying.
"""

from __future__ import annotations

import warnings

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (
    AttentionMaskInterface,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)

from ..attention import attention
from ..decode import decode

NAME = "exattn"
# At most this many new tokens over a longer cache go to `exattn.decode`.
DECODE_MAX_QUERIES = 16
UNSUPPORTED = ("softcap", "s_aux", "position_bias")


def register(name: str = NAME) -> None:
    """Make `attn_implementation=name` available to every transformers model."""
    AttentionInterface.register(name, exattn_attention_forward)
    AttentionMaskInterface.register(name, exattn_mask)


def exattn_mask(
    batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
    mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True, **kwargs,
) -> torch.Tensor | None:
    """transformers' mask interface: None for plain bottom-right causal, else SDPA's bool mask.

    attention_mask: the 2-D padding mask (B, past + Nq), True/1 = real token.
    Returns None or bool (B, 1, Nq, Nk), possibly a broadcast view.
    """
    if allow_is_causal_skip and is_plain_causal(
        q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, kwargs.get("local_size")
    ):
        return None
    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
        allow_is_causal_skip=False, **kwargs,
    )


def is_plain_causal(q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, local_size) -> bool:
    """True when the mask would be exactly exattn's bottom-right causal rule (reads the padding mask)."""
    if mask_function is not causal_mask_function or local_size is not None:
        return False
    if kv_offset != 0 or not isinstance(q_offset, int) or q_offset + q_length != kv_length:
        return False
    if attention_mask is None:
        return True
    if torch.compiler.is_compiling():
        return False
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    return padding.shape[-1] == kv_length and bool(padding.all())


def exattn_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface.

    query: (B, Hq, Nq, D); key, value: (B, Hk, Nk, D | Dv), after the KV-cache
    update; attention_mask: None (causal per the module, bottom-right, or
    full), or bool / additive float broadcastable to (B, Hq, Nq, Nk).
    Returns (out (B, Nq, Hq, Dv), None): exattn never forms the weights.
    """
    check_kwargs(kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is None and use_decode(query, key, value, causal, dropout):
        # Every key is valid (no cache_seqlens), so there is nothing to validate (and no sync).
        out = decode(query, key, value, scale=scaling, validate=False)
    else:
        out = attention(
            query, key, value, causal=attention_mask is None and causal,
            mask=attention_mask, scale=scaling, dropout_p=dropout,
        )
    return out.transpose(1, 2).contiguous(), None


def use_decode(query, key, value, causal: bool, dropout: float) -> bool:
    """A few new tokens over a longer KV cache, inference only: `exattn.decode` serves it."""
    len_q, len_k = query.shape[2], key.shape[2]
    differentiating = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    return (
        len_q <= DECODE_MAX_QUERIES and len_q < len_k and (causal or len_q == 1)
        and dropout == 0.0 and not differentiating
    )


def check_kwargs(kwargs: dict) -> None:
    for name in UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"attn_implementation='exattn' does not support {name}; got {name} set. "
                "Use attn_implementation='eager' for this model."
            )
    if kwargs.get("output_attentions"):
        warnings.warn(
            "attn_implementation='exattn' never forms the attention weights; "
            "output_attentions=True returns None for them. Use 'eager' to get them.",
            stacklevel=3,
        )


register()
