"""Forward TFLOP/s of the Gluon (sm_90) kernel against exattn's Triton forward, SDPA and FlexAttention.

FlashAttention's convention, as benchmarks/prefill.py: batch * seqlen = 16k
tokens, hidden 2048 (heads = 2048 / head_dim), bf16 (`--dtypes`); seqlen 4k, 8k, 16k;
head dim 64 and 128; causal off/on. FLOPs = 4*B*H*N^2*D, halved for causal,
`triton.testing.do_bench` median. In the same run: "gluon"
(`gluon_forward.gluon_forward`), "exattn-triton" (the raw pass
`passes.triton_forward`), SDPA's cuDNN and flash backends, and compiled
FlexAttention (inputs with requires_grad, as in prefill.py). `--variants`
adds Gluon rows with other tiles for one head dim: "dim:BLOCK_NxSTAGES", then
"w3" for three consumer warpgroups (192 query rows per program), "pp" for the
ping-pong schedule, "ps" for a persistent grid (one program per SM) and "ol" for one key-tile
loop per warpgroup (`GluonConfig.one_key_loop`), e.g.
"128:128x3,128:128x2pp,64:128x2w3pp,128:128x2ps,64:128x2w3ol".

    PYTHONPATH=src python3 benchmarks/gluon_forward.py --out $OUT/gluon-forward-h200.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import attention_flops  # noqa: E402
from prefill import attention_function, cells, make_inputs, prewarm, versions  # noqa: E402

IMPLS = ("gluon", "exattn-triton", "sdpa-cudnn", "sdpa-flash", "flex")
ANCHORS = ("sdpa-cudnn", "flex", "exattn-triton")


def parse_benchmark_args(argv, description: str, variants_help: str, out_name: str):
    """The options shared by the Gluon forward and backward benchmarks."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", default="4096,8192,16384")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--variants", default="", help=f"extra Gluon configs: {variants_help}")
    p.add_argument("--warmup-ms", type=float, default=25)
    p.add_argument("--rep-ms", type=float, default=100)
    p.add_argument("--workers", type=int, default=12, help="processes that pre-compile in parallel (0: none)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results" / out_name))
    return p.parse_args(argv)


def parse_args(argv=None):
    return parse_benchmark_args(argv, __doc__, "'dim:BLOCK_NxSTAGES[w3][pp][ps][ol],...'", "gluon-forward-h200.json")


def variant(spec: str):
    """'64:128x2w3pp' -> (64, GluonConfig(block_n=128, stages=2, pingpong=True, consumers=3)); then 'ps'
    makes it persistent and 'ol' gives it one key-tile loop."""
    import re

    from exattn.backends.triton.gluon_forward import GluonConfig

    found = re.fullmatch(r"(\d+):(\d+)x(\d+)(?:w(\d+))?(pp)?(ps)?(ol)?", spec)
    if found is None:
        raise ValueError(f"--variants: {spec!r} is not 'dim:BLOCK_NxSTAGES[wN][pp][ps][ol]'")
    dim, block_n, stages, consumers, pingpong, persistent, one_key_loop = found.groups()
    return int(dim), GluonConfig(int(block_n), int(stages), bool(pingpong), int(consumers or 2), bool(persistent),
                                 bool(one_key_loop))


def impl_names(args) -> list[str]:
    return args.impls.split(",") + [f"gluon:{spec}" for spec in filter(None, args.variants.split(","))]


def forward_function(impl: str, cell):
    """(fn(q, k, v), context manager factory) for one implementation, or None if it does not apply."""
    import contextlib

    from exattn.backends.triton import gluon_forward as gf
    from exattn.backends.triton.passes import triton_forward
    from exattn.problem import AttentionParams

    params = AttentionParams(scale=cell["head_dim"] ** -0.5, window=(-1, 0) if cell["causal"] else (-1, -1))
    if impl.startswith("gluon"):
        if impl.startswith("gluon:"):
            dim, cfg = variant(impl[len("gluon:"):])
            if dim != cell["head_dim"]:
                return None
            gf.CONFIGS[dim] = cfg
        return (lambda q, k, v: gf.gluon_forward(q, k, v, params)), contextlib.nullcontext
    if impl == "exattn-triton":
        return (lambda q, k, v: triton_forward(q, k, v, None, params)), contextlib.nullcontext
    return attention_function(impl, cell)


