"""The tiled and naive backends against the float64 oracle."""

import pytest
import torch

import exattn
from exattn.reference import attention_ref
from error_rule import assert_matches_oracle

SHAPES = {  # B, Hq, Hk, Nq, Nk, D, Dv
    "single": (1, 1, 1, 1, 1, 8, 8),
    "decode-like": (2, 4, 2, 1, 45, 24, 24),
    "gqa-dv": (2, 4, 2, 37, 53, 24, 40),
    "odd-dim": (1, 2, 2, 64, 64, 59, 59),
    "mqa-long-k": (1, 3, 1, 29, 203, 16, 16),
    "nq-gt-nk": (2, 2, 2, 77, 31, 32, 8),
}


def rand(*shape, dtype, scale=1.0, gen=None):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def make_inputs(shape, dtype, seed=0, logit_scale=1.0):
    b, hq, hk, nq, nk, d, dv = shape
    g = torch.Generator().manual_seed(seed)
    q = rand(b, hq, nq, d, dtype=dtype, scale=logit_scale, gen=g)
    k = rand(b, hk, nk, d, dtype=dtype, gen=g)
    v = rand(b, hk, nk, dv, dtype=dtype, gen=g)
    return q, k, v


def make_mask(kind, shape, seed=1):
    b, hq, _, nq, nk, _, _ = shape
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        mask = torch.rand(b, 1, nq, nk, generator=g) > 0.3
        mask[:, :, nq // 2] = False  # a fully masked row
        return {"mask": mask}
    if kind == "bias":
        bias = torch.randn(1, hq, nq, nk, generator=g)
        bias[torch.rand(1, hq, nq, nk, generator=g) < 0.2] = float("-inf")
        return {"mask": bias}
    if kind == "padding":
        return {"mask": torch.arange(nk)[None, None, None, :] < max(1, nk - 5)}
    return {
        "none": {},
        "causal": {"causal": True},
        "window": {"window": (5, 3)},
        "left-window": {"window": (6, -1)},
        "causal-window": {"causal": True, "window": (4, -1)},
    }[kind]


def run_with_grads(fn, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out, lse = fn(q, k, v)
    out.backward(dout.to(out.dtype))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def check_backend(backend, shape, dtype, mask_kind="none", tiles=(None, None), seed=0,
                  logit_scale=1.0, dropout_p=0.0, transform=lambda x: x):
    q, k, v = (transform(x) for x in make_inputs(shape, dtype, seed, logit_scale))
    kwargs = make_mask(mask_kind, shape)
    if "mask" in kwargs and kwargs["mask"].is_floating_point():
        kwargs["mask"] = kwargs["mask"].to(dtype)
    dout = torch.randn(*q.shape[:3], v.shape[3], dtype=torch.float64)
    drop = {"dropout_p": dropout_p, "seed": 1234} if dropout_p else {}

    def ours(q, k, v):
        return exattn.attention(q, k, v, backend=backend, block_m=tiles[0], block_n=tiles[1],
                                return_lse=True, **kwargs, **drop)

    def naive(q, k, v):
        return exattn.attention(q, k, v, backend="naive", return_lse=True, **kwargs, **drop)

    def oracle(q, k, v):
        keep = None
        if dropout_p:
            keep = exattn.dropout_mask(1234, (*q.shape[:3], k.shape[2]), dropout_p)
        return attention_ref(q, k, v, return_lse=True, dropout_mask=keep,
                             dropout_p=dropout_p if dropout_p else None, **kwargs)

    results = [run_with_grads(f, q, k, v, dout) for f in (ours, naive, oracle)]
    names = ("out", "lse", "dq", "dk", "dv")
    assert results[0][0].dtype == dtype and results[0][1].dtype == torch.float32
    for name, mine, base, ref in zip(names, *results):
        assert_matches_oracle(f"{backend}/{name}", mine, base, ref, dtype)


MASKS = ["none", "causal", "window", "left-window", "causal-window", "bool", "bias", "padding"]


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("mask_kind", MASKS)
def test_tiled_float32_every_shape_and_mask(shape, mask_kind):
    check_backend("tiled", shape, torch.float32, mask_kind, tiles=(16, 24))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bias"])
def test_tiled_low_and_high_precision(dtype, mask_kind):
    check_backend("tiled", SHAPES["gqa-dv"], dtype, mask_kind, tiles=(16, 16))


@pytest.mark.parametrize("tiles", [(1, 1), (7, 13), (16, 16), (64, 256), (None, None)])
def test_tile_sizes_that_do_not_divide_the_lengths(tiles):
    check_backend("tiled", SHAPES["mqa-long-k"], torch.float32, "causal", tiles=tiles)


def test_any_tile_size_computes_the_same_function():
    q, k, v = make_inputs(SHAPES["gqa-dv"], torch.float64)
    outs = [exattn.attention(q, k, v, causal=True, backend="tiled", block_m=bm, block_n=bn)
            for bm, bn in [(1, 1), (5, 9), (16, 64), (128, 128)]]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-13, atol=1e-13)



def test_few_query_rows_take_wide_key_tiles_in_the_forward_only():
    from exattn.backends.tiled import FEW_ROWS, FEW_ROWS_ELEMENTS, MAX_BLOCK_N, default_blocks

    assert default_blocks(2, 1, 4096) == (16, 4096)  # one key tile: 8192 scores
    assert default_blocks(128, 1, 16384)[1] == FEW_ROWS_ELEMENTS // 128
    assert default_blocks(2, FEW_ROWS, 300)[1] == 300
    assert default_blocks(2, 1, 4096, backward=True)[1] == MAX_BLOCK_N
    assert default_blocks(2, FEW_ROWS + 1, 4096)[1] == MAX_BLOCK_N
    torch.manual_seed(0)
    q = torch.randn(1, 2, 3, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 2000, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = exattn.attention(q, k, v, causal=True, backend="tiled")
    ref = attention_ref(q, k, v, causal=True)
    assert torch.allclose(out, ref, atol=1e-12)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref_grads = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(grads, ref_grads))


def test_huge_logits():
    check_backend("tiled", SHAPES["gqa-dv"], torch.float32, "causal", tiles=(16, 16), logit_scale=300.0)
    check_backend("tiled", SHAPES["gqa-dv"], torch.bfloat16, "none", tiles=(16, 16), logit_scale=300.0)


def test_non_contiguous_inputs():
    def strided(x):  # (B, H, N, D) stored as (B, N, H, 2D) and sliced
        wide = torch.cat([x, torch.randn_like(x)], dim=-1).transpose(1, 2).contiguous()
        return wide.transpose(1, 2)[..., : x.shape[-1]]

    check_backend("tiled", SHAPES["gqa-dv"], torch.float32, "bias", tiles=(16, 8), transform=strided)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_naive_backend_is_the_textbook_formula(dtype):
    q, k, v = make_inputs(SHAPES["gqa-dv"], dtype)
    out = exattn.attention(q, k, v, backend="naive")
    ref = attention_ref(q, k, v)
    scale = max(1.0, float(ref.abs().max()))
    assert (out.double() - ref).abs().max() < {torch.float32: 1e-5, torch.float16: 5e-3}[dtype] * scale


@pytest.mark.parametrize("backend", ["tiled", "naive"])
def test_fully_masked_rows_give_zeros_minus_inf_and_zero_grads(backend):
    b, hq, hk, nq, nk, d, dv = 1, 2, 1, 9, 4, 8, 8  # causal with Nq > Nk: rows 0..4 see nothing
    q, k, v = make_inputs((b, hq, hk, nq, nk, d, dv), torch.float32)
    mask = torch.ones(nq, nk, dtype=torch.bool)
    mask[7] = False
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out, lse = exattn.attention(q, k, v, causal=True, mask=mask, backend=backend,
                                block_m=4, block_n=2, return_lse=True)
    out.backward(torch.randn_like(out))
    empty_rows = [0, 1, 2, 3, 4, 7]
    assert torch.equal(out[:, :, empty_rows], torch.zeros_like(out[:, :, empty_rows]))
    assert torch.isneginf(lse[:, :, empty_rows]).all()
    assert torch.isfinite(lse[:, :, [5, 6, 8]]).all()
    assert torch.equal(q.grad[:, :, empty_rows], torch.zeros_like(q.grad[:, :, empty_rows]))
    for t in (out, lse, q.grad, k.grad, v.grad):
        assert not torch.isnan(t).any()


@pytest.mark.parametrize("backend", ["tiled", "naive", "triton"])
@pytest.mark.parametrize("empty", ["batch", "query heads", "queries"])
@pytest.mark.parametrize("rules", [{}, {"prefix": 2, "softcap": 3.0, "dropout_p": 0.2, "seed": 1}])
def test_no_query_row_gives_empty_outputs_and_zero_grads(backend, empty, rules):
    """B, Hq or Nq of 0 (Hk >= 1): empty out and lse, empty dq, zero dk and dv; nothing raises."""
    b, hq, nq = {"batch": (0, 2, 5), "query heads": (2, 0, 5), "queries": (2, 2, 0)}[empty]
    q = torch.randn(b, hq, nq, 8, requires_grad=True)
    k, v = (torch.randn(b, 1, 6, 8, requires_grad=True) for _ in range(2))
    segments = {"segment_ids": (torch.zeros(b, nq, dtype=torch.int32), torch.zeros(b, 6, dtype=torch.int32))}
    out, lse = exattn.attention(q, k, v, causal=True, backend=backend, return_lse=True, **rules, **segments)
    assert out.shape == (b, hq, nq, 8) and lse.shape == (b, hq, nq) and lse.dtype == torch.float32
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert dq.shape == q.shape
    assert torch.equal(dk, torch.zeros_like(k)) and torch.equal(dv, torch.zeros_like(v))


def test_everything_masked_with_minus_inf_bias():
    q, k, v = make_inputs((1, 1, 1, 5, 7, 8, 8), torch.float32)
    bias = torch.full((5, 7), float("-inf"))
    out, lse = exattn.attention(q, k, v, mask=bias, backend="tiled", return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_nan_input_gives_nan_output():
    q, k, v = make_inputs((1, 1, 1, 4, 6, 8, 8), torch.float32)
    q[0, 0, 2, 3] = float("nan")
    out = exattn.attention(q, k, v, backend="tiled")
    assert torch.isnan(out[0, 0, 2]).all() and not torch.isnan(out[0, 0, [0, 1, 3]]).any()


def test_gradcheck_float64():
    q, k, v = (x.requires_grad_(True) for x in make_inputs((1, 2, 1, 6, 9, 5, 3), torch.float64))
    bias = torch.randn(6, 9, dtype=torch.float64)
    for kwargs in ({}, {"causal": True, "mask": bias}, {"window": (2, 1)},
                   {"dropout_p": 0.3, "seed": 7, "causal": True}):
        assert torch.autograd.gradcheck(
            lambda q, k, v: exattn.attention(q, k, v, backend="tiled", block_m=4, block_n=4, **kwargs),
            (q, k, v),
        )


def test_auto_uses_tiled_on_cpu_and_explains_why():
    q, k, v = make_inputs(SHAPES["gqa-dv"], torch.float32)
    choice = exattn.explain_backend(q, k, v)
    assert choice.name == "tiled"
    assert choice.rejected["triton"], "auto must say why triton was passed over"
    torch.testing.assert_close(exattn.attention(q, k, v),
                               exattn.attention(q, k, v, backend="tiled"))


def test_raw_backward_rejects_bad_accumulators():
    from exattn.backends.tiled import tiled_backward
    from exattn.problem import make_problem

    q, k, v = make_inputs(SHAPES["gqa-dv"], torch.float32)
    params = make_problem(q, k, v).params
    dout, lse = torch.randn(2, 4, 37, 40), torch.zeros(2, 4, 37)
    good = [torch.zeros(x.shape) for x in (q, k, v)]
    with pytest.raises(TypeError, match="accumulate_into must be None or a \\(dq, dk, dv\\) tuple"):
        tiled_backward(dout, q, k, v, None, dout, lse, params, accumulate_into=good[0])
    with pytest.raises(TypeError, match="accumulate_into dk must be a torch.Tensor, got list"):
        tiled_backward(dout, q, k, v, None, dout, lse, params, accumulate_into=(good[0], [], good[2]))
    with pytest.raises(ValueError, match=r"accumulate_into dv must be torch.float32 of shape \(2, 2, 53, 40\).*"
                                         r"got torch.float16 of shape"):
        tiled_backward(dout, q, k, v, None, dout, lse, params, accumulate_into=(*good[:2], good[2].half()))
    with pytest.raises(ValueError, match=r"accumulate_into dq must be torch.float32 of shape \(2, 4, 37, 24\)"):
        tiled_backward(dout, q, k, v, None, dout, lse, params, accumulate_into=(good[1], *good[1:]))
