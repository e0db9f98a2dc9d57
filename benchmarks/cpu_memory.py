"""Peak RSS growth of attention on the CPU, each variant in its own process.

    python benchmarks/cpu_memory.py [--seq-len 8192] [--heads 8] [--head-dim 64]

Goal (issue 2): tiled forward+backward <= 1/8 of naive's; tiled forward
<= 1.5x torch SDPA's. Writes benchmarks/results/cpu-memory.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource

import torch

from common import environment, write_json

VARIANTS = ("naive fwd", "naive fwd+bwd", "tiled fwd", "tiled fwd+bwd", "sdpa fwd", "sdpa fwd+bwd")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_variant(variant: str, shape: tuple[int, int, int, int], queue) -> None:
    import exattn

    torch.manual_seed(0)
    b, h, n, d = shape
    backward = variant.endswith("bwd")
    q, k, v = (torch.randn(b, h, n, d, requires_grad=backward) for _ in range(3))
    dout = torch.randn(b, h, n, d)
    before = peak_rss_bytes()
    impl = variant.split()[0]
    if impl == "sdpa":
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    else:
        out = exattn.attention(q, k, v, backend=impl)
    if backward:
        out.backward(dout)
    queue.put(peak_rss_bytes() - before)


def measure(variant: str, shape) -> int:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=run_variant, args=(variant, shape, queue))
    proc.start()
    growth = queue.get()
    proc.join()
    return growth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    rows = []
    for variant in VARIANTS:
        growth = measure(variant, shape)
        rows.append({"variant": variant, "peak_rss_growth_mib": growth / 2**20})
        print(f"{variant:>15}: {growth / 2**20:9.1f} MiB")
    by = {r["variant"]: r["peak_rss_growth_mib"] for r in rows}
    summary = {
        "tiled_fwdbwd_over_naive_fwdbwd": by["tiled fwd+bwd"] / by["naive fwd+bwd"],
        "tiled_fwd_over_sdpa_fwd": by["tiled fwd"] / by["sdpa fwd"],
    }
    print(json.dumps(summary, indent=2))
    write_json("cpu-memory.json", {
        "shape_bhnd": shape, "dtype": "float32", "device": "cpu",
        "environment": environment(), "rows": rows, "ratios": summary,
    })


if __name__ == "__main__":
    main()
