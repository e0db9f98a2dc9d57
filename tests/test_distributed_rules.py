"""Score rules across ranks (segment ids, prefix, softcap, ALiBi slopes, sinks), on CPU with gloo.

Ring (both layouts), Ulysses and the hybrid on every mesh shape of the world run each
rule alone and all together, with causal masks, windows, GQA (K/V heads replicated for
Ulysses), Nq != Nk, odd shard lengths and queries that see no key. Each rank's out,
lse, dq, dk, dv and the whole d sinks (on every rank) are judged against the float64
oracle by the shared error rule, and in float64 against single-process
`exattn.attention` to 1e-12. Packed batches (Ulysses and ring varlen, sequences that
straddle ranks, empty ones) are judged against `exattn.attention_varlen` in float64.
Refused combinations and bad rules raise clear errors on every rank. Worlds 2 and 3.
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
from torch.distributed.device_mesh import init_device_mesh

import exattn
from exattn.distributed import (
    mesh_shard,
    ring,
    ring_attention,
    ring_attention_varlen,
    sequence_parallel_attention,
    shard,
    ulysses_attention,
    ulysses_attention_varlen,
)
from exattn.distributed.blocks import global_band, prefix_step_blocks
from exattn.distributed.layout import segments
from exattn.masks import band_mask
from exattn.reference import attention_ref

PIECES = (2, 3)  # forward, backward column pieces: uneven widths, as the default never cuts short shards
NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")
ALL_RING_RULES = ("segment_ids", "prefix_per_batch", "softcap", "sinks")


class Case(NamedTuple):
    name: str
    rules: tuple[str, ...]
    dtype: torch.dtype = torch.float64
    causal: bool = True
    window: tuple[int, int] | None = None
    heads: tuple[int, int] = (4, 2)  # at world 2; scaled with the world
    per_rank: tuple[int, int] = (6, 6)  # positions per rank, queries and keys
    batch: int = 2
    dims: tuple[int, int] = (16, 12)


def sorted_ids(batch: int, length: int, documents: int, gen) -> torch.Tensor:
    return torch.randint(0, documents, (batch, length), generator=gen).sort(dim=1).values.to(torch.int32)


def make_rule(name: str, case: Case, heads: int, lengths: tuple[int, int], gen) -> tuple[str, object]:
    """One rule on the full sequences. Query ids 0..3 against key ids 0..2: queries of id 3 see no key."""
    float_dtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    b, (len_q, len_k) = case.batch, lengths
    if name == "segment_ids":
        return name, (sorted_ids(b, len_q, 4, gen), sorted_ids(b, len_k, 3, gen))
    if name == "segment_ids_one":
        return "segment_ids", torch.randint(0, 3, (b, len_q), generator=gen, dtype=torch.int32)
    if name == "prefix":
        return name, len_k // 3
    if name == "prefix_per_batch":
        return "prefix", torch.tensor([len_k // 2, 1, len_k // 2, 0][:b], dtype=torch.int32)
    if name == "softcap":
        return name, 1.5
    if name == "alibi":
        return "alibi_slopes", torch.rand(heads, generator=gen, dtype=float_dtype)
    if name == "alibi_per_batch":
        return "alibi_slopes", torch.rand(b, heads, generator=gen, dtype=float_dtype)
    if name == "sinks":
        return name, torch.randn(heads, generator=gen, dtype=float_dtype)
    raise ValueError(f"unknown rule {name!r}")


class Problem(NamedTuple):
    """Full float64 q, k, v, dout and the rules on the full sequences."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    rules: dict


def make_problem(case: Case, world: int, seed: int) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    hq, hk = case.heads[0] * world // 2, max(1, case.heads[1] * world // 2)
    len_q, len_k = case.per_rank[0] * world, case.per_rank[1] * world
    (d, dv), b = case.dims, case.batch

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    tensors = randn(b, hq, len_q, d) * 2, randn(b, hk, len_k, d), randn(b, hk, len_k, dv), randn(b, hq, len_q, dv)
    return Problem(*tensors, dict(make_rule(n, case, hq, (len_q, len_k), gen) for n in case.rules))


def with_sinks_leaf(rules: dict) -> dict:
    """The rules with a fresh leaf for the sinks (each run gets its own gradient)."""
    rules = dict(rules)
    if "sinks" in rules:
        rules["sinks"] = rules["sinks"].detach().clone().requires_grad_()
    return rules


