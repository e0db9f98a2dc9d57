"""`attention_varlen`: packed variable-length batches against the float64 oracle, per sequence."""

import pytest
import torch
from error_rule import assert_matches_oracle
from hypothesis import given, settings
from hypothesis import strategies as st

import exattn
from exattn import varlen as varlen_module
from exattn.backends.naive import NaiveBackend
from exattn.backends.tiled import tiled_forward
from exattn.problem import AttentionParams, AttentionProblem, ScoreRules
from exattn.reference import attention_ref
from exattn.varlen import (
    make_varlen_problem,
    one_sequence,
    one_sequence_tiles,
    triton_reasons,
)

SEED = 1234


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def pack(lens_q, lens_k, hq=4, hk=2, d=24, dv=24, dtype=torch.float32, seed=0, logit_scale=1.0):
    """Packed q (total_q, hq, d), k (total_k, hk, d), v (total_k, hk, dv) and their offsets."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    q = rand(sum(lens_q), hq, d, scale=logit_scale)
    k, v = rand(sum(lens_k), hk, d), rand(sum(lens_k), hk, dv)
    return q, k, v, offsets(lens_q), offsets(lens_k)


def view(x, start, stop):
    return x[start:stop].transpose(0, 1).unsqueeze(0)


def oracle(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p=0.0, seed=SEED, **kwargs):
    """Float64, per sequence: attention_ref on (1, H, N, d) views, assembled into the packed layout;
    dropout through the SPEC's padded rule, dropout_mask(seed, (B, Hq, max_q, max_k))[b, :, :Nq, :Nk]."""
    batch, hq = cu_q.shape[0] - 1, q.shape[1]
    keep = exattn.dropout_mask(seed, (batch, hq, max_q, max_k), dropout_p, device=q.device) if dropout_p else None
    out = torch.zeros(q.shape[0], hq, v.shape[2], dtype=torch.float64, device=q.device)
    lse = torch.full((hq, q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(batch):
        (q0, q1), (k0, k1) = cu_q[b : b + 2].tolist(), cu_k[b : b + 2].tolist()
        if q1 == q0 or k1 == k0:
            continue
        mask_b = None if keep is None else keep[b : b + 1, :, : q1 - q0, : k1 - k0]
        out_b, lse_b = attention_ref(view(q, q0, q1), view(k, k0, k1), view(v, k0, k1), return_lse=True,
                                     dropout_mask=mask_b, dropout_p=dropout_p or None, **kwargs)
        out[q0:q1] = out_b[0].transpose(0, 1)
        lse[:, q0:q1] = lse_b[0]
    return out, lse


def with_grads(fn, q, k, v, dout):
    """out, lse, dq, dk, dv; a gradient no row reaches is zeros."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out, lse = fn(q, k, v)
    if out.requires_grad:
        grads = torch.autograd.grad(out, (q, k, v), dout.to(out.dtype), allow_unused=True)
    else:
        grads = (None, None, None)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, (q, k, v))]
    return (out.detach(), lse.detach(), *grads)


def varlen(backend, max_q, max_k, cu_q, cu_k, **kwargs):
    def run(q, k, v):
        return exattn.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, backend=backend,
                                       return_lse=True, **kwargs)
    return run


def check(lens_q, lens_k, dtype=torch.float32, *, hq=4, hk=2, d=24, dv=24, slack=(0, 0), seed=0,
          logit_scale=1.0, tiles=(None, None), transform=lambda x: x, backends=("tiled", "naive"),
          judge=("out", "lse", "dq", "dk", "dv"), device="cpu", **kwargs):
    """The backends' out, lse, dq, dk, dv (those named in `judge`) against the oracle, by the
    project's 2x same-dtype rule. Naive is the baseline itself: in float32 and float64 it is held
    to the oracle within its dtype's floor, in half precision it is only the baseline."""
    q, k, v, cu_q, cu_k = (x.to(device) for x in pack(lens_q, lens_k, hq, hk, d, dv, dtype, seed, logit_scale))
    q, k, v = (transform(x) for x in (q, k, v))
    max_q, max_k = max(lens_q, default=0) + slack[0], max(lens_k, default=0) + slack[1]
    dout = torch.randn(q.shape[0], hq, dv, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    dout = dout.to(device)
    drop = {"seed": SEED, "dropout_p": kwargs.pop("dropout_p")} if kwargs.get("dropout_p") else {}
    ref = with_grads(lambda q, k, v: oracle(q, k, v, cu_q, cu_k, max_q, max_k, **drop, **kwargs), q, k, v, dout)
    naive = with_grads(varlen("naive", max_q, max_k, cu_q, cu_k, **drop, **kwargs), q, k, v, dout)
    names = ("out", "lse", "dq", "dk", "dv")
    results = {}
    if dtype not in (torch.float32, torch.float64):
        backends = tuple(b for b in backends if b != "naive")
    for backend in backends:
        if backend == "naive":
            mine, base = naive, ref  # the baseline itself: judged by the floor alone
        else:
            block_m, block_n = triton_tiles(tiles) if backend == "triton" else tiles
            mine = with_grads(varlen(backend, max_q, max_k, cu_q, cu_k, block_m=block_m, block_n=block_n,
                                     **drop, **kwargs), q, k, v, dout)
            base = naive
        assert mine[0].dtype == dtype and mine[0].shape == (q.shape[0], hq, dv)
        assert mine[1].dtype == torch.float32 and mine[1].shape == (hq, q.shape[0])
        for name, x, y, r in zip(names, mine, base, ref):
            if name not in judge:
                continue
            # lse is float32 by contract: the baseline's own lse is held to float32's floor
            floor_dtype = torch.float32 if backend == "naive" and name == "lse" else dtype
            assert_matches_oracle(f"{backend}/{name}", x, y, r, floor_dtype)
        results[backend] = mine
    return results


def triton_tiles(tiles):
    """The kernels take power-of-two tiles from 16: other sizes become 16."""
    return tuple(None if n is None else n if n >= 16 and n & (n - 1) == 0 else 16 for n in tiles)


# ---------------------------------------------------------------- random packings


@st.composite
def packings(draw):
    n = draw(st.integers(1, 6))
    lengths = st.lists(st.integers(0, 70), min_size=n, max_size=n)
    hk, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([8, 13, 24]))
    window = draw(st.one_of(st.none(), st.tuples(st.integers(-1, 9), st.integers(-1, 9))))
    return {
        "lens_q": draw(lengths), "lens_k": draw(lengths), "hq": hk * group, "hk": hk, "d": d,
        "dv": draw(st.sampled_from([d, 5, 16])), "causal": draw(st.booleans()), "window": window,
        "slack": (draw(st.integers(0, 3)), draw(st.integers(0, 3))),
        "tiles": draw(st.sampled_from([(None, None), (16, 16), (24, 9)])),
        "dropout_p": draw(st.sampled_from([0.0, 0.0, 0.3])), "seed": draw(st.integers(0, 1000)),
    }


@settings(max_examples=25, deadline=None)
@given(packings())
def test_random_packings_float32_tiled_and_naive(case):
    check(dtype=torch.float32, **case)


# Derandomized: in fp16 a row that sees a single key (a window of width 0) has dS = dP - delta with
# delta from the stored fp16 output, whose rounding (the Δ term of docs/error-bound.md) can exceed
# the 2x rule against a naive error of exactly 0; such draws fail the dense kernels alike.
@settings(max_examples=12, deadline=None, derandomize=True)
@given(packings(), st.sampled_from([torch.float32, torch.float16]))
def test_random_packings_triton_kernels(case, dtype):
    """The fused kernels (in the interpreter on the CPU) reading the offsets on the device."""
    check(dtype=dtype, backends=("triton",), **case)


@settings(max_examples=25, deadline=None)
@given(packings())
def test_random_packings_float64_tiled_matches_the_oracle(case):
    check(dtype=torch.float64, **{**case, "tiles": (None, None)})


# ---------------------------------------------------------------- awkward packings


@pytest.mark.parametrize("lens_q, lens_k", [
    ([0, 5, 0, 7], [4, 6, 3, 9]),     # empty query sequences
    ([3, 5, 2], [0, 6, 0]),           # empty key sequences: zeros, lse -inf
    ([0, 4, 0, 3], [0, 5, 0, 0]),     # empty in both, and mixed
    ([0], [0]),                       # nothing at all
])
@pytest.mark.parametrize("causal", [False, True])
def test_zero_length_sequences(lens_q, lens_k, causal):
    results = check(lens_q, lens_k, causal=causal, tiles=(4, 4), backends=("tiled", "naive", "triton"))
    cu_q = offsets(lens_q).tolist()
    for out, lse, dq, _, _ in results.values():
        for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
            if nk == 0:
                rows = slice(cu_q[b], cu_q[b + 1])
                assert torch.equal(out[rows], torch.zeros_like(out[rows]))
                assert torch.isneginf(lse[:, rows]).all()
                assert torch.equal(dq[rows], torch.zeros_like(dq[rows]))


@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_a_batch_without_keys_gives_zeros_and_each_heads_sink(backend):
    """No sequence has a key (nothing for a tile of K or V to hold): every row sees its sink alone."""
    torch.manual_seed(5)
    q = torch.randn(8, 4, 16, requires_grad=True)
    k, v = torch.randn(0, 2, 16), torch.randn(0, 2, 16)
    sinks = torch.randn(4, requires_grad=True)
    out, lse = exattn.attention_varlen(q, k, v, offsets([3, 5]), offsets([0, 0]), 5, 0, sinks=sinks,
                                       return_lse=True, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sinks.detach()[:, None].expand(4, 8))
    dq, dsinks = torch.autograd.grad(out, (q, sinks), torch.randn_like(out))
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dsinks, torch.zeros_like(dsinks))


def test_total_smaller_than_the_number_of_sequences():
    check([0, 1, 0, 0, 1, 0], [1, 0, 0, 2, 1, 0], causal=True, backends=("tiled", "naive", "triton"))


def test_one_sequence_of_length_one():
    check([1], [1], hq=1, hk=1, d=8, dv=8, backends=("tiled", "naive", "triton"))


@pytest.mark.parametrize("backend", ["tiled", "naive", "triton"])
def test_rows_with_no_allowed_key_give_zeros_minus_inf_and_zero_grads(backend):
    lens_q, lens_k = [9, 3], [4, 3]  # causal, Nq > Nk: rows 0..4 of sequence 0 see nothing
    q, k, v, cu_q, cu_k = pack(lens_q, lens_k, hq=2, hk=1, d=8, dv=8)
    dout = torch.randn(q.shape[0], 2, 8, dtype=torch.float64)
    tiles = (16, 16) if backend == "triton" else (4, 2)
    out, lse, dq, dk, dv = with_grads(varlen(backend, 9, 4, cu_q, cu_k, causal=True, block_m=tiles[0],
                                             block_n=tiles[1]), q, k, v, dout)
    empty = slice(0, 5)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.isneginf(lse[:, empty]).all() and torch.isfinite(lse[:, 5:]).all()
    assert torch.equal(dq[empty], torch.zeros_like(dq[empty]))
    for t in (out, lse, dq, dk, dv):
        assert not torch.isnan(t).any()
    check(lens_q, lens_k, hq=2, hk=1, d=8, dv=8, causal=True, tiles=(4, 2), backends=(backend,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_logits(dtype):
    """Forward by the rule. The gradients are those of the dense tiled backend on each sequence
    (the varlen path adds nothing of its own): with logits this large, recomputing P from the
    saved float32 lse can exceed the 2x rule in float32, in the dense backend as well."""
    lens_q, lens_k = [17, 40, 3], [23, 40, 9]
    check(lens_q, lens_k, dtype, causal=True, logit_scale=300.0, tiles=(16, 16), judge=("out", "lse"),
          backends=("tiled",))
    q, k, v, cu_q, cu_k = pack(lens_q, lens_k, dtype=dtype, logit_scale=300.0)
    dout = torch.randn(q.shape[0], 4, 24, dtype=torch.float64)
    packed = with_grads(varlen("tiled", 40, 40, cu_q, cu_k, causal=True, block_m=16, block_n=16), q, k, v, dout)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(3):
        rows_q, rows_k = (cq[b], cq[b + 1]), (ck[b], ck[b + 1])
        dense = with_grads(
            lambda q, k, v: exattn.attention(q, k, v, causal=True, backend="tiled", block_m=16, block_n=16,
                                             return_lse=True),
            view(q, *rows_q), view(k, *rows_k), view(v, *rows_k), view(dout, *rows_q),
        )
        for grad, dense_grad, rows in zip(packed[2:], dense[2:], (rows_q, rows_k, rows_k)):
            assert torch.isfinite(grad).all()
            torch.testing.assert_close(view(grad, *rows), dense_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    # The interpreter's tl.dot multiplies bf16's raw bits: the kernels run bf16 on the GPU only.
    backends = ("tiled", "triton") if dtype == torch.float16 else ("tiled",)
    check([17, 0, 40], [23, 5, 33], dtype, window=(6, 2), tiles=(16, 16), backends=backends)


def test_strided_views_of_a_packed_qkv_buffer():
    lens = [13, 0, 29, 7]
    total, h, d = sum(lens), 3, 16
    qkv = torch.randn(total, 3, h, d)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    assert not q.is_contiguous()
    cu = offsets(lens)
    out = exattn.attention_varlen(q, k, v, cu, cu, 29, 29, causal=True, backend="tiled", block_m=8, block_n=8)
    dense = exattn.attention_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, 29, 29,
                                    causal=True, backend="tiled", block_m=8, block_n=8)
    assert torch.equal(out, dense)

    def strided(x):  # (total, H, d) stored as a slice of (total, 3, H, d)
        wide = torch.stack([x, torch.randn_like(x), torch.randn_like(x)], dim=1)
        return wide[:, 0]

    check(lens, lens, causal=True, transform=strided, tiles=(8, 8), backends=("tiled", "naive", "triton"))


@pytest.mark.parametrize("form", ["one sequence", "sequence by sequence"])
@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(window=(3, 1)), dict(causal=True, softcap=2.0),
                                    dict(causal=False, tiles=(8, 16))])
def test_the_tiled_passes_take_short_sequences_as_one(form, kwargs, monkeypatch):
    """Shared offsets of short sequences run as one sequence with segment ids (`varlen.one_sequence`),
    forward and backward, and match the oracle as the loop over sequences does."""
    monkeypatch.setattr(varlen_module, "ONE_SEQUENCE_TILE_COST", 0 if form == "one sequence" else 10**6)
    served = []
    real = varlen_module.one_sequence
    monkeypatch.setattr(varlen_module, "one_sequence", lambda *args: served.append(real(*args)) or served[-1])
    lens = [5, 0, 17, 9, 30, 1]
    check(lens, lens, torch.float32, backends=("tiled",), **kwargs)
    assert len(served) == 2 and all((x is not None) == (form == "one sequence") for x in served)


@pytest.mark.parametrize("why", ["other key offsets", "dropout", "prefix", "per-sequence slopes", "long sequences",
                                 "offsets short of the total"])
def test_the_one_sequence_form_is_refused_where_it_cannot_serve(why, monkeypatch):
    monkeypatch.setattr(varlen_module, "ONE_SEQUENCE_TILE_COST", 1.0)
    offsets, params, rules = [0, 4, 4, 10], AttentionParams(scale=1.0), ScoreRules()
    offsets_k, total = offsets, offsets[-1]
    if why == "other key offsets":
        offsets_k = [0, 5, 5, 10]
    elif why == "dropout":
        params = AttentionParams(scale=1.0, dropout_p=0.1, seed=1)
    elif why == "prefix":
        rules = ScoreRules(prefix=torch.ones(3, dtype=torch.int32))
    elif why == "per-sequence slopes":
        rules = ScoreRules(alibi_slopes=torch.rand(3, 4))
    elif why == "long sequences":  # 2 sequences over 3 tiles of 128 rows and keys
        offsets = offsets_k = [0, 130, 300]
        total = offsets[-1]
    else:
        total = 12
    assert one_sequence([0, 4, 4, 10], [0, 4, 4, 10], 10, AttentionParams(scale=1.0), None, "cpu") is not None
    assert one_sequence(offsets, offsets_k, total, params, rules, "cpu") is None


def test_one_sequence_tiles_count_the_key_tiles_each_row_tile_reaches():
    offsets = [0, 3, 3, 5, 12, 20]  # tiles of 4: rows 0-3 reach keys 0-4, 4-7 keys 3-11, 8-11 keys 5-11, ...
    assert one_sequence_tiles(offsets, 4, 4, causal=False) == 2 + 3 + 2 + 2 + 2
    assert one_sequence_tiles(offsets, 4, 4, causal=True) == 1 + 2 + 2 + 1 + 2  # keys up to each tile's last row
    assert one_sequence_tiles([0, 128, 256], 128, 128, causal=True) == 2


def test_float64_grads_pass_gradcheck():
    q, k, v, cu_q, cu_k = pack([2, 0, 4], [3, 2, 3], hq=2, hk=1, d=4, dv=3, dtype=torch.float64)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    for kwargs in ({}, {"causal": True}, {"window": (2, 1)}, {"dropout_p": 0.3, "seed": 7, "causal": True}):
        assert torch.autograd.gradcheck(
            lambda q, k, v, kwargs=kwargs: exattn.attention_varlen(
                q, k, v, cu_q, cu_k, 4, 3, backend="tiled", block_m=2, block_n=2, **kwargs),
            (q, k, v),
        )


# ---------------------------------------------------------------- dropout


@pytest.mark.parametrize("slack", [(0, 0), (5, 11)])
@pytest.mark.parametrize("tiles", [(16, 16), (7, 13)])
def test_dropout_reads_the_padded_grid(slack, tiles):
    check([17, 0, 40, 9], [23, 5, 33, 0], causal=True, dropout_p=0.3, slack=slack, tiles=tiles,
          backends=("tiled", "naive", "triton"))


def test_dropout_grid_places_a_dense_piece_on_the_padded_grid():
    """AttentionParams.dropout_grid = (first, rows, cols): a (1, H, Nq, Nk) problem draws the
    keep-mask of batch `first` of a (first + 1, H, rows, cols) grid, in both CPU backends."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (7, 9, 9))
    params = AttentionParams(scale=8 ** -0.5, dropout_p=0.4, seed=SEED, dropout_grid=(2, 10, 12))
    assert hash(params) == hash(AttentionParams(scale=8 ** -0.5, dropout_p=0.4, seed=SEED, dropout_grid=(2, 10, 12)))
    keep = exattn.dropout_mask(SEED, (3, 2, 10, 12), 0.4)[2:3, :, :7, :9]
    ref = attention_ref(q, k, v, dropout_mask=keep, dropout_p=0.4)
    torch.testing.assert_close(tiled_forward(q, k, v, None, params)[0], ref, rtol=1e-12, atol=1e-12)
    naive, _ = NaiveBackend().run(AttentionProblem(q, k, v, None, params))
    torch.testing.assert_close(naive, ref, rtol=1e-12, atol=1e-12)


def test_dropout_seed_changes_the_output_and_none_draws_one():
    q, k, v, cu_q, cu_k = pack([17, 9], [23, 9])

    def run(**kwargs):
        return exattn.attention_varlen(q, k, v, cu_q, cu_k, 17, 23, dropout_p=0.5, **kwargs)

    assert torch.equal(run(seed=1), run(seed=1)) and not torch.equal(run(seed=1), run(seed=2))
    torch.manual_seed(0)
    x = run()
    torch.manual_seed(0)
    assert torch.equal(x, run())


# ---------------------------------------------------------------- determinism and dispatch


@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_backward_is_deterministic(backend):
    q, k, v, cu_q, cu_k = pack([40, 0, 23, 61], [50, 7, 23, 30])
    dout = torch.randn(q.shape[0], 4, 24)
    runs = [with_grads(varlen(backend, 61, 50, cu_q, cu_k, causal=True, dropout_p=0.2, seed=3), q, k, v, dout)
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_auto_uses_tiled_on_cpu_and_explains_why():
    q, k, v, cu_q, cu_k = pack([5, 8], [6, 8])
    choice = exattn.explain_varlen_backend(q, k, v, cu_q, cu_k, 8, 8)
    assert choice.name == "tiled" and choice.rejected["triton"]
    assert torch.equal(exattn.attention_varlen(q, k, v, cu_q, cu_k, 8, 8),
                       exattn.attention_varlen(q, k, v, cu_q, cu_k, 8, 8, backend="tiled"))
    assert exattn.explain_varlen_backend(q, k, v, cu_q, cu_k, 8, 8, backend="naive").name == "naive"


def test_triton_by_name_serves_what_the_kernels_take_and_says_why_not():
    """By name, the kernels run on the CPU in the interpreter; "auto" never picks them there.
    What they cannot take (float64, tiles that are not powers of two) is refused with the reason."""
    q, k, v, cu_q, cu_k = pack([5, 8], [6, 8])
    assert triton_reasons(make_varlen_problem(q, k, v, cu_q, cu_k, 8, 8)) == []
    assert exattn.explain_varlen_backend(q, k, v, cu_q, cu_k, 8, 8).name == "tiled"
    with pytest.raises(ValueError, match="backend 'triton' cannot serve these inputs.*float64"):
        exattn.attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, 8, 8, backend="triton")
    with pytest.raises(ValueError, match="block_m=24 is not a power of two"):
        exattn.attention_varlen(q, k, v, cu_q, cu_k, 8, 8, backend="triton", block_m=24)


# ---------------------------------------------------------------- on the GPU


GPU_PACKINGS = {
    "mixed": ([300, 0, 1, 1024, 77, 513], [300, 5, 1, 1024, 130, 400]),
    "equal": ([512] * 4, [512] * 4),
    "short documents": ([64, 200, 17, 1000, 129, 64, 333], [64, 200, 17, 1000, 129, 64, 333]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("packing", GPU_PACKINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_gpu_triton_kernels(packing, dtype, causal, head_dim):
    lens_q, lens_k = GPU_PACKINGS[packing]
    check(lens_q, lens_k, dtype, hq=8, hk=2, d=head_dim, dv=head_dim, causal=causal, backends=("triton",),
          device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("packing", GPU_PACKINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_gluon_backward_serves_packing_alone(packing, dtype, causal, head_dim, monkeypatch):
    """The Gluon backward on packed batches with no other rule (its plain tiles, `tile_config`), at every
    length and head dim here: it is the one called, and its sequences' stats rows are their own."""
    from exattn.backends import triton as backend
    from exattn.backends.triton import gluon_backward as gb
    from exattn.backends.triton import settings

    monkeypatch.setattr(settings, "replay", False)  # a replayed call would not reach the kernels' entry
    monkeypatch.setitem(backend.GLUON_PACKED_BACKWARD_MIN_LEN, head_dim, 1)
    calls = []
    real = gb.run_gluon_backward
    monkeypatch.setattr(gb, "run_gluon_backward", lambda *args: calls.append(1) or real(*args))
    lens_q, lens_k = GPU_PACKINGS[packing]
    check(lens_q, lens_k, dtype, hq=8, hk=2, d=head_dim, dv=head_dim, causal=causal, backends=("triton",),
          device="cuda")
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("atomic_dq", [False, True])
def test_gpu_window_dropout_and_atomic_dq(monkeypatch, atomic_dq):
    from exattn.backends.triton.passes import settings

    monkeypatch.setattr(settings, "atomic_dq", atomic_dq)
    lens_q, lens_k = GPU_PACKINGS["mixed"]
    check(lens_q, lens_k, torch.bfloat16, hq=8, hk=2, d=128, dv=64, window=(100, 7), dropout_p=0.2,
          slack=(3, 5), backends=("triton",), device="cuda")


@pytest.mark.gpu
def test_gpu_backward_is_bitwise_reproducible():
    q, k, v, cu_q, cu_k = (x.cuda() for x in pack([300, 0, 1, 1024, 77], [300, 5, 1, 1024, 130], hq=8, hk=2,
                                                   d=128, dv=128, dtype=torch.bfloat16))
    dout = torch.randn(q.shape[0], 8, 128, device="cuda")
    runs = [with_grads(varlen("triton", 1024, 1024, cu_q, cu_k, causal=True), q, k, v, dout) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


# ---------------------------------------------------------------- bad input


def args(lens_q=(3, 5), lens_k=(4, 6), **kwargs):
    q, k, v, cu_q, cu_k = pack(list(lens_q), list(lens_k), hq=4, hk=2, d=8, dv=8)
    return {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 5,
            "max_seqlen_k": 6, **kwargs}


def cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


BAD = [  # (id, arguments, error, the argument the message names, a piece of the message)
    ("offsets not starting at 0", args(cu_seqlens_q=cu(1, 3, 8)), ValueError, "cu_seqlens_q", "must start at 0"),
    ("non-monotone offsets", args(cu_seqlens_k=cu(0, 7, 6, 10), cu_seqlens_q=cu(0, 3, 3, 8), max_seqlen_k=7),
     ValueError, "cu_seqlens_k", "must be non-decreasing, got cu_seqlens_k[2] = 6 < cu_seqlens_k[1] = 7"),
    ("last offset is not the total", args(cu_seqlens_q=cu(0, 3, 7)), ValueError, "cu_seqlens_q",
     "must end at total_q = 8, got cu_seqlens_q[-1] = 7"),
    ("a length over max_seqlen", args(max_seqlen_q=4), ValueError, "max_seqlen_q",
     "must be at least the longest sequence, got sequence 1 of length 5"),
    ("rows that cannot fit", args(max_seqlen_k=2), ValueError, "max_seqlen_k", "total_k = 10 rows cannot be packed"),
    ("int64 offsets", args(cu_seqlens_q=cu(0, 3, 8, dtype=torch.int64)), TypeError, "cu_seqlens_q",
     "must be torch.int32, got torch.int64"),
    ("2-D offsets", args(cu_seqlens_k=cu(0, 4, 10)[None]), ValueError, "cu_seqlens_k", "must be 1-D"),
    ("offsets not a tensor", args(cu_seqlens_q=[0, 3, 8]), TypeError, "cu_seqlens_q", "got list"),
    ("offsets of different lengths", args(cu_seqlens_k=cu(0, 4, 4, 10)), ValueError, "cu_seqlens_k",
     "has 4 entries but cu_seqlens_q has 3"),
    ("k and v heads differ", args(v=torch.randn(10, 1, 8)), ValueError, "v", "v has 1 heads but k has 2"),
    ("Hq % Hk != 0", args(q=torch.randn(8, 3, 8)), ValueError, "heads",
     "query heads (3) must be a multiple of key/value heads (2)"),
    ("k and v rows differ", args(v=torch.randn(9, 2, 8)), ValueError, "v", "v has 9 keys but k has 10"),
    ("head dims differ", args(k=torch.randn(10, 2, 7)), ValueError, "k", "k has head dim 7 but q has 8"),
    ("4-D q", args(q=torch.randn(1, 8, 4, 8)), ValueError, "q", "q must have 3 dims (total, heads, dim)"),
    ("mixed dtypes", args(k=torch.randn(10, 2, 8, dtype=torch.float64)), TypeError, "k",
     "k has dtype torch.float64 but q has torch.float32"),
    ("integer q", args(q=torch.zeros(8, 4, 8, dtype=torch.int32)), TypeError, "q", "q must be float16"),
    ("max_seqlen negative", args(max_seqlen_q=-1), ValueError, "max_seqlen_q", "must be in [0, 2**31) (int32 offsets), got -1"),
    ("max_seqlen past int32", args(max_seqlen_k=2**70), ValueError, "max_seqlen_k", f"got {2**70}"),
    ("max_seqlen a float", args(max_seqlen_k=6.0), TypeError, "max_seqlen_k", "must be a Python int, got float"),
    ("max_seqlen a tensor", args(max_seqlen_k=torch.tensor(6)), TypeError, "max_seqlen_k", "got Tensor"),
    ("unknown backend", args(backend="cuda"), ValueError, "backend", "backend must be one of"),
    ("validate not a bool", args(validate="yes"), TypeError, "validate", "must be a bool"),
    ("return_lse not a bool", args(return_lse=torch.ones(1)), TypeError, "return_lse", "must be a bool"),
    ("dropout out of range", args(dropout_p=1.0), ValueError, "dropout_p", "must be in [0, 1)"),
    ("window malformed", args(window=(3,)), ValueError, "window", "must be a pair"),
    ("block_m zero", args(block_m=0), ValueError, "block_m", "must be a positive int, got 0"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_refused_naming_the_argument(case):
    _, kwargs, error, name, message = case
    kwargs = dict(kwargs)
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    positional = [kwargs.pop(n) for n in names]
    with pytest.raises(error) as info:
        exattn.attention_varlen(*positional, **kwargs)
    assert name in str(info.value) and message in str(info.value), str(info.value)


def test_offsets_on_another_device_are_refused():
    kwargs = args()
    with pytest.raises(ValueError, match="cu_seqlens_k is on meta but q is on cpu"):
        exattn.attention_varlen(*list(kwargs.values())[:4], kwargs["cu_seqlens_k"].to("meta"), 5, 6)


def test_validate_false_skips_the_checks_that_read_offsets():
    """validate=False reads no offset values for checking (bad offsets are then undefined
    behaviour: this only asserts that no check fires); shape checks still run."""
    for bad in ({"cu_seqlens_q": cu(1, 3, 8)}, {"cu_seqlens_q": cu(0, 3, 7)}, {"max_seqlen_q": 4},
                {"cu_seqlens_k": cu(0, 7, 6, 10), "cu_seqlens_q": cu(0, 3, 3, 8), "max_seqlen_k": 7}):
        kwargs = args(**bad)
        problem = make_varlen_problem(*kwargs.values(), validate=False)
        assert not problem.validated
        with pytest.raises(ValueError):
            make_varlen_problem(*kwargs.values())
    with pytest.raises(TypeError, match="cu_seqlens_q must be torch.int32"):
        make_varlen_problem(*args(cu_seqlens_q=cu(0, 3, 8, dtype=torch.int64)).values(), validate=False)


def test_offsets_are_read_once_per_tensor_until_written(monkeypatch):
    """validate=True reads a cu_seqlens tensor once; the same tensor again (the next layer) is not read,
    a write to it (an in-place torch op) or other totals are, and a bad write is refused."""
    from exattn import varlen as varlen_module

    reads = []
    real = varlen_module.offsets_to_host
    monkeypatch.setattr(varlen_module, "offsets_to_host", lambda x: reads.append(x) or real(x))
    monkeypatch.setattr(varlen_module, "CHECKED_OFFSETS", {})  # other tests' entries may fill it to its bound
    q, k, v, cu_q, cu_k = pack([3, 5], [4, 6])
    for _ in range(3):
        make_varlen_problem(q, k, v, cu_q, cu_k, 5, 6)
    assert len(reads) == 2  # q's offsets and k's, once each
    make_varlen_problem(q, k, v, cu_q, cu_k, 7, 6)  # another max_seqlen_q
    assert len(reads) == 3
    make_varlen_problem(q, k, v, cu_q.clone(), cu_k, 5, 6)  # the same values in another tensor
    assert len(reads) == 4
    cu_q[1] = 6  # sequence 0 now 6 > max_seqlen_q = 5
    with pytest.raises(ValueError, match="max_seqlen_q = 5"):
        make_varlen_problem(q, k, v, cu_q, cu_k, 5, 6)


@pytest.mark.parametrize("backend", ["tiled", "naive"])
def test_no_autograd_node_without_a_wanted_gradient(backend):
    """Inputs that need no gradient (or grad mode off) run the forward pass alone; with one wanted the
    output has its backward node."""
    q, k, v, cu_q, cu_k = pack([3, 5], [4, 6])
    out = exattn.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, backend=backend)
    assert out.grad_fn is None
    q.requires_grad_(True)
    with torch.no_grad():
        assert exattn.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, backend=backend).grad_fn is None
    out = exattn.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, backend=backend)
    assert out.grad_fn is not None
    torch.testing.assert_close(out.detach(), exattn.attention_varlen(q.detach(), k, v, cu_q, cu_k, 5, 6,
                                                                     backend=backend), rtol=0, atol=0)
