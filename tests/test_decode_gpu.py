"""exattn.decode's Triton kernels compiled on a CUDA GPU, in bfloat16 (run with -m gpu)."""

import pytest
import torch

import exattn
from exattn.reference import attention_ref
from error_rule import assert_matches_oracle
from test_decode import paged

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BF16 = torch.bfloat16


def make_case(batch, heads_q, heads_k, len_q, capacity, head_dim, seed=0, value_dim=None, lengths=None):
    """bf16 q and contiguous caches on the GPU, stale slots NaN, ragged lengths in [Nq, capacity]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    value_dim = value_dim or head_dim
    q = torch.randn(batch, heads_q, len_q, head_dim, generator=g, device="cuda").to(BF16)
    k = torch.randn(batch, heads_k, capacity, head_dim, generator=g, device="cuda").to(BF16)
    v = torch.randn(batch, heads_k, capacity, value_dim, generator=g, device="cuda").to(BF16)
    if lengths is None:
        lengths = torch.randint(len_q, capacity + 1, (batch,), generator=g, device="cuda")
        lengths[0] = capacity
    lens = torch.as_tensor(lengths, dtype=torch.int32, device="cuda")
    for b, length in enumerate(lens.tolist()):
        k[b, :, length:] = float("nan")
        v[b, :, length:] = float("nan")
    return q, k, v, lens


def assert_matches_attention(name, out, lse, q, k, v, lens, batches=None):
    assert out.dtype == BF16 and lse.dtype == torch.float32
    for b in batches or range(q.shape[0]):
        length = int(lens[b])
        args = (q[b:b + 1], k[b:b + 1, :, :length], v[b:b + 1, :, :length])
        ref_out, ref_lse = attention_ref(*args, causal=True, return_lse=True)
        naive_out, naive_lse = exattn.attention(*args, causal=True, backend="naive", return_lse=True)
        assert_matches_oracle(f"{name} out[{b}]", out[b:b + 1], naive_out, ref_out, BF16)
        assert_matches_oracle(f"{name} lse[{b}]", lse[b:b + 1], naive_lse, ref_lse, BF16)


@pytest.mark.parametrize("len_q", (1, 4, 16))
@pytest.mark.parametrize("num_splits", (0, 1, 7, 64))
def test_bf16_llama_shapes(len_q, num_splits):
    q, k, v, lens = make_case(4, 32, 8, len_q, 5000, 128, seed=len_q)
    out, lse = exattn.decode(q, k, v, cache_seqlens=lens, num_splits=num_splits, return_lse=True)
    assert_matches_attention(f"Nq={len_q} splits={num_splits}", out, lse, q, k, v, lens)


@pytest.mark.parametrize("page_size", (16, 24, 64, 256))
def test_bf16_paged_equals_contiguous(page_size):
    q, k, v, lens = make_case(5, 32, 8, 1, 3000, 128, seed=page_size)
    k_pages, v_pages, table = paged(k, v, lens, page_size)
    for num_splits in (0, 1, 5):
        kwargs = dict(cache_seqlens=lens, num_splits=num_splits, return_lse=True)
        out, lse = exattn.decode(q, k_pages, v_pages, block_table=table, **kwargs)
        assert_matches_attention(f"paged {page_size}", out, lse, q, k, v, lens)
        flat_out, flat_lse = exattn.decode(q, k, v, **kwargs)
        torch.testing.assert_close(out, flat_out, rtol=0, atol=1e-2)
        torch.testing.assert_close(lse, flat_lse, rtol=0, atol=1e-4)


@pytest.mark.parametrize("merge_in_split", (False, True), ids=("combine-kernel", "merge-in-split"))
@pytest.mark.parametrize("stages", (2, 3))
def test_bf16_planned_configs(stages, merge_in_split):
    """The configurations the plan picks (3 stages, or 2 on a full GPU; splits merged by the
    combine kernel or in the split kernel), contiguous and paged."""
    from exattn.backends.triton.decode_kernel import DecodeConfig, decode_forward

    q, k, v, lens = make_case(4, 32, 8, 1, 3000, 128, seed=stages)
    config = DecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=stages, merge_in_split=merge_in_split)
    k_pages, v_pages, table = paged(k, v, lens, 16)
    for num_splits in (1, 6):
        out, lse = decode_forward(q, k, v, lens, None, 128 ** -0.5, num_splits, config)
        assert_matches_attention(f"{config} splits={num_splits}", out, lse, q, k, v, lens)
        paged_out, paged_lse = decode_forward(q, k_pages, v_pages, lens, table, 128 ** -0.5, num_splits, config)
        torch.testing.assert_close(paged_out, out, rtol=0, atol=1e-2)
        torch.testing.assert_close(paged_lse, lse, rtol=0, atol=1e-4)


@pytest.mark.parametrize("page_size", (16, 256))
def test_bf16_short_and_empty_sequences_paged(page_size):
    """Lengths 0, 1, about one key block and a few blocks, through both planned configurations
    (2 and 3 stages) and split counts that leave splits empty. Spare table slots hold -7,
    spare cache slots and pages NaN."""
    from exattn.backends.triton.decode_kernel import DecodeConfig, decode_forward

    lengths = [0, 1, 63, 64, 65, 700, 1024, 5]
    q, k, v, lens = make_case(8, 32, 8, 1, 1024, 128, seed=page_size, lengths=lengths)
    k_pages, v_pages, table = paged(k, v, lens, page_size)
    table = torch.cat([table, torch.full_like(table[:, :3], -7)], dim=1).contiguous()
    real = [b for b, n in enumerate(lengths) if n > 0]
    for stages, merge_in_split in ((2, False), (3, False), (2, True), (3, True)):
        config = DecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=stages, merge_in_split=merge_in_split)
        for num_splits in (1, 3, 16, 32):
            out, lse = decode_forward(q, k_pages, v_pages, lens, table, 128 ** -0.5, num_splits, config)
            name = f"stages={stages} merge_in_split={merge_in_split} splits={num_splits}"
            assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf")), name
            assert_matches_attention(name, out, lse, q, k, v, lens, batches=real)


def test_bf16_full_gpu_plan():
    """B = 64 x Hk = 8 fills the GPU: the 2-stage configuration through exattn.decode, ragged lengths."""
    q, k, v, lens = make_case(64, 32, 8, 1, 1500, 128, seed=5)
    out, lse = exattn.decode(q, k, v, cache_seqlens=lens, return_lse=True)
    assert_matches_attention("B=64", out, lse, q, k, v, lens, batches=[0, 1, 31, 63])


@pytest.mark.parametrize("batch", (1, 8))
def test_bf16_short_sequence_plan(batch):
    """Sequences of at most 1024 keys: 2 stages, splits of one or two key blocks, through
    exattn.decode, contiguous and with 16-key pages, ragged lengths."""
    from exattn.decode import make_decode_problem, triton_plan

    q, k, v, lens = make_case(batch, 32, 8, 1, 1024, 128, seed=batch, lengths=[1024, 77, 1000, 64, 1, 513, 900, 2][:batch])
    config, splits = triton_plan(make_decode_problem(q, k, v, lens, None, None, 0, False))
    assert config.num_stages == 2 and splits == {1: 16, 8: 8}[batch]
    out, lse = exattn.decode(q, k, v, cache_seqlens=lens, return_lse=True)
    assert_matches_attention(f"B={batch}", out, lse, q, k, v, lens)
    k_pages, v_pages, table = paged(k, v, lens, 16)
    paged_out, paged_lse = exattn.decode(q, k_pages, v_pages, cache_seqlens=lens, block_table=table, return_lse=True)
    torch.testing.assert_close(paged_out, out, rtol=0, atol=1e-2)
    torch.testing.assert_close(paged_lse, lse, rtol=0, atol=1e-4)


@pytest.mark.parametrize("shape", [(8, 1, 8, 64, 64), (6, 2, 2, 96, 96), (4, 4, 3, 256, 128), (4, 4, 1, 59, 40)],
                         ids=("mqa-128rows", "gqa-d96", "d256", "d59-dv40"))
def test_bf16_head_dims_and_groups(shape):
    heads_q, heads_k, len_q, head_dim, value_dim = shape
    q, k, v, lens = make_case(3, heads_q, heads_k, len_q, 700, head_dim, value_dim=value_dim)
    out, lse = exattn.decode(q, k, v, cache_seqlens=lens, return_lse=True, num_splits=3)
    assert_matches_attention(str(shape), out, lse, q, k, v, lens)


def test_bf16_offsets_beyond_int32():
    """16 x 8 x 131072 x 128 = 2**31 elements per cache: the last sequence's keys lie past int32 offsets."""
    q, k, v, lens = make_case(16, 32, 8, 1, 131072, 128, lengths=[131072] * 15 + [131000])
    out, lse = exattn.decode(q, k, v, cache_seqlens=lens, return_lse=True)
    assert_matches_attention("int64 offsets", out, lse, q, k, v, lens, batches=[0, 15])


