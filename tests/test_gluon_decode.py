"""The Gluon (sm_90) decode split kernel: compiled for Hopper on the CPU, and against the oracle on
the GPU (-m gpu). CPU (CI): it compiles without spills, 4 programs an SM with one new token, one K
and one V slot filled by TMA copies, and `gluon_decode_reasons` names every refusal;
`plan_launch` marks only the launches it was measured on. GPU: ragged lengths with NaN beyond them,
Nq up to 4, split counts from 1 to more than there are key blocks, fp16 and bf16, CUDA graphs."""

from __future__ import annotations

import re

import pytest
import torch
from test_gluon_forward import HOPPER_SHARED_BYTES, resource_usage
from test_triton_compile import RecordedLaunch, compile_for_sm90

import exattn
from exattn.backends.triton import decode_kernel
from exattn.backends.triton import gluon_decode as gd
from exattn.decode import GLUON_FULL_MIN_KEYS, GLUON_MIN_KEYS, plan_launch


SPLIT_KERNEL = gd.gluon_decode_split_kernel


def compiled_kernel(dtype: torch.dtype, len_q: int, monkeypatch, heads_q: int = 32, num_splits: int = 5,
                    merge_in_split: bool = False, options: dict | None = None, validate: bool = False,
                    window_left: int = -1):
    """The kernel as `gluon_decode_forward` launches it on CPU tensors, compiled for sm_90a."""
    kernel, recorder = SPLIT_KERNEL, RecordedLaunch()
    monkeypatch.setattr(gd, "gluon_decode_split_kernel", recorder)
    monkeypatch.setattr(decode_kernel, "decode_combine_kernel", RecordedLaunch())
    q = torch.randn(3, heads_q, len_q, 128).to(dtype)
    k, v = (torch.randn(3, 8, 4000, 128).to(dtype) for _ in range(2))
    gd.gluon_decode_forward(q, k, v, torch.tensor([4000, 17, 2500], dtype=torch.int32), 0.1, num_splits, merge_in_split,
                            validate=validate, window_left=window_left)
    args, kwargs = recorder.calls[0]
    return compile_for_sm90(kernel, args, {**kwargs, **(options or {})})


THREE_PER_SM_REGISTERS = 168  # 65536 registers / (3 programs * 128 threads), allocated in steps of 8


@pytest.mark.parametrize("dtype,len_q,heads_q,num_splits,merge_in_split,window_left", [
    (torch.bfloat16, 1, 32, 1, False, -1), (torch.float16, 1, 32, 5, False, -1), (torch.bfloat16, 4, 32, 5, False, -1),
    (torch.bfloat16, 1, 32, 5, True, -1), (torch.float16, 1, 32, 8, True, -1), (torch.bfloat16, 1, 8, 7, True, -1),
    (torch.bfloat16, 2, 64, 2, True, -1), (torch.bfloat16, 1, 32, 9, True, -1), (torch.bfloat16, 1, 32, 4, True, 4096),
    (torch.bfloat16, 3, 32, 3, False, 100),
])
def test_compiles_for_sm90_with_one_tma_slot_per_tensor(dtype, len_q, heads_q, num_splits, merge_in_split, window_left,
                                                         tmp_path, monkeypatch):
    """One new token: 4 programs an SM uncapped. Nq > 1: 3 uncapped, and 4 under `register_cap`'s
    option with at most the 16 bytes of spill its comment names. A window (window_left >= 0) keeps both."""
    kernel = compiled_kernel(dtype, len_q, monkeypatch, heads_q, num_splits, merge_in_split, window_left=window_left)
    usage = resource_usage(kernel, tmp_path)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"register spills: {usage}"
    limit = gd.FOUR_PER_SM_REGISTERS if len_q == 1 else THREE_PER_SM_REGISTERS
    assert usage["REG"] <= limit, f"fewer programs an SM than the plan counts on: {usage}"
    block_bytes = gd.BLOCK_N * gd.HEAD_DIM * dtype.itemsize
    assert 2 * block_bytes <= kernel.metadata.shared < 3 * block_bytes <= HOPPER_SHARED_BYTES, kernel.metadata.shared
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx, "K/V no longer arrive by TMA"
    assert "cp.async.wait_group" not in ptx
    assert "mma.sync.aligned.m16n8k16" in ptx
    merges = merge_in_split and gd.merge_shape(heads_q // 8 * len_q, num_splits) is not None
    assert bool(re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)) is merges, "arrival count"
    if len_q > 1:
        capped = compiled_kernel(dtype, len_q, monkeypatch, heads_q, num_splits, merge_in_split,
                                 options={"maxnreg": gd.FOUR_PER_SM_REGISTERS})
        usage = resource_usage(capped, tmp_path)
        assert usage["REG"] <= gd.FOUR_PER_SM_REGISTERS and usage["LOCAL"] == 0 and usage["STACK"] <= 16, usage


