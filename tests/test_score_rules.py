"""Segment ids, prefix, softcap, ALiBi and sinks (SPEC "Structured masks and score modifiers").

The oracle (`attention_ref`) is first checked against a loop over (b, h, i, j) written
here from the SPEC's words; then the tiled and naive backends are judged against it by
the project's error rule, each keyword alone and in random combinations.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import exattn
from exattn.backends import tiled as tiled_module
from exattn.backends.triton import problem_reasons
from exattn.problem import make_problem
from exattn.reference import attention_ref
from error_rule import FLOORS, assert_matches_oracle, floor_dtype

NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


# ---------------------------------------------------------------- inputs


def make_qkv(b, hq, hk, nq, nk, d, dv, dtype, gen, logit_scale=1.0):
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    return rand(b, hq, nq, d, scale=logit_scale), rand(b, hk, nk, d), rand(b, hk, nk, dv)


def sorted_ids(b, n, docs, gen):
    """int32 (b, n): packed documents, ids non-decreasing along the sequence."""
    cuts = torch.randint(0, docs, (b, n), generator=gen)
    return cuts.sort(dim=1).values.to(torch.int32)


def run(fn, q, k, v, sinks, dout):
    """(out, lse, dq, dk, dv, dsinks) of fn(q, k, v, sinks) -> (out, lse), after out.backward(dout)."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    if sinks is not None:
        sinks = sinks.detach().clone().requires_grad_(True)
    out, lse = fn(q, k, v, sinks)
    out.backward(dout.to(out.dtype))
    dsinks = torch.zeros(1) if sinks is None else sinks.grad
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad, dsinks


def check_rules(shape, dtype, rules, *, causal=False, window=None, mask=None, dropout_p=0.0,
                tiles=(None, None), logit_scale=1.0, seed=0):
    """Tiled vs naive vs the float64 oracle by the error rule: out, lse, dq, dk, dv, dsinks."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(*shape, dtype, gen, logit_scale)
    dout = torch.randn(*q.shape[:3], v.shape[3], generator=gen, dtype=torch.float64)
    rules = dict(rules)
    sinks = rules.pop("sinks", None)
    common = dict(causal=causal, window=window, mask=mask, return_lse=True, **rules)
    drop = {"dropout_p": dropout_p, "seed": 99} if dropout_p else {}

    def ours(q, k, v, sinks):
        return exattn.attention(q, k, v, backend="tiled", block_m=tiles[0], block_n=tiles[1],
                                sinks=sinks, **common, **drop)

    def naive(q, k, v, sinks):
        return exattn.attention(q, k, v, backend="naive", sinks=sinks, **common, **drop)

    def oracle(q, k, v, sinks):
        keep = None
        if dropout_p:
            keep = exattn.dropout_mask(99, (*q.shape[:3], k.shape[2]), dropout_p)
        return attention_ref(q.double(), k.double(), v.double(), sinks=sinks, dropout_mask=keep,
                             dropout_p=dropout_p or None, **common)

    ref_sinks = None if sinks is None else sinks.double()
    results = [run(f, q, k, v, s, dout) for f, s in ((ours, sinks), (naive, sinks), (oracle, ref_sinks))]
    assert results[0][0].dtype == dtype and results[0][1].dtype == torch.float32
    # dK = scale * dS^T Q: the rounding of dS = P (dP - delta) reaches dK times |Q|, even where dK itself
    # cancels to 0 (one key: dP = delta exactly, in exact arithmetic only).
    floors = {"dk": FLOORS[dtype] * max(1.0, float(q.abs().max()))}
    for name, mine, base, ref in zip(NAMES, *results):
        assert_matches_oracle(f"tiled/{name}", mine, base, ref, dtype, floors.get(name))
    for name, base, ref in zip(NAMES, results[1], results[2]):
        assert_matches_oracle(f"naive/{name}", base, base, ref, dtype)


# ---------------------------------------------------------------- the oracle itself


def loop_attention(q, k, v, *, scale, causal, window, q_ids, k_ids, prefix, softcap, slopes, sinks):
    """The SPEC's words as loops, float64: out (B, Hq, Nq, Dv) and lse (B, Hq, Nq)."""
    b_, hq, nq, _ = q.shape
    hk, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    left, right = window
    if causal:
        right = 0
    out = torch.zeros(b_, hq, nq, dv, dtype=torch.float64)
    lse = torch.zeros(b_, hq, nq, dtype=torch.float64)
    for b in range(b_):
        for h in range(hq):
            kv = h // (hq // hk)
            for i in range(nq):
                logits, values = [], []
                pos = i + nk - nq
                for j in range(nk):
                    band = (left == -1 or j >= pos - left) and (right == -1 or j <= pos + right)
                    if not ((band or j < prefix[b]) and q_ids[b][i] == k_ids[b][j]):
                        continue
                    s = scale * float(q[b, h, i] @ k[b, kv, j])
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    s -= slopes[b][h] * abs(pos - j)
                    logits.append(s)
                    values.append(v[b, kv, j])
                if sinks is not None:
                    logits.append(float(sinks[h]))
                    values.append(torch.zeros(dv, dtype=torch.float64))
                if not logits:
                    lse[b, h, i] = -math.inf
                    continue
                top = max(logits)
                weights = [math.exp(s - top) for s in logits]
                total = sum(weights)
                lse[b, h, i] = top + math.log(total)
                out[b, h, i] = sum(w * x for w, x in zip(weights, values)) / total
    return out, lse


