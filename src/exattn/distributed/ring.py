"""Exact ring attention over torch.distributed, forward and backward, in a bounded memory.

Every rank keeps its queries. K/V travel the ring (rank r sends to r+1,
receives from r-1), so in step i rank r holds the keys of rank r-i. The
passes cut every rank's keys into `pieces` column pieces (for zigzag, piece j
takes part j of each of the two chunks, so every piece carries the same
causal work) and run one ring per piece. The next step's send/recv is posted
before the current piece is computed, so communication overlaps compute; two
piece-sized K/V buffers alternate, reused by every step and piece.

Forward: each step runs exattn's own local attention ("triton" on GPUs,
"tiled" elsewhere) on the calls `blocks.step_blocks` plans; its `(out, lse)`
is merged into a running summary with the merge algebra (`algebra.merge_`)
in float32 (float64 for float64 inputs). A step with no allowed key
contributes nothing, the identity.

Backward: the K/V pieces travel the ring again, followed by float32
(float64) accumulators of their dK/dV, which move one rank on after every
step (`rotate`, in place) and arrive back at their owner one step after the
last; then they are cast into the returned dk, dv. Every step's local backward
uses the global out and lse, so `delta = rowsum(dO * O)` is that of the full
attention and the block gradients simply add up: the local backward adds them
straight into the float32 dQ and dK/dV accumulators (`accumulate_into`).

Score rules (`score_rules.py`): softcap applies in every call; segment ids are
sliced per call from this rank's query ids and the visiting shard's key ids (all
ranks' key ids are all-gathered once); a prefix is planned (`blocks.prefix_step_blocks`,
per run of batch entries with one prefix); the sink starts the running summary,
and its gradient is summed over the ring. ALiBi is refused.

What stays in float32 and why (the exactness argument): the running summary of
the forward (the output is a sum of W*pieces rescaled partial outputs), dQ (a
sum over every key of the sequence, W*pieces calls) and the travelling dK/dV
(a sum over every query, W calls): each is rounded to the input dtype once, at
the end, as on one device. Nothing else is: each step's partial output is
merged in its own dtype (merge_ promotes), and K/V travel as they are.

Memory per rank, in units of one (B, H, N/W, D) tensor in the input dtype
(bf16), with P backward pieces: the caller's q, k, v, dout, out (5), the
returned dk, dv (2, written as the pieces come home), float32 dQ (2, in four
row chunks that are cast one at a time at the end), K/V pieces (2 x 2/P) and
the dK/dV piece (4/P): 9 + 8/P, against 8 for one device at the per-rank
length (`ledger.single_device_ledger`). Every buffer is recorded in an optional
`MemoryLedger`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Literal, overload

import torch
import torch.distributed as dist

from ..algebra import NEG_INF, BlockSummary, empty_summary, finalize_, merge_
from ..backends import get_backend
from ..backends.autograd import no_gradients, returned_with_lse, row_delta
from ..masks import sinks_grad
from ..problem import (
    AttentionParams,
    ScoreRules,
    check_bool,
    check_qkv,
    check_scale,
    check_window,
    compute_dtype,
    make_problem,
)
from .blocks import FULL, Block, band_block, global_band, prefix_step_blocks
from .checks import agree, peer_failure
from .layout import LAYOUTS, Segment, check_layout, segments
from .ledger import MemoryLedger, NullLedger, Prefixed, as_ledger, nbytes
from .score_rules import (
    RuleTensor,
    SegmentIds,
    check_shard_rules,
    gather,
    refuse_alibi,
    rule_flags,
    sum_over,
)


class RingComm:
    """Send tensors to the next rank and receive as many from the previous one, asynchronously.

    `post(tensors, into=None)` starts the exchange, receiving into new tensors or
    into `into`; `wait()` returns the received tensors. A world of one sends to
    itself: `wait()` returns what was posted. A peer that fails, dies or never
    makes the matching call makes `wait()` raise a RuntimeError that says so,
    within the process group's timeout.
    """

    def __init__(self, group, tag: int = 0, what: str = "ring_attention"):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next, self.prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        self.tag = tag
        self.what = what
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

    def wait(self, where: str = "") -> list[torch.Tensor]:
        received, requests, _sent = self.pending
        self.pending = None
        with peer_failure(
            f"{self.what}: rank {self.rank} of a ring of {self.world} could not exchange blocks with "
            f"rank {self.prev} / {self.next}{' ' + where if where else ''}: a peer raised, died, or did "
            "not make the same call (every rank must call the ring the same number of times, forward "
            "and backward)"
        ):
            for request in requests:
                request.wait()
        return received


# Default column pieces per rank's keys: forward, backward; never below MIN_PIECE columns a segment.
FORWARD_PIECES = 2
BACKWARD_PIECES = 16
MIN_PIECE = 32
# dQ accumulates in this many row chunks when it is cast at the end (input dtype != float32).
DQ_CHUNKS = 4
# dK/dV move one rank on in this many pieces, through one staging piece.
ROTATE_PIECES = 16


def default_pieces(segment_length: int) -> tuple[int, int]:
    """(forward, backward) column pieces for a key segment of this length: as many as the defaults ask,
    each at least MIN_PIECE columns (one piece below that). A pure function of the shape."""
    most = max(1, segment_length // MIN_PIECE)
    return min(FORWARD_PIECES, most), min(BACKWARD_PIECES, most)


def check_pieces(pieces: object, segment_length: int) -> tuple[int, int]:
    if pieces is None:
        return default_pieces(segment_length)
    if (not isinstance(pieces, (tuple, list)) or len(pieces) != 2
            or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 1 for p in pieces)):
        raise ValueError(f"pieces must be None or a pair (forward, backward) of ints >= 1, got {pieces!r}")
    return min(pieces[0], max(1, segment_length)), min(pieces[1], max(1, segment_length))


@dataclass
class Piece:
    """Part of every rank's keys: `cols` (shard-local slices, packed in this order) and, per step,
    the local calls."""

    cols: list[slice]
    length: int
    steps: list[list[tuple[Block, AttentionParams]]] = field(default_factory=list)


@dataclass
class RingRules:
    """The score rules the passes read (prefix and softcap are planned into the calls):
    this rank's query ids (B, n_q), every rank's key ids [(B, n_k)] in rank order, the sinks (Hq,)."""

    q_ids: torch.Tensor | None = None
    k_ids: list[torch.Tensor] | None = None
    sinks: torch.Tensor | None = None


@dataclass
class RingPlan:
    """Everything the passes need: the group, the local backend, each pass's pieces and calls."""

    group: object
    world: int
    rank: int
    backend: object
    dtype: torch.dtype
    forward_pieces: list[Piece]
    backward_pieces: list[Piece]
    ledger: MemoryLedger | NullLedger
    record_inputs: bool = True
    rules: RingRules = field(default_factory=RingRules)
    what: str = "ring_attention"


