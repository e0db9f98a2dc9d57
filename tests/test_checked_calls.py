"""Calls whose signature was checked before skip validation and the backend choice
(`exattn.checked_calls`): they must give what a checked call gives, and every argument that
validation would refuse must still be refused, whatever was called before."""

from __future__ import annotations

import importlib

import pytest
import torch

import exattn
from exattn import checked_calls

attention_module = importlib.import_module("exattn.attention")  # the package's `attention` is the function
decode_module = importlib.import_module("exattn.decode")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def counted(monkeypatch, module, name: str) -> list:
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    return calls


def qkv(seed: int, shape=(2, 4, 33, 16), requires_grad=False):
    torch.manual_seed(seed)
    return [torch.randn(shape, device=DEVICE, requires_grad=requires_grad) for _ in range(3)]


@pytest.mark.parametrize("backend", ["tiled", "auto"])
def test_a_known_signature_skips_the_checks_and_gives_the_checked_result(backend, monkeypatch):
    checks = counted(monkeypatch, attention_module, "problem_from_args")
    first = exattn.attention(*qkv(0), causal=True, window=(5, 0), backend=backend)
    q, k, v = qkv(1)
    again = exattn.attention(q, k, v, causal=True, window=(5, 0), backend=backend, return_lse=True)
    assert len(checks) == 1, "the second call was validated again"
    checked_calls.KNOWN.clear()
    expected = exattn.attention(q, k, v, causal=True, window=(5, 0), backend=backend, return_lse=True)
    assert len(checks) == 2
    assert first.shape == again[0].shape
    for got, want in zip(again, expected):
        assert torch.equal(got, want)


def test_a_known_signature_keeps_gradients(monkeypatch):
    q, k, v = qkv(2, requires_grad=True)
    exattn.attention(q, k, v, causal=True, backend="tiled").sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    exattn.attention(q, k, v, causal=True, backend="tiled").sum().backward()
    assert len(checked_calls.KNOWN) == 1
    for x, want in zip((q, k, v), grads):
        assert torch.equal(x.grad, want)


@pytest.mark.parametrize("bad, error", [
    (dict(causal=1), TypeError),           # equal to True, but not a bool
    (dict(window=(True, 0)), TypeError),   # equal to (1, 0)
    (dict(scale=True), TypeError),         # equal to 1.0
    (dict(dropout_p=False), TypeError),    # equal to 0.0
    (dict(block_m=16.0), TypeError),       # equal to 16
])
def test_arguments_equal_to_checked_ones_are_still_refused(bad, error):
    good = dict(causal=True, window=(1, 0), scale=1.0, dropout_p=0.0, block_m=16)
    q, k, v = qkv(3)
    exattn.attention(q, k, v, backend="tiled", **good)
    exattn.attention(q, k, v, backend="tiled", **good)
    with pytest.raises(error):
        exattn.attention(q, k, v, backend="tiled", **{**good, **bad})


def test_other_shapes_dtypes_and_unhashable_arguments_are_checked():
    q, k, v = qkv(4)
    exattn.attention(q, k, v, backend="tiled")
    with pytest.raises(ValueError, match="head dim"):
        exattn.attention(q, k[..., :8], v, backend="tiled")
    with pytest.raises(TypeError, match="share one dtype"):
        exattn.attention(q, k.double(), v, backend="tiled")
    with pytest.raises(ValueError, match="window must be a pair"):
        exattn.attention(q, k, v, window=[1, 2, 3], backend="tiled")
    assert len(checked_calls.KNOWN) == 1


def test_calls_with_other_tensors_or_a_drawn_seed_are_never_kept():
    q, k, v = qkv(5)
    exattn.attention(q, k, v, mask=torch.ones(33, 33, dtype=torch.bool, device=DEVICE), backend="tiled")
    exattn.attention(q, k, v, alibi_slopes=torch.rand(4, device=DEVICE), backend="tiled")
    exattn.attention(q, k, v, dropout_p=0.1, backend="tiled")
    exattn.attention(q, k, v, backend="naive")
    assert not checked_calls.KNOWN
    exattn.attention(q, k, v, dropout_p=0.1, seed=7, backend="tiled")
    assert len(checked_calls.KNOWN) == 1


def test_the_interpreter_switch_is_part_of_the_signature(monkeypatch):
    if DEVICE == "cuda":
        pytest.skip("CPU tensors reach the Triton backend only through the interpreter")
    q, k, v = qkv(6)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    exattn.attention(q, k, v, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        exattn.attention(q, k, v, backend="triton")


def test_signatures_are_bounded(monkeypatch):
    monkeypatch.setattr(checked_calls, "MAX_SIGNATURES", 3)
    q, k, v = qkv(7)
    for scale in (0.1, 0.2, 0.3, 0.4, 0.5):
        exattn.attention(q, k, v, scale=scale, backend="tiled")
    assert len(checked_calls.KNOWN) == 3


def decode_case(seed: int):
    torch.manual_seed(seed)
    q = torch.randn(2, 4, 1, 16, device=DEVICE)
    k, v = (torch.randn(2, 2, 40, 16, device=DEVICE) for _ in range(2))
    return q, k, v, torch.tensor([40, 17], dtype=torch.int32, device=DEVICE)


def test_decode_with_a_known_signature_skips_the_checks_and_still_refuses_bad_input(monkeypatch):
    checks = counted(monkeypatch, decode_module, "make_decode_problem")
    q, k, v, lens = decode_case(8)
    first = exattn.decode(q, k, v, cache_seqlens=lens, window=(8, 0), softcap=5.0, backend="triton")
    again = exattn.decode(q, k, v, cache_seqlens=lens, window=(8, 0), softcap=5.0, backend="triton")
    assert len(checks) == 1
    assert torch.equal(first, again)
    with pytest.raises(TypeError, match="cache_seqlens"):
        exattn.decode(q, k, v, cache_seqlens=lens.long(), window=(8, 0), softcap=5.0, backend="triton")
    with pytest.raises(TypeError, match="validate"):
        exattn.decode(q, k, v, cache_seqlens=lens, window=(8, 0), softcap=5.0, backend="triton", validate=1)
    with pytest.raises(ValueError, match="softcap"):
        exattn.decode(q, k, v, cache_seqlens=lens, window=(8, 0), softcap=-5.0, backend="triton")


def test_kept_calls_take_their_replay_plans_and_give_the_checked_results():
    """On CUDA the third call of a signature runs the plans its passes recorded (`backends/planned.py`),
    forward and backward, and matches a checked call bitwise; on the CPU (no replay) nothing is planned."""
    from exattn.backends.planned import PlannedPasses

    results = []
    for seed in (9, 10, 11):
        q, k, v = qkv(seed, requires_grad=True)
        out = exattn.attention(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), q.grad, k.grad, v.grad))
    (_, passes), = checked_calls.KNOWN.values()
    assert isinstance(passes, PlannedPasses) == (DEVICE == "cuda")
    checked_calls.KNOWN.clear()
    out = exattn.attention(q, k, v, causal=True)
    q.grad = k.grad = v.grad = None
    out.backward(torch.ones_like(out))
    for got, want in zip(results[-1], (out.detach(), q.grad, k.grad, v.grad)):
        assert torch.equal(got, want)


