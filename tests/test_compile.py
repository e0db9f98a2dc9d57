"""`torch.compile(fullgraph=True)` over `exattn.attention` on the tiled path (custom ops in exattn.backends.tiled_ops).

Compiling on the CPU is slow: one small shape per compiled function.
"""

import torch

import exattn
from exattn.backends.tiled_ops import params_to_args
from exattn.problem import make_problem
from exattn.reference import attention_ref
from error_rule import assert_matches_oracle


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 11, 24, generator=g)
    k = torch.randn(2, 2, 19, 24, generator=g)
    v = torch.randn(2, 2, 19, 8, generator=g)
    mask = torch.rand(2, 1, 11, 19, generator=g) > 0.3
    mask[:, :, 4] = False  # a row with nothing to attend
    return q, k, v, mask


def grads(fn, q, k, v, mask, dout):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out, lse = fn(q, k, v, mask)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


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


def test_custom_ops_pass_opcheck():
    q, k, v, mask = inputs(2)
    problem = make_problem(q, k, v, mask=mask, causal=True, dropout_p=0.1, seed=5, block_m=4, block_n=8)
    args = params_to_args(problem.params)
    q, k, v = (x.requires_grad_(True) for x in (problem.q, problem.k, problem.v))
    torch.library.opcheck(torch.ops.exattn.tiled_forward, (q, k, v, problem.mask, *args))
    out, lse = torch.ops.exattn.tiled_forward(q, k, v, problem.mask, *args)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.exattn.tiled_backward,
                          (dout, q.detach(), k.detach(), v.detach(), problem.mask, out.detach(), lse.detach(), *args))
