"""Window, softcap, ALiBi and sinks in the Triton decode kernels (interpreter on CPU, compiled on CUDA).

Every result is judged per sequence against the float64 oracle over the sequence's own keys
(`attention_ref(..., causal=True, <rule>)`), relative to naive attention in the same dtype.
Cache slots past each length hold NaN, so reading one would show.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads

import exattn
from error_rule import assert_matches_oracle
from exattn.backends.triton.decode_kernel import DecodeConfig, DecodeRules, decode_forward, max_useful_splits
from exattn.reference import attention_ref
from test_decode import DEVICE, make_case, paged

RULE_NAMES = ("window", "softcap", "alibi", "sinks", "all")


def rule_kwargs(name: str, heads_q: int, batch: int, window: int = 11, softcap: float = 4.0) -> dict:
    """`decode` keywords of one rule (or all four); slopes per (b, h), sinks around the logits' size."""
    g = torch.Generator().manual_seed(len(name) + heads_q)
    slopes = (torch.rand(batch, heads_q, generator=g) * 0.3).to(DEVICE)
    sinks = (torch.randn(heads_q, generator=g) * 2).to(DEVICE)
    every = dict(window=(window, 0), softcap=softcap, alibi_slopes=slopes, sinks=sinks)
    keys = {"window": ["window"], "softcap": ["softcap"], "alibi": ["alibi_slopes"], "sinks": ["sinks"],
            "all": list(every)}[name]
    return {key: every[key] for key in keys}


def kernel_rules(kwargs: dict) -> DecodeRules:
    return DecodeRules(kwargs.get("window", (-1, 0))[0], kwargs.get("softcap", 0.0), kwargs.get("alibi_slopes"),
                       kwargs.get("sinks"))


def assert_rules_match(name, out, lse, q, k, v, lens, kwargs, batches=None, leftpad=None):
    """Per sequence b: ours vs the oracle over keys [leftpad[b], lens[b]) (from 0 without `leftpad`) with
    the same rules; the oracle's bottom-right alignment keeps each token's position and distances."""
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    for b in batches if batches is not None else range(q.shape[0]):
        length, first = int(lens[b]), 0 if leftpad is None else int(leftpad[b])
        per_seq = dict(kwargs)
        if "alibi_slopes" in per_seq:
            per_seq["alibi_slopes"] = per_seq["alibi_slopes"][b:b + 1]
        args = (q[b:b + 1], k[b:b + 1, :, first:length], v[b:b + 1, :, first:length])
        ref_out, ref_lse = attention_ref(*args, causal=True, return_lse=True, **per_seq)
        naive_out, naive_lse = exattn.attention(*args, causal=True, backend="naive", return_lse=True, **per_seq)
        assert_matches_oracle(f"{name} out[{b}]", out[b:b + 1], naive_out, ref_out, q.dtype)
        assert_matches_oracle(f"{name} lse[{b}]", lse[b:b + 1], naive_lse, ref_lse, q.dtype)


@pytest.mark.parametrize("rules", RULE_NAMES)
@pytest.mark.parametrize("layout", ("contiguous", "paged"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=("fp32", "fp16"))
def test_each_rule_through_decode(rules, layout, dtype):
    """GQA 4:2, Nq = 3, D = 24, lengths not multiples of a block (one equal to Nq), planned splits."""
    q, k, v, lens = make_case(3, 4, 2, 3, 150, 24, dtype, seed=len(rules), lengths=[150, 77, 3])
    kwargs = rule_kwargs(rules, 4, 3)
    caches = (k, v, None) if layout == "contiguous" else paged(k, v, lens, 16)
    for num_splits in (1, 3):
        out, lse = exattn.decode(q, caches[0], caches[1], block_table=caches[2], cache_seqlens=lens,
                                 num_splits=num_splits, return_lse=True, backend="triton", **kwargs)
        assert_rules_match(f"{rules} {layout} splits={num_splits}", out, lse, q, k, v, lens, kwargs)
    exattn.check_errors()


@pytest.mark.parametrize("merge_in_split", (False, True), ids=("combine-kernel", "merge-in-split"))
@pytest.mark.parametrize("len_q", (1, 4))
def test_every_pass_folds_the_sinks_once(merge_in_split, len_q):
    """One split (the split kernel's epilogue), the combine kernel, or the merge in the split kernel:
    the sink joins each row's softmax exactly once; many splits are empty for the short sequences."""
    q, k, v, lens = make_case(3, 6, 2, len_q, 200, 16, torch.float32, seed=11, lengths=[200, len_q, 37])
    kwargs = rule_kwargs("all", 6, 3, window=40)
    config = DecodeConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, merge_in_split=merge_in_split)
    for num_splits in (1, 4, 64):
        out, lse = decode_forward(q, k, v, lens, None, 16 ** -0.5, num_splits, config, kernel_rules(kwargs))
        assert_rules_match(f"splits={num_splits} merge_in_split={merge_in_split}", out, lse, q, k, v, lens, kwargs)


