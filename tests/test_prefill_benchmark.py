"""benchmarks/prefill.py's CPU-side parts: arguments and the interleaved rounds (no GPU needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import prefill  # noqa: E402

CELL = dict(dtype="fp16", head_dim=64, causal=False, seqlen=4096, batch=4, heads=32)


@pytest.mark.parametrize("rounds", ["0", "-2", "two"])
def test_rounds_must_be_a_positive_int(rounds, capsys):
    with pytest.raises(SystemExit):
        prefill.parse_args(["--rounds", rounds])
    err = capsys.readouterr().err
    assert "--rounds" in err and f"expected an int >= 1, got {rounds!r}" in err


def test_rounds_interleave_and_rows_keep_the_median(monkeypatch):
    calls = []
    times = iter([(1.0, 2.0), (9.0, 9.0), (4.0, 5.0), (3.0, 3.0), (5.0, 6.0), (6.0, 8.0)])

    def measure(impl, cell, warmup_ms, rep_ms):
        calls.append(impl)
        if impl == "bad":
            raise RuntimeError("boom")
        return next(times)

    monkeypatch.setattr(prefill, "measure", measure)
    args = prefill.parse_args(["--rounds", "3", "--flex-dtypes", "bf16"])
    samples = prefill.timed_rounds(["a", "bad", "flex", "b"], CELL, args)
    assert calls == ["a", "bad", "b", "b", "a", "a", "b"]  # reversed every other round; failures not retried
    assert samples["bad"] == "RuntimeError: boom" and samples["flex"].startswith("skipped")
    row = prefill.row_for("a", CELL, samples["a"])
    assert row["fwd_ms_rounds"] == [1.0, 3.0, 5.0] and row["fwd_ms"] == 3.0 and row["bwd_ms"] == 3.0
    assert prefill.row_for("bad", CELL, samples["bad"])["fwd_tflops"] is None


def test_update_keeps_the_cells_not_measured(monkeypatch, tmp_path):
    monkeypatch.setattr(prefill, "prewarm", lambda jobs, workers: None)
    monkeypatch.setattr(prefill, "versions", lambda: {"date": "new"})
    monkeypatch.setattr(prefill, "measure", lambda impl, cell, warmup_ms, rep_ms: (2.0, 4.0))
    out = tmp_path / "prefill.json"
    common = ["--impls", "sdpa-cudnn", "--dtypes", "bf16", "--head-dims", "64", "--causal", "1", "--rounds", "1",
              "--out", str(out)]
    prefill.main([*common, "--seqlens", "512,1024"])
    before = {row["seqlen"]: row["fwd_ms"] for row in json.loads(out.read_text())["rows"]}
    monkeypatch.setattr(prefill, "measure", lambda impl, cell, warmup_ms, rep_ms: (1.0, 3.0))
    prefill.main([*common, "--seqlens", "1024", "--update"])
    results = json.loads(out.read_text())
    assert before == {512: 2.0, 1024: 2.0}
    assert {row["seqlen"]: row["fwd_ms"] for row in results["rows"]} == {512: 2.0, 1024: 1.0}
    assert results["meta"]["updated"] == [{"date": "new", "cells": [["bf16", 64, True, 1024]]}]