@pytest.mark.parametrize("page_size", (16, 256))
def test_bf16_page_offsets_beyond_int32(page_size):
    """The sequences' pages lie past 2**31 elements of the pool (index x page stride needs 64 bits),
    in reverse order; the pool's other pages are never written."""
    q, k, v, lens = make_case(2, 32, 8, 1, 4096, 128, lengths=[4096, 3001])
    slots = 4096 // page_size
    num_pages = 2**31 // (8 * page_size * 128) + 2 * slots
    table = (num_pages - 1 - torch.arange(2 * slots, dtype=torch.int32, device="cuda")).view(2, slots)
    k_pages, v_pages = (torch.empty(num_pages, 8, page_size, 128, dtype=BF16, device="cuda") for _ in range(2))
    for cache, pages in ((k, k_pages), (v, v_pages)):
        pages[table.flatten().long()] = cache.view(2, 8, slots, page_size, 128).transpose(1, 2).flatten(0, 1)
    out, lse = exattn.decode(q, k_pages, v_pages, cache_seqlens=lens, block_table=table, return_lse=True)
    assert_matches_attention(f"paged {page_size} int64 offsets", out, lse, q, k, v, lens)
    del k_pages, v_pages
    torch.cuda.empty_cache()


def test_cuda_graph_capture_with_validate_false():
    """validate=False never syncs, so decode can be captured; replays read the current lengths."""
    q, k, v, full = make_case(4, 32, 8, 1, 4096, 128, lengths=[4096] * 4)
    k_pages, v_pages, table = paged(k, v, full, 64)
    lens = torch.tensor([4096, 100, 2000, 1], dtype=torch.int32, device="cuda")
    kwargs = dict(cache_seqlens=lens, block_table=table, num_splits=0, validate=False)
    exattn.decode(q, k_pages, v_pages, **kwargs)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = exattn.decode(q, k_pages, v_pages, **kwargs)
    lens.copy_(torch.tensor([4000, 1000, 1, 3333], dtype=torch.int32))  # the next step's lengths
    graph.replay()
    torch.cuda.synchronize()
    out, lse = exattn.decode(q, k_pages, v_pages, cache_seqlens=lens, block_table=table, return_lse=True)
    assert torch.equal(captured, out)
    assert_matches_attention("graph", out, lse, q, k, v, lens)
    again = exattn.decode(q, k_pages, v_pages, cache_seqlens=lens, block_table=table)
    assert torch.equal(out, again)  # run to run, bitwise