def run(fn, q, k, v, dout, rules: dict, dtype: torch.dtype):
    """(out, lse, dq, dk, dv, dsinks) of fn(q, k, v, **rules) -> (out, lse) after out.backward(dout)."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    rules = with_sinks_leaf(rules)
    out, lse = fn(q, k, v, **rules)
    out.backward(dout.to(out.dtype))
    sinks = rules.get("sinks")
    return out, lse, q.grad, k.grad, v.grad, None if sinks is None else sinks.grad


def full_results(problem: Problem, case: Case):
    """(oracle, naive in case.dtype, tiled in case.dtype) on the full tensors."""
    common = {"causal": case.causal, "window": case.window, "return_lse": True}

    def oracle(q, k, v, **rules):
        return attention_ref(q, k, v, **common, **rules)

    def single(backend):
        def fn(q, k, v, **rules):
            return exattn.attention(q, k, v, backend=backend, **common, **rules)
        return fn

    args = (problem.q, problem.k, problem.v, problem.dout, problem.rules)
    low_rules = {n: x.to(case.dtype) if n in ("sinks", "alibi_slopes") else x for n, x in problem.rules.items()}
    return (run(oracle, *args, torch.float64), run(single("naive"), *args[:4], low_rules, case.dtype),
            run(single("tiled"), *args[:4], low_rules, case.dtype))


def compare(name: str, case: Case, ours, problem: Problem, cut) -> None:
    """This rank's results against the full ones, cut to its positions (d sinks whole)."""
    oracle, naive, single = full_results(problem, case)
    for item, a, r, n, s in zip(NAMES, ours, oracle, naive, single):
        if r is None:
            assert a is None, f"{name} {item}: a gradient for sinks that were not given"
            continue
        if item != "dsinks":
            r, n, s = (cut(x) for x in (r, n, s))
        label = f"{name} {item}"
        assert a is not None and a.shape == r.shape, f"{label}: got {None if a is None else tuple(a.shape)}"
        assert_matches_oracle(label, a, n, r, case.dtype)
        if case.dtype == torch.float64 and item != "lse":
            gap = max_abs_error(a, s)
            assert gap <= 1e-12, f"{label}: differs from exattn.attention by {gap:.2e}"


def sharded_run(fn, problem: Problem, case: Case, cut, cut_ids):
    """(out, lse, dq, dk, dv, dsinks) of fn on this rank's part; sequence-indexed rules cut by `cut_ids`."""
    rules = dict(problem.rules)
    if "segment_ids" in rules:
        ids = rules["segment_ids"]
        rules["segment_ids"] = cut_ids(ids) if isinstance(ids, torch.Tensor) else tuple(cut_ids(x) for x in ids)
    return run(fn, *(cut(x) for x in problem[:4]), rules, case.dtype)


# ---------------------------------------------------------------- the ring


RING_CASES = [
    (Case("ring-segment-ids-q-longer-odd", ("segment_ids",), per_rank=(7, 5)), "contiguous"),
    (Case("ring-segment-ids-one", ("segment_ids_one",), causal=False, window=(3, 2)), "zigzag"),
    (Case("ring-prefix", ("prefix",), heads=(4, 1)), "zigzag"),
    (Case("ring-prefix-per-batch-window", ("prefix_per_batch",), causal=False, window=(2, 1)), "contiguous"),
    (Case("ring-prefix-per-batch-q-longer", ("prefix_per_batch",), per_rank=(8, 4), batch=3), "zigzag"),
    (Case("ring-softcap", ("softcap",), window=(4, 0)), "zigzag"),
    (Case("ring-sinks-q-longer", ("sinks",), per_rank=(6, 2)), "contiguous"),
    (Case("ring-all", ALL_RING_RULES, window=(5, 0)), "zigzag"),
    (Case("ring-all-f32", ALL_RING_RULES, torch.float32, per_rank=(8, 8), dims=(40, 40)), "zigzag"),
]


def check_ring(case: Case, layout: str, rank: int, world: int, seed: int) -> None:
    problem = make_problem(case, world, seed)

    def cut(x, dim=2):
        return shard(x, rank, world, layout, dim)

    def fn(q, k, v, **rules):
        return ring_attention(q, k, v, causal=case.causal, window=case.window, layout=layout, pieces=PIECES,
                              return_lse=True, **rules)

    ours = sharded_run(fn, problem, case, cut, lambda ids: cut(ids, 1))
    compare(f"{case.name}-{layout}", case, ours, problem, cut)


# ---------------------------------------------------------------- Ulysses


