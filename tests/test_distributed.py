"""Ring attention on CPU with gloo, judged against the float64 oracle.

World sizes 2, 3 and 4 are spawned once each (process start dominates), and
every case runs inside those spawns: both layouts, causal on and off, GQA/MQA,
Nq != Nk, rows with no allowed key, fp64/fp32/fp16/bf16. Each rank checks its
shard of out, lse, dq, dk, dv against the oracle on the full tensors with the
shared error rule, and float64 runs against single-process `exattn.attention`.
World 3 also runs rings of one process, world 4 two interleaved subgroup rings.
Every world also checks `rotate` (dK/dV moving one rank on, in place) and, with a
spy backend, that the local calls get views of whole shards and accumulate in place.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from error_rule import assert_matches_oracle, max_abs_error
from rank_checks import finish, run_checks

import exattn
from exattn.distributed import RingComm, ring, ring_attention, shard, unshard
from exattn.distributed.blocks import global_band, step_blocks
from exattn.distributed.layout import segments
from exattn.masks import band_mask
from exattn.reference import attention_ref


class Case(NamedTuple):
    name: str
    dtype: torch.dtype
    layout: str
    causal: bool
    heads: tuple[int, int] = (2, 2)
    chunks: tuple[int, int] = (3, 3)  # positions per chunk, queries and keys
    dims: tuple[int, int] = (24, 24)
    batch: int = 1
    scale: float | None = None
    strided: bool = False
    logit_gain: float = 1.0


CASES = [
    Case("f64-zigzag-causal-gqa", torch.float64, "zigzag", True, heads=(4, 2), dims=(24, 24)),
    Case("f64-contig-full-mqa", torch.float64, "contiguous", False, heads=(3, 1), dims=(40, 24)),
    Case("f64-zigzag-causal-kv-longer", torch.float64, "zigzag", True, chunks=(2, 5)),
    Case("f32-zigzag-causal-strided", torch.float32, "zigzag", True, batch=2, dims=(59, 59), strided=True),
    Case("f32-contig-causal-gqa", torch.float32, "contiguous", True, heads=(4, 2), chunks=(5, 5)),
    Case("f32-zigzag-full", torch.float32, "zigzag", False, heads=(2, 1), chunks=(2, 3)),
    Case("f32-contig-causal-q-longer", torch.float32, "contiguous", True, chunks=(4, 2)),
    Case("f32-zigzag-causal-q-longer", torch.float32, "zigzag", True, chunks=(3, 2)),
    Case("f32-contig-causal-one-query", torch.float32, "contiguous", True, chunks=(1, 3)),
    Case("f32-zigzag-causal-huge-logits", torch.float32, "zigzag", True, logit_gain=30.0),
    Case("f16-contig-causal-scale", torch.float16, "contiguous", True, scale=0.3, dims=(40, 40)),
    Case("bf16-zigzag-causal-gqa", torch.bfloat16, "zigzag", True, heads=(4, 1), dims=(64, 64), chunks=(4, 4)),
]


def make_inputs(case: Case, world: int, seed: int):
    """Full q, k, v, dout in float64, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    per_rank = 2 if case.layout == "zigzag" else 1
    len_q, len_k = case.chunks[0] * per_rank * world, case.chunks[1] * per_rank * world
    (hq, hk), (d, dv) = case.heads, case.dims

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = randn(case.batch, hq, len_q, d) * case.logit_gain
    return q, randn(case.batch, hk, len_k, d), randn(case.batch, hk, len_k, dv), randn(case.batch, hq, len_q, dv)


def leaf(x: torch.Tensor, dtype: torch.dtype, strided: bool) -> torch.Tensor:
    """A leaf tensor in `dtype`; with `strided`, a transposed view of (B, N, H, D) memory."""
    x = x.to(dtype)
    if strided:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    return x.detach().requires_grad_()


