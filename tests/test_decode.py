"""exattn.decode on the tiled path and the Triton kernels (interpreter on CPU, compiled on CUDA).

Every result is judged against `attention(q, k[:, :, :len], v[:, :, :len], causal=True)`
with the shared error rule, per sequence. Cache slots past a sequence's length
(and pages no sequence uses) hold NaN, so reading one would show.
"""

import importlib
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads

import exattn
from exattn.decode import choose_decode_backend, make_decode_problem, plan_splits, triton_reasons
from exattn.reference import attention_ref
from error_rule import assert_matches_oracle

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ("tiled", "triton")
DTYPES = (torch.float32, torch.float16)


def make_case(batch, heads_q, heads_k, len_q, capacity, head_dim, dtype, seed=0, value_dim=None,
              logit_scale=1.0, lengths=None):
    """Random q and contiguous caches (stale slots NaN), with random ragged lengths in [Nq, capacity]."""
    g = torch.Generator().manual_seed(seed)
    value_dim = value_dim or head_dim
    q = torch.randn(batch, heads_q, len_q, head_dim, generator=g, dtype=torch.float64) * logit_scale
    k = torch.randn(batch, heads_k, capacity, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, heads_k, capacity, value_dim, generator=g, dtype=torch.float64)
    if lengths is None:
        lengths = torch.randint(len_q, capacity + 1, (batch,), generator=g)
        lengths[0] = capacity
    lens = torch.as_tensor(lengths, dtype=torch.int32)
    for b, length in enumerate(lens.tolist()):
        k[b, :, length:] = float("nan")
        v[b, :, length:] = float("nan")
    to = dict(dtype=dtype, device=DEVICE)
    return q.to(**to), k.to(**to), v.to(**to), lens.to(DEVICE)