ULYSSES_CASES = [
    Case("ulysses-segment-ids-kv-longer-odd", ("segment_ids",), per_rank=(5, 7)),
    Case("ulysses-segment-ids-one-window", ("segment_ids_one",), causal=False, window=(3, 1)),
    Case("ulysses-prefix-gqa-replicated", ("prefix",), heads=(4, 1)),
    Case("ulysses-prefix-per-batch", ("prefix_per_batch",), window=(2, 0)),
    Case("ulysses-softcap", ("softcap",)),
    Case("ulysses-alibi-gqa-replicated", ("alibi",), causal=False, heads=(4, 1)),
    Case("ulysses-alibi-per-batch", ("alibi_per_batch",)),
    Case("ulysses-sinks-q-longer", ("sinks",), per_rank=(6, 3), heads=(4, 1)),
    Case("ulysses-all", ("segment_ids", "prefix_per_batch", "softcap", "alibi_per_batch", "sinks"), window=(5, 0)),
    Case("ulysses-all-f32", ("segment_ids", "prefix", "softcap", "alibi", "sinks"), torch.float32, dims=(40, 40)),
]


def check_ulysses(case: Case, rank: int, world: int, seed: int) -> None:
    problem = make_problem(case, world, seed)

    def cut(x, dim=2):
        return shard(x, rank, world, "contiguous", dim)

    def fn(q, k, v, **rules):
        return ulysses_attention(q, k, v, causal=case.causal, window=case.window, return_lse=True,
                                 backend="tiled", **rules)

    compare(case.name, case, sharded_run(fn, problem, case, cut, lambda ids: cut(ids, 1)), problem, cut)


class Packed(NamedTuple):
    """A packed batch (lengths 5, 0, 9, 1 and the rest: sequences straddle ranks) and its rules."""

    tensors: tuple[torch.Tensor, ...]  # q, k, v, dout (total, H, d) float64
    offsets: tuple  # cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    rules: dict


