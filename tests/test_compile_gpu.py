"""`torch.compile` over exattn on a CUDA GPU (`pytest -m gpu`): inductor, and CUDA graphs
(mode="reduce-overhead"), run the Triton / Gluon kernels through the custom ops, forward and
backward, with no graph break, matching eager (bf16).

Compiled and eager attention call the same passes on the same tensors: out, lse, dq, dk, dv
must agree bitwise; the sinks' gradient (fused by inductor) and a module's parameter gradients
(projections compiled by inductor) within bf16 tolerance.

Its speed against eager is measured by `benchmarks/compiled.py`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_compile import assert_same, exattn_ops, outputs_and_grads, recording
from torch._dynamo.utils import counters

import exattn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
DTYPE = torch.bfloat16
EXACT = ("out", "lse", "dq", "dk", "dv")


def dense_inputs(batch, heads_q, heads_k, seq_len, head_dim, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, heads_q, seq_len, head_dim, device=DEVICE, generator=g, dtype=DTYPE)
    k, v = (torch.randn(batch, heads_k, seq_len, head_dim, device=DEVICE, generator=g, dtype=DTYPE) for _ in range(2))
    return q, k, v, torch.randn(heads_q, device=DEVICE, generator=g)


def causal(q, k, v):
    return exattn.attention(q, k, v, causal=True, return_lse=True)


def causal_sinks_softcap(q, k, v, sinks):
    return exattn.attention(q, k, v, causal=True, sinks=sinks, softcap=30.0, return_lse=True)


def packed_inputs(lengths=(1000, 17, 512, 0, 300), heads_q=8, heads_k=2, head_dim=128, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads_q, head_dim, device=DEVICE, generator=g, dtype=DTYPE)
    k, v = (torch.randn(total, heads_k, head_dim, device=DEVICE, generator=g, dtype=DTYPE) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return (q, k, v, torch.randn(heads_q, device=DEVICE, generator=g)), cu, max(lengths)


def varlen_fn(cu, longest):
    def fn(q, k, v, sinks):
        return exattn.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True, sinks=sinks,
                                       validate=False, return_lse=True)
    return fn


def assert_matches_eager(ours, eager):
    """out, lse, dq, dk, dv bitwise; the sinks' gradient, if any, within float32 tolerance."""
    assert_same(EXACT, ours[:5], eager[:5])
    if len(ours) > 5:
        torch.testing.assert_close(ours[5], eager[5], rtol=1e-4, atol=1e-4, msg="dsinks")


@pytest.mark.parametrize("fn", [causal, causal_sinks_softcap])
@pytest.mark.parametrize("head_dim, seq_len", [(128, 1024), (64, 300)])
def test_inductor_fullgraph_matches_eager(fn, head_dim, seq_len):
    q, k, v, sinks = dense_inputs(2, 8, 2, seq_len, head_dim)
    leaves = (q, k, v) if fn is causal else (q, k, v, sinks)
    record, graphs = recording("inductor")
    ours = outputs_and_grads(torch.compile(fn, backend=record, fullgraph=True), leaves)
    assert exattn_ops(graphs) == ["exattn.triton_forward.default"]
    assert_matches_eager(ours, outputs_and_grads(fn, leaves))


def test_varlen_inductor_fullgraph_matches_eager():
    leaves, cu, longest = packed_inputs()
    fn = varlen_fn(cu, longest)
    record, graphs = recording("inductor")
    ours = outputs_and_grads(torch.compile(fn, backend=record, fullgraph=True), leaves)
    assert exattn_ops(graphs) == ["exattn.triton_varlen_forward.default"]
    assert_matches_eager(ours, outputs_and_grads(fn, leaves))


class SelfAttention(torch.nn.Module):
    """qkv projection, `exattn.attention` (GQA, causal, learned sinks), output projection."""

    def __init__(self, dim=512, heads_q=8, heads_k=2, head_dim=64):
        super().__init__()
        self.heads, self.head_dim = (heads_q, heads_k), head_dim
        linear = {"bias": False, "device": DEVICE, "dtype": DTYPE}
        self.qkv = torch.nn.Linear(dim, (heads_q + 2 * heads_k) * head_dim, **linear)
        self.out = torch.nn.Linear(heads_q * head_dim, dim, **linear)
        self.sinks = torch.nn.Parameter(torch.zeros(heads_q, device=DEVICE))  # float32, as sinks must be

    def forward(self, x):
        batch, seq_len, _ = x.shape
        heads_q, heads_k = self.heads
        q, k, v = self.qkv(x).view(batch, seq_len, heads_q + 2 * heads_k, self.head_dim).transpose(1, 2).split(
            [heads_q, heads_k, heads_k], dim=1)
        out = exattn.attention(q, k, v, causal=True, sinks=self.sinks)
        return self.out(out.transpose(1, 2).reshape(batch, seq_len, heads_q * self.head_dim))


def tokens(seed, seq_len=777, dim=512):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(2, seq_len, dim, device=DEVICE, dtype=DTYPE, generator=g)


def test_module_has_no_graph_break():
    explanation = torch._dynamo.explain(SelfAttention())(tokens(0))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    assert exattn_ops(explanation.graphs) == ["exattn.triton_forward.default"]


def test_varlen_has_no_graph_break():
    leaves, cu, longest = packed_inputs()
    explanation = torch._dynamo.explain(varlen_fn(cu, longest))(*leaves)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


def training_step(model, x):
    """(out, grads of x and of every parameter) of one forward and backward."""
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    out.float().square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.detach().clone(), grads


def assert_close_to_scale(name, ours, eager, tolerance=1e-2):
    """max |ours - eager| within `tolerance` of max |eager| (bf16 projections may round differently)."""
    error, scale = (ours - eager).abs().max().item(), eager.abs().max().item()
    assert error <= tolerance * scale, f"{name}: max error {error:.3e} > {tolerance} * {scale:.3e}"


def test_reduce_overhead_steps_match_eager():
    torch._dynamo.reset()
    counters.clear()
    model = SelfAttention()
    eager_model = copy.deepcopy(model)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for step in range(4):  # warm-up, recording, then replays of the CUDA graphs
        x = tokens(step)
        torch.compiler.cudagraph_mark_step_begin()
        out, grads = training_step(compiled, x)
        eager_out, eager_grads = training_step(eager_model, x)
        assert_close_to_scale(f"step {step}: out", out, eager_out)
        for i, (a, b) in enumerate(zip(grads, eager_grads, strict=True)):
            assert_close_to_scale(f"step {step}: grad {i}", a, b)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_varlen_reduce_overhead_steps_match_eager():
    torch._dynamo.reset()
    counters.clear()
    _, cu, longest = packed_inputs()
    fn = varlen_fn(cu, longest)
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    for step in range(4):  # warm-up, recording, then replays of the CUDA graphs
        leaves = packed_inputs(seed=step)[0]
        torch.compiler.cudagraph_mark_step_begin()
        ours = [x.clone() for x in outputs_and_grads(compiled, leaves)]
        assert_matches_eager(ours, outputs_and_grads(fn, leaves))
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