def restore_configs(saved):
    from exattn.backends.triton import gluon_forward as gf

    gf.CONFIGS.clear()
    gf.CONFIGS.update(saved)


def measure(impl, cell, warmup_ms, rep_ms):
    from triton.testing import do_bench

    from exattn.backends.triton import gluon_forward as gf

    saved = dict(gf.CONFIGS)
    try:
        found = forward_function(impl, cell)
        if found is None:
            return None
        fn, context = found
        q, k, v = make_inputs(cell)
        with context():
            fn(q, k, v)
            torch.cuda.synchronize()
            return do_bench(lambda: fn(q, k, v), warmup=warmup_ms, rep=rep_ms, return_mode="median")
    finally:
        restore_configs(saved)


def warm_with(measure, job):
    """Worker: run one (impl, cell) once so its kernels land in the on-disk caches."""
    impl, cell = job
    try:
        measure(impl, cell, 1, 1)
        return None
    except Exception as exc:  # the timed run reports failures
        return f"{impl} {cell}: {type(exc).__name__}"


def row_for(impl, cell, args, measure, pass_name: str):
    """One result row: `{pass_name}_ms` and `{pass_name}_tflops` ("fwd" or "bwd"), or the error."""
    row = dict(impl=impl, **cell, error=None, **{f"{pass_name}_tflops": None, f"{pass_name}_ms": None})
    try:
        ms = measure(impl, cell, args.warmup_ms, args.rep_ms)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        traceback.print_exc(limit=2)
        torch.cuda.empty_cache()
        return row
    if ms is None:
        return None
    sizes = (cell["batch"], cell["heads"], cell["seqlen"], cell["seqlen"], cell["head_dim"], cell["causal"])
    flops = attention_flops(*sizes, backward=pass_name == "bwd")
    row.update({f"{pass_name}_ms": ms, f"{pass_name}_tflops": flops / ms * 1e-9})
    return row


def ratio_table(rows, pass_name: str) -> str:
    """Markdown: each Gluon row's TFLOP/s and its ratios to cuDNN, Flex and exattn's Triton pass."""
    index = {(r["impl"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"]): r[f"{pass_name}_tflops"]
             for r in rows}
    lines = ["| impl | dtype | d | causal | N | TFLOP/s | cuDNN | x cuDNN | Flex | x Flex | exattn-triton | x triton |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(x, ratio=False):
        return "-" if x is None else (f"{x:.2f}" if ratio else f"{x:.0f}")

    for (impl, dtype, d, causal, n), x in index.items():
        if not impl.startswith("gluon"):
            continue
        cols = []
        for anchor in ANCHORS:
            a = index.get((anchor, dtype, d, causal, n))
            cols += [fmt(a), fmt(x / a if x and a else None, ratio=True)]
        lines.append(f"| {impl} | {dtype} | {d} | {int(causal)} | {n} | {fmt(x)} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def run_benchmark(args, measure, pass_name: str) -> None:
    """Pre-compile, then time every (impl, cell) with `measure`; rows are written as they finish."""
    impls = impl_names(args)
    all_cells = list(cells(args))
    compiled = [(impl, cell) for cell in all_cells for impl in impls
                if impl.startswith("gluon") or impl in ("exattn-triton", "flex")]
    prewarm(compiled, args.workers, functools.partial(warm_with, measure))
    meta = versions()
    print(json.dumps(meta), flush=True)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for cell in all_cells:
        for impl in impls:
            row = row_for(impl, cell, args, measure, pass_name)
            if row is None:
                continue
            rows.append(row)
            print(f"{impl:22s} {cell['dtype']} d={cell['head_dim']} causal={int(cell['causal'])} N={cell['seqlen']:5d} "
                  f"{pass_name}={row[f'{pass_name}_tflops'] or 0:6.1f} {row['error'] or ''}", flush=True)
            out_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(ratio_table(rows, pass_name))


def main(argv=None):
    run_benchmark(parse_args(argv), measure, "fwd")


if __name__ == "__main__":
    main()
