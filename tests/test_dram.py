"""Measured DRAM bytes through Nsight Compute: finding ncu, its command line, parsing its CSV, failures.

No GPU here: a fake `ncu` (a script printing ncu's CSV) stands in for the real one.
"""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest
import torch

from exattn.experiment import dram
from exattn.experiment.workload import RunSpec

# ncu --csv (details page) as Nsight Compute prints it: its own ==PROF== lines, the program's output,
# one row per (kernel, metric), quoted fields, kernel names with commas, thousands separators.
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def kernel_rows(kid: int, name: str, read: tuple[str, str], write: tuple[str, str]) -> list[str]:
    front = (f'"{kid}","4242","python3.12","127.0.0.1","{name}","1","7","(128, 1, 1)","(32, 2, 1)","0","9.0",'
             '"Command line profiler metrics"')
    return [f'{front},"dram__bytes_read.sum","{read[1]}","{read[0]}"',
            f'{front},"dram__bytes_write.sum","{write[1]}","{write[0]}"']


DETAILS = "\n".join([
    "==PROF== Connected to process 4242 (/opt/torch/.venv/bin/python3.12)",
    'some line the program printed, with "quotes" inside',
    '==PROF== Profiling "_attn_fwd" - 0: 0%....50%....100% - 1 pass',
    '==PROF== Profiling "_attn_bwd_dkdv" - 1: 0%....50%....100% - 1 pass',
    '==PROF== Profiling "vectorized_elementwise_kernel" - 2: 0%....50%....100% - 1 pass',
    "==PROF== Disconnected from process 4242",
    HEADER,
    *kernel_rows(0, "_attn_fwd", ("1,048,576", "byte"), ("524,288", "byte")),
    *kernel_rows(1, "_attn_bwd_dkdv", ("2,097,152", "byte"), ("1,050,624", "byte")),
    *kernel_rows(2, "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
                    "std::array<char *, 1>>(int, T2, T3)", ("0", "byte"), ("131,072", "byte")),
]) + "\n"
DETAILS_READ = 1_048_576 + 2_097_152
DETAILS_WRITE = 524_288 + 1_050_624 + 131_072

# --page raw: one column per metric, a row of units, one row per kernel.
RAW = "\n".join([
    "==PROF== Connected to process 77 (/usr/bin/python3)",
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","dram__bytes_read.sum",'
    '"dram__bytes_write.sum","gpu__time_duration.sum"',
    '"","","","","","","","Mbyte","Kbyte","nsecond"',
    '"0","77","python3","localhost","_attn_fwd","1","7","1.50","256.00","9,120"',
    '"1","77","python3","localhost","_attn_bwd","1","7","2.25","1,024.50","18,400"',
])


def spec(**overrides) -> RunSpec:
    fields = dict(phase="prefill", impl="triton", dtype="bf16", seq_len=1024, causal=False, dropout_p=0.0,
                  block_m=64, block_n=64, batch=1, heads=2, heads_k=2, head_dim=64, seed=0, device="cuda")
    return RunSpec(**(fields | overrides))


# ---------------------------------------------------------------- parsing

def test_parse_details_page_sums_every_kernel():
    totals = dram.parse_ncu_csv(DETAILS)
    assert totals == dram.Totals(DETAILS_READ, DETAILS_WRITE, 3)


def test_parse_raw_page_with_a_units_row():
    totals = dram.parse_ncu_csv(RAW)
    assert totals.kernels == 2
    assert totals.read == pytest.approx((1.50 + 2.25) * 1e6)
    assert totals.write == pytest.approx((256.0 + 1024.5) * 1e3)


@pytest.mark.parametrize("value, unit, expected", [
    ("1,048,576", "byte", 1_048_576), ("0", "byte", 0), ("12.58", "Kbyte", 12_580), ("3.5", "Mbyte", 3_500_000),
    ("1.25", "Gbyte", 1.25e9), ("2", "KB", 2000), ("1", "MiB", 2**20), (" 7 ", " byte ", 7),
])
def test_units_convert_to_bytes(value, unit, expected):
    assert dram.to_bytes(value, unit) == pytest.approx(expected)


