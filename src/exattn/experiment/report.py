"""results.json, results.csv and report.md (tables, plots and a plain-language reading)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from .findings import findings
from .plots import make_plots

MIB = 2**20
FIRST_COLUMNS = (
    "phase", "dtype", "seq_len", "len_q", "len_k", "causal", "dropout_p", "impl", "tile",
    "block_m", "block_n", "status", "note",
    "out_err_max_abs", "out_err_rel", "out_err_ratio_naive",
    "grad_err_max_abs", "grad_err_rel", "grad_err_ratio_naive",
    "out_err_over_max_v", "proven_out_bound", "proven_grad_bound",
    "peak_bytes", "traffic_model_bytes", "traffic_model_fwd_bytes",
    "dram_bytes", "dram_read_bytes", "dram_write_bytes", "dram_kernels", "dram_error",
    "time_fwd_ms", "time_bwd_ms", "time_total_ms",
)
DRAM_COLUMNS = ("dram_bytes", "dram_read_bytes", "dram_write_bytes", "dram_kernels", "dram_error")


def strict(value):
    """JSON-safe: NaN and infinities become the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def measured_dram(rows: list[dict]) -> bool:
    """Whether DRAM bytes were measured (or tried) for any row: only then do their columns appear."""
    return any("dram_bytes" in r or "dram_error" in r for r in rows)


def columns(rows: list[dict]) -> list[str]:
    dram = measured_dram(rows)
    seen = dict.fromkeys(c for c in FIRST_COLUMNS if dram or c not in DRAM_COLUMNS)
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def write_json(path: Path, rows: list[dict], meta: dict) -> None:
    path.write_text(json.dumps(strict({"meta": meta, "rows": rows}), indent=1) + "\n")


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns(rows))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def fmt(value, kind: str) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if kind == "err":
        return f"{value:.2e}"
    if kind == "ratio":
        return "inf" if value == float("inf") else f"{value:.2f}"
    if kind == "mib":
        return f"{value / MIB:.2f}"
    if kind == "x":
        return f"{value:.3g}"
    return f"{value:.1f}"


TABLE = (
    ("N", "seq_len", None), ("impl", "impl", None), ("tile", "tile", None),
    ("out max-abs", "out_err_max_abs", "err"), ("out rel", "out_err_rel", "err"),
    ("out ×naive", "out_err_ratio_naive", "ratio"),
    ("out / max abs v", "out_err_over_max_v", "err"), ("proven bound", "proven_out_bound", "err"),
    ("grad max-abs", "grad_err_max_abs", "err"), ("grad rel", "grad_err_rel", "err"),
    ("grad ×naive", "grad_err_ratio_naive", "ratio"),
    ("peak MiB (measured)", "peak_bytes", "mib"), ("traffic MiB (model)", "traffic_model_bytes", "mib"),
    ("fwd ms", "time_fwd_ms", "ms"), ("bwd ms", "time_bwd_ms", "ms"), ("status", "status", None),
)
DRAM_TABLE = (("DRAM MiB (measured)", "dram_bytes", "mib"), ("measured / model", "dram_vs_model", "x"))


def dram_vs_model(row: dict) -> float | None:
    """Measured DRAM bytes over modeled traffic (below 1: caches kept data the model re-reads)."""
    measured, model = row.get("dram_bytes"), row.get("traffic_model_bytes")
    return measured / model if measured is not None and model else None


def table(rows: list[dict]) -> list[str]:
    spec = TABLE
    if measured_dram(rows):
        at = [key for _, key, _ in TABLE].index("traffic_model_bytes") + 1
        spec = TABLE[:at] + DRAM_TABLE + TABLE[at:]
    lines = ["| " + " | ".join(h for h, _, _ in spec) + " |", "|" + "---|" * len(spec)]
    for row in rows:
        row = row | {"dram_vs_model": dram_vs_model(row)}
        cells = [str(row.get(key, "")) if kind is None else fmt(row.get(key), kind) for _, key, kind in spec]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {r['seq_len']} {r['impl']} {r['tile']}: {r['note']}" for r in rows if r.get("note")]
    notes += [f"- {r['seq_len']} {r['impl']} {r['tile']}: DRAM not measured: {r['dram_error']}"
              for r in rows if r.get("dram_error")]
    return lines + ([""] + notes if notes else [])


def groups(rows: list[dict]) -> dict:
    out: dict = {}
    for row in rows:
        key = (row["phase"], row["dropout_p"], row["dtype"], row["causal"])
        out.setdefault(key, []).append(row)
    return out


def baseline_name(meta: dict, dtype: str) -> str:
    v = meta["versions"]
    return (f"`naive` backend of exattn {v['exattn']} (materializes the matrix in {dtype}), "
            f"torch {v['torch']}, {meta['device']} ({meta['device_name']}), {dtype}")


