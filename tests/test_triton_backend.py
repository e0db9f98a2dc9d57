"""The Triton kernels, run on the CPU through Triton's interpreter, judged by the shared error rule.

Shapes are tiny and awkward (ragged tails, Nq = 1, Nq > Nk, head dims that are
not powers of two) so every path of the kernels runs: masked and full tiles,
TMA descriptors and plain pointers, every mask kind, GQA, dropout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import triton  # noqa: F401  (part of the test extra: a missing triton must fail, not skip)

# The interpreter's numpy calls emit DeprecationWarnings by the thousand.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
# These run the kernels on CPU tensors through the interpreter, which conftest turns on
# wherever there is no GPU (CI included). On a GPU machine tests/test_triton_gpu.py runs
# the same kernels compiled, so this module is skipped there, by design.
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)", allow_module_level=True)

import exattn  # noqa: E402
from exattn.backends import get_backend  # noqa: E402
from exattn.backends.tiled import tiled_backward, tiled_forward  # noqa: E402
from exattn.backends.triton import settings  # noqa: E402
from exattn.problem import make_problem  # noqa: E402
from exattn.reference import attention_ref  # noqa: E402
from error_rule import assert_matches_oracle  # noqa: E402
from hard_inputs import own_key_scores_far_below_the_rest  # noqa: E402

SEED = 1234


def make_inputs(b, hq, hk, nq, nk, d, dv, dtype, scale_inputs=1.0, layout="bhnd"):
    """Fresh random q, k, v with requires_grad; layout "bnhd" gives transposed (strided) views."""
    def one(h, n, dim):
        if layout == "bnhd":
            x = torch.randn(b, n, h, dim, dtype=torch.float32).transpose(1, 2)
        else:
            x = torch.randn(b, h, n, dim, dtype=torch.float32)
        return (x * scale_inputs).to(dtype).requires_grad_()
    return one(hq, nq, d), one(hk, nk, d), one(hk, nk, dv)


def run_with_grads(q, k, v, dout, **kwargs):
    out, lse = exattn.attention(q, k, v, return_lse=True, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out, lse, grads


def check_against_oracle(q, k, v, *, dropout_p=0.0, **kwargs):
    """Triton vs naive (same dtype) vs float64 oracle: out, lse, dq, dk, dv."""
    dout = torch.randn(q.shape[:3] + (v.shape[3],)).to(q.dtype)
    common = dict(kwargs, dropout_p=dropout_p, seed=SEED)
    ours = run_with_grads(q, k, v, dout, backend="triton", **common)
    naive = run_with_grads(q, k, v, dout, backend="naive", **common)
    ref_kwargs = {key: val for key, val in kwargs.items() if key not in ("block_m", "block_n")}
    if dropout_p > 0:
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        ref_kwargs.update(dropout_mask=exattn.dropout_mask(SEED, shape, dropout_p), dropout_p=dropout_p)
    ref_out, ref_lse = attention_ref(q, k, v, return_lse=True, **ref_kwargs)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout.to(torch.float64))
    names = ("out", "lse", "dq", "dk", "dv")
    for name, a, b, r in zip(names, (ours[0], ours[1], *ours[2]), (naive[0], naive[1], *naive[2]),
                             (ref_out, ref_lse, *ref_grads)):
        assert a.dtype == (torch.float32 if name == "lse" else q.dtype), name
        assert_matches_oracle(name, a, b, r, q.dtype)
    return ours


# (B, Hq, Hk, Nq, Nk, D, Dv, dtype, attention kwargs)
CASES = [
    pytest.param(1, 2, 1, 37, 45, 24, 40, torch.float32, {}, id="gqa-dv-ne-d"),
    pytest.param(1, 2, 2, 60, 20, 59, 16, torch.float16, dict(causal=True), id="causal-nq-gt-nk-d59"),
    pytest.param(2, 1, 1, 1, 70, 32, 32, torch.float32, dict(causal=True), id="nq1-causal"),
    pytest.param(1, 1, 1, 33, 70, 40, 24, torch.float16, dict(window=(5, 3), block_m=16, block_n=16),
                 id="window"),
    pytest.param(1, 2, 1, 50, 50, 16, 16, torch.float32, dict(window=(7, -1), causal=True), id="causal+left"),
    pytest.param(1, 4, 1, 64, 64, 32, 32, torch.float16, dict(causal=True, block_m=16, block_n=32),
                 id="mqa-even-tiles"),
    pytest.param(1, 1, 1, 20, 33, 160, 100, torch.float32, {}, id="d160"),
    pytest.param(1, 2, 1, 29, 41, 24, 24, torch.float16, dict(window=(0, 4), block_m=32, block_n=16),
                 id="right-window-only"),
]


@pytest.mark.parametrize("b, hq, hk, nq, nk, d, dv, dtype, kwargs", CASES)
def test_matches_oracle(b, hq, hk, nq, nk, d, dv, dtype, kwargs):
    torch.manual_seed(0)
    check_against_oracle(*make_inputs(b, hq, hk, nq, nk, d, dv, dtype), **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_inputs_and_huge_logits(dtype):
    torch.manual_seed(1)
    q, k, v = make_inputs(1, 2, 1, 31, 47, 32, 32, dtype, scale_inputs=8.0, layout="bnhd")
    check_against_oracle(q, k, v, causal=True)


@pytest.mark.parametrize("backend", ["triton", "tiled"])
@pytest.mark.parametrize("scale", [1e9, 1e12, 1e30])
def test_gradients_stay_finite_for_logits_past_two_to_the_thirty(backend, scale):
    """float32 scores of 1e9 and more: where the backward's recomputed scores round apart from the
    forward's lse by more than 128 (base 2), an unclamped exp2 gave inf and then NaN in dQ and dK; P
    stays at most 1. Such rows are one-hot: out is the argmax key's value. (In half precision dQ
    itself, scale times rounding, overflows there.)"""
    torch.manual_seed(2)
    q, k, v = (x.requires_grad_() for x in make_inputs(1, 2, 1, 37, 45, 24, 24, torch.float32))
    out, lse = exattn.attention(q, k, v, causal=True, scale=scale, backend=backend, return_lse=True)
    out.backward(torch.randn_like(out))
    for name, x in (("out", out), ("lse", lse), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(x).all(), f"{name} has {(~torch.isfinite(x)).sum().item()} non-finite values"
    top = (q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(
        torch.ones(37, 45, dtype=torch.bool).tril(8).logical_not(), float("-inf")).argmax(-1)
    chosen = v.double().expand(1, 2, 45, 24).gather(2, top.unsqueeze(-1).expand(1, 2, 37, 24))
    torch.testing.assert_close(out.double(), chosen, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kwargs", [{}, dict(softcap=5.0, window=(9, 2))], ids=["plain", "softcap-window"])
def test_a_negative_scale_takes_each_rows_true_maximum(dtype, kwargs):
    """A tile's row maximum of the raw scores, scaled after, is the scaled maximum only for scale >= 0: with
    scale = -0.2 and logits of about +-40 the unmasked tiles' weights overflowed (inf, then NaN)."""
    torch.manual_seed(6)
    q, k, v = make_inputs(1, 2, 1, 64, 70, 32, 32, dtype, scale_inputs=10.0)
    check_against_oracle(q, k, v, scale=-0.2, **kwargs)


