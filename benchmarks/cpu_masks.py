"""Score rules on the CPU: exattn's keywords (O(N) inputs) against the same rule as a dense
(Nq, Nk) mask or bias, through exattn's tiled backend and torch SDPA's CPU kernel, same run.

    python benchmarks/cpu_masks.py [--seq-len 16384] [--heads 8] [--head-dim 64] [--repeats 3]

fp32, B = 1, causal throughout; the rules of `benchmarks/masks.py` (documents of log-uniform lengths
128-8192, a 1024-key prefix, softcap 50, ALiBi, sinks with a 4k window). Implementations:
  exattn         exattn.attention(..., backend="tiled") with the rule's keyword;
  exattn mask    the tiled backend with the rule as a dense bool mask or float bias (Nq, Nk);
  sdpa mask      torch SDPA with the same dense mask (is_causal for the plain call).
Softcap has no dense form and SDPA no sinks: their rows are exattn's alone; the dense form of the sink
rule is its 4k window without the sinks. Time: medians of alternating rounds, the dense tensors built
once beforehand; useful GFLOP/s count allowed pairs only (4 * H * pairs * D forward, 3.5x for
forward + backward). Memory: each (rule, implementation, pass) in a fresh process, MiB of peak RSS
growth from the moment q, k and v exist, building the rule's inputs included. Writes
benchmarks/results/cpu-masks.json.
"""

from __future__ import annotations

import statistics

import torch

import exattn
from common import cpu_parser, environment, interleaved_seconds, result_rows, write_json
from cpu_memory import in_fresh_process, peak_rss_bytes
from masks import RULES, WINDOW, allowed_pairs, keywords

IMPLS = ("exattn", "exattn mask", "sdpa mask")
PASSES = ("fwd", "fwd+bwd")


def dense_rule(rule: str, n: int, heads: int, dtype=torch.float32) -> torch.Tensor | None:
    """The rule with causality as one dense mask: bool (1, 1, n, n), or ALiBi's bias (1, H, n, n) in
    `dtype`, the queries' (SDPA reads a bias of another dtype wrongly); None where the rule has no dense
    form (softcap)."""
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    causal = cols <= rows
    kw = keywords(rule, n, heads, "cpu")
    if rule == "plain":
        allowed = causal
    elif rule == "segment_ids":
        ids = kw["segment_ids"][0]
        allowed = causal & (ids[:, None] == ids[None, :])
    elif rule == "prefix":
        allowed = causal | (cols < kw["prefix"])
    elif rule == "sinks":
        allowed = causal & (rows - cols < WINDOW)
    elif rule == "alibi_slopes":
        distance = (rows - cols).abs().to(dtype)
        bias = -kw["alibi_slopes"].to(dtype)[:, None, None] * distance
        return bias.masked_fill_(~causal, float("-inf"))[None]
    else:
        return None
    return allowed[None, None]


def runner(impl: str, rule: str, q, k, v, dense: torch.Tensor | None):
    """fn() -> out for one implementation of one rule, or None where it cannot express the rule.
    dense: `dense_rule`'s tensor for the rule (built once, shared by the implementations)."""
    if impl == "exattn":
        kw = keywords(rule, q.shape[2], q.shape[1], "cpu")
        return lambda: exattn.attention(q, k, v, causal=True, backend="tiled", **kw)
    if rule == "plain" and impl == "sdpa mask":
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    if dense is None or (rule == "sinks" and impl == "exattn mask"):
        return None
    if impl == "exattn mask":
        return lambda: exattn.attention(q, k, v, mask=dense, backend="tiled")
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)


def timed_pass(fn, inputs, backward: bool):
    if not backward:
        def forward():
            with torch.no_grad():
                fn()
        return forward
    dout = torch.randn_like(inputs[0])

    def forward_backward():
        for x in inputs:
            x.grad = None
        fn().backward(dout)
    return forward_backward


def inputs(shape, backward: bool):
    torch.manual_seed(0)
    return [torch.randn(shape, requires_grad=backward) for _ in range(3)]


def measure_memory(impl, rule, shape, backward, queue) -> None:
    q, k, v = inputs(shape, backward)
    start = peak_rss_bytes()
    dense = None if impl == "exattn" else dense_rule(rule, shape[2], shape[1])
    fn = runner(impl, rule, q, k, v, dense)
    timed_pass(fn, (q, k, v), backward)()
    queue.put((peak_rss_bytes() - start) / 2**20)


def memory_mib(impl, rule, shape, backward) -> float:
    return in_fresh_process(measure_memory, impl, rule, shape, backward)


def rule_rows(rule, shape, repeats) -> list[dict]:
    _, heads, n, d = shape
    rows = []
    dense = dense_rule(rule, n, heads)
    for backward in (False, True):
        q, k, v = inputs(shape, backward)
        fns = {impl: runner(impl, rule, q, k, v, dense) for impl in IMPLS}
        passes = {impl: timed_pass(fn, (q, k, v), backward) for impl, fn in fns.items() if fn is not None}
        times = interleaved_seconds(passes, repeats=repeats)
        flops = 4 * heads * allowed_pairs(rule, n) * d * (3.5 if backward else 1)
        for impl, seconds in times.items():
            median = statistics.median(seconds)
            rows.append({"rule": rule, "impl": impl, "pass": PASSES[backward], "seconds": median,
                         "runs_s": seconds, "useful_gflops": flops / median / 1e9})
    del dense, fns, passes  # the memory runs below build their own
    for row in rows:
        row["peak_rss_growth_mib"] = memory_mib(row["impl"], rule, shape, row["pass"] == "fwd+bwd")
        print(f"{rule:>12} {row['impl']:>11} {row['pass']:>7}: {row['seconds']:7.3f} s  "
              f"{row['useful_gflops']:6.1f} GFLOP/s  +{row['peak_rss_growth_mib']:7.1f} MiB", flush=True)
    return rows


LABELS = {"plain": "plain causal", "segment_ids": "segment ids, log-uniform 128–8192", "prefix": "prefix 1024",
          "softcap": "softcap 50", "alibi_slopes": "ALiBi", "sinks": "sinks, 4k window"}


def table(rows) -> str:
    """The docs table: seconds and MiB of each implementation, forward and forward + backward."""
    found = {(r["rule"], r["impl"], r["pass"]): r for r in rows}
    head = " | ".join(f"{impl} {p}" for p in PASSES for impl in IMPLS)
    lines = [f"| rule | {head} |", "|---|" + "---|" * len(PASSES) * len(IMPLS)]
    for rule in RULES:
        cells = []
        for p in PASSES:
            for impl in IMPLS:
                r = found.get((rule, impl, p))
                cells.append(f"{r['seconds']:.2f} s, {r['peak_rss_growth_mib']:.0f} MiB" if r else "–")
        lines.append(f"| {LABELS[rule]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = cpu_parser(__doc__)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--rules", default=",".join(RULES))
    args = parser.parse_args()
    if args.table:
        print(table(result_rows(args.table)))
        return
    shape = (1, args.heads, args.seq_len, args.head_dim)
    rows = [row for rule in args.rules.split(",") for row in rule_rows(rule, shape, args.repeats)]
    print(table(rows))
    write_json("cpu-masks.json", {
        "shape_bhnd": shape, "dtype": "float32", "device": "cpu", "causal": True,
        "flops": "4*H*allowed_pairs*D forward; fwd+bwd 3.5x", "environment": environment(), "rows": rows,
    })


if __name__ == "__main__":
    main()