@pytest.mark.parametrize("case", range(4))
def test_oracle_matches_the_loops(case):
    gen = torch.Generator().manual_seed(case)
    b, hq, hk, nq, nk, d = 2, 4, 2, 5, 7, 6
    q, k, v = make_qkv(b, hq, hk, nq, nk, d, 3, torch.float64, gen, logit_scale=2.0)
    q_ids = torch.randint(0, 2, (b, nq), generator=gen, dtype=torch.int32)
    k_ids = torch.randint(0, 2, (b, nk), generator=gen, dtype=torch.int32)
    prefix = torch.tensor([2, 0], dtype=torch.int32)
    slopes = torch.rand(b, hq, generator=gen)
    sinks = torch.randn(hq, generator=gen) * 2
    causal, window = [(True, (-1, -1)), (False, (1, 0)), (True, (2, -1)), (False, (-1, -1))][case]
    softcap = [0.0, 1.5, 0.7, 3.0][case]
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal, window=window, segment_ids=(q_ids, k_ids),
                                     prefix=prefix, softcap=softcap, alibi_slopes=slopes, sinks=sinks,
                                     return_lse=True)
    out, lse = loop_attention(q, k, v, scale=d ** -0.5, causal=causal, window=window, q_ids=q_ids.tolist(),
                              k_ids=k_ids.tolist(), prefix=prefix.tolist(), softcap=softcap,
                              slopes=slopes.double().tolist(), sinks=sinks.double())
    torch.testing.assert_close(ref_out, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref_lse, lse, rtol=1e-12, atol=1e-12)


def test_oracle_rows_with_no_key_give_zeros_and_the_sink_or_minus_inf():
    q, k, v = make_qkv(1, 2, 1, 3, 4, 8, 8, torch.float64, torch.Generator().manual_seed(1))
    ids = (torch.tensor([[0, 5, 1]], dtype=torch.int32), torch.tensor([[0, 0, 1, 1]], dtype=torch.int32))
    sinks = torch.tensor([0.5, -2.0])
    for s, expected in ((None, torch.full((1, 2), -math.inf)), (sinks, sinks.double()[None])):
        out, lse = attention_ref(q, k, v, segment_ids=ids, sinks=s, return_lse=True)
        assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
        assert torch.equal(lse[:, :, 1], expected)


# ---------------------------------------------------------------- each keyword alone


SHAPE = (2, 4, 2, 37, 29, 24, 16)  # B, Hq, Hk, Nq, Nk, D, Dv: GQA, Nq != Nk, odd lengths


def single_rules(kind, gen=None):
    gen = gen or torch.Generator().manual_seed(7)
    b, hq, _, nq, nk, _, _ = SHAPE
    return {
        "segment_ids": {"segment_ids": (sorted_ids(b, nq, 4, gen), sorted_ids(b, nk, 4, gen))},
        "prefix-int": {"prefix": 5},
        "prefix-tensor": {"prefix": torch.tensor([0, 11], dtype=torch.int32)},
        "softcap": {"softcap": 2.5},
        "alibi-heads": {"alibi_slopes": torch.rand(hq, generator=gen)},
        "alibi-batch": {"alibi_slopes": torch.rand(b, hq, generator=gen)},
        "sinks": {"sinks": torch.randn(hq, generator=gen) * 3},
    }[kind]


