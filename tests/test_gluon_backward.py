"""The Gluon (sm_90) backward: compiled for Hopper on the CPU, run against the oracle on the GPU.

CPU (CI): every shipped configuration of both kernels (dK/dV and dQ) compiles
for sm_90a with the wheel's ptxas, without spills, inside Hopper's shared
memory, and keeps its design (warp specialization, TMA, the dP wgmma in flight
under the exponentials); `gluon_backward_supports` names every reason it
refuses. GPU (`-m gpu`): dq, dk, dv on awkward shapes against the float64
oracle with the shared error rule, bitwise reruns, accumulate_into, and the
dispatch of backend "triton".
"""

from __future__ import annotations

import re

import pytest
import torch
import triton
from error_rule import assert_matches_oracle
from test_gluon_forward import (DTYPES, HOPPER_SHARED_BYTES, SHAPES, TYPE_NAMES, cpu_inputs, gpu_inputs,
                                needs_cuda, resource_usage)
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

import exattn
from exattn.backends.triton import gluon_backward as gb
from exattn.problem import AttentionParams
from exattn.reference import attention_ref

KERNELS = {"dkdv": gb.gluon_dkdv_kernel, "dq": gb.gluon_dq_kernel}


def constants(kind: str, dim: int, causal: bool, accumulate: bool) -> dict:
    """Constexpr arguments and launch options, as `gluon_backward.launch` passes them."""
    cfg = gb.CONFIGS[dim]
    tiles = (dict(BLOCK_M=cfg.dkdv_block_m, STAGES=cfg.dkdv_stages) if kind == "dkdv"
             else dict(BLOCK_N=cfg.dq_block_n, STAGES=cfg.dq_stages))
    return dict(D=dim, CAUSAL=causal, ACCUMULATE=accumulate, **tiles)


