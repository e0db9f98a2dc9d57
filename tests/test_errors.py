"""Every bad input is refused with a message naming the argument, the value and what is expected."""

import pytest
import torch

import exattn
from exattn.reference import attention_ref


def qkv(b=1, hq=2, hk=1, nq=4, nk=6, d=8, dv=8, dtype=torch.float32):
    return (torch.randn(b, hq, nq, d, dtype=dtype), torch.randn(b, hk, nk, d, dtype=dtype),
            torch.randn(b, hk, nk, dv, dtype=dtype))


CASES = [
    ("q not a tensor", lambda q, k, v: (q.tolist(), k, v, {}), TypeError, "q must be a torch.Tensor"),
    ("integer tensors", lambda q, k, v: (q.long(), k, v, {}), TypeError, "q must be float16"),
    ("wrong rank", lambda q, k, v: (q[0], k, v, {}), ValueError, "q must have 4 dims"),
    ("mixed dtypes", lambda q, k, v: (q, k.double(), v, {}), TypeError, "k has dtype torch.float64"),
    ("batch mismatch", lambda q, k, v: (q, k.expand(2, -1, -1, -1), v, {}), ValueError, "batch sizes differ"),
    ("heads not divisible", lambda q, k, v: (q[:, :1].expand(1, 3, -1, -1), k.expand(-1, 2, -1, -1),
                                             v.expand(-1, 2, -1, -1), {}), ValueError, "multiple of key/value heads"),
    ("no k/v heads", lambda q, k, v: (q, k[:, :0], v[:, :0], {}), ValueError, "k and v have no heads (dim 1 is 0)"),
    ("k/v heads differ", lambda q, k, v: (q, k, v.expand(-1, 2, -1, -1), {}), ValueError, "v has 2 heads"),
    ("k/v lengths differ", lambda q, k, v: (q, k, v[:, :, :5], {}), ValueError, "v has 5 keys"),
    ("head dim mismatch", lambda q, k, v: (q, k[..., :7], v, {}), ValueError, "k has head dim 7"),
    ("dropout too large", lambda q, k, v: (q, k, v, {"dropout_p": 1.0}), ValueError, "dropout_p must be in [0, 1)"),
    ("dropout negative", lambda q, k, v: (q, k, v, {"dropout_p": -0.1}), ValueError, "dropout_p must be in [0, 1)"),
    ("dropout not a number", lambda q, k, v: (q, k, v, {"dropout_p": "0.1"}), TypeError, "dropout_p must be a float"),
    ("dropout a tensor", lambda q, k, v: (q, k, v, {"dropout_p": torch.rand(3)}), TypeError, "dropout_p must be a float"),
    ("return_lse a tensor", lambda q, k, v: (q, k, v, {"return_lse": torch.ones(2)}), TypeError,
     "return_lse must be a bool, got a tensor of shape (2,) (Tensor)"),
    ("seed out of range", lambda q, k, v: (q, k, v, {"dropout_p": 0.1, "seed": -1}), ValueError, "seed must be in [0, 2**63)"),
    ("seed not an int", lambda q, k, v: (q, k, v, {"seed": 1.5}), TypeError, "seed must be an int"),
    ("mask not broadcastable", lambda q, k, v: (q, k, v, {"mask": torch.ones(3, 6, dtype=torch.bool)}),
     ValueError, "does not broadcast to (B, Hq, Nq, Nk) = (1, 2, 4, 6)"),
    ("integer mask", lambda q, k, v: (q, k, v, {"mask": torch.ones(4, 6, dtype=torch.int64)}), TypeError, "mask must be bool"),
    ("bias requires grad", lambda q, k, v: (q, k, v, {"mask": torch.zeros(4, 6, requires_grad=True)}),
     ValueError, "mask requires grad"),
    ("unknown backend", lambda q, k, v: (q, k, v, {"backend": "cuda"}), ValueError, "backend must be one of"),
    ("block_m zero", lambda q, k, v: (q, k, v, {"block_m": 0}), ValueError, "block_m must be a positive int, got 0"),
    ("block_n float", lambda q, k, v: (q, k, v, {"block_n": 16.0}), TypeError, "block_n must be a positive int"),
    ("window malformed", lambda q, k, v: (q, k, v, {"window": (3,)}), ValueError, "window must be a pair"),
    ("window negative", lambda q, k, v: (q, k, v, {"window": (-2, 0)}), ValueError, "window left must be >= 0 or -1"),
    ("causal not bool", lambda q, k, v: (q, k, v, {"causal": 1}), TypeError, "causal must be a bool"),
    ("scale not a number", lambda q, k, v: (q, k, v, {"scale": "x"}), TypeError, "scale must be a float"),
    ("scale not finite", lambda q, k, v: (q, k, v, {"scale": float("nan")}), ValueError, "scale must be finite, got nan"),
    ("scale infinite", lambda q, k, v: (q, k, v, {"scale": -float("inf")}), ValueError, "scale must be finite, got -inf"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_clearly(case):
    _, build, error, message = case
    q, k, v, kwargs = build(*qkv())
    with pytest.raises(error) as info:
        exattn.attention(q, k, v, **kwargs)
    assert message in str(info.value)


def test_mixed_devices_are_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
        exattn.attention(q, k.to("meta"), v)


def test_triton_by_name_on_cpu_says_why_not(monkeypatch):
    q, k, v = qkv()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend 'triton' cannot serve these inputs"):
        exattn.attention(q, k, v, backend="triton")


def test_oracle_needs_dropout_p_with_a_mask():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dropout_p must be given"):
        attention_ref(q, k, v, dropout_mask=torch.ones(1, 2, 4, 6, dtype=torch.bool))


def test_dropout_mask_arguments():
    with pytest.raises(ValueError, match="shape must be"):
        exattn.dropout_mask(1, (2, 3), 0.1)
    with pytest.raises(ValueError, match=r"four non-negative ints, got \(1, 1, -2, 2\)"):
        exattn.dropout_mask(1, (1, 1, -2, 2), 0.1)
    for shape in ((1, 1, 2.5, 2), (1, True, 2, 2), "abcd", 7):
        with pytest.raises(TypeError, match="shape must be a sequence of four ints"):
            exattn.dropout_mask(1, shape, 0.1)
    with pytest.raises(ValueError, match="more than a tensor can hold"):
        exattn.dropout_mask(1, (2**40, 2**40, 1, 1), 0.1)
    assert exattn.dropout_mask(1, torch.Size([1, 1, 2, 3]), 0.1).shape == (1, 1, 2, 3)
    with pytest.raises(TypeError, match="seed must be an int"):
        exattn.dropout_mask(None, (1, 1, 2, 2), 0.1)


def ids(*shape, dtype=torch.int32):
    return torch.zeros(*shape, dtype=dtype)


# qkv(): B = 1, Hq = 2, Nq = 4, Nk = 6
RULE_CASES = [
    ("segment ids int64", {"segment_ids": (ids(1, 4, dtype=torch.int64), ids(1, 6))}, TypeError,
     "segment_ids (q ids) must be torch.int32"),
    ("segment ids float", {"segment_ids": (ids(1, 4), ids(1, 6, dtype=torch.float32))}, TypeError,
     "segment_ids (k ids) must be torch.int32"),
    ("segment ids wrong batch", {"segment_ids": (ids(2, 4), ids(2, 6))}, ValueError,
     "segment ids of the wrong batch"),
    ("segment ids wrong length", {"segment_ids": (ids(1, 4), ids(1, 5))}, ValueError,
     "segment_ids (k ids) must have shape (B, Nk) = (1, 6), got (1, 5)"),
    ("one segment ids tensor, Nq != Nk", {"segment_ids": ids(1, 4)}, ValueError, "needs Nq == Nk"),
    ("segment ids a list of one", {"segment_ids": [[0, 0, 0, 0]]}, ValueError, "pair (q_ids, k_ids)"),
    ("segment ids a string", {"segment_ids": "ids"}, TypeError, "segment_ids must be an int32 tensor"),
    ("prefix negative", {"prefix": -1}, ValueError, "prefix must be >= 0"),
    ("prefix float", {"prefix": 2.0}, TypeError, "prefix must be a torch.Tensor"),
    ("prefix int64", {"prefix": ids(1, dtype=torch.int64)}, TypeError, "prefix must be torch.int32"),
    ("prefix wrong batch", {"prefix": ids(3)}, ValueError, "prefix must have shape (B,) = (1,), got (3,)"),
    ("softcap negative", {"softcap": -1.0}, ValueError, "softcap must be a finite float > 0, or 0"),
    ("softcap not a number", {"softcap": "2"}, TypeError, "softcap must be a float"),
    ("alibi wrong heads", {"alibi_slopes": torch.ones(3)}, ValueError, "alibi_slopes must have shape (Hq,) or (B, Hq)"),
    ("alibi float64 with float32 q", {"alibi_slopes": torch.ones(2, dtype=torch.float64)}, TypeError,
     "alibi_slopes must be torch.float32"),
    ("alibi requires grad", {"alibi_slopes": torch.ones(2, requires_grad=True)}, ValueError,
     "alibi_slopes requires grad"),
    ("sinks wrong length", {"sinks": torch.zeros(3)}, ValueError, "sinks must have shape (Hq,) = (2,), got (3,)"),
    ("sinks half", {"sinks": torch.zeros(2, dtype=torch.float16)}, TypeError, "sinks must be torch.float32"),
    ("sinks not a tensor", {"sinks": [0.0, 0.0]}, TypeError, "sinks must be a torch.Tensor"),
]


@pytest.mark.parametrize("case", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_bad_score_rules_are_refused_clearly(case):
    _, kwargs, error, message = case
    q, k, v = qkv()
    with pytest.raises(error) as info:
        exattn.attention(q, k, v, **kwargs)
    assert message in str(info.value)


def test_bad_score_rules_on_another_device_are_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="sinks is on meta but q is on cpu"):
        exattn.attention(q, k, v, sinks=torch.zeros(2, device="meta"))


def test_varlen_score_rules_are_checked_against_the_packed_batch():
    q, k, v = (torch.randn(7, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"prefix must have shape \(B,\) = \(2,\)"):
        exattn.attention_varlen(q, k, v, cu, cu, 4, 4, prefix=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        exattn.attention_varlen(q, k, v, cu, cu, 4, 4, alibi_slopes=torch.ones(3, 2))
    with pytest.raises(TypeError, match="unexpected keyword argument 'segment_ids'"):
        exattn.attention_varlen(q, k, v, cu, cu, 4, 4, segment_ids=torch.zeros(2, 4, dtype=torch.int32))
