"""The run grid and its execution: one oracle per setting, the naive baseline first, then every tile.

A setting is (phase, dtype, N, causal, dropout_p): every implementation in
it sees the same inputs and is judged against the same float64 oracle.
Prefill runs over `seq_lens` without dropout and over `dropout_seq_lens`
with each nonzero dropout (the second, matched-mask comparison). Decode is
one query against N keys; it has no dropout and, for one query, causal
(bottom-right) is the whole context, so it runs once per (dtype, N), with
one run per distinct block_n.
"""

from __future__ import annotations

import itertools
import time
from typing import NamedTuple

import torch
from tqdm import tqdm

from ..bounds import tile_bounds
from .config import ExperimentConfig
from .dram import measure_dram
from .environment import describe_environment
from .isolate import SERVER, peak_memory
from .measure import elapsed, error_stats, ratios_to_naive
from .oracle import oracle
from .traffic import Shape, modeled_traffic
from .workload import DTYPE_BYTES, RunSpec, make_inputs, run_once

IMPLEMENTATIONS = {
    "naive": "exattn naive backend: softmax(scale * q k^T) v with the (B, Hq, Nq, Nk) matrix "
             "materialized in the input dtype, PyTorch autograd backward",
    "tiled": "exattn tiled backend: pure PyTorch tiles merged with (m, l, u), float32 "
             "accumulation, backward recomputes tiles from the saved lse",
    "triton": "exattn triton backend: fused Triton forward and backward kernels",
}


class Results(NamedTuple):
    rows: list[dict]
    meta: dict


def spec(config: ExperimentConfig, **fields) -> RunSpec:
    return RunSpec(
        batch=config.batch, heads=config.heads, heads_k=config.heads_k,
        head_dim=config.head_dim, seed=config.seed, device=config.device, **fields,
    )


def setting_runs(config: ExperimentConfig, tiles, **setting) -> list[RunSpec]:
    """The naive baseline, then each backend at each tile, for one setting."""
    runs = [spec(config, impl="naive", block_m=None, block_n=None, **setting)]
    for backend, (block_m, block_n) in itertools.product(config.backends, tiles):
        runs.append(spec(config, impl=backend, block_m=block_m, block_n=block_n, **setting))
    return runs


def plan_runs(config: ExperimentConfig) -> list[list[RunSpec]]:
    """Runs grouped by setting, in execution order."""
    groups = []
    if "prefill" in config.phases:
        for dropout_p, dtype, causal in itertools.product(config.dropout, config.dtypes, config.causal):
            lengths = config.seq_lens if dropout_p == 0 else config.dropout_seq_lens
            for n in lengths:
                groups.append(setting_runs(
                    config, config.tiles, phase="prefill", dtype=dtype, seq_len=n,
                    causal=causal, dropout_p=dropout_p,
                ))
    if "decode" in config.phases:
        splits = tuple((1, block_n) for block_n in sorted({n for _, n in config.tiles}))
        for dtype, n in itertools.product(config.dtypes, config.seq_lens):
            groups.append(setting_runs(
                config, splits, phase="decode", dtype=dtype, seq_len=n, causal=True, dropout_p=0.0,
            ))
    return groups


def naive_cap_note(run: RunSpec, config: ExperimentConfig) -> str | None:
    """Why the naive baseline is skipped for this run, or None."""
    if run.impl != "naive" or run.len_q * run.seq_len <= config.naive_max_len ** 2:
        return None
    entries = run.batch * run.heads * run.len_q * run.seq_len
    mib = entries * DTYPE_BYTES[run.dtype] / 2**20
    return (f"skipped: naive materializes B*Hq*Nq*Nk = {entries:,} entries ({mib:,.0f} MiB per "
            f"matrix, several live at once); N = {run.seq_len} > --naive-max-len {config.naive_max_len}")


def entry_point(run: RunSpec) -> str:
    if run.phase == "prefill" or run.impl == "naive":
        return f"exattn.attention(backend={run.impl!r})"
    return f"exattn.decode(backend={run.impl!r}, num_splits=ceil(N / {run.block_n}))"


