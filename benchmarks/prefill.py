"""Prefill throughput on a GPU, FlashAttention's convention: exattn-triton vs SDPA and FlexAttention.

batch * seqlen = 16k tokens, hidden 2048 (heads = 2048 / head_dim); seqlen
1k..16k, head dim 64 and 128, causal off/on, bf16 and fp16. Forward and
backward TFLOP/s with FLOPs = 4*B*H*N^2*D (halved for causal, x2.5 backward),
timed with `triton.testing.do_bench` (median), `--rounds` times per cell with
the implementations interleaved (rows keep the median). Implementations, in the same
run: exattn "triton" (deterministic, the default), SDPA's cuDNN, flash and
efficient backends, and FlexAttention under torch.compile; with
`--impls ...,exattn-triton-atomic` also exattn "triton" with
`settings.atomic_dq` (dQ by atomics: the variant the FlashAttention, cuDNN and
Flex backwards are); a "-head-major" suffix (exattn-triton-head-major,
exattn-triton-atomic-head-major) runs causal work tiles in plain head-major
order instead of `schedule.heads_per_group`'s, exattn-triton-two-kernel the
deterministic backward with its dQ kernel everywhere (`settings.ordered_dq`
off), exattn-triton-ordered the ordered dQ wherever it fits (any length
of the Gluon backward), and exattn-triton-rotated / exattn-triton-unrotated the
ordered dQ with `settings.rotated_dq_order` True / False, for A/B runs. A failing implementation gives a row of
nulls with the error. Compilation (exattn kernels, FlexAttention graphs) is
first warmed in parallel worker processes sharing the on-disk caches.

    PYTHONPATH=src python3 benchmarks/prefill.py --out benchmarks/results/prefill-h200.json

--flex-dtypes caps which dtypes FlexAttention is compiled for (its compile
is slow); cells left out are rows with "skipped" as the error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import attention_flops, interleaved_rounds, result_rows, size_label, updated  # noqa: E402

IMPLS = ("exattn-triton", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "flex")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOKENS = 16384
HIDDEN = 2048


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--flex-dtypes", default="bf16,fp16")
    p.add_argument("--warmup-ms", type=float, default=25)
    p.add_argument("--rep-ms", type=float, default=100)
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="measurements of each implementation per cell, interleaved; rows keep the median")
    p.add_argument("--workers", type=int, default=12, help="processes that pre-compile in parallel (0: none)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/prefill-h200.json"))
    p.add_argument("--table", help="print the docs/performance.md table of a results file and exit")
    p.add_argument("--update", action="store_true",
                   help="replace only the measured cells' rows of an existing --out (its meta lists them)")
    return p.parse_args(argv)


def cells(args):
    for dtype in args.dtypes.split(","):
        for d in (int(x) for x in args.head_dims.split(",")):
            for causal in (bool(int(x)) for x in args.causal.split(",")):
                for n in (int(x) for x in args.seqlens.split(",")):
                    yield dict(dtype=dtype, head_dim=d, causal=causal, seqlen=n,
                               batch=max(1, TOKENS // n), heads=HIDDEN // d)


FLEX_CACHE: dict = {}


def flex_function(cell):
    """Compiled flex_attention and the block mask for this cell (None when not causal)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in FLEX_CACHE:
        # One static compile per shape; raise dynamo's limits so none falls back to eager.
        torch._dynamo.config.cache_size_limit = 256
        torch._dynamo.config.accumulated_cache_size_limit = 1024
        # The timed backward replays one graph (retain_graph=True): no donated buffers.
        torch._functorch.config.donated_buffer = False
        FLEX_CACHE["fn"] = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if cell["causal"]:
        n = cell["seqlen"]
        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n, device="cuda")
    fn = FLEX_CACHE["fn"]
    return lambda q, k, v: fn(q, k, v, block_mask=block_mask)


