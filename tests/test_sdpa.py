"""`exattn.sdpa` against PyTorch SDPA's math backend.

The oracle is SDPA's math backend in float64; the baseline it is judged
relative to (the shared error rule) is the same math backend in the test dtype.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import exattn
from error_rule import assert_matches_oracle

SHAPES = {  # query shape, key shape, value shape
    "square": ((2, 3, 37, 24), (2, 3, 37, 24), (2, 3, 37, 24)),
    "nq<nk": ((2, 2, 13, 40), (2, 2, 45, 40), (2, 2, 45, 16)),
    "nq>nk": ((1, 2, 45, 24), (1, 2, 13, 24), (1, 2, 13, 24)),
    "nq=1": ((2, 4, 1, 59), (2, 4, 29, 59), (2, 4, 29, 59)),
    "3d": ((3, 21, 24), (3, 34, 24), (3, 34, 8)),
    "2d": ((21, 24), (34, 24), (34, 24)),
    "5d-broadcast": ((2, 2, 3, 11, 16), (1, 2, 3, 17, 16), (2, 1, 3, 17, 16)),
    "mqa-broadcast": ((2, 4, 19, 24), (2, 1, 23, 24), (2, 1, 23, 24)),
}


def make(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def make_mask(kind, query, key, seed=1):
    g = torch.Generator().manual_seed(seed)
    rows, cols = query.shape[-2], key.shape[-2]
    if kind == "none":
        return None
    if kind == "bool":
        mask = torch.rand(rows, cols, generator=g) > 0.4
        mask[rows // 2] = False  # a row with nothing to attend
        return mask
    if kind == "bool-per-head":
        heads = query.shape[-3] if query.dim() >= 3 else 1
        mask = torch.rand(heads, rows, cols, generator=g) > 0.4
        mask[..., 0, :] = False
        return mask
    bias = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    bias[torch.rand(rows, cols, generator=g) < 0.2] = float("-inf")
    bias[-1] = float("-inf")  # a row with nothing to attend
    return bias


def math_sdpa(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


def forward_backward(fn, inputs, dout, **kwargs):
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*inputs, **kwargs)
    out.backward(dout.to(out.dtype))
    return [out.detach()] + [x.grad for x in inputs]


def check_against_math(shapes, dtype, mask_kind="none", transform=lambda x: x, **kwargs):
    q, k, v = (transform(x) for x in make(shapes, dtype))
    mask = make_mask(mask_kind, q, k)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    mask64 = mask.double() if mask is not None and mask.is_floating_point() else mask
    dout = torch.randn(math_sdpa(q, k, v, attn_mask=mask, **kwargs).shape, dtype=torch.float64)
    ours = forward_backward(exattn.sdpa, (q, k, v), dout, attn_mask=mask, **kwargs)
    naive = forward_backward(math_sdpa, (q, k, v), dout, attn_mask=mask, **kwargs)
    ref = forward_backward(math_sdpa, [x.double() for x in (q, k, v)], dout, attn_mask=mask64, **kwargs)
    assert ours[0].shape == ref[0].shape and ours[0].dtype == dtype
    for name, mine, base, oracle in zip(("out", "dq", "dk", "dv"), ours, naive, ref):
        assert mine.shape == oracle.shape, name
        assert_matches_oracle(name, mine, base, oracle, dtype)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "bias"])
def test_matches_sdpa_math_float32(shape, mask_kind):
    if mask_kind == "causal":
        check_against_math(shape, torch.float32, is_causal=True)
    else:
        check_against_math(shape, torch.float32, mask_kind)


@pytest.mark.parametrize("shape", ["nq<nk", "nq>nk", "nq=1"])
@pytest.mark.parametrize("kind", ["causal", "bool-per-head", "bias"])
def test_grouped_query_attention(shape, kind):
    q, k, v = SHAPES[shape]
    q = q[:1] + (4,) + q[2:]  # 4 query heads share 2 K/V heads
    k, v = (s[:1] + (2,) + s[2:] for s in (k, v))
    if kind == "causal":
        check_against_math((q, k, v), torch.float32, enable_gqa=True, is_causal=True)
    else:
        check_against_math((q, k, v), torch.float32, kind, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_with_scale(dtype):
    check_against_math(SHAPES["nq>nk"], dtype, is_causal=True, scale=0.37)
    check_against_math(SHAPES["nq<nk"], dtype, "bias", scale=0.11)


def test_non_contiguous_inputs():
    def strided(x):  # stored with the last two dims swapped, then viewed back
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)

    check_against_math(SHAPES["nq<nk"], torch.float32, "bool", transform=strided)


def test_rows_with_nothing_to_attend_are_zero_with_zero_grads():
    q, k, v = (x.requires_grad_(True) for x in make(SHAPES["square"], torch.float32))
    mask = torch.ones(37, 37, dtype=torch.bool)
    mask[[0, 5, 36]] = False
    out = exattn.sdpa(q, k, v, attn_mask=mask)
    out.backward(torch.randn_like(out))
    assert torch.equal(out[:, :, [0, 5, 36]], torch.zeros_like(out[:, :, [0, 5, 36]]))
    assert torch.equal(q.grad[:, :, [0, 5, 36]], torch.zeros_like(q.grad[:, :, [0, 5, 36]]))
    assert not any(torch.isnan(t).any() for t in (out, q.grad, k.grad, v.grad))


def test_causal_is_top_left_not_bottom_right():
    q, k, v = make(SHAPES["nq<nk"], torch.float64)
    top_left = exattn.sdpa(q, k, v, is_causal=True)
    keys_before = exattn.attention(q, k[:, :, :13], v[:, :, :13], causal=True)  # j <= i
    torch.testing.assert_close(top_left, keys_before, rtol=0, atol=0)
    bottom_right = exattn.attention(q, k, v, causal=True)
    assert (top_left - bottom_right).abs().max() > 0.1


def test_empty_sequences_like_sdpa():
    q, k, v = make(((2, 3, 0, 8), (2, 3, 5, 8), (2, 3, 5, 4)), torch.float32)
    assert exattn.sdpa(q, k, v).shape == math_sdpa(q, k, v).shape == (2, 3, 0, 4)
    q, k, v = make(((2, 3, 4, 8), (2, 3, 0, 8), (2, 3, 0, 4)), torch.float32)
    assert torch.equal(exattn.sdpa(q, k, v), math_sdpa(q, k, v))


def test_dropout_is_exattn_philox_seeded_from_torch():
    q, k, v = make(SHAPES["nq<nk"], torch.float32)
    torch.manual_seed(3)
    first = exattn.sdpa(q, k, v, dropout_p=0.3, is_causal=True)
    torch.manual_seed(3)
    again = exattn.sdpa(q, k, v, dropout_p=0.3, is_causal=True)
    torch.manual_seed(3)
    same_stream = exattn.attention(q, k[:, :, :13], v[:, :, :13], dropout_p=0.3, causal=True)
    assert torch.equal(first, again) and torch.equal(first, same_stream)
    assert (first - exattn.sdpa(q, k, v, is_causal=True)).abs().max() > 0.1


def qkv():
    return make(((1, 4, 5, 8), (1, 2, 6, 8), (1, 2, 6, 8)), torch.float32)


BAD = [
    ("query not a tensor", lambda q, k, v: ((q.tolist(), k, v), {}), TypeError, "query must be a torch.Tensor"),
    ("integer key", lambda q, k, v: ((q, k.long(), v), {}), TypeError, "key must be float16"),
    ("1-d value", lambda q, k, v: ((q, k, v[0, 0, 0]), {}), ValueError, "value must have at least 2 dims"),
    ("mixed dtypes", lambda q, k, v: ((q, k, v.double()), {}), TypeError, "value has dtype torch.float64"),
    ("head dim", lambda q, k, v: ((q, k[..., :7], v), {}), ValueError, "key has head dim 7"),
    ("lengths", lambda q, k, v: ((q, k, v[:, :, :5]), {}), ValueError, "value has 5 keys but key has 6"),
    ("heads differ without gqa", lambda q, k, v: ((q, k, v), {}), ValueError, "pass enable_gqa=True"),
    ("gqa not divisible", lambda q, k, v: ((q[:, :3], k, v), {"enable_gqa": True}), ValueError,
     "query heads (3) must be a multiple of key/value heads (2)"),
    ("gqa without k/v heads", lambda q, k, v: ((q, k[:, :0], v[:, :0]), {"enable_gqa": True}), ValueError,
     "with enable_gqa, key and value have no heads"),
    ("gqa k/v heads differ", lambda q, k, v: ((q, k, v[:, :1]), {"enable_gqa": True}), ValueError,
     "key (2) and value (1) must have the same number of heads"),
    ("batch does not broadcast", lambda q, k, v: ((q.expand(3, -1, -1, -1), k.expand(2, -1, -1, -1),
                                                   v.expand(2, -1, -1, -1)), {"enable_gqa": True}),
     ValueError, "do not broadcast"),
    ("mask and causal", lambda q, k, v: ((q, k, v), {"enable_gqa": True, "is_causal": True,
                                                     "attn_mask": torch.ones(5, 6, dtype=torch.bool)}),
     ValueError, "attn_mask must be None when is_causal=True"),
    ("mask shape", lambda q, k, v: ((q, k, v), {"enable_gqa": True, "attn_mask": torch.ones(4, 6, dtype=torch.bool)}),
     ValueError, "attn_mask of shape (4, 6) does not broadcast to (..., Hq, L, S) = (1, 4, 5, 6)"),
    ("mask dtype", lambda q, k, v: ((q, k, v), {"enable_gqa": True, "attn_mask": torch.ones(5, 6, dtype=torch.int32)}),
     TypeError, "attn_mask must be bool"),
    ("mask type", lambda q, k, v: ((q, k, v), {"enable_gqa": True, "attn_mask": [[True]]}),
     TypeError, "attn_mask must be a torch.Tensor or None, got list"),
    ("mask requires grad", lambda q, k, v: ((q, k, v), {"enable_gqa": True, "attn_mask": torch.zeros(5, 6, requires_grad=True)}),
     ValueError, "attn_mask requires grad"),
    ("dropout 1", lambda q, k, v: ((q, k, v), {"enable_gqa": True, "dropout_p": 1.0}), ValueError,
     "dropout_p must be in [0, 1)"),
    ("causal not bool", lambda q, k, v: ((q, k, v), {"enable_gqa": True, "is_causal": 1}), TypeError,
     "is_causal must be a bool"),
    ("gqa not bool", lambda q, k, v: ((q, k, v), {"enable_gqa": "yes"}), TypeError, "enable_gqa must be a bool"),
    ("scale type", lambda q, k, v: ((q, k, v), {"enable_gqa": True, "scale": "0.1"}), TypeError, "scale must be a float"),
]


@pytest.mark.parametrize("make_args, error, message", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_inputs_name_the_argument(make_args, error, message):
    args, kwargs = make_args(*qkv())
    with pytest.raises(error) as info:
        exattn.sdpa(*args, **kwargs)
    assert message in str(info.value)


def test_sdpa_also_refuses_heads_that_differ_without_gqa():
    q, k, v = qkv()
    with pytest.raises(RuntimeError):
        math_sdpa(q, k, v)
    torch.testing.assert_close(exattn.sdpa(q, k, v, enable_gqa=True), math_sdpa(q, k, v, enable_gqa=True))