def paged(k, v, lens, page_size, seed=0):
    """The same caches as shuffled pages: (num_pages, Hk, page_size, D) and block_table (B, max_pages).

    Page slots no sequence uses hold -7 (must never be read); spare pages hold NaN."""
    batch, heads_k, capacity, _ = k.shape
    max_pages = -(-capacity // page_size)
    num_pages = batch * max_pages + 3
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed + 1))
    k_pages = torch.full((num_pages, heads_k, page_size, k.shape[3]), float("nan"), dtype=k.dtype, device=k.device)
    v_pages = torch.full((num_pages, heads_k, page_size, v.shape[3]), float("nan"), dtype=v.dtype, device=v.device)
    table = torch.full((batch, max_pages), -7, dtype=torch.int32)
    for b, length in enumerate(lens.tolist()):
        for slot in range(-(-length // page_size)):
            page = int(order[b * max_pages + slot])
            table[b, slot] = page
            keys = slice(slot * page_size, min((slot + 1) * page_size, capacity))
            n = keys.stop - keys.start
            k_pages[page, :, :n] = k[b, :, keys]
            v_pages[page, :, :n] = v[b, :, keys]
    return k_pages, v_pages, table.to(k.device)


def assert_matches_attention(name, out, lse, q, k, v, lens):
    """Per sequence: ours vs the float64 oracle, relative to naive attention in q's dtype."""
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == q.shape[:3] + (v.shape[3],) and lse.shape == q.shape[:3]
    for b, length in enumerate(lens.tolist()):
        args = (q[b:b + 1], k[b:b + 1, :, :length], v[b:b + 1, :, :length])
        ref_out, ref_lse = attention_ref(*args, causal=True, return_lse=True)
        naive_out, naive_lse = exattn.attention(*args, causal=True, backend="naive", return_lse=True)
        assert_matches_oracle(f"{name} out[{b}]", out[b:b + 1], naive_out, ref_out, q.dtype)
        assert_matches_oracle(f"{name} lse[{b}]", lse[b:b + 1], naive_lse, ref_lse, q.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_lengths_match_attention(backend, dtype):
    q, k, v, lens = make_case(3, 4, 2, 3, 150, 40, dtype, seed=1)
    out, lse = exattn.decode(q, k, v, cache_seqlens=lens, return_lse=True, backend=backend)
    assert_matches_attention(backend, out, lse, q, k, v, lens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_num_splits_agrees(backend):
    q, k, v, lens = make_case(3, 4, 1, 2, 300, 24, torch.float32, seed=2, lengths=[300, 7, 130])
    results = []
    for num_splits in (1, 2, 3, 5, 64):
        out, lse = exattn.decode(q, k, v, cache_seqlens=lens, num_splits=num_splits,
                                 return_lse=True, backend=backend)
        assert_matches_attention(f"{backend} splits={num_splits}", out, lse, q, k, v, lens)
        results.append(out)
    for out in results[1:]:
        torch.testing.assert_close(out, results[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("merge_in_split", (False, True), ids=("combine-kernel", "merge-in-split"))
@pytest.mark.parametrize("block_n", (16, 32))
def test_kernel_many_and_empty_splits(block_n, merge_in_split):
    """Small key blocks give many real splits; the short sequences leave most of them empty.
    G = 3 query heads a K/V head: merged in the split kernel, a padded row is masked."""
    from exattn.backends.triton.decode_kernel import DecodeConfig, decode_forward

    q, k, v, lens = make_case(3, 6, 2, 1, 200, 16, torch.float16, seed=3, lengths=[200, 1, 37])
    config = DecodeConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=2, merge_in_split=merge_in_split)
    for num_splits in (1, 4, 64):
        out, lse = decode_forward(q, k, v, lens, None, 0.25, num_splits, config)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert_matches_attention(f"splits={num_splits}", out, lse, q, k, v, lens)  # scale 0.25 = 16 ** -0.5


def test_merge_in_split_over_several_row_blocks():
    """G * Nq = 128 rows: two row blocks of 64, each merged by its own last split."""
    from exattn.backends.triton.decode_kernel import DecodeConfig, decode_forward

    q, k, v, lens = make_case(2, 8, 1, 16, 150, 16, torch.float32, seed=7, lengths=[150, 40])
    config = DecodeConfig(block_m=64, block_n=16, num_warps=4, num_stages=2, merge_in_split=True)
    out, lse = decode_forward(q, k, v, lens, None, 0.25, 5, config)
    assert_matches_attention("128 rows, 5 splits", out, lse, q, k, v, lens)


def test_merge_in_split_takes_several_loads(monkeypatch):
    """More splits than one merge load holds: the online merge across loads."""
    from exattn.backends.triton import decode_kernel
    from exattn.backends.triton.decode_kernel import DecodeConfig, decode_forward

    monkeypatch.setattr(decode_kernel, "MERGE_ELEMENTS", 3 * 16 * 4)  # 4 rows x 16 (Dv) x 3 -> 2 splits a load
    q, k, v, lens = make_case(2, 8, 2, 1, 300, 16, torch.float32, seed=5, lengths=[300, 70])
    config = DecodeConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, merge_in_split=True)
    out, lse = decode_forward(q, k, v, lens, None, 0.25, 7, config)
    assert_matches_attention("7 splits, 2 a load", out, lse, q, k, v, lens)


@pytest.mark.parametrize("page_size, block_n, len_q", [(16, 32, 3), (24, 64, 16), (32, 32, 1), (48, 16, 2)],
                         ids=("page<block", "page<block-Nq16", "page=block", "page>block"))
def test_kernel_short_and_empty_sequences_wide_tables(page_size, block_n, len_q):
    """Lengths 0, below Nq and below one key block leave splits empty or rows fully masked
    (out 0, lse -inf, never NaN); shuffled pages smaller than, equal to and larger than the
    key block; a table wider than the pages used holds -7 in its spare slots and spare
    pages hold NaN, so reading either would show."""
    from exattn.backends.triton.decode_kernel import DecodeConfig, decode_forward

    lengths = [200, 0, 2, 13, 131]
    q, k, v, lens = make_case(5, 4, 2, len_q, 200, 24, torch.float16, seed=page_size, lengths=lengths)
    k_pages, v_pages, table = paged(k, v, lens, page_size)
    table = torch.cat([table, torch.full_like(table[:, :2], -7)], dim=1).contiguous()
    real = [b for b, n in enumerate(lengths) if n > 0]
    for num_splits, merge_in_split in ((1, False), (3, False), (3, True)):
        config = DecodeConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=3, merge_in_split=merge_in_split)
        for caches in ((k, v, None), (k_pages, v_pages, table)):
            out, lse = decode_forward(q, caches[0], caches[1], lens, caches[2], 24 ** -0.5, num_splits, config)
            name = f"splits={num_splits} merge_in_split={merge_in_split} paged={caches[2] is not None}"
            assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf")), name
            assert_matches_attention(name, out[real], lse[real], q[real], k[real], v[real], lens[real])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", (16, 24, 64))
def test_paged_equals_contiguous(backend, page_size):
    q, k, v, lens = make_case(3, 4, 2, 2, 130, 32, torch.float16, seed=4)
    k_pages, v_pages, table = paged(k, v, lens, page_size)
    for num_splits in (1, 3):
        kwargs = dict(cache_seqlens=lens, num_splits=num_splits, return_lse=True, backend=backend)
        out, lse = exattn.decode(q, k_pages, v_pages, block_table=table, **kwargs)
        assert_matches_attention(f"paged {page_size}", out, lse, q, k, v, lens)
        flat_out, flat_lse = exattn.decode(q, k, v, **kwargs)
        torch.testing.assert_close(out, flat_out, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(lse, flat_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", ((4, 4), (8, 1)), ids=("mha", "mqa"))
@pytest.mark.parametrize("len_q", (1, 5, 16))
def test_new_token_counts_and_groups(backend, heads, len_q):
    """Nq from 1 to 16; with MQA 8 x 16 = 128 query rows span two row blocks of the kernel."""
    heads_q, heads_k = heads
    q, k, v, lens = make_case(2, heads_q, heads_k, len_q, 90, 16, torch.float32, seed=5 + len_q)
    out, lse = exattn.decode(q, k, v, cache_seqlens=lens, num_splits=2, return_lse=True, backend=backend)
    assert_matches_attention(f"Nq={len_q}", out, lse, q, k, v, lens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_value_dim_and_huge_logits(backend):
    q, k, v, lens = make_case(2, 6, 3, 2, 70, 24, torch.float32, seed=6, value_dim=40, logit_scale=30.0)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, Nq, Hq, D) memory
    big_k = torch.full((2, 3, 90, 48), float("nan"), device=DEVICE)
    big_k[:, :, 5:75, 3:27] = k
    k_view = big_k[:, :, 5:75, 3:27]
    lens_view = torch.stack([lens, lens * 0], dim=1)[:, 0]  # a strided int32 view
    out, lse = exattn.decode(q_t, k_view, v, cache_seqlens=lens_view, num_splits=2, return_lse=True,
                             backend=backend)
    assert_matches_attention("strided", out, lse, q, k, v, lens)


def test_float64_tiled_and_defaults():
    q, k, v, lens = make_case(2, 2, 1, 3, 40, 8, torch.float64, seed=7, lengths=[40, 40])
    out, lse = exattn.decode(q, k, v, return_lse=True)  # whole cache, auto, splits chosen
    assert_matches_attention("float64", out, lse, q, k, v, lens)
    assert isinstance(exattn.decode(q, k, v, num_splits=3), torch.Tensor)


@pytest.mark.parametrize("budget", [1, 3000, 1 << 22])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_tiled_splits_taken_together_match_attention(budget, layout, monkeypatch):
    """The tiled path folds as many splits into one batch as SPLIT_ELEMENTS allows (one at a time, a few,
    all), padding the last with masked keys: the same result every way, stale NaN slots and ALiBi's bias
    included."""
    monkeypatch.setattr(importlib.import_module("exattn.decode"), "SPLIT_ELEMENTS", budget)
    q, k, v, lens = make_case(3, 4, 2, 2, 300, 24, torch.float32, seed=9, lengths=[300, 7, 131])
    slopes = torch.rand(4)
    caches, table = ((k, v), None) if layout == "contiguous" else (lambda p: (p[:2], p[2]))(paged(k, v, lens, 16))
    out, lse = exattn.decode(q, *caches, cache_seqlens=lens, block_table=table, num_splits=7, return_lse=True,
                             backend="tiled", alibi_slopes=slopes)
    for b, length in enumerate(lens.tolist()):
        ref_out, ref_lse = attention_ref(q[b:b + 1].double(), k[b:b + 1, :, :length].double(),
                                         v[b:b + 1, :, :length].double(), causal=True, alibi_slopes=slopes.double(),
                                         return_lse=True)
        torch.testing.assert_close(out[b:b + 1].double(), ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[b:b + 1].double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_key_ranges_read_what_every_sequence_holds_in_place():
    from exattn.decode import key_ranges

    assert key_ranges(100, 0, 100, 1) == [(0, 100, True)]
    assert key_ranges(100, 10, 60, 1) == [(0, 10, False), (10, 60, True), (60, 100, False)]
    assert key_ranges(100, 10, 60, 16) == [(0, 16, False), (16, 48, True), (48, 100, False)]  # page-aligned
    assert key_ranges(100, 0, 40, 1) == [(0, 40, True), (40, 100, False)]
    assert key_ranges(100, 70, 60, 1) == [(0, 100, False)]  # no key that every sequence holds
    assert key_ranges(0, 0, 0, 1) == []


@pytest.mark.parametrize("stale", ["finite", "nan"])
@pytest.mark.parametrize("alibi", [False, True])
def test_tiled_reads_finite_stale_slots_in_place(stale, alibi, monkeypatch):
    """Ragged lengths and left paddings: where the values some sequence does not hold are finite (NaN keys
    are masked away), the tiled path reads the caches in place (no zeroed copy); where values hold NaN, or
    ALiBi's bias would meet the scores, it zeroes them in copies. The oracle's result either way."""
    decode_module = importlib.import_module("exattn.decode")
    copies = []
    real = decode_module.folded_keys
    monkeypatch.setattr(decode_module, "folded_keys", lambda x, stale_slots, *a: copies.append(
        stale_slots is not None) or real(x, stale_slots, *a))
    q, k, v, lens = make_case(3, 4, 2, 2, 300, 24, torch.float32, seed=10, lengths=[300, 40, 131])
    leftpad = torch.tensor([20, 0, 100], dtype=torch.int32)
    clean_k, clean_v = k.clone(), v.clone()
    for b, (first, length) in enumerate(zip(leftpad.tolist(), lens.tolist())):
        for x in (k, v):
            x[b, :, :first] = float("nan")
        if stale == "finite":
            v[b] = v[b].nan_to_num(nan=1e30)
    kwargs = dict(alibi_slopes=torch.rand(4)) if alibi else {}
    out, lse = exattn.decode(q, k, v, cache_seqlens=lens, cache_leftpad=leftpad, return_lse=True, backend="tiled",
                             **kwargs)
    assert any(copies) == (stale == "nan" or alibi)
    assert torch.isfinite(out).all()
    for b, (first, length) in enumerate(zip(leftpad.tolist(), lens.tolist())):
        args = (x[b:b + 1, :, first:length].double() for x in (clean_k, clean_v))
        ref_out, ref_lse = attention_ref(q[b:b + 1].double(), *args, causal=True, return_lse=True,
                                         **{name: x.double() for name, x in kwargs.items()})
        torch.testing.assert_close(out[b:b + 1].double(), ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[b:b + 1].double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", [[0, 0], [0, 5]])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_unvalidated_empty_sequences_give_zeros_and_minus_infinity(backend, lengths, num_splits):
    """validate=False lets a length of 0 through (below Nq): that sequence has no key, so zeros and lse -inf;
    the others are unchanged (one split: its state is the result, without a merge)."""
    q, k, v, _ = make_case(2, 2, 2, 1, 16, 8, torch.float32, seed=10)
    lens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
    out, lse = exattn.decode(q, k, v, cache_seqlens=lens, validate=False, num_splits=num_splits, return_lse=True,
                             backend=backend)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == -math.inf).all())
    if lengths[1]:
        assert_matches_attention(backend, out[1:], lse[1:], q[1:], k[1:], v[1:], lens[1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_validate_false_gives_the_same(backend):
    q, k, v, lens = make_case(2, 2, 2, 1, 50, 16, torch.float16, seed=8)
    k_pages, v_pages, table = paged(k, v, lens, 16)
    kwargs = dict(cache_seqlens=lens, block_table=table, num_splits=2, backend=backend)
    checked = exattn.decode(q, k_pages, v_pages, **kwargs)
    unchecked = exattn.decode(q, k_pages, v_pages, validate=False, **kwargs)
    assert torch.equal(checked, unchecked)


def test_auto_picks_triton_only_on_cuda():
    q, k, v, lens = make_case(1, 2, 2, 1, 8, 8, torch.float32)
    problem = make_decode_problem(q, k, v, lens, None, None, 0, True)
    assert choose_decode_backend(problem, "auto") == ("triton" if q.is_cuda else "tiled")
    assert choose_decode_backend(problem, "tiled") == "tiled"
    problem64 = make_decode_problem(q.double(), k.double(), v.double(), lens, None, None, 0, True)
    assert choose_decode_backend(problem64, "auto") == "tiled"
    with pytest.raises(ValueError, match="float64"):
        choose_decode_backend(problem64, "triton")


# ---------------------------------------------------------------- the split heuristic

def test_plan_splits_fills_the_gpu_only_when_needed():
    h200 = dict(num_sms=132)
    assert plan_splits(64, 8, 131072, **h200) == 3  # 512 programs = 1.3 resident waves; 3 splits = 3.9
    assert plan_splits(64, 8, 131072, **h200, resident_per_sm=2) == 1  # 1.94 waves: nearly whole
    assert plan_splits(1, 8, 131072, **h200) >= 16  # one sequence: splitting keeps the GPU busy
    few = plan_splits(8, 8, 131072, **h200)
    assert 2 <= few <= 8
    assert plan_splits(1, 8, 1024, **h200) == 8  # 16 key blocks: 8 splits of 2 (best on 3 stages; `plan_launch` goes finer)
    assert plan_splits(64, 8, 1024, **h200) == 1  # a full GPU: 3 splits of 5 blocks measured slower
    assert plan_splits(1, 8, 100, **h200) == 1  # 2 key blocks: nothing worth splitting
    assert plan_splits(1, 1, 10**6, num_sms=1, saturating_per_sm=1, resident_per_sm=1) == 1  # one slot


@pytest.mark.parametrize("batch,seqlen,splits", [
    (1, 2048, 16), (1, 4096, 16),  # one program per SM: 1-2 key blocks a split at two per SM
    (1, 8192, 32), (1, 16384, 32), (1, 32768, 32), (1, 131072, 32),  # two per SM from 3 blocks a split
    (2, 4096, 16), (2, 8192, 16), (4, 2048, 8), (4, 4096, 8), (8, 8192, 4),
])
def test_plan_splits_under_filled_measured(batch, seqlen, splits):
    """The best split counts of the H200 sweeps, Hk = 8, contiguous and paged caches alike."""
    assert plan_splits(batch, 8, seqlen, 132) == splits


@pytest.mark.parametrize("batch", (1, 2, 3, 8, 20, 33, 64, 200))
@pytest.mark.parametrize("seqlen", (1, 63, 1000, 32768, 131072))
def test_plan_splits_bounds(batch, seqlen):
    programs, key_blocks = batch * 8, -(-seqlen // 64)
    full = programs >= 132 * 2
    if full:  # waves of the resident programs; splits of at least 16 key blocks
        slots, most = 132 * 3, max(1, min(128, key_blocks // 16))
    else:  # waves of one program per SM, two where the splits keep 3 blocks; splits of at least 4
        slots = 132 * 2 if key_blocks // max(1, 132 * 2 // programs) >= 3 else 132
        most = max(1, min(128, key_blocks // 4, slots // programs))
    splits = plan_splits(batch, 8, seqlen, 132, block_n=64, saturating_per_sm=2, resident_per_sm=3,
                         min_blocks_per_split=4, min_blocks_saturating=3, min_blocks_when_full=16, max_splits=128)
    assert 1 <= splits <= most
    assert full or splits == 1 or programs * splits <= slots  # under-filled and split: no program waits

    def tail_efficiency(s):
        waves = programs * s / slots
        return waves / math.ceil(waves)

    best = max(tail_efficiency(s) for s in range(1, most + 1))
    assert tail_efficiency(splits) >= 0.95 * best  # no SMs idle in a partial last wave
    assert all(tail_efficiency(s) < 0.95 * best for s in range(1, splits))  # and no more splits than that


def test_register_cap_keeps_the_resident_programs_the_plan_counts():
    """2 stages: capped so that `resident_per_sm` programs fit 64 K registers (128 a thread at 4 warps);
    3 stages (shared memory bounds them): uncapped. The launch passes the cap as `maxnreg`."""
    from exattn.backends.triton import decode_kernel as dk

    two, three = (dk.default_config(4, 128, 128, fills_gpu=full) for full in (True, False))
    assert dk.register_cap(two) == 128 and dk.register_cap(three) is None
    assert dk.resident_per_sm(two) * dk.register_cap(two) * 32 * two.num_warps <= dk.REGISTERS_PER_SM

    from test_triton_compile import RecordedLaunch

    recorder, real = RecordedLaunch(), dk.decode_split_kernel
    dk.decode_split_kernel = recorder
    try:
        q, k, v, lens = make_case(2, 8, 2, 1, 64, 16, torch.float16)
        for config in (two, three):
            dk.decode_forward(q, k, v, lens, None, 0.25, 1, config)
    finally:
        dk.decode_split_kernel = real
    assert [kwargs["maxnreg"] for _, kwargs in recorder.calls] == [128, None]


def test_plan_launch_keeps_more_programs_resident_on_a_full_gpu():
    from exattn.decode import plan_launch

    h200 = dict(head_dim=128, value_dim=128, num_sms=132)
    config, splits = plan_launch(64, 8, 4, max_seqlen=131072, **h200)  # 512 programs saturate HBM unsplit
    assert (config.block_n, config.num_stages) == (64, 2) and splits == 1  # 4 resident per SM: 0.97 waves
    config, splits = plan_launch(8, 8, 4, max_seqlen=131072, **h200)  # 64 programs: deep pipelines, split
    assert config.num_stages == 3 and splits == plan_splits(8, 8, 131072, 132, resident_per_sm=3)
    config, splits = plan_launch(4, 8, 128, max_seqlen=8192, **h200)  # 2 row blocks of 64 x 32 = 64 programs
    assert (config.block_m, config.num_stages) == (64, 3)
    assert splits == plan_splits(4, 8, 8192, 132, row_blocks=2)
    config, _ = plan_launch(33, 8, 4, max_seqlen=1024, **h200)  # 264 programs: just full
    assert config.num_stages == 2


@pytest.mark.parametrize("batch,seqlen,splits", [
    (1, 1024, 16),  # 8 programs: one key block a split, 128 programs
    (8, 1024, 8),   # 64 programs: 512 = one wave of 4 resident per SM, 2 blocks a split
    (16, 1024, 4),
    (2, 300, 5),    # 5 key blocks, one each
])
def test_plan_launch_splits_short_sequences_finely_with_two_stages(batch, seqlen, splits):
    from exattn.decode import SHORT_KEY_BLOCKS, plan_launch

    h200 = dict(head_dim=128, value_dim=128, num_sms=132)
    config, planned = plan_launch(batch, 8, 4, max_seqlen=seqlen, **h200)
    assert config.num_stages == 2 and planned == splits
    assert batch * 8 * planned <= 132 * 4 and planned <= -(-seqlen // config.block_n) <= SHORT_KEY_BLOCKS


@pytest.mark.parametrize("batch,seqlen", [(1, 8192), (8, 1040), (32, 1024), (1, 100)])
def test_plan_launch_keeps_the_plan_beyond_short_sequences(batch, seqlen):
    """Longer than SHORT_KEY_BLOCKS blocks, a plan of one split, or too short to split: `plan_splits`, 3 stages."""
    from exattn.decode import plan_launch

    config, planned = plan_launch(batch, 8, 4, max_seqlen=seqlen, head_dim=128, value_dim=128, num_sms=132)
    assert config.num_stages == 3 and planned == plan_splits(batch, 8, seqlen, 132, resident_per_sm=3)


@pytest.mark.parametrize("batch,seqlen,merge", [
    (1, 2048, False), (1, 4096, False), (1, 16384, True), (8, 4096, True), (8, 1024, True), (64, 8192, False),
])
def test_plan_launch_merges_in_the_split_kernel_past_one_program_per_sm(batch, seqlen, merge):
    """B = 1 with 16 splits is 128 programs on 132 SMs: the combine kernel; 32 splits, or B = 8's 4: merged
    in the split kernel; unsplit: nothing to merge."""
    from exattn.decode import plan_launch

    config, splits = plan_launch(batch, 8, 4, max_seqlen=seqlen, head_dim=128, value_dim=128, num_sms=132)
    assert config.merge_in_split == merge and (splits > 1 or not merge)


def test_plan_splits_rejects_nonsense():
    with pytest.raises(ValueError, match="max_seqlen"):
        plan_splits(1, 8, 0, 132)
    with pytest.raises(ValueError, match="num_sms"):
        plan_splits(1, 8, 10, 0)


# ---------------------------------------------------------------- errors

def error_case(**overrides):
    q, k, v, lens = make_case(2, 4, 2, 3, 32, 8, torch.float32)
    args = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=lens)
    args.update(overrides)
    return args


def call(args, **kwargs):
    args = dict(args)
    return exattn.decode(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args, **kwargs)


@pytest.mark.parametrize("overrides, error, pattern", [
    (dict(cache_seqlens=torch.tensor([32, 2], dtype=torch.int32)), ValueError, r"cache_seqlens\[1\] = 2 is below Nq = 3"),
    (dict(cache_seqlens=torch.tensor([33, 5], dtype=torch.int32)), ValueError, r"cache_seqlens\[0\] = 33 is beyond the cache"),
    (dict(cache_seqlens=torch.tensor([5, 5])), TypeError, "cache_seqlens must have dtype torch.int32, got torch.int64"),
    (dict(cache_seqlens=[5, 5]), TypeError, "cache_seqlens must be an int32 torch.Tensor"),
    (dict(cache_seqlens=torch.tensor([5, 5, 5], dtype=torch.int32)), ValueError, r"cache_seqlens must have shape \(2,\)"),
    (dict(k_cache=torch.randn(3, 2, 32, 8)), ValueError, "k_cache has batch 3 but q has 2"),
    (dict(k_cache=torch.randn(2, 3, 32, 8), v_cache=torch.randn(2, 3, 32, 8)), ValueError, "multiple of k_cache heads"),
    (dict(k_cache=torch.randn(2, 0, 32, 8), v_cache=torch.randn(2, 0, 32, 8)), ValueError,
     r"k_cache and v_cache have no heads \(dim 1 is 0\)"),
    (dict(v_cache=torch.randn(2, 2, 31, 8)), ValueError, "v_cache has length 31 but k_cache has 32"),
    (dict(k_cache=torch.randn(2, 2, 32, 9)), ValueError, "k_cache has head dim 9 but q has 8"),
    (dict(v_cache=torch.randn(2, 2, 32, 8, dtype=torch.float16)), TypeError, "v_cache has dtype"),
    (dict(k_cache=torch.randn(2, 32, 8)), ValueError, "k_cache must have 4 dims"),
    (dict(q=torch.randn(2, 4, 0, 8)), ValueError, "Nq >= 1"),
    (dict(q=torch.randint(0, 3, (2, 4, 3, 8))), TypeError, "q must be float16"),
])
def test_contiguous_errors(overrides, error, pattern):
    args = error_case(**{key: (val.to(DEVICE) if isinstance(val, torch.Tensor) else val)
                         for key, val in overrides.items()})
    with pytest.raises(error, match=pattern):
        call(args)


def test_paged_errors():
    q, k, v, lens = make_case(2, 4, 2, 3, 32, 8, torch.float32)
    k_pages, v_pages, table = paged(k, v, lens, 16)
    args = dict(q=q, k_cache=k_pages, v_cache=v_pages, cache_seqlens=lens)
    with pytest.raises(ValueError, match=r"beyond the cache: the pages block_table names hold 1 x 16 = 16"):
        call(args, block_table=table[:, :1].contiguous())
    bad = table.clone()
    bad[1, 0] = k_pages.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = \d+ is not a page of k_cache"):
        call(args, block_table=bad)
    with pytest.raises(TypeError, match="block_table must have dtype torch.int32"):
        call(args, block_table=table.long())
    with pytest.raises(ValueError, match=r"block_table must have shape \(2, 'any'\)"):
        call(args, block_table=table[:1])
    with pytest.raises(ValueError, match="v_cache has page size 8 but k_cache has 16"):
        call(dict(args, v_cache=v_pages[:, :, :8]), block_table=table)


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(num_splits=-1), ValueError, "num_splits must be >= 0"),
    (dict(num_splits=2.0), TypeError, "num_splits must be an int"),
    (dict(backend="naive"), ValueError, "backend must be one of"),
    (dict(scale="big"), TypeError, "scale must be a float"),
    (dict(validate=1), TypeError, "validate must be a bool"),
    (dict(return_lse="yes"), TypeError, "return_lse must be a bool, got 'yes' \\(str\\)"),
])
def test_argument_errors(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        call(error_case(), **kwargs)


def test_triton_refuses_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend 'triton' cannot serve these inputs: inputs are on the CPU"):
        call(error_case(), backend="triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    q, k, v, lens = make_case(1, 2, 1, 1, 8, 8, torch.float32)
    out, lse = exattn.decode(q[:0], k[:0], v[:0], cache_seqlens=lens[:0], return_lse=True, backend=backend)
    assert out.shape == (0, 2, 1, 8) and lse.shape == (0, 2, 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "sinks"])
def test_inputs_that_require_grad_are_refused_with_grad_on(backend, name):
    """decode has no backward: with grad mode on, an input that requires grad is refused by name (also on
    the kept path of a signature seen before); under torch.no_grad() the same call runs."""
    q, k, v, lens = make_case(2, 2, 1, 1, 8, 8, torch.float32)
    args = dict(q=q, k_cache=k, v_cache=v, sinks=torch.randn(2, device=DEVICE))
    exattn.decode(**args, cache_seqlens=lens, backend=backend)  # kept for this signature
    args[name] = args[name].clone().requires_grad_()
    with pytest.raises(ValueError, match=f"decode computes no gradient, but {name} requires grad"):
        exattn.decode(**args, cache_seqlens=lens, backend=backend)
    with torch.no_grad():
        out = exattn.decode(**args, cache_seqlens=lens, backend=backend)
    assert out.shape == (2, 2, 1, 8) and not out.requires_grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_query_head_gives_empty_outputs(backend):
    q, k, v, lens = make_case(2, 2, 1, 1, 8, 8, torch.float32)
    for _ in range(2):  # the second call of a signature takes the kept path
        out, lse = exattn.decode(q[:, :0], k, v, cache_seqlens=lens, return_lse=True, backend=backend)
        assert out.shape == (2, 0, 1, 8) and lse.shape == (2, 0, 1)


# ---------------------------------------------------------------- window, softcap, ALiBi and sinks


@pytest.mark.parametrize("rules", ["window", "softcap", "alibi", "sinks", "all"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_score_rules_match_the_oracle(rules, num_splits):
    """Each sequence against the float64 oracle over its own keys (the new tokens last, causal)."""
    g = torch.Generator().manual_seed(3)
    b, hq, hk, nq, nmax, d = 3, 4, 2, 2, 40, 16
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64)
               for shape in ((b, hq, nq, d), (b, hk, nmax, d), (b, hk, nmax, d)))
    lens = torch.tensor([40, 17, 2], dtype=torch.int32)
    slopes, sinks = torch.rand(b, hq, generator=g, dtype=torch.float64), torch.randn(hq, generator=g,
                                                                                    dtype=torch.float64)
    kwargs = {"window": {"window": (5, 0)}, "softcap": {"softcap": 3.0}, "alibi": {"alibi_slopes": slopes},
              "sinks": {"sinks": sinks},
              "all": {"window": (3, 2), "softcap": 2.0, "alibi_slopes": slopes, "sinks": sinks}}[rules]
    out, lse = exattn.decode(q, k, v, cache_seqlens=lens, num_splits=num_splits, return_lse=True, **kwargs)
    for i, n in enumerate(lens.tolist()):
        per_seq = dict(kwargs, alibi_slopes=slopes[i:i + 1]) if "alibi_slopes" in kwargs else kwargs
        ref_out, ref_lse = attention_ref(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], causal=True,
                                         return_lse=True, **per_seq)
        torch.testing.assert_close(out[i:i + 1], ref_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[i:i + 1], ref_lse.float(), rtol=1e-6, atol=1e-6)


def test_the_decode_kernels_serve_every_rule_and_gluon_names_them():
    from exattn.backends.triton.gluon_decode import gluon_decode_reasons

    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16)
    problem = make_decode_problem(q, k, v, None, None, None, 0, True, window=(2, 0), softcap=1.0,
                                  alibi_slopes=torch.ones(2), sinks=torch.zeros(2),
                                  cache_leftpad=torch.ones(1, dtype=torch.int32))
    assert problem.score_rules_in_use == ["window", "softcap", "cache_leftpad", "alibi_slopes", "sinks"]
    assert triton_reasons(problem) == []
    assert choose_decode_backend(problem, "triton") == "triton"
    refusal = gluon_decode_reasons(q, k, v, None, problem.score_rules_in_use)
    assert "score rules (softcap, cache_leftpad, alibi_slopes, sinks) run on the Triton decode kernel" in refusal
    with pytest.raises(ValueError, match="softcap must be"):
        exattn.decode(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="sinks"):
        exattn.decode(q, k, v, sinks=torch.zeros(3))


def test_a_cache_too_small_for_the_new_tokens_is_refused_before_any_length_is_read():
    q, k, v, lens = make_case(2, 2, 1, 5, 4, 8, torch.float32, lengths=[4, 4])
    with pytest.raises(ValueError, match="the cache holds 4 keys per sequence, fewer than Nq = 5: no length is valid"):
        exattn.decode(q, k, v, cache_seqlens=lens, validate=False)
    k_pages, v_pages = (torch.randn(0, 1, 16, 8, device=DEVICE) for _ in range(2))
    table = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"k_cache holds no pages \(num_pages = 0\)"):
        exattn.decode(q[:, :, :1], k_pages, v_pages, block_table=table, validate=False)