def test_kept_decode_calls_take_their_replay_plan(monkeypatch):
    q, k, v, lens = decode_case(12)
    calls = [exattn.decode(q, k, v, cache_seqlens=lens, softcap=5.0, backend="triton") for _ in range(3)]
    (_, kept, doorbell), = checked_calls.KNOWN.values()
    assert (kept is not None) == (DEVICE == "cuda")
    assert (doorbell is not None) == (DEVICE == "cuda"), "a validated kept call reads the device's doorbell"
    assert torch.equal(calls[0], calls[2])


varlen_module = importlib.import_module("exattn.varlen")


def packed_case(seed: int, requires_grad=False):
    """q, k, v of 3 packed sequences (lengths 7, 0, 12), and their offsets."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(19, 4, 16, device=DEVICE, requires_grad=requires_grad) for _ in range(3))
    return q, k, v, torch.tensor([0, 7, 7, 19], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("backend", ["tiled", "auto"])
def test_varlen_with_a_known_signature_skips_the_checks_but_not_new_offsets(backend, monkeypatch):
    checks = counted(monkeypatch, varlen_module, "make_varlen_problem")
    q, k, v, cu = packed_case(13)
    first = exattn.attention_varlen(q, k, v, cu, cu, 12, 12, causal=True, backend=backend)
    q, k, v, cu = packed_case(14)
    again = exattn.attention_varlen(q, k, v, cu, cu, 12, 12, causal=True, backend=backend, return_lse=True)
    assert len(checks) == 1, "the second call was validated again"
    checked_calls.KNOWN.clear()
    expected = exattn.attention_varlen(q, k, v, cu, cu, 12, 12, causal=True, backend=backend, return_lse=True)
    assert first.shape == again[0].shape
    for got, want in zip(again, expected):
        assert torch.equal(got, want)
    falling = torch.tensor([0, 12, 7, 19], dtype=torch.int32, device=DEVICE)  # the same layout, bad values
    with pytest.raises(ValueError, match="non-decreasing"):
        exattn.attention_varlen(q, k, v, falling, cu, 12, 12, causal=True, backend=backend)
    good = cu.clone()
    cu[3] = 18  # written since it was checked
    with pytest.raises(ValueError, match="must end at total_k = 19"):
        exattn.attention_varlen(q, k, v, good, cu, 12, 12, causal=True, backend=backend)
    with pytest.raises(TypeError, match="validate"):
        exattn.attention_varlen(q, k, v, cu, cu, 12, 12, causal=True, backend=backend, validate=1)
    with pytest.raises(TypeError, match="max_seqlen_q"):
        exattn.attention_varlen(q, k, v, cu, cu, 12.0, 12, causal=True, backend=backend)


def test_kept_varlen_calls_keep_gradients_and_take_their_replay_plans():
    """Kept calls give the checked gradients; on CUDA the third call of a signature runs the plans its
    passes recorded, forward and backward, and matches a checked call bitwise."""
    from exattn.backends.planned import PlannedPasses

    results = []
    for seed in (15, 16, 17):
        q, k, v, cu = packed_case(seed, requires_grad=True)
        out = exattn.attention_varlen(q, k, v, cu, cu, 12, 12, causal=True)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), q.grad, k.grad, v.grad))
    (_, passes), = checked_calls.KNOWN.values()
    assert isinstance(passes, PlannedPasses) == (DEVICE == "cuda")
    checked_calls.KNOWN.clear()
    out = exattn.attention_varlen(q, k, v, cu, cu, 12, 12, causal=True)
    q.grad = k.grad = v.grad = None
    out.backward(torch.ones_like(out))
    for got, want in zip(results[-1], (out.detach(), q.grad, k.grad, v.grad)):
        assert torch.equal(got, want)


def test_varlen_calls_with_rule_tensors_or_a_drawn_seed_are_never_kept():
    q, k, v, cu = packed_case(18)
    exattn.attention_varlen(q, k, v, cu, cu, 12, 12, sinks=torch.rand(4, device=DEVICE), backend="tiled")
    exattn.attention_varlen(q, k, v, cu, cu, 12, 12, dropout_p=0.1, backend="tiled")
    exattn.attention_varlen(q, k, v, cu, cu, 12, 12, backend="naive")
    assert not checked_calls.KNOWN
