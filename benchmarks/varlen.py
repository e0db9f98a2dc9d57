"""Packed variable-length batches on the GPU: exattn.attention_varlen against padding and Flex.

For 16k tokens per batch (bf16, d = 64 and 128, hidden 2048, causal and not) and three
packings (equal lengths, lengths log-uniform in [128, 8192], short documents log-uniform
in [64, 1024]; fixed seed) it times, in --rounds interleaved rounds (medians of
`triton.testing.do_bench`):

- exattn-varlen: `exattn.attention_varlen` on the packed (total, H, d) tensors (defaults:
  `validate=True` reads the offsets on the host, a device sync every call);
- exattn-varlen-unvalidated: the same with `validate=False` (no sync: the kernels' own speed);
- exattn-padded: `exattn.attention` on the padded (B, H, max_len, d) batch;
- sdpa-cudnn-padded: SDPA's cuDNN backend on the padded batch (for equal lengths, cuDNN dense);
- flex-document: FlexAttention (compiled) over the packed sequence with a document BlockMask.

The padded rows run without a key-padding mask (the least a padded batch can cost).
Throughput counts useful FLOPs only: the allowed pairs of each document (causal halved).
Also records exattn-varlen's device memory beyond its outputs and lse, forward and
forward + backward (beyond the gradients), as a fraction of the inputs' bytes.

    PYTHONPATH=src python3 benchmarks/varlen.py --out benchmarks/results/varlen-h200.json
    # rerun some cells into that table (their rows replaced, the run listed in its meta):
    PYTHONPATH=src python3 benchmarks/varlen.py --packings "short 64-1024" --head-dims 64 --update
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import attention_flops, interleaved_rounds, updated  # noqa: E402
from prefill import versions  # noqa: E402

TOKENS = 16384
HIDDEN = 2048
PACKINGS = {"equal": None, "log-uniform 128-8192": (128, 8192), "short 64-1024": (64, 1024)}
IMPLS = ("exattn-varlen", "exattn-padded", "sdpa-cudnn-padded", "flex-document", "exattn-varlen-unvalidated")
ANCHORS = IMPLS[1:4]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--packings", default=",".join(PACKINGS))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-ms", type=float, default=10)
    p.add_argument("--rep-ms", type=float, default=30)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/varlen-h200.json"))
    p.add_argument("--update", action="store_true",
                   help="replace only the measured cells' rows of an existing --out (its meta lists them)")
    return p.parse_args(argv)


def document_lengths(packing: str, total: int = TOKENS, seed: int = 0) -> list[int]:
    """Lengths summing to `total`: 8 equal ones, or log-uniform draws (the last one cut to fit)."""
    bounds = PACKINGS[packing]
    if bounds is None:
        return [total // 8] * 8
    rng, lengths = random.Random(seed), []
    while sum(lengths) < total:
        lengths.append(min(round(math.exp(rng.uniform(*map(math.log, bounds)))), total - sum(lengths)))
    return lengths


def useful_flops(lengths, heads, head_dim, causal, backward=False) -> float:
    return sum(attention_flops(1, heads, n, n, head_dim, causal, backward) for n in lengths)


def packed_inputs(lengths, heads, head_dim):
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu


def padded_inputs(lengths, heads, head_dim):
    shape = (len(lengths), heads, max(lengths), head_dim)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]


FLEX: dict = {}


def flex_document(lengths, causal):
    """Compiled flex_attention over (1, H, total, d) with a block mask of the documents."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in FLEX:
        torch._dynamo.config.cache_size_limit = 256
        torch._functorch.config.donated_buffer = False
        FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda"))

    def mask_mod(b, h, qi, ki):
        same = doc[qi] == doc[ki]
        return same & (qi >= ki) if causal else same

    total = sum(lengths)
    block_mask = create_block_mask(mask_mod, None, None, total, total, device="cuda")
    return lambda q, k, v: FLEX["fn"](q, k, v, block_mask=block_mask)


