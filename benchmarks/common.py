"""Helpers shared by the benchmarks: FLOP counts, timing, environment."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def attention_flops(batch, heads, len_q, len_k, head_dim, causal=False, backward=False):
    """4·B·H·Nq·Nk·D for the forward, halved for causal, ×2.5 for the backward."""
    flops = 4 * batch * heads * len_q * len_k * head_dim
    if causal:
        flops /= 2
    return flops * 2.5 if backward else flops


def size_label(n: int) -> str:
    """1024 -> "1k"; lengths that are not whole multiples of 1024 as they are."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def interleaved_seconds(fns: dict, warmup=1, repeats=5) -> dict[str, list[float]]:
    """Times of each callable, taken in alternating rounds so machine drift hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_rounds(names, rounds, measure, describe_failure, samples=None) -> dict:
    """{name: [measure(name) per round] or a note}: every other round in reverse order, so that a
    drift in the GPU's clock between measurements reaches every implementation alike. A name whose
    measurement raised (its note: describe_failure(error)), or that `samples` maps to a note, is not
    measured again."""
    samples = dict(samples or {})
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:
            if isinstance(samples.get(name), str):
                continue
            try:
                samples.setdefault(name, []).append(measure(name))
            except Exception as error:  # noqa: BLE001 - a failing implementation becomes a note
                samples[name] = describe_failure(error)
    return samples


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as info:
            names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
    except OSError:  # no /proc (not Linux)
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def environment() -> dict:
    import exattn

    return {
        "torch": torch.__version__,
        "exattn": exattn.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }


def write_json(name: str, payload) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def result_rows(path: str) -> list[dict]:
    """The rows of a results file (each script's `--table FILE`)."""
    return json.loads(Path(path).read_text())["rows"]


def updated(results: dict, rows: list, meta: dict, cell) -> tuple[list, dict]:
    """(rows, meta) of `results` with the cells of `rows` (`cell(row)`: a row's cell) replaced by them,
    their run's meta under "updated" (a list: one entry per update, with its cells)."""
    measured = {cell(r) for r in rows}
    merged, placed = [], set()
    for r in results["rows"]:
        if cell(r) not in measured:
            merged.append(r)
        elif cell(r) not in placed:  # the cell's new rows where its old ones were
            merged += [x for x in rows if cell(x) == cell(r)]
            placed.add(cell(r))
    merged += [x for x in rows if cell(x) not in placed]
    old = dict(results["meta"])
    old["updated"] = [*old.get("updated", []), {**meta, "cells": sorted(measured)}]
    return merged, old


def cpu_parser(doc: str) -> argparse.ArgumentParser:
    """The CPU tables' shared options: shape, rounds and `--table`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--table", metavar="JSON", help="print the docs table of a results file and exit")
    return parser
