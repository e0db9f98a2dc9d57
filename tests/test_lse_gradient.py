"""lse is returned without a gradient: the backward makes no zero tensor for it (the autograd engine would
allocate and fill one of lse's size every backward), and a backward that reaches no output's gradient
passes none on."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import exattn


class ZerosMade(TorchDispatchMode):
    """The shapes of the zero-filled tensors made while active."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default, torch.ops.aten.new_zeros.default):
            self.shapes.append(tuple(result.shape))
        return result


def dense(q, k, v):
    return exattn.attention(q, k, v, causal=True, backend="tiled", return_lse=True)


def packed(q, k, v):
    cu = torch.tensor([0, 13, 33], dtype=torch.int32)
    return exattn.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 20, 20,
                                   causal=True, backend="tiled", return_lse=True)


@pytest.mark.parametrize("call", [dense, packed])
def test_the_backward_makes_no_zeros_for_lse(call):
    q, k, v = (torch.randn(1, 4, 33, 16, requires_grad=True) for _ in range(3))
    out, lse = call(q, k, v)
    zeros = ZerosMade()
    with zeros:
        out.backward(torch.randn_like(out))
    assert lse.requires_grad is False and tuple(lse.shape) not in zeros.shapes, zeros.shapes
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (q, k, v))


@pytest.mark.parametrize("call", [dense, packed])
def test_a_backward_without_an_output_gradient_passes_none_on(call):
    q, k, v = (torch.randn(1, 4, 33, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: call(q, k, v)[0], (q, k, v), check_undefined_grad=True)