def setup_lines(meta: dict) -> list[str]:
    c, v = meta["config"], meta["versions"]
    return [
        f"- Command: `{meta['command']}`" if meta.get("command") else "- Command: (library call)",
        f"- Date: {meta['date']}; wall time {meta.get('wall_seconds', meta['sweep_seconds']):.1f} s",
        f"- Device: {meta['device']} ({meta['device_name']}), {meta['threads']} torch threads, {meta['platform']}",
        f"- Versions: exattn {v['exattn']}, torch {v['torch']}, Python {v['python']}, "
        f"triton {v['triton'] or 'not installed'}, numpy {v['numpy']}",
        f"- Shapes: batch {c['batch']}, {c['heads']} query heads, {c['kv_heads'] or c['heads']} key/value heads, "
        f"head dim {c['head_dim']}; prefill Nq = Nk = N; decode Nq = 1, Nk = N",
        "- Baseline in every table: `naive`, "
        "softmax(scale·q·kᵀ)·v with the (B, Hq, Nq, Nk) matrix materialized in the run's dtype, "
        "PyTorch autograd backward (`exattn.backends.naive`).",
        f"- Compared: backends {', '.join(c['backends'])} at tiles "
        f"{', '.join(f'{m}x{n}' for m, n in c['tiles'])} (block_m × block_n). Decode runs "
        "`exattn.decode` with one split per block_n keys (num_splits = ceil(N / block_n)), shown as 1 × block_n.",
        f"- Oracle: {meta['oracle']}. Errors: max-abs, relative (max-abs / max|oracle|), "
        "and ratio to the naive error in the same dtype (1.0 = as accurate as naive).",
        "- Proven bound (tiled, prefill, no dropout): the a-priori bound of docs/error-bound.md on "
        "max-abs / max|v| (column `out / max abs v` is the measured error in that normalization), for "
        "S = scale·max|q|₂·max|k|₂ of the inputs; `proven_grad_bound` in the CSV bounds dv, dq, dk.",
        f"- Peak memory (measured): {meta['memory_method']}.",
        f"- Memory traffic: a MODEL of bytes between main and on-chip memory "
        f"(on-chip size {meta['on_chip_bytes']:,} B: {meta['on_chip_source']}); "
        f"measured DRAM bytes: {meta['dram_measured']}.",
        f"- Time: median of {c['repeats']} repeats after {c['warmup']} warm-up run(s) "
        "(the error run is the first warm-up).",
    ]


PLOTS = (
    ("error_vs_tile.png", "Error vs tile size, per dtype"),
    ("memory_vs_n.png", "Measured peak memory vs N (log-log)"),
    ("time_vs_n.png", "Elapsed time vs N"),
    ("traffic_vs_tile.png", "Modeled traffic vs tile size"),
)


def markdown(rows: list[dict], meta: dict, plots: list[str]) -> str:
    lines = ["# exattn experiment: tile × length × precision", "", "## Setup", ""]
    lines += setup_lines(meta)
    lines += ["", "## What was found", ""] + [f"- {f}" for f in findings(rows, meta)]
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{title}]({name})" for name, title in PLOTS if name in plots]
    lines += ["", "## Tables", ""]
    for (phase, p, dtype, causal), group in groups(rows).items():
        causal_text = "whole context" if phase == "decode" else ("causal" if causal else "not causal")
        lines += [f"### {phase}, {dtype}, {causal_text}, dropout {p:g}", "",
                  f"Baseline: {baseline_name(meta, dtype)}.", ""]
        lines += table(group) + [""]
    limits = LIMITS + (DRAM_LIMITS if measured_dram(rows) else ())
    lines += ["## Limits", ""] + [f"- {x}" for x in limits]
    return "\n".join(lines) + "\n"


LIMITS = (
    "Traffic is modeled, not measured: it counts the tile loads a FlashAttention-2 schedule needs and "
    "ignores caches that keep tiles between uses; see docs/experiment.md.",
    "CPU peak memory is resident-set growth of a fresh process during one forward (and backward): it "
    "includes allocator and page granularity (4 KiB) and can read 0 for tiny runs that reuse freed memory.",
    "CPU times on a shared machine are noisy; the pure-PyTorch tiled backend pays Python overhead per tile, "
    "so on the CPU small tiles are slow for reasons a fused GPU kernel does not share.",
    "The naive baseline is skipped (not crashed) above --naive-max-len; its rows say so.",
    "Decoding is inference: decode rows have forward errors and times only.",
)
DRAM_LIMITS = (
    "Measured DRAM bytes (Nsight Compute) cover every kernel of one forward (+ backward) call, each kernel "
    "starting with a flushed L2; reads that hit the L2 inside a kernel are not DRAM traffic, so a measurement "
    "well below the model means the cache, not the schedule, kept the re-read tiles. Work the CPU does and "
    "host-device copies are not counted.",
)


def write_report(results, out_dir: str | Path) -> list[Path]:
    """Write every output file; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, meta = results.rows, results.meta
    write_json(out / "results.json", rows, meta)
    write_csv(out / "results.csv", rows)
    plots = make_plots(rows, out) if meta["config"].get("plots", True) else []
    (out / "report.md").write_text(markdown(rows, meta, [p.name for p in plots]))
    return [out / "results.json", out / "results.csv", out / "report.md", *plots]
