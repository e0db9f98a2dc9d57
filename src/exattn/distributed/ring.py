"""Exact ring attention over torch.distributed, forward and backward.

Every rank keeps its queries. K/V blocks travel the ring (rank r sends to
r+1, receives from r-1), so in step i rank r holds the keys of rank r-i.
The next block's send/recv is posted before the current block is computed,
so communication overlaps compute. Each step runs exattn's own local
attention ("triton" on GPUs, "tiled" elsewhere) on the calls `blocks.step_blocks`
plans, and its `(out, lse)` is merged into a running summary with the
merge algebra in float32 (float64 for float64 inputs); a step with no
allowed key contributes nothing, the identity.

Backward: K/V travel the ring again, together with float32 (float64)
accumulators of dK/dV, which arrive back at their owners one step after the
last block. Every step's local backward uses the global out and lse, so
`delta = rowsum(dO * O)` is that of the full attention and the block
gradients simply add up: the local backward adds them straight into the
float32 dQ and dK/dV accumulators (`accumulate_into`).

Memory per rank, in units of one (B, H, N/W, D) tensor in the input dtype,
beyond the caller's q, k, v, dout, out and the returned grads: the received
K/V block (2; from W = 3 also the next one, 2 more), float32 dQ (2) and
dK/dV (4), and a staging piece of 1/ROTATE_PIECES of dK/dV while the
accumulators move one rank on (`rotate`, which does not overlap compute).
Local calls take views of the shards, never copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, overload

import torch
import torch.distributed as dist

from ..algebra import BlockSummary, as_summary, empty_summary, finalize_, merge_
from ..backends import get_backend
from ..problem import AttentionParams, check_qkv, check_scale, compute_dtype, make_problem
from .blocks import Block, step_blocks
from .layout import check_layout, segments


class RingComm:
    """Send tensors to the next rank and receive as many from the previous one, asynchronously.

    `post(tensors, into=None)` starts the exchange, receiving into new tensors or
    into `into`; `wait()` returns the received tensors. A world of one sends to
    itself: `wait()` returns what was posted.
    """

    def __init__(self, group, tag: int = 0):
        self.group = group
        self.world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.next, self.prev = (rank + 1) % self.world, (rank - 1) % self.world
        self.tag = tag
        self.pending: tuple[list[torch.Tensor], list, list[torch.Tensor]] | None = None

    def post(self, tensors, into=None) -> None:
        tensors = [t.contiguous() for t in tensors]
        if self.world == 1:
            self.pending = (tensors, [], tensors)
            return
        received = [torch.empty_like(t) for t in tensors] if into is None else list(into)
        ops = [
            dist.P2POp(dist.isend, t, group=self.group, tag=self.tag + i, group_peer=self.next)
            for i, t in enumerate(tensors)
        ] + [
            dist.P2POp(dist.irecv, t, group=self.group, tag=self.tag + i, group_peer=self.prev)
            for i, t in enumerate(received)
        ]
        self.pending = (received, dist.batch_isend_irecv(ops), tensors)

    def wait(self) -> list[torch.Tensor]:
        received, requests, _sent = self.pending
        for request in requests:
            request.wait()
        self.pending = None
        return received


@dataclass
class RingPlan:
    """Everything the passes need: the group, the local backend, and each step's calls."""

    group: object
    world: int
    backend: object
    dtype: torch.dtype
    steps: list[list[tuple[Block, AttentionParams]]]


def local_backend_name(q, k, v, causal: bool, scale: float) -> str:
    """ "triton" when it can serve this rank's shard on a GPU, else "tiled"."""
    if q.is_cuda:
        problem = make_problem(q, k, v, causal=causal, scale=scale)
        if not get_backend("triton").not_supported_reasons(problem):
            return "triton"
    return "tiled"


def make_plan(q, k, v, causal: bool, scale: float, layout: str, group) -> RingPlan:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("group does not contain this process; call ring_attention only on its members")
    len_q, len_k = q.shape[2] * world, k.shape[2] * world
    q_segs = segments(rank, world, len_q, layout)
    offset = len_k - len_q if causal else None
    steps = []
    for step in range(world):
        k_segs = segments((rank - step) % world, world, len_k, layout)
        blocks = step_blocks(q_segs, k_segs, offset)
        steps.append([(b, AttentionParams(scale=scale, window=b.window)) for b in blocks])
    backend = get_backend(local_backend_name(q, k, v, causal, scale))
    return RingPlan(group, world, backend, compute_dtype(q.dtype), steps)


# dK/dV move one rank on in this many pieces, through one staging piece.
ROTATE_PIECES = 16


def part(x: torch.Tensor, s: slice) -> torch.Tensor:
    """Sequence slice of a (B, H, N, ...) tensor: a view (both local backends take any strides)."""
    return x[:, :, s]


def rotate(comm: RingComm, tensors: list[torch.Tensor], pieces: int = ROTATE_PIECES) -> None:
    """Send `tensors` (contiguous) to the next rank and overwrite them with the previous rank's, in place.

    Piece by piece through one staging buffer of 1/pieces of each tensor, so
    only that much memory is added, never a second copy of the tensors.
    """
    if comm.world == 1:
        return
    chunked = [t.view(-1).chunk(pieces) for t in tensors]
    staging = [torch.empty_like(c[0]) for c in chunked]
    for piece in zip(*chunked):
        comm.post(piece, into=[s[: p.numel()] for s, p in zip(staging, piece)])
        for p, received in zip(piece, comm.wait()):
            p.copy_(received)


