"""Host (CPU) time per eager call on a GPU, and the first call of a new shape family.

Short attention calls leave the GPU waiting on Python: what a call costs is then its
host time. For each implementation (exattn, SDPA cuDNN, SDPA flash, compiled Flex) and
call it times the CPU seconds per call with the GPU kept busy (a queue of large matmuls
enqueued first, the calls back to back, one synchronize at the end), so no call waits
on the device. --repeats interleaved rounds each time one run of --calls calls of every
row (every other round in reverse order), so the host's drift between seconds reaches
every row alike: a row is the median of its runs, and its ratio to SDPA cuDNN's call of
the same kind (`x_cudnn`; decode rows against cuDNN's decode) and, for exattn's
validated decode rows, to the same call with validate=False (`x_unvalidated`) are the
medians of the per-round ratios.

Calls: `fwd` (no grad) and `fwd_bwd` (forward with grad, then backward) at bf16,
B = 4, H = 16, N = 1k, d = 128, causal; `decode` (one new token, B = 8, Hq = 32, Hk = 8,
d = 128, 16k keys, `cache_seqlens` given, default arguments) and `decode_paged` (the
same over 256-key pages with a block table: exattn only; SDPA and Flex have no paged
cache); for exattn also `decode_unvalidated` and `decode_paged_unvalidated`
(`validate=False`), the CUDA-graph setting.

First call (--first-call, each implementation in a fresh process with empty Triton and
Inductor caches): seconds of the first forward + backward at N = 1k (bf16, d = 128, causal)
and then of the first at N = 2k (a second length of the same family), each synchronized.

    PYTHONPATH=src python3 benchmarks/host.py --out benchmarks/results/host-h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import interleaved_rounds  # noqa: E402
from prefill import attention_function, versions  # noqa: E402

IMPLS = ("exattn", "sdpa-cudnn", "sdpa-flash", "flex")
CALLS = ("fwd", "fwd_bwd", "decode", "decode_paged")
PREFILL = dict(dtype="bf16", head_dim=128, causal=True, seqlen=1024)
PREFILL_SHAPE = (4, 16, 1024, 128)
DECODE_BATCH, DECODE_HEADS_Q, DECODE_HEADS_K, DECODE_KEYS, PAGE = 8, 32, 8, 16384, 256


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--calls-to-time", default=",".join(CALLS), help="which calls (fwd, fwd_bwd, decode, decode_paged)")
    p.add_argument("--calls", type=int, default=100, help="calls per timed run")
    p.add_argument("--repeats", type=int, default=7, help="interleaved rounds")
    p.add_argument("--first-call", action="store_true", help="also time the first call, a fresh process per impl")
    p.add_argument("--profile", action="store_true", help="print a cProfile of exattn's fwd_bwd calls")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/host-h200.json"))
    p.add_argument("--first-call-child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def busy_gpu(seconds: float) -> None:
    """Enqueue about `seconds` of matmuls, so calls enqueued after them never wait on the device."""
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(max(1, int(seconds / 0.0016))):  # ~1.6 ms per 8k^3 bf16 matmul on an H200
        big @ big


def host_us_per_call(step, calls: int) -> float:
    """CPU µs per step() over `calls` calls while the GPU works through a queue."""
    busy_gpu(calls * 1.5e-3)
    start = time.perf_counter()
    for _ in range(calls):
        step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def interleaved_host_us(steps: dict, calls: int, repeats: int) -> dict:
    """{(impl, call): [µs per call, one per round] or a note}: after one untimed call of each step,
    `interleaved_rounds` of `host_us_per_call`."""
    ready = {}
    for name, step in steps.items():
        try:
            step()
            ready[name] = step
        except Exception as exc:  # an anchor that cannot run this call keeps a row saying why
            ready[name] = f"{type(exc).__name__}: {exc}"[:200]
    torch.cuda.synchronize()
    runnable = [name for name, step in ready.items() if not isinstance(step, str)]
    samples = interleaved_rounds(runnable, repeats, lambda name: host_us_per_call(ready[name], calls),
                                 lambda exc: f"{type(exc).__name__}: {exc}"[:200])
    return {name: samples.get(name, ready[name]) for name in steps}


def anchor_of(impl: str, call: str) -> tuple[tuple[str, str], ...]:
    """The rows a row's per-round ratios are taken against: ("x_cudnn", (impl, call)), ...."""
    kind = "decode" if call.startswith("decode") else call
    anchors = [("x_cudnn", ("sdpa-cudnn", kind))]
    if impl == "exattn" and call in ("decode", "decode_paged"):
        anchors.append(("x_unvalidated", ("exattn", f"{call}_unvalidated")))
    return tuple(anchors)


def rows_of(samples: dict) -> list[dict]:
    rows = []
    for (impl, call), runs in samples.items():
        if isinstance(runs, str):
            rows.append(dict(impl=impl, call=call, host_us=None, note=runs))
            continue
        row = dict(impl=impl, call=call, host_us=round(statistics.median(runs), 1), runs_us=[round(x, 1) for x in runs])
        for name, anchor in anchor_of(impl, call):
            other = samples.get(anchor)
            if anchor != (impl, call) and isinstance(other, list):
                row[name] = round(statistics.median(mine / theirs for mine, theirs in zip(runs, other)), 3)
        rows.append(row)
    return rows