def attention_function(impl, cell):
    """(fn(q, k, v) -> out, context manager factory) for one implementation."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import exattn

    causal = cell["causal"]
    if impl.startswith("exattn-triton"):
        atomic, head_major, two_kernel = "-atomic" in impl, impl.endswith("-head-major"), "-two-kernel" in impl
        return (lambda q, k, v: exattn.attention(q, k, v, causal=causal, backend="triton")), (
            lambda: exattn_setting(atomic, head_major, two_kernel, ordered_everywhere=impl.endswith("-ordered"),
                                   rotated={"-rotated": True, "-unrotated": False}.get(impl[impl.rfind("-"):])))
    if impl == "flex":
        return flex_function(cell), contextlib.nullcontext
    backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION,
               "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[impl]
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), (
        lambda: sdpa_kernel([backend]))


@contextlib.contextmanager
def exattn_setting(atomic_dq: bool, head_major: bool, two_kernel: bool = False, ordered_everywhere: bool = False,
                   rotated: bool | None = None):
    """settings.atomic_dq; head_major: causal work tiles in head-major order (the order before
    `schedule.heads_per_group`, for A/B runs); two_kernel: settings.ordered_dq off;
    ordered_everywhere: the ordered dQ for every length of the Gluon backward where it fits;
    rotated: settings.rotated_dq_order."""
    from exattn.backends.triton import gluon_backward, schedule, settings

    saved = (settings.atomic_dq, settings.ordered_dq, settings.rotated_dq_order, schedule.heads_per_group,
             gluon_backward.ORDERED_DQ_MIN_LEN)
    settings.atomic_dq = atomic_dq
    settings.ordered_dq = not two_kernel
    settings.rotated_dq_order = rotated
    if head_major:
        schedule.heads_per_group = lambda *args: 1
    if ordered_everywhere:
        gluon_backward.ORDERED_DQ_MIN_LEN = 1
    try:
        yield
    finally:
        (settings.atomic_dq, settings.ordered_dq, settings.rotated_dq_order, schedule.heads_per_group,
         gluon_backward.ORDERED_DQ_MIN_LEN) = saved


def make_inputs(cell):
    dtype = DTYPES[cell["dtype"]]
    shape = (cell["batch"], cell["heads"], cell["seqlen"], cell["head_dim"])
    return [torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]


def measure(impl, cell, warmup_ms, rep_ms):
    """(fwd_ms, bwd_ms) medians for one implementation and cell."""
    from triton.testing import do_bench

    q, k, v = make_inputs(cell)
    fn, context = attention_function(impl, cell)
    with context():
        out = fn(q, k, v)
        dout = torch.randn_like(out)
        out.backward(dout, retain_graph=True)
        torch.cuda.synchronize()
        fwd = do_bench(lambda: fn(q, k, v), warmup=warmup_ms, rep=rep_ms, return_mode="median")
        bwd = do_bench(lambda: out.backward(dout, retain_graph=True), warmup=warmup_ms, rep=rep_ms,
                       grad_to_none=[q, k, v], return_mode="median")
    return fwd, bwd


def warm_one(job):
    """Worker: run one (impl, cell) once so its kernels land in the on-disk caches."""
    impl, cell = job
    try:
        q, k, v = make_inputs(cell)
        fn, context = attention_function(impl, cell)
        with context():
            out = fn(q, k, v)
            out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # the timed run reports failures
        return f"{impl} {cell}: {type(exc).__name__}"


def prewarm(jobs, workers, warm=warm_one):
    """Run `warm(job)` for every job in `workers` spawned processes (shared on-disk kernel caches)."""
    if workers <= 0 or not jobs:
        return
    start = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        failures = [f for f in pool.imap_unordered(warm, jobs) if f]
    print(f"pre-compiled {len(jobs)} jobs in {time.time() - start:.0f}s with {workers} workers; "
          f"{len(failures)} failed", flush=True)


def versions() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"),
    }


def timed_rounds(impls, cell, args) -> dict:
    """{impl: [(fwd_ms, bwd_ms), ...] or an error string}: `args.rounds` interleaved rounds
    (`common.interleaved_rounds`)."""
    skipped = {}
    if "flex" in impls and cell["dtype"] not in args.flex_dtypes.split(","):
        skipped["flex"] = "skipped (--flex-dtypes)"
    return interleaved_rounds(list(impls), args.rounds, lambda impl: measure(impl, cell, args.warmup_ms, args.rep_ms),
                              describe_failure, skipped)


def describe_failure(exc: Exception) -> str:
    traceback.print_exc(limit=2)
    torch.cuda.empty_cache()
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def row_for(impl, cell, samples):
    """The results row of one implementation and cell: the medians of its rounds (`timed_rounds`)."""
    row = dict(impl=impl, **cell, fwd_tflops=None, bwd_tflops=None, fwd_ms=None, bwd_ms=None, error=None)
    if isinstance(samples, str):
        row["error"] = samples
        return row
    fwd_ms, bwd_ms = (statistics.median(times) for times in zip(*samples))
    sizes = (cell["batch"], cell["heads"], cell["seqlen"], cell["seqlen"], cell["head_dim"], cell["causal"])
    row.update(fwd_ms=fwd_ms, bwd_ms=bwd_ms,
               fwd_tflops=attention_flops(*sizes) / fwd_ms * 1e-9,
               bwd_tflops=attention_flops(*sizes, backward=True) / bwd_ms * 1e-9,
               fwd_ms_rounds=[f for f, _ in samples], bwd_ms_rounds=[b for _, b in samples])
    return row


def doc_table(rows) -> str:
    """The docs/performance.md table: one line per cell, forward and backward side by side."""
    index = {(r["impl"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"]): r for r in rows}
    atomic = any(r["impl"] == "exattn-triton-atomic" for r in rows)
    lines = ["| dtype | d | causal | N | exattn fwd | cuDNN fwd | × cuDNN | × Flex | × FA2 "
             "| exattn bwd | cuDNN bwd | × cuDNN | × Flex | × FA2 |" + (" atomic dQ bwd | × cuDNN |" if atomic else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if atomic else "")]

    def ratio(a, b):
        return "–" if a is None or b is None else f"{a / b:.2f}"

    for key, ours in index.items():
        if key[0] != "exattn-triton":
            continue
        cols = [key[1], str(key[2]), "yes" if key[3] else "no", size_label(key[4])]
        for pass_ in ("fwd", "bwd"):
            col = f"{pass_}_tflops"
            cudnn, flex, fa2 = (index.get((impl,) + key[1:], {}).get(col)
                                for impl in ("sdpa-cudnn", "flex", "sdpa-flash"))
            x = ours[col]
            cols += ["–" if x is None else f"{x:.0f}", "–" if cudnn is None else f"{cudnn:.0f}",
                     ratio(x, cudnn), ratio(x, flex), ratio(x, fa2)]
        if atomic:
            x = index.get(("exattn-triton-atomic",) + key[1:], {}).get("bwd_tflops")
            cudnn = index.get(("sdpa-cudnn",) + key[1:], {}).get("bwd_tflops")
            cols += ["–" if x is None else f"{x:.0f}", ratio(x, cudnn)]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.table:
        print(doc_table(result_rows(args.table)))
        return
    impls = args.impls.split(",")
    all_cells = list(cells(args))
    jobs = [(impl, cell) for cell in all_cells for impl in impls
            if impl.startswith("exattn-triton") or (impl == "flex" and cell["dtype"] in args.flex_dtypes.split(","))]
    prewarm(jobs, args.workers)
    meta = versions()
    print(json.dumps(meta), flush=True)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(out_path.read_text()) if args.update and out_path.exists() else None
    rows = kept_rows = []
    for cell in all_cells:
        samples = timed_rounds(impls, cell, args)
        for impl in impls:
            row = row_for(impl, cell, samples[impl])
            rows.append(row)
            print(f"{impl:15s} {cell['dtype']} d={cell['head_dim']} causal={int(cell['causal'])} "
                  f"N={cell['seqlen']:5d} fwd={row['fwd_tflops'] or 0:6.1f} bwd={row['bwd_tflops'] or 0:6.1f} "
                  f"{row['error'] or ''}", flush=True)
        kept_rows, kept_meta = (rows, meta) if existing is None else updated(existing, rows, meta, cell_of)
        out_path.write_text(json.dumps({"meta": kept_meta, "rows": kept_rows}, indent=1) + "\n")
    print(doc_table(kept_rows))


def cell_of(row) -> tuple:
    return row["dtype"], row["head_dim"], row["causal"], row["seqlen"]


if __name__ == "__main__":
    main()