def run_full(q, k, v, dout, case: Case, **kwargs):
    """(out, lse, dq, dk, dv) of single-process attention on the full tensors."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out, lse = kwargs.pop("fn")(q, k, v, causal=case.causal, scale=case.scale, return_lse=True, **kwargs)
    out.backward(dout.to(out.dtype))
    return out, lse, q.grad, k.grad, v.grad


def run_ring(q, k, v, dout, case: Case, rank: int, world: int, group=None):
    """(out, lse, dq, dk, dv) shards of this rank."""
    q, k, v = (leaf(shard(x, rank, world, case.layout), case.dtype, case.strided) for x in (q, k, v))
    out, lse = ring_attention(
        q, k, v, causal=case.causal, scale=case.scale, group=group, layout=case.layout, return_lse=True
    )
    out.backward(shard(dout, rank, world, case.layout).to(case.dtype))
    return out, lse, q.grad, k.grad, v.grad


def check_case(case: Case, rank: int, world: int, seed: int, group=None) -> None:
    q, k, v, dout = make_inputs(case, world, seed)
    ours = run_ring(q, k, v, dout, case, rank, world, group)
    ref = run_full(q, k, v, dout, case, fn=attention_ref)
    low = [x.to(case.dtype) for x in (q, k, v)]
    naive = run_full(*low, dout, case, fn=exattn.attention, backend="naive")
    single = run_full(*low, dout, case, fn=exattn.attention, backend="tiled")
    for name, a, n, r, s in zip(("out", "lse", "dq", "dk", "dv"), ours, naive, ref, single):
        r, n, s = (shard(x, rank, world, case.layout) for x in (r, n, s))
        assert a.shape == r.shape, f"{case.name} {name}: shape {tuple(a.shape)} != {tuple(r.shape)}"
        assert a.dtype == (torch.float32 if name == "lse" else case.dtype), f"{case.name} {name}: dtype {a.dtype}"
        assert_matches_oracle(f"{case.name} {name}", a, n, r, case.dtype)
        if case.dtype == torch.float64 and name != "lse":
            gap = max_abs_error(a, s)
            assert gap <= 1e-12, f"{case.name} {name}: differs from exattn.attention by {gap:.2e}"


def check_subgroups(rank: int, world: int) -> None:
    """Two rings over interleaved ranks ({0, 2} and {1, 3}) run side by side."""
    members = [list(range(start, world, 2)) for start in (0, 1)]
    groups = [dist.new_group(m) for m in members]
    mine = rank % 2
    case = Case("f32-subgroup-zigzag-causal", torch.float32, "zigzag", True, heads=(2, 1))
    check_case(case, members[mine].index(rank), len(members[mine]), seed=100 + mine, group=groups[mine])


def check_singleton_groups(rank: int, world: int) -> None:
    """A ring of one process (its own group) is plain local attention."""
    groups = [dist.new_group([r]) for r in range(world)]
    case = Case("f64-singleton-zigzag-causal", torch.float64, "zigzag", True, heads=(2, 1))
    check_case(case, 0, 1, seed=200 + rank, group=groups[rank])


def check_rotate(rank: int, world: int) -> None:
    """rotate() leaves every rank holding its previous rank's tensors, pieces of uneven sizes included."""
    def mine(r):
        return [torch.arange(10.0) + 100 * r, torch.arange(21, dtype=torch.float64).view(3, 7) - 100 * r]
    for pieces in (3, 16):  # 16: chunk sizes that cut 10 and 21 elements into different counts
        tensors = mine(rank)
        storage = [t.data_ptr() for t in tensors]
        ring.rotate(RingComm(None, tag=4), tensors, pieces=pieces)
        for got, expected in zip(tensors, mine((rank - 1) % world)):
            assert torch.equal(got, expected), f"pieces={pieces}"
        assert [t.data_ptr() for t in tensors] == storage, "rotate must work in place"