def cpu_has_avx2() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx2" in cpuinfo.read_text()


# OPENBLAS_CORETYPE=Haswell on a CPU without AVX2 would run illegal instructions, so the test is
# skipped there; test_strided_inputs_and_huge_logits still runs the same case with the default kernels.
@pytest.mark.skipif(not cpu_has_avx2(), reason="OpenBLAS's Haswell kernels need an x86 CPU with AVX2 (Linux)")
def test_huge_logits_where_the_dot_rounds_by_operand_order():
    """The interpreter's tl.dot is numpy's matmul; with OpenBLAS's Haswell kernels (CI's CPU) K·Qᵀ and
    (Q·Kᵀ)ᵀ round differently, so the fp32 backward must recompute the scores as the forward did."""
    code = "import torch, test_triton_backend as t; t.test_strided_inputs_and_huge_logits(torch.float32)"
    env = dict(os.environ, OPENBLAS_CORETYPE="Haswell", TRITON_INTERPRET="1")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, check=True)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masks_with_broadcast_and_fully_masked_rows(kind):
    torch.manual_seed(2)
    q, k, v = make_inputs(2, 2, 1, 23, 38, 24, 24, torch.float16)
    if kind == "bool":
        mask = torch.rand(1, 2, 23, 38) > 0.4
        mask[:, :, 5] = False  # fully masked rows
    else:
        mask = torch.randn(2, 1, 1, 38)
        mask[..., 30:] = float("-inf")
    out, lse, grads = check_against_oracle(q, k, v, mask=mask, causal=kind == "additive")
    if kind == "bool":
        assert torch.all(out[:, :, 5] == 0) and torch.all(lse[:, :, 5] == float("-inf"))
        assert torch.all(grads[0][:, :, 5] == 0)


