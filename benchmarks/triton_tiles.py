"""Tile-configuration sweep of the exattn Triton kernels on one GPU: how configs.py's tables were chosen.

For bf16, N = 16k, B = 1, H = 2048 / d, d in (64, 128), causal off/on, it times
the forward under each forward candidate (tiles, warps, stages, TMA or
pointers, warp specialization) and the backward under each dK/dV and each
dQ candidate (the other kernel at its table entry), with SDPA cuDNN timed in
the same run as the anchor. The candidates are those left after a first,
wider round (which also timed the atomic-dQ variant) on the H200. They are
compiled first in parallel worker processes (shared Triton cache).

    PYTHONPATH=src python3 benchmarks/triton_tiles.py --out benchmarks/results/triton-tiles-h200.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import attention_flops  # noqa: E402

# Forward: (label, block_m, block_n, warps, stages, tma, warp_specialize), by head dim.
FORWARD = {
    64: [
        ("128x64 w4 s3", 128, 64, 4, 3, True, False),
        ("128x64 w4 s3 again", 128, 64, 4, 3, True, False),
        ("128x64 w4 s4", 128, 64, 4, 4, True, False),
        ("128x64 w4 s2", 128, 64, 4, 2, True, False),
        ("64x64 w4 s3", 64, 64, 4, 3, True, False),
        ("128x64 w4 s3 ptr", 128, 64, 4, 3, False, False),
        ("128x128 w8 s3", 128, 128, 8, 3, True, False),
        ("128x128 w8 s2", 128, 128, 8, 2, True, False),
        ("128x64 w8 s3", 128, 64, 8, 3, True, False),
    ],
    128: [
        ("128x64 w8 s3", 128, 64, 8, 3, True, False),
        ("128x64 w8 s3 again", 128, 64, 8, 3, True, False),
        ("128x64 w8 s4", 128, 64, 8, 4, True, False),
        ("128x64 w8 s2", 128, 64, 8, 2, True, False),
        ("64x64 w4 s3", 64, 64, 4, 3, True, False),
        ("64x64 w4 s4", 64, 64, 4, 4, True, False),
        ("128x128 w4 s2 ws", 128, 128, 4, 2, True, True),
        ("128x64 w4 s2 ws", 128, 64, 4, 2, True, True),
        ("128x128 w8 s3", 128, 128, 8, 3, True, False),
        ("128x32 w4 s4", 128, 32, 4, 4, True, False),
    ],
}
# dK/dV kernel: (label, block_m = query rows per step, block_n = keys per program, warps, stages, tma).
DKDV = [
    ("64x64 w4 s2", 64, 64, 4, 2, True),
    ("64x64 w4 s2 again", 64, 64, 4, 2, True),
    ("64x64 w4 s3", 64, 64, 4, 3, True),
    ("32x64 w4 s3", 32, 64, 4, 3, True),
    ("128x64 w8 s2", 128, 64, 8, 2, True),
    ("64x64 w8 s2", 64, 64, 8, 2, True),
]
# dQ kernel: (label, block_m = query rows per program, block_n = keys per step, warps, stages), by head dim.
DQ = {
    64: [
        ("64x64 w4 s3", 64, 64, 4, 3),
        ("64x64 w4 s4", 64, 64, 4, 4),
        ("64x128 w4 s3", 64, 128, 4, 3),
        ("128x64 w4 s3", 128, 64, 4, 3),
        ("64x32 w4 s3", 64, 32, 4, 3),
    ],
    128: [
        ("128x128 w8 s2", 128, 128, 8, 2),
        ("64x128 w4 s2", 64, 128, 4, 2),
        ("64x64 w4 s2", 64, 64, 4, 2),
        ("128x64 w8 s3", 128, 64, 8, 3),
        ("64x64 w8 s3", 64, 64, 8, 3),
    ],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--kinds", default="fwd,dkdv,dq", help="which kernels to sweep")
    p.add_argument("--workers", type=int, default=14)
    p.add_argument("--rep-ms", type=float, default=100)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/triton-tiles-h200.json"))
    return p.parse_args(argv)


def jobs(args):
    for d in (int(x) for x in args.head_dims.split(",")):
        for causal in (bool(int(x)) for x in args.causal.split(",")):
            shape = dict(d=d, causal=causal, n=args.seqlen, batch=max(1, 16384 // args.seqlen), heads=2048 // d)
            candidates = {"fwd": FORWARD[d], "dkdv": DKDV, "dq": DQ[d]}
            for kind in args.kinds.split(","):
                for cand in candidates[kind]:
                    yield dict(shape, kind=kind, cand=cand)


def apply(job):
    """Point the backend's tables and settings at this job's candidate."""
    from exattn.backends.triton import configs, passes

    bucket = configs.dim_bucket(job["d"])
    passes.settings.use_tma, passes.settings.atomic_dq = True, False
    passes.settings.use_gluon = False  # this sweep tunes the Triton kernels' tables
    cand = job["cand"]
    if job["kind"] == "fwd":
        _, bm, bn, w, s, tma, ws = cand
        configs.FORWARD_TILES[(bucket, job["causal"])] = configs.TileConfig(bm, bn, w, s, ws)
        passes.settings.use_tma = tma
    elif job["kind"] == "dkdv":
        _, bm, bn, w, s, tma = cand
        old = configs.BACKWARD_TILES[bucket]
        configs.BACKWARD_TILES[bucket] = configs.BackwardConfig(configs.TileConfig(bm, bn, w, s), old.dq)
        passes.settings.use_tma = tma
    elif job["kind"] == "dq":
        _, bm, bn, w, s = cand
        old = configs.BACKWARD_TILES[bucket]
        configs.BACKWARD_TILES[bucket] = configs.BackwardConfig(old.dkdv, configs.TileConfig(bm, bn, w, s))
    else:
        passes.settings.atomic_dq = True


def run_job(job, timed, rep_ms=100):
    """Run (and optionally time, in ms) the pass this job tunes."""
    import exattn
    from triton.testing import do_bench

    snapshot = snapshot_tables()
    apply(job)
    try:
        shape = (job["batch"], job["heads"], job["n"], job["d"])
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = exattn.attention(q, k, v, causal=job["causal"], backend="triton")
        dout = torch.randn_like(out)
        out.backward(dout, retain_graph=True)
        torch.cuda.synchronize()
        if not timed:
            return None
        if job["kind"] == "fwd":
            return do_bench(lambda: exattn.attention(q, k, v, causal=job["causal"], backend="triton"),
                            rep=rep_ms, return_mode="median")
        return do_bench(lambda: out.backward(dout, retain_graph=True), rep=rep_ms,
                        grad_to_none=[q, k, v], return_mode="median")
    finally:
        restore_tables(snapshot)


def snapshot_tables():
    from exattn.backends.triton import configs, passes

    return dict(configs.FORWARD_TILES), dict(configs.BACKWARD_TILES), dict(vars(passes.settings))


def restore_tables(snapshot):
    from exattn.backends.triton import configs, passes

    configs.FORWARD_TILES.update(snapshot[0])
    configs.BACKWARD_TILES.update(snapshot[1])
    vars(passes.settings).update(snapshot[2])


def warm(job):
    try:
        run_job(job, timed=False)
        return None
    except Exception as exc:
        return f"{job['kind']} {job['cand'][0]} d={job['d']}: {type(exc).__name__}: {str(exc)[:200]}"


def cudnn_ms(job, rep_ms):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    shape = (job["batch"], job["heads"], job["n"], job["d"])
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        fwd = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=job["causal"]),
                       rep=rep_ms, return_mode="median")
        out = F.scaled_dot_product_attention(q, k, v, is_causal=job["causal"])
        dout = torch.randn_like(out)
        bwd = do_bench(lambda: out.backward(dout, retain_graph=True), rep=rep_ms,
                       grad_to_none=[q, k, v], return_mode="median")
    return fwd, bwd


def main(argv=None):
    args = parse_args(argv)
    all_jobs = list(jobs(args))
    start = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        failures = [f for f in pool.imap_unordered(warm, all_jobs) if f]
    print(f"compiled {len(all_jobs)} candidates in {time.time() - start:.0f}s; failures: {failures}", flush=True)
    rows, anchors = [], {}
    for job in all_jobs:
        key = (job["d"], job["causal"])
        if key not in anchors:
            anchors[key] = cudnn_ms(job, args.rep_ms)
            print(f"cuDNN d={job['d']} causal={int(job['causal'])}: fwd {anchors[key][0]:.3f} ms "
                  f"bwd {anchors[key][1]:.3f} ms", flush=True)
        try:
            ms, error = run_job(job, timed=True, rep_ms=args.rep_ms), None
        except Exception as exc:
            ms, error = None, f"{type(exc).__name__}: {str(exc)[:200]}"
        backward = job["kind"] != "fwd"
        flops = attention_flops(job["batch"], job["heads"], job["n"], job["n"], job["d"], job["causal"], backward)
        tflops = None if ms is None else flops / ms * 1e-9
        anchor = anchors[key][1 if backward else 0]
        rows.append(dict(kind=job["kind"], label=job["cand"][0], head_dim=job["d"], causal=job["causal"],
                         seqlen=job["n"], batch=job["batch"], heads=job["heads"], ms=ms, tflops=tflops,
                         cudnn_ms=anchor, x_cudnn=None if ms is None else anchor / ms, error=error))
        print(f"{job['kind']:6s} d={job['d']:3d} causal={int(job['causal'])} {job['cand'][0]:20s} "
              f"{(tflops or 0):6.1f} TFLOP/s  x cuDNN {(rows[-1]['x_cudnn'] or 0):.2f} {error or ''}", flush=True)
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
