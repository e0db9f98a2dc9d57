"""Sequence parallelism across GPUs (NCCL) or CPU processes (gloo): ring, Ulysses or the hybrid, per device vs one.

Strategies (--strategy, comma-separated): "ring" (ring_attention, zigzag), "ulysses"
(ulysses_attention, contiguous shards) and "hybrid" (sequence_parallel_attention over a
(world / U, U) mesh, U = --ulysses). Each row: strategy, world, total_len, causal,
fwd_tflops_per_gpu, bwd_tflops_per_gpu, single_gpu_tflops, efficiency, peak_mem_gib,
single_gpu_peak_mem_gib, and the ledger's peak (ledger_peak_gib, the per-rank bytes
the strategy records, `exattn.distributed.MemoryLedger`) with the single-device
figure by the same rules. With --strategy, the default output is
sequence-parallel-<gpu>x<world>.json (sequence-parallel-h200x2.json on two H200s):

    export NCCL_NVLS_ENABLE=0
    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/ring.py --strategy ring,ulysses,hybrid \
        --lengths 32k,64k,128k,256k --out benchmarks/results
    # the same at world 2 on the CPU (gloo), a correctness and plumbing run:
    PYTHONPATH=src python benchmarks/ring.py --nproc 2 --device cpu --dtype float32 --strategy ring,ulysses,hybrid \
        --lengths 1k --heads 4 --dim 32 --check-len 128 --full-mem-max 0 --out /tmp

Two H200s (about 3-5 minutes; writes ring-h200x2.json):

    export NCCL_NVLS_ENABLE=0        # never NVLink multicast
    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/ring.py --out benchmarks/results

Four / eight GPUs, up to 1M tokens (issue 8):

    PYTHONPATH=src torchrun --nproc-per-node 4 benchmarks/ring.py --lengths 64k,128k,256k,512k --out benchmarks/results
    PYTHONPATH=src torchrun --nproc-per-node 8 benchmarks/ring.py --lengths 128k,256k,512k,1M --out benchmarks/results

CPU, gloo, eight processes (a correctness run at world size 8; CPU timings mean little):

    PYTHONPATH=src torchrun --nproc-per-node 8 benchmarks/ring.py --device cpu --dtype float32 \
        --lengths 2k --heads 2 --dim 64 --check-len 256 --out benchmarks/results

Without torchrun the script spawns --nproc processes itself. Each run first
checks ring attention against single-device exattn and the float64 oracle
(shared error rule, tests/error_rule.py) on a small shape, then times, for each
total length N on W devices: ring fwd+bwd (causal, default zigzag) on N/W
tokens per device, and single-device `exattn.attention` fwd+bwd at the per-device
length N/W. FLOPs: 4*B*H*N^2*D/2 per causal forward, x2.5 for backward; ring
per-device FLOPs = total / W; efficiency = per-device TFLOP/s / single-device TFLOP/s.

Memory (CUDA peak allocated of one fwd+bwd, inputs included): the ring's peak per
device (`peak_mem_gib`, the largest rank's) against rank 0 alone on the whole
sequence, both single-device exattn (`full_len_single_peak_mem_gib`) and the ring
of one process in its own group (`ring_w1_peak_mem_gib`); `mem_ratio_vs_full_single`
and `mem_ratio_vs_ring_w1` are peak * W over those: 1.0 means memory per device
falls exactly as 1/W. A failing configuration becomes a row of nulls with the
error. Rows are written as they finish.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import exattn  # noqa: E402
from common import attention_flops  # noqa: E402
from error_rule import FLOORS, max_abs_error  # noqa: E402
from exattn.distributed import (  # noqa: E402
    MemoryLedger, mesh_shard, ring_attention, sequence_parallel_attention, shard, single_device_ledger,
    ulysses_attention,
)
from exattn.distributed.ring import local_backend_name  # noqa: E402
from exattn.reference import attention_ref  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
GIB = 1024 ** 3


def parse_length(text: str) -> int:
    text = text.strip()
    factor = {"k": 1024, "K": 1024, "m": 1024 ** 2, "M": 1024 ** 2}.get(text[-1], 1)
    return int(text[:-1] if factor > 1 else text) * factor


def causal_flops(args, length: int, mode: str) -> float:
    """FLOPs of causal attention over `length` tokens: forward, or forward + backward (x3.5)."""
    forward = attention_flops(args.batch, args.heads, length, length, args.dim, causal=True)
    backward = attention_flops(args.batch, args.heads, length, length, args.dim, causal=True, backward=True)
    return forward + (backward if mode == "fwd_bwd" else 0.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_ok(ok: bool, device: torch.device) -> bool:
    return all_max(0.0 if ok else 1.0, device) == 0.0


def fwd_bwd(attend, q, k, v, dout):
    """(out, dq, dk, dv) of one forward and backward."""
    out = attend(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def seconds_per_call(fn, device, warmup: int, repeat: int, min_time: float) -> float:
    """Mean seconds of `fn` after warm-up, the slowest rank's; repeats until about `min_time` seconds."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    once = all_max(time.perf_counter() - start, device)
    repeat = max(repeat, min(1000, int(min_time / max(once, 1e-6))))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return all_max((time.perf_counter() - start) / repeat, device)


