"""benchmarks/decode.py's CPU-side parts: block-table modes, interleaved rounds, the docs table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode as bench  # noqa: E402

CPU = torch.device("cpu")


def test_shared_tables_are_one_table_and_rotated_tables_one_per_pool():
    shared = bench.paged_caches(2, 64, 16, 3, CPU, table_mode="shared")
    rotated = bench.paged_caches(2, 64, 16, 3, CPU, table_mode="rotated")
    assert all(table is shared[0][2] for _, _, table in shared)
    assert len({tuple(table.flatten().tolist()) for _, _, table in rotated}) == 3
    for _, _, table in shared + rotated:  # every table is a permutation of the pool's 8 pages
        assert table.shape == (2, 4) and sorted(table.flatten().tolist()) == list(range(8))


def test_rounds_interleave_and_rows_keep_the_median(monkeypatch, tmp_path):
    order, times = [], iter([3.0, 1.0, 5.0, 2.0, 4.0, 6.0])

    def time_calls(calls, device):
        order.append(calls[0].__defaults__[2].__name__)
        return next(times), "host clock"

    def impl(name):
        def call(q, k, v):
            return q.new_zeros(q.shape[:3] + (v.shape[-1],))
        call.__name__ = name
        return lambda: call

    monkeypatch.setattr(bench, "time_calls", time_calls)
    monkeypatch.setattr(bench, "exattn_call", lambda lens: impl("ours")())
    monkeypatch.setattr(bench, "ANCHORS", {"sdpa_cudnn": impl("theirs")})
    monkeypatch.setattr(bench, "copies_for", lambda batch, context: 1)
    rows = bench.Rows(tmp_path / "rows.json", {})
    bench.run_contiguous(rows, 1, 64, ["exattn", "sdpa_cudnn"], CPU, deadline=float("inf"), rounds=3)
    assert order == ["ours", "theirs", "theirs", "ours", "ours", "theirs"]
    ours, theirs = rows.get("exattn", 1, 64), rows.get("sdpa_cudnn", 1, 64)
    assert ours["ms_rounds"] == [3.0, 2.0, 4.0] and ours["ms"] == 3.0
    assert theirs["ms_rounds"] == [1.0, 5.0, 6.0] and theirs["ms"] == 5.0


def test_docs_table_has_a_column_per_page_size_and_table_mode(tmp_path):
    def row(impl, ms, page_size=None, **table):
        tbps = bench.kv_bytes(8, 8192) / (ms * 1e-3) / 1e12
        return dict(impl=impl, batch=8, context=8192, page_size=page_size, tbps=tbps, ms=ms, **table)

    rows = [row("exattn", 0.10), row("sdpa_cudnn", 0.11), row("exattn", 0.125, 16, table="shared"),
            row("exattn", 0.20, 16, table="rotated")]
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(rows))
    header, _, line = bench.markdown_table(path).splitlines()
    assert "paged 16, one table TB/s" in header and "paged 16, a table per pool TB/s" in header
    assert line.endswith("(0.80x) | 1.34 (0.50x) |") and "1.10x" in line
    del rows[2]["table"], rows[3]  # a file from before the table modes: its paged rows had a table per pool
    path.write_text(json.dumps(rows))
    header, _, line = bench.markdown_table(path).splitlines()
    assert "paged 16, a table per pool" in header and "one table" not in header and line.endswith("(0.80x) |")


def test_rule_rows_carry_the_rule_the_keys_read_and_the_plain_kernels_speed(monkeypatch, tmp_path):
    """A window reads min(context, 4097) keys a sequence and its TB/s counts those; every rule row holds the
    plain kernel's TB/s of the same rounds and the ratio to it, the window's row also the ratio to the plain
    kernel over a cache of 4097 keys."""
    times = iter([2.0, 1.0, 4.0, 0.8])  # ms of plain, window, softcap, plain over 4097 keys: one round
    monkeypatch.setattr(bench, "time_calls", lambda calls, device: (next(times), "host clock"))
    monkeypatch.setattr(bench, "copies_for", lambda batch, context: 1)
    monkeypatch.setattr(bench, "HEADS_Q", 8)
    monkeypatch.setattr(bench, "HEADS_K", 2)
    monkeypatch.setattr(bench, "HEAD_DIM", 16)
    monkeypatch.setattr(bench, "DTYPE", torch.float32)
    rows = bench.Rows(tmp_path / "rows.json", {})
    bench.run_rules(rows, 1, 5000, ["window", "softcap"], CPU, deadline=float("inf"), rounds=1)
    by_rule = {row["rule"]: row for row in rows.rows}
    assert sorted(by_rule) == ["plain", "softcap", "window"]
    plain_tbps = bench.kv_bytes(1, 5000) / 2e-3 / 1e12
    assert by_rule["plain"]["tbps"] == pytest.approx(plain_tbps) and by_rule["plain"]["vs_plain"] == 1.0
    window = by_rule["window"]
    assert window["keys"] == 4097 and window["tbps"] == pytest.approx(bench.kv_bytes(1, 4097) / 1e-3 / 1e12)
    assert window["plain_tbps"] == pytest.approx(plain_tbps)
    assert window["vs_plain"] == pytest.approx(4097 / 5000 * 2)
    assert window["plain_same_keys_tbps"] == pytest.approx(bench.kv_bytes(1, 4097) / 0.8e-3 / 1e12)
    assert window["vs_plain_same_keys"] == pytest.approx(0.8)
    assert "vs_plain_same_keys" not in by_rule["softcap"]
    assert by_rule["softcap"]["vs_plain"] == pytest.approx(0.5)
    assert rows.get("exattn", 1, 5000) is None, "rule rows must not stand in for the main table's rows"
    assert json.loads((tmp_path / "rows.json").read_text())[1]["rule"] == "window"


def test_rule_arguments():
    assert bench.rule_arguments("window", CPU) == {"window": (4096, 0)}
    assert bench.rule_arguments("softcap", CPU) == {"softcap": 50.0}
    sinks = bench.rule_arguments("sinks", CPU)["sinks"]
    assert sinks.shape == (bench.HEADS_Q,) and sinks.dtype == torch.float32
    assert bench.rule_arguments("plain", CPU) == {}


@pytest.mark.parametrize("argv, message", [
    (["--table-modes", "shared,bogus"], "--table-modes must be among shared,rotated,identity, got shared,bogus"),
    (["--rules", "window,bogus"], "--rules must be among plain,window,softcap,sinks, got window,bogus"),
    (["--rounds", "0"], "expected an int >= 1, got '0'"),
])
def test_bad_arguments_name_the_flag(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["decode.py", "--device", "cpu", *argv])
    with pytest.raises(SystemExit):
        bench.main()
    assert message in capsys.readouterr().err
