"""A short plain-language reading of the results, computed from the rows (nothing hard-coded)."""

from __future__ import annotations

from .selection import by_tile, finite, growth, label, median, reference_setting, select, tile_order

MIB = 2**20


def accuracy(rows: list[dict]) -> list[str]:
    lines = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        ours = [r for r in select(rows, phase="prefill", dropout_p=0.0, dtype=dtype) if r["impl"] != "naive"]
        out, grad = finite(r["out_err_ratio_naive"] for r in ours), finite(r["grad_err_ratio_naive"] for r in ours)
        if not out:
            continue
        text = (f"Accuracy, prefill {dtype} ({len(ours)} tiled runs): output error was at most "
                f"{max(out):.2f}× the naive {dtype} error (median {median(out):.2f}×)")
        if grad:
            text += f"; gradient error at most {max(grad):.2f}× (median {median(grad):.2f}×)"
        worst = max(finite(r["out_err_rel"] for r in ours))
        lines.append(text + f". Worst relative output error {worst:.1e}. "
                     + ("Within the project's 2× rule." if max(out + grad) <= 2 else
                        "Some runs exceed 2× naive: see the tables."))
        lines += tile_effect(ours, dtype)
    return lines


def tile_effect(ours: list[dict], dtype: str) -> list[str]:
    n = max(r["seq_len"] for r in ours)
    at_n = sorted((r for r in ours if r["seq_len"] == n and r["causal"] == ours[0]["causal"]), key=tile_order)
    errs = finite(r["out_err_rel"] for r in at_n)
    if len(errs) < 2 or min(errs) == 0:
        return []
    best = min(at_n, key=lambda r: r["out_err_rel"])
    worst = max(at_n, key=lambda r: r["out_err_rel"])
    factor = worst["out_err_rel"] / best["out_err_rel"]
    if factor < 1.01:
        return [f"Tile size vs error ({dtype}, N = {n}): the tile did not change the relative output "
                f"error ({best['out_err_rel']:.1e} at every tile)."]
    return [f"Tile size vs error ({dtype}, N = {n}): relative output error ranged from "
            f"{best['out_err_rel']:.1e} ({best['tile']}) to {worst['out_err_rel']:.1e} ({worst['tile']}), "
            f"a factor of {factor:.2f}."]


def memory(rows: list[dict]) -> list[str]:
    ref = reference_setting(rows)
    curves = by_tile(select(rows, **ref)) if ref else {}
    lines = []
    for name, curve in curves.items():
        g = growth(curve, "peak_bytes")
        if g is None:
            continue
        kind = "≈ quadratic" if g[2] >= 1.5 else ("≈ linear" if g[2] >= 0.5 else "≈ flat: constant costs dominate")
        lines.append(f"{name}: {g[0] / MIB:.1f} MiB at N = {curve[-1]['seq_len']}, ×{g[1]:.1f} over the last "
                     f"doubling of N (exponent {g[2]:.2f}, {kind})")
    if not lines:
        return ["Memory: not enough measured peaks to show growth (run with more sequence lengths)."]
    head = (f"Measured peak memory ({ref['dtype']}, prefill forward+backward, "
            f"{'causal' if ref['causal'] else 'not causal'}): ")
    return [head + "; ".join(lines) + "." + memory_ratio(curves)]


def memory_ratio(curves: dict) -> str:
    naive = {r["seq_len"]: r["peak_bytes"] for r in curves.get("naive", []) if r.get("peak_bytes")}
    tiled = [r for name, c in curves.items() if name != "naive" for r in c
             if r["seq_len"] in naive and r.get("peak_bytes") is not None]
    if not tiled:
        return ""
    n = max(r["seq_len"] for r in tiled)
    worst = max((r for r in tiled if r["seq_len"] == n), key=lambda r: r["peak_bytes"])
    return (f" At N = {n} the largest tiled peak ({worst['tile']}) was "
            f"{100 * worst['peak_bytes'] / naive[n]:.1f}% of naive's.")


def speed_and_traffic(rows: list[dict]) -> list[str]:
    ref = reference_setting(rows)
    if not ref:
        return []
    chosen = select(rows, **ref)
    n = max(r["seq_len"] for r in chosen)
    at_n = [r for r in chosen if r["seq_len"] == n]
    naive = [r for r in at_n if r["impl"] == "naive"]
    tiled = sorted((r for r in at_n if r["impl"] != "naive"), key=lambda r: r["time_total_ms"])
    lines = []
    if tiled:
        text = (f"Time (N = {n}, {ref['dtype']}, forward+backward): fastest tile {label(tiled[0])} "
                f"{tiled[0]['time_total_ms']:.1f} ms, slowest {label(tiled[-1])} {tiled[-1]['time_total_ms']:.1f} ms")
        if naive:
            text += (f"; naive {naive[0]['time_total_ms']:.1f} ms "
                     f"(best tiled / naive = {tiled[0]['time_total_ms'] / naive[0]['time_total_ms']:.2f})")
        lines.append(text + ". A memory saving need not be a time saving.")
        by_traffic = sorted(tiled, key=lambda r: r["traffic_model_bytes"])
        text = (f"Modeled traffic (N = {n}): {by_traffic[0]['traffic_model_bytes'] / MIB:.1f} MiB for "
                f"{by_traffic[0]['tile']} up to {by_traffic[-1]['traffic_model_bytes'] / MIB:.1f} MiB for "
                f"{by_traffic[-1]['tile']}")
        model_naive = [r for r in rows if r["impl"] == "naive" and r["seq_len"] == n
                       and r["phase"] == "prefill" and r["dtype"] == ref["dtype"] and r["causal"] == ref["causal"]]
        if model_naive:
            text += f", against {model_naive[0]['traffic_model_bytes'] / MIB:.1f} MiB for the naive schedule"
        lines.append(text + ". Larger block_m cuts K/V re-reads (forward); larger block_n cuts Q/dO re-reads (backward).")
    return lines