def test_bad_values_and_tables_are_errors_not_numbers():
    with pytest.raises(ValueError, match="unknown unit 'sector'"):
        dram.to_bytes("4", "sector")
    with pytest.raises(ValueError, match="not a number: 'n/a'"):
        dram.to_bytes("n/a", "byte")
    with pytest.raises(ValueError, match="no CSV table"):
        dram.parse_ncu_csv("==PROF== Connected\n==WARNING== No kernels were profiled.\n")
    only_read = "\n".join([HEADER, kernel_rows(0, "k", ("1", "byte"), ("2", "byte"))[0]])
    with pytest.raises(ValueError, match="no dram__bytes_write.sum"):
        dram.parse_ncu_csv(only_read)
    assert dram.parse_ncu_csv(HEADER + "\n") == dram.Totals(0, 0, 0)


def test_outcome_becomes_row_fields_or_an_error():
    ok = dram.read_outcome(dram.Outcome(0, DETAILS, ""), "Version 2025.3.1.0")
    assert ok["dram_read_bytes"] == DETAILS_READ and ok["dram_write_bytes"] == DETAILS_WRITE
    assert ok["dram_bytes"] == DETAILS_READ + DETAILS_WRITE and ok["dram_kernels"] == 3
    assert "2025.3.1" in ok["dram_method"] and "3 kernels" in ok["dram_method"]
    refused = dram.read_outcome(dram.Outcome(1, "==PROF== Connected to process 9\n",
                                             "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission\n"))
    assert refused.keys() == {"dram_error"}
    assert "exited with status 1" in refused["dram_error"] and "ERR_NVGPUCTRPERM" in refused["dram_error"]
    empty = dram.read_outcome(dram.Outcome(0, HEADER + "\n", ""))
    assert "no kernel" in empty["dram_error"]
    none = dram.read_outcome(dram.Outcome(0, "==WARNING== No kernels were profiled.\n", ""))
    assert "no CSV table" in none["dram_error"] and "No kernels were profiled" in none["dram_error"]
    many = "\n".join([HEADER] + [row for k in range(dram.MAX_KERNELS + 1)
                                 for row in kernel_rows(k, "k", ("1", "byte"), ("1", "byte"))])
    assert "more than 200 kernels" in dram.read_outcome(dram.Outcome(0, many, ""))["dram_error"]


# ---------------------------------------------------------------- the command line and finding ncu

def test_ncu_command_for_a_spec():
    run = spec(causal=True, block_m=128)
    command = dram.ncu_command("/opt/nvidia/nsight-compute/2025.3.1/ncu", run)
    assert command == [
        "/opt/nvidia/nsight-compute/2025.3.1/ncu", "--csv", "--print-units", "base", "--print-metric-name", "name",
        "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum",
        "--profile-from-start", "off", "--launch-count", "201",
        "--cache-control", "all", "--clock-control", "none",
        sys.executable, "-c", "import sys; from exattn.experiment.dram import child_main; child_main(sys.argv[1])",
        json.dumps(run.as_dict(), sort_keys=True),
    ]
    assert RunSpec(**json.loads(command[-1])) == run


