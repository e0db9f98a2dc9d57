"""PNG figures (matplotlib, Agg): error vs tile, peak memory vs N, time vs N, traffic vs tile (model, measured DRAM)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .selection import by_tile, reference_setting, select, tile_order  # noqa: E402

MIB = 2**20
PAGE = 4096


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def error_vs_tile(rows: list[dict], path: Path) -> Path | None:
    """Relative output and gradient error per tile, one panel per dtype, naive as dashed lines."""
    ref = reference_setting(rows)
    if not ref:
        return None
    dtypes = list(dict.fromkeys(r["dtype"] for r in select(rows, phase="prefill", dropout_p=0.0)))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(4.5 * len(dtypes), 3.6), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        chosen = select(rows, phase="prefill", dropout_p=0.0, dtype=dtype, causal=ref["causal"])
        n = max(r["seq_len"] for r in chosen)
        at_n = [r for r in chosen if r["seq_len"] == n]
        tiled = sorted((r for r in at_n if r["impl"] != "naive"), key=tile_order)
        x = range(len(tiled))
        for key, marker, name in (("out_err_rel", "o", "output"), ("grad_err_rel", "s", "gradient")):
            ax.plot(x, [max(r[key], 1e-300) for r in tiled], marker=marker, label=f"tiled {name}")
            for r in at_n:
                if r["impl"] == "naive":
                    ax.axhline(r[key], linestyle="--", color=ax.lines[-1].get_color(), label=f"naive {name}")
        proven(ax, x, tiled)
        ax.set_xticks(list(x), [r["tile"] for r in tiled], rotation=45)
        ax.set_yscale("log")
        ax.set_title(f"{dtype}, N = {n}")
        ax.set_xlabel("tile (block_m x block_n)")
        ax.set_ylabel("max-abs error / max |oracle| (bound: / max |v|)")
        ax.legend(fontsize=7)
    return save(fig, path)


def proven(ax, x, tiled: list[dict]) -> None:
    """The a-priori bound (exattn.bounds) and the measured error in its normalization (max-abs / max|v|)."""
    if not all(r.get("proven_out_bound") is not None for r in tiled) or not tiled:
        return
    ax.plot(x, [max(r["out_err_over_max_v"], 1e-300) for r in tiled], marker="^", linestyle=":",
            label="tiled output, max-abs / max|v|")
    ax.plot(x, [r["proven_out_bound"] for r in tiled], marker="_", linestyle="-", color="black",
            label="proven bound on max-abs / max|v|")


def versus_n(ax, curves: dict, key: str, scale: float) -> None:
    for name, curve in curves.items():
        points = [(r["seq_len"], max(r[key] or 0, PAGE if key == "peak_bytes" else 1e-9) / scale)
                  for r in curve if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), marker="o", linestyle="--" if name == "naive" else "-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")


def guides(ax, curves: dict) -> None:
    """Dotted N^1 and N^2 lines through the first naive point, to read the slopes against."""
    naive = [r for r in curves.get("naive", []) if r.get("peak_bytes")]
    if not naive:
        return
    n0, y0 = naive[0]["seq_len"], naive[0]["peak_bytes"] / MIB
    ns = [r["seq_len"] for r in naive]
    ax.plot(ns, [y0 * (n / n0) ** 2 for n in ns], ":", color="gray", label="∝ N² (quadratic)")
    ax.plot(ns, [y0 * (n / n0) for n in ns], "-.", color="gray", label="∝ N (linear)")


def memory_vs_n(rows: list[dict], path: Path) -> Path | None:
    ref = reference_setting(rows)
    curves = by_tile(select(rows, **ref)) if ref else {}
    if not any(r.get("peak_bytes") is not None for c in curves.values() for r in c):
        return None
    fig, ax = plt.subplots(figsize=(6, 4.2))
    versus_n(ax, curves, "peak_bytes", MIB)
    guides(ax, curves)
    ax.set_ylabel("measured peak memory (MiB)")
    ax.set_title(f"Peak memory, prefill fwd+bwd, {ref['dtype']}, {'causal' if ref['causal'] else 'not causal'}")
    ax.legend(fontsize=7)
    return save(fig, path)


def time_vs_n(rows: list[dict], path: Path) -> Path | None:
    ref = reference_setting(rows)
    panels = []
    if ref:
        panels.append(("prefill fwd+bwd", by_tile(select(rows, **ref)), "time_total_ms"))
    decode = select(rows, phase="decode", dtype=ref.get("dtype", "fp32"))
    if decode:
        panels.append(("decode fwd", by_tile(decode), "time_fwd_ms"))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (title, curves, key) in zip(axes[0], panels):
        versus_n(ax, curves, key, 1.0)
        ax.set_ylabel("median time (ms)")
        ax.set_title(f"{title}, {ref.get('dtype', '')}")
        ax.legend(fontsize=7)
    return save(fig, path)


def traffic_vs_tile(rows: list[dict], path: Path) -> Path | None:
    ref = reference_setting(rows)
    if not ref:
        return None
    same = [r for r in rows if r["phase"] == "prefill" and r["dtype"] == ref["dtype"] and r["dropout_p"] == 0.0]
    n = max(r["seq_len"] for r in same)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    naive_levels = {}
    for causal in dict.fromkeys(r["causal"] for r in same):
        at_n = [r for r in same if r["seq_len"] == n and r["causal"] == causal]
        tiled = sorted((r for r in at_n if r["impl"] != "naive"), key=tile_order)
        name = f"tiled, {'causal' if causal else 'not causal'}"
        ax.plot([r["tile"] for r in tiled], [r["traffic_model_bytes"] / MIB for r in tiled], marker="o", label=name)
        measured = [r for r in tiled if r.get("dram_bytes") is not None]
        if measured:
            ax.plot([r["tile"] for r in measured], [r["dram_bytes"] / MIB for r in measured], marker="x",
                    linestyle=":", color=ax.lines[-1].get_color(), label=f"{name}, measured DRAM (ncu)")
        naive_levels.update({r["traffic_model_bytes"]: causal for r in at_n if r["impl"] == "naive"})
        for r in at_n:
            if r["impl"] == "naive" and r.get("dram_bytes") is not None:
                ax.axhline(r["dram_bytes"] / MIB, linestyle=":", color="black", label="naive, measured DRAM (ncu)")
    for level in naive_levels:
        ax.axhline(level / MIB, linestyle="--", color="gray", label="naive schedule (N x N in main memory)")
    ax.set_yscale("log")
    ax.set_xlabel("tile (block_m x block_n)")
    if any(r.get("dram_bytes") is not None for r in same):
        ax.set_ylabel("bytes moved, fwd+bwd (MiB)")
        ax.set_title(f"Traffic, N = {n}, {ref['dtype']}: MODEL (o) vs measured DRAM (x)")
    else:
        ax.set_ylabel("MODELED bytes moved, fwd+bwd (MiB)")
        ax.set_title(f"Modeled HBM<->on-chip traffic, N = {n}, {ref['dtype']}")
    ax.tick_params(axis="x", rotation=45)
    ax.legend(fontsize=7)
    return save(fig, path)


def make_plots(rows: list[dict], out: Path) -> list[Path]:
    """Every figure the rows support; a figure without data is left out, not drawn empty."""
    made = []
    for name, draw in (("error_vs_tile.png", error_vs_tile), ("memory_vs_n.png", memory_vs_n),
                       ("time_vs_n.png", time_vs_n), ("traffic_vs_tile.png", traffic_vs_tile)):
        path = draw(rows, out / name)
        if path is not None:
            made.append(path)
    return made
