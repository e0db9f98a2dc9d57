"""`torch.compile(fullgraph=True)` over the Triton backend (custom ops exattn::triton_* and
exattn::triton_varlen_*), on the CPU through Triton's interpreter, with the aot_eager backend.

Compiled and eager runs call the same Triton passes on the same inputs, so they must agree
bitwise; a spy on the passes' launches shows the kernels ran (not the tiled path).
"""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
# CPU tensors through the interpreter, which conftest turns on wherever there is no GPU (CI included).
# On a GPU machine tests/test_compile_gpu.py compiles the same custom ops over the compiled kernels,
# so this module is skipped there, by design.
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)", allow_module_level=True)

from test_compile import (
    assert_same,
    detached,
    exattn_ops,
    opcheck_varlen_ops,
    outputs_and_grads,
    recording,
    varlen_problem,
)

import exattn
from exattn.backends.custom_ops import params_to_args
from exattn.backends.triton import passes
from exattn.problem import make_problem

GRAD_NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


@pytest.fixture
def launches(monkeypatch):
    """{"forward": [packing, ...], "backward": [...]}: every launch of the Triton passes, with its packing
    (None for dense problems)."""
    seen = {"forward": [], "backward": []}

    def spy(kind, launch):
        def recorded(*args, **kwargs):
            seen[kind].append(inspect.signature(launch).bind(*args, **kwargs).arguments.get("packing"))
            return launch(*args, **kwargs)
        return recorded

    monkeypatch.setattr(passes, "launch_forward", spy("forward", passes.launch_forward))
    monkeypatch.setattr(passes, "launch_backward", spy("backward", passes.launch_backward))
    return seen


def dense_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 21, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 33, 16, generator=g).to(dtype) for _ in range(2))
    return q, k, v, torch.randn(4, generator=g)


def causal_sinks_softcap(q, k, v, sinks):
    return exattn.attention(q, k, v, causal=True, sinks=sinks, softcap=6.0, backend="triton", return_lse=True)


def window_mask_dropout_rules(q, k, v, sinks):
    ids = torch.tensor([[0] * 9 + [1] * 24, [0] * 33], dtype=torch.int32)
    mask = torch.arange(33) % 5 != 2
    return exattn.attention(q, k, v, window=(12, 3), mask=mask, dropout_p=0.25, seed=99, sinks=sinks,
                            alibi_slopes=torch.linspace(0.1, 0.4, 4), prefix=torch.tensor([4, 0], dtype=torch.int32),
                            segment_ids=(ids[:, :21], ids), backend="triton", return_lse=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fn", [causal_sinks_softcap, window_mask_dropout_rules])
def test_dense_compiles_to_the_triton_ops(fn, dtype, launches):
    leaves = dense_inputs(dtype)
    record, graphs = recording()
    ours = outputs_and_grads(torch.compile(fn, backend=record, fullgraph=True), leaves)
    assert exattn_ops(graphs) == ["exattn.triton_forward.default"]
    assert launches == {"forward": [None], "backward": [None]}
    eager = outputs_and_grads(fn, leaves)
    assert_same(GRAD_NAMES, ours, eager)


def test_varlen_compiles_to_the_triton_varlen_ops(launches):
    fn, leaves = varlen_problem("triton", block_m=16, block_n=16)
    record, graphs = recording()
    ours = outputs_and_grads(torch.compile(fn, backend=record, fullgraph=True), leaves)
    assert exattn_ops(graphs) == ["exattn.triton_varlen_forward.default"]
    assert [p is not None for p in launches["forward"] + launches["backward"]] == [True, True]
    assert_same(GRAD_NAMES, ours, outputs_and_grads(fn, leaves))


@pytest.mark.parametrize("problem", ["dense", "varlen"])
def test_dynamic_shapes_reach_the_ops_and_dynamo_traces_no_cache(problem, monkeypatch):
    """The support checks run at trace time, untraced (Dynamo warns about a cache wrapper it traces), and
    their head dims stay out of them, so symbolic sizes (dynamic=True) compile to the same ops."""
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set(), raising=False)
    if problem == "dense":
        fn, leaves, op = causal_sinks_softcap, dense_inputs(torch.float32), "exattn.triton_forward.default"
    else:
        (fn, leaves), op = varlen_problem("triton", block_m=16, block_n=16), "exattn.triton_varlen_forward.default"
    record, graphs = recording()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = outputs_and_grads(torch.compile(fn, backend=record, fullgraph=True, dynamic=True), leaves)
    assert [str(w.message) for w in caught if "Dynamo" in str(w.message)] == []
    assert exattn_ops(graphs) == [op]
    assert_same(GRAD_NAMES, ours, outputs_and_grads(fn, leaves))


def test_eager_calls_keep_the_autograd_functions():
    q, k, v, sinks = (x.requires_grad_(True) for x in dense_inputs(torch.float32))
    out, _ = causal_sinks_softcap(q, k, v, sinks)
    assert out.grad_fn.name() == "RecomputingAttentionBackward"
    fn, leaves = varlen_problem("triton", block_m=16, block_n=16)
    out, _ = fn(*(x.requires_grad_(True) for x in leaves))
    assert out.grad_fn.name() == "VarlenAttentionBackward"


def test_triton_ops_pass_opcheck():
    q, k, v, sinks = dense_inputs(torch.float32, seed=1)
    problem = make_problem(q, k, v, causal=True, sinks=sinks.requires_grad_(True), softcap=5.0, block_m=16,
                           block_n=16)
    args = (problem.mask, *params_to_args(problem.params), *problem.rules)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    torch.library.opcheck(torch.ops.exattn.triton_forward, (q, k, v, *args))
    out, lse = torch.ops.exattn.triton_forward(q, k, v, *args)
    q, k, v, out, lse, mask, *rest = detached((q, k, v, out, lse, *args))
    torch.library.opcheck(torch.ops.exattn.triton_backward, (torch.randn_like(out), q, k, v, mask, out, lse, *rest))


def test_triton_varlen_ops_pass_opcheck():
    opcheck_varlen_ops("triton_varlen", block=16)