def local_backend_name(q, k, v, causal: bool, scale: float) -> str:
    """ "triton" when it can serve this rank's shard on a GPU, else "tiled"."""
    if q.is_cuda:
        problem = make_problem(q, k, v, causal=causal, scale=scale)
        if not get_backend("triton").not_supported_reasons(problem):
            return "triton"
    return "tiled"


def cut(segs: list[Segment], j: int, count: int) -> tuple[list[Segment], list[slice]]:
    """Part j of `count` of each segment, packed: the packed segments and their shard-local slices."""
    packed, cols, at = [], [], 0
    for s in segs:
        lo, hi = s.length * j // count, s.length * (j + 1) // count
        if hi > lo:
            packed.append(Segment(at, s.start + lo, hi - lo))
            cols.append(slice(s.local + lo, s.local + hi))
            at += hi - lo
    return packed, cols


def plan_pieces(rank, world, len_q, len_k, layout, band, params: AttentionParams, count,
                runs: list[tuple[slice, int]]) -> list[Piece]:
    """The pieces of one pass, each with every step's calls; `runs`: (batch entries, their prefix)."""
    q_segs = segments(rank, world, len_q, layout)
    pieces = []
    for j in range(count):
        _, cols = cut(segments(rank, world, len_k, layout), j, count)
        piece = Piece(cols, sum(c.stop - c.start for c in cols))
        for step in range(world):
            k_segs, _ = cut(segments((rank - step) % world, world, len_k, layout), j, count)
            blocks = [b for batch, prefix in runs for b in prefix_step_blocks(q_segs, k_segs, band, prefix, batch)]
            piece.steps.append([(b, replace(params, window=b.window)) for b in blocks])
        pieces.append(piece)
    return pieces


