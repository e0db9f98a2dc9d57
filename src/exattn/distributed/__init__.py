"""Attention over a sequence sharded across processes (torch.distributed).

    ring_attention(q, k, v, *, causal, scale, group, layout, return_lse)
    shard(x, rank, world, layout, dim=2)     # full tensor -> this rank's part
    unshard(shards, layout, dim=2)           # every rank's part -> full tensor

See docs/distributed.md for running under torchrun.
"""

from .layout import LAYOUTS, shard, unshard
from .ring import RingComm, ring_attention

__all__ = ["LAYOUTS", "RingComm", "ring_attention", "shard", "unshard"]