def local_peak_gib(fn, device) -> float | None:
    """Peak allocated memory of one call on this rank (inputs included); None off CUDA."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) / GIB


def peak_gib(fn, device) -> float | None:
    """Peak allocated memory of one call (inputs included), the largest rank's."""
    value = local_peak_gib(fn, device)
    return None if value is None else all_max(value, device)


def random_inputs(args, length: int, device, seed: int, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[args.dtype]
    shapes = [(args.batch, args.heads, length, args.dim), (args.batch, args.kv_heads, length, args.dim),
              (args.batch, args.kv_heads, length, args.dim), (args.batch, args.heads, length, args.dim)]
    xs = [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]
    return [x.requires_grad_(requires_grad and i < 3) for i, x in enumerate(xs)]


STRATEGIES = ("ring", "ulysses", "hybrid")


def hybrid_mesh(args, world: int, device):
    from torch.distributed.device_mesh import init_device_mesh

    uly = args.ulysses if world % args.ulysses == 0 else 1
    return init_device_mesh(device.type, (world // uly, uly), mesh_dim_names=("ring", "ulysses"))


def strategy_fns(strategy: str, args, rank: int, world: int, layout: str, mesh):
    """(attend(q, k, v, ledger=None), cut(full tensor) -> this rank's part) of one strategy."""
    if strategy == "ring":
        return (lambda q, k, v, ledger=None: ring_attention(q, k, v, causal=True, layout=layout, ledger=ledger),
                lambda x: shard(x, rank, world, layout))
    if strategy == "ulysses":
        return (lambda q, k, v, ledger=None: ulysses_attention(q, k, v, causal=True, ledger=ledger),
                lambda x: shard(x, rank, world, "contiguous"))
    return (lambda q, k, v, ledger=None: sequence_parallel_attention(q, k, v, mesh=mesh, causal=True,
                                                                     layout=layout, ledger=ledger),
            lambda x: mesh_shard(x, mesh, layout))


def check_against_oracle(args, attend, cut, device, row: dict, err_key: str = "err",
                         vs_single_key: str | None = None) -> dict:
    """attend (sharded by cut) vs single-device exattn vs the float64 oracle on the full tensors, with the
    shared rule; the errors go into row under out, dq, dk and dv (with the distance to single-device
    exattn's under vs_single_key, if given)."""
    q, k, v, dout = random_inputs(args, args.check_len, device, seed=1234)
    ours = fwd_bwd(attend, *[cut(x.detach()).requires_grad_() for x in (q, k, v)], cut(dout))
    single = fwd_bwd(lambda *t: exattn.attention(*t, causal=True), q, k, v, dout)
    naive = fwd_bwd(lambda *t: exattn.attention(*t, causal=True, backend="naive"), q, k, v, dout)
    full64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = fwd_bwd(lambda *t: attention_ref(*t, causal=True), *full64, dout.double())
    ok = True
    for name, a, s, n, r in zip(("out", "dq", "dk", "dv"), ours, single, naive, ref):
        s, n, r = (cut(x) for x in (s, n, r))
        floor = FLOORS[q.dtype] * max(1.0, float(r.abs().max()))
        errs = [all_max(max_abs_error(x, r), device) for x in (a, s, n)]
        bad = all_max(float(torch.isnan(a).any()), device) > 0
        passed = not bad and errs[0] <= 2 * errs[2] + floor
        row[name] = {err_key: errs[0], "err_single": errs[1], "err_naive": errs[2], "passed": passed}
        if vs_single_key:
            row[name][vs_single_key] = all_max(max_abs_error(a, s), device)
        ok &= passed
    row["passed"] = ok
    return row


def check_strategy(args, strategy: str, rank: int, world: int, device, mesh) -> dict:
    """One strategy against the oracle (`check_against_oracle`)."""
    attend, cut = strategy_fns(strategy, args, rank, world, args.layout, mesh)
    return check_against_oracle(args, attend, cut, device, {"strategy": strategy, "total_len": args.check_len})


def measure_strategy(args, strategy: str, total_len: int, rank: int, world: int, device, mesh) -> dict:
    """One row of the --strategy table: forward and backward TFLOP/s per GPU, memory, ledger."""
    n = total_len // world
    attend, _ = strategy_fns(strategy, args, rank, world, args.layout, mesh)
    q, k, v, dout = random_inputs(args, n, device, seed=rank)
    single = (lambda *t, ledger=None: exattn.attention(*t, causal=True))
    row = {"strategy": strategy, "world": world, "total_len": total_len, "per_gpu_len": n, "causal": True}
    if strategy == "hybrid":
        row["mesh"] = list(mesh.shape)
    timing = (device, args.warmup, args.repeat, args.min_time)
    times = {}
    for name, fn in (("sp", attend), ("single", single)):
        with torch.no_grad():
            times[f"{name}_fwd"] = seconds_per_call(lambda: fn(q, k, v), *timing)
        times[f"{name}_fwd_bwd"] = seconds_per_call(lambda: fwd_bwd(fn, q, k, v, dout), *timing)
    fwd_total = attention_flops(args.batch, args.heads, total_len, total_len, args.dim, causal=True)
    bwd_total = attention_flops(args.batch, args.heads, total_len, total_len, args.dim, causal=True, backward=True)
    fwd_local = attention_flops(args.batch, args.heads, n, n, args.dim, causal=True)
    bwd_local = attention_flops(args.batch, args.heads, n, n, args.dim, causal=True, backward=True)
    sp_bwd = max(times["sp_fwd_bwd"] - times["sp_fwd"], 1e-9)
    row["fwd_tflops_per_gpu"] = fwd_total / world / times["sp_fwd"] / 1e12
    row["bwd_tflops_per_gpu"] = bwd_total / world / sp_bwd / 1e12
    row["tflops_per_gpu"] = (fwd_total + bwd_total) / world / times["sp_fwd_bwd"] / 1e12
    row["single_gpu_tflops"] = (fwd_local + bwd_local) / times["single_fwd_bwd"] / 1e12
    row["efficiency"] = row["tflops_per_gpu"] / row["single_gpu_tflops"]
    row["peak_mem_gib"] = peak_gib(lambda: fwd_bwd(attend, q, k, v, dout), device)
    row["single_gpu_peak_mem_gib"] = peak_gib(lambda: fwd_bwd(single, q, k, v, dout), device)
    ledger = MemoryLedger()
    fwd_bwd(lambda *t: attend(*t, ledger=ledger), q, k, v, dout)
    rules = "triton" if device.type == "cuda" else "tiled"
    row["ledger_peak_gib"] = all_max(ledger.peak / GIB, device)
    row["ledger_single_gib"] = single_device_ledger(q, k, v, rules).peak / GIB
    row["ledger_ratio"] = row["ledger_peak_gib"] / row["ledger_single_gib"]
    return row


def check(args, layout: str, rank: int, world: int, device) -> dict:
    """Ring against the oracle (`check_against_oracle`), with its distance to single-device exattn."""
    attend, cut = strategy_fns("ring", args, rank, world, layout, None)
    return check_against_oracle(args, attend, cut, device, {"layout": layout, "total_len": args.check_len},
                                err_key="err_ring", vs_single_key="ring_vs_single")


def measure(args, total_len: int, rank: int, world: int, device) -> dict:
    """One row: ring on total_len / world tokens per device vs one device at that length."""
    n = total_len // world
    q, k, v, dout = random_inputs(args, n, device, seed=rank)
    attends = {
        "ring": lambda *t: ring_attention(*t, causal=True, layout=args.layout),
        "single": lambda *t: exattn.attention(*t, causal=True),
    }
    row = {"world": world, "total_len": total_len, "per_gpu_len": n}
    timing = (device, args.warmup, args.repeat, args.min_time)
    for name, attend in attends.items():
        with torch.no_grad():
            row[f"{name}_fwd_ms"] = 1e3 * seconds_per_call(lambda: attend(q, k, v), *timing)
        row[f"{name}_ms"] = 1e3 * seconds_per_call(lambda: fwd_bwd(attend, q, k, v, dout), *timing)
        peak_key = "peak_mem_gib" if name == "ring" else "single_peak_mem_gib"
        row[peak_key] = peak_gib(lambda: fwd_bwd(attend, q, k, v, dout), device)
    for suffix, mode in (("", "fwd_bwd"), ("_fwd", "fwd")):
        total, local = causal_flops(args, total_len, mode), causal_flops(args, n, mode)
        row[f"per_gpu{suffix}_tflops"] = total / world / (row[f"ring{suffix}_ms"] * 1e-3) / 1e12
        row[f"single_gpu{suffix}_tflops"] = local / (row[f"single{suffix}_ms"] * 1e-3) / 1e12
        efficiency_key = "efficiency" if mode == "fwd_bwd" else "fwd_efficiency"
        row[efficiency_key] = row[f"per_gpu{suffix}_tflops"] / row[f"single_gpu{suffix}_tflops"]
    return row


FULL_LEN_KEYS = ("full_len_single_peak_mem_gib", "ring_w1_peak_mem_gib")


def full_length_peaks(args, total_len: int, rank: int, device, solo) -> dict:
    """Rank 0 alone on the whole sequence: peak of exattn fwd+bwd and of the ring of one process
    (`solo`, rank 0's own group): the two baselines for memory falling as 1/W."""
    peaks = dict.fromkeys(FULL_LEN_KEYS)
    if rank == 0:
        q, k, v, dout = random_inputs(args, total_len, device, seed=7)
        attends = (lambda *t: exattn.attention(*t, causal=True),
                   lambda *t: ring_attention(*t, causal=True, layout=args.layout, group=solo))
        for key, attend in zip(FULL_LEN_KEYS, attends):
            peaks[key] = local_peak_gib(lambda: fwd_bwd(attend, q, k, v, dout), device)
    return peaks


def memory_ratios(row: dict) -> dict:
    """peak per device * W over each whole-sequence baseline (1.0 = memory falls as 1/W)."""
    ratios = {}
    for key, name in zip(FULL_LEN_KEYS, ("mem_ratio_vs_full_single", "mem_ratio_vs_ring_w1")):
        ok = row.get("peak_mem_gib") is not None and row.get(key)
        ratios[name] = row["peak_mem_gib"] * row["world"] / row[key] if ok else None
    return ratios


NULL_ROW_KEYS = ("ring_ms", "single_ms", "per_gpu_tflops", "single_gpu_tflops", "efficiency",
                 "peak_mem_gib", "single_peak_mem_gib", "ring_fwd_ms", "single_fwd_ms",
                 "per_gpu_fwd_tflops", "single_gpu_fwd_tflops", "fwd_efficiency")


def guarded(fn, device, fallback):
    """fn() on every rank; if any rank fails, every rank returns fallback with the error text."""
    try:
        value, error = fn(), None
    except Exception as exc:  # a failing config becomes a null row, not a crash
        value, error = None, f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not all_ok(error is None, device):
        return fallback(error or "failed on another rank")
    return value


def environment(args, device, world: int) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    env = {"device": name, "world": world, "torch": torch.__version__, "exattn": exattn.__version__,
           "python": platform.python_version(), "backend_dist": dist.get_backend(),
           "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        version = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    shape_keys = ("batch", "heads", "kv_heads", "dim", "dtype", "layout", "warmup", "repeat", "min_time")
    env.update({k: getattr(args, k) for k in shape_keys})
    env["causal"] = True
    env["flops"] = "4*B*H*N^2*D/2 per causal fwd, x2.5 bwd; ring per-device = total/world"
    return env


def output_path(args, device, world: int) -> Path:
    if args.name:
        return Path(args.out) / args.name
    if device.type == "cuda":
        tag = "h200" if "H200" in torch.cuda.get_device_name(device) else "gpu"
    else:
        tag = "cpu"
    return Path(args.out) / f"ring-{tag}x{world}.json"


def run(args) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=args.timeout))
    else:
        torch.set_num_threads(max(1, args.threads))
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    if args.strategy:
        run_strategies(args, rank, world, device, use_cuda)
        return
    probe = random_inputs(args, max(2, args.check_len // world), device, seed=0, requires_grad=False)
    report = {"env": environment(args, device, world),
              "local_backend": local_backend_name(*probe[:3], True, args.dim ** -0.5),
              "single_backend": exattn.explain_backend(*probe[:3], causal=True).name,
              "checks": [], "rows": []}
    path = output_path(args, device, world)

    def save():
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=2))
            print(f"wrote {path}", flush=True)

    for layout in dict.fromkeys((args.layout, "contiguous")):
        result = guarded(lambda: check(args, layout, rank, world, device), device,
                         lambda e: {"layout": layout, "passed": False, "error": e})
        report["checks"].append(result)
        if rank == 0:
            print(json.dumps(result), flush=True)
    save()
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    if use_cuda and report["local_backend"] != "triton":
        report["note"] = "the triton backend cannot serve these inputs; timing only lengths <= 16k with tiled"
        lengths = [n for n in lengths if n <= 16384]
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    for total_len in lengths:
        null_row = {"world": world, "total_len": total_len, **dict.fromkeys(NULL_ROW_KEYS)}
        row = guarded(lambda: measure(args, total_len, rank, world, device), device,
                      lambda e: {**null_row, "error": e})
        row.update(dict.fromkeys(FULL_LEN_KEYS))
        if use_cuda and total_len <= parse_length(args.full_mem_max):
            row.update(guarded(lambda: full_length_peaks(args, total_len, rank, device, solo), device,
                               lambda e: {"full_len_error": e}))
        row.update(memory_ratios(row))
        report["rows"].append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        save()
    dist.barrier()
    dist.destroy_process_group()


STRATEGY_NULL_KEYS = ("fwd_tflops_per_gpu", "bwd_tflops_per_gpu", "tflops_per_gpu", "single_gpu_tflops",
                      "efficiency", "peak_mem_gib", "single_gpu_peak_mem_gib", "ledger_peak_gib",
                      "ledger_single_gib", "ledger_ratio")


def run_strategies(args, rank: int, world: int, device, use_cuda: bool) -> None:
    """--strategy: check, then time every strategy at every length; rows written as they finish."""
    strategies = [s.strip() for s in args.strategy.split(",")]
    for s in strategies:
        if s not in STRATEGIES:
            raise SystemExit(f"--strategy takes {STRATEGIES}, got {s!r}")
    mesh = hybrid_mesh(args, world, device) if "hybrid" in strategies else None
    report = {"env": environment(args, device, world), "checks": [], "rows": []}
    report["env"]["strategies"] = strategies
    if mesh is not None:
        report["env"]["hybrid_mesh"] = list(mesh.shape)
    if args.name:
        path = Path(args.out) / args.name
    else:
        tag = ("h200" if "H200" in torch.cuda.get_device_name(device) else "gpu") if use_cuda else "cpu"
        path = Path(args.out) / f"sequence-parallel-{tag}x{world}.json"

    def save():
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=2))
            print(f"wrote {path}", flush=True)

    for strategy in strategies:
        result = guarded(lambda: check_strategy(args, strategy, rank, world, device, mesh), device,
                         lambda e: {"strategy": strategy, "passed": False, "error": e})
        report["checks"].append(result)
        if rank == 0:
            print(json.dumps(result), flush=True)
    save()
    for total_len in [parse_length(x) for x in args.lengths.split(",")]:
        for strategy in strategies:
            null_row = {"strategy": strategy, "world": world, "total_len": total_len, "causal": True,
                        **dict.fromkeys(STRATEGY_NULL_KEYS)}
            row = guarded(lambda: measure_strategy(args, strategy, total_len, rank, world, device, mesh), device,
                          lambda e: {**null_row, "error": e})
            report["rows"].append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
            save()
    dist.barrier()
    dist.destroy_process_group()


