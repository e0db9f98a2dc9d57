"""Segment ids, softcap, ALiBi, sinks and a prefix in the Triton kernels, against the float64 oracle by the shared error rule.

On the CPU the kernels run in Triton's interpreter (fp32 and fp16: its dot mishandles bf16); the
tests marked gpu run the compiled kernels in bf16 and fp16 at larger shapes.
"""

from __future__ import annotations

import os

import pytest
import torch
from error_rule import assert_matches_oracle, floor_dtype
from hypothesis import given, settings
from hypothesis import strategies as st

import exattn
from exattn.reference import attention_ref

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors reach Triton only in the interpreter")


def inputs(b, hq, hk, nq, nk, d, dtype, device, logit_scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    rules = dict(alibi_slopes=(torch.rand(b, hq, generator=g) * 0.5).to(device),
                 sinks=torch.randn(hq, generator=g).to(device))
    return rand(b, hq, nq, d, scale=logit_scale), rand(b, hk, nk, d), rand(b, hk, nk, d), rules


def with_grads(fn, q, k, v, sinks, dout):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    sinks = None if sinks is None else sinks.detach().clone().requires_grad_(True)
    out, lse = fn(q, k, v, sinks)
    wrt = (q, k, v) if sinks is None else (q, k, v, sinks)
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, wrt, dout.to(out.dtype)))


def check(q, k, v, *, sinks=None, dropout_p=0.0, seed=5, **kwargs):
    """Triton against naive (same dtype) against the float64 oracle: out, lse, dq, dk, dv, d sinks."""
    dout = torch.randn(*q.shape[:3], v.shape[3], device=q.device)
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    keep = exattn.dropout_mask(seed, shape, dropout_p, device=q.device) if dropout_p else None

    def run(backend):
        return lambda q, k, v, s: exattn.attention(q, k, v, sinks=s, return_lse=True, backend=backend,
                                                   dropout_p=dropout_p, seed=seed, **kwargs)

    def oracle(q, k, v, s):
        return attention_ref(q.double(), k.double(), v.double(), sinks=None if s is None else s.double(),
                             dropout_mask=keep, dropout_p=dropout_p or None, return_lse=True, **kwargs)

    ours, naive, ref = (with_grads(fn, q, k, v, sinks, dout) for fn in (run("triton"), run("naive"), oracle))
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    for name, x, y, r in zip(names, ours, naive, ref):
        assert_matches_oracle(f"triton/{name}", x, y, r, floor_dtype(name, q.dtype))


