"""Which rows each finding and figure reads."""

from __future__ import annotations

import math
import statistics


def select(rows: list[dict], **equal) -> list[dict]:
    """Successful rows whose fields equal `equal`."""
    return [r for r in rows if r.get("status") == "ok" and all(r.get(k) == v for k, v in equal.items())]


def reference_setting(rows: list[dict]) -> dict:
    """The setting the scaling findings use: prefill, no dropout, fp32 if run, not causal if run."""
    prefill = select(rows, phase="prefill", dropout_p=0.0)
    dtypes = [r["dtype"] for r in prefill]
    causal = [r["causal"] for r in prefill]
    if not prefill:
        return {}
    return {
        "phase": "prefill", "dropout_p": 0.0,
        "dtype": "fp32" if "fp32" in dtypes else dtypes[0],
        "causal": False if False in causal else causal[0],
    }


def by_tile(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows per implementation label ("naive", "tiled 64x64", ...), each sorted by N."""
    out: dict[str, list[dict]] = {}
    for row in sorted(rows, key=lambda r: (r["seq_len"], (r["block_m"] or 0) * (r["block_n"] or 0))):
        out.setdefault(label(row), []).append(row)
    return out


def label(row: dict) -> str:
    return row["impl"] if row["impl"] == "naive" else f"{row['impl']} {row['tile']}"


def tile_order(row: dict) -> tuple:
    return ((row["block_m"] or 0) * (row["block_n"] or 0), row["block_m"] or 0)


def finite(values) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def growth(rows: list[dict], key: str) -> tuple[float, float, float] | None:
    """(value at the largest N, factor over the two largest N, log-log exponent between them)."""
    points = [(r["seq_len"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and r[key] > 0]
    if len(points) < 2:
        return None
    (n0, y0), (n1, y1) = points[-2], points[-1]
    return y1, y1 / y0, math.log(y1 / y0) / math.log(n1 / n0)


def median(values) -> float | None:
    values = finite(values)
    return statistics.median(values) if values else None