def ring_forward(q, k, v, plan: RingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, Hq, n, Dv) in q's dtype and lse (B, Hq, n) in the compute dtype, for this rank's queries."""
    comm = RingComm(plan.group, tag=0)
    state = empty_summary(q.shape[:3], v.shape[3], plan.dtype, q.device)
    kv = (k, v)
    for step, calls in enumerate(plan.steps):
        if step + 1 < plan.world:
            comm.post(kv)
        for block, params in calls:
            out, lse = plan.backend.forward(
                part(q, block.rows), part(kv[0], block.cols), part(kv[1], block.cols), None, params
            )
            rows = BlockSummary(*(part(x, block.rows) for x in state))
            merge_(rows, as_summary(out, lse, plan.dtype))
            del out, lse
        if step + 1 < plan.world:
            kv = comm.wait()
    del kv
    out, lse = finalize_(state)
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, plan: RingPlan):
    """dq, dk, dv for this rank's shards; dK/dV accumulate in the compute dtype while they travel.

    The local backward adds every step straight into float32 (float64) dQ and dK/dV.
    Between steps, dK/dV move one rank on (`rotate`); the last move brings them home.
    """
    kv_comm, grad_comm = RingComm(plan.group, tag=0), RingComm(plan.group, tag=2)
    dq = torch.zeros(q.shape, dtype=plan.dtype, device=q.device)
    dkv = [torch.zeros(k.shape, dtype=plan.dtype, device=k.device),
           torch.zeros(v.shape, dtype=plan.dtype, device=v.device)]
    kv = (k, v)
    for step, calls in enumerate(plan.steps):
        if step > 0:
            rotate(grad_comm, dkv)  # first: queued behind the next K/V block, it would wait for it
        if step + 1 < plan.world:
            kv_comm.post(kv)
        for block, params in calls:
            r, c = block.rows, block.cols
            plan.backend.backward(
                part(dout, r), part(q, r), part(kv[0], c), part(kv[1], c), None, part(out, r),
                part(lse, r), params, accumulate_into=(part(dq, r), part(dkv[0], c), part(dkv[1], c)),
            )
        if step + 1 < plan.world:
            kv = kv_comm.wait()
    del kv
    rotate(grad_comm, dkv)
    dq = dq.to(q.dtype)  # each float32 buffer goes before the next conversion allocates
    dk = dkv.pop(0).to(k.dtype)
    dv = dkv.pop(0).to(v.dtype)
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    """Autograd over the ring: saves q, k, v, the global out and lse; no N x N tensor."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan):
        out, lse = ring_forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.plan)
        return dq, dk, dv, None


def check_group(group: object) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ring_attention needs torch.distributed: call torch.distributed.init_process_group "
            "(gloo on CPU, nccl on GPUs) first, e.g. under torchrun"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")


def check_zigzag_lengths(layout: str, **tensors: torch.Tensor) -> None:
    if layout != "zigzag":
        return
    for name, x in tensors.items():
        if x.shape[2] % 2:
            raise ValueError(
                f"{name} holds {x.shape[2]} positions on this rank, but layout 'zigzag' holds two "
                "equal chunks per rank: the per-rank length must be even (the full length a "
                "multiple of 2 * world)"
            )


@overload
def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
    scale: float | None = ..., group=..., layout: str = ..., return_lse: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
    scale: float | None = ..., group=..., layout: str = ..., return_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def ring_attention(q, k, v, *, causal=False, scale=None, group=None, layout="contiguous", return_lse=False):
    """Exact attention over a sequence sharded across the ranks of `group`.

    Every rank of `group` calls this with its own shard (`shard(x, rank, world, layout)`):

    Args:
        q: (B, Hq, Nq / W, D), k: (B, Hk, Nk / W, D), v: (B, Hk, Nk / W, Dv) on this
            rank; Hq % Hk == 0 (GQA/MQA). Every rank passes the same shapes.
        causal: bottom-right aligned over the full sequences, as in `exattn.attention`:
            global query i sees global key j iff j <= i + Nk - Nq.
        scale: score scale, default D ** -0.5.
        group: the torch.distributed process group (None = the default group);
            gloo for CPU tensors, nccl for CUDA tensors.
        layout: "contiguous" (rank r holds positions [r N/W, (r+1) N/W)) or "zigzag"
            (2W chunks, rank r holds chunks r and 2W-1-r: balanced causal work).
        return_lse: also return lse (B, Hq, Nq / W), natural log, float32.

    Returns:
        out (B, Hq, Nq / W, Dv) in q's dtype for this rank's queries, or (out, lse).
        Differentiable with respect to q, k, v (each rank gets its shards' gradients).
    """
    check_qkv(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    scale = check_scale(scale, q.shape[3])
    layout = check_layout(layout)
    check_zigzag_lengths(layout, q=q, k=k)
    check_group(group)
    plan = make_plan(q, k, v, causal, scale, layout, group)
    out, lse = RingAttention.apply(q, k, v, plan)
    if not return_lse:
        return out
    return out, lse.to(torch.float32)
