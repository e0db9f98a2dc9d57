"""Figures of the canonical GPU tables: prefill TFLOP/s and decode TB/s against length.

    python benchmarks/plot.py                          # docs/prefill-h200.png, docs/decode-h200.png
    python benchmarks/plot.py [--prefill benchmarks/results/prefill-h200.json]
                              [--decode benchmarks/results/decode-h200.json] [--out docs]
                              [--dtype bf16] [--head-dim 128] [--table shared]

Prefill: a 2x2 grid (forward / backward, full / causal), TFLOP/s against sequence
length for one dtype and head dim, one line per implementation (exattn, cuDNN,
FlashAttention-2 through SDPA's flash backend, FlexAttention). Decode: one panel per
batch size, KV bytes read per second against context length; contiguous caches solid,
exattn's paged caches (one block table shared by the layers, `--table`) dashed.
Each PNG is named after its JSON (prefill-h200.json -> prefill-h200.png).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

from common import size_label  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PREFILL_KEYS = ("impl", "dtype", "head_dim", "causal", "seqlen", "fwd_tflops", "bwd_tflops")
DECODE_KEYS = ("impl", "batch", "context", "paged", "tbps")
PREFILL_IMPLS = {"exattn-triton": "exattn", "sdpa-cudnn": "cuDNN", "sdpa-flash": "FA2 (SDPA flash)",
                 "flex": "FlexAttention"}
DECODE_IMPLS = {"exattn": "exattn", "sdpa_cudnn": "cuDNN", "sdpa_flash": "FA2 (SDPA flash)",
                "flex": "FlexAttention"}
COLORS = {"exattn": "C0", "cuDNN": "C1", "FA2 (SDPA flash)": "C2", "FlexAttention": "C3"}
PAGED_STYLES = ("--", "-.", ":")


def load_rows(path: str | Path, required: tuple[str, ...]) -> tuple[list[dict], dict]:
    """The rows (and meta, if any) of a results JSON: {"meta", "rows"} or a bare list of rows.
    Raises ValueError naming the file when there are no rows or a row lacks a required key."""
    data = json.loads(Path(path).read_text())
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: no rows (expected a list of rows or an object with 'rows')")
    for i, row in enumerate(rows):
        missing = [key for key in required if key not in row]
        if missing:
            raise ValueError(f"{path}: row {i} lacks required key(s) {', '.join(missing)}")
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    return rows, meta


def series(rows: list[dict], x: str, y: str, **match) -> tuple[list, list]:
    """(x, y) of the rows whose fields equal `match`, sorted by x; rows with y null are left out."""
    points = sorted((row[x], row[y]) for row in rows
                    if row[y] is not None and all(row.get(k) == v for k, v in match.items()))
    return [p[0] for p in points], [p[1] for p in points]


def style_axis(ax, xs: list[int], xlabel: str, ylabel: str) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(xs))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([size_label(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def device_of(rows: list[dict], meta: dict) -> str:
    return meta.get("device") or rows[0].get("device") or "GPU"


def plot_prefill(rows: list[dict], meta: dict, path: Path, dtype: str = "bf16", head_dim: int = 128) -> Path:
    """The 2x2 prefill grid for one dtype and head dim, written to `path`."""
    picked = [r for r in rows if r["dtype"] == dtype and r["head_dim"] == head_dim]
    if not picked:
        have = sorted({(r["dtype"], r["head_dim"]) for r in rows})
        raise ValueError(f"no prefill rows for {dtype} d={head_dim}; the file has {have}")
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    xs = sorted({r["seqlen"] for r in picked})
    for ax, (which, causal) in zip(axes.flat, [(w, c) for w in ("fwd", "bwd") for c in (False, True)]):
        for impl, label in PREFILL_IMPLS.items():
            x, y = series(picked, "seqlen", f"{which}_tflops", impl=impl, causal=causal)
            if x:
                ax.plot(x, y, marker="o", color=COLORS[label], label=label)
        ax.set_title(f"{'forward' if which == 'fwd' else 'backward'}, {'causal' if causal else 'full'}")
        style_axis(ax, xs, "sequence length N" if which == "bwd" else "", "TFLOP/s")
        ax.set_ylim(bottom=0)
    axes[0, 0].legend(loc="lower right")
    first = picked[0]
    shape = f", {first['heads']} heads, batch x N = {size_label(first['batch'] * first['seqlen'])} tokens" \
        if "heads" in first and "batch" in first else ""
    fig.suptitle(f"Prefill on {device_of(rows, meta)}: {dtype}, d = {head_dim}{shape}")
    return save(fig, path)


def plot_decode(rows: list[dict], meta: dict, path: Path, table: str = "shared") -> Path:
    """One panel per batch size of decode TB/s against context, written to `path`."""
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 5), sharey=True, squeeze=False)
    xs = sorted({r["context"] for r in rows})
    for ax, batch in zip(axes[0], batches):
        decode_panel(ax, rows, batch, table)
        style_axis(ax, xs, "context length (keys)", "TB/s (K/V bytes read / time)" if batch == batches[0] else "")
        ax.set_title(f"batch {batch}")
    axes[0, 0].set_ylim(bottom=0)  # after every panel: the y axis is shared
    lines = {label: line for ax in axes[0] for line, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(lines.values(), lines.keys(), loc="lower center", ncol=6, frameon=False)
    first = rows[0]
    fig.suptitle(f"Decode on {device_of(rows, meta)}: one new token, {first.get('dtype', '')}, "
                 f"Hq = {first.get('heads_q')}, Hk = {first.get('heads_k')}, d = {first.get('head_dim')}")
    return save(fig, path, bottom=0.08)


def decode_panel(ax, rows: list[dict], batch: int, table: str) -> None:
    for impl, label in DECODE_IMPLS.items():
        x, y = series(rows, "context", "tbps", impl=impl, batch=batch, paged=False)
        if x:
            ax.plot(x, y, marker="o", color=COLORS[label], label=label)
    paged = [r for r in rows if r["paged"] and r["batch"] == batch and r.get("table", table) == table]
    for page, style in zip(sorted({r.get("page_size") for r in paged}, key=lambda page: page or 0), PAGED_STYLES):
        x, y = series(paged, "context", "tbps", page_size=page)
        ax.plot(x, y, style, marker=".", color=COLORS["exattn"], label=f"exattn paged, {page}-key pages")


def save(fig, path: Path, bottom: float = 0.0) -> Path:
    """Write `fig` to `path` (folders made as needed), leaving `bottom` of the height for a figure legend."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", default=str(RESULTS / "prefill-h200.json"))
    p.add_argument("--decode", default=str(RESULTS / "decode-h200.json"))
    p.add_argument("--out", default=str(ROOT / "docs"), help="folder for the PNGs")
    p.add_argument("--dtype", default="bf16", help="prefill dtype to draw")
    p.add_argument("--head-dim", type=int, default=128, help="prefill head dim to draw")
    p.add_argument("--table", default="shared", help="block-table mode of the paged decode rows")
    args = p.parse_args(argv)
    out = Path(args.out)
    rows, meta = load_rows(args.prefill, PREFILL_KEYS)
    print(plot_prefill(rows, meta, out / f"{Path(args.prefill).stem}.png", args.dtype, args.head_dim))
    rows, meta = load_rows(args.decode, DECODE_KEYS)
    print(plot_decode(rows, meta, out / f"{Path(args.decode).stem}.png", args.table))


if __name__ == "__main__":
    main()
