"""Replayed launches on the GPU (`exattn.backends.triton.replay`): a call whose signature was seen
before gives bitwise what the pass gives without replay, on new tensors, for the Gluon and Triton
forward and backward passes, and the hot configurations are replayed, not refused."""

from __future__ import annotations

import pytest
import torch

import exattn
from exattn.backends.triton import replay, settings

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CASES = {
    "gluon d128 causal": dict(shape=(2, 4, 1024, 128), kv_heads=4, causal=True),
    "gluon d64 full gqa": dict(shape=(2, 8, 768, 64), kv_heads=2, causal=False),
    "triton d80 causal": dict(shape=(1, 4, 300, 80), kv_heads=4, causal=True),
    "triton rules": dict(shape=(2, 4, 333, 64), kv_heads=2, causal=True, softcap=30.0, alibi=True, sinks=True),
    "triton window nq<nk": dict(shape=(1, 2, 100, 128), kv_heads=2, len_k=257, window=(64, 0)),
}


def run(case: dict, seed: int):
    torch.manual_seed(seed)
    b, h, n, d = case["shape"]
    len_k = case.get("len_k", n)
    q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, case["kv_heads"], len_k, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    sinks = torch.randn(h, device="cuda", requires_grad=True) if case.get("sinks") else None
    alibi = torch.rand(h, device="cuda") if case.get("alibi") else None
    out, lse = exattn.attention(q, k, v, causal=case.get("causal", False), window=case.get("window"),
                                softcap=case.get("softcap", 0.0), alibi_slopes=alibi, sinks=sinks,
                                return_lse=True, backend="triton")
    out.backward(torch.randn_like(out))
    grads = [x.grad for x in (q, k, v, sinks) if x is not None]
    return [out, lse, *grads]


@pytest.mark.parametrize("name", list(CASES))
def test_replayed_calls_match_the_pass_bitwise(name, monkeypatch):
    case = CASES[name]
    replay.clear()
    monkeypatch.setattr(settings, "replay", False)
    expected = [run(case, seed) for seed in (1, 2)]
    monkeypatch.setattr(settings, "replay", True)
    recorded = run(case, 1)
    replayed = run(case, 2)
    for want, got in zip(expected, (recorded, replayed)):
        for x, y in zip(want, got):
            assert torch.equal(x, y)
    assert not replay.REFUSED, dict(replay.REFUSED)
    assert len(replay.PLANS) == 2  # the forward and the backward pass


def decode_inputs(seed: int, paged: bool):
    torch.manual_seed(seed)
    q = torch.randn(4, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(4, 2, 3000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.randint(1, 3000, (4,), device="cuda", dtype=torch.int32)
    if not paged:
        return q, k, v, lens, None
    pages = 3000 // 200 + 1
    k, v = (torch.nn.functional.pad(x, (0, 0, 0, pages * 200 - 3000)) for x in (k, v))
    table = torch.randperm(4 * pages, device="cuda").view(4, pages).to(torch.int32)
    k, v = (x.view(4, 2, pages, 200, 128).permute(0, 2, 1, 3, 4).reshape(4 * pages, 2, 200, 128) for x in (k, v))
    cache = torch.empty_like(k)
    cache[table.flatten().long()] = k
    values = torch.empty_like(v)
    values[table.flatten().long()] = v
    return q, cache, values, lens, table


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rules", [{}, {"window": (512, 0), "softcap": 30.0}])
def test_replayed_decode_matches_and_still_reports_bad_lengths(paged, rules, monkeypatch):
    replay.clear()
    calls = [decode_inputs(seed, paged) for seed in (1, 2, 3)]

    def run_decode(q, k, v, lens, table):
        return exattn.decode(q, k, v, cache_seqlens=lens, block_table=table, return_lse=True, **rules)

    monkeypatch.setattr(settings, "replay", False)
    expected = [run_decode(*args) for args in calls]
    monkeypatch.setattr(settings, "replay", True)
    for args, want in zip(calls, expected):
        for x, y in zip(want, run_decode(*args)):
            assert torch.equal(x, y)
    assert not replay.REFUSED, dict(replay.REFUSED)
    assert len(replay.PLANS) == 1
    q, k, v, lens, table = calls[0]
    run_decode(q, k, v, torch.full_like(lens, 10**6), table)  # replayed: its kernels record the error
    with pytest.raises(ValueError, match="cache_seqlens"):
        exattn.check_errors()


VARLEN_CASES = {  # the Gluon forward and packed backward; the Triton kernels for short sequences
    "gluon d128 causal": dict(lengths=[1100, 0, 1500, 77], head_dim=128, heads=(8, 2), causal=True),
    "triton d64 full": dict(lengths=[300, 500, 129], head_dim=64, heads=(4, 4), causal=False),
}


def run_varlen(case: dict, seed: int):
    torch.manual_seed(seed)
    total, (hq, hk), d = sum(case["lengths"]), case["heads"], case["head_dim"]
    q = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(total, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(case["lengths"]).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    longest = max(case["lengths"])
    out, lse = exattn.attention_varlen(q, k, v, cu, cu, longest, longest, causal=case["causal"], return_lse=True,
                                       backend="triton")
    out.backward(torch.randn_like(out))
    return [out, lse, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_replayed_varlen_calls_match_the_passes_bitwise(name, monkeypatch):
    case = VARLEN_CASES[name]
    replay.clear()
    monkeypatch.setattr(settings, "replay", False)
    expected = [run_varlen(case, seed) for seed in (1, 2, 3)]
    monkeypatch.setattr(settings, "replay", True)
    for seed, want in zip((1, 2, 3), expected):  # recorded, replayed, then through the kept plans
        for x, y in zip(want, run_varlen(case, seed)):
            assert torch.equal(x, y)
    assert not replay.REFUSED, dict(replay.REFUSED)
    assert len(replay.PLANS) == 2  # the forward and the backward pass