def test_rules_over_two_row_blocks():
    """MQA 8:1 with Nq = 16 is 128 query rows: two row blocks, each with its own slopes and sinks."""
    q, k, v, lens = make_case(2, 8, 1, 16, 90, 16, torch.float32, seed=3, lengths=[90, 40])
    kwargs = rule_kwargs("all", 8, 2, window=20, softcap=2.0)
    for merge_in_split in (False, True):
        config = DecodeConfig(block_m=64, block_n=16, num_warps=4, num_stages=2, merge_in_split=merge_in_split)
        out, lse = decode_forward(q, k, v, lens, None, 0.25, 3, config, kernel_rules(kwargs))
        assert_rules_match(f"128 rows merge_in_split={merge_in_split}", out, lse, q, k, v, lens, kwargs)


@pytest.mark.parametrize("page_size", (None, 8, 48), ids=("contiguous", "page<block", "page>block"))
@pytest.mark.parametrize("num_splits", (1, 3))
def test_the_window_skips_the_key_blocks_before_it(page_size, num_splits):
    """V holds NaN in every key before the block where the first token's window starts: a read
    of any such block would give NaN (0 * NaN in P V). Lengths 190 and 61 with a window of 20 and
    Nq = 2; key blocks of 16."""
    q, k, v, lens = make_case(2, 4, 2, 2, 190, 16, torch.float32, seed=5, lengths=[190, 61])
    kwargs = dict(window=(20, 0))
    clean_v = v.clone()
    for b, length in enumerate(lens.tolist()):
        start = max(length - 2 - 20, 0) // 16 * 16
        v[b, :, :start] = float("nan")
    caches = (k, v, None) if page_size is None else paged(k, v, lens, page_size)
    config = DecodeConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)
    out, lse = decode_forward(q, caches[0], caches[1], lens, caches[2], 0.25, num_splits, config, kernel_rules(kwargs))
    assert not out.isnan().any()
    assert_rules_match(f"window pages={page_size}", out, lse, q, k, clean_v, lens, kwargs)


def test_the_plan_and_the_split_count_cover_only_the_window():
    rules = DecodeRules(window_left=4096)
    assert rules.key_span(131072, 1) == 4097 and rules.key_span(3000, 1) == 3000
    assert DecodeRules().key_span(131072, 4) == 131072
    config = DecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
    assert max_useful_splits(4097, config, window=True) == 66 and max_useful_splits(4097, config) == 65


def test_a_row_before_its_first_key_sees_only_the_sink():
    """Unvalidated lengths below Nq leave the first rows without keys: out 0 and lse = sinks[h],
    as the oracle's bottom-right alignment gives (Nq > Nk); with a window of 0 every other row
    sees its own key and the sink only."""
    q, k, v, lens = make_case(3, 4, 2, 4, 40, 16, torch.float32, seed=9, lengths=[40, 2, 1])
    kwargs = dict(rule_kwargs("sinks", 4, 3), window=(0, 0))
    config = DecodeConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)
    for num_splits in (1, 3):
        out, lse = decode_forward(q, k, v, lens, None, 0.25, num_splits, config, kernel_rules(kwargs))
        assert torch.all(out[1, :, :2] == 0) and torch.all(out[2, :, :3] == 0)
        torch.testing.assert_close(lse[2, :, 0], kwargs["sinks"], rtol=0, atol=0)
        assert_rules_match(f"only the sink splits={num_splits}", out, lse, q, k, v, lens, kwargs)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=("fp32", "fp16"))
def test_softcap_tames_huge_logits(dtype):
    """Logits near 30 x the usual size: softcap 5 keeps every score in (-5, 5), no NaN, no overflow."""
    q, k, v, lens = make_case(2, 4, 2, 2, 100, 24, dtype, seed=2, logit_scale=30.0, lengths=[100, 57])
    kwargs = dict(softcap=5.0, alibi_slopes=rule_kwargs("alibi", 4, 2)["alibi_slopes"])
    for num_splits in (1, 3):
        out, lse = exattn.decode(q, k, v, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                                 backend="triton", **kwargs)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert_rules_match(f"softcap 5 splits={num_splits}", out, lse, q, k, v, lens, kwargs)


def test_slopes_of_one_row_per_head_broadcast_over_the_batch():
    """(Hq,) slopes reach the kernel as a (B, Hq) view with batch stride 0."""
    q, k, v, lens = make_case(3, 4, 4, 1, 70, 8, torch.float32, seed=4)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)
    out, lse = exattn.decode(q, k, v, cache_seqlens=lens, alibi_slopes=slopes, return_lse=True, backend="triton")
    assert_rules_match("(Hq,) slopes", out, lse, q, k, v, lens, dict(alibi_slopes=slopes.expand(3, 4)))