def test_fully_masked_rows_from_causal_give_zero_and_no_nan():
    torch.manual_seed(3)
    q, k, v = make_inputs(1, 1, 1, 40, 9, 16, 16, torch.float32)
    out, lse, (dq, dk, dv) = check_against_oracle(q, k, v, causal=True)
    assert torch.all(out[:, :, :31] == 0) and torch.all(lse[:, :, :31] == float("-inf"))
    assert torch.all(dq[:, :, :31] == 0)
    assert not any(torch.isnan(x).any() for x in (out, dq, dk, dv))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", ["triton", "tiled"])
def test_rows_whose_first_tiles_are_masked_keep_very_negative_scores(dtype, backend):
    """A row's running max stays -inf through the tiles it cannot see: shifting by 0 there would
    underflow the row's own keys when they all score below about -87 (here about -800)."""
    torch.manual_seed(11)
    n_q, n_k, d = 130, 200, 16
    q, k, v = own_key_scores_far_below_the_rest(n_q, n_k, d, dtype)
    own_keys = slice(n_k - n_q, n_k)
    out, lse = exattn.attention(q, k, v, window=(0, 0), return_lse=True, backend=backend)
    own = (q.double() * k[:, :, own_keys].double()).sum(-1) * d ** -0.5
    assert own.max() < -400
    torch.testing.assert_close(out, v[:, :, own_keys], rtol=0, atol=0)
    torch.testing.assert_close(lse.double(), own, rtol=1e-6, atol=0)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    out = exattn.attention(q, k, v, window=(0, 0), backend=backend)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    torch.testing.assert_close(dv[:, :, own_keys], dout, rtol=0, atol=0)  # P = I on the own keys
    assert (dv[:, :, :n_k - n_q] == 0).all()
    # dS = P (dP - delta) is 0 up to rounding, which |q| ~ 800 scales in dK
    assert dq.abs().max() < 1e-3 and dk.abs().max() < 1e-3 * q.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dropout_is_the_shared_philox_mask(dtype):
    torch.manual_seed(4)
    q, k, v = make_inputs(1, 2, 1, 35, 43, 24, 32, dtype)
    check_against_oracle(q, k, v, dropout_p=0.3, causal=dtype == torch.float16)


def test_reruns_are_bitwise_identical():
    torch.manual_seed(5)
    q, k, v = make_inputs(1, 4, 2, 45, 45, 32, 32, torch.float16)
    dout = torch.randn(1, 4, 45, 32).to(torch.float16)
    first = run_with_grads(q, k, v, dout, backend="triton", causal=True, dropout_p=0.2, seed=9)
    second = run_with_grads(q, k, v, dout, backend="triton", causal=True, dropout_p=0.2, seed=9)
    for a, b in zip((first[0], first[1], *first[2]), (second[0], second[1], *second[2])):
        assert torch.equal(a, b)


def test_tma_and_pointer_paths_agree_bitwise(monkeypatch):
    torch.manual_seed(6)
    q, k, v = make_inputs(1, 2, 1, 37, 45, 32, 16, torch.float16)
    dout = torch.randn(1, 2, 37, 16).to(torch.float16)
    with_tma = run_with_grads(q, k, v, dout, backend="triton", window=(9, 2))
    monkeypatch.setattr(settings, "use_tma", False)
    without = run_with_grads(q, k, v, dout, backend="triton", window=(9, 2))
    for a, b in zip((with_tma[0], *with_tma[2]), (without[0], *without[2])):
        assert torch.equal(a, b)


def test_atomic_dq_flag_matches_oracle(monkeypatch):
    monkeypatch.setattr(settings, "atomic_dq", True)
    torch.manual_seed(7)
    check_against_oracle(*make_inputs(1, 4, 2, 37, 29, 24, 24, torch.float32), causal=True)


def test_raw_passes_match_tiled_and_accept_strided_lse():
    torch.manual_seed(8)
    q, k, v = (x.detach() for x in make_inputs(1, 2, 1, 40, 40, 16, 16, torch.float32))
    problem = make_problem(q, k, v, causal=True)
    backend = get_backend("triton")
    out, lse = backend.forward(q, k, v, None, problem.params)
    ref_out, ref_lse = tiled_forward(q, k, v, None, problem.params)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse.float())
    dout = torch.randn_like(out)
    wide_lse = torch.randn(1, 2, 80)
    wide_lse[..., 10:50] = lse
    grads = backend.backward(dout, q, k, v, None, out, wide_lse[..., 10:50], problem.params)
    for ours, ref in zip(grads, tiled_backward(dout, q, k, v, None, out, lse, problem.params)):
        torch.testing.assert_close(ours, ref)