KINDS = ["segment_ids", "prefix-int", "prefix-tensor", "softcap", "alibi-heads", "alibi-batch", "sinks"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_keyword_alone(kind, dtype):
    rules = single_rules(kind)
    if dtype == torch.float64 and "sinks" in rules:
        rules["sinks"] = rules["sinks"].double()
    masks = {"causal": True} if kind.startswith("prefix") else {}
    check_rules(SHAPE, dtype, rules, tiles=(8, 16), **masks)


def test_one_segment_ids_tensor_for_equal_lengths():
    gen = torch.Generator().manual_seed(3)
    ids = sorted_ids(2, 33, 5, gen)
    check_rules((2, 2, 1, 33, 33, 16, 16), torch.float32, {"segment_ids": ids}, causal=True, tiles=(8, 8))
    q, k, v = make_qkv(2, 2, 1, 33, 33, 16, 16, torch.float64, gen)
    torch.testing.assert_close(exattn.attention(q, k, v, segment_ids=ids, backend="tiled"),
                               exattn.attention(q, k, v, segment_ids=(ids, ids), backend="tiled"),
                               rtol=0, atol=0)


def test_huge_logits_with_softcap_stay_finite():
    check_rules(SHAPE, torch.float32, {"softcap": 20.0, "sinks": torch.full((4,), 30.0)},
                logit_scale=300.0, causal=True, tiles=(16, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softcap_through_expm1_matches_tanh_and_saturates(dtype):
    """masks.softcap_ (the tiled backend's tanh): softcap * tanh(s / softcap) and 1 - tanh^2, also at
    the extremes (its 2x is clamped below expm1's overflow); NaN stays NaN."""
    from exattn.masks import softcap_

    inf = float("inf")
    s = torch.cat([torch.tensor([-inf, -1e30, -300.0, -1e-9, 0.0, 1e-9, 300.0, 1e30, inf]), torch.randn(200) * 20])
    s = s.to(dtype)
    exact = 5.0 * torch.tanh(s.double() / 5.0)
    grad = torch.empty_like(s)
    capped = softcap_(s.clone(), 5.0, torch.empty_like(s), grad)
    tolerance = 4 * torch.finfo(dtype).eps * 5.0
    assert (capped.double() - exact).abs().max() <= tolerance
    assert (grad.double() - (1 - (exact / 5.0) ** 2)).abs().max() <= 4 * tolerance
    assert torch.isnan(softcap_(torch.tensor([float("nan")], dtype=dtype), 5.0, torch.empty(1, dtype=dtype))).all()


def test_sinks_gradcheck_float64():
    gen = torch.Generator().manual_seed(5)
    q, k, v = make_qkv(1, 2, 1, 6, 9, 4, 3, torch.float64, gen)
    ids = (torch.tensor([[0, 0, 1, 1, 7, 2]], dtype=torch.int32), torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2, 2]],
                                                                                dtype=torch.int32))
    sinks = torch.randn(2, generator=gen, dtype=torch.float64)
    slopes = torch.rand(2, dtype=torch.float64)

    def fn(q, k, v, sinks):
        return exattn.attention(q, k, v, causal=True, segment_ids=ids, prefix=2, softcap=1.3, alibi_slopes=slopes,
                                sinks=sinks, backend="tiled", block_m=2, block_n=4)

    inputs = tuple(x.requires_grad_(True) for x in (q, k, v, sinks))
    assert torch.autograd.gradcheck(fn, inputs)


# ---------------------------------------------------------------- random combinations


