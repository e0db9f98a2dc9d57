"""`torch.compile(fullgraph=True)` over `exattn.attention` and `exattn.attention_varlen` on the tiled path
(custom ops from exattn.backends.custom_ops), and the helpers the other compile tests share.

Compiling on the CPU is slow: one small shape per compiled function.
"""

import pytest
import torch
from error_rule import assert_matches_oracle
from torch._dynamo.backends.registry import lookup_backend

import exattn
from exattn.backends.custom_ops import params_from_args, params_to_args
from exattn.problem import AttentionParams, ScoreRules, make_problem
from exattn.reference import attention_ref
from exattn.varlen import make_varlen_problem


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 11, 24, generator=g)
    k = torch.randn(2, 2, 19, 24, generator=g)
    v = torch.randn(2, 2, 19, 8, generator=g)
    mask = torch.rand(2, 1, 11, 19, generator=g) > 0.3
    mask[:, :, 4] = False  # a row with nothing to attend
    return q, k, v, mask


def packed_inputs(lengths=(5, 0, 9, 3), hq=4, hk=2, d=16, dv=8, dtype=torch.float32, seed=0):
    """q (total, hq, d), k (total, hk, d), v (total, hk, dv), int32 offsets and the longest length."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, dim, generator=g).to(dtype) for h, dim in ((hq, d), (hk, d), (hk, dv)))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, max(lengths)


def grads(fn, q, k, v, mask, dout):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out, lse = fn(q, k, v, mask)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def outputs_and_grads(fn, leaves, others=()):
    """(out, lse, *grads): fn(*leaves, *others) on fresh leaf copies, out backpropagated with a fixed
    random dout; the grads of the leaves in order."""
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    out, lse = fn(*leaves, *others)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout))


def assert_same(names, ours, theirs):
    for name, a, b in zip(names, ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def recording(backend="aot_eager"):
    """(a dynamo backend that records each graph before handing it to `backend`, the graphs)."""
    graphs, inner = [], lookup_backend(backend)

    def record(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    return record, graphs


def exattn_ops(graphs) -> list[str]:
    """The exattn custom ops called in the graphs, in order ("exattn.tiled_forward.default", ...)."""
    return [str(node.target) for gm in graphs for node in gm.graph.nodes if str(node.target).startswith("exattn.")]


def attend(q, k, v, mask):
    return exattn.attention(q, k, v, mask=mask, causal=True, window=(9, -1), dropout_p=0.2, seed=11,
                            scale=0.3, backend="tiled", block_m=4, block_n=8, return_lse=True)


def test_fullgraph_compile_forward_and_backward_match_eager():
    q, k, v, mask = inputs()
    dout = torch.randn(2, 4, 11, 8)
    compiled = torch.compile(attend, fullgraph=True)
    ours = grads(compiled, q, k, v, mask, dout)
    eager = grads(attend, q, k, v, mask, dout)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ours, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    assert not ours[1].requires_grad, "lse carries no gradient"

    keep = exattn.dropout_mask(11, (2, 4, 11, 19), 0.2)

    def oracle(q, k, v, mask):
        return attention_ref(q, k, v, mask=mask, causal=True, window=(9, -1), scale=0.3,
                             dropout_mask=keep, dropout_p=0.2, return_lse=True)

    def naive(q, k, v, mask):
        return exattn.attention(q, k, v, mask=mask, causal=True, window=(9, -1), dropout_p=0.2, seed=11,
                                scale=0.3, backend="naive", return_lse=True)

    ref, base = grads(oracle, q, k, v, mask, dout.double()), grads(naive, q, k, v, mask, dout)
    for name, a, b, r in zip(("out", "lse", "dq", "dk", "dv"), ours, base, ref):
        assert_matches_oracle(name, a, b, r, torch.float32)


def test_score_rules_and_the_sinks_gradient_compile_to_the_tiled_ops():
    q, k, v, _ = inputs(3)
    sinks = torch.randn(4)
    slopes = torch.rand(4)
    ids = torch.tensor([[0] * 6 + [1] * 13, [0] * 19], dtype=torch.int32)

    def fn(q, k, v, sinks):
        return exattn.attention(q, k, v, causal=True, sinks=sinks, alibi_slopes=slopes, softcap=4.0, prefix=3,
                                segment_ids=(ids[:, :11], ids), backend="tiled", return_lse=True)

    record, graphs = recording()
    ours = outputs_and_grads(torch.compile(fn, backend=record, fullgraph=True), (q, k, v, sinks))
    assert_same(("out", "lse", "dq", "dk", "dv", "dsinks"), ours, outputs_and_grads(fn, (q, k, v, sinks)))
    assert exattn_ops(graphs) == ["exattn.tiled_forward.default"]


def test_dynamic_shapes_take_rule_tensors_made_in_the_compiled_code():
    """Rule tensors made while tracing have literal sizes, the head count a symbolic one: their shape
    check compares the sizes one by one (a tuple of sizes in a list of tuples does not trace)."""
    q, k, v, _ = inputs(3)

    def fn(q, k, v, sinks):
        return exattn.attention(q, k, v, causal=True, softcap=4.0, alibi_slopes=torch.full((2, 4), 0.25),
                                sinks=sinks, backend="tiled", return_lse=True)

    leaves = (q, k, v, torch.randn(4))
    record, graphs = recording()
    ours = outputs_and_grads(torch.compile(fn, backend=record, fullgraph=True, dynamic=True), leaves)
    assert_same(("out", "lse", "dq", "dk", "dv", "dsinks"), ours, outputs_and_grads(fn, leaves))
    assert exattn_ops(graphs) == ["exattn.tiled_forward.default"]


def test_sdpa_traces_into_one_graph_around_the_custom_op():
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    q, k, v, _ = inputs(1)
    fn = torch.compile(lambda q, k, v: exattn.sdpa(q, k, v, is_causal=True, enable_gqa=True),
                       fullgraph=True, backend=record)
    torch.testing.assert_close(fn(q, k, v), exattn.sdpa(q, k, v, is_causal=True, enable_gqa=True),
                               rtol=1e-6, atol=1e-6)
    targets = [node.target for node in graphs[0].graph.nodes]
    assert len(graphs) == 1 and torch.ops.exattn.tiled_forward.default in targets


@pytest.mark.parametrize("with_rules", [False, True])
def test_custom_ops_pass_opcheck(with_rules):
    q, k, v, mask = inputs(2)
    rules = {"sinks": torch.randn(4, requires_grad=True), "alibi_slopes": torch.rand(4), "prefix": 2} if with_rules else {}
    problem = make_problem(q, k, v, mask=mask, causal=True, dropout_p=0.1, seed=5, block_m=4, block_n=8,
                           softcap=3.0 if with_rules else 0.0, **rules)
    params = params_to_args(problem.params)
    args = (*params, *problem.rules) if with_rules else params[:-1]  # softcap and the rules: their defaults
    q, k, v = (x.requires_grad_(True) for x in (problem.q, problem.k, problem.v))
    torch.library.opcheck(torch.ops.exattn.tiled_forward, (q, k, v, problem.mask, *args))
    out, lse = torch.ops.exattn.tiled_forward(q, k, v, problem.mask, *args)
    q, k, v, out, lse, *args = detached((q, k, v, out, lse, *args))
    torch.library.opcheck(torch.ops.exattn.tiled_backward, (torch.randn_like(out), q, k, v, problem.mask, out, lse, *args))


def detached(values) -> list:
    """The values with every tensor detached (the backward op takes no tensor that requires grad)."""
    return [x.detach() if isinstance(x, torch.Tensor) else x for x in values]


def varlen_problem(backend, dtype=torch.float32, block_m=None, block_n=None):
    """(fn(q, k, v, sinks) -> (out, lse) over a causal GQA packing with sinks, ALiBi and a prefix,
    the packed q, k, v, sinks)."""
    q, k, v, cu, longest = packed_inputs(dtype=dtype)
    slopes = torch.rand(4, 4, generator=torch.Generator().manual_seed(1))

    def fn(q, k, v, sinks):
        return exattn.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True, sinks=sinks,
                                       alibi_slopes=slopes, prefix=2, backend=backend, validate=False,
                                       block_m=block_m, block_n=block_n, return_lse=True)

    return fn, (q, k, v, torch.randn(4, generator=torch.Generator().manual_seed(2)))


def test_varlen_compiles_to_the_tiled_varlen_ops():
    fn, leaves = varlen_problem("tiled")
    record, graphs = recording()
    ours = outputs_and_grads(torch.compile(fn, backend=record, fullgraph=True), leaves)
    assert_same(("out", "lse", "dq", "dk", "dv", "dsinks"), ours, outputs_and_grads(fn, leaves))
    assert exattn_ops(graphs) == ["exattn.tiled_varlen_forward.default"]


def varlen_op_args(problem) -> tuple:
    return (problem.cu_seqlens_q, problem.cu_seqlens_k, problem.max_seqlen_q, problem.max_seqlen_k,
            *params_to_args(problem.params), *(problem.rules or ScoreRules()))


def opcheck_varlen_ops(name, device="cpu", dtype=torch.float32, block=None):
    """opcheck on exattn::<name>_forward and exattn::<name>_backward over a causal packing with sinks."""
    q, k, v, cu, longest = (x.to(device) if isinstance(x, torch.Tensor) else x for x in packed_inputs(dtype=dtype))
    sinks = torch.randn(4, device=device, requires_grad=True)
    problem = make_varlen_problem(q, k, v, cu, cu, longest, longest, causal=True, sinks=sinks, block_m=block,
                                  block_n=block)
    args = varlen_op_args(problem)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    forward, backward = getattr(torch.ops.exattn, f"{name}_forward"), getattr(torch.ops.exattn, f"{name}_backward")
    torch.library.opcheck(forward, (q, k, v, *args))
    out, lse = forward(q, k, v, *args)
    q, k, v, out, lse, *args = detached((q, k, v, out, lse, *args))
    torch.library.opcheck(backward, (torch.randn_like(out), q, k, v, *args[:4], out, lse, *args[4:]))


def test_varlen_custom_ops_pass_opcheck():
    opcheck_varlen_ops("tiled_varlen")


def test_varlen_under_compile_asks_for_validate_false():
    q, k, v, cu, longest = packed_inputs()
    fn = torch.compile(lambda q, k, v: exattn.attention_varlen(q, k, v, cu, cu, longest, longest, backend="tiled"),
                       backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="pass validate=False"):
        fn(q, k, v)


def test_the_ops_take_no_dropout_grid():
    params = AttentionParams(scale=0.5, dropout_p=0.1, seed=3, dropout_grid=(1, 8, 8))
    with pytest.raises(ValueError, match="dropout_grid"):
        params_to_args(params)


def test_op_arguments_give_back_the_params_they_came_from():
    """The ops rebuild params from their arguments (kept per argument set): each comes back equal, the
    arguments' types included (an int dropout_p stays an int, 0.0 stays a float)."""
    for params in (AttentionParams(scale=0.5, window=(7, 0), dropout_p=0), AttentionParams(scale=0.5, window=(7, 0)),
                   AttentionParams(scale=0.5, window=(-1, 0), dropout_p=0.1, seed=2, block_m=16, softcap=3.0)):
        rebuilt = params_from_args(*params_to_args(params))
        assert rebuilt == params and type(rebuilt.dropout_p) is type(params.dropout_p)