class Allocations(torch.overrides.TorchFunctionMode):
    """The (shape, dtype) of every tensor a block allocates through torch.empty / empty_like / zeros."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in (torch.empty, torch.empty_like, torch.empty_strided, torch.zeros, torch.zeros_like):
            self.made.append((tuple(result.shape), result.dtype))
        return result


@pytest.mark.parametrize("packed, atomic", [(False, False), (True, False), (False, True)])
def test_the_backward_keeps_delta_in_the_bytes_of_dq(monkeypatch, packed, atomic):
    """The dK/dV kernel's delta lives in dq's bytes (`passes.float32_within`) and the dQ kernel forms its
    own, so the backward allocates its gradients alone (and atomic dQ's float32 sum): no per-row buffer."""
    from exattn.backends.triton.passes import Packing, triton_backward, triton_forward

    monkeypatch.setattr(settings, "atomic_dq", atomic)
    torch.manual_seed(11)
    if packed:
        lengths = [5, 0, 23, 9]
        q, k, v = (torch.randn(sum(lengths), h, 24, dtype=torch.float16) for h in (4, 2, 2))
        offsets = torch.tensor([0, 5, 5, 28, 37], dtype=torch.int32)
        packing, params = Packing(offsets, offsets, 23, 23), make_problem(
            q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2), causal=True).params
    else:
        q, k, v = (x.detach() for x in make_inputs(2, 4, 2, 37, 29, 24, 24, torch.float16))
        packing, params = None, make_problem(q, k, v, causal=True).params
    out, lse = triton_forward(q, k, v, None, params, packing)
    dout = torch.randn_like(out)
    with Allocations() as allocations:
        grads = triton_backward(dout, q, k, v, None, out, lse, params, packing=packing)
    expected = [(tuple(x.shape), x.dtype) for x in (q, k, v)]
    if atomic:
        expected.append((tuple(q.shape), torch.float32))
    assert sorted(allocations.made, key=str) == sorted(expected, key=str)
    if packed:
        return
    ref = tiled_backward(dout, q, k, v, None, out, lse, params)
    for name, ours, theirs in zip(("dq", "dk", "dv"), grads, ref):
        torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=2e-3, msg=name)


def test_float32_within_takes_a_gradients_first_bytes_only_where_they_hold_it():
    from exattn.backends.triton.passes import float32_within

    grad = torch.empty(4, 8, dtype=torch.float16)  # 64 bytes
    inside = float32_within(grad, (2, 8), grad.device)
    assert inside.dtype == torch.float32 and inside.shape == (2, 8) and inside.data_ptr() == grad.data_ptr()
    for too_small_or_strided, shape in ((grad, (3, 8)), (grad.t(), (2, 8)), (None, (2, 8))):
        own = float32_within(too_small_or_strided, shape, grad.device)
        assert own.shape == shape and own.untyped_storage().data_ptr() != grad.data_ptr()


def test_empty_keys_and_queries():
    q, k, v = (torch.randn(1, 1, n, 16) for n in (5, 0, 0))
    out, lse = exattn.attention(q, k, v, backend="triton", return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    sinks = torch.randn(1)
    out, lse = exattn.attention(q, k, v, backend="triton", return_lse=True, sinks=sinks)
    assert torch.all(out == 0) and torch.equal(lse, sinks.expand(1, 1, 5))
    q = torch.randn(1, 1, 0, 16)
    k, v = torch.randn(1, 1, 7, 16), torch.randn(1, 1, 7, 16)
    assert exattn.attention(q, k, v, backend="triton").shape == (1, 1, 0, 16)


def problem_of(dtype=torch.float32, d=16, **kwargs):
    q, k, v = (torch.randn(1, 1, 8, d, dtype=dtype) for _ in range(3))
    return make_problem(q, k, v, **kwargs)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(dtype=torch.float64), "float64"),
    (dict(d=300), "head dim D=300"),
    (dict(block_m=24), "block_m=24"),
    (dict(block_n=512), "block_n=512"),
])
def test_reasons_name_what_cannot_be_served(kwargs, expected):
    reasons = get_backend("triton").not_supported_reasons(problem_of(**kwargs))
    assert any(expected in r for r in reasons), reasons
    q = problem_of(**kwargs)
    with pytest.raises(ValueError, match="triton"):
        exattn.attention(q.q, q.k, q.v, backend="triton", block_m=q.params.block_m,
                         block_n=q.params.block_n)


