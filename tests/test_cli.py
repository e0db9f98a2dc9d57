"""The `exattn` command end to end: experiment on a tiny sweep, memory, plan, bad arguments."""

from __future__ import annotations

import csv
import json

import pytest

from exattn.cli import main

TINY = ["--seq-lens", "32,48", "--tiles", "16x16,16x32", "--dtypes", "fp32,bf16",
        "--dropout", "0,0.1", "--dropout-seq-lens", "32", "--repeats", "1"]
FILES = ("results.json", "results.csv", "report.md", "error_vs_tile.png", "memory_vs_n.png",
         "time_vs_n.png", "traffic_vs_tile.png")
ROW_FIELDS = (
    "phase", "impl", "dtype", "seq_len", "causal", "dropout_p", "block_m", "block_n", "status",
    "implementation", "entry_point",
    "out_err_max_abs", "out_err_rel", "out_err_ratio_naive",
    "grad_err_max_abs", "grad_err_rel", "grad_err_ratio_naive",
    "peak_bytes", "peak_method", "traffic_model_bytes", "time_fwd_ms", "time_bwd_ms", "time_total_ms",
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("experiment")
    assert main(["experiment", "--out", str(out), *TINY]) == 0
    return out


def test_experiment_writes_every_file(tiny_run):
    for name in FILES:
        assert (tiny_run / name).stat().st_size > 0, name
    with (tiny_run / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(json.loads((tiny_run / "results.json").read_text())["rows"])


def test_results_json_has_the_required_fields(tiny_run):
    data = json.loads((tiny_run / "results.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert meta["baseline"] == "naive" and meta["versions"]["torch"] and meta["versions"]["exattn"]
    assert meta["device"] == "cpu" and meta["device_name"]
    assert "not available" in meta["dram_measured"] or "uncore" in meta["dram_measured"]
    assert meta["config"]["dram"] is False
    # 2 causal x (2 lengths + 1 dropout length) x 2 dtypes x 3 impls, + decode 2 dtypes x 2 lengths x 3
    assert len(rows) == 2 * 3 * 2 * 3 + 2 * 2 * 3
    for row in rows:
        assert row["status"] == "ok", row
        for field in ROW_FIELDS:
            assert field in row, field
        assert row["out_err_max_abs"] >= 0 and row["traffic_model_bytes"] > 0
        assert row["peak_bytes"] is not None and row["time_fwd_ms"] > 0
        assert not any(key.startswith("dram_") for key in row)  # measured only with --dram on cuda
        if row["phase"] == "prefill":
            assert row["grad_err_max_abs"] >= 0 and row["grad_err_ratio_naive"] is not None
        else:
            assert row["grad_err_max_abs"] is None and row["entry_point"].startswith(
                "exattn.attention" if row["impl"] == "naive" else "exattn.decode")
    naive = [r for r in rows if r["impl"] == "naive"]
    assert all(r["out_err_ratio_naive"] == 1.0 for r in naive)
    assert {r["dropout_p"] for r in rows} == {0.0, 0.1}


def test_report_names_the_baseline_and_reads_the_results(tiny_run):
    report = (tiny_run / "report.md").read_text()
    assert "## What was found" in report and "## Tables" in report
    assert report.count("Baseline: `naive` backend of exattn") == 2 * 2 * 2 + 2  # one per table
    assert "torch 2." in report and "MODEL" in report and "![Measured peak memory" in report
    assert "measured DRAM bytes: not available on this CPU" in report or "uncore" in report
    assert "DRAM MiB" not in report and "dram_bytes" not in (tiny_run / "results.csv").read_text()


def test_memory_command_prints_exact_sizes(capsys):
    assert main(["memory", "--seq-len", "16384", "--head-dim", "64", "--dtype", "fp16"]) == 0
    text = capsys.readouterr().out
    assert "268,435,456 entries" in text and "536,870,912 bytes = 512 MiB" in text
    assert "1,048,576 entries" in text and "2,097,152 bytes = 2 MiB" in text
    assert "tensor sizes, not measured peak memory" in text


def test_plan_command_respects_its_bound(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "--seq-len", "40", "--head-dim", "16", "--dtype", "fp16", "--heads", "2",
                 "--causal", "--max-error", "5e-3", "--tiles", "16x16,32x32,16x40", "--trials", "1",
                 "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "Choice: block_m=" in text and "Evidence" in text
    result = json.loads(out.read_text())
    choice = result["choice"]
    assert choice["out_err_rel"] <= 5e-3 and choice["grad_err_rel"] <= 5e-3
    measured = [c for c in result["candidates"] if c["out_err_rel"] is not None]
    assert all((c["out_err_rel"] <= 5e-3 and c["grad_err_rel"] <= 5e-3) == (c["verdict"] == "meets the bound")
               for c in measured)


def test_plan_command_exits_1_when_nothing_meets_the_bound(capsys):
    code = main(["plan", "--seq-len", "32", "--head-dim", "16", "--dtype", "bf16", "--max-error", "1e-9",
                 "--tiles", "16x16", "--trials", "1"])
    assert code == 1
    assert "NO candidate met the bound" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["experiment", "--tiles", "16by16"], "--tiles must hold tiles written BLOCK_MxBLOCK_N"),
    (["experiment", "--seq-lens", "256,abc"], "--seq-lens must hold positive integers, got 'abc'"),
    (["experiment", "--dtypes", "fp8"], "--dtypes must hold fp32, fp16 or bf16, got 'fp8'"),
    (["experiment", "--dropout", "1.5"], "--dropout must hold dropout probabilities in [0, 1)"),
    (["experiment", "--device", "cuda"], "no CUDA device is available"),
    (["experiment", "--repeats", "0"], "--repeats must be an integer >= 1, got '0'"),
    (["experiment", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["memory", "--seq-len", "0", "--head-dim", "64"], "argument --seq-len: must be a positive int, got '0'"),
    (["memory", "--seq-len", "8", "--head-dim", "64", "--dtype", "int8"], "--dtype must be one of fp16"),
    (["memory", "--head-dim", "64"], "the following arguments are required: --seq-len"),
    (["plan", "--seq-len", "64", "--head-dim", "16"], "the following arguments are required: --max-error"),
    (["plan", "--seq-len", "64", "--head-dim", "16", "--max-error", "-1"], "must be a positive float"),
    (["plan", "--seq-len", "64", "--head-dim", "16", "--max-error", "0.1", "--tiles", "8"], "--tiles"),
    (["launch"], "invalid choice: 'launch'"),
    (["experiment", "--dram"], "--dram needs --device cuda, got --device cpu"),
])
def test_bad_arguments_exit_2_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_dram_without_ncu_exits_2(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # get past the device check
    monkeypatch.setenv("EXATTN_NCU", str(tmp_path / "no-ncu"))
    with pytest.raises(SystemExit) as exit_info:
        main(["experiment", "--device", "cuda", "--dram", "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "--dram: Nsight Compute (ncu) not found" in capsys.readouterr().err
    config = tmp_path / "c.toml"
    config.write_text("[experiment]\ndram = true\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["experiment", "--config", str(config), "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "--dram needs --device cuda" in capsys.readouterr().err


def test_bad_config_file_exits_2(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text("tiles = ['16x16']\nwarmup = -1\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["experiment", "--config", str(path), "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "--warmup must be an integer >= 0, got -1" in capsys.readouterr().err


def test_plan_command_proven_bound(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "--seq-len", "256", "--head-dim", "32", "--dtype", "fp32", "--max-error", "1e-4",
                 "--bound", "proven", "--score-bound", "4", "--out", str(out)])
    assert code == 0
    assert "nothing was run" in capsys.readouterr().out
    choice = json.loads(out.read_text())["choice"]
    assert max(choice["out_bound"], choice["lse_bound"], choice["grad_bound"]) <= 1e-4
    assert choice["out_err_rel"] is None  # proven mode measures nothing


@pytest.mark.parametrize("extra, message", [
    ([], "--score-bound"),
    (["--score-bound", "4", "--backend", "triton"], "tiled backend only"),
])
def test_plan_command_proven_needs_its_inputs(extra, message, capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--seq-len", "64", "--head-dim", "16", "--max-error", "0.1", "--bound", "proven", *extra])
    assert message in capsys.readouterr().err


def test_report_has_the_proven_bound_column(tiny_run):
    report = (tiny_run / "report.md").read_text()
    assert "proven bound" in report and "Proven bound (fp32" in report
    rows = json.loads((tiny_run / "results.json").read_text())["rows"]
    bounded = [r for r in rows if r.get("proven_out_bound") is not None]
    assert bounded and all(r["impl"] == "tiled" and r["dropout_p"] == 0 for r in bounded)
    assert all(r["out_err_over_max_v"] <= r["proven_out_bound"] for r in bounded)