def prefill_steps(impl: str, seqlen: int = 1024):
    """{"fwd": step, "fwd_bwd": step} for one implementation."""
    cell = dict(PREFILL, seqlen=seqlen)
    fn, context = attention_function("exattn-triton" if impl == "exattn" else impl, cell)
    shape = (*PREFILL_SHAPE[:2], seqlen, PREFILL_SHAPE[3])
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def forward():
        with context(), torch.no_grad():
            fn(q, k, v)

    def forward_backward():
        with context():
            fn(q, k, v).backward(dout)

    return {"fwd": forward, "fwd_bwd": forward_backward}


def decode_inputs():
    q = torch.randn(DECODE_BATCH, DECODE_HEADS_Q, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(DECODE_BATCH, DECODE_HEADS_K, DECODE_KEYS, 128, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    lens = torch.full((DECODE_BATCH,), DECODE_KEYS, dtype=torch.int32, device="cuda")
    pages = DECODE_KEYS // PAGE
    table = torch.randperm(DECODE_BATCH * pages, device="cuda").view(DECODE_BATCH, pages).to(torch.int32)
    paged = [x.view(DECODE_BATCH, DECODE_HEADS_K, pages, PAGE, 128).permute(0, 2, 1, 3, 4)
             .reshape(DECODE_BATCH * pages, DECODE_HEADS_K, PAGE, 128) for x in (k, v)]
    return q, k, v, lens, table, paged


def decode_steps(impl: str) -> dict:
    """{call: step}: exattn's decode (validated by default, and with validate=False), contiguous and
    paged; the anchors' attention of one token over the contiguous cache."""
    q, k, v, lens, table, (k_pages, v_pages) = decode_inputs()
    if impl == "exattn":
        import exattn

        def call(keys, values, block_table, validate=True):
            return lambda: exattn.decode(q, keys, values, cache_seqlens=lens, block_table=block_table,
                                         validate=validate)

        return {"decode": call(k, v, None), "decode_unvalidated": call(k, v, None, False),
                "decode_paged": call(k_pages, v_pages, table),
                "decode_paged_unvalidated": call(k_pages, v_pages, table, False)}
    if impl == "flex":
        from decode import flex_call

        fn = flex_call()
        return {"decode": lambda: fn(q, k, v)}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}[impl]

    def sdpa():
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return {"decode": sdpa}


def steps_for(impl: str, wanted: set[str]) -> dict:
    steps = {}
    if wanted & {"fwd", "fwd_bwd"}:
        steps.update({c: s for c, s in prefill_steps(impl).items() if c in wanted})
    if wanted & {"decode", "decode_paged"}:
        steps.update({c: s for c, s in decode_steps(impl).items() if c.removesuffix("_unvalidated") in wanted})
    return steps


def profile_text(step, calls: int) -> str:
    profile = cProfile.Profile()
    profile.runcall(lambda: [step() for _ in range(calls)])
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def first_call_seconds(impl: str) -> dict:
    """In this (fresh) process: seconds of the first fwd+bwd at N = 1k, then at N = 2k."""
    timings = {}
    for seqlen in (1024, 2048):
        step = prefill_steps(impl, seqlen)["fwd_bwd"]
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        timings[f"first_{seqlen}_s"] = time.perf_counter() - start
    return timings


def first_call_in_fresh_process(impl: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=f"{cache}/triton", TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor")
        done = subprocess.run([sys.executable, __file__, "--first-call-child", impl], env=env,
                              capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    args = parse_args(argv)
    if args.first_call_child:
        torch.randn(1, device="cuda")  # the CUDA context is not the kernels' first-call cost
        print(json.dumps(first_call_seconds(args.first_call_child)))
        return
    impls, wanted = args.impls.split(","), set(args.calls_to_time.split(","))
    first_calls, profile = {}, ""
    steps = {(impl, call): step for impl in impls for call, step in steps_for(impl, wanted).items()}
    rows = rows_of(interleaved_host_us(steps, args.calls, args.repeats))
    for row in rows:
        ratios = "  ".join(f"{k} {row[k]:.2f}" for k in ("x_cudnn", "x_unvalidated") if k in row)
        got = f"{row['host_us']:8.1f} us host per call" if row["host_us"] is not None else row["note"]
        print(f"{row['impl']:11s} {row['call']:26s} {got}  {ratios}", flush=True)
    if args.profile and "exattn" in impls:
        profile = profile_text(prefill_steps("exattn")["fwd_bwd"], args.calls)
        print(profile)
    if args.first_call:
        for impl in impls:
            first_calls[impl] = first_call_in_fresh_process(impl)
            print(f"{impl:11s} first call {first_calls[impl]}", flush=True)
    meta = dict(versions(), prefill=dict(PREFILL, shape=PREFILL_SHAPE),
                decode=dict(batch=DECODE_BATCH, heads_q=DECODE_HEADS_Q, heads_k=DECODE_HEADS_K, keys=DECODE_KEYS,
                            page_size=PAGE, dtype="bf16", head_dim=128),
                calls=args.calls, repeats=args.repeats)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "first_call": first_calls,
                                          "profile": profile}, indent=1) + "\n")


if __name__ == "__main__":
    main()