def executable(path, text: str = "#!/bin/sh\nexit 0\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_ncu_override_path_and_install_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(dram, "NCU_GLOB", str(tmp_path / "nsight-compute" / "*" / "ncu"))
    monkeypatch.delenv("EXATTN_NCU", raising=False)
    assert dram.find_ncu() is None
    assert "not found" in dram.dram_status("cuda", True) and "--dram" not in dram.dram_status("cuda", True)
    for version in ("2024.1.0", "2025.3.1", "2025.10.0"):
        executable(tmp_path / "nsight-compute" / version / "ncu")
    assert dram.find_ncu() == str(tmp_path / "nsight-compute" / "2025.10.0" / "ncu")
    assert "pass --dram" in dram.dram_status("cuda", False)
    on_path = executable(tmp_path / "bin" / "ncu")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert dram.find_ncu() == str(on_path)
    mine = executable(tmp_path / "mine" / "ncu-wrapper")
    monkeypatch.setenv("EXATTN_NCU", str(mine))
    assert dram.find_ncu() == str(mine)
    monkeypatch.setenv("EXATTN_NCU", str(tmp_path / "missing"))
    assert dram.find_ncu() is None and "EXATTN_NCU" in dram.not_found()


def test_cpu_and_missing_ncu_give_an_error_row(monkeypatch):
    cpu = dram.measure_dram(spec(device="cpu"))
    assert cpu.keys() == {"dram_error"} and "no DRAM counters on cpu" in cpu["dram_error"]
    assert "not available" in dram.dram_status("cpu", False) or "uncore" in dram.dram_status("cpu", False)
    monkeypatch.setenv("EXATTN_NCU", "/nonexistent/ncu")
    missing = dram.measure_dram(spec())
    assert missing.keys() == {"dram_error"} and "not found" in missing["dram_error"]


# ---------------------------------------------------------------- end to end with a fake ncu

FAKE_NCU = """#!{python}
import json, os, sys, time
args = sys.argv[1:]
if args == ["--version"]:
    print("NVIDIA (R) Nsight Compute Command Line Profiler\\nVersion 2099.1.0.0 (fake)")
    sys.exit(0)
with open(os.environ["FAKE_NCU_ARGS"], "w") as f:
    json.dump({{"args": args, "pythonpath": os.environ.get("PYTHONPATH", "")}}, f)
mode = os.environ.get("FAKE_NCU_MODE", "ok")
if mode == "sleep":
    time.sleep(60)
if mode == "refuse":
    print("==PROF== Connected to process 1")
    print("==ERROR== Failed to initialize the profiler: LibraryNotLoaded", file=sys.stderr)
    sys.exit(3)
sys.stdout.write(os.environ["FAKE_NCU_CSV"])
"""


@pytest.fixture
def fake_ncu(tmp_path, monkeypatch):
    path = executable(tmp_path / "ncu", FAKE_NCU.format(python=sys.executable))
    monkeypatch.setenv("EXATTN_NCU", str(path))
    monkeypatch.setenv("FAKE_NCU_ARGS", str(tmp_path / "args.json"))
    monkeypatch.setenv("FAKE_NCU_CSV", DETAILS)
    dram.ncu_version.cache_clear()
    yield path, tmp_path / "args.json"
    dram.ncu_version.cache_clear()


def test_measure_dram_runs_ncu_and_sums_its_table(fake_ncu):
    path, args_file = fake_ncu
    run = spec(seq_len=4096, block_m=128)
    result = dram.measure_dram(run, timeout=60)
    assert result["dram_bytes"] == DETAILS_READ + DETAILS_WRITE and result["dram_kernels"] == 3
    assert "Version 2099.1.0.0 (fake)" in result["dram_method"]
    seen = json.loads(args_file.read_text())
    assert [str(path)] + seen["args"] == dram.ncu_command(str(path), run)
    source = os.path.dirname(os.path.dirname(os.path.abspath(dram.exattn.__file__)))
    assert seen["pythonpath"].split(os.pathsep)[0] == source
    assert "measured per run by" in dram.dram_status("cuda", True) and "2099.1.0.0" in dram.dram_status("cuda", True)


def test_measure_dram_reports_ncu_failures_and_time_outs(fake_ncu, monkeypatch):
    monkeypatch.setenv("FAKE_NCU_MODE", "refuse")
    refused = dram.measure_dram(spec(), timeout=60)
    assert "status 3" in refused["dram_error"] and "LibraryNotLoaded" in refused["dram_error"]
    monkeypatch.setenv("FAKE_NCU_MODE", "sleep")
    slow = dram.measure_dram(spec(), timeout=1)
    assert slow == {"dram_error": "ncu did not finish within 1 s (--memory-timeout)"}


# ---------------------------------------------------------------- the profiled child

def test_child_warms_up_outside_the_profiler_window(monkeypatch):
    events = []
    real_run_once = dram.run_once

    def run_once(run, inputs):
        events.append("run")
        return real_run_once(run, inputs)

    monkeypatch.setattr(dram, "run_once", run_once)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: events.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: events.append("stop"))
    run = spec(device="cpu", impl="tiled", seq_len=40, dtype="fp32", block_m=16, block_n=16)
    dram.child_main(json.dumps(run.as_dict()))
    assert events == ["run", "start", "run", "stop"]
