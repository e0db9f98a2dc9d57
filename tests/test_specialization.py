"""Lengths that differ only in their tile counts share compiled kernels: Triton specializes integer
arguments (divisible by 16? equal to 1?), and the counts of tiles and heads are left out of it
(`configs.COUNTS`), so 1k, 2k and 4k tokens bind to one specialization of each Gluon kernel."""

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import create_function_from_signature, native_specialize_impl  # noqa: E402

from exattn.backends.triton import gluon_backward as gb  # noqa: E402
from exattn.backends.triton import gluon_forward as gf  # noqa: E402
from exattn.problem import AttentionParams  # noqa: E402

LENGTHS = (1024, 2048, 4096)


def specialization(kernel, args, options: dict) -> list:
    """What Triton keys a launch of `kernel` on, besides its constexprs."""
    binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
    constexprs = {name: value for name, value in options.items() if name in kernel.arg_names}
    return binder(*args, **constexprs)[1]


def forward_keys(n: int, causal: bool) -> list:
    q, k, v = (torch.empty(4, 16, n, 128, dtype=torch.bfloat16) for _ in range(3))
    args, _ = gf.forward_arguments(q, k, v, torch.empty_like(q), torch.empty(4, 16, n), 0.5, causal, programs=132)
    return specialization(gf.gluon_forward_kernel, args, gf.kernel_constants(128, causal))


def backward_keys(n: int, causal: bool, monkeypatch) -> list:
    launches = []
    monkeypatch.setattr(gb, "run_kernel", lambda kernel, grid, *args, **options: launches.append((kernel, args, options)))
    monkeypatch.setattr(gb, "row_stats", lambda lse, out, dout, pad, semaphores, packing, within: (lse, lse))
    q, k, v, out, dout = (torch.randn(2, 4, n, 128, dtype=torch.bfloat16) for _ in range(5))
    params = AttentionParams(scale=0.1, window=(-1, 0) if causal else (-1, -1))
    gb.launch(dout, q, k, v, out, torch.zeros(2, 4, gb.stats_rows(n)), params, None, False)
    return [specialization(kernel, args, options) for kernel, args, options in launches]


@pytest.mark.parametrize("causal", [False, True])
def test_gluon_forward_lengths_share_a_specialization(causal):
    first, *others = (forward_keys(n, causal) for n in LENGTHS)
    assert all(keys == first for keys in others)


@pytest.mark.parametrize("causal", [False, True])
def test_gluon_backward_lengths_share_a_specialization(causal, monkeypatch):
    first, *others = (backward_keys(n, causal, monkeypatch) for n in LENGTHS)
    assert first and all(keys == first for keys in others)


def test_the_lengths_differ_in_what_triton_specializes():
    """The tests above are not vacuous: 1k and 2k tokens are 8 and 16 row tiles of the forward, which
    Triton would specialize apart."""
    tile_counts = []
    for n in LENGTHS[:2]:
        q = torch.empty(4, 16, n, 128, dtype=torch.bfloat16)
        args, _ = gf.forward_arguments(q, q, q, q, torch.empty(4, 16, n), 0.5, True)
        tile_counts.append(args[gf.gluon_forward_kernel.arg_names.index("num_row_tiles")])
    assert tile_counts == [8, 16]
    assert native_specialize_impl(BaseBackend, 8, False, True, True) != native_specialize_impl(BaseBackend, 16, False,
                                                                                                True, True)
