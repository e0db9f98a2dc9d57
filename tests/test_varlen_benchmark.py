"""benchmarks/varlen.py's packings, FLOP counts and table (the timing itself needs a GPU)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import varlen  # noqa: E402
from common import updated  # noqa: E402


@pytest.mark.parametrize("packing", list(varlen.PACKINGS))
def test_packings_fill_the_batch_within_their_bounds(packing):
    lengths = varlen.document_lengths(packing)
    assert sum(lengths) == varlen.TOKENS and min(lengths) > 0
    bounds = varlen.PACKINGS[packing]
    if bounds is None:
        assert len(set(lengths)) == 1
    else:
        assert max(lengths) <= bounds[1] and all(n >= bounds[0] for n in lengths[:-1])
    assert lengths == varlen.document_lengths(packing)  # fixed seed


def test_useful_flops_count_each_document_alone():
    assert varlen.useful_flops([2, 3], 4, 8, False) == 4 * 4 * 8 * (4 + 9)
    assert varlen.useful_flops([2, 3], 4, 8, True, backward=True) == 4 * 4 * 8 * (4 + 9) / 2 * 2.5


def test_table_reports_ratios_and_failures():
    def row(impl, fwd, bwd):
        return dict(impl=impl, packing="equal", head_dim=64, causal=False, documents=8, fwd_tflops=fwd, bwd_tflops=bwd)

    rows = [row("exattn-varlen", 400.0, 300.0), row("exattn-padded", 400.0, 150.0),
            row("sdpa-cudnn-padded", 200.0, 300.0), row("flex-document", None, None)]
    line = varlen.table(rows).splitlines()[-1]
    assert line == "| equal | 64 | no | 8 | 400 | 1.00 | 2.00 | – | 300 | 2.00 | 1.00 | – | – |"
    line = varlen.table(rows + [row("exattn-varlen-unvalidated", 500.0, 300.0)]).splitlines()[-1]
    assert line.endswith("| 1.25 |")


def test_update_replaces_only_the_measured_cells_in_place():
    def row(packing, d, impl, tflops):
        return dict(impl=impl, packing=packing, head_dim=d, causal=False, fwd_tflops=tflops)

    results = {"meta": {"date": "old"}, "rows": [row("equal", 64, "a", 1.0), row("equal", 64, "b", 2.0),
                                                 row("short", 64, "a", 3.0), row("short", 128, "a", 4.0)]}
    new_rows = [row("short", 64, "a", 30.0), row("short", 64, "b", 31.0)]
    rows, meta = updated(results, new_rows, {"date": "new"}, varlen.cell_of)
    assert [(r["packing"], r["head_dim"], r["impl"], r["fwd_tflops"]) for r in rows] == [
        ("equal", 64, "a", 1.0), ("equal", 64, "b", 2.0), ("short", 64, "a", 30.0), ("short", 64, "b", 31.0),
        ("short", 128, "a", 4.0)]
    assert meta == {"date": "old", "updated": [{"date": "new", "cells": [("short", 64, False)]}]}
