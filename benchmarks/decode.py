"""Decoding throughput: exattn.decode against SDPA (cuDNN, flash) and compiled FlexAttention, same run.

    python benchmarks/decode.py [--batches 1,8,64] [--contexts 1024,8192,32768,131072]
                                [--page-sizes 16,256] [--impls exattn,sdpa_cudnn,sdpa_flash,flex]
                                [--table-modes shared,rotated] [--rounds 3] [--deadline-s 240]
                                [--sweep [--sweep-shapes 8x131072,1x8192x16] [--sweep-configs 64:4:2,...]
                                         [--sweep-splits 1,2,4]] [--out benchmarks/results/decode-h200.json]
    python benchmarks/decode.py --table benchmarks/results/decode-h200.json   # the docs table
    python benchmarks/decode.py --rules plain,window,softcap,sinks --batches 1,8,64 --contexts 32768,131072 \
                                --impls exattn --page-sizes "" --out decode-rules.json    # score rules

One new token (Nq = 1), bf16, Hq = 32, Hk = 8, D = 128, every sequence at the full context.
The figure of merit is KV bytes read per second, 2 (K, V) x B x Hk x context x D x 2 bytes
over the time of one call, the same count for every implementation (SDPA and Flex get
the un-expanded K/V with enable_gqa=True). Paged caches (shuffled pages) run only through
exattn; SDPA and Flex have no paged layout, so `paged` rows compare with the contiguous
anchors. Each paged shape runs with one block table shared by the rotated pools ("shared":
the layers of a decode step share the sequences' table, as they share `cache_seqlens`)
and with a table per pool ("rotated": every call reads its table from HBM). Timing: the
calls of one configuration are captured in a CUDA graph, replayed back to back in windows
of at least 1 ms, and the median replay time divided by the calls; on contiguous caches
each implementation is timed in `--rounds` interleaved rounds (the order reversed every
other round) and a row keeps their median; small caches rotate among copies (>= 256 MB
in all) so that each call reads from HBM, not L2 (as a decode step over many layers
does). Configurations that do not fit in memory, fail, or run past the deadline give
rows with tbps/ms null and a note. Goal
(issue 5): >= 1.0x cuDNN at every shape; >= 4.5 TB/s at 128k; >= 3.5 TB/s at batch 1,
128k; paged >= 0.95x contiguous.

`--rules` (a comma list of plain, window, softcap, sinks; default none) also times exattn on
contiguous caches with each score rule: window = (4096, 0), softcap 50, sinks random float32 (Hq,),
in interleaved rounds with the plain kernel (always timed). Their rows carry `rule`, the
`keys` a call reads (a window reads min(context, 4097) keys a sequence, and its TB/s counts
those), `plain_tbps` (the plain kernel's TB/s in the same rounds) and `vs_plain`
(= tbps / plain_tbps; goal >= 0.97 at 32k-128k). A window row also carries `vs_plain_same_keys`:
its TB/s over that of the plain kernel on a cache of as many keys as the window reads, timed in the
same rounds (reading 4097 keys of a 128k cache is judged against reading a 4097-key cache).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

import exattn
from common import interleaved_rounds, size_label

HEADS_Q, HEADS_K, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
ROTATE_BYTES = 256 * 2**20
MAX_COPIES = 64
RESULTS = Path(__file__).parent / "results"


def kv_bytes(batch: int, context: int) -> int:
    return 2 * batch * HEADS_K * context * HEAD_DIM * DTYPE.itemsize


def versions(device) -> dict:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "exattn": exattn.__version__,
            "python": platform.python_version(), "dtype": "bfloat16",
            "heads_q": HEADS_Q, "heads_k": HEADS_K, "head_dim": HEAD_DIM, "len_q": 1}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, sms=props.multi_processor_count,
                    cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    else:
        info.update(device="cpu (smoke run)")
    return info


# ---------------------------------------------------------------- timing

def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(calls, device, budget_ms=60.0, window_ms=1.0, warmup_ms=150.0) -> tuple[float, str]:
    """Median ms of one call, the calls run back to back (a CUDA graph where it captures).

    Each timed window replays the graph back to back until it spans `window_ms`, so that
    the gap between recording the start event and the first replay reaching the GPU
    (the host's graph launch) is not counted as the calls' time. Replays for `warmup_ms`
    come first, untimed: right after its caches were allocated, B = 64 at 128k with paged
    caches read 3.95-3.99 TB/s for the first ~100 ms and 4.51-4.59 after, in every layout
    (measured on the H200)."""
    def run_all():
        for call in calls:
            call()

    run_all()
    synchronize(device)
    if device.type != "cuda":
        start = time.perf_counter()
        run_all()
        return (time.perf_counter() - start) * 1e3 / len(calls), "host clock"
    replay, mode = run_all, "stream"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_all()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_all()
        replay, mode = graph.replay, "cuda graph"
    except Exception as error:  # noqa: BLE001 - time without a graph, and say so
        mode = f"stream (graph capture failed: {type(error).__name__})"
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    replay()
    end.record()
    end.synchronize()
    once_ms = max(start.elapsed_time(end), 1e-3)
    for _ in range(min(10_000, int(warmup_ms / once_ms))):
        replay()
    replays = max(1, min(100, math.ceil(window_ms / once_ms)))
    reps = max(3, min(50, int(budget_ms / (once_ms * replays))))
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(replays):
            replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times) / len(calls), mode


# ---------------------------------------------------------------- implementations

def sdpa_call(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    chosen = {}

    def call(q, k, v):
        """enable_gqa=True; if the backend refuses it, Hk < Hq heads as they are (cuDNN reads them natively)."""
        with sdpa_kernel(backend):
            if "gqa" not in chosen:
                try:
                    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    chosen["gqa"] = True
                    return out
                except RuntimeError:
                    chosen["gqa"] = False
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=chosen["gqa"])

    return call


FLEX = {}


def flex_call():
    if "fn" not in FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        for limit in ("recompile_limit", "cache_size_limit"):  # one compile per shape, never eager
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, 256)
        FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    fn = FLEX["fn"]
    return lambda q, k, v: fn(q, k, v, enable_gqa=True)


def exattn_call(lens, table=None):
    return lambda q, k, v: exattn.decode(q, k, v, cache_seqlens=lens, block_table=table, validate=False)


ANCHORS = {"sdpa_cudnn": lambda: sdpa_call("CUDNN_ATTENTION"),
           "sdpa_flash": lambda: sdpa_call("FLASH_ATTENTION"),
           "flex": flex_call}


# ---------------------------------------------------------------- caches

def copies_for(batch, context) -> int:
    return max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / kv_bytes(batch, context))))


def fits(batch, context, copies, device, factor=1.3) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return kv_bytes(batch, context) * copies * factor < free


def contiguous_caches(batch, context, copies, device):
    shape = (batch, HEADS_K, context, HEAD_DIM)
    return [(torch.randn(shape, dtype=DTYPE, device=device), torch.randn(shape, dtype=DTYPE, device=device))
            for _ in range(copies)]


TABLE_MODES = ("shared", "rotated", "identity")
TABLE_LABELS = {"shared": "one table", "rotated": "a table per pool", "identity": "pages in order"}


def paged_caches(batch, context, page_size, copies, device, seed=0, table_mode="shared"):
    """Pools of pages and their block tables: a shuffled table per pool ("rotated"),
    one shuffled table for every pool ("shared": one decode step's layers share the
    sequences' table), or pages in order ("identity", a diagnostic)."""
    pages = math.ceil(context / page_size)
    shape = (batch * pages, HEADS_K, page_size, HEAD_DIM)
    g = torch.Generator().manual_seed(seed)

    def table():
        order = torch.arange(batch * pages) if table_mode == "identity" else torch.randperm(batch * pages, generator=g)
        return order.view(batch, pages).to(torch.int32).to(device)

    shared = table()
    caches = []
    for _ in range(copies):
        caches.append((torch.randn(shape, dtype=DTYPE, device=device), torch.randn(shape, dtype=DTYPE, device=device),
                       table() if table_mode == "rotated" else shared))
    return caches


# ---------------------------------------------------------------- measuring

class Rows:
    """Result rows, rewritten to disk after each one (a killed run keeps what it measured)."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.meta, self.rows = path, meta, []

    def add(self, impl, batch, context, paged, page_size, ms, note="", table=None, keys=None, **extra):
        """keys: the keys a call reads per sequence, for the TB/s (default: the context)."""
        tbps = None if ms is None else kv_bytes(batch, keys or context) / (ms * 1e-3) / 1e12
        if keys is not None:
            extra["keys"] = keys
        row = dict(impl=impl, batch=batch, context=context, paged=paged, page_size=page_size,
                   table=table, tbps=tbps, ms=ms, note=note, **extra, **self.meta)
        self.rows.append(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.rows, indent=1) + "\n")
        shown = "null" if ms is None else f"{tbps:5.2f} TB/s {ms:8.4f} ms"
        label = f"{impl}:{extra['rule']}" if extra.get("rule") else impl
        print(f"{label:<14} B={batch:<3} ctx={context:<7} paged={page_size or '-':<4} {table or '':<7} {shown}  {note}",
              flush=True)

    def get(self, impl, batch, context, page_size=None, table=None):
        return find_row(self.rows, impl, batch, context, page_size, table)


def find_row(rows, impl, batch, context, page_size=None, table=None):
    """The row of one measurement (not the `--rules` rows); paged rows of files from before the table
    modes had a table per pool."""
    for row in rows:
        if row.get("rule") is not None:
            continue
        mode = row.get("table", "rotated") if row["page_size"] else None
        if (row["impl"], row["batch"], row["context"], row["page_size"], mode) == (
                impl, batch, context, page_size, table if page_size else None):
            return row
    return None


def measure(rows, impl, batch, context, page_size, calls, device, note="", table=None):
    try:
        ms, mode = time_calls(calls, device)
        rows.add(impl, batch, context, page_size is not None, page_size, ms, f"{mode}; {note}".strip("; "), table)
    except Exception as error:  # noqa: BLE001 - a failing implementation is a null row
        rows.add(impl, batch, context, page_size is not None, page_size, None, failure(error), table)
        synchronize(device)


def failure(error: Exception) -> str:
    if os.environ.get("DECODE_BENCH_TRACE"):
        traceback.print_exc()
    return f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"


def max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def run_contiguous(rows, batch, context, impls, device, deadline, rounds=1):
    """Each implementation timed `rounds` times, rounds interleaved (reversed every other round);
    a row keeps the median and every round's ms."""
    copies = copies_for(batch, context)
    if not fits(batch, context, copies, device):
        for impl in impls:
            rows.add(impl, batch, context, False, None, None, "skipped: does not fit in GPU memory")
        return
    caches = contiguous_caches(batch, context, copies, device)
    q = torch.randn(batch, HEADS_Q, 1, HEAD_DIM, dtype=DTYPE, device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    ours = exattn.decode(q, *caches[0], cache_seqlens=lens)
    timed = {}
    for impl in impls:
        if time.time() > deadline:
            rows.add(impl, batch, context, False, None, None, "not run: past the deadline")
            continue
        make = (lambda: exattn_call(lens)) if impl == "exattn" else ANCHORS[impl]
        try:
            fn = make()
            check = fn(q, *caches[0])
            note = "" if impl == "exattn" else f"max|diff| vs exattn {max_diff(check, ours):.2e}"
        except Exception as error:  # noqa: BLE001
            rows.add(impl, batch, context, False, None, None, failure(error))
            synchronize(device)
            continue
        timed[impl] = ([lambda k=k, v=v, fn=fn: fn(q, k, v) for k, v in caches], f"{copies} caches rotated; {note}")
    samples = timed_rounds({impl: calls for impl, (calls, _) in timed.items()}, device, rounds)
    for impl, (_, note) in timed.items():
        if isinstance(samples[impl], str):
            rows.add(impl, batch, context, False, None, None, samples[impl])
            continue
        ms_rounds = [ms for ms, _ in samples[impl]]
        rows.add(impl, batch, context, False, None, statistics.median(ms_rounds),
                 f"{samples[impl][0][1]}; {note}".strip("; "), ms_rounds=ms_rounds)
    del caches
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_rounds(calls_by_impl, device, rounds):
    """impl -> [(ms, mode) per round], or a failure note (`common.interleaved_rounds`)."""
    def failed(error):
        synchronize(device)
        return failure(error)

    return interleaved_rounds(list(calls_by_impl), rounds, lambda impl: time_calls(calls_by_impl[impl], device), failed)


def run_paged(rows, batch, context, page_size, device, deadline, table_mode="shared"):
    copies = copies_for(batch, context)
    if time.time() > deadline:
        rows.add("exattn", batch, context, True, page_size, None, "not run: past the deadline", table_mode)
        return
    if not fits(batch, context, copies, device):
        rows.add("exattn", batch, context, True, page_size, None, "skipped: does not fit in GPU memory", table_mode)
        return
    caches = paged_caches(batch, context, page_size, copies, device, table_mode=table_mode)
    q = torch.randn(batch, HEADS_Q, 1, HEAD_DIM, dtype=DTYPE, device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    calls = [lambda k=k, v=v, t=t: exattn.decode(q, k, v, cache_seqlens=lens, block_table=t, validate=False)
             for k, v, t in caches]
    exattn.decode(q, *caches[0][:2], cache_seqlens=lens, block_table=caches[0][2])  # validated once
    measure(rows, "exattn", batch, context, page_size, calls, device, f"{copies} caches rotated; {table_mode} tables",
            table_mode)
    del caches, calls
    if device.type == "cuda":
        torch.cuda.empty_cache()


RULES = ("plain", "window", "softcap", "sinks")
RULE_WINDOW = 4096
RULE_SOFTCAP = 50.0


def rule_arguments(rule: str, device) -> dict:
    """`exattn.decode` keywords of one `--rules` entry."""
    if rule == "window":
        return dict(window=(RULE_WINDOW, 0))
    if rule == "softcap":
        return dict(softcap=RULE_SOFTCAP)
    if rule == "sinks":
        return dict(sinks=torch.randn(HEADS_Q, dtype=torch.float32, device=device))
    return {}


def keys_read(rule: str, context: int) -> int:
    return min(context, RULE_WINDOW + 1) if rule == "window" else context


SAME_KEYS = "plain over the window's keys"


def decode_calls(q, caches, lens, kwargs: dict) -> list:
    """One unvalidated `exattn.decode` call per cache copy, after one validated call."""
    exattn.decode(q, *caches[0], cache_seqlens=lens, **kwargs)
    return [lambda k=k, v=v: exattn.decode(q, k, v, cache_seqlens=lens, validate=False, **kwargs) for k, v in caches]


def run_rules(rows, batch, context, rules, device, deadline, rounds=1):
    """exattn with each score rule and plain, contiguous caches, in interleaved rounds; each row keeps the
    median and the plain kernel's TB/s of the same rounds. Where the window reads fewer keys than the
    context, the plain kernel over a cache of that many keys runs in the same rounds too, and the window's
    row also keeps its TB/s (`plain_same_keys_tbps`) and the ratio to it (`vs_plain_same_keys`)."""
    names = ["plain"] + [rule for rule in rules if rule != "plain"]
    copies = copies_for(batch, context)
    if time.time() > deadline or not fits(batch, context, copies, device):
        note = "not run: past the deadline" if time.time() > deadline else "skipped: does not fit in GPU memory"
        for rule in names:
            rows.add("exattn", batch, context, False, None, None, note, rule=rule, keys=keys_read(rule, context))
        return
    caches = contiguous_caches(batch, context, copies, device)
    q = torch.randn(batch, HEADS_Q, 1, HEAD_DIM, dtype=DTYPE, device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    calls = {rule: decode_calls(q, caches, lens, rule_arguments(rule, device)) for rule in names}
    window_keys = keys_read("window", context)
    if "window" in names and window_keys < context:  # the plain kernel over as many keys of the same caches
        calls[SAME_KEYS] = decode_calls(q, caches, torch.full_like(lens, window_keys), {})
    samples = timed_rounds(calls, device, rounds)
    plain = samples["plain"]
    plain_tbps = None if isinstance(plain, str) else kv_bytes(batch, context) / (statistics.median(
        ms for ms, _ in plain) * 1e-3) / 1e12
    for rule in names:
        keys = keys_read(rule, context)
        if isinstance(samples[rule], str):
            rows.add("exattn", batch, context, False, None, None, samples[rule], rule=rule, keys=keys)
            continue
        ms_rounds = [ms for ms, _ in samples[rule]]
        ms = statistics.median(ms_rounds)
        tbps = kv_bytes(batch, keys) / (ms * 1e-3) / 1e12
        extra = {}
        if rule == "window" and not isinstance(samples.get(SAME_KEYS, ""), str):
            same = kv_bytes(batch, keys) / (statistics.median(ms for ms, _ in samples[SAME_KEYS]) * 1e-3) / 1e12
            extra = dict(plain_same_keys_tbps=same, vs_plain_same_keys=tbps / same)
        rows.add("exattn", batch, context, False, None, ms, f"{samples[rule][0][1]}; {copies} caches rotated",
                 rule=rule, keys=keys, plain_tbps=plain_tbps, vs_plain=tbps / plain_tbps if plain_tbps else None,
                 ms_rounds=ms_rounds, **extra)
    del caches, calls
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rules_summary(rows, rules):
    print("\nexattn TB/s with each score rule (vs the plain kernel in the same rounds)")
    print(f"{'B':>3} {'ctx':>7} {'plain':>7} " + " ".join(f"{rule:>15}" for rule in rules if rule != "plain"))
    shapes = sorted({(r["batch"], r["context"]) for r in rows.rows if r.get("rule") is not None})
    for batch, context in shapes:
        found = {r["rule"]: r for r in rows.rows if r.get("rule") and (r["batch"], r["context"]) == (batch, context)}
        plain = found.get("plain", {}).get("tbps")
        cells = [f"{batch:>3} {context:>7} {plain or float('nan'):7.2f}"]
        for rule in rules:
            if rule != "plain":
                row = found.get(rule, {})
                cells.append(f"{row.get('tbps') or float('nan'):6.2f} ({row.get('vs_plain') or float('nan'):5.3f}x)")
                if row.get("vs_plain_same_keys"):
                    cells.append(f"[{row['vs_plain_same_keys']:5.3f}x plain over {row['keys']} keys]")
        print(" ".join(cells))


SWEEP_CONFIGS = "64:4:2,128:4:2,128:4:3,64:4:4,128:8:3,32:4:4"


def parse_configs(spec: str):
    """'BLOCK_N:WARPS:STAGES,...' -> DecodeConfigs (block_m 16: G = 4 query rows)."""
    from exattn.backends.triton.decode_kernel import DecodeConfig

    return [DecodeConfig(16, *(int(n) for n in item.split(":"))) for item in filter(None, spec.split(","))]


def parse_shape(spec: str):
    """'BxCONTEXT[xPAGE_SIZE][@S1/S2/...]' -> (batch, context, page_size or None, split counts or None)."""
    dims, _, splits = spec.partition("@")
    batch, context, *page = (int(n) for n in dims.split("x"))
    return batch, context, page[0] if page else None, [int(n) for n in splits.split("/")] if splits else None


def sweep(path, device, deadline, shapes, configs, split_spec="", table_mode="shared"):
    """Kernel configurations and split counts at a few shapes (for tuning; not the headline rows).

    The default configuration and plan run first; a shape's own split counts, else
    `split_spec` ("plan": the planned count only; empty: 0.5, 1, 2 and 3 x the plan)."""
    from exattn.backends.triton.decode_kernel import decode_forward
    from exattn.decode import make_decode_problem, triton_plan

    results = []
    for batch, context, page_size, shape_splits in shapes:
        copies = copies_for(batch, context)
        if page_size:
            caches = paged_caches(batch, context, page_size, copies, device, table_mode=table_mode)
        else:
            caches = [(k, v, None) for k, v in contiguous_caches(batch, context, copies, device)]
        q = torch.randn(batch, HEADS_Q, 1, HEAD_DIM, dtype=DTYPE, device=device)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        problem = make_decode_problem(q, caches[0][0], caches[0][1], lens, caches[0][2], None, 0, False)
        default, planned = triton_plan(problem)
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        if shape_splits or split_spec not in ("", "plan"):
            split_counts = shape_splits or [int(x) for x in split_spec.split(",")]
        else:
            split_counts = [planned] if split_spec else sorted({max(1, planned // 2), planned, planned * 2, planned * 3})
        for config in [default] + [c for c in configs if c != default]:
            for splits in split_counts:
                if time.time() > deadline:
                    break
                programs = batch * HEADS_K * math.ceil(HEADS_Q // HEADS_K / config.block_m)
                merged = config._replace(merge_in_split=splits > 1 and programs * splits > num_sms)  # as plan_launch
                calls = [lambda k=k, v=v, t=t, c=merged, n=splits:
                         decode_forward(q, k, v, lens, t, HEAD_DIM ** -0.5, n, c) for k, v, t in caches]
                try:
                    ms, _ = time_calls(calls, device, budget_ms=30)
                except Exception as error:  # noqa: BLE001
                    ms = None
                    print("sweep failure", config, splits, type(error).__name__, str(error)[:200])
                tbps = None if ms is None else kv_bytes(batch, context) / (ms * 1e-3) / 1e12
                results.append(dict(batch=batch, context=context, page_size=page_size,
                                    table=table_mode if page_size else None,
                                    config=merged._asdict(), splits=splits, default=merged == default
                                    and splits == planned, ms=ms, tbps=tbps))
                print(f"sweep B={batch} ctx={context} page={page_size} {tuple(config)} splits={splits}"
                      f"{'*' if splits == planned else ' '} "
                      f"{'null' if ms is None else f'{tbps:.2f} TB/s {ms:.4f} ms'}", flush=True)
        del caches
        path.write_text(json.dumps(results, indent=1) + "\n")


def summary(rows, batches, contexts, page_sizes, table_modes):
    print("\nimpl TB/s (ratio exattn / anchor)")
    paged_columns = [(p, mode) for mode in table_modes for p in page_sizes]
    header = f"{'B':>3} {'ctx':>7} {'exattn':>7} " + " ".join(
        f"{name:>14}" for name in ("cudnn", "flash", "flex")) + " " + " ".join(
        f"{f'paged{p} {mode}':>13}" for p, mode in paged_columns)
    print(header)
    for batch in batches:
        for context in contexts:
            ours = rows.get("exattn", batch, context)
            ours_tbps = ours and ours["tbps"]
            cells = [f"{batch:>3} {context:>7} {ours_tbps or float('nan'):7.2f}"]
            for impl in ("sdpa_cudnn", "sdpa_flash", "flex"):
                row = rows.get(impl, batch, context)
                tbps = row and row["tbps"]
                ratio = ours_tbps / tbps if ours_tbps and tbps else float("nan")
                cells.append(f"{tbps or float('nan'):6.2f} ({ratio:4.2f}x)")
            for page_size, mode in paged_columns:
                row = rows.get("exattn", batch, context, page_size, mode)
                tbps = row and row["tbps"]
                ratio = tbps / ours_tbps if ours_tbps and tbps else float("nan")
                cells.append(f"{tbps or float('nan'):5.2f} ({ratio:4.2f}x)")
            print(" ".join(cells))


def markdown_table(path: Path) -> str:
    """The docs table from a results file: TB/s and ms per shape, ratios to each anchor."""
    rows = json.loads(path.read_text())
    modes = [m for m in TABLE_MODES if any(r.get("table", "rotated") == m for r in rows if r["page_size"])]
    paged_columns = [(p, mode) for mode in modes for p in sorted({r["page_size"] for r in rows if r["page_size"]})]
    shapes = sorted({(r["batch"], r["context"]) for r in rows})
    head = ["B", "context", "exattn TB/s (ms)", "vs cuDNN", "vs flash", "vs Flex"]
    head += [f"paged {p}, {TABLE_LABELS[mode]} TB/s (vs contiguous)" for p, mode in paged_columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def tbps(impl, batch, context, page=None, mode=None):
        row = find_row(rows, impl, batch, context, page, mode)
        return row and row["tbps"]

    for batch, context in shapes:
        ours = find_row(rows, "exattn", batch, context)
        ours_tbps = ours and ours["tbps"]
        cells = [str(batch), size_label(context),
                 f"{ours_tbps:.2f} ({ours['ms']:.4f})" if ours_tbps else "n/a"]
        for impl in ("sdpa_cudnn", "sdpa_flash", "flex"):
            theirs = tbps(impl, batch, context)
            cells.append(f"{ours_tbps / theirs:.2f}x ({theirs:.2f})" if ours_tbps and theirs else "n/a")
        for page, mode in paged_columns:
            paged_tbps = tbps("exattn", batch, context, page, mode)
            cells.append(f"{paged_tbps:.2f} ({paged_tbps / ours_tbps:.2f}x)" if paged_tbps and ours_tbps else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--contexts", default="1024,8192,32768,131072")
    parser.add_argument("--page-sizes", default="16,256")
    parser.add_argument("--impls", default="exattn,sdpa_cudnn,sdpa_flash,flex")
    parser.add_argument("--deadline-s", type=float, default=240.0, help="stop starting measurements after this")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="contiguous shapes: interleaved rounds per implementation; rows keep the median")
    parser.add_argument("--sweep", action="store_true", help="also time kernel configs and split counts")
    parser.add_argument("--sweep-shapes", default="1x131072,8x32768,8x32768x16,8x32768x256",
                        help="BxCONTEXT[xPAGE_SIZE][@SPLITS/SPLITS/...],...")
    parser.add_argument("--sweep-s", type=float, default=45.0, help="time for the sweep, after the rest")
    parser.add_argument("--sweep-default-only", action="store_true",
                        help="sweep only split counts, with the default kernel configuration")
    parser.add_argument("--sweep-configs", default=SWEEP_CONFIGS, help="BLOCK_N:WARPS:STAGES,... besides the default")
    parser.add_argument("--sweep-splits", default="",
                        help="split counts, or 'plan' (default: 0.5, 1, 2, 3 x the plan)")
    parser.add_argument("--sweep-out", help="sweep results (default: the --out name with -sweep)")
    parser.add_argument("--table-modes", default="shared,rotated",
                        help=f"paged caches, any of {','.join(TABLE_MODES)}: one block table for every rotated pool, "
                             "a table per pool, or pages in order (the sweep takes the first)")
    parser.add_argument("--no-main", action="store_true", help="skip the main table (with --sweep or --rules)")
    parser.add_argument("--rules", default="",
                        help=f"also time exattn with each score rule, any of {','.join(RULES)} (the plain kernel "
                             "is always timed with them)")
    parser.add_argument("--out", default=str(RESULTS / "decode-h200.json"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--table", help="print the markdown table of a results file and exit")
    args = parser.parse_args()
    if args.table:
        print(markdown_table(Path(args.table)))
        return
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.empty(1, device=device)
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    page_sizes = [int(x) for x in args.page_sizes.split(",") if x]
    impls = args.impls.split(",")
    table_modes = args.table_modes.split(",")
    if not set(table_modes) <= set(TABLE_MODES):
        parser.error(f"--table-modes must be among {','.join(TABLE_MODES)}, got {args.table_modes}")
    rules = [rule for rule in args.rules.split(",") if rule]
    if not set(rules) <= set(RULES):
        parser.error(f"--rules must be among {','.join(RULES)}, got {args.rules}")
    deadline = time.time() + args.deadline_s
    rows = Rows(Path(args.out), versions(device))
    torch.manual_seed(0)
    first = [impl for impl in impls if impl != "flex"]  # flex compiles per shape: measured last
    rule_shapes = [(batch, context) for batch in batches for context in contexts] if rules else []
    if args.no_main:
        batches, impls, first = [], [], []
    for batch in batches:
        for context in contexts:
            run_contiguous(rows, batch, context, first, device, deadline, args.rounds)
            for mode in table_modes:
                for page_size in page_sizes:
                    run_paged(rows, batch, context, page_size, device, deadline, mode)
    if "flex" in impls:  # the anchor table's batch first
        for batch in sorted(batches, key=lambda b: (b != 8, b)):
            for context in contexts:
                run_contiguous(rows, batch, context, ["flex"], device, deadline, args.rounds)
    if batches:
        summary(rows, batches, contexts, page_sizes, table_modes)
    for batch, context in rule_shapes:
        run_rules(rows, batch, context, rules, device, deadline, args.rounds)
    if rule_shapes:
        rules_summary(rows, rules)
    if args.sweep:
        shapes = [parse_shape(shape) for shape in args.sweep_shapes.split(",")]
        sweep_path = Path(args.sweep_out or Path(args.out).with_name(Path(args.out).stem + "-sweep.json"))
        configs = [] if args.sweep_default_only else parse_configs(args.sweep_configs)
        sweep(sweep_path, device, time.time() + args.sweep_s, shapes, configs, args.sweep_splits, table_modes[0])


if __name__ == "__main__":
    main()
