"""DeepSpeed-Ulysses sequence parallelism: all-to-all from sequence shards to head shards and back.

Each of the W ranks of `group` holds a shard of the sequence with every head.
One all-to-all per tensor gives each rank the whole sequence for H/W heads;
local exattn attention (any backend, `attention` or `attention_varlen`) runs
on it; one all-to-all brings the output back to sequence shards:

    rank r: q[seq chunk r, all heads]  --all_to_all-->  q[all seq, head group r]
            local exattn on the full sequence, head group r
    rank r: out[seq chunk r, all heads] <--all_to_all--  out[all seq, head group r]

The backward pass runs the reverse all-to-alls (dout to head shards, dq, dk,
dv back to sequence shards) around the local backward. The sequence dimension
of the shards is contiguous: rank r holds positions [r N/W, (r+1) N/W).

GQA/MQA: with Hk % W != 0 the K/V heads are replicated R = W / gcd(Hk, W)
times before the exchange (query head h still reads its own K/V head), and the
gradients of the replicas are summed on the way back. Hq % W != 0 is refused.

Communication buffers: the send side of an all-to-all is one contiguous copy
(freed when the exchange is done); the receive side is laid out sequence-major
so the gathered tensor is a strided view of it, with no second copy. The way
back copies only where heads cannot be merged without one (batch > 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, overload

import torch
import torch.distributed as dist

from ..attention import attention as local_attention
from ..attention import explain_backend
from ..backends.autograd import no_gradients, returned_with_lse
from ..problem import (
    ScoreRules,
    check_qkv,
    check_scale,
    check_score_rules,
    check_softcap,
    check_window,
    compute_dtype,
)
from ..varlen import (
    attention_varlen,
    check_max_seqlen,
    check_offsets,
    explain_varlen_backend,
)
from .checks import agree, peer_failure
from .ledger import MemoryLedger, NullLedger, as_ledger, tensor_bytes
from ..problem import check_bool
from .ring import check_group
from .score_rules import (
    RuleTensor,
    SegmentIds,
    check_shard_rules,
    gather,
    head_group,
    rule_flags,
    ulysses_rules,
)


def exchange(send: torch.Tensor, group, what: str) -> torch.Tensor:
    """all_to_all_single over dim 0 (one equal chunk per rank), with a clear error if a peer fails."""
    recv = torch.empty_like(send)
    with peer_failure(f"{what}: rank {dist.get_rank(group)} of {dist.get_world_size(group)} could not finish "
                      "its all-to-all: a peer raised, died, or did not make the same call"):
        dist.all_to_all_single(recv, send, group=group)
    return recv


def to_heads(x: torch.Tensor, group, world: int, seq_dim: int, head_dim: int, ledger, name: str,
             what: str) -> torch.Tensor:
    """(.., n, .., H, ..) sequence shard -> (.., W n, .., H / W, ..) head shard: a view of the receive buffer."""
    xs = x.unflatten(head_dim, (world, x.shape[head_dim] // world))
    seq = seq_dim + (seq_dim > head_dim)
    others = [d for d in range(xs.dim()) if d not in (head_dim, seq)]
    send = xs.permute([head_dim, seq, *others]).contiguous()  # (W, n, rest): chunk w to rank w
    ledger.add(f"{name}.send", send)
    recv = exchange(send, group, what)
    del send
    ledger.free(f"{name}.send")
    ledger.add(name, recv)
    full = recv.flatten(0, 1)  # (W n, rest): rank w's chunk is the sequence's chunk w
    back = [0 if d == seq_dim else 1 + sum(1 for e in range(x.dim()) if e != seq_dim and e < d) for d in range(x.dim())]
    return full.permute(back)


def to_seq(y: torch.Tensor, group, world: int, seq_dim: int, head_dim: int, ledger, name: str,
           what: str) -> torch.Tensor:
    """(.., W n, .., h, ..) head shard -> (.., n, .., W h, ..) sequence shard (a copy only where heads
    cannot merge in place)."""
    ys = y.unflatten(seq_dim, (world, y.shape[seq_dim] // world))
    others = [d for d in range(ys.dim()) if d != seq_dim]
    send = ys.permute([seq_dim, *others]).contiguous()  # (W, y's dims with n): chunk w to rank w
    ledger.add(f"{name}.send", send)
    recv = exchange(send, group, what)
    del send
    ledger.free(f"{name}.send")
    ledger.add(f"{name}.recv", recv)
    out = recv.movedim(0, head_dim).flatten(head_dim, head_dim + 1)  # head group g from rank g
    copied = out.untyped_storage().data_ptr() != recv.untyped_storage().data_ptr()
    ledger.add(name, out if copied else 0)
    if copied:
        del recv
        ledger.free(f"{name}.recv")
    return out


def kv_replicas(heads_q: int, heads_k: int, world: int, what: str = "ulysses_attention") -> int:
    """How many times each K/V head is copied so that the W head groups split evenly (1: not at all)."""
    if heads_q % world:
        raise ValueError(
            f"{what} splits the {heads_q} query heads over the {world} ranks of the group: "
            f"the number of query heads must be a multiple of the group size"
        )
    return world // math.gcd(heads_k, world)


@dataclass
class UlyssesSpec:
    """The exchange and the local call of one Ulysses attention."""

    group: object
    world: int
    seq_dim: int
    head_dim: int
    lse_dims: tuple[int, int]  # (seq, head) of the lse
    local: Callable  # (q_h, k_h, v_h, **rules, sinks=) -> (out_h, lse_h)
    replicas: int
    ledger: MemoryLedger | NullLedger
    # The local backend's name, for the ledger's model of the local call (from `explain`, on the
    # gathered tensors), or "ring": the hybrid's ring, which records its own buffers under "ring.".
    explain: Callable | None
    what: str = "ulysses_attention"
    record_inputs: bool = True
    backend: str = ""
    rules: dict = field(default_factory=dict)  # the local call's score-rule keywords, sinks apart
    heads: slice = field(default_factory=lambda: slice(None))  # this rank's query heads (its part of the sinks)

    @property
    def prefix(self) -> str:
        return "ring." if self.backend == "ring" else "local."


def model_local_backward(ledger, spec: UlyssesSpec, leaves, out_h) -> None:
    """Record what the local backward allocates (single-device rules, `ledger.single_device_ledger`)."""
    acc = compute_dtype(out_h.dtype)
    rows = out_h.numel() // out_h.shape[-1]
    ledger.add("local.delta", tensor_bytes((rows,), acc))
    for name, x in zip(("dq", "dk", "dv"), leaves):
        if spec.backend == "triton" or acc == x.dtype:
            ledger.add(f"local.{name}", x)
        else:
            ledger.add(f"local.{name}_acc", tensor_bytes(x.shape, acc))
    if spec.backend != "triton" and acc != out_h.dtype:
        for name, x in zip(("dq", "dk", "dv"), leaves):
            ledger.add(f"local.{name}", x)
    ledger.step("ulysses local backward")
    ledger.free("local.delta")
    if spec.backend != "triton" and acc != out_h.dtype:
        ledger.free("local.dq_acc", "local.dk_acc", "local.dv_acc")


class UlyssesAttention(torch.autograd.Function):
    """All-to-all to head shards, local attention (its own autograd graph), all-to-all back.
    `sinks` (Hq,) or None: the local call takes this rank's heads of it; their gradients are gathered."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, spec: UlyssesSpec):
        ledger, world = spec.ledger, spec.world
        seq, head = spec.seq_dim, spec.head_dim
        if spec.record_inputs:
            for name, x in (("q", q), ("k", k), ("v", v)):
                ledger.add(name, x)
        if spec.replicas > 1:
            k, v = (x.repeat_interleave(spec.replicas, dim=head) for x in (k, v))
            ledger.add("k_replicated", k)
            ledger.add("v_replicated", v)
        heads = [to_heads(x, spec.group, world, seq, head, ledger, f"{n}_heads", spec.what)
                 for n, x in (("q", q), ("k", k), ("v", v))]
        if spec.replicas > 1:
            del k, v
            ledger.free("k_replicated", "v_replicated")
        leaves = [x.detach().requires_grad_() for x in heads]
        if sinks is not None:
            leaves.append(sinks.detach()[spec.heads].requires_grad_())
        rules = dict(spec.rules, sinks=leaves[3] if sinks is not None else None)
        if "segment_ids" in spec.rules:
            ledger.add("segment_ids", sum(tensor_bytes(x.shape, x.dtype) for x in set(spec.rules["segment_ids"])))
        if spec.explain is not None:
            spec.backend = spec.explain(*heads, **rules)
        with torch.enable_grad():
            out_h, lse_h = spec.local(*leaves[:3], **rules)
        if spec.backend != "ring":
            ledger.add("local.out", out_h)
            ledger.add("local.lse", lse_h)
        ledger.step("ulysses forward local")
        out = to_seq(out_h.detach(), spec.group, world, seq, head, ledger, "out", spec.what)
        lse = to_seq(lse_h.detach().float(), spec.group, world, *spec.lse_dims, ledger, "lse", spec.what)
        ledger.step("ulysses forward")
        ctx.graph = (leaves, out_h)
        ctx.spec = spec
        return returned_with_lse(ctx, out, lse)

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            ctx.graph = None
            return no_gradients(ctx)
        spec, ledger, world = ctx.spec, ctx.spec.ledger, ctx.spec.world
        seq, head = spec.seq_dim, spec.head_dim
        leaves, out_h = ctx.graph
        ctx.graph = None
        if spec.record_inputs:
            ledger.add("dout", dout)
        dout_h = to_heads(dout, spec.group, world, seq, head, ledger, "dout_heads", spec.what)
        if spec.backend != "ring":
            model_local_backward(ledger, spec, leaves[:3], out_h)
        grads = torch.autograd.grad(out_h, leaves, dout_h)
        del dout_h, out_h, leaves
        p = spec.prefix
        ledger.free("dout_heads", f"{p}out", f"{p}lse", "q_heads", "k_heads", "v_heads")
        if "segment_ids" in spec.rules:
            ledger.free("segment_ids")
        results = []
        for name, g in zip(("dq", "dk", "dv"), grads):
            r = to_seq(g, spec.group, world, seq, head, ledger, name if spec.replicas == 1 or name == "dq"
                       else f"{name}_replicated", spec.what)
            ledger.free(f"{p}{name}")
            if spec.replicas > 1 and name != "dq":
                r = r.unflatten(head, (r.shape[head] // spec.replicas, spec.replicas)).sum(head + 1)
                ledger.add(name, r)
                ledger.free(f"{name}_replicated")
            results.append(r)
        dsinks = torch.cat(gather(grads[3], spec.group, spec.what)) if len(grads) > 3 else None
        grads = None
        ledger.step("ulysses backward")
        return (*results, dsinks, None)


def check_no_dropout(kwargs: dict, what: str) -> None:
    if kwargs.get("dropout_p", 0.0):
        raise ValueError(
            f"{what} does not support dropout_p > 0: the keep-mask is keyed by the global head index, "
            "which a head shard does not see"
        )
    if kwargs.get("mask") is not None:
        raise ValueError(f"{what} takes no mask: an (N x N) mask cannot be sharded by heads and sequence")


@overload
def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
    window: tuple[int, int] | None = ..., scale: float | None = ..., group=...,
    return_lse: Literal[False] = ..., backend: str = ..., ledger: MemoryLedger | None = ...,
    validate: bool = ..., segment_ids: SegmentIds = ...,
    prefix: int | torch.Tensor | None = ..., softcap: float = ..., alibi_slopes: RuleTensor = ...,
    sinks: RuleTensor = ..., **local_kwargs,
) -> torch.Tensor: ...


@overload
def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
    window: tuple[int, int] | None = ..., scale: float | None = ..., group=...,
    return_lse: Literal[True], backend: str = ..., ledger: MemoryLedger | None = ...,
    validate: bool = ..., segment_ids: SegmentIds = ...,
    prefix: int | torch.Tensor | None = ..., softcap: float = ..., alibi_slopes: RuleTensor = ...,
    sinks: RuleTensor = ..., **local_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def ulysses_attention(q, k, v, *, causal=False, window=None, scale=None, group=None, return_lse=False,
                      backend="auto", ledger=None, validate=True, segment_ids=None, prefix=None, softcap=0.0,
                      alibi_slopes=None, sinks=None, **local_kwargs):
    """Exact attention over a sequence sharded across `group`, by all-to-all over heads (DeepSpeed-Ulysses).

    Every rank of `group` calls this with its contiguous shard of the sequence
    (`shard(x, rank, world, "contiguous")`):

    Args:
        q: (B, Hq, Nq / W, D), k: (B, Hk, Nk / W, D), v: (B, Hk, Nk / W, Dv) on this rank.
            Hq % W == 0; Hq % Hk == 0 (GQA/MQA; K/V heads are replicated when Hk % W != 0).
            Every rank passes the same shapes.
        causal, window, scale: as in `exattn.attention`, over the full sequences.
        group: the torch.distributed process group (None = the default group).
        return_lse: also return lse (B, Hq, Nq / W), natural log, float32.
        backend: the local attention's backend ("auto", "triton", "tiled", "naive").
        ledger: a `MemoryLedger` recording this rank's buffers (the local call modelled
            by the single-device rules).
        validate: check with one small all_gather that every rank passes the same shapes
            and the same score rules.
        segment_ids: int32 (B, Nq / W) and (B, Nk / W) as a pair, or one (B, N / W): this
            rank's shard of the ids (`shard(ids, rank, world, dim=1)`); all-gathered here.
        prefix, softcap: as in `exattn.attention` (prefix counts global positions).
        alibi_slopes: float32 (Hq,) or (B, Hq), sinks: float32 (Hq,), whole on every rank;
            each rank's local call takes its heads. The gradient of sinks is that of the
            whole attention, on every rank (gathered here: do not reduce it again).
        local_kwargs: further keywords of `exattn.attention` (block_m, block_n, ...).
            dropout_p > 0 and mask are refused (neither shards by heads).

    Returns:
        out (B, Hq, Nq / W, Dv) in q's dtype for this rank's positions, or (out, lse).
        Differentiable with respect to q, k, v and sinks.
    """
    return_lse = check_bool("return_lse", return_lse)
    rules = {"segment_ids": segment_ids, "prefix": prefix, "softcap": softcap, "alibi_slopes": alibi_slopes,
             "sinks": sinks}
    out, lse = ulysses_call(q, k, v, causal=causal, window=window, scale=scale, group=group, backend=backend,
                            ledger=ledger, validate=validate, local_kwargs=local_kwargs, rules=rules)
    return (out, lse) if return_lse else out


def ulysses_call(q, k, v, *, causal, window, scale, group, backend, ledger, validate, local_kwargs, rules,
                 local=None, record_inputs=True, what="ulysses_attention"):
    """Checked arguments -> (out, lse float32); `local` replaces exattn.attention (the hybrid's ring)."""
    check_qkv(q, k, v)
    causal = check_bool("causal", causal)
    window_pair = check_window(window, causal)
    scale = check_scale(scale, q.shape[3])
    check_group(group, what)
    check_no_dropout(local_kwargs, what)
    score_rules, softcap = check_shard_rules(what, q, k, **rules)
    world = dist.get_world_size(group)
    replicas = kv_replicas(q.shape[1], k.shape[1], world, what)
    if check_bool("validate", validate):
        agree(what, group, q.device, q_shape=q.shape, k_shape=k.shape, v_shape=v.shape, dtype=q.dtype,
              window=window_pair, scale=scale, score_rules=rule_flags(score_rules, softcap))
    heads = head_group(dist.get_rank(group), world, q.shape[1])
    explain = None
    if local is None:
        def local(q_h, k_h, v_h, **head_rules):
            return local_attention(q_h, k_h, v_h, causal=causal, window=window, scale=scale, backend=backend,
                                   return_lse=True, **head_rules, **local_kwargs)

        def explain(q_h, k_h, v_h, **head_rules):
            return explain_backend(q_h, k_h, v_h, causal=causal, window=window, scale=scale, backend=backend,
                                   **head_rules).name
    spec = UlyssesSpec(group, world, 2, 1, (2, 1), local, replicas, as_ledger(ledger), explain, what,
                       record_inputs, backend="ring" if explain is None else "",
                       rules=ulysses_rules(score_rules, softcap, heads, group, what), heads=heads)
    return UlyssesAttention.apply(q, k, v, None if score_rules is None else score_rules.sinks, spec)


def check_varlen_rules(what, q, cu_seqlens_q, max_seqlen_q, max_seqlen_k, local_kwargs, *, prefix, softcap,
                       alibi_slopes, sinks) -> tuple[ScoreRules | None, float]:
    """The rules of a packed batch: prefix (B,), slopes (B, Hq), sinks (Hq,), softcap; no segment ids."""
    if local_kwargs.get("segment_ids") is not None:
        raise ValueError(
            f"{what} does not take segment_ids: cu_seqlens already keeps the packed sequences apart "
            "(as in exattn.attention_varlen)"
        )
    batch = check_offsets("cu_seqlens_q", cu_seqlens_q, q).shape[0] - 1
    try:
        rules = check_score_rules(batch=batch, heads_q=q.shape[1], len_q=check_max_seqlen("max_seqlen_q", max_seqlen_q),
                                  len_k=check_max_seqlen("max_seqlen_k", max_seqlen_k), device=q.device,
                                  dtype=q.dtype, prefix=prefix, alibi_slopes=alibi_slopes, sinks=sinks)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    return rules, check_softcap(softcap)


def ulysses_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                             causal=False, window=None, scale=None, group=None, return_lse=False,
                             backend="auto", ledger=None, validate=True, prefix=None, softcap=0.0,
                             alibi_slopes=None, sinks=None, **local_kwargs):
    """Ulysses over a packed variable-length batch (token-major, as `exattn.attention_varlen`).

    Args:
        q: (total_q / W, Hq, D), k: (total_k / W, Hk, D), v: (total_k / W, Hk, Dv): this rank's
            contiguous part of the packed tokens (`shard(x, rank, world, dim=0)`); a sequence may
            straddle ranks. Hq % W == 0.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: of the whole packed batch, the
            same on every rank (as `exattn.attention_varlen` takes them).
        prefix, softcap, alibi_slopes, sinks: as `exattn.attention_varlen` takes them, whole on
            every rank (prefix and slopes per sequence (B,) / (B, Hq)); as in `ulysses_attention`,
            each rank's local call takes its heads of the slopes and sinks. No segment ids.
        the rest: as `ulysses_attention`.

    Returns:
        out (total_q / W, Hq, Dv), and with return_lse lse (Hq, total_q / W) float32.
        Differentiable with respect to q, k, v and sinks.
    """
    what = "ulysses_attention_varlen"
    return_lse = check_bool("return_lse", return_lse)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a 3-dim (tokens, heads, dim) tensor shard")
    causal = check_bool("causal", causal)
    window_pair = check_window(window, causal)
    scale = check_scale(scale, q.shape[2])
    check_group(group, what)
    check_no_dropout(local_kwargs, what)
    score_rules, softcap = check_varlen_rules(what, q, cu_seqlens_q, max_seqlen_q, max_seqlen_k, local_kwargs,
                                              prefix=prefix, softcap=softcap, alibi_slopes=alibi_slopes,
                                              sinks=sinks)
    world = dist.get_world_size(group)
    replicas = kv_replicas(q.shape[1], k.shape[1], world, what)
    if check_bool("validate", validate):
        agree(what, group, q.device, q_shape=q.shape, k_shape=k.shape, v_shape=v.shape,
              dtype=q.dtype, window=window_pair, scale=scale, lengths=(max_seqlen_q, max_seqlen_k),
              cu_seqlens=tuple(cu_seqlens_q.tolist()) + tuple(cu_seqlens_k.tolist()),
              score_rules=rule_flags(score_rules, softcap))
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

    def local(q_h, k_h, v_h, **head_rules):
        return attention_varlen(q_h, k_h, v_h, *lengths, causal=causal, window=window, scale=scale,
                                backend=backend, return_lse=True, **head_rules, **local_kwargs)

    def explain(q_h, k_h, v_h, **head_rules):
        return explain_varlen_backend(q_h, k_h, v_h, *lengths, causal=causal, window=window, scale=scale,
                                      backend=backend, **head_rules).name

    heads = head_group(dist.get_rank(group), world, q.shape[1])
    spec = UlyssesSpec(group, world, 0, 1, (1, 0), local, replicas, as_ledger(ledger), explain, what,
                       rules=ulysses_rules(score_rules, softcap, heads, group, what), heads=heads)
    out, lse = UlyssesAttention.apply(q, k, v, None if score_rules is None else score_rules.sinks, spec)
    return (out, lse) if return_lse else out