@pytest.mark.parametrize("len_q,merge_in_split", [(1, True), (1, False), (4, True)])
def test_validation_keeps_the_register_budget(len_q, merge_in_split, tmp_path, monkeypatch):
    """With validate=True the kernel also clamps and checks each length (one program a sequence claims
    the error record by an atomic compare-and-swap): no spills, and 128 registers with one new token."""
    kernel = compiled_kernel(torch.bfloat16, len_q, monkeypatch, merge_in_split=merge_in_split, validate=True)
    usage = resource_usage(kernel, tmp_path)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"register spills: {usage}"
    assert usage["REG"] <= (gd.FOUR_PER_SM_REGISTERS if len_q == 1 else THREE_PER_SM_REGISTERS), usage
    assert re.search(r"atom\.global(\.\w+)*\.cas", kernel.asm["ptx"]), "no compare-and-swap of the error flag"


def test_register_cap_applies_only_past_three_programs_an_sm(monkeypatch):
    monkeypatch.setattr(gd, "multiprocessor_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert gd.register_cap(3 * 132, cuda) == {}
    assert gd.register_cap(3 * 132 + 1, cuda) == {"maxnreg": gd.FOUR_PER_SM_REGISTERS}
    assert gd.register_cap(10**6, torch.device("cpu")) == {}


@pytest.mark.parametrize("rows,num_splits,shape", [
    (4, 1, None), (4, 2, (4, 2)), (4, 8, (4, 8)), (4, 9, None), (1, 8, (4, 8)), (3, 5, (4, 8)),
    (8, 4, (8, 4)), (8, 5, None), (16, 2, (16, 2)), (16, 3, None),
])
def test_merge_shape_takes_every_split_in_one_load(rows, num_splits, shape):
    assert gd.merge_shape(rows, num_splits) == shape


def test_reasons_name_every_refusal(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 40, 1, 100)
    v = torch.randn(1, 2, 64, 96)
    k = torch.randn(1, 2, 64, 101)[..., :100]  # rows of 101 floats: not 16-byte aligned
    reasons = " | ".join(gd.gluon_decode_reasons(q, k, v, torch.zeros(1, 4, dtype=torch.int32), ["window", "sinks"]))
    for words in ("CUDA", "float32", "D=100, Dv=96", "20 query rows", "paged", "16-byte",
                  "score rules (sinks) run on the Triton decode kernel"):
        assert words in reasons, (words, reasons)
    assert "score rules" not in " | ".join(gd.gluon_decode_reasons(q, k, v, None, ["window"])), "it serves windows"


@pytest.mark.parametrize("interpret,words", [("0", "CUDA"), ("1", "TRITON_INTERPRET")])
def test_good_cpu_inputs_are_refused_only_for_the_device(interpret, words, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q = torch.randn(2, 32, 1, 128).to(torch.bfloat16)
    k = torch.randn(2, 8, 256, 128).to(torch.bfloat16)
    reasons = gd.gluon_decode_reasons(q, k, k, None)
    assert len(reasons) == 1 and words in reasons[0], reasons


@pytest.mark.parametrize("batch,rows,dims,context,marked", [
    (8, 4, (128, 128), 131072, True), (1, 4, (128, 128), GLUON_MIN_KEYS, True), (8, 16, (128, 128), 32768, True),
    (64, 4, (128, 128), GLUON_FULL_MIN_KEYS, True), (64, 8, (128, 128), 131072, True),
    (64, 16, (128, 128), 131072, False),
    (64, 4, (128, 128), GLUON_FULL_MIN_KEYS - 1, False),
    (1, 4, (128, 128), GLUON_MIN_KEYS - 1, False), (8, 4, (128, 128), GLUON_MIN_KEYS - 1, False),
    (8, 32, (128, 128), 32768, False), (64, 32, (128, 128), 131072, False), (8, 4, (64, 64), 32768, False),
    (8, 4, (128, 64), 32768, False), (64, 4, (128, 64), 131072, False),
])
def test_plan_marks_only_the_measured_launches(batch, rows, dims, context, marked):
    """Both kernels take the plan's splits: several for an under-filled launch, 1 for B = 64."""
    config, splits = plan_launch(batch, 8, rows, *dims, context, 132)
    assert config.gluon is marked
    if marked:
        assert (splits > 1) is (batch < 64)


def test_a_window_is_marked_as_a_plain_launch_over_the_same_cache(monkeypatch):
    """A 4k window over a 128k cache is split as the 4097 keys it reads but takes the kernel a plain launch over
    that cache takes; over a cache too short for the Gluon kernel it stays on the Triton one."""
    import importlib

    from exattn.decode import make_decode_problem, triton_plan

    decode_module = importlib.import_module("exattn.decode")  # the attribute exattn.decode is the function

    keys = plan_launch(8, 8, 4, 128, 128, 4097, 132)
    window = plan_launch(8, 8, 4, 128, 128, 4097, 132, capacity=131072)
    assert not keys[0].gluon and window == (keys[0]._replace(gluon=True), keys[1])
    assert window[1] == plan_launch(8, 8, 4, 128, 128, 131072, 132)[1] == 4  # as many splits, of fewer keys
    assert not plan_launch(8, 8, 4, 128, 128, 4097, 132, capacity=GLUON_MIN_KEYS - 1)[0].gluon
    asked = []
    monkeypatch.setattr(decode_module, "plan_launch", lambda *args, **kw: asked.append((args, kw)) or window)
    q = torch.randn(8, 32, 1, 128).to(torch.bfloat16)
    k = torch.empty(8, 8, 131072, 128, dtype=torch.bfloat16)
    triton_plan(make_decode_problem(q, k, k, torch.full((8,), 131072, dtype=torch.int32), None, None, 0, False,
                                    (4096, 0)))
    assert asked[0][0][5] == 4097 and asked[0][1] == {"capacity": 131072}


# With a GPU, conftest leaves TRITON_INTERPRET unset and CPU tensors cannot reach a Triton kernel;
# there the dispatch is tested by test_gpu_decode_takes_the_gluon_path_and_agrees_with_triton.
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors decode through Triton only in the interpreter")
def test_interpreter_decode_of_a_marked_plan_runs_the_triton_kernel(monkeypatch):
    """A launch the plan marks, on inputs Gluon refuses (the interpreter), decodes with the Triton kernel."""
    from exattn.decode import make_decode_problem, triton_plan

    def refuse(*args):
        raise AssertionError("the Gluon path ran")

    monkeypatch.setattr(gd, "gluon_decode_forward", refuse)
    q = torch.randn(1, 4, 1, 128).to(torch.float16)
    k, v = (torch.randn(1, 1, GLUON_MIN_KEYS, 128).to(torch.float16) for _ in range(2))
    lens = torch.tensor([GLUON_MIN_KEYS - 5], dtype=torch.int32)
    config, _ = triton_plan(make_decode_problem(q, k, v, lens, None, None, 2, True))
    assert config.gluon, "the plan no longer marks it"
    out = exattn.decode(q, k, v, cache_seqlens=lens, num_splits=2, backend="triton")
    ref = exattn.decode(q, k, v, cache_seqlens=lens, backend="tiled")
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-3)


# ---------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_case(batch, len_q, capacity, dtype, seed, heads=(32, 8)):
    """`test_decode_gpu.make_case` (NaN past each length) in `dtype`."""
    from test_decode_gpu import make_case

    q, k, v, lens = make_case(batch, *heads, len_q, capacity, 128, seed=seed)
    return q.to(dtype), k.to(dtype), v.to(dtype), lens


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=("bf16", "fp16"))
@pytest.mark.parametrize("len_q", (1, 4))
@pytest.mark.parametrize("num_splits", (1, 4, 7, 300))
@pytest.mark.parametrize("merge_in_split", (False, True), ids=("combine", "merge"))
def test_gpu_matches_the_oracle(dtype, len_q, num_splits, merge_in_split, monkeypatch):
    """Twice in a row where the split kernel merges: the last split to arrive must leave its counter at 0."""
    from test_decode import assert_matches_attention

    q, k, v, lens = gpu_case(3, len_q, 9000, dtype, seed=num_splits + len_q)
    assert not gd.gluon_decode_reasons(q, k, v, None)
    combines = []
    real = decode_kernel.combine_splits
    monkeypatch.setattr(decode_kernel, "combine_splits", lambda *args: combines.append(1) or real(*args))
    launched = min(num_splits, -(-9000 // gd.BLOCK_N))
    merges = merge_in_split and gd.merge_shape(4 * len_q, launched) is not None
    for call in range(1 + merges):
        out, lse = gd.gluon_decode_forward(q, k, v, lens, 128 ** -0.5, num_splits, merge_in_split)
        assert_matches_attention(f"gluon {dtype} Nq={len_q} splits={num_splits} merge={merges} call {call}",
                                 out, lse, q, k, v, lens)
    assert len(combines) == (0 if merges or launched == 1 else 1)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("len_q", (1, 3))
@pytest.mark.parametrize("num_splits", (1, 3, 8))
@pytest.mark.parametrize("window", (0, 100, 4096, 20000))
def test_gpu_window_reads_only_its_blocks_and_matches_the_oracle(window, num_splits, len_q):
    """V holds NaN in every key block before the one where the first token's window starts, so a read of
    any such block gives NaN; lengths end inside a block, on one, below the window and at Nq."""
    from test_decode_rules import assert_rules_match
    from test_decode_gpu import make_case

    q, k, v, lens = make_case(4, 32, 8, len_q, 9000, 128, seed=window + num_splits, lengths=[9000, 4160, 65, len_q])
    clean_v = v.clone()
    for b, length in enumerate(lens.tolist()):
        v[b, :, :max(length - len_q - window, 0) // gd.BLOCK_N * gd.BLOCK_N] = float("nan")
    out, lse = gd.gluon_decode_forward(q, k, v, lens, 128 ** -0.5, num_splits, window_left=window)
    assert not out.isnan().any()
    assert_rules_match(f"gluon window={window} splits={num_splits} Nq={len_q}", out, lse, q, k, clean_v, lens,
                       dict(window=(window, 0)))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", (1, 3))
def test_gpu_cut_last_blocks_over_nan_slots(num_splits):
    """Lengths that end inside a key block (4000, 65, 1), or on one (192): the TMA copy of a cut block
    brings the NaN slots past the length, and the kernel must zero V's rows there."""
    from test_decode import assert_matches_attention
    from test_decode_gpu import make_case

    q, k, v, lens = make_case(4, 32, 8, 1, 4000, 128, seed=5, lengths=[4000, 192, 65, 1])
    out, lse = gd.gluon_decode_forward(q, k, v, lens, 128 ** -0.5, num_splits)
    assert not out.isnan().any()
    assert_matches_attention(f"gluon cut blocks splits={num_splits}", out, lse, q, k, v, lens)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads,len_q", [((8, 8), 3), ((8, 8), 1), ((64, 8), 2), ((16, 1), 1)],
                         ids=("G1", "G1-one-row", "G8", "MQA"))
@pytest.mark.parametrize("merge_in_split", (False, True), ids=("combine", "merge"))
@pytest.mark.parametrize("num_splits", (2, 3))
def test_gpu_other_groups(heads, len_q, merge_in_split, num_splits):
    """16 rows (G8, MQA) merge in the split kernel with 2 splits, the others with both counts."""
    from test_decode import assert_matches_attention

    q, k, v, lens = gpu_case(2, len_q, 5000, torch.bfloat16, seed=len_q, heads=heads)
    out, lse = gd.gluon_decode_forward(q, k, v, lens, 128 ** -0.5, num_splits, merge_in_split)
    assert_matches_attention(f"gluon heads={heads} Nq={len_q} splits={num_splits} merge={merge_in_split}",
                             out, lse, q, k, v, lens)


@pytest.mark.gpu
@needs_cuda
def test_gpu_capped_launch_of_several_new_tokens_matches_the_oracle():
    """400 programs (more than 3 an SM) with Nq = 4: the kernel runs under `register_cap`'s option."""
    from test_decode import assert_matches_attention

    q, k, v, lens = gpu_case(50, 4, 3000, torch.bfloat16, seed=9)
    assert gd.register_cap(50 * 8, q.device), "the launch is not capped"
    out, lse = gd.gluon_decode_forward(q, k, v, lens, 128 ** -0.5, 1)
    assert_matches_attention("gluon capped B=50 Nq=4", out, lse, q, k, v, lens)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch,capacity", [(8, 2 * GLUON_MIN_KEYS), (33, GLUON_FULL_MIN_KEYS + 100),
                                            (50, 3000)], ids=("under-filled", "full", "four-an-sm"))