@st.composite
def problems(draw):
    b, hk, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 3]))
    nq, nk = draw(st.integers(1, 33)), draw(st.integers(1, 33))
    shape = (b, hk * group, hk, nq, nk, draw(st.sampled_from([8, 13])), draw(st.sampled_from([5, 8])))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    rules = {}
    if draw(st.booleans()):
        docs = draw(st.integers(1, 4))
        if draw(st.booleans()):  # packed documents
            ids = (sorted_ids(b, nq, docs, gen), sorted_ids(b, nk, docs, gen))
        else:  # any ids: rows whose id no key has
            ids = (torch.randint(0, docs, (b, nq), generator=gen, dtype=torch.int32),
                   torch.randint(0, docs, (b, nk), generator=gen, dtype=torch.int32))
        rules["segment_ids"] = ids
    if draw(st.booleans()):
        rules["prefix"] = draw(st.one_of(st.integers(0, 40), st.just(torch.randint(0, nk + 2, (b,), generator=gen,
                                                                                       dtype=torch.int32))))
    if draw(st.booleans()):
        rules["softcap"] = draw(st.sampled_from([0.5, 5.0, 30.0]))
    if draw(st.booleans()):
        rules["alibi_slopes"] = torch.rand(*draw(st.sampled_from([(), (b,)])), hk * group, generator=gen)
    if draw(st.booleans()):
        rules["sinks"] = torch.randn(hk * group, generator=gen) * draw(st.sampled_from([1.0, 10.0]))
    causal = draw(st.booleans())
    window = draw(st.sampled_from([None, (3, -1), (2, 4), (0, 0)]))
    mask = None
    mask_kind = draw(st.sampled_from(["none", "bool", "bias"]))
    if mask_kind == "bool":
        mask = torch.rand(b, 1, nq, nk, generator=gen) > 0.3
    elif mask_kind == "bias":
        mask = torch.randn(1, hk * group, nq, nk, generator=gen)
    extra = dict(causal=causal, window=window, mask=mask,
                 dropout_p=draw(st.sampled_from([0.0, 0.0, 0.3])),
                 tiles=(draw(st.integers(1, 16)), draw(st.integers(1, 16))),
                 logit_scale=draw(st.sampled_from([1.0, 1.0, 40.0])), seed=seed)
    return shape, rules, extra


@settings(max_examples=40, deadline=None)
@given(problems())
def test_random_combinations_float32(case):
    shape, rules, extra = case
    if extra["logit_scale"] > 1 and not rules.get("softcap"):
        extra["logit_scale"] = 4.0  # huge logits without a cap: the naive float32 error grows too
    if extra["mask"] is not None and extra["mask"].is_floating_point():
        extra["mask"] = extra["mask"].float()
    check_rules(shape, torch.float32, rules, **extra)


@settings(max_examples=25, deadline=None)
@given(problems())
def test_random_combinations_float64(case):
    shape, rules, extra = case
    if "sinks" in rules:
        rules["sinks"] = rules["sinks"].double()
    if extra["mask"] is not None and extra["mask"].is_floating_point():
        extra["mask"] = extra["mask"].double()
    check_rules(shape, torch.float64, rules, **extra)


