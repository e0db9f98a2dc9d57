"""Attention over a sequence sharded across processes (torch.distributed).

    ring_attention(q, k, v, *, causal, window, scale, group, layout, return_lse, pieces, ledger, <rules>)
    ring_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, ...)
    ulysses_attention(q, k, v, *, causal, window, scale, group, return_lse, backend, ledger, <rules>)
    ulysses_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, ...)
    sequence_parallel_attention(q, k, v, *, mesh, causal, window, scale, layout, return_lse, ledger, <rules>)
    shard(x, rank, world, layout, dim=2)     # full tensor -> this rank's part
    unshard(shards, layout, dim=2)           # every rank's part -> full tensor
    mesh_shard(x, mesh, layout, dim=2)       # full tensor -> this process's part of a 2-D mesh
    MemoryLedger, single_device_ledger       # per-rank memory accounting

<rules>: segment_ids, prefix, softcap, alibi_slopes, sinks, as `exattn.attention` takes them
(`score_rules.py` says how each crosses the shards; the ring refuses alibi_slopes).
See docs/distributed.md for choosing a strategy and running under torchrun.
"""

from .hybrid import mesh_shard, sequence_parallel_attention
from .layout import LAYOUTS, shard, unshard
from .ledger import MemoryLedger, single_device_ledger
from .ring import RingComm, ring_attention
from .ring_varlen import ring_attention_varlen
from .ulysses import ulysses_attention, ulysses_attention_varlen

__all__ = [
    "LAYOUTS",
    "MemoryLedger",
    "RingComm",
    "mesh_shard",
    "ring_attention",
    "ring_attention_varlen",
    "sequence_parallel_attention",
    "shard",
    "single_device_ledger",
    "ulysses_attention",
    "ulysses_attention_varlen",
    "unshard",
]