def test_calls_on_streams_at_once_merge_through_counters_of_their_own():
    """The split kernels' arrival counts are kept per stream: calls on two streams at once (kept plans
    included) give the one-stream result, contiguous (Gluon) and paged (Triton)."""
    q, k, v, lens = make_case(8, 32, 8, 1, 16384, 128, lengths=[16384] * 8)
    k_pages, v_pages, table = paged(k, v, lens, 256)
    calls = [dict(k_cache=k, v_cache=v), dict(k_cache=k_pages, v_cache=v_pages, block_table=table)]
    expected = [exattn.decode(q, cache_seqlens=lens, num_splits=16, **call) for call in calls]
    streams = [torch.cuda.Stream() for _ in range(2)]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(20):
        for stream in streams:
            with torch.cuda.stream(stream):
                outs.append([exattn.decode(q, cache_seqlens=lens, num_splits=16, **call) for call in calls])
    torch.cuda.synchronize()
    assert all(torch.equal(out, want) for pair in outs for out, want in zip(pair, expected))


# ---------------------------------------------------------------- score rules in the kernels

@pytest.mark.parametrize("dtype", (BF16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("rules", ("window", "softcap", "alibi", "sinks", "all"))
@pytest.mark.parametrize("layout", ("contiguous", "paged"))
@pytest.mark.parametrize("len_q", (1, 4))
def test_rules_match_the_oracle(dtype, rules, layout, len_q, monkeypatch):
    """`backend="auto"` runs them in the Triton kernel (never the tiled path), planned splits and 1 and 7."""
    from test_decode_rules import rule_kwargs

    q, k, v, lens = make_case(3, 32, 8, len_q, 3000, 128, seed=len(rules) + len_q, lengths=[3000, 1001, len_q])
    q, k, v = (x.to(dtype) for x in (q, k, v))
    kwargs = rule_kwargs(rules, 32, 3, window=700, softcap=20.0)
    caches = (k, v, None) if layout == "contiguous" else paged(k, v, lens, 16)
    assert_auto_runs_the_triton_kernel(monkeypatch, f"{rules} {layout}", q, caches, lens, (k, v), kwargs)


def assert_auto_runs_the_triton_kernel(monkeypatch, name, q, caches, lens, clean_kv, kwargs, leftpad=None):
    """`decode` with backend="auto" over planned splits and 1 and 7 runs the Triton decode kernel each time,
    and matches the oracle over the clean keys and values (`assert_rules_match`)."""
    from exattn.backends.triton import decode_kernel
    from test_decode_rules import assert_rules_match

    runs = []
    real = decode_kernel.decode_forward
    monkeypatch.setattr(decode_kernel, "decode_forward", lambda *a, **kw: runs.append(1) or real(*a, **kw))
    for num_splits in (0, 1, 7):
        out, lse = exattn.decode(q, caches[0], caches[1], block_table=caches[2], cache_seqlens=lens,
                                 cache_leftpad=leftpad, num_splits=num_splits, return_lse=True, **kwargs)
        assert_rules_match(f"{name} splits={num_splits}", out, lse, q, *clean_kv, lens, kwargs, leftpad=leftpad)
    assert len(runs) == 3, "auto did not take the Triton decode kernel"
    exattn.check_errors()


@pytest.mark.parametrize("dtype", (BF16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("layout", ("contiguous", "paged"))
@pytest.mark.parametrize("capacity", (3000, 40000))
def test_left_padding_matches_the_oracle(dtype, layout, capacity, monkeypatch):
    """`cache_leftpad` in the Triton kernel (40k keys would take the Gluon kernel without it); the padding's
    slots hold NaN; the last sequence keeps fewer keys than its new tokens."""
    q, k, v, lens = make_case(3, 32, 8, 4, capacity, 128, seed=capacity, lengths=[capacity, 1001, 6])
    q, k, v = (x.to(dtype) for x in (q, k, v))
    leftpad = torch.tensor([capacity // 3, 1000, 3], dtype=torch.int32, device="cuda")
    clean_k, clean_v = k.clone(), v.clone()
    for b, first in enumerate(leftpad.tolist()):
        k[b, :, :first] = float("nan")
        v[b, :, :first] = float("nan")
    caches = (k, v, None) if layout == "contiguous" else paged(k, v, lens, 16)
    assert_auto_runs_the_triton_kernel(monkeypatch, f"leftpad {layout}", q, caches, lens, (clean_k, clean_v), {},
                                       leftpad=leftpad)


@pytest.mark.parametrize("layout", ("contiguous", "paged"))
def test_a_4k_window_over_128k_keys_reads_only_the_window(layout):
    """V holds NaN before the block where the window starts: a read would show. Long caches on an
    under-filled GPU would take the Gluon kernel, which leaves rules to the Triton kernel."""
    from test_decode_rules import assert_rules_match

    q, k, v, lens = make_case(1, 32, 8, 1, 131072, 128, lengths=[131000])
    clean_v = v.clone()
    v[:, :, :(131000 - 1 - 4096) // 64 * 64] = float("nan")
    kwargs = dict(window=(4096, 0), sinks=torch.randn(32, device="cuda"))
    caches = (k, v, None) if layout == "contiguous" else paged(k, v, lens, 256)
    out, lse = exattn.decode(q, caches[0], caches[1], block_table=caches[2], cache_seqlens=lens, return_lse=True,
                             **kwargs)
    assert not out.isnan().any()
    assert_rules_match("4k window of 128k", out, lse, q, k, clean_v, lens, kwargs)


def test_softcap_with_huge_logits_stays_finite():
    from test_decode_rules import assert_rules_match

    q, k, v, lens = make_case(2, 32, 8, 2, 2000, 128, seed=3, lengths=[2000, 999])
    q = q * 40
    for softcap in (1.0, 50.0):
        out, lse = exattn.decode(q, k, v, cache_seqlens=lens, softcap=softcap, return_lse=True)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert_rules_match(f"softcap {softcap}", out, lse, q, k, v, lens, dict(softcap=softcap))


# ---------------------------------------------------------------- validation without a device sync

def clear_records():
    from exattn import errors

    torch.cuda.synchronize()
    for state in errors._RECORDS.values():
        state.record.zero_()
        state.rung.value = 0


@pytest.mark.parametrize("layout", ("contiguous", "paged", "gluon"))
def test_validated_decode_never_syncs(layout):
    """Under torch.cuda.set_sync_debug_mode("error") every host sync raises: validated calls on valid
    inputs (Triton kernel, paged, and the Gluon kernel on a long cache) run without one."""
    capacity = 40000 if layout == "gluon" else 3000
    q, k, v, lens = make_case(2, 32, 8, 1, capacity, 128, seed=4)
    table = None
    if layout == "paged":
        k, v, table = paged(k, v, lens, 64)
    calls = [dict(), dict(window=(500, 0), sinks=torch.zeros(32, device="cuda"))]
    for kwargs in calls:  # compile, plan and make the error record outside the check
        exattn.decode(q, k, v, cache_seqlens=lens, block_table=table, **kwargs)
    torch.cuda.synchronize()
    clear_records()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            for kwargs in calls:
                exattn.decode(q, k, v, cache_seqlens=lens, block_table=table, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    exattn.check_errors()


@pytest.mark.parametrize("case", ("beyond", "below", "page", "gluon-beyond"))
def test_bad_inputs_raise_at_check_errors_and_at_the_next_call(case, monkeypatch):
    """The kernels (Triton; Gluon for the long contiguous cache) record the first violation and set
    the doorbell in pinned host memory; check_errors() raises it, or else the next validated call."""
    from exattn import errors
    import exattn.backends.triton.gluon_decode as gd

    clear_records()
    capacity = 40000 if case == "gluon-beyond" else 3000
    q, k, v, lens = make_case(3, 32, 8, 2, capacity, 128, seed=5)
    table = bad_table = None
    bad = lens.clone()
    if case in ("beyond", "gluon-beyond"):
        bad[1] = capacity + 1
    elif case == "below":
        bad[2] = 1
    else:
        k, v, table = paged(k, v, lens, 64)
        bad_table = table.clone()
        bad_table[0, 3] = 99999
    pattern = {"beyond": rf"cache_seqlens\[1\] = {capacity + 1} is beyond the cache: k_cache holds {capacity} keys",
               "gluon-beyond": rf"cache_seqlens\[1\] = {capacity + 1} is beyond the cache",
               "below": r"cache_seqlens\[2\] = 1 is below Nq = 2",
               "page": r"block_table\[0, 3\] = 99999 is not a page of k_cache"}[case]
    gluon_runs = []
    real = gd.gluon_decode_forward
    monkeypatch.setattr(gd, "gluon_decode_forward", lambda *a, **kw: gluon_runs.append(1) or real(*a, **kw))
    out = exattn.decode(q, k, v, cache_seqlens=bad, block_table=bad_table if case == "page" else table)
    assert bool(gluon_runs) is (case == "gluon-beyond")
    valid = [b for b in range(3) if int(bad[b]) == int(lens[b]) and not (case == "page" and b == 0)]
    assert not out[valid].isnan().any()
    with pytest.raises(ValueError, match=pattern):
        exattn.check_errors()
    exattn.check_errors()  # reset
    exattn.decode(q, k, v, cache_seqlens=bad, block_table=bad_table if case == "page" else table)
    torch.cuda.synchronize()
    assert errors._RECORDS[q.device].rung.value == 1, "the kernel did not set the doorbell in pinned memory"
    with pytest.raises(ValueError, match=pattern):
        exattn.decode(q, k, v, cache_seqlens=lens, block_table=table)
    exattn.decode(q, k, v, cache_seqlens=lens, block_table=table)
    exattn.check_errors()
    exattn.decode(q, k, v, cache_seqlens=bad, block_table=bad_table if case == "page" else table)  # a kept plan
    with pytest.raises(ValueError, match=pattern):
        exattn.check_errors()


def test_validated_calls_capture_in_a_cuda_graph_and_replays_record():
    q, k, v, lens = make_case(2, 32, 8, 1, 4096, 128, lengths=[4096, 4096])
    k_pages, v_pages, table = paged(k, v, lens, 64)
    clear_records()
    kwargs = dict(cache_seqlens=lens, block_table=table)
    exattn.decode(q, k_pages, v_pages, **kwargs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = exattn.decode(q, k_pages, v_pages, **kwargs)
    lens.copy_(torch.tensor([100, 2000], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, exattn.decode(q, k_pages, v_pages, **kwargs), rtol=0, atol=0)
    exattn.check_errors()
    lens.copy_(torch.tensor([100, 5000], dtype=torch.int32))
    graph.replay()
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 5000 is beyond the cache"):
        exattn.check_errors()