def test_gpu_decode_takes_the_gluon_path_and_agrees_with_triton(batch, capacity, monkeypatch):
    """B = 33, Hk = 8 is 264 programs: a launch that fills the H200's 132 SMs unsplit; B = 50 is 400,
    more than 3 an SM (`register_cap`)."""
    from exattn.backends.triton.passes import settings
    from exattn.decode import make_decode_problem, triton_plan

    q, k, v, lens = gpu_case(batch, 1, capacity, torch.bfloat16, seed=batch)
    config, planned = triton_plan(make_decode_problem(q, k, v, lens, None, None, 0, True))
    assert config.gluon
    calls = []
    real = gd.gluon_decode_forward
    monkeypatch.setattr(gd, "gluon_decode_forward",
                        lambda *args, **kwargs: calls.append(args[-1]) or real(*args, **kwargs))
    out, lse = exattn.decode(q, k, v, cache_seqlens=lens, return_lse=True)
    assert calls == [planned], "the plan's Gluon launch did not run with its splits"
    monkeypatch.setattr(settings, "use_gluon", False)
    triton_out, triton_lse = exattn.decode(q, k, v, cache_seqlens=lens, return_lse=True)
    assert len(calls) == 1
    torch.testing.assert_close(out, triton_out, rtol=0, atol=1e-2)
    torch.testing.assert_close(lse, triton_lse, rtol=0, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replays_the_gluon_path():
    q, k, v, lens = gpu_case(2, 1, GLUON_MIN_KEYS + 100, torch.bfloat16, seed=3)
    eager = exattn.decode(q, k, v, cache_seqlens=lens, validate=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = exattn.decode(q, k, v, cache_seqlens=lens, validate=False)
    graph.replay()
    torch.testing.assert_close(captured, eager, rtol=0, atol=0)
