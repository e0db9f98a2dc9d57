"""benchmarks/plot.py: the figures of the canonical prefill and decode tables, and its input checks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import plot  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    assert path.is_file()
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000  # axes, lines and text, not an empty canvas


def test_prefill_figure_from_the_canonical_table(tmp_path):
    rows, meta = plot.load_rows(RESULTS / "prefill-h200.json", plot.PREFILL_KEYS)
    assert_png(plot.plot_prefill(rows, meta, tmp_path / "prefill.png", "bf16", 128))


def test_decode_figure_from_the_canonical_table(tmp_path):
    rows, meta = plot.load_rows(RESULTS / "decode-h200.json", plot.DECODE_KEYS)
    assert_png(plot.plot_decode(rows, meta, tmp_path / "decode.png"))


def test_command_line_writes_both_figures_named_after_their_json(tmp_path):
    plot.main(["--out", str(tmp_path)])
    assert_png(tmp_path / "prefill-h200.png")
    assert_png(tmp_path / "decode-h200.png")


def test_missing_keys_name_the_file_row_and_keys(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text(json.dumps({"meta": {}, "rows": [{"impl": "exattn-triton", "dtype": "bf16", "seqlen": 1024}]}))
    with pytest.raises(ValueError, match=r"broken\.json: row 0 lacks required key\(s\) head_dim, causal, "
                                         r"fwd_tflops, bwd_tflops"):
        plot.load_rows(path, plot.PREFILL_KEYS)


@pytest.mark.parametrize("data", [[], {"meta": {}}, {"rows": []}])
def test_a_file_without_rows_is_an_error(tmp_path, data):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no rows"):
        plot.load_rows(path, plot.DECODE_KEYS)


def test_a_dtype_or_head_dim_not_in_the_table_says_what_is(tmp_path):
    rows, meta = plot.load_rows(RESULTS / "prefill-h200.json", plot.PREFILL_KEYS)
    with pytest.raises(ValueError, match=r"no prefill rows for bf16 d=96; the file has .*\('bf16', 128\)"):
        plot.plot_prefill(rows, meta, tmp_path / "prefill.png", "bf16", 96)
    assert not (tmp_path / "prefill.png").exists()
