"""Packed variable-length batches on the CPU: exattn.attention_varlen (tiled backend) against torch
SDPA on the padded batch and SDPA called once per document, same run.

    python benchmarks/cpu_varlen.py [--heads 8] [--head-dim 64] [--repeats 3]

fp32, 16k tokens, the packings of `benchmarks/varlen.py` (8 equal documents; log-uniform 128-8192;
short 64-1024), causal and not. Implementations:
  exattn varlen     exattn.attention_varlen on token-major (total, H, d) tensors;
  sdpa padded       SDPA over (documents, H, longest, d), no key-padding mask (the least padding costs);
  sdpa per doc      SDPA on each document's (1, H, n, d) view of the packed tensors, in a Python loop.
Time: medians of alternating rounds; useful GFLOP/s count each document's own pairs (forward +
backward 3.5x the forward). Memory: each cell in a fresh process, MiB of peak RSS growth from the
moment the inputs exist. Writes benchmarks/results/cpu-varlen.json.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

import exattn
from common import cpu_parser, environment, interleaved_seconds, result_rows, write_json
from cpu_masks import timed_pass
from cpu_memory import in_fresh_process, peak_rss_bytes
from varlen import PACKINGS, document_lengths, useful_flops

IMPLS = ("exattn varlen", "sdpa padded", "sdpa per doc")
PASSES = ("fwd", "fwd+bwd")


def inputs(impl: str, lengths: list[int], heads: int, head_dim: int, backward: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    shape = (len(lengths), heads, max(lengths), head_dim) if impl == "sdpa padded" else (sum(lengths), heads, head_dim)
    return [torch.randn(shape, requires_grad=backward) for _ in range(3)]


def runner(impl: str, lengths: list[int], causal: bool, q, k, v):
    """fn() -> out for one implementation over q, k, v from `inputs`."""
    if impl == "sdpa padded":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    if impl == "exattn varlen":
        cu = torch.tensor(offsets, dtype=torch.int32)
        longest = max(lengths)
        return lambda: exattn.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal)

    def per_document():
        outs = [F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1)[None] for x in (q, k, v)), is_causal=causal)
                for a, b in zip(offsets[:-1], offsets[1:])]
        return torch.cat([o[0].transpose(0, 1) for o in outs])
    return per_document


def measure_memory(impl, lengths, causal, heads, head_dim, backward, queue) -> None:
    q, k, v = inputs(impl, lengths, heads, head_dim, backward)
    start = peak_rss_bytes()
    timed_pass(runner(impl, lengths, causal, q, k, v), (q, k, v), backward)()
    queue.put((peak_rss_bytes() - start) / 2**20)


def cell_rows(packing: str, causal: bool, args) -> list[dict]:
    lengths = document_lengths(packing)
    rows = []
    for backward in (False, True):
        passes = {}
        for impl in IMPLS:
            q, k, v = inputs(impl, lengths, args.heads, args.head_dim, backward)
            passes[impl] = timed_pass(runner(impl, lengths, causal, q, k, v), (q, k, v), backward)
        times = interleaved_seconds(passes, repeats=args.repeats)
        flops = useful_flops(lengths, args.heads, args.head_dim, causal) * (3.5 if backward else 1)
        for impl, seconds in times.items():
            median = statistics.median(seconds)
            rows.append({"packing": packing, "causal": causal, "impl": impl, "pass": PASSES[backward],
                         "documents": len(lengths), "longest": max(lengths), "seconds": median, "runs_s": seconds,
                         "useful_gflops": flops / median / 1e9})
    del passes
    for row in rows:
        row["peak_rss_growth_mib"] = in_fresh_process(measure_memory, row["impl"], lengths, causal, args.heads,
                                                      args.head_dim, row["pass"] == "fwd+bwd")
        print(f"{packing:>20} causal={causal!s:5} {row['impl']:>13} {row['pass']:>7}: {row['seconds']:7.3f} s  "
              f"{row['useful_gflops']:6.1f} GFLOP/s  +{row['peak_rss_growth_mib']:7.1f} MiB", flush=True)
    return rows


def table(rows) -> str:
    """The docs table: useful GFLOP/s and MiB of each implementation, and exattn's time ratios."""
    found = {(r["packing"], r["causal"], r["impl"], r["pass"]): r for r in rows}
    lines = ["| packing | causal | pass | exattn varlen | sdpa padded | sdpa per doc | × padded | × per doc |",
             "|---|---|---|---|---|---|---|---|"]
    for packing in PACKINGS:
        for causal in (False, True):
            for p in PASSES:
                cells = [found.get((packing, causal, impl, p)) for impl in IMPLS]
                if not all(cells):
                    continue
                ours, padded, per_doc = cells
                shown = " | ".join(f"{c['useful_gflops']:.0f} GFLOP/s, {c['peak_rss_growth_mib']:.0f} MiB" for c in cells)
                lines.append(f"| {packing} | {'yes' if causal else 'no'} | {p} | {shown} | "
                             f"{padded['seconds'] / ours['seconds']:.2f} | {per_doc['seconds'] / ours['seconds']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = cpu_parser(__doc__)
    parser.add_argument("--packings", default=",".join(PACKINGS))
    args = parser.parse_args()
    if args.table:
        print(table(result_rows(args.table)))
        return
    rows = [row for packing in args.packings.split(",") for causal in (False, True)
            for row in cell_rows(packing, causal, args)]
    print(table(rows))
    write_json("cpu-varlen.json", {
        "tokens": sum(document_lengths(next(iter(PACKINGS)))), "heads": args.heads, "head_dim": args.head_dim,
        "dtype": "float32", "device": "cpu", "flops": "each document's 4*H*n^2*d forward (halved for causal); "
        "fwd+bwd 3.5x", "environment": environment(), "rows": rows,
    })


if __name__ == "__main__":
    main()
