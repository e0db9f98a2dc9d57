"""Ring attention over a packed batch of variable-length sequences (token-major, as `attention_varlen`).

Packed self-attention (`cu_seqlens_q == cu_seqlens_k`) is the ring's dense
problem on the packed tokens, `(1, H, total, D)`, with each token's sequence
index as its segment id. A sequence's causal and window rules are then the
global ones (its query and key offsets agree), and no query attends a key of
another sequence. The ids are sorted along each shard, so the kernels skip the
tiles that pair two sequences.

    packed tokens    A A A A A | B B B | C C C C      cu_seqlens = [0, 5, 8, 12]
    contiguous, W=2  rank 0: A A A A A B              rank 1: B B C C C C
    zigzag, W=2      rank 0: A A A C C C (chunks 0, 3)  rank 1: A A B B B C (chunks 1, 2)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..varlen import (
    check_max_seqlen,
    check_offset_values,
    check_offsets,
    offsets_to_host,
)
from .checks import agree
from .layout import check_layout, segments
from ..problem import check_bool
from .ring import check_group, check_zigzag_lengths, ring_call
from .score_rules import refuse_alibi

WHAT = "ring_attention_varlen"


def check_packed(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 3-dim (tokens, heads, dim) tensor shard, got {shape}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(
            f"{WHAT} takes packed self-attention (cu_seqlens_q == cu_seqlens_k): q and k hold the same "
            f"tokens, but this rank's q has {q.shape[0]} and k has {k.shape[0]}"
        )


def check_refused(prefix: object, alibi_slopes: object) -> None:
    if prefix is not None:
        raise ValueError(
            f"{WHAT} does not take prefix: each sequence's prefix starts at its own offset, and the ring "
            "plans one prefix over the packed tokens; use ulysses_attention_varlen"
        )
    refuse_alibi(WHAT, alibi_slopes)


def check_offset_pair(cu_q, cu_k, total: int, max_q, max_k, validate: bool, group) -> None:
    """The offsets as `attention_varlen` checks them; with `validate`, also that they are equal, and
    the same on every rank."""
    max_q, max_k = check_max_seqlen("max_seqlen_q", max_q), check_max_seqlen("max_seqlen_k", max_k)
    if not validate:
        return
    host_q, host_k = offsets_to_host(cu_q), offsets_to_host(cu_k)
    check_offset_values("cu_seqlens_q", host_q, total, "total_q", max_q, "max_seqlen_q")
    check_offset_values("cu_seqlens_k", host_k, total, "total_k", max_k, "max_seqlen_k")
    if host_q != host_k:
        raise ValueError(
            f"{WHAT} takes packed self-attention: cu_seqlens_q must equal cu_seqlens_k, got {host_q} "
            f"and {host_k}"
        )
    agree(WHAT, group, cu_q.device, cu_seqlens=host_q)


def sequence_ids(cu_seqlens: torch.Tensor, rank: int, world: int, length: int, layout: str) -> torch.Tensor:
    """int32 (1, length / world): the sequence of each packed token this rank holds."""
    positions = torch.cat([torch.arange(s.start, s.start + s.length, device=cu_seqlens.device)
                           for s in segments(rank, world, length, layout)])
    return torch.searchsorted(cu_seqlens[1:], positions.to(cu_seqlens.dtype), right=True).to(torch.int32)[None]


def dense(x: torch.Tensor) -> torch.Tensor:
    """(tokens, H, d) -> (1, H, tokens, d), a view."""
    return x.transpose(0, 1).unsqueeze(0)


def ring_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                          window=None, scale=None, group=None, layout="contiguous", return_lse=False, pieces=None,
                          ledger=None, validate=True, softcap=0.0, sinks=None, prefix=None, alibi_slopes=None):
    """Exact ring attention over a packed batch of sequences sharded across the ranks of `group`.

    Args:
        q: (total / W, Hq, D), k: (total / W, Hk, D), v: (total / W, Hk, Dv): this rank's part of
            the packed tokens (`shard(x, rank, world, layout, dim=0)`); a sequence may straddle
            ranks. Hq % Hk == 0.
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,) of the whole packed batch, equal (packed
            self-attention), the same on every rank. max_seqlen_q, max_seqlen_k: Python ints,
            at least the longest sequence (checked, as `exattn.attention_varlen` does).
        causal, window, scale, softcap, sinks: as in `exattn.attention_varlen`, per sequence.
        group, layout, return_lse, pieces, ledger: as in `ring_attention`.
        validate: check the offsets' values (a host sync) and, with one small all_gather,
            that every rank passes the same shapes and rules.
        prefix, alibi_slopes: refused (ValueError): both count positions within a sequence,
            which the ring's plan over the packed tokens does not see.

    Returns:
        out (total / W, Hq, Dv) in q's dtype (a view of the ring's (1, Hq, total / W, Dv)), and
        with return_lse lse (Hq, total / W) float32. Differentiable in q, k, v and sinks.
    """
    return_lse = check_bool("return_lse", return_lse)
    validate = check_bool("validate", validate)
    check_packed(q, k, v)
    check_refused(prefix, alibi_slopes)
    layout = check_layout(layout)
    check_zigzag_lengths(layout, q=dense(q), k=dense(k))
    check_group(group, WHAT)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cu_q, cu_k = check_offsets("cu_seqlens_q", cu_seqlens_q, q), check_offsets("cu_seqlens_k", cu_seqlens_k, q)
    check_offset_pair(cu_q, cu_k, q.shape[0] * world, max_seqlen_q, max_seqlen_k, validate, group)
    ids = sequence_ids(cu_q, rank, world, q.shape[0] * world, layout)
    out, lse = ring_call(dense(q), dense(k), dense(v), causal=causal, window=window, scale=scale, group=group,
                         layout=layout, pieces=pieces, ledger=ledger, validate=validate, what=WHAT,
                         segment_ids=ids, softcap=softcap, sinks=sinks)
    out = out[0].transpose(0, 1)
    return (out, lse[0].to(torch.float32)) if return_lse else out
