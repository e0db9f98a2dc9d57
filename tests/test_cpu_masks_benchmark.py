"""benchmarks/cpu_masks.py: each implementation computes the same rule, and its table."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cpu_masks  # noqa: E402


@pytest.mark.parametrize("rule", cpu_masks.RULES)
def test_dense_forms_compute_the_keyword_rule(rule):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1100, 16, dtype=torch.float64) for _ in range(3))
    keyword = cpu_masks.runner("exattn", rule, q, k, v, None)()
    if rule == "sinks":  # the dense form is the window alone: the sinks only take weight off it
        keyword = cpu_masks.exattn.attention(q, k, v, causal=True, window=(cpu_masks.WINDOW - 1, 0))
    for impl in cpu_masks.IMPLS[1:]:
        fn = cpu_masks.runner(impl, rule, q, k, v, cpu_masks.dense_rule(rule, 1100, 2, q.dtype))
        if rule == "softcap" or (rule == "sinks" and impl == "exattn mask"):
            assert fn is None
            continue
        torch.testing.assert_close(fn(), keyword, rtol=1e-9, atol=1e-9)


def test_table_gives_seconds_and_memory_of_every_implementation():
    rows = [dict(rule="plain", impl=impl, **{"pass": p}, seconds=1.5, peak_rss_growth_mib=99.4)
            for impl in cpu_masks.IMPLS for p in cpu_masks.PASSES]
    rows.append(dict(rule="softcap", impl="exattn", **{"pass": "fwd"}, seconds=2.0, peak_rss_growth_mib=20))
    lines = cpu_masks.table(rows).splitlines()
    assert lines[2] == "| plain causal |" + " 1.50 s, 99 MiB |" * 6
    assert lines[5] == "| softcap 50 | 2.00 s, 20 MiB |" + " – |" * 5