def test_auto_picks_tiled_on_cpu_and_explains_why():
    q, k, v = (torch.randn(1, 1, 8, 16) for _ in range(3))
    choice = exattn.explain_backend(q, k, v)
    assert choice.name == "tiled"
    assert any("CUDA" in r for r in choice.rejected["triton"])
    assert get_backend("triton").not_supported_reasons(make_problem(q, k, v)) == []


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reasons = get_backend("triton").not_supported_reasons(problem_of())
    assert any("TRITON_INTERPRET" in r for r in reasons)


def strided_buffers(like, gen):
    """Random float32 buffers shaped like `like`, each a strided view into a larger tensor."""
    views = []
    for x in like:
        big = torch.randn(x.shape[0], x.shape[1] + 1, x.shape[2] + 3, x.shape[3] + 5, generator=gen)
        views.append(big[:, 1:, 2:2 + x.shape[2], 3:3 + x.shape[3]])
    return views


@pytest.mark.parametrize("backend_name", ["tiled", "triton"])
@pytest.mark.parametrize("dtype, kwargs, atomic", [
    (torch.float32, dict(causal=True), False),
    (torch.float16, dict(window=(6, 2), block_m=16, block_n=16), False),
    (torch.float32, dict(causal=True), True),
])
def test_backward_accumulates_into_float32_buffers(monkeypatch, backend_name, dtype, kwargs, atomic):
    """accumulate_into adds the gradients into strided float32 views, touching nothing else, deterministically."""
    monkeypatch.setattr(settings, "atomic_dq", atomic)
    torch.manual_seed(9)
    q, k, v = make_inputs(1, 4, 2, 37, 45, 24, 40, dtype)
    dout = torch.randn(1, 4, 37, 40).to(dtype)
    backend, params = get_backend(backend_name), make_problem(q, k, v, **kwargs).params
    out, lse = backend.forward(q.detach(), k.detach(), v.detach(), None, params)
    start = strided_buffers((q, k, v), torch.Generator().manual_seed(10))
    runs = []
    for _ in range(2):
        accs = [x._base.clone()[:, 1:, 2:2 + x.shape[2], 3:3 + x.shape[3]] for x in start]
        returned = backend.backward(dout, q.detach(), k.detach(), v.detach(), None, out, lse, params,
                                    accumulate_into=tuple(accs))
        assert all(r is a for r, a in zip(returned, accs))
        runs.append(accs)
    ref_kwargs = {key: val for key, val in kwargs.items() if key not in ("block_m", "block_n")}
    ref_out = attention_ref(q, k, v, **ref_kwargs)
    ref = torch.autograd.grad(ref_out, (q, k, v), dout.to(torch.float64))
    naive = torch.autograd.grad(exattn.attention(q, k, v, backend="naive", **ref_kwargs), (q, k, v), dout)
    for name, acc, again, init, n, r in zip(("dq", "dk", "dv"), *runs, start, naive, ref):
        assert acc.dtype == torch.float32
        if not (atomic and name == "dq" and backend_name == "triton"):
            assert torch.equal(acc, again), f"{name}: accumulation is not deterministic"
        assert_matches_oracle(name, acc - init, n, r, dtype)
        outside = acc._base.clone()
        outside[:, 1:, 2:2 + acc.shape[2], 3:3 + acc.shape[3]] = 0
        untouched = init._base.clone()
        untouched[:, 1:, 2:2 + acc.shape[2], 3:3 + acc.shape[3]] = 0
        assert torch.equal(outside, untouched), f"{name}: wrote outside its view"


def test_hopper_reads_the_cached_capability(monkeypatch):
    from types import SimpleNamespace

    from exattn.backends.triton import configs, passes

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(configs, "device_capability", lambda index: (9, 0))
    assert passes.hopper(on_gpu)
    monkeypatch.setattr(configs, "device_capability", lambda index: (8, 0))
    assert not passes.hopper(on_gpu)


@pytest.mark.parametrize("value,default,expected", [(None, None, None), (None, True, True), ("1", False, True),
                                                   ("0", True, False)])
def test_env_flags_read_one_zero_or_unset(value, default, expected, monkeypatch):
    from exattn.backends.triton.passes import env_flag

    monkeypatch.delenv("EXATTN_TEST_FLAG", raising=False)
    if value is not None:
        monkeypatch.setenv("EXATTN_TEST_FLAG", value)
    assert env_flag("EXATTN_TEST_FLAG", default) is expected


def test_env_flags_refuse_other_values_naming_the_variable(monkeypatch):
    from exattn.backends.triton.passes import env_flag

    monkeypatch.setenv("EXATTN_TEST_FLAG", "yes")
    with pytest.raises(ValueError, match=r"EXATTN_TEST_FLAG: got 'yes', expected '0' or '1' \(or unset\)"):
        env_flag("EXATTN_TEST_FLAG")