@needs_interpreter
@settings(max_examples=12, deadline=None, derandomize=True)  # fp16 delta rounding: see tests/test_varlen.py
@given(
    shape=st.sampled_from([(1, 2, 2, 1, 37, 16), (2, 4, 2, 45, 29, 24), (1, 3, 1, 64, 64, 13)]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    causal=st.booleans(), window=st.sampled_from([None, (7, 3)]),
    softcap=st.sampled_from([0.0, 2.0, 30.0]), alibi=st.booleans(), sink=st.booleans(),
    prefix=st.sampled_from([None, 0, 5, 20]), dropout_p=st.sampled_from([0.0, 0.2]),
    documents=st.sampled_from([None, 1, 4, 9]),
)
def test_rules_in_the_kernels(shape, dtype, causal, window, softcap, alibi, sink, prefix, dropout_p, documents):
    q, k, v, rules = inputs(*shape, dtype, "cpu", logit_scale=3.0)
    check(q, k, v, sinks=rules["sinks"] if sink else None, causal=causal, window=window, softcap=softcap,
          alibi_slopes=rules["alibi_slopes"] if alibi else None, prefix=prefix, dropout_p=dropout_p,
          segment_ids=None if documents is None else document_ids(q, k, documents))


def document_ids(q, k, documents, shuffled=False):
    """(q ids, k ids): `documents` runs of ids over each sequence (out of order when shuffled)."""
    def ids(n):
        run = (torch.arange(n) * documents // max(n, 1)).to(torch.int32)
        return (run * 7 % documents if shuffled else run)[None].expand(q.shape[0], n).contiguous()
    return ids(q.shape[2]), ids(k.shape[2])


@needs_interpreter
@pytest.mark.parametrize("shuffled", [False, True])
def test_segment_ids_skip_tiles_and_hold_when_unsorted(shuffled):
    """Sorted ids take the searched tile ranges; unsorted ones every tile: both exact."""
    q, k, v, _ = inputs(2, 2, 1, 100, 100, 16, torch.float32, "cpu")
    check(q, k, v, causal=True, segment_ids=document_ids(q, k, 5, shuffled))
    check(q, k, v, segment_ids=document_ids(q, k, 3, shuffled)[0], prefix=10)


def padding_case(len_q, len_k, dtype, device, head_dim):
    """The transformers integration's padding as segment ids: keys 0 where real, 1 where padding (left
    padding of 0, a fifth and all but one of the keys), every query 0; a left-padded prefill leaves
    queries that see no key."""
    q, k, v, rules = inputs(3, 4, 2, len_q, len_k, head_dim, dtype, device, logit_scale=2.0)
    padding = torch.tensor([0, len_k // 5, len_k - 1])
    key_ids = (torch.arange(len_k)[None] < padding[:, None]).to(device=device, dtype=torch.int32)
    return q, k, v, rules["sinks"], (torch.zeros(3, len_q, dtype=torch.int32, device=device), key_ids)


@needs_interpreter
@pytest.mark.parametrize("len_q", [1, 5, 45])
@pytest.mark.parametrize("window", [None, (9, 0)])
def test_padding_as_segment_ids(len_q, window):
    q, k, v, sinks, ids = padding_case(len_q, 45, torch.float32, "cpu", 16)
    check(q, k, v, sinks=sinks, causal=True, window=window, softcap=5.0, segment_ids=ids)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("len_q", [1, 7, 700])
@pytest.mark.parametrize("window", [None, (255, 0)])
def test_gpu_padding_as_segment_ids(dtype, len_q, window):
    q, k, v, sinks, ids = padding_case(len_q, 700, dtype, "cuda", 128)
    check(q, k, v, sinks=sinks, causal=True, window=window, softcap=30.0, segment_ids=ids)


@needs_interpreter
@pytest.mark.parametrize("prefix", [torch.tensor([3, 0, 70], dtype=torch.int32), 33])
def test_prefix_lm(prefix):
    """A prefix-LM (bidirectional prefix, causal after it) and a streaming window with sink tokens,
    per batch entry, prefixes past the keys included."""
    q, k, v, _ = inputs(3, 2, 1, 64, 64, 16, torch.float32, "cpu")
    check(q, k, v, causal=True, prefix=prefix)
    check(q, k, v, causal=True, window=(8, 0), prefix=prefix)


@needs_interpreter
def test_huge_logits_under_softcap_and_rows_that_see_only_the_sink():
    q, k, v, rules = inputs(1, 2, 1, 40, 17, 16, torch.float32, "cpu", logit_scale=300.0)
    check(q, k, v, sinks=rules["sinks"], causal=True, softcap=20.0, alibi_slopes=rules["alibi_slopes"])
    out, lse = exattn.attention(q, k, v, causal=True, sinks=rules["sinks"], backend="triton", return_lse=True)
    empty = slice(0, 40 - 17)  # causal with Nq > Nk: these rows see no key, only the sink
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    torch.testing.assert_close(lse[0, :, empty], rules["sinks"][:, None].expand(2, 23))


@needs_interpreter
def test_triton_serves_every_rule():
    q, k, v, rules = inputs(1, 2, 2, 8, 8, 16, torch.float32, "cpu")
    assert exattn.explain_backend(q, k, v, softcap=5.0, sinks=rules["sinks"], backend="triton").name == "triton"
    assert exattn.explain_backend(q, k, v, prefix=3, causal=True, backend="triton").name == "triton"
    ids = torch.zeros(1, 8, dtype=torch.int32)
    assert exattn.explain_backend(q, k, v, segment_ids=ids, backend="triton").name == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rule", ["softcap", "alibi", "sinks", "prefix", "all"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_rules(dtype, head_dim, rule, causal):
    q, k, v, rules = inputs(2, 8, 2, 1000, 1000, head_dim, dtype, "cuda", logit_scale=2.0)
    kwargs = {"softcap": 30.0 if rule in ("softcap", "all") else 0.0,
              "alibi_slopes": rules["alibi_slopes"] if rule in ("alibi", "all") else None,
              "prefix": 100 if rule in ("prefix", "all") else None}
    check(q, k, v, sinks=rules["sinks"] if rule in ("sinks", "all") else None, causal=causal, **kwargs)


GLUON_RULES = {  # name: keywords of exattn.attention (segment ids from `document_ids`: "documents")
    "segments": dict(causal=True, documents=5),
    "unsorted segments": dict(documents=4, shuffled=True),
    "window": dict(window=(100, 0)),
    "window right": dict(window=(64, 32)),
    "right only": dict(window=(-1, 32)),
    "left only": dict(window=(100, -1)),
    "prefix": dict(causal=True, prefix=100),
    "prefix window": dict(window=(64, 0), prefix=70),
    "softcap alone": dict(causal=True, softcap=30.0),
    "alibi alone": dict(alibi=True),  # the dK/dV kernel forms dQ (`dq_in_dkdv_serves`) from 512 query rows
    "causal alibi": dict(causal=True, alibi=True),  # ALiBi's distance split in row and key terms (`splits_alibi`)
    "alibi window": dict(window=(150, 0), alibi=True),
    "softcap alibi sinks": dict(causal=True, softcap=30.0, alibi=True, sinks=True),
    "all": dict(window=(200, 0), prefix=50, documents=3, softcap=20.0, alibi=True, sinks=True),
}


GPU_RULE_SHAPES = [(2, 8, 2, 1000, 1000), (1, 4, 2, 333, 517), (2, 4, 4, 517, 200), (1, 2, 1, 1, 300)]


def gluon_rule_case(rule: str, shape: tuple, head_dim: int, seed: int):
    """(q, k, v, sinks, keywords of exattn.attention) on the GPU for GLUON_RULES[rule] (fp16 for the
    333-row shape, bf16 otherwise)."""
    kwargs = dict(GLUON_RULES[rule])
    dtype = torch.float16 if shape[3] == 333 else torch.bfloat16
    q, k, v, rules = inputs(*shape, head_dim, dtype, "cuda", logit_scale=2.0, seed=seed)
    documents, shuffled = kwargs.pop("documents", None), kwargs.pop("shuffled", False)
    if documents is not None:
        kwargs["segment_ids"] = tuple(x.cuda() for x in document_ids(q, k, documents, shuffled))
    kwargs["alibi_slopes"] = rules["alibi_slopes"] if kwargs.pop("alibi", False) else None
    return q, k, v, rules["sinks"] if kwargs.pop("sinks", False) else None, kwargs


def counted(monkeypatch, module, name: str) -> list:
    """A list that gains an entry each time module.name is called (replay off: a replayed call would not
    reach it)."""
    from exattn.backends.triton import settings

    monkeypatch.setattr(settings, "replay", False)
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: calls.append(1) or real(*args))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rule", GLUON_RULES)
@pytest.mark.parametrize("shape", GPU_RULE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_gluon_forward_serves_the_rules(head_dim, rule, shape, monkeypatch):
    """The Gluon forward applies every rule: it is the one called."""
    from exattn.backends.triton import gluon_forward as gf

    calls = counted(monkeypatch, gf, "run_gluon_forward")
    q, k, v, sinks, kwargs = gluon_rule_case(rule, shape, head_dim, seed=shape[3])
    check(q, k, v, sinks=sinks, **kwargs)
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rule", GLUON_RULES)
@pytest.mark.parametrize("shape", GPU_RULE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_gluon_backward_serves_the_rules(head_dim, rule, shape, monkeypatch):
    """The Gluon backward applies every rule (at every length and head dim here): it is the one called,
    its gradients match the oracle, and a second backward is bitwise equal."""
    from exattn.backends import triton as backend
    from exattn.backends.triton import gluon_backward as gb

    monkeypatch.setitem(backend.GLUON_BACKWARD_MIN_LEN, head_dim, 1)
    monkeypatch.setattr(gb, "TRITON_FASTER_AT_D64", 0)  # also where Triton is faster
    calls = counted(monkeypatch, gb, "run_gluon_backward")
    q, k, v, sinks, kwargs = gluon_rule_case(rule, shape, head_dim, seed=shape[3] + 1)
    check(q, k, v, sinks=sinks, **kwargs)
    assert calls == [1]
    dout = torch.randn(*q.shape[:3], v.shape[3], device=q.device)

    def run(q, k, v, s):
        return exattn.attention(q, k, v, sinks=s, return_lse=True, backend="triton", **kwargs)

    first, second = (with_grads(run, q, k, v, sinks, dout) for _ in range(2))
    for x, y in zip(first[2:], second[2:]):
        assert torch.equal(x, y)
