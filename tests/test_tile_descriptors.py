"""How the Triton kernels read their tiles: host descriptors (USE_TMA = 2), descriptors built in the
kernel (1) and pointers (0) give the same bits, and each layout gets the mode it should."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
# These run the kernels on CPU tensors through the interpreter, which conftest turns on wherever there is
# no GPU (CI included). On a GPU machine the compiled kernels take the same modes in tests/test_varlen.py's
# and tests/test_triton_gpu.py's GPU tests (packed layouts and d = 64 through host descriptors), so this
# module is skipped there, as tests/test_triton_backend.py is.
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)", allow_module_level=True)

import exattn  # noqa: E402
from exattn.backends.triton import passes  # noqa: E402


@pytest.mark.parametrize(("strides", "heads", "dim", "block", "fits"), [
    ((4 * 40 * 64, 40 * 64, 64, 1), 4, 64, 64, True),      # contiguous (B, H, N, D): heads whole rows
    ((40 * 4 * 64, 64, 4 * 64, 1), 4, 64, 64, True),        # token-major (B, N, H, D) seen as (B, H, N, D)
    ((0, 64, 3 * 4 * 64, 1), 4, 64, 64, True),              # packed qkv[:, i]: heads inside a 3-head-wide row
    ((4 * 40 * 48, 40 * 48, 48, 1), 4, 48, 64, False),      # padded head dim: a box would read past the head
    ((40 * 4 * 64, 100, 4 * 64, 1), 4, 64, 64, False),      # the last head's columns leave the row
    ((4 * 40 * 64 + 8, 40 * 64, 64, 1), 4, 64, 64, False),  # batch stride not whole rows
    ((4 * 40 * 64, 40 * 64, 64, 2), 4, 64, 64, False),      # columns not unit-strided
    ((40 * 32, 40 * 32, 32, 1), 1, 64, 64, False),          # rows narrower than a head (overlapping)
])
def test_which_layouts_one_host_descriptor_serves(strides, heads, dim, block, fits):
    x = torch.empty(8)  # only the strides are read, and the last element's offset: 0 here
    assert passes.host_descriptor_fits(x, strides, heads, dim, block) is fits


def modes_used(monkeypatch) -> list[int]:
    used = []
    original = passes.tma_mode

    def spy(*args):
        used.append(original(*args))
        return used[-1]

    monkeypatch.setattr(passes, "tma_mode", spy)
    return used


def forward_and_grads(run, inputs, dout):
    inputs = [x.detach().requires_grad_() for x in inputs]
    out = run(*inputs)
    return (out, *torch.autograd.grad(out, inputs, dout))


def assert_same_bits_in_each_mode(monkeypatch, run, inputs, dout, expected_mode):
    used = modes_used(monkeypatch)
    host = forward_and_grads(run, inputs, dout)
    assert used and set(used) == {expected_mode}, used
    monkeypatch.setattr(passes, "host_descriptor_fits", lambda *args: False)
    built = forward_and_grads(run, inputs, dout)
    monkeypatch.setattr(passes, "can_use_tma", lambda *tensors: False)
    pointers = forward_and_grads(run, inputs, dout)
    assert set(used[-4:-2]) == {1} and set(used[-2:]) == {0}, used
    for a, b, c in zip(host, built, pointers):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_qkv_views_read_through_host_descriptors(monkeypatch, causal):
    """Sequences of 7, 0, 20 and 1 tokens in a packed (total, 3, H, d) buffer: tiles that run past a sequence
    read the next one's rows, which the kernels mask; the last one's run past the buffer reads zeros."""
    lengths = [7, 0, 20, 1]
    offsets = torch.tensor([0, 7, 7, 27, 28], dtype=torch.int32)
    qkv = torch.randn(28, 3, 4, 16, dtype=torch.float16)
    dout = torch.randn(28, 4, 16, dtype=torch.float16)

    def run(q, k, v):
        return exattn.attention_varlen(q, k, v, offsets, offsets, max(lengths), max(lengths), causal=causal,
                                       backend="triton", block_m=16, block_n=16)

    assert_same_bits_in_each_mode(monkeypatch, run, (qkv[:, 0], qkv[:, 1], qkv[:, 2]), dout, 2)


@pytest.mark.parametrize(("dim", "mode"), [(32, 2), (128, 1)])
def test_dense_token_major_views_take_host_descriptors_up_to_d64(monkeypatch, dim, mode):
    """(B, N, H, D) tensors seen as (B, H, N, D), a ragged last tile, GQA: host descriptors up to
    d = 64 (`passes.HOST_DESCRIPTOR_MAX_DENSE_DIM`), descriptors built in the kernel above."""
    q = torch.randn(2, 21, 4, dim, dtype=torch.float16).transpose(1, 2)
    k, v = (torch.randn(2, 13, 2, dim, dtype=torch.float16).transpose(1, 2) for _ in range(2))
    dout = torch.randn(2, 4, 21, dim, dtype=torch.float16)

    def run(q, k, v):
        return exattn.attention(q, k, v, causal=True, backend="triton", block_m=16, block_n=16)

    assert_same_bits_in_each_mode(monkeypatch, run, (q, k, v), dout, mode)
