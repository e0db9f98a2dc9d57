"""Structured masks and score rules on the GPU: each keyword alone against exattn's plain causal kernel
and FlexAttention with the same rule.

bf16, d = 128, B = 1, H = 16, N = 16384 (--seqlen), causal throughout; rules: `segment_ids` (documents of
lengths log-uniform in 128-8192, fixed seed), `prefix` (1024 keys), `softcap` (50), `alibi_slopes`
(BLOOM's geometric slopes), `sinks` with a 4k window (learnable sink logits; Flex cannot express
sinks: its row is the window alone). Each row: useful TFLOP/s (the allowed pairs only), forward and
backward, medians of --rounds interleaved rounds of `triton.testing.do_bench`, and exattn's device memory
beyond its outputs and lse as a fraction of the inputs.

    PYTHONPATH=src python3 benchmarks/masks.py --out benchmarks/results/masks-h200.json
    python3 benchmarks/masks.py --table benchmarks/results/masks-h200.json   # the docs table
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import interleaved_rounds, result_rows  # noqa: E402
from prefill import versions  # noqa: E402
from varlen import document_lengths  # noqa: E402

RULES = ("plain", "segment_ids", "prefix", "softcap", "alibi_slopes", "sinks")
PREFIX, SOFTCAP, WINDOW = 1024, 50.0, 4096


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", metavar="JSON", help="print the docs table of a results file and exit")
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-ms", type=float, default=10)
    p.add_argument("--rep-ms", type=float, default=30)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/masks-h200.json"))
    return p.parse_args(argv)


def alibi_slopes(heads: int) -> torch.Tensor:
    """BLOOM's slopes: 2^(-8 i / H), i = 1..H."""
    return torch.tensor([2.0 ** (-8.0 * i / heads) for i in range(1, heads + 1)])


