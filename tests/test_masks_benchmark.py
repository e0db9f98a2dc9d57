"""benchmarks/masks.py's pair counts and rule keywords (the timing itself needs a GPU)."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import masks  # noqa: E402


def brute_force_pairs(rule: str, n: int) -> int:
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = j <= i
    if rule == "prefix":
        allowed = allowed | (j < masks.PREFIX)
    if rule == "sinks":
        allowed = allowed & (i - j < masks.WINDOW)
    if rule == "segment_ids":
        doc = masks.keywords(rule, n, 2, "cpu")["segment_ids"][0]
        allowed = allowed & (doc[:, None] == doc[None, :])
    return int(allowed.sum())


@pytest.mark.parametrize("rule", masks.RULES)
def test_allowed_pairs_count_the_rule(rule):
    assert masks.allowed_pairs(rule, 6000) == brute_force_pairs(rule, 6000)


def test_keywords_are_what_exattn_takes():
    import exattn

    q = torch.randn(1, 2, 300, 16)
    for rule in masks.RULES:
        kw = masks.keywords(rule, 300, 2, "cpu")
        assert exattn.attention(q, q, q, causal=True, **kw).shape == q.shape
    assert masks.alibi_slopes(8)[0] == 0.5


def test_table_gives_each_rule_over_the_plain_call_and_over_flex(tmp_path, capsys):
    rows = [dict(impl="exattn", rule="plain", fwd_tflops=600.0, bwd_tflops=500.0),
            dict(impl="flex", rule="plain", fwd_tflops=400.0, bwd_tflops=250.0),
            dict(impl="exattn", rule="softcap", fwd_tflops=450.0, bwd_tflops=400.0),
            dict(impl="flex", rule="softcap", error="failed: OutOfMemoryError"),
            dict(impl="exattn", rule="prefix", error="failed: RuntimeError")]
    lines = masks.table(rows).splitlines()
    assert lines[2] == "| plain (Gluon) | 600 | 1.00 | 1.50 | 500 | 1.00 | 2.00 |"
    assert "| softcap 50 | 450 | 0.75 | – | 400 | 0.80 | – |" in lines
    assert "| prefix 1024 | failed: RuntimeError | | | | | |" in lines
    assert "| ALiBi | not run | | | | | |" in lines
    path = tmp_path / "masks.json"
    path.write_text(json.dumps({"meta": {}, "rows": rows}))
    masks.main(["--table", str(path)])
    assert capsys.readouterr().out.splitlines() == lines