def base_row(run: RunSpec) -> dict:
    row = run.as_dict() | {
        "tile": run.tile,
        "len_q": run.len_q,
        "len_k": run.seq_len,
        "implementation": IMPLEMENTATIONS.get(run.impl, run.impl),
        "entry_point": entry_point(run),
        "status": "ok",
        "note": "",
    }
    shape = Shape(run.batch, run.heads, run.len_q, run.seq_len, run.head_dim, run.head_dim,
                  DTYPE_BYTES[run.dtype], run.causal)
    return row | modeled_traffic(shape, run.block_m, run.block_n, run.phase)


def proven_columns(run: RunSpec, inputs, row: dict) -> dict:
    """The a-priori bound (exattn.bounds) next to the measured error it bounds, for tiled prefill without
    dropout: S = scale * max|q_i|_2 * max|k_j|_2 from the inputs (cheap), R = 2 S; the bound is on
    max-abs / max|v|, so the measured output error is given in that normalization too."""
    if run.impl != "tiled" or run.phase != "prefill" or run.dropout_p > 0 or row.get("out_err_max_abs") is None:
        return {}
    q, k, v = (x.detach().double() for x in inputs[:3])
    score_bound = run.head_dim ** -0.5 * float(q.norm(dim=-1).max() * k.norm(dim=-1).max())
    b = tile_bounds(run.block_m, run.block_n, run.len_q, run.seq_len, run.head_dim, run.dtype,
                    score_bound, None, run.heads // run.heads_k)
    max_v = float(v.abs().max())
    return {"out_err_over_max_v": row["out_err_max_abs"] / max_v if max_v > 0 else None,
            "proven_out_bound": b["out"], "proven_grad_bound": max(b["dv"], b["dq"], b["dk"]),
            "proven_score_bound": score_bound}


def execute(run: RunSpec, inputs, ref, naive: dict | None, config: ExperimentConfig) -> dict:
    """Every measurement of one run; a failure becomes a failed row."""
    row = base_row(run)
    skip = naive_cap_note(run, config)
    if skip:
        return row | {"status": "skipped", "note": skip}
    try:
        out, grads = run_once(run, inputs)
        row |= error_stats(out, grads, ref)
        row |= proven_columns(run, inputs, row)
        row |= ratios_to_naive(row, naive if run.impl != "naive" else row)
        del out, grads
        row |= elapsed(run, inputs, max(0, config.warmup - 1), config.repeats)
    except Exception as err:
        return row | {"status": "failed", "note": f"{type(err).__name__}: {err}"}
    if config.memory:
        memory = peak_memory(run, config.memory_timeout)
        row["peak_bytes"] = memory.get("peak_bytes")
        row["peak_method"] = memory.get("method", "")
        if "error" in memory:
            row["note"] = f"memory not measured: {memory['error']}"
    if config.dram:
        row |= measure_dram(run, config.memory_timeout)
    return row


def run_setting(group: list[RunSpec], config: ExperimentConfig, bar) -> list[dict]:
    try:
        inputs = make_inputs(group[0])
        ref = oracle(group[0], inputs)
    except Exception as err:
        bar.update(len(group))
        note = f"oracle failed: {type(err).__name__}: {err}"
        return [base_row(run) | {"status": "failed", "note": note} for run in group]
    rows, naive = [], None
    for run in group:
        bar.set_postfix_str(f"{run.phase} {run.dtype} N={run.seq_len} {run.impl} {run.tile}", refresh=False)
        row = execute(run, inputs, ref, naive, config)
        if run.impl == "naive" and row["status"] == "ok":
            naive = row
        rows.append(row)
        bar.update(1)
    return rows


def run_sweep(config: ExperimentConfig, progress: bool = True, argv: list[str] | None = None) -> Results:
    """Run the whole grid of `config`; returns the rows and what they were measured on."""
    if config.threads:
        torch.set_num_threads(config.threads)
    groups = plan_runs(config)
    start = time.perf_counter()
    rows: list[dict] = []
    with tqdm(total=sum(map(len, groups)), desc="exattn experiment", unit="run",
              disable=not progress) as bar:
        try:
            for group in groups:
                rows.extend(run_setting(group, config, bar))
        finally:
            SERVER.close()
    meta = describe_environment(config, argv) | {"sweep_seconds": time.perf_counter() - start}
    return Results(rows, meta)
