"""The Triton backend on a CUDA GPU (`pytest -m gpu`): bf16/fp16 at larger shapes, same error rule.

Run on the device machine through benchmarks/gpu_run.sh. References are
computed on the GPU: the float64 oracle and the naive backend in the same dtype.
"""

from __future__ import annotations

import pytest
import torch

import exattn
from exattn.backends.triton import settings
from exattn.reference import attention_ref
from error_rule import assert_matches_oracle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
SEED = 77


def inputs(b, hq, hk, nq, nk, d, dv, dtype, layout="bhnd"):
    def one(h, n, dim):
        if layout == "bnhd":
            x = torch.randn(b, n, h, dim, device=DEVICE).transpose(1, 2)
        else:
            x = torch.randn(b, h, n, dim, device=DEVICE)
        return x.to(dtype).requires_grad_()
    return one(hq, nq, d), one(hk, nk, d), one(hk, nk, dv)


def forward_backward(q, k, v, dout, **kwargs):
    out, lse = exattn.attention(q, k, v, return_lse=True, **kwargs)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))


def check(q, k, v, dropout_p=0.0, **kwargs):
    dout = torch.randn(q.shape[:3] + (v.shape[3],), device=DEVICE).to(q.dtype)
    common = dict(kwargs, dropout_p=dropout_p, seed=SEED)
    ours = forward_backward(q, k, v, dout, backend="triton", **common)
    naive = forward_backward(q, k, v, dout, backend="naive", **common)
    ref_kwargs = dict(kwargs)
    if dropout_p:
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        ref_kwargs.update(dropout_mask=exattn.dropout_mask(SEED, shape, dropout_p, device=DEVICE),
                          dropout_p=dropout_p)
    ref_out, ref_lse = attention_ref(q, k, v, return_lse=True, **ref_kwargs)
    ref = (ref_out, ref_lse, *torch.autograd.grad(ref_out, (q, k, v), dout.double()))
    for name, a, b, r in zip(("out", "lse", "dq", "dk", "dv"), ours, naive, ref):
        assert_matches_oracle(name, a, b, r, q.dtype)
    return ours


DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_benchmark_head_dims(dtype, d, causal):
    torch.manual_seed(0)
    check(*inputs(2, 4, 4, 1000, 1000, d, d, dtype), causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [
    (1, 8, 2, 777, 1333, 96, 80),    # GQA, Dv != D, ragged, Nq < Nk
    (2, 3, 1, 515, 257, 40, 40),     # MQA, Nq > Nk (rows with no key under causal)
    (1, 2, 2, 300, 300, 256, 256),   # widest head
    (3, 2, 1, 1, 900, 59, 59),       # one query, odd dim (pointer path)
])
def test_awkward_shapes(dtype, shape):
    torch.manual_seed(1)
    check(*inputs(*shape, dtype), causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_masks_dropout_strided(dtype):
    torch.manual_seed(2)
    q, k, v = inputs(2, 4, 2, 600, 700, 64, 64, dtype, layout="bnhd")
    bias = torch.randn(2, 1, 600, 700, device=DEVICE)
    bias[:, :, 17] = float("-inf")
    check(q, k, v, window=(100, 30), mask=bias)
    keep = torch.rand(1, 4, 1, 700, device=DEVICE) > 0.3
    check(q, k, v, causal=True, mask=keep, dropout_p=0.25)


def test_float32_is_ieee():
    torch.manual_seed(3)
    check(*inputs(1, 2, 1, 333, 444, 72, 64, torch.float32), causal=True)


@pytest.mark.parametrize("atomic", [False, True])
def test_gradients_rerun_bitwise_unless_atomic(monkeypatch, atomic):
    monkeypatch.setattr(settings, "atomic_dq", atomic)
    torch.manual_seed(4)
    q, k, v = inputs(2, 8, 2, 2048, 2048, 128, 128, torch.bfloat16)
    dout = torch.randn(2, 8, 2048, 128, device=DEVICE, dtype=torch.bfloat16)
    runs = [forward_backward(q, k, v, dout, backend="triton", causal=True) for _ in range(3)]
    if atomic:
        check(q, k, v, causal=True)
    else:
        for other in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


@pytest.mark.parametrize("tma", [False, True])
def test_tma_and_pointer_paths_agree(monkeypatch, tma):
    monkeypatch.setattr(settings, "use_tma", tma)
    torch.manual_seed(5)
    check(*inputs(1, 4, 4, 1024, 1024, 128, 128, torch.bfloat16), causal=True)


def test_many_heads_grid():
    torch.manual_seed(6)
    check(*inputs(64, 1100, 1100, 17, 17, 16, 16, torch.bfloat16))


def test_64bit_row_offsets():
    """q rows * row stride crosses 2**31 elements: offsets must be 64-bit."""
    torch.manual_seed(7)
    n = 2**24 + 300
    q = torch.randn(1, 1, n, 128, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(1, 1, 64, 128, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(1, 1, 64, 128, device=DEVICE, dtype=torch.bfloat16)
    out = exattn.attention(q, k, v, backend="triton")
    tail = slice(n - 500, n)
    ref = attention_ref(q[:, :, tail], k, v)
    naive = exattn.attention(q[:, :, tail], k, v, backend="naive")
    assert_matches_oracle("out tail", out[:, :, tail], naive, ref, torch.bfloat16)


def test_auto_picks_triton_on_cuda():
    q, k, v = inputs(1, 2, 2, 128, 128, 64, 64, torch.bfloat16)
    assert exattn.explain_backend(q, k, v).name == "triton"


@pytest.mark.parametrize("atomic", [False, True])
def test_backward_accumulates_into_float32_views(monkeypatch, atomic):
    """accumulate_into (ring attention's path): adds into strided float32 views, bitwise repeatable."""
    from exattn.backends import get_backend
    from exattn.problem import make_problem

    monkeypatch.setattr(settings, "atomic_dq", atomic)
    torch.manual_seed(8)
    q, k, v = inputs(2, 8, 2, 1500, 2048, 128, 128, torch.bfloat16)
    dout = torch.randn(2, 8, 1500, 128, device=DEVICE, dtype=torch.bfloat16)
    backend, params = get_backend("triton"), make_problem(q, k, v, causal=True).params
    args = [x.detach() for x in (q, k, v)]
    out, lse = backend.forward(*args, None, params)
    bigs = [torch.randn(x.shape[0], x.shape[1], x.shape[2] + 64, x.shape[3], device=DEVICE) for x in (q, k, v)]

    def accumulate():
        accs = [big.clone()[:, :, 64:] for big in bigs]
        backend.backward(dout, *args, None, out, lse, params, accumulate_into=tuple(accs))
        return accs

    first, second = accumulate(), accumulate()
    ref_out = attention_ref(q, k, v, causal=True)
    ref = torch.autograd.grad(ref_out, (q, k, v), dout.double())
    naive = torch.autograd.grad(exattn.attention(q, k, v, causal=True, backend="naive"), (q, k, v), dout)
    for name, a, b, big, n, r in zip(("dq", "dk", "dv"), first, second, bigs, naive, ref):
        assert torch.equal(a._base[:, :, :64], big[:, :, :64]), f"{name}: wrote outside its view"
        assert_matches_oracle(name, a - big[:, :, 64:], n, r, torch.bfloat16)
        if not (atomic and name == "dq"):
            assert torch.equal(a, b), f"{name}: not bitwise repeatable"