def prefix_runs(prefix: object, batch: int) -> list[tuple[slice, int]]:
    """The batch cut into runs of entries that share one prefix (0: none): the prefix read to the host."""
    if prefix is None or isinstance(prefix, int):
        return [(slice(None), prefix or 0)]
    values = prefix.tolist()
    starts = [b for b in range(batch) if b == 0 or values[b] != values[b - 1]]
    if len(starts) == 1:
        return [(slice(None), values[0])]
    return [(slice(a, b), values[a]) for a, b in zip(starts, [*starts[1:], batch])]


def make_plan(q, k, v, causal, window, scale, layout, group, pieces, ledger, record_inputs=True, softcap=0.0,
              runs=None, rules=None, what="ring_attention") -> RingPlan:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(f"group does not contain this process; call {what} only on its members")
    len_q, len_k = q.shape[2] * world, k.shape[2] * world
    band = global_band(len_q, len_k, window)
    segment_length = k.shape[2] // (1 if layout == "contiguous" else 2)
    forward, backward = check_pieces(pieces, segment_length)
    backend = get_backend(local_backend_name(q, k, v, causal, scale))
    params = AttentionParams(scale=scale, softcap=softcap)
    runs = runs or [(slice(None), 0)]
    return RingPlan(
        group, world, rank, backend, compute_dtype(q.dtype),
        plan_pieces(rank, world, len_q, len_k, layout, band, params, forward, runs),
        plan_pieces(rank, world, len_q, len_k, layout, band, params, backward, runs),
        ledger, record_inputs, rules or RingRules(), what,
    )


def part(x: torch.Tensor, s: slice, batch: slice = slice(None)) -> torch.Tensor:
    """Sequence slice of a (B, H, N, ...) tensor, for the batch entries `batch`: a view (both local
    backends take any strides)."""
    return x[batch, :, s]


def visiting_ids(plan: RingPlan, piece: Piece, step: int) -> torch.Tensor | None:
    """The segment ids (B, piece length) of the keys that visit in `step`, packed as the piece packs them."""
    if plan.rules.k_ids is None:
        return None
    ids = plan.rules.k_ids[(plan.rank - step) % plan.world]
    return torch.cat([ids[:, c] for c in piece.cols], dim=1)


def block_rules(plan: RingPlan, k_ids: torch.Tensor | None, batch: slice, rows: slice, cols: slice) -> dict:
    """The `rules` keyword of one local call: its rows' and columns' segment ids, or nothing."""
    if k_ids is None:
        return {}
    return {"rules": ScoreRules(plan.rules.q_ids[batch, rows], k_ids[batch, cols])}