def test_compiled_tiled_path_gives_the_sinks_gradient():
    gen = torch.Generator().manual_seed(2)
    q, k, v = make_qkv(1, 2, 1, 7, 9, 8, 8, torch.float32, gen)
    ids = sorted_ids(1, 9, 2, gen)
    slopes = torch.rand(2, generator=gen)
    dout = torch.randn(1, 2, 7, 8, generator=gen)

    def fn(q, k, v, sinks):
        return exattn.attention(q, k, v, causal=True, segment_ids=(ids[:, :7], ids), prefix=2, softcap=2.0,
                                alibi_slopes=slopes, sinks=sinks, seed=3, dropout_p=0.1, backend="tiled",
                                block_m=4, block_n=4, return_lse=True)

    sinks = torch.randn(2, generator=gen)
    eager = run(fn, q, k, v, sinks, dout)
    compiled = run(torch.compile(fn, fullgraph=True), q, k, v, sinks, dout)
    for name, a, b in zip(NAMES, compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


# ---------------------------------------------------------------- tile skipping


def count_tiles(monkeypatch):
    calls = []
    original = tiled_module.TileContext.scores

    def counting(self, q_tile, k_tile, rows, cols, *args):
        calls.append((rows.start // self.block_m, cols.start // self.block_n))
        return original(self, q_tile, k_tile, rows, cols, *args)

    monkeypatch.setattr(tiled_module.TileContext, "scores", counting)
    return calls


def allowed_tiles(ids, block, causal):
    """Tiles of the (aligned) block grid with at least one allowed pair, in any batch entry."""
    n = ids.shape[1]
    allowed = ids[:, :, None] == ids[:, None, :]
    if causal:
        allowed &= torch.ones(n, n, dtype=torch.bool).tril()
    tiles = set()
    for b, i, j in allowed.nonzero().tolist():
        tiles.add((i // block, j // block))
    return tiles


@pytest.mark.parametrize("causal", [False, True])
def test_segment_ids_skip_empty_tiles(monkeypatch, causal):
    """16 short documents per sequence: the tiles computed are exactly the tiles that hold an
    allowed pair, forward and backward, a small fraction of all tiles."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 48, (2, 16), generator=gen)
    n = int(lengths.sum(1).min())
    ids = torch.stack([torch.repeat_interleave(torch.arange(16), row)[:n] for row in lengths]).to(torch.int32)
    block = 16
    q, k, v = make_qkv(2, 2, 1, n, n, 8, 8, torch.float32, gen)
    q.requires_grad_(True)
    calls = count_tiles(monkeypatch)
    out = exattn.attention(q, k, v, segment_ids=ids, causal=causal, backend="tiled", block_m=block, block_n=block)
    forward = list(calls)
    calls.clear()
    out.sum().backward()
    expected = allowed_tiles(ids, block, causal)
    total = math.ceil(n / block) ** 2
    assert sorted(forward) == sorted(expected) and sorted(calls) == sorted(expected)
    assert len(expected) < total / 4


def test_segment_ids_leave_tiles_of_one_id_unmasked():
    """A tile needs no segment mask only where, in every batch entry, its rows and keys hold one id."""
    from exattn.backends.tiled import SegmentSkip
    from exattn.problem import ScoreRules

    ids = torch.tensor([[0] * 8 + [1] * 8, [0] * 4 + [1] * 12], dtype=torch.int32)
    skip = SegmentSkip(ScoreRules(q_segment_ids=ids, k_segment_ids=ids), 4, 4)
    assert skip.one_id(range(0, 4), range(0, 4))
    assert skip.one_id(range(8, 12), range(12, 16))
    assert not skip.one_id(range(0, 4), range(4, 8))  # the second entry's keys 4-7 hold id 1
    assert not skip.one_id(range(0, 8), range(0, 4))  # the second entry's rows hold two ids
    assert not skip.one_id(range(8, 12), range(0, 4))

def test_prefix_tiles_are_computed_and_the_rest_skipped(monkeypatch):
    """Causal with a prefix of 20 keys, 8 x 8 tiles: the causal triangle plus the prefix columns."""
    q, k, v = make_qkv(1, 1, 1, 64, 64, 8, 8, torch.float32, torch.Generator().manual_seed(0))
    calls = count_tiles(monkeypatch)
    exattn.attention(q, k, v, causal=True, prefix=20, backend="tiled", block_m=8, block_n=8)
    expected = {(i, j) for i in range(8) for j in range(8) if j <= i or j * 8 < 20}
    assert sorted(calls) == sorted(expected)


# ---------------------------------------------------------------- packed sequences


VARLEN_CASES = [  # (lens_q, lens_k, rules)
    ([5, 0, 17, 9], [9, 4, 17, 0], dict(softcap=0.0, prefix=torch.tensor([2, 0, 5, 1], dtype=torch.int32),
                                         causal=True, window=None)),
    ([12, 3, 7, 4], [12, 3, 20, 4], dict(softcap=3.0, prefix=3, causal=False, window=(4, 2))),
    ([1, 30, 8, 6], [7, 30, 8, 6], dict(softcap=1.0, prefix=None, causal=True, window=(5, -1))),
]


def check_varlen_rules(lens_q, lens_k, rules, dtype, backend="tiled", device="cpu", d=16, dv=8, seed=0,
                       shared_slopes=False, **tiles):
    """attention_varlen with every rule (ALiBi slopes, (B, Hq) or with shared_slopes (Hq,), and sinks drawn
    here) through `backend` against naive and the per-sequence float64 oracle: out, lse, dq, dk, dv, d sinks."""
    gen = torch.Generator().manual_seed(seed)
    hq, hk, batch = 4, 2, len(lens_q)

    def rand(*shape, dtype=dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)

    q, k, v = rand(sum(lens_q), hq, d), rand(sum(lens_k), hk, d), rand(sum(lens_k), hk, dv)
    dout = rand(sum(lens_q), hq, dv, dtype=torch.float64)
    float_rules = torch.float64 if dtype == torch.float64 else torch.float32
    sinks = rand(hq, dtype=float_rules)
    rules = dict(rules, alibi_slopes=rand(*(() if shared_slopes else (batch,)), hq, dtype=float_rules).abs())
    if isinstance(rules["prefix"], torch.Tensor):
        rules["prefix"] = rules["prefix"].to(device)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for lens in (lens_q, lens_k))

    def packed(backend, **extra):
        def fn(q, k, v, sinks):
            return exattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), sinks=sinks,
                                           backend=backend, return_lse=True, **rules, **extra)
        return fn

    def oracle(q, k, v, sinks):
        outs, lses = [], []
        prefix = rules["prefix"]
        for b in range(batch):
            rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            view = [x[r].transpose(0, 1).unsqueeze(0).double() for x, r in ((q, rq), (k, rk), (v, rk))]
            pre = prefix[b:b + 1] if isinstance(prefix, torch.Tensor) else prefix
            out, lse = attention_ref(*view, causal=rules["causal"], window=rules["window"], softcap=rules["softcap"],
                                     alibi_slopes=rules["alibi_slopes"].expand(batch, hq)[b:b + 1], prefix=pre,
                                     sinks=sinks.double(),
                                     return_lse=True)
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    results = [run(f, q, k, v, s, dout) for f, s in ((packed(backend, **tiles), sinks), (packed("naive"), sinks),
                                                      (oracle, sinks.double()))]
    for name, mine, base, ref in zip(NAMES, *results):
        assert_matches_oracle(f"varlen/{name}", mine, base, ref, floor_dtype(name, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", range(3))
def test_varlen_rules_against_the_per_sequence_oracle(case, dtype):
    check_varlen_rules(*VARLEN_CASES[case], dtype, seed=case, block_m=4, block_n=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_varlen_rules_through_the_one_sequence_form(dtype, monkeypatch):
    """Shared offsets of short sequences with softcap, a window, shared ALiBi slopes and sinks: the tiled passes
    run them as one sequence with segment ids (`varlen.one_sequence`), forward and backward."""
    from exattn import varlen

    served = []
    real = varlen.one_sequence
    monkeypatch.setattr(varlen, "ONE_SEQUENCE_TILE_COST", 0)  # whatever its tiles cost
    monkeypatch.setattr(varlen, "one_sequence", lambda *args: served.append(real(*args)) or served[-1])
    lens = [5, 0, 17, 9]
    check_varlen_rules(lens, lens, dict(softcap=2.0, prefix=None, causal=True, window=(6, -1)), dtype,
                       shared_slopes=True, block_m=4, block_n=8)
    assert len(served) == 2 and all(x is not None for x in served)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["forward", "backward"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", range(3))
def test_gpu_gluon_kernels_serve_packed_rules(case, d, dtype, kernel, monkeypatch):
    """Packed sequences (empty ones, lengths off the tiles) with the rules, through the Gluon forward, or the
    Gluon backward (at every length, head dim and window here): it is the one called."""
    from exattn.backends import triton as backend
    from exattn.backends.triton import gluon_backward as gb
    from exattn.backends.triton import gluon_forward as gf
    from exattn.backends.triton import settings

    monkeypatch.setattr(settings, "replay", False)  # a replayed call would not reach the kernels' entry
    module, entry = (gf, "run_gluon_forward") if kernel == "forward" else (gb, "run_gluon_backward")
    if kernel == "backward":
        monkeypatch.setitem(backend.GLUON_PACKED_BACKWARD_MIN_LEN, d, 1)
        monkeypatch.setattr(gb, "TRITON_FASTER_AT_D64", 0)  # also where Triton is faster
    calls = []
    real = getattr(module, entry)
    monkeypatch.setattr(module, entry, lambda *args: calls.append(1) or real(*args))
    lens_q, lens_k, rules = VARLEN_CASES[case]
    scale = 37
    check_varlen_rules([n * scale for n in lens_q], [n * scale for n in lens_k], rules, dtype, "triton", "cuda",
                       d=d, dv=d, seed=case)
    assert calls == [1]


# ---------------------------------------------------------------- backends that say why not


def test_triton_serves_every_rule():
    """The kernels apply segment ids, prefix, softcap, ALiBi and sinks (tests/test_triton_score_rules.py)."""
    q, k, v = make_qkv(1, 2, 1, 4, 4, 8, 8, torch.float32, torch.Generator().manual_seed(0))
    problem = make_problem(q, k, v, segment_ids=torch.zeros(1, 4, dtype=torch.int32), prefix=1, softcap=2.0,
                           alibi_slopes=torch.ones(2), sinks=torch.zeros(2))
    assert problem_reasons(problem) == []
