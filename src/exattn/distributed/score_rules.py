"""The score rules (segment ids, prefix, softcap, ALiBi slopes, sinks) over sharded sequences.

Every rank passes the rules the way it passes q and k: a sequence-indexed rule
(segment ids) as its own shard, a head-indexed one (slopes, sinks) whole.
How each reaches the local calls:

    rule          Ulysses (whole sequence, a group of heads)   ring (a shard of the sequence, all heads)
    segment_ids   all-gathered to the full sequence            every shard all-gathered once; a step reads
                                                               its own rows' ids and the visiting keys' ids
    prefix        as given (it counts global positions)        planned: one full call over the visiting keys
                                                               before the prefix, the band over the rest
    softcap       as given                                     as given, in every step
    alibi_slopes  this rank's heads                            refused: a step's local call sees shard
                                                               positions, not the global distance i - j
    sinks         this rank's heads; their gradients           the initial state of the merge (the sink joins
                  all-gathered                                 once); the gradient summed over the ranks

So every rank ends with the gradient of all of `sinks`, that of the whole
attention (the loss summed over the ranks): do not reduce it again over the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..problem import ScoreRules, check_score_rules, check_softcap
from .checks import peer_failure

RuleTensor = torch.Tensor | None
SegmentIds = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None


def check_shard_rules(what: str, q: torch.Tensor, k: torch.Tensor, *, segment_ids=None, prefix=None,
                      softcap=0.0, alibi_slopes=None, sinks=None) -> tuple[ScoreRules | None, float]:
    """The rules of this rank's shards q (B, Hq, n_q, D), k (B, Hk, n_k, D), checked: segment ids of
    the shard's lengths, prefix (B,), slopes (B, Hq), sinks (Hq,); and softcap."""
    try:
        rules = check_score_rules(batch=q.shape[0], heads_q=q.shape[1], len_q=q.shape[2], len_k=k.shape[2],
                                  device=q.device, dtype=q.dtype, segment_ids=segment_ids, prefix=prefix,
                                  alibi_slopes=alibi_slopes, sinks=sinks)
    except ValueError as exc:
        hint = ("; every rank passes the segment ids of its own shard, cut like q and k"
                if str(exc).startswith("segment_ids") else "")
        raise ValueError(f"{what}: {exc}{hint}") from None
    return rules, check_softcap(softcap)


def refuse_alibi(what: str, alibi_slopes: object) -> None:
    if alibi_slopes is not None:
        raise ValueError(
            f"{what} does not take alibi_slopes: the ring's local calls see positions within shards, not "
            "the global distance i - j the slopes multiply; use ulysses_attention (or a mesh with one ring "
            "rank), whose local call holds the whole sequence"
        )


def rule_flags(rules: ScoreRules | None, softcap: float) -> tuple:
    """What every rank must agree on: which rules are on, and the softcap."""
    on = [] if rules is None else rules.in_use()
    return (*(name in on for name in ("segment_ids", "prefix", "alibi_slopes", "sinks")), softcap)


def head_group(rank: int, world: int, heads: int) -> slice:
    """The query heads rank `rank` holds after Ulysses's all-to-all: group `rank` of `world` equal groups."""
    size = heads // world
    return slice(rank * size, (rank + 1) * size)


def gather(x: torch.Tensor, group, what: str) -> list[torch.Tensor]:
    """Every rank's `x` (the same shape on every rank), in rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return [x]
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    with peer_failure(f"{what}: rank {dist.get_rank(group)} of {dist.get_world_size(group)} could not gather "
                      "the score rules: a peer raised, died, or did not make the same call"):
        dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def sum_over(x: torch.Tensor, group, what: str) -> torch.Tensor:
    """`x` summed over the ranks of `group`, in place."""
    if dist.get_world_size(group) > 1:
        with peer_failure(f"{what}: rank {dist.get_rank(group)} could not sum the sinks' gradient: a peer "
                          "raised, died, or did not make the same call"):
            dist.all_reduce(x, group=group)
    return x


def ulysses_rules(rules: ScoreRules | None, softcap: float, heads: slice, group, what: str) -> dict:
    """The keywords of the local call on the whole sequence and the heads `heads` (sinks apart):
    segment ids all-gathered over `group` (contiguous shards), slopes cut to the heads."""
    local = {"softcap": softcap}
    if rules is None:
        return local
    if rules.q_segment_ids is not None:
        q_ids = torch.cat(gather(rules.q_segment_ids, group, what), dim=1)
        same = rules.k_segment_ids is rules.q_segment_ids
        k_ids = q_ids if same else torch.cat(gather(rules.k_segment_ids, group, what), dim=1)
        local["segment_ids"] = (q_ids, k_ids)
    if rules.prefix is not None:
        local["prefix"] = rules.prefix
    if rules.alibi_slopes is not None:
        local["alibi_slopes"] = rules.alibi_slopes[:, heads].contiguous()
    return local