def front(buffer: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous tensor of `shape` on the front of a flat buffer (buffers are sized for the largest piece)."""
    return buffer[: math.prod(shape)].view(shape)


class KVBuffers:
    """Two flat buffers per tensor, each the size of the largest piece, that alternate between the
    piece in use (being sent) and the one arriving."""

    def __init__(self, k, v, pieces: list[Piece], ledger, name: str):
        longest = max(p.length for p in pieces)
        self.slots = [[x.new_empty(x.shape[0] * x.shape[1] * longest * x.shape[3]) for x in (k, v)] for _ in range(2)]
        self.ledger, self.name = ledger, name
        for i, slot in enumerate(self.slots):
            for t, buf in zip("kv", slot):
                ledger.add(f"{name}.{t}{i}", buf)

    def pack(self, k, v, piece: Piece, slot: int) -> list[torch.Tensor]:
        """This rank's own keys of `piece`, packed contiguous into `slot`."""
        packed = []
        for x, buf in zip((k, v), self.slots[slot]):
            target = front(buf, (x.shape[0], x.shape[1], piece.length, x.shape[3]))
            at = 0
            for c in piece.cols:
                width = c.stop - c.start
                target[:, :, at: at + width].copy_(part(x, c))
                at += width
            packed.append(target)
        return packed

    def like(self, kv: list[torch.Tensor], slot: int) -> list[torch.Tensor]:
        return [front(buf, t.shape) for buf, t in zip(self.slots[slot], kv)]

    def free(self) -> None:
        for i in range(2):
            self.ledger.free(f"{self.name}.k{i}", f"{self.name}.v{i}")
        self.slots = []


def as_state(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> BlockSummary:
    """A normalized state as a summary, `(m, l, u) = (lse, 1, out)`, with `out` kept in its own dtype:
    `merge_` promotes as it adds, so no float32 copy of the step's output is made."""
    lse = lse.to(dtype)
    return BlockSummary(lse, (lse != NEG_INF).to(dtype), out)


def initial_state(rows: tuple[int, ...], value_dim: int, dtype, device, sinks) -> BlockSummary:
    """The merge's starting summary for `rows` (B, Hq, n): empty, or the sink (a key of logit sinks[h]
    and value 0), which so joins each row's softmax once."""
    if sinks is None:
        return empty_summary(rows, value_dim, dtype, device)
    m = sinks.detach().to(dtype).view(1, -1, 1).expand(rows).contiguous()
    return BlockSummary(m, (m != NEG_INF).to(dtype), torch.zeros(*rows, value_dim, dtype=dtype, device=device))


def ring_forward(q, k, v, plan: RingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, Hq, n, Dv) in q's dtype and lse (B, Hq, n) in the compute dtype, for this rank's queries."""
    ledger = plan.ledger
    comm = RingComm(plan.group, tag=0)
    state = initial_state(q.shape[:3], v.shape[3], plan.dtype, q.device, plan.rules.sinks)
    for name, x in zip(("state.m", "state.l", "state.u"), state):
        ledger.add(name, x)
    buffers = KVBuffers(k, v, plan.forward_pieces, ledger, "fwd.kv")
    for j, piece in enumerate(plan.forward_pieces):
        kv = buffers.pack(k, v, piece, 0)
        for step, calls in enumerate(piece.steps):
            if step + 1 < plan.world:
                comm.post(kv, into=buffers.like(kv, (step + 1) % 2))
            k_ids = visiting_ids(plan, piece, step)
            for block, params in calls:
                rows, cols, batch = block.rows, block.cols, block.batch
                out, lse = plan.backend.forward(
                    part(q, rows, batch), part(kv[0], cols, batch), part(kv[1], cols, batch), None, params,
                    **block_rules(plan, k_ids, batch, rows, cols),
                )
                ledger.add("step.out", out)
                ledger.add("step.lse", lse)
                rows = BlockSummary(*(part(x, rows, batch) for x in state))
                merge_(rows, as_state(out, lse, plan.dtype))
                del out, lse
                ledger.free("step.out", "step.lse")
            if step + 1 < plan.world:
                kv = comm.wait(f"in forward piece {j}, step {step}")
            ledger.step(f"forward piece {j} step {step}")
    del kv
    buffers.free()
    out, lse = finalize_(state)
    ledger.free("state.l")
    result = out.to(q.dtype)
    if result is not out:
        ledger.add("out", result)
        ledger.free("state.u")
    else:
        ledger.replace("out", ledger.size("state.u"))
        ledger.free("state.u")
    ledger.replace("lse", ledger.size("state.m"))
    ledger.free("state.m")
    ledger.step("forward finalize")
    return result, lse


def rotate(comm: RingComm, tensors: list[torch.Tensor], pieces: int = ROTATE_PIECES, ledger=None,
           where: str = "") -> None:
    """Send `tensors` (contiguous) to the next rank and overwrite them with the previous rank's, in place.

    Piece by piece through one staging buffer of 1/pieces of each tensor, so
    only that much memory is added, never a second copy of the tensors.
    """
    if comm.world == 1:
        return
    ledger = ledger or NullLedger()
    count = max(1, min(pieces, *(t.numel() for t in tensors)))
    chunked = [t.view(-1).tensor_split(count) for t in tensors]  # the same count for every tensor
    staging = [torch.empty_like(c[0]) for c in chunked]
    for i, s in enumerate(staging):
        ledger.add(f"rotate.staging{i}", s)
    for piece in zip(*chunked):
        comm.post(piece, into=[s[: p.numel()] for s, p in zip(staging, piece)])
        for p, received in zip(piece, comm.wait(where)):
            p.copy_(received)
    ledger.free(*(f"rotate.staging{i}" for i in range(len(staging))))


def row_chunks(rows: int, count: int) -> list[slice]:
    bounds = [rows * i // count for i in range(count + 1)]
    return [slice(a, b) for a, b in pairwise(bounds) if b > a]


def block_band(block: Block) -> tuple:
    """The (lo, hi) band of a block's window in its own coordinates (row a sees column b iff lo <= b - a <= hi)."""
    rows, cols = block.rows.stop - block.rows.start, block.cols.stop - block.cols.start
    left, right = block.window
    offset = cols - rows
    return (None if left == -1 else offset - left, None if right == -1 else offset + right)


def split_rows(block: Block, chunk: slice) -> Block | None:
    """The part of `block` whose rows lie in `chunk`, rows relative to the chunk."""
    start, stop = max(block.rows.start, chunk.start), min(block.rows.stop, chunk.stop)
    if stop <= start:
        return None
    if block.window == FULL:
        return Block(slice(start - chunk.start, stop - chunk.start), block.cols, FULL, block.batch)
    shift = start - block.rows.start
    lo, hi = block_band(block)
    band = (None if lo is None else lo + shift, None if hi is None else hi + shift)
    sub = band_block(start - chunk.start, stop - start, block.cols.start, block.cols.stop - block.cols.start, band)
    return None if sub is None else sub._replace(batch=block.batch)


def ring_backward(dout, q, k, v, out, lse, plan: RingPlan):
    """dq, dk, dv for this rank's shards.

    Per piece: the ring of K/V, the local backward adding into float32 dQ and the
    piece's float32 dK/dV, which move one rank on between steps (`rotate`) and come
    home after the last step, to be cast into dk, dv.
    """
    ledger = plan.ledger
    kv_comm, grad_comm = RingComm(plan.group, tag=0), RingComm(plan.group, tag=2)
    cast_dq = plan.dtype != q.dtype
    chunks = row_chunks(q.shape[2], DQ_CHUNKS if cast_dq else 1)
    dq_acc = []
    for i, c in enumerate(chunks):
        dq_acc.append(torch.zeros((*q.shape[:2], c.stop - c.start, q.shape[3]), dtype=plan.dtype, device=q.device))
        ledger.add(f"dq_acc{i}", dq_acc[-1])
    dk, dv = torch.empty_like(k, memory_format=torch.contiguous_format), torch.empty_like(v, memory_format=torch.contiguous_format)
    ledger.add("dk", dk)
    ledger.add("dv", dv)
    longest = max(p.length for p in plan.backward_pieces)
    flat = [torch.empty(x.shape[0] * x.shape[1] * longest * x.shape[3], dtype=plan.dtype, device=x.device) for x in (k, v)]
    ledger.add("dkv_acc.k", flat[0])
    ledger.add("dkv_acc.v", flat[1])
    buffers = KVBuffers(k, v, plan.backward_pieces, ledger, "bwd.kv")
    delta_bytes = q.shape[1] * torch.empty((), dtype=plan.dtype).element_size()
    for j, piece in enumerate(plan.backward_pieces):
        kv = buffers.pack(k, v, piece, 0)
        dkv = [front(f, (*x.shape[:2], piece.length, x.shape[3])).zero_() for f, x in zip(flat, (k, v))]
        for step, calls in enumerate(piece.steps):
            if step > 0:  # first: queued behind the next K/V block, it would wait for it
                rotate(grad_comm, dkv, ledger=ledger, where=f"moving dK/dV in backward piece {j}, step {step}")
            if step + 1 < plan.world:
                kv_comm.post(kv, into=buffers.like(kv, (step + 1) % 2))
            k_ids = visiting_ids(plan, piece, step)
            for block, params in calls:
                for chunk, acc in zip(chunks, dq_acc):
                    sub = split_rows(block, chunk) if len(chunks) > 1 else block
                    if sub is None:
                        continue
                    r, c, b = slice(sub.rows.start + chunk.start, sub.rows.stop + chunk.start), sub.cols, sub.batch
                    sub_params = params if sub is block else replace(params, window=sub.window)
                    ledger.add("step.delta", delta_bytes * len(range(q.shape[0])[b]) * (r.stop - r.start))
                    plan.backend.backward(
                        part(dout, r, b), part(q, r, b), part(kv[0], c, b), part(kv[1], c, b), None,
                        part(out, r, b), part(lse, r, b), sub_params,
                        accumulate_into=(part(acc, sub.rows, b), part(dkv[0], c, b), part(dkv[1], c, b)),
                        **block_rules(plan, k_ids, b, r, c),
                    )
                    ledger.free("step.delta")
            if step + 1 < plan.world:
                kv = kv_comm.wait(f"in backward piece {j}, step {step}")
            ledger.step(f"backward piece {j} step {step}")
        rotate(grad_comm, dkv, ledger=ledger, where=f"bringing dK/dV home in backward piece {j}")
        at = 0
        for c in piece.cols:
            width = c.stop - c.start
            part(dk, c).copy_(part(dkv[0], slice(at, at + width)))
            part(dv, c).copy_(part(dkv[1], slice(at, at + width)))
            at += width
        ledger.step(f"backward piece {j} home")
    del kv, dkv
    buffers.free()
    flat.clear()
    ledger.free("dkv_acc.k", "dkv_acc.v")
    if not cast_dq:
        dq = dq_acc.pop()
        ledger.replace("dq", ledger.size("dq_acc0"))
        ledger.free("dq_acc0")
    else:
        parts = []
        for i in range(len(chunks)):  # each float32 chunk goes as its cast arrives
            parts.append(dq_acc[0].to(q.dtype))
            ledger.add(f"dq_part{i}", parts[-1])
            dq_acc.pop(0)
            ledger.free(f"dq_acc{i}")
        dq = torch.cat(parts, dim=2)
        ledger.add("dq", dq)
        parts.clear()
        ledger.free(*(f"dq_part{i}" for i in range(len(chunks))))
    ledger.step("backward finalize")
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    """Autograd over the ring: saves q, k, v, the global out and lse; no N x N tensor.
    `sinks` (Hq,) or None is `plan.rules.sinks` again, an input so that it gets its gradient."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: RingPlan):
        if plan.record_inputs:
            for name, x in (("q", q), ("k", k), ("v", v)):
                plan.ledger.add(name, x)
        if plan.rules.k_ids is not None:
            plan.ledger.add("k_segment_ids", sum(nbytes(x) for x in plan.rules.k_ids))
        out, lse = ring_forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return returned_with_lse(ctx, out, lse)

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return no_gradients(ctx)
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        if plan.record_inputs:
            plan.ledger.add("dout", dout)
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, plan)
        if plan.rules.k_ids is not None:
            plan.ledger.free("k_segment_ids")
        return dq, dk, dv, ring_sinks_grad(dout, out, lse, plan), None


def ring_sinks_grad(dout, out, lse, plan: RingPlan) -> torch.Tensor | None:
    """d loss / d sinks (Hq,) of the whole attention: this rank's rows' part, summed over the ring."""
    sinks = plan.rules.sinks
    if sinks is None:
        return None
    local = sinks_grad(sinks.detach(), lse, row_delta(dout, out, lse.dtype), head_dim=1)
    return sum_over(local, plan.group, plan.what)


def check_group(group: object, what: str = "ring_attention") -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs torch.distributed: call torch.distributed.init_process_group "
            "(gloo on CPU, nccl on GPUs) first, e.g. under torchrun"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError(f"group does not contain this process; call {what} only on its members")


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


def ring_call(q, k, v, *, causal, window, scale, group, layout, pieces, ledger, validate, record_inputs=True,
              ledger_prefix="", what="ring_attention", segment_ids=None, prefix=None, softcap=0.0,
              alibi_slopes=None, sinks=None):
    """Checked arguments -> (out, lse in the compute dtype): the body of `ring_attention`, also the hybrid's."""
    check_qkv(q, k, v)
    causal = check_bool("causal", causal)
    window = check_window(window, causal)
    scale = check_scale(scale, q.shape[3])
    layout = check_layout(layout)
    check_zigzag_lengths(layout, q=q, k=k)
    check_group(group, what)
    refuse_alibi(what, alibi_slopes)
    rules, softcap = check_shard_rules(what, q, k, segment_ids=segment_ids, prefix=prefix, softcap=softcap,
                                       sinks=sinks)
    runs = prefix_runs(prefix if rules is None or isinstance(prefix, int) else rules.prefix, q.shape[0])
    ledger = as_ledger(ledger)
    if ledger_prefix:
        ledger = Prefixed(ledger, ledger_prefix)
    if check_bool("validate", validate):
        agree(what, group, q.device, q_shape=q.shape, k_shape=k.shape, v_shape=v.shape,
              dtype=q.dtype, window=window, scale=scale, layout=LAYOUTS.index(layout),
              pieces=(-1, -1) if pieces is None else pieces, score_rules=rule_flags(rules, softcap),
              prefix=[p for _, p in runs])
    ring_rules = RingRules()
    if rules is not None:
        k_ids = None if rules.k_segment_ids is None else gather(rules.k_segment_ids, group, what)
        ring_rules = RingRules(rules.q_segment_ids, k_ids, rules.sinks)
    plan = make_plan(q, k, v, causal, window, scale, layout, group, pieces, ledger, record_inputs, softcap, runs,
                     ring_rules, what)
    return RingAttention.apply(q, k, v, ring_rules.sinks, plan)


@overload
def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
    window: tuple[int, int] | None = ..., scale: float | None = ..., group=..., layout: str = ...,
    return_lse: Literal[False] = ..., pieces: tuple[int, int] | None = ...,
    ledger: MemoryLedger | None = ..., validate: bool = ..., segment_ids: SegmentIds = ...,
    prefix: int | torch.Tensor | None = ..., softcap: float = ..., alibi_slopes: RuleTensor = ...,
    sinks: RuleTensor = ...,
) -> torch.Tensor: ...


@overload
def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
    window: tuple[int, int] | None = ..., scale: float | None = ..., group=..., layout: str = ...,
    return_lse: Literal[True], pieces: tuple[int, int] | None = ...,
    ledger: MemoryLedger | None = ..., validate: bool = ..., segment_ids: SegmentIds = ...,
    prefix: int | torch.Tensor | None = ..., softcap: float = ..., alibi_slopes: RuleTensor = ...,
    sinks: RuleTensor = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def ring_attention(q, k, v, *, causal=False, window=None, scale=None, group=None, layout="contiguous",
                   return_lse=False, pieces=None, ledger=None, validate=True, segment_ids=None, prefix=None,
                   softcap=0.0, alibi_slopes=None, sinks=None):
    """Exact attention over a sequence sharded across the ranks of `group`.

    Every rank of `group` calls this with its own shard (`shard(x, rank, world, layout)`):

    Args:
        q: (B, Hq, Nq / W, D), k: (B, Hk, Nk / W, D), v: (B, Hk, Nk / W, Dv) on this
            rank; Hq % Hk == 0 (GQA/MQA). Every rank passes the same shapes.
        causal: bottom-right aligned over the full sequences, as in `exattn.attention`:
            global query i sees global key j iff j <= i + Nk - Nq.
        window: (left, right) over the full sequences, as in `exattn.attention`: global key j
            is allowed iff i + Nk - Nq - left <= j <= i + Nk - Nq + right (-1 = unbounded).
        scale: score scale, default D ** -0.5.
        group: the torch.distributed process group (None = the default group);
            gloo for CPU tensors, nccl for CUDA tensors.
        layout: "contiguous" (rank r holds positions [r N/W, (r+1) N/W)) or "zigzag"
            (2W chunks, rank r holds chunks r and 2W-1-r: balanced causal work).
        return_lse: also return lse (B, Hq, Nq / W), natural log, float32.
        pieces: (forward, backward) column pieces each rank's keys travel in; None picks
            (2, 16), fewer for short shards. More pieces, less memory, smaller calls.
        ledger: a `MemoryLedger` that records every buffer this rank holds, forward and backward.
        validate: first check, with one small all_gather, that every rank passes the same
            shapes, dtype, window, scale, layout and score rules (a mismatch raises ValueError
            on every rank).
        segment_ids: int32 (B, Nq / W) and (B, Nk / W) as a pair, or one (B, N / W): this rank's
            shard of the ids, cut like q and k (`shard(ids, rank, world, layout, dim=1)`); the
            key ids of every rank are all-gathered once (B x Nk int32 per rank).
        prefix: int or int32 (B,), global key positions j < prefix[b] allowed to every query
            (read to the host: a sync on GPUs).
        softcap: as in `exattn.attention`.
        alibi_slopes: refused (ValueError): a step sees shard positions, not global distances.
        sinks: float32 (Hq,), differentiable; every rank gets the gradient of the whole attention.

    Returns:
        out (B, Hq, Nq / W, Dv) in q's dtype for this rank's queries, or (out, lse).
        Differentiable with respect to q, k, v (each rank gets its shards' gradients) and sinks.
    """
    return_lse = check_bool("return_lse", return_lse)
    out, lse = ring_call(q, k, v, causal=causal, window=window, scale=scale, group=group, layout=layout,
                         pieces=pieces, ledger=ledger, validate=validate, segment_ids=segment_ids, prefix=prefix,
                         softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    if not return_lse:
        return out
    return out, lse.to(torch.float32)