class SpyBackend:
    """The ring's local backend, recording every tensor it is handed."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def forward(self, q, k, v, mask, params):
        self.seen += [("forward", x) for x in (q, k, v)]
        return self.inner.forward(q, k, v, mask, params)

    def backward(self, dout, q, k, v, mask, out, lse, params, accumulate_into=None):
        assert accumulate_into is not None, "the ring must accumulate in place, not add returned blocks"
        self.seen += [("backward", x) for x in (dout, q, k, v, out, lse)]
        self.seen += [("accumulator", x) for x in accumulate_into]
        return self.inner.backward(dout, q, k, v, mask, out, lse, params, accumulate_into=accumulate_into)


def check_local_calls_take_views(rank: int, world: int) -> None:
    """Zigzag causal steps attend half a shard: the local calls must get views of whole shards, not copies."""
    case = Case("f32-zigzag-views", torch.float32, "zigzag", True, batch=2, heads=(4, 2), chunks=(4, 4))
    spies = []

    def spy_backend(name):
        spies.append(SpyBackend(exattn.backends.get_backend(name)))
        return spies[-1]

    original, ring.get_backend = ring.get_backend, spy_backend
    try:
        q, k, v, dout = make_inputs(case, world, seed=5)
        run_ring(q, k, v, dout, case, rank, world)
    finally:
        ring.get_backend = original
    per_rank = q.shape[2] // world
    seen = [item for spy in spies for item in spy.seen]
    assert {kind for kind, _ in seen} == {"forward", "backward", "accumulator"}
    assert any(x.shape[2] < per_rank for _, x in seen), "expected calls on part of a shard"
    for kind, x in seen:
        whole_shard = x.numel() // x.shape[2] * per_rank * x.element_size()
        assert x.untyped_storage().nbytes() >= whole_shard, f"{kind}: a copy of {tuple(x.shape)}, not a view"
        if kind == "accumulator":
            assert x.dtype == torch.float32


def check_bad_group(rank: int, world: int) -> None:
    q, k, v, _ = make_inputs(CASES[0], world, seed=0)
    with pytest.raises(TypeError, match="group must be"):
        ring_attention(q, k, v, group="world")


def worker(rank: int, world: int, store_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )
    checks = [(c.name, lambda c=c, i=i: check_case(c, rank, world, seed=i)) for i, c in enumerate(CASES)]
    checks.append(("bad-group", lambda: check_bad_group(rank, world)))
    checks.append(("rotate", lambda: check_rotate(rank, world)))
    checks.append(("views", lambda: check_local_calls_take_views(rank, world)))
    if world == 3:
        checks.append(("singletons", lambda: check_singleton_groups(rank, world)))
    if world == 4:
        checks.append(("subgroups", lambda: check_subgroups(rank, world)))
    failures = run_checks(checks, rank, world)
    finish(failures)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_single_process(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "store")), nprocs=world, join=True)


def visibility(blocks, len_q: int, len_k: int) -> torch.Tensor:
    """How many calls cover each (row, col) of a step, from the planned blocks."""
    count = torch.zeros(len_q, len_k, dtype=torch.int64)
    for b in blocks:
        rows, cols = b.rows.stop - b.rows.start, b.cols.stop - b.cols.start
        band = band_mask(range(rows), range(cols), rows, cols, b.window, "cpu")
        count[b.rows, b.cols] += 1 if band is None else band.long()
    return count


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_step_blocks_cover_the_causal_pattern_once(layout):
    per_rank = 2 if layout == "zigzag" else 1
    for world in (1, 2, 3, 5):
        for cq, ck in [(2, 2), (3, 3), (2, 3), (3, 2), (1, 4), (4, 1)]:
            len_q, len_k = cq * per_rank * world, ck * per_rank * world
            i, j = torch.arange(len_q)[:, None], torch.arange(len_k)[None, :]
            allowed = (j <= i + len_k - len_q).long()
            band = (None, len_k - len_q)
            for r in range(world):
                q_segs = segments(r, world, len_q, layout)
                rows = torch.cat([torch.arange(s.start, s.start + s.length) for s in q_segs])
                for s in range(world):
                    k_segs = segments(s, world, len_k, layout)
                    cols = torch.cat([torch.arange(x.start, x.start + x.length) for x in k_segs])
                    blocks = step_blocks(q_segs, k_segs, band)
                    assert torch.equal(visibility(blocks, len(rows), len(cols)), allowed[rows][:, cols])
                    if layout == "zigzag" and cq == ck:
                        assert len(blocks) == 1, "balanced zigzag steps are one call each"


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("window", [(2, 0), (0, 3), (3, 1), (-1, 2), (5, -1)])
def test_step_blocks_cover_windows_once(layout, window):
    """Any window (both sides, causal or not), cut into column pieces as the ring cuts keys."""
    per_rank = 2 if layout == "zigzag" else 1
    for world in (1, 2, 3):
        for cq, ck in [(3, 3), (2, 4), (4, 2)]:
            len_q, len_k = cq * per_rank * world, ck * per_rank * world
            full = band_mask(range(len_q), range(len_k), len_q, len_k, window, "cpu")
            allowed = torch.ones(len_q, len_k, dtype=torch.long) if full is None else full.long()
            band = global_band(len_q, len_k, window)
            for r in range(world):
                q_segs = segments(r, world, len_q, layout)
                rows = torch.cat([torch.arange(s.start, s.start + s.length) for s in q_segs])
                for s in range(world):
                    for count in (1, 2):
                        k_segs, _ = ring.cut(segments(s, world, len_k, layout), 0, 1)
                        packed, _ = ring.cut(k_segs, count - 1, count)
                        cols = torch.cat([torch.arange(x.start, x.start + x.length) for x in packed])
                        blocks = step_blocks(q_segs, packed, band)
                        assert torch.equal(visibility(blocks, len(rows), len(cols)), allowed[rows][:, cols])


def test_non_causal_step_is_one_full_call():
    segs = segments(1, 3, 12, "zigzag")
    (block,) = step_blocks(segs, segments(2, 3, 12, "zigzag"), None)
    assert (block.rows, block.cols, block.window) == (slice(0, 4), slice(0, 4), (-1, -1))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("dim", [2, -1, 0])
def test_shard_unshard_round_trip(layout, dim):
    x = torch.randn(12, 3, 12, 12)
    for world in (1, 2, 3, 6):
        parts = [shard(x, r, world, layout, dim=dim) for r in range(world)]
        assert sum(p.shape[dim] for p in parts) == x.shape[dim]
        assert torch.equal(unshard(parts, layout, dim=dim), x)


def test_zigzag_shard_holds_chunks_r_and_mirror():
    x = torch.arange(8).view(1, 1, 8, 1)
    assert shard(x, 0, 2, "zigzag").flatten().tolist() == [0, 1, 6, 7]
    assert shard(x, 1, 2, "zigzag").flatten().tolist() == [2, 3, 4, 5]
    assert shard(x, 1, 2, "contiguous").flatten().tolist() == [4, 5, 6, 7]


def test_shard_rejects_lengths_the_layout_cannot_split():
    x = torch.randn(1, 2, 10, 4)
    with pytest.raises(ValueError, match=r"x has length 10.*world=3.*multiple of 3"):
        shard(x, 0, 3, "contiguous")
    with pytest.raises(ValueError, match=r"x has length 10.*'zigzag'.*world=2.*multiple of 4"):
        shard(x, 0, 2, "zigzag")
    with pytest.raises(ValueError, match=r"each shard has length 3.*multiple of 2"):
        unshard([torch.randn(1, 2, 3, 4)] * 2, "zigzag")


def test_shard_and_unshard_reject_bad_arguments():
    x = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="layout must be one of"):
        shard(x, 0, 2, "spiral")
    with pytest.raises(ValueError, match=r"rank must be in \[0, world\) = \[0, 2\), got 2"):
        shard(x, 2, 2)
    with pytest.raises(ValueError, match="world must be >= 1, got 0"):
        shard(x, 0, 0)
    with pytest.raises(TypeError, match="rank must be an int"):
        shard(x, 0.0, 2)
    with pytest.raises(ValueError, match="dim must be in"):
        shard(x, 0, 2, dim=4)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        shard(x.numpy(), 0, 2)
    with pytest.raises(TypeError, match="shards must be a non-empty list"):
        unshard(x)
    with pytest.raises(ValueError, match=r"shards\[1\] has shape"):
        unshard([x, x[:, :, :4]])


def test_ring_attention_rejects_bad_arguments_before_communicating():
    q = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="q holds 3 positions on this rank.*'zigzag'.*even"):
        ring_attention(q[:, :, :3], q[:, :, :4], q[:, :, :4], layout="zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(q, q, q, layout="ring")
    with pytest.raises(TypeError, match="causal must be a bool"):
        ring_attention(q, q, q, causal=1)
    with pytest.raises(ValueError, match="query heads"):
        ring_attention(q, q[:, :1].expand(1, 3, 6, 8), q[:, :1].expand(1, 3, 6, 8))
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            ring_attention(q, q, q)