def markdown_table(path: str) -> str:
    """The rows of a results file as a markdown table, for docs/performance.md."""
    report = json.loads(Path(path).read_text())
    env = report["env"]
    if "strategies" in env:
        return strategy_table(report)
    lines = [f"{env['device']} x{env['world']}, torch {env['torch']}, triton {env.get('triton')}, "
             f"{env['dtype']}, B={env['batch']}, H={env['heads']}, Hk={env['kv_heads']}, D={env['dim']}, "
             f"causal {env['layout']}, local backend {report['local_backend']}; checks passed: "
             f"{all(c.get('passed') for c in report['checks'])}", "",
             "| world | total len | per-GPU len | ring TFLOP/s per GPU | single TFLOP/s | efficiency "
             "| fwd efficiency | peak GiB per GPU | single at full len GiB | ring W=1 at full len GiB "
             "| peak x W / single full | peak x W / ring W=1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(x, spec):
        return "n/a" if x is None else format(x, spec)

    for r in report["rows"]:
        lines.append(
            f"| {r['world']} | {r['total_len']} | {r.get('per_gpu_len', r['total_len'] // r['world'])} "
            f"| {fmt(r.get('per_gpu_tflops'), '.3g')} | {fmt(r.get('single_gpu_tflops'), '.3g')} "
            f"| {fmt(r.get('efficiency'), '.1%')} | {fmt(r.get('fwd_efficiency'), '.1%')} "
            f"| {fmt(r.get('peak_mem_gib'), '.2f')} | {fmt(r.get('full_len_single_peak_mem_gib'), '.2f')} "
            f"| {fmt(r.get('ring_w1_peak_mem_gib'), '.2f')} | {fmt(r.get('mem_ratio_vs_full_single'), '.2f')} "
            f"| {fmt(r.get('mem_ratio_vs_ring_w1'), '.2f')} |")
    return "\n".join(lines)


def strategy_table(report: dict) -> str:
    env = report["env"]

    def fmt(x, spec):
        return "n/a" if x is None else format(x, spec)

    lines = [f"{env['device']} x{env['world']}, torch {env['torch']}, {env['dtype']}, B={env['batch']}, "
             f"H={env['heads']}, Hk={env['kv_heads']}, D={env['dim']}, causal, layout {env['layout']}; checks "
             f"passed: {all(c.get('passed') for c in report['checks'])}", "",
             "| strategy | world | total len | fwd TFLOP/s per GPU | bwd TFLOP/s per GPU | single TFLOP/s "
             "| efficiency | peak GiB | single GiB | ledger peak / single |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(
            f"| {r['strategy']} | {r['world']} | {r['total_len']} | {fmt(r.get('fwd_tflops_per_gpu'), '.3g')} "
            f"| {fmt(r.get('bwd_tflops_per_gpu'), '.3g')} | {fmt(r.get('single_gpu_tflops'), '.3g')} "
            f"| {fmt(r.get('efficiency'), '.1%')} | {fmt(r.get('peak_mem_gib'), '.2f')} "
            f"| {fmt(r.get('single_gpu_peak_mem_gib'), '.2f')} | {fmt(r.get('ledger_ratio'), '.2f')} |")
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run(args)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="32k,64k,128k,256k", help="total sequence lengths, e.g. 32k,64k,1M")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3, help="timed calls at least")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls at least")
    p.add_argument("--check-len", type=int, default=4096, help="total length of the correctness check")
    p.add_argument("--full-mem-max", default="256k", help="measure single-device memory at the full length up to this")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per process on CPU")
    p.add_argument("--timeout", type=int, default=300, help="seconds before a stuck collective fails")
    p.add_argument("--nproc", type=int, default=None, help="processes to spawn without torchrun")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default=None, help="output file name, default ring-<gpu>x<world>.json")
    p.add_argument("--strategy", default=None,
                   help="comma-separated ring,ulysses,hybrid: the sequence-parallel table (see the top)")
    p.add_argument("--ulysses", type=int, default=2, help="Ulysses size U of the hybrid's (world / U, U) mesh")
    p.add_argument("--table", default=None, metavar="JSON", help="print a results file as markdown and exit")
    args = p.parse_args(argv)
    if args.table:
        print(markdown_table(args.table))
        return
    args.kv_heads = args.kv_heads or args.heads
    args.dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(args.dtype, args.dtype)
    if "RANK" in os.environ:
        run(args)
        return
    world = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() and args.device != "cpu" else 2)
    mp.spawn(spawned, args=(world, free_port(), args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
