"""benchmarks/host.py's rows: per-round ratios to cuDNN and to validate=False (the timing needs a GPU)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import host  # noqa: E402


def test_ratios_are_medians_of_per_round_ratios_against_the_rows_own_anchor():
    samples = {
        ("exattn", "fwd"): [10.0, 30.0, 20.0],
        ("exattn", "decode"): [11.0, 22.0, 33.0],
        ("exattn", "decode_unvalidated"): [10.0, 20.0, 30.0],
        ("exattn", "decode_paged_unvalidated"): [5.0, 5.0, 5.0],
        ("sdpa-cudnn", "fwd"): [20.0, 20.0, 40.0],  # the host slowed in the last round
        ("sdpa-cudnn", "decode"): [10.0, 10.0, 10.0],
        ("flex", "fwd"): "RuntimeError: no",
    }
    rows = {(r["impl"], r["call"]): r for r in host.rows_of(samples)}
    assert rows["exattn", "fwd"]["host_us"] == 20.0 and rows["exattn", "fwd"]["x_cudnn"] == 0.5
    assert rows["exattn", "decode"]["x_cudnn"] == 2.2 and rows["exattn", "decode"]["x_unvalidated"] == pytest.approx(1.1)
    assert rows["exattn", "decode_paged_unvalidated"]["x_cudnn"] == 0.5
    assert "x_unvalidated" not in rows["exattn", "decode_unvalidated"]
    assert "x_cudnn" not in rows["sdpa-cudnn", "fwd"]
    assert rows["flex", "fwd"]["host_us"] is None and rows["flex", "fwd"]["note"] == "RuntimeError: no"