def compile_for_sm90(kind: str, dim: int, causal: bool, dtype: torch.dtype, accumulate: bool = False):
    """One kernel as `gluon_backward` launches it for contiguous inputs, compiled for sm_90a."""
    kernel = KERNELS[kind]
    consts = constants(kind, dim, causal, accumulate)
    signature, constexprs = {}, dict(consts)
    grads = "*fp32" if accumulate else "*" + TYPE_NAMES[dtype]
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in ("Q", "K", "V", "DO"):
            signature[name] = "*" + TYPE_NAMES[dtype]
        elif name in ("DQ", "DK", "DV"):
            signature[name] = grads
        elif name in ("LSE2", "DELTA"):
            signature[name] = "*fp32"
        elif name.endswith("strides"):
            signature[name] = ("i64", "i64", "i64", "constexpr")
            constexprs[(i, 3)] = 1
        elif name.startswith("scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    source = GluonASTSource(kernel, signature=signature, constexprs=constexprs)
    options = dict(num_warps=4, maxnreg=gb.MAXNREG)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.parametrize("kind,dim,causal,dtype,accumulate", [
    ("dkdv", 128, False, torch.bfloat16, False), ("dkdv", 128, True, torch.bfloat16, False),
    ("dkdv", 64, False, torch.bfloat16, False), ("dkdv", 64, True, torch.bfloat16, False),
    ("dkdv", 128, True, torch.float16, True),
    ("dq", 128, False, torch.bfloat16, False), ("dq", 128, True, torch.bfloat16, False),
    ("dq", 64, False, torch.bfloat16, False), ("dq", 64, True, torch.bfloat16, False),
    ("dq", 128, True, torch.float16, True),
])
def test_compiles_for_sm90_without_spills(kind, dim, causal, dtype, accumulate, tmp_path):
    kernel = compile_for_sm90(kind, dim, causal, dtype, accumulate)
    usage = resource_usage(kernel, tmp_path)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"register spills: {usage}"
    assert kernel.metadata.shared <= HOPPER_SHARED_BYTES, kernel.metadata.shared
    ptx = kernel.asm["ptx"]
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx, "no warp specialization"
    assert "wgmma.wait_group.sync.aligned 1;" in ptx, "dP no longer overlaps the exponentials"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads"
    atomics = re.findall(r"^\s*(?:@!?%p\d+\s+)?(?:atom|red|cp\.reduce)\.\S*", ptx, re.MULTILINE)
    assert not atomics, f"atomics {atomics[:3]}: the backward must stay deterministic"


def test_supports_names_every_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = cpu_inputs(torch.float32, dim=81, heads=(3, 2))
    q, k = q[..., :80], k[..., :80]
    params = AttentionParams(scale=-1.0, window=(4, 0), dropout_p=0.1, block_m=64)
    dout = torch.randn(1, 3, 8, 81)[..., :48]
    reasons = " | ".join(gb.gluon_backward_supports(q, k, v[..., :48], torch.ones(8, 8, dtype=torch.bool),
                                                    params, dout))
    for words in ("CUDA", "float32", "D=80, Dv=48", "mask", "dropout_p=0.1", "window=(4, 0)",
                  "scale=-1.0", "block_m=64", "multiple of key/value heads", "TMA", "dout (shape (1, 3, 8, 48)"):
        assert words in reasons, (words, reasons)


def test_supports_refuses_lse_rows_beyond_32_bit_coordinates(monkeypatch):
    q = torch.empty(2**16, 2**8, 2**7, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2**16, 2**8, 2**7, 128, dtype=torch.bfloat16, device="meta")
    reasons = " | ".join(gb.gluon_backward_supports(q, k, k, None, AttentionParams(scale=0.1)))
    assert "exceeds 2147483647" in reasons, reasons


@pytest.mark.parametrize("interpret,words", [("0", "CUDA"), ("1", "TRITON_INTERPRET")])
def test_backward_refuses_cpu_inputs_naming_the_device(interpret, words, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q, k, v = cpu_inputs()
    params = AttentionParams(scale=0.125, window=(-1, 0))
    reasons = gb.gluon_backward_supports(q, k, v, None, params, q)
    assert len(reasons) == 1 and words in reasons[0], reasons
    lse = torch.zeros(q.shape[:3])
    with pytest.raises(ValueError, match=words):
        gb.gluon_backward(q, q, k, v, q, lse, params)


# ---------------------------------------------------------------- GPU

def params_for(d, causal):
    return AttentionParams(scale=d ** -0.5, window=(-1, 0) if causal else (-1, -1))


def saved_forward(q, k, v, params):
    from exattn.backends.triton import triton_forward

    return triton_forward(q, k, v, None, params)


def oracle_grads(q, k, v, dout, causal, backend=None):
    """(dq, dk, dv): float64 oracle, or `backend` in the inputs' dtype."""
    if backend is None:
        inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
        out = attention_ref(*inputs, causal=causal)
        return torch.autograd.grad(out, inputs, dout.double())
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    out = exattn.attention(*inputs, causal=causal, backend=backend)
    return torch.autograd.grad(out, inputs, dout)


def check(q, k, v, dout, causal):
    params = params_for(q.shape[-1], causal)
    assert gb.gluon_backward_supports(q, k, v, None, params, dout) == []
    out, lse = saved_forward(q, k, v, params)
    grads = gb.gluon_backward(dout, q, k, v, out, lse, params)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    naive = oracle_grads(q, k, v, dout, causal, "naive")
    ref = oracle_grads(q, k, v, dout, causal)
    for name, ours, base, r in zip(("dq", "dk", "dv"), grads, naive, ref):
        assert_matches_oracle(name, ours, base, r, q.dtype)
    return grads, (out, lse, params)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_oracle(dtype, d, causal, shape):
    torch.manual_seed(hash((d, causal) + shape) % 2**31)
    check(*gpu_inputs(*shape, d, dtype, with_dout=True), causal)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
def test_rows_with_no_key_get_zero_gradients(d):
    torch.manual_seed(3)
    (dq, dk, dv), _ = check(*gpu_inputs(1, 2, 2, 300, 70, d, torch.bfloat16, with_dout=True), causal=True)
    empty = 300 - 70  # rows i with i + Nk - Nq < 0
    assert (dq[:, :, :empty] == 0).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_huge_logits_and_strided_inputs(dtype, causal, d):
    torch.manual_seed(4)
    check(*gpu_inputs(2, 4, 2, 333, 515, d, dtype, layout="bnhd", logit_scale=60.0, with_dout=True), causal)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_many_ring_rounds(causal):
    torch.manual_seed(5)
    check(*gpu_inputs(1, 4, 1, 2048, 4100, 128, torch.bfloat16, with_dout=True), causal)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_reruns_are_bitwise_equal(d, causal):
    torch.manual_seed(6)
    q, k, v, dout = gpu_inputs(2, 8, 2, 1111, 999, d, torch.bfloat16, with_dout=True)
    (first, (out, lse, params)) = check(q, k, v, dout, causal)
    for _ in range(3):
        again = gb.gluon_backward(dout, q, k, v, out, lse, params)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_accumulate_into_adds_to_strided_float32(causal, d):
    torch.manual_seed(7)
    q, k, v, dout = gpu_inputs(2, 4, 2, 333, 270, d, torch.bfloat16, with_dout=True)
    params = params_for(d, causal)
    out, lse = saved_forward(q, k, v, params)
    start = [torch.randn(x.shape[0], x.shape[2], x.shape[1], d, device="cuda").transpose(1, 2)
             for x in (q, k, v)]  # float32 views with (B, N, H, D) memory order
    acc = [x.clone() for x in start]
    returned = gb.gluon_backward(dout, q, k, v, out, lse, params, accumulate_into=tuple(acc))
    assert all(r is a for r, a in zip(returned, acc))
    naive = oracle_grads(q, k, v, dout, causal, "naive")
    ref = oracle_grads(q, k, v, dout, causal)
    for name, a, s, base, r in zip(("dq", "dk", "dv"), acc, start, naive, ref):
        assert_matches_oracle(name, a - s, base, r, q.dtype)
    plain = gb.gluon_backward(dout, q, k, v, out, lse, params)
    for a, s, p in zip(acc, start, plain):  # the same tiles, added: equal up to the final rounding
        torch.testing.assert_close(a - s, p.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@needs_cuda
def test_backward_refuses_bad_dout_strides():
    q, k, v, dout = gpu_inputs(1, 2, 2, 64, 64, 128, torch.bfloat16, with_dout=True)
    params = params_for(128, False)
    odd = torch.randn(1, 2, 64, 129, device="cuda").to(torch.bfloat16)[..., 1:]  # misaligned base
    with pytest.raises(ValueError, match="dout"):
        gb.gluon_backward(odd, q, k, v, dout, torch.zeros(1, 2, 64, device="cuda"), params)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_triton_backend_dispatches_backward_to_gluon(causal, d, monkeypatch):
    from exattn.backends import triton as backend
    from exattn.backends.triton import settings

    if d in backend.GLUON_BACKWARD_MIN_LEN:
        monkeypatch.setitem(backend.GLUON_BACKWARD_MIN_LEN, d, 333)  # this test's query length
    calls = []
    real = gb.gluon_backward
    monkeypatch.setattr(gb, "gluon_backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.manual_seed(8)
    q, k, v, dout = (x.requires_grad_() for x in gpu_inputs(2, 4, 2, 333, 515, d, torch.bfloat16, with_dout=True))
    dout = dout.detach()
    out = exattn.attention(q, k, v, causal=causal, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = int(d in backend.GLUON_BACKWARD_HEAD_DIMS)
    assert len(calls) == expected
    naive = oracle_grads(q, k, v, dout, causal, "naive")
    ref = oracle_grads(q, k, v, dout, causal)
    for name, ours, base, r in zip(("dq", "dk", "dv"), grads, naive, ref):
        assert_matches_oracle(name, ours, base, r, q.dtype)
    monkeypatch.setattr(settings, "use_gluon", False)
    out = exattn.attention(q, k, v, causal=causal, backend="triton")
    torch.autograd.grad(out, (q, k, v), dout)
    assert len(calls) == expected  # switched off: the Triton backward kernels
