"""Backward TFLOP/s of the Gluon (sm_90) kernels against exattn's Triton backward, SDPA and FlexAttention.

FlashAttention's convention, as benchmarks/prefill.py: batch * seqlen = 16k
tokens, hidden 2048 (heads = 2048 / head_dim), bf16; seqlen 4k, 8k, 16k; head
dim 64 and 128; causal off/on. FLOPs = 2.5 * 4*B*H*N^2*D, halved for causal;
`triton.testing.do_bench` median. In the same run: "gluon" (the raw pass
`gluon_backward.gluon_backward`, delta preprocess included), "gluon-atomic" (the same with
`atomic_dq=True`: dQ added by TMA reductions from the dK/dV kernel, d = 128), "exattn-triton"
(the raw pass `passes.triton_backward`), and the autograd backward of SDPA's
cuDNN and flash backends and of compiled FlexAttention (as prefill.py times
them). `--variants` adds Gluon rows with other tiles for one head dim:
"dim:BLOCK_MxSTAGES/BLOCK_NxSTAGES[r]" (dK/dV queries per step and Q/dO slots,
dQ keys per step and K/V slots; "r": resident tiles as register operands,
`GluonBackwardConfig.in_registers`), e.g. "64:64x4/128x4,64:64x4/64x4r".

    PYTHONPATH=src python3 benchmarks/gluon_backward.py --out $OUT/gluon-backward-h200.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gluon_forward import parse_benchmark_args, run_benchmark  # noqa: E402
from prefill import attention_function, make_inputs  # noqa: E402

RAW = ("gluon", "gluon-atomic", "exattn-triton")


def parse_args(argv=None):
    return parse_benchmark_args(argv, __doc__, "'dim:BMxS/BNxS,...'", "gluon-backward-h200.json")


def variant(spec: str):
    """'64:64x4/128x4' -> (64, GluonBackwardConfig(64, 4, 128, 4)); a trailing 'r' sets in_registers."""
    import re

    from exattn.backends.triton.gluon_backward import GluonBackwardConfig

    found = re.fullmatch(r"(\d+):(\d+)x(\d+)/(\d+)x(\d+)(r?)", spec)
    if found is None:
        raise ValueError(f"--variants: {spec!r} is not 'dim:BLOCK_MxSTAGES/BLOCK_NxSTAGES[r]'")
    dim, bm, sm, bn, sn, regs = found.groups()
    return int(dim), GluonBackwardConfig(int(bm), int(sm), int(bn), int(sn), bool(regs))


def raw_backward(impl: str, cell):
    """fn() running one raw backward pass on fresh inputs of this cell, or None if it does not apply."""
    from exattn.backends.triton import gluon_backward as gb
    from exattn.backends.triton import triton_forward
    from exattn.backends.triton.passes import triton_backward
    from exattn.problem import AttentionParams

    params = AttentionParams(scale=cell["head_dim"] ** -0.5, window=(-1, 0) if cell["causal"] else (-1, -1))
    if impl.startswith("gluon:"):
        dim, cfg = variant(impl[len("gluon:"):])
        if dim != cell["head_dim"]:
            return None
        gb.CONFIGS[dim] = cfg
    if impl == "gluon-atomic" and cell["head_dim"] not in gb.ATOMIC_CONFIGS:
        return None
    q, k, v = (x.detach() for x in make_inputs(cell))
    dout = torch.randn_like(q)
    out, lse = triton_forward(q, k, v, None, params)
    if impl == "gluon-atomic":
        return lambda: gb.gluon_backward(dout, q, k, v, out, lse, params, atomic_dq=True)
    if impl.startswith("gluon"):
        return lambda: gb.gluon_backward(dout, q, k, v, out, lse, params)
    return lambda: triton_backward(dout, q, k, v, None, out, lse, params)


def autograd_backward(impl: str, cell):
    """(fn(), grads to reset) timing `out.backward` of SDPA / FlexAttention on a retained graph."""
    q, k, v = make_inputs(cell)
    fn, context = attention_function(impl, cell)
    with context():
        out = fn(q, k, v)
    dout = torch.randn_like(out)

    def run():
        with context():
            out.backward(dout, retain_graph=True)
    return run, [q, k, v]


def measure(impl, cell, warmup_ms, rep_ms):
    from triton.testing import do_bench

    from exattn.backends.triton import gluon_backward as gb

    saved = dict(gb.CONFIGS)
    try:
        if impl.split(":")[0] in RAW:
            fn, grads = raw_backward(impl, cell), None
            if fn is None:
                return None
        else:
            fn, grads = autograd_backward(impl, cell)
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grads, return_mode="median")
    finally:
        gb.CONFIGS.clear()
        gb.CONFIGS.update(saved)


def main(argv=None):
    run_benchmark(parse_args(argv), measure, "bwd")


if __name__ == "__main__":
    main()
