"""Tiled attention throughput on the CPU against torch SDPA's CPU kernel, same run.

    python benchmarks/cpu_speed.py [--seq-len 4096] [--heads 8] [--head-dim 64]

Goal (issue 2): tiled forward >= 0.8x SDPA at N=4096, D=64, fp32. The two run in
alternating rounds; the ratio is the median of the per-round ratios.
Writes benchmarks/results/cpu-speed.json.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import exattn
from common import attention_flops, environment, interleaved_seconds, write_json


def implementations(block_m, block_n):
    def sdpa(q, k, v, causal):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def tiled(q, k, v, causal):
        return exattn.attention(q, k, v, causal=causal, backend="tiled", block_m=block_m, block_n=block_n)

    return {"torch-sdpa-cpu": sdpa, "exattn-tiled": tiled}


def one_pass(fn, q, k, v, causal, backward):
    if not backward:
        def forward():
            with torch.no_grad():
                fn(q, k, v, causal)
        return forward
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    dout = torch.randn_like(q)
    return lambda: fn(q, k, v, causal).backward(dout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-m", type=int, default=None)
    parser.add_argument("--block-n", type=int, default=None)
    args = parser.parse_args()
    b, h, n, d = args.batch, args.heads, args.seq_len, args.head_dim
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    rows = []
    for causal in (False, True):
        for backward in (False, True):
            flops = attention_flops(b, h, n, n, d, causal) * (3.5 if backward else 1)
            row = {"causal": causal, "pass": "fwd+bwd" if backward else "fwd"}
            passes = {name: one_pass(fn, q, k, v, causal, backward)
                      for name, fn in implementations(args.block_m, args.block_n).items()}
            times = interleaved_seconds(passes, repeats=args.repeats)
            for name, seconds in times.items():
                row[name] = {"seconds": statistics.median(seconds),
                             "gflops": flops / statistics.median(seconds) / 1e9}
            # Median over rounds of the per-round ratio: robust to drift between rounds.
            row["ratio_tiled_to_sdpa"] = statistics.median(
                s / t for s, t in zip(times["torch-sdpa-cpu"], times["exattn-tiled"])
            )
            rows.append(row)
            print(f"causal={causal!s:5} {row['pass']:7}  sdpa {row['torch-sdpa-cpu']['gflops']:6.1f} GFLOP/s"
                  f"  tiled {row['exattn-tiled']['gflops']:6.1f} GFLOP/s  ratio {row['ratio_tiled_to_sdpa']:.2f}")
    write_json("cpu-speed.json", {
        "shape_bhnd": (b, h, n, d), "dtype": "float32", "device": "cpu",
        "flops": "4*B*H*N^2*D forward (halved for causal); fwd+bwd counts 3.5x forward",
        "environment": environment(), "rows": rows,
    })


if __name__ == "__main__":
    main()