def measured_traffic(rows: list[dict]) -> list[str]:
    """Measured DRAM bytes against the model, in the reference setting at the largest measured N."""
    ref = reference_setting(rows)
    measured = [r for r in select(rows, **ref) if r.get("dram_bytes") is not None] if ref else []
    failed = [r for r in rows if r.get("dram_error")]
    lines = []
    if measured:
        n = max(r["seq_len"] for r in measured)
        at_n = sorted((r for r in measured if r["seq_len"] == n),
                      key=lambda r: (r["impl"] != "naive", tile_order(r)))
        parts = [f"{label(r)} {r['dram_bytes'] / MIB:.1f} MiB = {r['dram_bytes'] / r['traffic_model_bytes']:.2f}× "
                 f"the model's {r['traffic_model_bytes'] / MIB:.1f} MiB" for r in at_n]
        lines.append(f"Measured DRAM traffic (Nsight Compute; N = {n}, {ref['dtype']}, prefill forward+backward, "
                     f"{'causal' if ref['causal'] else 'not causal'}): " + "; ".join(parts)
                     + ". Below 1× the L2 kept data that the model counts as re-read from DRAM.")
    if failed:
        lines.append(f"DRAM bytes could not be measured for {len(failed)} run(s), e.g. {label(failed[0])} "
                     f"at N = {failed[0]['seq_len']}: {failed[0]['dram_error']}")
    return lines


def dropout(rows: list[dict]) -> list[str]:
    with_p = [r for r in rows if r["status"] == "ok" and r["dropout_p"] > 0 and r["impl"] != "naive"]
    if not with_p:
        return []
    lengths = {r["seq_len"] for r in with_p}
    without = [r for r in select(rows, phase="prefill", dropout_p=0.0) if r["impl"] != "naive" and r["seq_len"] in lengths]
    def worst(rs, key):
        values = finite(r[key] for r in rs)
        return f"{max(values):.2f}×" if values else "-"
    probabilities = ", ".join(sorted({f"{r['dropout_p']:g}" for r in with_p}))
    return [f"Dropout (same Philox keep-mask in every implementation and the oracle, "
            f"p = {probabilities}): worst output error "
            f"{worst(with_p, 'out_err_ratio_naive')} naive and gradient error {worst(with_p, 'grad_err_ratio_naive')} "
            f"naive, against {worst(without, 'out_err_ratio_naive')} and {worst(without, 'grad_err_ratio_naive')} "
            "without dropout at the same lengths: with matched masks the differences are numerical, not stochastic."]


def decode(rows: list[dict]) -> list[str]:
    ours = [r for r in select(rows, phase="decode") if r["impl"] != "naive"]
    if not ours:
        return []
    n = max(r["seq_len"] for r in ours)
    naive = [r for r in select(rows, phase="decode", seq_len=n) if r["impl"] == "naive"]
    fastest = min((r for r in ours if r["seq_len"] == n), key=lambda r: r["time_fwd_ms"])
    text = (f"Decode (one query against N keys): output error at most "
            f"{max(finite(r['out_err_ratio_naive'] for r in ours)):.2f}× naive; at N = {n} the fastest split "
            f"({fastest['tile']}) took {fastest['time_fwd_ms']:.2f} ms")
    if naive:
        text += f" vs naive {naive[0]['time_fwd_ms']:.2f} ms"
    return [text + "."]


def problems(rows: list[dict]) -> list[str]:
    failed = [r for r in rows if r["status"] == "failed"]
    skipped = [r for r in rows if r["status"] == "skipped"]
    lines = []
    if skipped:
        lines.append(f"{len(skipped)} run(s) skipped by design, e.g. {skipped[0]['note']}")
    if failed:
        lines.append(f"{len(failed)} run(s) FAILED, e.g. {label(failed[0])} at N = {failed[0]['seq_len']}: "
                     f"{failed[0]['note']}")
    return lines or ["Every planned run completed."]


def proven_bound(rows: list[dict]) -> list[str]:
    """How far the a-priori bound (docs/error-bound.md) sits above the measured output error, per dtype."""
    lines = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        pairs = [(r["proven_out_bound"], r["out_err_over_max_v"]) for r in rows
                 if r["dtype"] == dtype and r.get("proven_out_bound") is not None and r.get("out_err_over_max_v")]
        if not pairs:
            continue
        factors = [b / m for b, m in pairs]
        broken = sum(m > b for b, m in pairs)
        lines.append(f"Proven bound ({dtype}, {len(pairs)} tiled runs): the output error (max-abs / max|v|) stayed "
                     f"below the a-priori bound in {len(pairs) - broken} of {len(pairs)} runs; the bound was "
                     f"{min(factors):.0f}× to {max(factors):.0f}× the measured error "
                     f"(random inputs are not the worst case)." + (" BOUND EXCEEDED: a bug." if broken else ""))
    return lines


def findings(rows: list[dict], meta: dict) -> list[str]:
    """Bullets for report.md: accuracy, proven bound, memory, time and traffic, dropout, decode, problems."""
    return (accuracy(rows) + proven_bound(rows) + memory(rows) + speed_and_traffic(rows) + measured_traffic(rows) + dropout(rows)
            + decode(rows) + problems(rows))
