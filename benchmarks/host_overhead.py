"""Host (CPU) time per attention call on a GPU, where short kernels can leave the GPU waiting on Python.

For one prefill cell (default bf16, B=16, H=16, N=1k, d=128, causal) it times,
with the GPU kept busy so the queue never drains (a large matmul first, calls
enqueued back to back, one synchronize at the end): exattn's forward
(`exattn.attention(..., backend="triton")` without grad), its forward with grad
plus backward, and the same two for SDPA's cuDNN backend; then prints a
cProfile of the exattn calls (top functions by own time). Results (µs of host
time per call) go to --out.

    PYTHONPATH=src python3 benchmarks/host_overhead.py --out $OUT/host-overhead-h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from prefill import attention_function, versions  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", type=int, default=1)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/host-overhead-h200.json"))
    return p.parse_args(argv)


def host_seconds_per_call(step, calls: int) -> float:
    """CPU seconds per step() while the GPU runs a long matmul queued first (so no call waits on it)."""
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    step()
    torch.cuda.synchronize()
    for _ in range(6):
        big @ big
    start = time.perf_counter()
    for _ in range(calls):
        step()
    seconds = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return seconds


def steps(impl: str, cell: dict):
    """(forward-only step, forward+backward step) for one implementation."""
    fn, context = attention_function(impl, cell)
    shape = (max(1, 16384 // cell["seqlen"]), 2048 // cell["head_dim"], cell["seqlen"], cell["head_dim"])
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cell["dtype"]]
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=dtype)

    def forward():
        with context(), torch.no_grad():
            fn(q, k, v)

    def forward_backward():
        with context():
            fn(q, k, v).backward(dout)

    return forward, forward_backward


def main(argv=None):
    args = parse_args(argv)
    cell = dict(dtype=args.dtype, head_dim=args.head_dim, causal=bool(args.causal), seqlen=args.seqlen)
    rows = []
    for impl in ("exattn-triton", "sdpa-cudnn"):
        forward, forward_backward = steps(impl, cell)
        for name, step in (("fwd", forward), ("fwd+bwd", forward_backward)):
            us = host_seconds_per_call(step, args.calls) * 1e6
            rows.append(dict(impl=impl, **cell, step=name, host_us_per_call=us))
            print(f"{impl:15s} {name:8s} {us:8.1f} us host per call", flush=True)
    forward, forward_backward = steps("exattn-triton", cell)
    profile = cProfile.Profile()
    profile.runcall(lambda: [forward_backward() for _ in range(args.calls)])
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue())
    Path(args.out).write_text(json.dumps({"meta": versions(), "rows": rows, "profile": text.getvalue()}, indent=1))


if __name__ == "__main__":
    main()