def runner(impl, lengths, heads, head_dim, causal):
    """(fn() -> out, inputs needing grads) for one implementation."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import exattn

    if impl.startswith("exattn-varlen"):
        q, k, v, cu = packed_inputs(lengths, heads, head_dim)
        longest, validate = max(lengths), impl == "exattn-varlen"
        return (lambda: exattn.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal,
                                                validate=validate)), (q, k, v)
    if impl == "flex-document":
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in packed_inputs(lengths, heads, head_dim)[:3])
        q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
        fn = flex_document(lengths, causal)
        return (lambda: fn(q, k, v)), (q, k, v)
    q, k, v = padded_inputs(lengths, heads, head_dim)
    if impl == "exattn-padded":
        return (lambda: exattn.attention(q, k, v, causal=causal)), (q, k, v)

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return cudnn, (q, k, v)


def measure(impl, lengths, heads, head_dim, causal, args):
    """(fwd_ms, bwd_ms) medians of do_bench."""
    from triton.testing import do_bench

    fn, inputs = runner(impl, lengths, heads, head_dim, causal)
    out = fn()
    dout = torch.randn_like(out)
    out.backward(dout, retain_graph=True)
    torch.cuda.synchronize()
    fwd = do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
    bwd = do_bench(lambda: out.backward(dout, retain_graph=True), warmup=args.warmup_ms, rep=args.rep_ms,
                   grad_to_none=list(inputs), return_mode="median")
    return fwd, bwd


def extra_memory(lengths, heads, head_dim, causal) -> dict:
    """exattn-varlen's peak device memory beyond inputs, outputs and lse (forward), and beyond those and
    the gradients (forward + backward), in bytes and as a fraction of the inputs' bytes."""
    import exattn

    q, k, v, cu = packed_inputs(lengths, heads, head_dim)
    longest, inputs = max(lengths), 3 * q.numel() * q.element_size()
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = exattn.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    results = out.numel() * out.element_size() + lse.numel() * 4
    fwd_extra = torch.cuda.max_memory_allocated() - base - results
    torch.cuda.reset_peak_memory_stats()
    out.backward(dout)
    torch.cuda.synchronize()
    grads = sum(x.grad.numel() * x.grad.element_size() for x in (q, k, v))
    bwd_extra = torch.cuda.max_memory_allocated() - base - results - grads
    return dict(fwd_extra_bytes=fwd_extra, fwd_extra_fraction=fwd_extra / inputs,
                fwd_bwd_extra_bytes=bwd_extra, fwd_bwd_extra_fraction=bwd_extra / inputs, input_bytes=inputs)


def cells(args):
    for packing in args.packings.split(","):
        lengths = document_lengths(packing)
        for head_dim in (int(x) for x in args.head_dims.split(",")):
            for causal in (bool(int(x)) for x in args.causal.split(",")):
                yield packing, lengths, head_dim, causal


def cell_of(row) -> tuple:
    return row["packing"], row["head_dim"], row["causal"]


def table(rows) -> str:
    lines = ["| packing | d | causal | docs | exattn fwd | × padded exattn | × cuDNN padded | × Flex | "
             "exattn bwd | × padded exattn | × cuDNN padded | × Flex | validate=False fwd × padded exattn |",
             "|" + "---|" * 13]
    by = {(r["packing"], r["head_dim"], r["causal"], r["impl"]): r for r in rows}
    for (packing, d, causal, impl), r in by.items():
        if impl != "exattn-varlen":
            continue

        def ratio(other, key, mine=r):
            o = by.get((packing, d, causal, other))
            return f"{mine[key] / o[key]:.2f}" if o and o.get(key) and mine and mine.get(key) else "–"
        unvalidated = by.get((packing, d, causal, "exattn-varlen-unvalidated"))
        lines.append(f"| {packing} | {d} | {'yes' if causal else 'no'} | {r['documents']} | {r['fwd_tflops']:.0f} | "
                     + " | ".join(ratio(o, "fwd_tflops") for o in ANCHORS) + f" | {r['bwd_tflops']:.0f} | "
                     + " | ".join(ratio(o, "bwd_tflops") for o in ANCHORS) + " | "
                     + ratio("exattn-padded", "fwd_tflops", unvalidated) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    impls = args.impls.split(",")
    rows = []
    for packing, lengths, head_dim, causal in cells(args):
        heads = HIDDEN // head_dim
        samples = interleaved_rounds(impls, args.rounds,
                                     lambda impl: measure(impl, lengths, heads, head_dim, causal, args),
                                     lambda e: f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        flops = useful_flops(lengths, heads, head_dim, causal), useful_flops(lengths, heads, head_dim, causal, True)
        for impl in impls:
            row = dict(impl=impl, dtype="bf16", head_dim=head_dim, heads=heads, packing=packing, causal=causal,
                       total_tokens=sum(lengths), documents=len(lengths), max_len=max(lengths))
            got = samples.get(impl)
            if isinstance(got, str) or not got:
                row.update(fwd_tflops=None, bwd_tflops=None, fwd_ms=None, bwd_ms=None, error=got or "not run")
            else:
                fwd_ms = sorted(f for f, _ in got)[len(got) // 2]
                bwd_ms = sorted(b for _, b in got)[len(got) // 2]
                row.update(fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwd_tflops=flops[0] / fwd_ms / 1e9,
                           bwd_tflops=flops[1] / bwd_ms / 1e9, error=None,
                           fwd_ms_rounds=[f for f, _ in got], bwd_ms_rounds=[b for _, b in got])
            if impl == "exattn-varlen":
                row.update(extra_memory(lengths, heads, head_dim, causal))
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("impl", "packing", "head_dim", "causal", "fwd_tflops",
                                                  "bwd_tflops", "error")}), flush=True)
    meta = versions()
    if args.update and Path(args.out).exists():
        rows, meta = updated(json.loads(Path(args.out).read_text()), rows, meta, cell_of)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
