"""exattn as a HuggingFace transformers attention implementation.

    import exattn.integrations.transformers      # registers "exattn"
    model = AutoModel.from_pretrained(path, attn_implementation="exattn")

Two registrations, because transformers builds the attention mask per
implementation name (`ALL_MASK_ATTENTION_FUNCTIONS`) and gives an
unregistered name no mask at all (padding would be silently ignored):

- `exattn_mask` (mask interface): the bool mask SDPA gets, (B, 1, Nq, Nk),
  True = attend, built by transformers' own `sdpa_mask`; except that a plain
  causal or sliding-window causal mask without padding, whose queries are the
  last Nq keys (a prefill, or new tokens over a KV cache, sliding or not),
  becomes None, and the attention function applies exattn's bottom-right
  causal rule (and the layer's `sliding_window`) instead of a mask. With
  padding, those rules and full attention become a `DeferredMask` holding the
  padding as segment ids (`padding_ids`); so do the causal rules over a static
  cache, whose slots past the newest token are unused (`used_keys`, and
  `cache_seqlens` for `exattn.decode`), and chunked causal attention, whose
  chunks become segment ids (`chunk_ids`). The block-diagonal mask of a packed
  batch (one row, position ids restarting per document) is not built either:
  it becomes a `DeferredMask`, which the attention function serves through
  `attention_varlen` with the documents' offsets, given or read from their ids
  (`packed_documents`).
- `exattn_attention_forward` (attention interface): runs `exattn.attention_varlen`
  on a packed batch (the `cu_seq_lens_q/k`, `max_length_q/k` keywords, as
  `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` makes them),
  `exattn.decode` for a few new tokens over a longer cache (no mask, or on CUDA
  left padding as `cache_leftpad`; causal or Nq = 1, no dropout, no gradient;
  with the softcap, sinks and window), else
  `exattn.attention` with the mask, the module's `scaling`, the `dropout`,
  `softcap` (Gemma 2's `attn_logit_softcapping`), `s_aux` (gpt-oss's sinks)
  and `sliding_window` transformers passes, and K/V heads shared across query
  heads (GQA) without copying.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
    chunked_overlay,
    packed_sequence_mask_function,
    prepare_padding_mask,
    remap_positions_for_packed_sequence,
    sdpa_mask,
    sliding_window_overlay,
)

from ..attention import attention
from ..decode import decode
from ..varlen import attention_varlen

NAME = "exattn"
# At most this many new tokens over a longer cache go to `exattn.decode`.
DECODE_MAX_QUERIES = 16
UNSUPPORTED = ("position_bias",)
# The code of the same-document rule transformers adds to the mask of a packed batch
# (`packed_sequence_mask_function(ids)` returns a new closure over this code each call).
PACKED_RULE_CODE = packed_sequence_mask_function(torch.zeros(1, 1, dtype=torch.long)).__code__
# The code of the rule it wraps the others in, read at per-document positions.
REMAP_RULE_CODE = remap_positions_for_packed_sequence(causal_mask_function, torch.zeros(1, 1)).__code__
# The code of the window rule of `sliding_window_causal_mask_function(w)` = and_masks(overlay(w), causal).
SLIDING_RULE_CODE = sliding_window_overlay(1).__code__
# The code of the chunk rule of `chunked_causal_mask_function(size, left_padding)` = and_masks(overlay, causal).
CHUNKED_RULE_CODE = chunked_overlay(1, torch.zeros(1)).__code__
# The chunk id of keys no query may see (padding, a static cache's unused slots): below any position's.
NO_CHUNK = -(2**31)


def register(name: str = NAME) -> None:
    """Make `attn_implementation=name` available to every transformers model."""
    AttentionInterface.register(name, exattn_attention_forward)
    AttentionMaskInterface.register(name, exattn_mask)


def exattn_mask(
    batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
    mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True, **kwargs,
) -> torch.Tensor | DeferredMask | None:
    """transformers' mask interface: None for plain bottom-right causal (sliding or not) without padding
    (`deferred_rule`); a `DeferredMask` for those rules and full attention with padding or over a static
    cache, for chunked causal attention and for a packed batch's rule; else SDPA's bool mask (B, 1, Nq, Nk)
    (possibly a broadcast view).

    attention_mask: the 2-D padding mask (B, past + Nq), True/1 = real token; or a `DeferredMask` this
    function gave before, handed back: `generate` prepares the masks of a compileable (static) cache ahead
    of the forward and passes them as the model's attention mask, which asks for its mask again.
    """
    if isinstance(attention_mask, DeferredMask):
        if attention_mask.made_for(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                   local_size=kwargs.get("local_size")):
            return attention_mask
        attention_mask = attention_mask.arguments["attention_mask"]  # the padding it was made from
    arguments = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)
    # Under torch.compile a rule made while tracing keeps its closure out of reach (transformers
    # wraps every rule there, packed or not): it is deferred or built as SDPA's mask would be.
    traced_rule = torch.compiler.is_compiling() and mask_function not in (causal_mask_function,
                                                                          bidirectional_mask_function)
    if attention_mask is None and (traced_rule or is_packed_sequence_rule(mask_function)):
        documents = None if traced_rule else packed_documents(mask_function)
        return DeferredMask(arguments, *((documents[0], *documents) if documents else ()), packed=True)
    rule = None if traced_rule else read_rule(q_length, kv_length, settled(q_offset), kv_offset, mask_function,
                                                kwargs.get("local_size"))
    if rule is None:
        return sdpa_mask(**arguments, allow_is_causal_skip=False)
    return deferred_rule(arguments, rule, allow_is_causal_skip)


def settled(offset):
    """A static cache's query offset, which transformers gives as a 0-d tensor, as an int: read once a
    forward outside torch.compile (a host sync); else as given."""
    if isinstance(offset, torch.Tensor) and offset.ndim == 0 and not torch.compiler.is_compiling():
        return int(offset)
    return offset


class ReadRule(NamedTuple):
    """A mask transformers asked for, read: bottom-right causal or full attention over the first
    `used_keys` keys, the window w (keys `q - w < k <= q`) if set, and the chunks (size, left padding
    (B,)) of `chunked_causal_mask_function` if set (a query sees the keys of its chunk)."""

    causal: bool
    window: int | None
    used_keys: int
    chunks: tuple[int, torch.Tensor] | None = None


def read_rule(q_length, kv_length, q_offset, kv_offset, mask_function, local_size) -> ReadRule | None:
    """The mask as a `ReadRule` where, padding aside, it is exattn's bottom-right causal rule, that rule
    with the window transformers' attention functions get as `sliding_window` = w (a sliding layer,
    `local_size` w), that rule within chunks (`local_size` the chunk size), or full attention; else None.

    Keys are absolute positions `kv_offset .. kv_offset + kv_length - 1` (a sliding cache drops the
    oldest: kv_offset > 0); the newest query must be the newest used key: the last key, or under a
    causal rule an earlier one (a static cache: the slots after it are unused, and hidden).
    """
    if not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        return None
    used_keys = q_offset + q_length - kv_offset
    if local_size is not None:
        chunks = chunked_rule(mask_function)
        if sliding_causal_window(mask_function) == local_size:
            rule = ReadRule(True, local_size, used_keys)
        elif chunks is not None and chunks[0] == local_size:
            rule = ReadRule(True, None, used_keys, chunks)
        else:
            return None
    elif mask_function is causal_mask_function:
        rule = ReadRule(True, None, used_keys)
    elif mask_function is bidirectional_mask_function:
        rule = ReadRule(False, None, used_keys)
    else:
        return None
    return rule if used_keys == kv_length or (rule.causal and 0 < used_keys < kv_length) else None


def deferred_rule(arguments: dict, rule: ReadRule, allow_is_causal_skip: bool) -> DeferredMask | None:
    """A rule read: None for plain bottom-right causal (sliding or not) without padding, which the attention
    function applies; else a `DeferredMask` holding the padding and chunks as segment ids and a static
    cache's used keys. A static cache (its offset a tensor) gets its lengths at every step, so a compiled
    step sees one kind of mask from the first step to the one that fills the cache; and where transformers
    asks for a mask (no skip: a compileable cache's step, prepared ahead of the forward), a None would have
    the compiled forward make the rule anew, out of reach while tracing."""
    batch, q_length, kv_length = arguments["batch_size"], arguments["q_length"], arguments["kv_length"]
    kv_offset = arguments["kv_offset"]
    q_offset = kv_offset + rule.used_keys - q_length  # as read, without reading a tensor offset again
    padding = padding_ids(arguments["attention_mask"], kv_length, kv_offset, rule.used_keys)
    static = isinstance(arguments["q_offset"], torch.Tensor) or rule.used_keys < kv_length
    if padding is None and rule.chunks is None and rule.causal and not static and allow_is_causal_skip:
        return None
    device = arguments.get("device") or (padding.device if padding is not None else "cpu")
    lengths = torch.full((batch,), rule.used_keys, dtype=torch.int32, device=device) if static else None
    query_ids, key_ids, leading = None, padding, None
    if rule.chunks is not None:
        if key_ids is None:
            key_ids = torch.zeros(batch, kv_length, dtype=torch.int32, device=device)
            key_ids[:, rule.used_keys:] = 1
        query_ids = chunk_ids(rule.chunks, q_offset, q_length, device)
        key_ids = chunk_ids(rule.chunks, kv_offset, kv_length, device).masked_fill_(key_ids.bool(), NO_CHUNK)
    elif padding is not None:
        query_ids = torch.zeros(batch, q_length, dtype=torch.int32, device=device)
        if rule.causal and q_length <= DECODE_MAX_QUERIES and not torch.compiler.is_compiling():
            leading = leading_padding(padding[:, :rule.used_keys])
    return DeferredMask(arguments, query_ids, key_ids, rule.causal, rule.window, used_keys=rule.used_keys,
                        cache_seqlens=lengths, left_padding=leading)


def chunk_ids(chunks: tuple[int, torch.Tensor], start: int, count: int, device) -> torch.Tensor:
    """int32 (B, count): the chunk of positions `start .. start + count - 1` of each row, chunks counted
    from the row's first real token (its left padding), as `chunked_overlay`."""
    size, left_padding = chunks
    positions = torch.arange(start, start + count, device=device)[None, :] - left_padding.to(device)[:, None]
    return torch.div(positions, size, rounding_mode="floor").to(torch.int32)


def padding_ids(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int,
                used_keys: int) -> torch.Tensor | None:
    """Segment ids of the keys, int32 (B, kv_length): 0 for a real token, 1 for padding and for the slots
    past the first `used_keys` (every query has id 0: it sees the real keys, as under SDPA's mask); None
    where the used keys are all real (known without reading the mask where it is None; read, a host
    sync, outside torch.compile)."""
    if attention_mask is None:
        return None
    real = prepare_padding_mask(attention_mask, kv_length, kv_offset)[..., kv_offset:kv_offset + kv_length]
    if not torch.compiler.is_compiling() and bool(real[..., :used_keys].all()):
        return None
    padding = (real == 0).to(torch.int32)
    padding[..., used_keys:] = 1
    return padding


def leading_padding(padding: torch.Tensor) -> torch.Tensor | None:
    """int32 (B,): each row's padding keys where they all lead it (a batch of prompts padded on the left),
    else None; read once (a host sync) where the mask is made: ahead of a compiled step for a static cache."""
    counts = padding.sum(1, dtype=torch.int32)
    leading = torch.arange(padding.shape[1], device=padding.device)[None, :] < counts[:, None]
    return counts if torch.equal(leading.to(padding.dtype), padding) else None


def sliding_window_of(rule) -> int | None:
    """w for `sliding_window_overlay(w)`, else None."""
    if getattr(rule, "__code__", None) is not SLIDING_RULE_CODE:
        return None
    (cell,) = rule.__closure__
    return cell.cell_contents


def sliding_causal_window(mask_function) -> int | None:
    """w when `mask_function` is `sliding_window_causal_mask_function(w)`, that is
    `and_masks(sliding_window_overlay(w), causal_mask_function)` (either order), else None.

    Reads the `and_masks` closure; a transformers release that builds it otherwise gives
    None, and the mask is materialized as before (correct, at O(N^2) memory).
    """
    parts = and_parts(mask_function)
    if parts is None or len(parts) != 2 or causal_mask_function not in parts:
        return None
    return sliding_window_of(parts[1] if parts[0] is causal_mask_function else parts[0])


def chunked_rule(mask_function) -> tuple[int, torch.Tensor] | None:
    """(chunk size, left padding (B,)) when `mask_function` is `chunked_causal_mask_function(size, left_padding)`,
    that is `and_masks(chunked_overlay(size, left_padding), causal_mask_function)`, else None."""
    parts = and_parts(mask_function)
    if parts is None or len(parts) != 2 or parts[1] is not causal_mask_function:
        return None
    if code_of(parts[0]) is not CHUNKED_RULE_CODE:
        return None
    captured = dict(zip(CHUNKED_RULE_CODE.co_freevars, closure_values(parts[0])))
    return captured["chunk_size"], captured["left_padding"]


def is_packed_sequence_rule(mask_function) -> bool:
    """True for the mask function `create_causal_mask` (and its sliding-window and chunked
    variants) builds for a packed batch: `and_masks(..., packed_sequence_mask_function(ids))`.

    Reads the `and_masks` closure; if a transformers release builds it otherwise, this is
    False and the mask is materialized as before (correct, at O(N^2) memory).
    """
    return any(code_of(part) is PACKED_RULE_CODE for part in and_parts(mask_function) or ())


def packed_documents(mask_function) -> tuple[torch.Tensor, bool, int | None] | None:
    """(document ids int32 (B, N), causal: True, window w or None) of transformers' rule for a packed
    batch over plain or sliding-window causal attention:

        and_masks(remap_positions_for_packed_sequence(rule, position_ids), packed_sequence_mask_function(ids))

    with `rule` `causal_mask_function` or `sliding_window_causal_mask_function(w)`; None for any other
    rule (a chunked or an overlaid one), whose mask is built.
    """
    parts = and_parts(mask_function)
    if parts is None or len(parts) != 2 or code_of(parts[0]) is not REMAP_RULE_CODE:
        return None
    if code_of(parts[1]) is not PACKED_RULE_CODE:
        return None
    (rule,) = (x for x in closure_values(parts[0]) if callable(x))
    (ids,) = (x for x in closure_values(parts[1]) if isinstance(x, torch.Tensor))
    window = None if rule is causal_mask_function else sliding_causal_window(rule)
    if rule is not causal_mask_function and window is None:
        return None
    return ids.to(torch.int32), True, window


def and_parts(mask_function) -> tuple | None:
    """The rules `and_masks(*rules)` made `mask_function` from (read from its closure), else None."""
    for value in closure_values(mask_function):
        if isinstance(value, tuple) and all(callable(part) for part in value):
            return value
    return None


def closure_values(function) -> list:
    return [cell.cell_contents for cell in getattr(function, "__closure__", None) or ()]


def code_of(function):
    return getattr(function, "__code__", None)


@dataclass(frozen=True)
class DeferredMask:
    """A mask transformers asked for, not built (`arguments`: `sdpa_mask`'s keywords).

    Where the rule was read, `causal` and `window` hold it (bottom-right causal, and the window w: keys
    `q - w < k <= q`, if set) over the first `used_keys` keys (all but a static cache's unused slots),
    and `query_ids` (B, Nq) and `key_ids` (B, Nk) int32, if set, narrow it: a query sees the keys of its
    own id (the unused slots have a padding's). `exattn.attention` serves that with `segment_ids` and no
    mask; `exattn.decode` takes `cache_seqlens` (`used_keys` each) where slots are unused. Four sources:

    - a static cache's unused slots under plain or sliding-window causal attention (`read_rule`): no ids;
    - padding under those rules or full attention: real keys have id 0, padding 1, every query 0
      (`padding_ids`); a query with no real key (left padding, causal) gets zeros. Where the padding
      leads every row, `left_padding` counts it (read where the mask is made, for at most
      `DECODE_MAX_QUERIES` queries under a causal rule);
    - chunked causal attention (Llama 4's `attention_chunk_size`): ids are chunks (`chunk_ids`), and
      padding keys get `NO_CHUNK`, which no query has;
    - a packed batch (`packed`), from position ids that restart per document: transformers asks for
      its block-diagonal mask once per forward, before it knows whether the attention function gets
      the documents' offsets. With `cu_seq_lens_q/k` the attention function runs `attention_varlen`;
      without them it runs `attention_varlen` over the `documents` read from the ids
      (`packed_documents`), or builds the mask where the rule was not read.

    `build()` gives the bool (B, 1, Nq, Nk) mask SDPA would get, where no ids were read: another rule
    under the packing, or any rule made while compiling, where transformers cannot tell a packed
    batch and `exattn_mask` cannot read the rule.
    """

    arguments: dict
    query_ids: torch.Tensor | None = None
    key_ids: torch.Tensor | None = None
    causal: bool = True
    window: int | None = None
    packed: bool = False
    used_keys: int | None = None
    cache_seqlens: torch.Tensor | None = None
    left_padding: torch.Tensor | None = None

    # Stands for a bool mask of this shape, so that transformers takes it for one made already
    # (a model's mask functions read `ndim` of the attention mask they are given).
    ndim = 4

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.arguments["batch_size"], 1, self.arguments["q_length"], self.arguments["kv_length"]

    def made_for(self, **sizes) -> bool:
        """Whether it was made for these mask-interface sizes (`batch_size`, `q_length`, `kv_length`,
        `local_size`)."""
        return all(self.arguments.get(name) == value for name, value in sizes.items())

    def build(self) -> torch.Tensor:
        return sdpa_mask(**self.arguments, allow_is_causal_skip=False)

    def read_for(self, query: torch.Tensor, key: torch.Tensor) -> bool:
        """Whether the rule was read for these queries and keys."""
        if self.packed:
            return (self.key_ids is not None and self.query_ids.shape == (query.shape[0], query.shape[2])
                    and self.key_ids.shape == (key.shape[0], key.shape[2]))
        return (query.shape[0], 1, query.shape[2], key.shape[2]) == self.shape

    @cached_property
    def documents(self) -> tuple[torch.Tensor, int]:
        """(offsets int32 (n + 1,), longest document) of a packed batch's n documents, its rows laid end
        to end (token-major): read from the ids once (one host sync), shared by every layer."""
        ids = self.key_ids.cpu().to(torch.int64)
        rows, length = ids.shape
        unique_per_row = ids + torch.arange(rows)[:, None] * (length + 1)
        lengths = torch.unique_consecutive(unique_per_row.flatten(), return_counts=True)[1]
        offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(self.key_ids.device, torch.int32)
        return offsets, int(lengths.max()) if lengths.numel() else 0


def deferred_attention(query, key, value, rule: DeferredMask, scale, dropout, softcap, sinks) -> torch.Tensor:
    """A rule read from transformers: a packed batch's documents through `attention_varlen`; a few new
    tokens (`use_decode`) through `exattn.decode` over the whole cache with its used lengths, where no key
    is padding or the padding leads every row and `decode_serves_left_padding` (as `cache_leftpad`);
    else `exattn.attention` over the used keys, the padding as segment ids. Returns (B, Nq, Hq, Dv)."""
    if rule.packed:
        offsets, longest_document = rule.documents
        window = None if rule.window is None else (rule.window - 1, rule.window - 1)
        return rows_attention(
            query, key, value, offsets, offsets, longest_document, longest_document, causal=rule.causal,
            window=window, scale=scale, dropout=dropout, softcap=softcap, sinks=sinks, validate=False,
        )
    # A window that holds every used key is dropped, as without a mask, so that decode's fastest kernel serves it.
    window = None if rule.window is None or rule.window >= rule.used_keys else (rule.window - 1, 0)
    leftpad = rule.left_padding if rule.key_ids is not None and decode_serves_left_padding(query) else None
    if use_decode(query, key, value, rule.causal, dropout, sinks) and (rule.key_ids is None or leftpad is not None):
        out = decode(query, key, value, cache_seqlens=rule.cache_seqlens, scale=scale, validate=False,
                     window=window, softcap=softcap, sinks=sinks, cache_leftpad=leftpad)
    else:
        key_ids = rule.key_ids
        # One query at the last slot sees what the newest used key's does: the unused slots are padding.
        if not (query.shape[2] == 1 and window is None and key_ids is not None) and rule.used_keys < key.shape[2]:
            key, value = key[:, :, :rule.used_keys], value[:, :, :rule.used_keys]
            key_ids = None if key_ids is None else key_ids[:, :rule.used_keys]
        segment_ids = None if key_ids is None else (rule.query_ids, key_ids)
        out = attention(query, key, value, causal=rule.causal, window=window, scale=scale, dropout_p=dropout,
                        softcap=softcap, sinks=sinks, segment_ids=segment_ids)
    return out.transpose(1, 2).contiguous()


def decode_serves_left_padding(query: torch.Tensor) -> bool:
    """Whether a left-padded decoding step goes to `exattn.decode` (`cache_leftpad`): on CUDA, whose split-KV
    kernels read each K/V head once for its query heads. The tiled backend's decode and its forward with
    segment ids run the same products; there the forward read 1.18-1.20x faster (B = 4, Hq = 32, Hk = 8, 4k
    keys, d = 128, fp32, the CPU of docs/performance.md)."""
    return query.is_cuda


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
    full), bool / additive float broadcastable to (B, Hq, Nq, Nk), or a
    `DeferredMask`. kwargs `cu_seq_lens_q`, `cu_seq_lens_k` ((n + 1,)
    offsets of n packed documents, any int dtype and device) and `max_length_q`,
    `max_length_k` (int or 0-d tensor; computed from the offsets if absent):
    a packed batch, B = 1, run by `packed_attention`. `softcap`: float or None
    (Gemma 2/3); `s_aux`: (Hq,) sink logits in any float dtype (gpt-oss), cast to
    float32 (float64 for float64 queries) with gradients kept; `sliding_window` w
    (else the module's): with no mask and causal, keys `i + Nk - Nq - w < j`
    only, i.e. exattn's window (w - 1, 0); with a mask, the mask already holds it.
    Returns (out (B, Nq, Hq, Dv), None): exattn never forms the weights.
    """
    check_kwargs(kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    softcap = float(kwargs.get("softcap") or 0.0)
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sinks = sinks.to(torch.float64 if query.dtype == torch.float64 else torch.float32)
    sliding_window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        if attention_mask is not None and not (isinstance(attention_mask, DeferredMask) and attention_mask.packed):
            raise ValueError(
                "attn_implementation='exattn' got a packed batch (cu_seq_lens_q/k) together with an attention "
                "mask; a packed batch has no padding: drop attention_mask (DataCollatorWithFlattening gives none)"
            )
        return packed_attention(
            query, key, value, kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"),
            kwargs.get("max_length_q"), kwargs.get("max_length_k"), causal=bool(causal),
            sliding_window=sliding_window, scale=scaling, dropout=dropout, softcap=softcap, sinks=sinks,
        ), None
    if isinstance(attention_mask, DeferredMask):
        if attention_mask.read_for(query, key):
            return deferred_attention(query, key, value, attention_mask, scaling, dropout, softcap, sinks), None
        attention_mask = attention_mask.build()
    window = None
    # Without a mask a causal sliding layer needs its window, unless even the last query sees
    # every key (Nk <= w: a sliding cache's decoding step), where `decode` may still serve it.
    if attention_mask is None and causal and sliding_window is not None and sliding_window < key.shape[2]:
        window = (sliding_window - 1, 0)
    if attention_mask is None and use_decode(query, key, value, causal, dropout, sinks):
        # Every key is valid (no cache_seqlens), so there is nothing to validate.
        out = decode(query, key, value, scale=scaling, validate=False, window=window, softcap=softcap, sinks=sinks)
    else:
        out = attention(
            query, key, value, causal=attention_mask is None and causal, window=window,
            mask=attention_mask, scale=scaling, dropout_p=dropout, softcap=softcap, sinks=sinks,
        )
    return out.transpose(1, 2).contiguous(), None


def packed_attention(
    query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, *,
    causal: bool, sliding_window: int | None, scale: float | None, dropout: float,
    softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A packed batch through `attention_varlen`: no padding and no (N, N) mask.

    query: (1, Hq, total_q, D); key, value: (1, Hk, total_k, D | Dv); document b
    owns rows `cu_seq_lens_*[b] : cu_seq_lens_*[b + 1]`. Causal is bottom-right
    within each document. `sliding_window` w keeps the w most recent keys, the
    query's own included (transformers' convention): window (w - 1, w - 1),
    whose right side causal folds to 0, as transformers' FlashAttention path.
    Returns (1, total_q, Hq, Dv).
    """
    if query.shape[0] != 1:
        raise ValueError(
            f"attn_implementation='exattn' got cu_seq_lens_q/k with batch size {query.shape[0]}; a packed "
            "batch is one row of concatenated documents, shape (1, total)"
        )
    if cu_seq_lens_q is None or cu_seq_lens_k is None:
        raise ValueError("attn_implementation='exattn' needs both cu_seq_lens_q and cu_seq_lens_k for a packed batch")
    offsets_q, offsets_k = (torch.as_tensor(x).to(device=query.device, dtype=torch.int32)
                            for x in (cu_seq_lens_q, cu_seq_lens_k))
    window = None if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    return rows_attention(
        query, key, value, offsets_q, offsets_k, longest(max_length_q, offsets_q), longest(max_length_k, offsets_k),
        causal=causal, window=window, scale=scale, dropout=dropout, softcap=softcap, sinks=sinks,
        validate=not torch.compiler.is_compiling(),  # reading the offsets would break the graph
    )


def rows_attention(query, key, value, offsets_q, offsets_k, max_q: int, max_k: int, *, causal: bool, window,
                   scale, dropout: float, softcap: float, sinks, validate: bool) -> torch.Tensor:
    """`attention_varlen` over documents packed along rows laid end to end: query (B, Hq, Nq, D), key and
    value (B, Hk, Nk, D | Dv), offsets into the B * N tokens. Rows stored token-major, as transformers'
    projections leave them, are read in place. Returns (B, Nq, Hq, Dv)."""
    def token_major(x):
        return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])

    out = attention_varlen(
        token_major(query), token_major(key), token_major(value), offsets_q, offsets_k, max_q, max_k,
        causal=causal, window=window, scale=scale, dropout_p=dropout, softcap=softcap, sinks=sinks,
        validate=validate,
    )
    return out.view(query.shape[0], query.shape[2], *out.shape[1:])


def longest(max_length, offsets: torch.Tensor) -> int:
    """`max_length_*` as a Python int (a tensor is read once); the longest document if absent."""
    if max_length is None:
        return int(offsets.diff().max()) if offsets.shape[0] > 1 else 0
    return max_length if isinstance(max_length, int) else int(max_length)


def use_decode(query, key, value, causal: bool, dropout: float, sinks: torch.Tensor | None = None) -> bool:
    """A few new tokens over a longer KV cache, inference only: `exattn.decode` serves it."""
    len_q, len_k = query.shape[2], key.shape[2]
    differentiating = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (query, key, value, sinks))
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
