"""`torch.compile(fullgraph=True)` over `exattn.decode`: the Triton kernels run as the opaque custom op
`exattn::decode_triton`, the tiled path as `exattn::decode_tiled`. CPU: the aot_eager backend, kernels in
the interpreter. GPU (-m gpu): inductor, and mode="reduce-overhead" (CUDA graphs)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads

import exattn
from exattn import errors
from exattn.backends.triton import decode_kernel, replay
from exattn.decode import DECODE_OPS, decode_op_args, make_decode_problem
from test_compile import exattn_ops, recording
from test_decode import DEVICE, assert_matches_attention, make_case, paged


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    for state in errors._RECORDS.values():
        state.record.zero_()
        state.rung.value = 0


def step(q, k, v, lens, table, sinks, slopes, backend="triton"):
    """One decode step with every rule, as a model would write it."""
    return exattn.decode(q, k, v, cache_seqlens=lens, block_table=table, backend=backend, return_lse=True,
                         window=(21, 0), softcap=6.0, sinks=sinks, alibi_slopes=slopes, num_splits=3)


def tiled_step(*inputs):
    return step(*inputs, backend="tiled")


def plain_step(q, k, v, lens, backend="triton"):
    return exattn.decode(q, k, v, cache_seqlens=lens, backend=backend, return_lse=True)


def case(layout: str):
    q, k, v, lens = make_case(2, 4, 2, 2, 60, 24, torch.float32, seed=4, lengths=[60, 29])
    table = None
    if layout == "paged":
        k, v, table = paged(k, v, lens, 16)
    g = torch.Generator().manual_seed(1)
    sinks, slopes = torch.randn(4, generator=g).to(DEVICE), (torch.rand(4, generator=g) * 0.2).to(DEVICE)
    return q, k, v, lens, table, sinks, slopes


def count_kernel_runs(monkeypatch) -> list:
    runs = []
    real = decode_kernel.decode_forward
    monkeypatch.setattr(decode_kernel, "decode_forward",
                        lambda *args, **kwargs: runs.append(1) or real(*args, **kwargs))
    return runs


on_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the interpreter; -m gpu covers CUDA")


@on_cpu
@pytest.mark.parametrize("dynamic", (False, True), ids=("static", "dynamic"))
@pytest.mark.parametrize("layout", ("contiguous", "paged"))
def test_fullgraph_aot_eager_runs_the_kernels_and_matches_eager(layout, dynamic, monkeypatch):
    inputs = case(layout)
    runs = count_kernel_runs(monkeypatch)
    record, graphs = recording()
    compiled_out, compiled_lse = torch.compile(step, fullgraph=True, backend=record, dynamic=dynamic)(*inputs)
    assert len(graphs) == 1 and exattn_ops(graphs) == ["exattn.decode_triton.default"]
    assert len(runs) == 1, "the compiled call did not run the Triton decode kernels"
    out, lse = step(*inputs)
    assert len(runs) == 2
    assert torch.equal(compiled_out, out) and torch.equal(compiled_lse, lse)
    if layout == "contiguous":
        plain_out, plain_lse = torch.compile(plain_step, fullgraph=True, backend="aot_eager")(*inputs[:4])
        assert_matches_attention("compiled", plain_out, plain_lse, *inputs[:4])


@on_cpu
def test_compiled_validated_calls_record_bad_lengths():
    q, k, v, lens, *_ = case("contiguous")
    compiled = torch.compile(plain_step, fullgraph=True, backend="aot_eager")
    compiled(q, k, v, lens)
    exattn.check_errors()
    compiled(q, k, v, torch.tensor([60, 61], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 61 is beyond the cache"):
        exattn.check_errors()


@pytest.mark.parametrize("dynamic", (False, True), ids=("static", "dynamic"))
@pytest.mark.parametrize("layout", ("contiguous", "paged"))
def test_fullgraph_tiled_path_runs_its_op_and_matches_eager(layout, dynamic):
    inputs = case(layout)
    record, graphs = recording()
    compiled_out, compiled_lse = torch.compile(tiled_step, fullgraph=True, backend=record, dynamic=dynamic)(*inputs)
    assert exattn_ops(graphs) == ["exattn.decode_tiled.default"]
    out, lse = tiled_step(*inputs)
    assert torch.equal(compiled_out, out) and torch.equal(compiled_lse, lse)


def test_compiled_tiled_calls_check_the_lengths():
    q, k, v, lens, *_ = case("contiguous")
    compiled = torch.compile(lambda *args: plain_step(*args, backend="tiled"), fullgraph=True, backend="aot_eager")
    compiled(q, k, v, lens)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 61 is beyond the cache"):
        compiled(q, k, v, torch.tensor([60, 61], dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("backend", sorted(DECODE_OPS))
def test_the_custom_ops_pass_opcheck(backend):
    q, k, v, lens, table, sinks, slopes = case("paged")
    leftpad = torch.tensor([5, 0], dtype=torch.int32, device=DEVICE)
    problem = make_decode_problem(q, k, v, lens, table, None, 2, True, window=(9, 0), softcap=3.0,
                                  alibi_slopes=slopes, sinks=sinks, cache_leftpad=leftpad)
    torch.library.opcheck(DECODE_OPS[backend], decode_op_args(problem),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


# ---------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_case(layout: str):
    """bf16, B = 4, Hq = 32, Hk = 8, D = 128, a 3000-key cache (NaN past the first lengths)."""
    from test_decode_gpu import make_case as make_gpu_case

    q, k, v, lens = make_gpu_case(4, 32, 8, 1, 3000, 128, seed=7, lengths=[3000] * 4)
    table = None
    if layout == "paged":
        k, v, table = paged(k, v, lens, 64)
    return q, k, v, lens, table


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", (None, "reduce-overhead"), ids=("inductor", "reduce-overhead"))
@pytest.mark.parametrize("validate", (False, True))
@pytest.mark.parametrize("layout", ("contiguous", "paged"))
@pytest.mark.parametrize("rules", (False, True), ids=("plain", "rules"))
def test_gpu_compiled_decode_runs_the_kernels_and_follows_the_lengths(mode, validate, layout, rules, monkeypatch):
    """Default inductor and mode="reduce-overhead" (warm-up, recording, then CUDA-graph replays): each
    call reads the lengths it is given, and matches the eager call bitwise. validate=True records
    through replays too (`check_errors` raises after them). The error record (and the replay plans that
    hold it) are made afresh, so that the compiled call's warm-up makes it, outside the graph's pool."""
    errors._RECORDS.clear()
    replay.clear()
    q, k, v, lens, table = gpu_case(layout)
    kwargs = dict(window=(700, 0), softcap=30.0, sinks=torch.randn(32, device="cuda"),
                  alibi_slopes=torch.rand(32, device="cuda") * 0.05) if rules else {}

    def fn(q, k, v, lens, table):
        return exattn.decode(q, k, v, cache_seqlens=lens, block_table=table, return_lse=True, validate=validate,
                             **kwargs)

    runs = count_kernel_runs(monkeypatch)
    compiled = torch.compile(fn, fullgraph=True, mode=mode)
    for lengths in ([3000, 1200, 1, 2999], [17, 3000, 2500, 64], [3000, 1, 1, 1], [5, 6, 7, 8], [2048] * 4):
        lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        out, lse = compiled(q, k, v, lens, table)
        eager_out, eager_lse = fn(q, k, v, lens, table)
        torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, eager_lse, rtol=0, atol=0)
    assert runs, "the Triton decode kernel never ran"
    exattn.check_errors()
    if validate:
        beyond = (k.shape[2] if table is None else table.shape[1] * k.shape[2]) + 1  # paged: whole pages
        lens.copy_(torch.tensor([3000, beyond, 1, 1], dtype=torch.int32))
        compiled(q, k, v, lens, table)
        with pytest.raises(ValueError, match=rf"cache_seqlens\[1\] = {beyond} is beyond the cache"):
            exattn.check_errors()


@pytest.mark.gpu
@needs_cuda
def test_gpu_compiled_decode_matches_the_oracle():
    q, k, v, lens, _ = gpu_case("contiguous")
    lens.copy_(torch.tensor([3000, 1200, 1, 2999], dtype=torch.int32))
    out, lse = torch.compile(plain_step, fullgraph=True)(q, k, v, lens)
    from test_decode_gpu import assert_matches_attention as assert_bf16_matches

    assert_bf16_matches("compiled", out, lse, q, k, v, lens)
