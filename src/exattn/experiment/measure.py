"""Errors against the oracle and elapsed time, for one run (memory: `isolate`, traffic: `traffic`)."""

from __future__ import annotations

import statistics
import time

import torch

from ..reference import max_abs_error
from .oracle import Reference
from .workload import Inputs, RunSpec, forward, run_once, synchronize

GRAD_NAMES = ("dq", "dk", "dv")


def relative(err: float, ref: torch.Tensor) -> float:
    """err / max|ref| (a normwise relative error; 0 when the reference is all zero)."""
    scale = float(ref.detach().abs().nan_to_num(posinf=0.0, neginf=0.0).max()) if ref.numel() else 0.0
    return err / scale if scale > 0 else err


def error_stats(out: torch.Tensor, grads, ref: Reference) -> dict:
    """Max-abs and relative errors of the output and of each gradient; grad_* is the worst of dq, dk, dv."""
    stats = {"out_err_max_abs": max_abs_error(out, ref.out)}
    stats["out_err_rel"] = relative(stats["out_err_max_abs"], ref.out)
    if grads is None:
        return stats | {"grad_err_max_abs": None, "grad_err_rel": None}
    for name, grad, ref_grad in zip(GRAD_NAMES, grads, ref.grads):
        stats[f"{name}_err_max_abs"] = max_abs_error(grad, ref_grad)
        stats[f"{name}_err_rel"] = relative(stats[f"{name}_err_max_abs"], ref_grad)
    stats["grad_err_max_abs"] = max(stats[f"{n}_err_max_abs"] for n in GRAD_NAMES)
    stats["grad_err_rel"] = max(stats[f"{n}_err_rel"] for n in GRAD_NAMES)
    return stats


def ratio(ours: float | None, naive: float | None) -> float | None:
    """ours / naive, or None when either is missing; inf when only naive is exact."""
    if ours is None or naive is None:
        return None
    if naive == 0:
        return 1.0 if ours == 0 else float("inf")
    return ours / naive


def ratios_to_naive(stats: dict, naive: dict | None) -> dict:
    """The ratio of each max-abs error to the naive same-dtype error of the same setting."""
    naive = naive or {}
    return {
        "out_err_ratio_naive": ratio(stats.get("out_err_max_abs"), naive.get("out_err_max_abs")),
        "grad_err_ratio_naive": ratio(stats.get("grad_err_max_abs"), naive.get("grad_err_max_abs")),
    }


def elapsed(spec: RunSpec, inputs: Inputs, warmup: int, repeats: int) -> dict:
    """Median forward and backward seconds over `repeats`, after `warmup` untimed runs."""
    for _ in range(warmup):
        run_once(spec, inputs)
    fwd, bwd = [], []
    for _ in range(repeats):
        for x in inputs[:3]:
            x.grad = None
        synchronize(spec.device)
        start = time.perf_counter()
        out = forward(spec, inputs)
        synchronize(spec.device)
        mid = time.perf_counter()
        if spec.backward:
            out.backward(inputs.dout)
            synchronize(spec.device)
        fwd.append(mid - start)
        bwd.append(time.perf_counter() - mid)
    return {
        "time_fwd_ms": 1e3 * statistics.median(fwd),
        "time_bwd_ms": 1e3 * statistics.median(bwd) if spec.backward else None,
        "time_total_ms": 1e3 * statistics.median(f + b for f, b in zip(fwd, bwd)),
        "time_repeats": repeats,
    }