def make_packed(world: int, heads: tuple[int, int], rules: tuple[str, ...], seed: int) -> Packed:
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 0, 9, 1, 12 * world - 15]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total, (hq, hk), d = sum(lengths), heads, 16
    q, dout = (torch.randn(total, hq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(total, hk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    made = {"softcap": 2.0, "sinks": torch.randn(hq, generator=gen, dtype=torch.float64),
            "prefix": torch.tensor([2, 0, 4, 1, 3], dtype=torch.int32),
            "alibi_slopes": torch.rand(len(lengths), hq, generator=gen, dtype=torch.float64)}
    return Packed((q, k, v, dout), (cu, cu, max(lengths), max(lengths)), {n: made[n] for n in rules})


def check_varlen(name: str, fn, packed: Packed, cut, **mask) -> None:
    """fn on this rank's tokens against `exattn.attention_varlen` on all of them, float64, to 1e-12."""
    def single(q, k, v, **rules):
        return exattn.attention_varlen(q, k, v, *packed.offsets, return_lse=True, backend="tiled", **mask,
                                       **rules)

    def ours(q, k, v, **rules):
        return fn(q, k, v, *packed.offsets, return_lse=True, **mask, **rules)

    ref = run(single, *packed.tensors, packed.rules, torch.float64)
    mine = run(ours, *(cut(x) for x in packed.tensors), packed.rules, torch.float64)
    for item, a, r in zip(NAMES, mine, ref):
        if r is None:
            continue
        if item != "dsinks":
            r = cut(r.transpose(0, 1)).transpose(0, 1) if item == "lse" else cut(r)
        assert a.shape == r.shape, f"{name} {item}: shape {tuple(a.shape)} != {tuple(r.shape)}"
        gap = max_abs_error(a, r)
        assert gap <= (1e-6 if item == "lse" else 1e-12), f"{name} {item}: {gap:.2e}"


def check_ulysses_varlen(rank: int, world: int) -> None:
    packed = make_packed(world, (2 * world, 1), ("prefix", "softcap", "alibi_slopes", "sinks"), seed=7)
    check_varlen("ulysses varlen", ulysses_attention_varlen, packed,
                 lambda x: shard(x, rank, world, dim=0), causal=True)


RING_VARLEN_CASES = [
    ("contiguous", {"causal": True}, ("softcap", "sinks")),
    ("zigzag", {"causal": True, "window": (4, 0)}, ("sinks",)),
    ("zigzag", {"window": (2, 3)}, ("softcap",)),
]


def check_ring_varlen(layout: str, mask: dict, rules: tuple[str, ...], rank: int, world: int, seed: int) -> None:
    packed = make_packed(world, (2 * world, world), rules, seed)

    def fn(*args, **kwargs):
        return ring_attention_varlen(*args, layout=layout, pieces=PIECES, **kwargs)

    check_varlen(f"ring varlen {layout} {mask} {rules}", fn, packed,
                 lambda x: shard(x, rank, world, layout, dim=0), **mask)


# ---------------------------------------------------------------- the hybrid


HYBRID_RULES = ("segment_ids", "prefix_per_batch", "softcap", "sinks")


def mesh_shapes(world: int) -> list[tuple[int, int]]:
    return [(r, world // r) for r in range(1, world + 1) if world % r == 0]


def check_hybrid(shape: tuple[int, int], rank: int, world: int, seed: int) -> None:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("ring", "ulysses"))
    rules = HYBRID_RULES + (("alibi_per_batch",) if shape[0] == 1 else ())
    case = Case(f"hybrid-{shape}", rules, heads=(2 * shape[1], 1), window=(7, 0))
    problem = make_problem(case, world, seed)

    def cut(x, dim=2):
        return mesh_shard(x, mesh, "zigzag", dim)

    def fn(q, k, v, **rules):
        return sequence_parallel_attention(q, k, v, mesh=mesh, causal=case.causal, window=case.window,
                                           return_lse=True, **rules)

    compare(case.name, case, sharded_run(fn, problem, case, cut, lambda ids: cut(ids, 1)), problem, cut)


# ---------------------------------------------------------------- refusals and bad rules


def check_refusals(rank: int, world: int) -> None:
    q = torch.randn(1, 2 * world, 4, 8)
    slopes = torch.rand(2 * world)
    with pytest.raises(ValueError, match="ring_attention does not take alibi_slopes"):
        ring_attention(q, q, q, alibi_slopes=slopes)
    ring_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ring", "ulysses"))
    with pytest.raises(ValueError, match="sequence_parallel_attention does not take alibi_slopes"):
        sequence_parallel_attention(q, q, q, mesh=ring_mesh, alibi_slopes=slopes)
    packed = q[0].transpose(0, 1)
    cu = torch.tensor([0, 4 * world], dtype=torch.int32)
    with pytest.raises(ValueError, match="ulysses_attention_varlen does not take segment_ids"):
        ulysses_attention_varlen(packed, packed, packed, cu, cu, 4 * world, 4 * world,
                                 segment_ids=torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="ring_attention_varlen does not take prefix"):
        ring_attention_varlen(packed, packed, packed, cu, cu, 4 * world, 4 * world, prefix=2)
    with pytest.raises(ValueError, match="ring_attention_varlen does not take alibi_slopes"):
        ring_attention_varlen(packed, packed, packed, cu, cu, 4 * world, 4 * world, alibi_slopes=slopes)
    other = torch.tensor([0, 1, 4 * world], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must equal cu_seqlens_k, got \[0, 1, \d+\] and \[0, 2,"):
        ring_attention_varlen(packed, packed, packed, other, other + torch.tensor([0, 1, 0], dtype=torch.int32),
                              4 * world, 4 * world)
    with pytest.raises(ValueError, match="q and k hold the same tokens, but this rank's q has 4 and k has 3"):
        ring_attention_varlen(packed, packed[:3], packed[:3], cu, cu, 4 * world, 4 * world)
    with pytest.raises(ValueError, match=r"max_seqlen_q = 3 must be at least the longest sequence"):
        ring_attention_varlen(packed, packed, packed, cu, cu, 3, 4 * world)


def check_bad_rules(rank: int, world: int) -> None:
    q = torch.randn(1, 2 * world, 4, 8)
    full_ids = torch.zeros(1, 4 * world, dtype=torch.int32)
    for fn, what in ((ulysses_attention, "ulysses_attention"), (ring_attention, "ring_attention")):
        with pytest.raises(ValueError, match=rf"{what}: segment_ids.*got \(1, {4 * world}\).*its own shard"):
            fn(q, q, q, segment_ids=full_ids)
        with pytest.raises(ValueError, match=rf"{what}: sinks must have shape.*\({2 * world},\).*got \(2,\)"):
            fn(q, q, q, sinks=torch.zeros(2))
        with pytest.raises(TypeError, match="segment_ids .* must be torch.int32"):
            fn(q, q, q, segment_ids=full_ids[:, :4].long())
        with pytest.raises(ValueError, match="softcap must be a finite float > 0, or 0 for off, got -1.0"):
            fn(q, q, q, softcap=-1.0)
        with pytest.raises(ValueError, match="prefix must be >= 0, got -2"):
            fn(q, q, q, prefix=-2)
        sinks = torch.zeros(2 * world) if rank == 0 else None
        with pytest.raises(ValueError, match=rf"{what}: every rank of the group must pass the same score_rules"):
            fn(q, q, q, sinks=sinks)


# ---------------------------------------------------------------- the spawned worlds


def worker(rank: int, world: int, store_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    checks = [(f"{c.name}-{lay}", lambda c=c, lay=lay, i=i: check_ring(c, lay, rank, world, i))
              for i, (c, lay) in enumerate(RING_CASES)]
    checks += [(c.name, lambda c=c, i=i: check_ulysses(c, rank, world, 40 + i)) for i, c in enumerate(ULYSSES_CASES)]
    checks.append(("ulysses-varlen", lambda: check_ulysses_varlen(rank, world)))
    checks += [(f"ring-varlen-{i}", lambda c=c, i=i: check_ring_varlen(*c, rank, world, 60 + i))
               for i, c in enumerate(RING_VARLEN_CASES)]
    checks += [(f"hybrid-{s}", lambda s=s, i=i: check_hybrid(s, rank, world, 80 + i))
               for i, s in enumerate(mesh_shapes(world))]
    checks.append(("refusals", lambda: check_refusals(rank, world)))
    checks.append(("bad-rules", lambda: check_bad_rules(rank, world)))
    failures = run_checks(checks, rank, world)
    finish(failures)


def spawn(world: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "store")), nprocs=world, join=True)


@pytest.mark.parametrize("world", [2, 3])
def test_score_rules_across_ranks(world):
    spawn(world)


# ---------------------------------------------------------------- the ring's plan, without processes


def coverage(blocks, len_q: int, len_k: int, batch: int) -> torch.Tensor:
    """How many calls cover each (batch, row, col) of a step."""
    count = torch.zeros(batch, len_q, len_k, dtype=torch.int64)
    for b in blocks:
        rows, cols = b.rows.stop - b.rows.start, b.cols.stop - b.cols.start
        band = band_mask(range(rows), range(cols), rows, cols, b.window, "cpu")
        count[b.batch, b.rows, b.cols] += 1 if band is None else band.long()
    return count


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("window", [(-1, 0), (2, 0), (3, 1), (-1, -1)])
def test_prefix_steps_cover_band_or_prefix_once(layout, window):
    """Every (query, key) pair the band or the prefix allows is covered once, in every step and piece."""
    per_rank = 2 if layout == "zigzag" else 1
    for world in (1, 2, 3):
        for cq, ck in [(3, 3), (2, 4), (4, 2)]:
            len_q, len_k = cq * per_rank * world, ck * per_rank * world
            j = torch.arange(len_k)[None, :]
            band = band_mask(range(len_q), range(len_k), len_q, len_k, window, "cpu")
            in_band = torch.ones(len_q, len_k, dtype=torch.bool) if band is None else band
            for prefix in (0, 1, ck * per_rank, len_k - 1, len_k + 3):
                allowed = (in_band | (j < prefix)).long()
                for r in range(world):
                    q_segs = segments(r, world, len_q, layout)
                    rows = torch.cat([torch.arange(s.start, s.start + s.length) for s in q_segs])
                    for s in range(world):
                        for part, count in ((0, 1), (1, 2)):
                            k_segs, _ = ring.cut(segments(s, world, len_k, layout), part, count)
                            cols = torch.cat([torch.arange(x.start, x.start + x.length) for x in k_segs])
                            blocks = prefix_step_blocks(q_segs, k_segs, global_band(len_q, len_k, window), prefix)
                            seen = coverage(blocks, len(rows), len(cols), 1)[0]
                            assert torch.equal(seen, allowed[rows][:, cols]), (world, cq, ck, prefix, r, s)


def test_prefix_runs_group_equal_prefixes():
    assert ring.prefix_runs(None, 3) == [(slice(None), 0)]
    assert ring.prefix_runs(5, 3) == [(slice(None), 5)]
    assert ring.prefix_runs(torch.tensor([4, 4, 4], dtype=torch.int32), 3) == [(slice(None), 4)]
    runs = ring.prefix_runs(torch.tensor([4, 4, 1, 4], dtype=torch.int32), 4)
    assert runs == [(slice(0, 2), 4), (slice(2, 3), 1), (slice(3, 4), 4)]