def allowed_pairs(rule: str, n: int) -> int:
    """Query-key pairs the rule allows (causal throughout)."""
    causal = n * (n + 1) // 2
    if rule == "segment_ids":
        return sum(m * (m + 1) // 2 for m in document_lengths("log-uniform 128-8192", n))
    if rule == "prefix":
        return causal + PREFIX * (PREFIX - 1) // 2
    if rule == "sinks":
        return sum(min(i + 1, WINDOW) for i in range(n))
    return causal


def keywords(rule: str, n: int, heads: int, device) -> dict:
    """exattn.attention's keywords for one rule."""
    if rule == "segment_ids":
        lengths = document_lengths("log-uniform 128-8192", n)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        return {"segment_ids": ids[None].to(device=device, dtype=torch.int32)}
    if rule == "prefix":
        return {"prefix": PREFIX}
    if rule == "softcap":
        return {"softcap": SOFTCAP}
    if rule == "alibi_slopes":
        return {"alibi_slopes": alibi_slopes(heads).to(device)}
    if rule == "sinks":
        return {"sinks": torch.randn(heads, device=device, requires_grad=True), "window": (WINDOW - 1, 0)}
    return {}


def flex_rule(rule: str, n: int, heads: int):
    """(score_mod, mask_mod) of FlexAttention for one rule (causal throughout)."""
    def causal(b, h, q, k):
        return q >= k

    if rule == "segment_ids":
        doc = keywords(rule, n, heads, "cuda")["segment_ids"][0]
        return None, lambda b, h, q, k: (q >= k) & (doc[q] == doc[k])
    if rule == "prefix":
        return None, lambda b, h, q, k: (q >= k) | (k < PREFIX)
    if rule == "softcap":
        return (lambda s, b, h, q, k: SOFTCAP * torch.tanh(s / SOFTCAP)), causal
    if rule == "alibi_slopes":
        slopes = alibi_slopes(heads).cuda()
        return (lambda s, b, h, q, k: s - slopes[h] * (q - k).abs()), causal
    if rule == "sinks":
        return None, lambda b, h, q, k: (q >= k) & (q - k < WINDOW)
    return None, causal


FLEX: dict = {}


def runner(impl: str, rule: str, args):
    """(fn() -> out, inputs needing grads)."""
    import exattn

    shape = (1, args.heads, args.seqlen, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    if impl == "exattn":
        kw = keywords(rule, args.seqlen, args.heads, "cuda")
        extra = [kw["sinks"]] if "sinks" in kw else []
        return (lambda: exattn.attention(q, k, v, causal=True, **kw)), (q, k, v, *extra)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in FLEX:
        torch._dynamo.config.cache_size_limit = 256
        torch._functorch.config.donated_buffer = False
        FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    score_mod, mask_mod = flex_rule(rule, args.seqlen, args.heads)
    block_mask = create_block_mask(mask_mod, None, None, args.seqlen, args.seqlen, device="cuda")
    return (lambda: FLEX["fn"](q, k, v, score_mod=score_mod, block_mask=block_mask)), (q, k, v)


def measure(impl: str, rule: str, args) -> tuple[float, float]:
    from triton.testing import do_bench

    fn, inputs = runner(impl, rule, args)
    out = fn()
    dout = torch.randn_like(out)
    out.backward(dout, retain_graph=True)
    fwd = do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
    bwd = do_bench(lambda: out.backward(dout, retain_graph=True), warmup=args.warmup_ms, rep=args.rep_ms,
                   grad_to_none=list(inputs), return_mode="median")
    return fwd, bwd


def extra_memory_fraction(rule: str, args) -> float:
    """exattn's forward peak beyond inputs, outputs and lse, over the inputs' bytes."""
    fn, inputs = runner("exattn", rule, args)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        out = fn()
    torch.cuda.synchronize()
    lse_bytes = out.shape[0] * out.shape[1] * out.shape[2] * 4
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size() - lse_bytes
    return extra / sum(x.numel() * x.element_size() for x in inputs[:3])


LABELS = {"plain": "plain (Gluon)", "segment_ids": "segment ids, log-uniform 128–8192", "prefix": "prefix 1024",
          "softcap": "softcap 50", "alibi_slopes": "ALiBi", "sinks": "sinks, 4k window"}


def table(rows) -> str:
    """The docs table: exattn's useful TFLOP/s with each rule, over its plain call's and over Flex's."""
    found = {(r["impl"], r["rule"]): r for r in rows}

    def ratio(a, b, key):
        return f"{a[key] / b[key]:.2f}" if a.get(key) and b.get(key) else "–"

    lines = ["| rule | exattn fwd | × plain | × Flex | exattn bwd | × plain | × Flex |", "|---|---|---|---|---|---|---|"]
    plain = found.get(("exattn", "plain"), {})
    for rule in RULES:
        ours, flex = found.get(("exattn", rule), {}), found.get(("flex", rule), {})
        if not ours.get("fwd_tflops"):
            lines.append(f"| {LABELS[rule]} | {ours.get('error') or 'not run'} | | | | | |")
            continue
        lines.append(f"| {LABELS[rule]} | {ours['fwd_tflops']:.0f} | {ratio(ours, plain, 'fwd_tflops')} | "
                     f"{ratio(ours, flex, 'fwd_tflops')} | {ours['bwd_tflops']:.0f} | {ratio(ours, plain, 'bwd_tflops')} | "
                     f"{ratio(ours, flex, 'bwd_tflops')} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.table:
        print(table(result_rows(args.table)))
        return
    rows = []
    for rule in args.rules.split(","):
        impls = ["exattn", "flex"]
        samples = interleaved_rounds(impls, args.rounds, lambda impl: measure(impl, rule, args),
                                     lambda e: f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        flops = 4 * args.heads * allowed_pairs(rule, args.seqlen) * args.head_dim
        for impl in impls:
            got = samples.get(impl)
            row = dict(impl=impl, rule=rule, dtype="bf16", head_dim=args.head_dim, heads=args.heads,
                       seqlen=args.seqlen, allowed_pairs=allowed_pairs(rule, args.seqlen))
            if isinstance(got, str) or not got:
                row.update(error=got or "not run")
            else:
                fwd = sorted(f for f, _ in got)[len(got) // 2]
                bwd = sorted(b for _, b in got)[len(got) // 2]
                row.update(fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=flops / fwd / 1e9, bwd_tflops=2.5 * flops / bwd / 1e9,
                           error=None)
            if impl == "exattn":
                row["extra_memory_fraction"] = extra_memory_fraction(rule, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"meta": versions(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