def test_rules_agree_with_the_tiled_backend():
    q, k, v, lens = make_case(2, 4, 2, 2, 120, 16, torch.float32, seed=8)
    k_pages, v_pages, table = paged(k, v, lens, 24)
    kwargs = rule_kwargs("all", 4, 2, window=33)
    common = dict(cache_seqlens=lens, block_table=table, num_splits=3, return_lse=True, **kwargs)
    out, lse = exattn.decode(q, k_pages, v_pages, backend="triton", **common)
    tiled_out, tiled_lse = exattn.decode(q, k_pages, v_pages, backend="tiled", **common)
    torch.testing.assert_close(out, tiled_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, tiled_lse, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- left padding (cache_leftpad)

def left_padded_case(dtype):
    """GQA 4:2, Nq = 3, D = 24; lengths 150, 77, 3 with left paddings 17, 70, 2: the second sequence keeps
    7 keys, the last one key, which its first two tokens do not see. The padding's slots hold NaN."""
    q, k, v, lens = make_case(3, 4, 2, 3, 150, 24, dtype, seed=12, lengths=[150, 77, 3])
    leftpad = torch.tensor([17, 70, 2], dtype=torch.int32, device=DEVICE)
    clean_k, clean_v = k.clone(), v.clone()
    for b, first in enumerate(leftpad.tolist()):
        k[b, :, :first] = float("nan")
        v[b, :, :first] = float("nan")
    return q, k, v, lens, leftpad, clean_k, clean_v


@pytest.mark.parametrize("rules", ("none", "all"))
@pytest.mark.parametrize("layout", ("contiguous", "paged"))
@pytest.mark.parametrize("backend", ("tiled", "triton"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=("fp32", "fp16"))
def test_left_padding_leaves_out_the_keys_before_it(rules, layout, backend, dtype):
    q, k, v, lens, leftpad, clean_k, clean_v = left_padded_case(dtype)
    kwargs = {} if rules == "none" else rule_kwargs("all", 4, 3, window=40)
    caches = (k, v, None) if layout == "contiguous" else paged(k, v, lens, 16)
    for num_splits in (1, 3):
        out, lse = exattn.decode(q, caches[0], caches[1], block_table=caches[2], cache_seqlens=lens,
                                 cache_leftpad=leftpad, num_splits=num_splits, return_lse=True, backend=backend,
                                 **kwargs)
        assert torch.all(out[2, :, :2] == 0)  # tokens before the last sequence's only key
        assert_rules_match(f"leftpad {rules} {layout} {backend} splits={num_splits}", out, lse, q, clean_k, clean_v,
                           lens, kwargs, leftpad=leftpad)
    exattn.check_errors()


def test_a_signature_seen_before_takes_new_left_paddings():
    """The second call of a signature runs the kept path (`checked_calls`): its new left paddings, not the
    first call's, decide."""
    q, k, v, lens, leftpad, clean_k, clean_v = left_padded_case(torch.float32)
    for first in ([17, 70, 2], [0, 5, 1], [149, 0, 3]):
        leftpad = torch.tensor(first, dtype=torch.int32, device=DEVICE)
        out, lse = exattn.decode(q, clean_k, clean_v, cache_seqlens=lens, cache_leftpad=leftpad, return_lse=True,
                                 backend="triton")
        assert_rules_match(f"leftpad {first}", out, lse, q, clean_k, clean_v, lens, {}, leftpad=leftpad)
    exattn.check_errors()


@pytest.mark.parametrize("backend", ("tiled", "triton"))
def test_a_left_padding_outside_its_sequence_is_refused(backend):
    q, k, v, lens = make_case(2, 2, 1, 1, 40, 8, torch.float32, seed=1, lengths=[40, 20])
    for bad, message in (([0, 21], r"cache_leftpad\[1\] = 21 is outside \[0, cache_seqlens\[1\] = 20\]"),
                         ([-1, 0], r"cache_leftpad\[0\] = -1 is outside \[0, cache_seqlens\[0\] = 40\]")):
        leftpad = torch.tensor(bad, dtype=torch.int32, device=DEVICE)
        with pytest.raises(ValueError, match=message):
            exattn.decode(q, k, v, cache_seqlens=lens, cache_leftpad=leftpad, backend=backend)
            exattn.check_errors()
    exattn.decode(q, k, v, cache_seqlens=lens, cache_leftpad=torch.tensor([0, 20], dtype=torch.int32, device=DEVICE),
                  backend=backend)
    exattn.check_errors()  # a padding up to the length leaves no key, which is allowed


def test_left_padding_of_the_wrong_type_or_shape_is_refused():
    q, k, v, lens = make_case(2, 2, 1, 1, 40, 8, torch.float32, seed=1, lengths=[40, 20])
    with pytest.raises(TypeError, match="cache_leftpad must have dtype torch.int32, got torch.int64"):
        exattn.decode(q, k, v, cache_leftpad=torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"cache_leftpad must have shape \(2,\), got \(3,\)"):
        exattn.decode(q, k, v, cache_leftpad=torch.zeros(3, dtype=torch.int32, device=DEVICE))

