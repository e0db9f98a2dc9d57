"""benchmarks/cpu_varlen.py: its implementations compute the same packed attention, and its table."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cpu_varlen  # noqa: E402


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_and_per_document_sdpa_agree_and_padding_keeps_each_document(causal):
    lengths = [70, 5, 130]
    q, k, v = (x.double() for x in cpu_varlen.inputs("exattn varlen", lengths, 2, 16, backward=False))
    ours = cpu_varlen.runner("exattn varlen", lengths, causal, q, k, v)()
    per_doc = cpu_varlen.runner("sdpa per doc", lengths, causal, q, k, v)()
    torch.testing.assert_close(ours, per_doc, rtol=1e-10, atol=1e-10)
    padded = cpu_varlen.inputs("sdpa padded", lengths, 2, 16, backward=True)
    assert padded[0].shape == (3, 2, 130, 16) and padded[0].requires_grad
    assert cpu_varlen.runner("sdpa padded", lengths, causal, *padded)().shape == (3, 2, 130, 16)


def test_table_gives_gflops_memory_and_time_ratios():
    rows = [dict(packing="equal", causal=True, impl=impl, **{"pass": "fwd"}, seconds=seconds,
                 useful_gflops=gflops, peak_rss_growth_mib=mib)
            for impl, seconds, gflops, mib in (("exattn varlen", 1.0, 100.0, 40.0), ("sdpa padded", 2.0, 50.0, 300.0),
                                               ("sdpa per doc", 1.5, 66.7, 20.0))]
    lines = cpu_varlen.table(rows).splitlines()
    assert lines[2] == ("| equal | yes | fwd | 100 GFLOP/s, 40 MiB | 50 GFLOP/s, 300 MiB | 67 GFLOP/s, 20 MiB | "
                        "2.00 | 1.50 |")
    assert len(lines) == 3
