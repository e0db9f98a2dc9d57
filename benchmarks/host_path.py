"""exattn's own host (Python) time per call, with the Triton kernel launches stubbed out.

Runs anywhere: on the CPU it sets TRITON_INTERPRET=1 so the Triton backend accepts
CPU tensors, and replaces the kernels' launch with a no-op, so what is timed is
exattn's code between the call and the launches (validation, planning, buffers,
autograd glue), not the GPU, Triton's launcher or the interpreter. Cases: decode
(B = 8, Hq = 32, Hk = 8, D = 128, one new token, a 1k cache, contiguous and with
16-key pages; with and without validation) and attention through the Triton passes
(fp16, 1 x 2 x 256 x 64, causal; forward, forward + backward). Each case: the best of
--repeats runs of --calls calls, in µs per call. --src times another exattn tree (an
A/B of host-path changes: run once per tree).

    python3 benchmarks/host_path.py --out benchmarks/results/host-path-cpu.json [--src OTHER/src]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class NoLaunch:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_kernels() -> None:
    from exattn.backends.triton import decode_kernel, passes

    for module, names in ((decode_kernel, ("decode_split_kernel", "decode_combine_kernel")),
                          (passes, ("attention_forward_kernel", "attention_delta_kernel", "attention_dkdv_kernel",
                                    "attention_dq_kernel"))):
        for name in names:
            setattr(module, name, NoLaunch())


def cases():
    import torch

    import exattn

    torch.manual_seed(0)
    q = torch.randn(8, 32, 1, 128, dtype=torch.float16)
    k, v = (torch.randn(8, 8, 1024, 128, dtype=torch.float16) for _ in range(2))
    lens = torch.full((8,), 1000, dtype=torch.int32)
    pages = torch.randperm(8 * 64).view(8, 64).to(torch.int32)
    k_pages, v_pages = (x.view(8, 8, 64, 16, 128).permute(0, 2, 1, 3, 4).reshape(8 * 64, 8, 16, 128) for x in (k, v))
    qa, ka, va = (torch.randn(1, 2, 256, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 2, 256, 64, dtype=torch.float16)

    def forward_backward():
        exattn.attention(qa, ka, va, causal=True, backend="triton").backward(dout)

    return {
        "decode, validated": lambda: exattn.decode(q, k, v, cache_seqlens=lens, backend="triton"),
        "decode, validate=False": lambda: exattn.decode(q, k, v, cache_seqlens=lens, backend="triton", validate=False),
        "decode, 16-key pages": lambda: exattn.decode(q, k_pages, v_pages, cache_seqlens=lens, block_table=pages,
                                                      backend="triton"),
        "attention forward": lambda: exattn.attention(qa, ka, va, causal=True, backend="triton"),
        "attention forward + backward": forward_backward,
    }


def best_us(fn, calls: int, repeats: int) -> float:
    for _ in range(calls // 10 + 1):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--src", default=str(ROOT / "src"), help="the exattn source tree to time")
    p.add_argument("--out", help="results JSON")
    args = p.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, args.src)
    import torch
    import triton

    timed = cases()
    stub_kernels()
    results = {name: best_us(fn, args.calls, args.repeats) for name, fn in timed.items()}
    for name, us in results.items():
        print(f"{name:32s} {us:8.1f} us per call")
    meta = {"src": args.src, "calls": args.calls, "repeats": args.repeats, "python": platform.python_version(),
            "torch": torch.__version__, "triton": triton.__version__, "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "us_per_call": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
