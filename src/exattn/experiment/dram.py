"""Measured DRAM bytes of one run, read from the GPU's hardware counters by Nsight Compute (`ncu`).

For each run the sweep starts `ncu ... python -c CHILD SPEC` (`ncu_command`).
The child (`measure_child`) builds the run's inputs with `workload.make_inputs`,
runs `workload.run_once` once as a warm-up (Triton compilation, input creation
and allocator growth are not counted), then runs it once more between
`cudaProfilerStart` and `cudaProfilerStop`, ending with a synchronize. With
`--profile-from-start off` ncu profiles exactly the kernels launched in that
window, from any thread: the backward's kernels are launched by autograd's
device thread, which a thread-local NVTX push/pop range would miss. ncu
reports `dram__bytes_read.sum` and `dram__bytes_write.sum` per kernel;
`parse_ncu_csv` sums them over every kernel of the call.

`--cache-control all` (ncu's default, made explicit) flushes the L2 before each
kernel, so every kernel starts cold; L2 hits inside a kernel are not DRAM
traffic, so the measurement can be far below the traffic model, which assumes
no cache. `--clock-control none` leaves the GPU's clocks alone.

Every failure (no ncu, ncu refused, no kernels, an unreadable table, a time-out)
becomes `{"dram_error": ...}`, never an exception in the sweep.
"""

from __future__ import annotations

import csv
import functools
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import torch

import exattn

from .workload import RunSpec, make_inputs, run_once, synchronize

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
MAX_KERNELS = 200
CHILD = "import sys; from exattn.experiment.dram import child_main; child_main(sys.argv[1])"
NCU_GLOB = "/opt/nvidia/nsight-compute/*/ncu"
SEARCHED = f"searched $EXATTN_NCU, PATH and {NCU_GLOB}"
METHOD = ("Nsight Compute hardware counters: dram__bytes_read.sum + dram__bytes_write.sum summed over "
          "every kernel of one forward (+ backward) call after a warm-up; L2 flushed before each kernel "
          "(--cache-control all), clocks untouched (--clock-control none)")
UNITS = {
    "byte": 1, "b": 1, "kbyte": 1e3, "kb": 1e3, "mbyte": 1e6, "mb": 1e6,
    "gbyte": 1e9, "gb": 1e9, "tbyte": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
}


class Totals(NamedTuple):
    """Bytes read from and written to DRAM, summed over `kernels` profiled kernels."""

    read: float
    write: float
    kernels: int


# ---------------------------------------------------------------- finding ncu

def version_key(path: str) -> tuple[int, ...]:
    """/opt/nvidia/nsight-compute/2025.3.1/ncu -> (2025, 3, 1), for picking the newest."""
    return tuple(int(x) for x in re.findall(r"\d+", Path(path).parent.name))


def find_ncu() -> str | None:
    """$EXATTN_NCU if it is an executable file, else `ncu` on PATH, else the newest /opt/nvidia one."""
    override = os.environ.get("EXATTN_NCU")
    if override:
        return override if os.path.isfile(override) and os.access(override, os.X_OK) else None
    found = shutil.which("ncu")
    if found:
        return found
    installed = sorted(glob.glob(NCU_GLOB), key=version_key)
    return installed[-1] if installed else None


@functools.lru_cache(maxsize=None)
def ncu_version(ncu: str) -> str:
    """The last line of `ncu --version` ("Version 2025.3.1.0 ..."), or why it could not be read."""
    try:
        done = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"version unknown ({type(err).__name__})"
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else f"version unknown (exit status {done.returncode})"


def not_found() -> str:
    override = os.environ.get("EXATTN_NCU")
    if override:
        return f"Nsight Compute (ncu) not found: $EXATTN_NCU={override!r} is not an executable file"
    return f"Nsight Compute (ncu) not found ({SEARCHED})"


def cpu_counters() -> str:
    """Why the CPU rows have no measured DRAM bytes."""
    devices = Path("/sys/bus/event_source/devices")
    uncore = list(devices.glob("uncore_imc*")) if devices.is_dir() else []
    if uncore and shutil.which("perf"):
        return ("not measured: uncore memory-controller counters exist (perf uncore_imc), but they count "
                "the whole socket, other processes included")
    return ("not available on this CPU: no memory-controller (uncore_imc) hardware counters are "
            "exposed here (typical inside a virtual machine)")


def dram_status(device: str, enabled: bool) -> str:
    """One line for the report: are measured DRAM bytes in the rows, and if not, why not."""
    if not device.startswith("cuda"):
        return cpu_counters()
    ncu = find_ncu()
    if ncu is None:
        return f"not measured: {not_found()}"
    if not enabled:
        return f"not measured: Nsight Compute is at {ncu}; pass --dram to measure every run with it"
    return f"measured per run by {ncu} ({ncu_version(ncu)}): {METHOD}"


# ---------------------------------------------------------------- running ncu

def ncu_command(ncu: str, spec: RunSpec) -> list[str]:
    """The command line that measures one run in a fresh child process."""
    return [
        ncu, "--csv", "--print-units", "base", "--print-metric-name", "name",
        "--metrics", ",".join(METRICS),
        "--profile-from-start", "off", "--launch-count", str(MAX_KERNELS + 1),
        "--cache-control", "all", "--clock-control", "none",
        sys.executable, "-c", CHILD, json.dumps(spec.as_dict(), sort_keys=True),
    ]


def child_env() -> dict:
    """This environment, with exattn's source folder first on PYTHONPATH (the child must import it)."""
    source = str(Path(exattn.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": source + (os.pathsep + path if path else "")}


class Outcome(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def run_ncu(command: list[str], timeout: float) -> Outcome:
    """Run ncu in its own process group; on time-out kill the group (ncu and the profiled child)."""
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return Outcome(proc.returncode, stdout, stderr)


def measure_dram(spec: RunSpec, timeout: float = 300.0) -> dict:
    """{"dram_read_bytes", "dram_write_bytes", "dram_bytes", "dram_kernels", "dram_method"} or {"dram_error"}."""
    if not spec.device.startswith("cuda"):
        return {"dram_error": f"no DRAM counters on {spec.device}: " + cpu_counters()}
    ncu = find_ncu()
    if ncu is None:
        return {"dram_error": not_found()}
    try:
        outcome = run_ncu(ncu_command(ncu, spec), timeout)
    except subprocess.TimeoutExpired:
        return {"dram_error": f"ncu did not finish within {timeout:g} s (--memory-timeout)"}
    except OSError as err:
        return {"dram_error": f"ncu could not be started ({ncu}): {err}"}
    return read_outcome(outcome, ncu_version(ncu))


def read_outcome(outcome: Outcome, version: str = "version unknown") -> dict:
    """The row fields for one ncu run: its totals, or an error quoting what ncu said."""
    if outcome.returncode != 0:
        return {"dram_error": f"ncu exited with status {outcome.returncode}: {said(outcome)}"}
    try:
        totals = parse_ncu_csv(outcome.stdout)
    except ValueError as err:
        return {"dram_error": f"{err}; ncu said: {said(outcome)}"}
    if totals.kernels == 0:
        return {"dram_error": f"ncu profiled no kernel in the measured call; ncu said: {said(outcome)}"}
    if totals.kernels > MAX_KERNELS:
        return {"dram_error": f"the call launched more than {MAX_KERNELS} kernels (a pure-PyTorch backend "
                              "launches several per tile); not measured, profiling each would take too long"}
    return {
        "dram_read_bytes": round(totals.read),
        "dram_write_bytes": round(totals.write),
        "dram_bytes": round(totals.read + totals.write),
        "dram_kernels": totals.kernels,
        "dram_method": f"Nsight Compute ({version}): dram__bytes_read.sum + dram__bytes_write.sum over "
                       f"{totals.kernels} kernels",
    }


def said(outcome: Outcome, limit: int = 800) -> str:
    """ncu's own messages and the child's stderr (not the CSV), shortened to the last `limit` characters."""
    lines = [line for line in (outcome.stdout + "\n" + outcome.stderr).splitlines()
             if line.strip() and not line.startswith('"')]
    text = " | ".join(lines)
    return text[-limit:] if text else "(nothing)"


# ---------------------------------------------------------------- parsing ncu's CSV

def to_bytes(value: str, unit: str) -> float:
    """'1,048,576' 'byte' -> 1048576.0; '12.5' 'Mbyte' -> 12500000.0 (ncu's prefixes are decimal)."""
    scale = UNITS.get(unit.strip().lower())
    if scale is None:
        raise ValueError(f"ncu reported DRAM bytes in an unknown unit {unit!r} (expected one of byte, "
                         "Kbyte, Mbyte, Gbyte, Tbyte)")
    try:
        return float(value.replace(",", "").strip()) * scale
    except ValueError:
        raise ValueError(f"ncu reported a DRAM byte count that is not a number: {value!r} {unit}") from None


def table(text: str) -> tuple[list[str], list[list[str]]]:
    """The header and the rows of ncu's CSV, skipping ==PROF== lines and the program's own output."""
    rows = list(csv.reader(line for line in text.splitlines() if line.startswith('"')))
    for i, row in enumerate(rows):
        if row and row[0] == "ID":
            return row, [r for r in rows[i + 1:] if len(r) == len(row)]
    raise ValueError('ncu printed no CSV table (no header row starting with "ID")')


def long_rows(header: list[str], body: list[list[str]]):
    """The details page: one row per (kernel, metric): (kernel id, metric, unit, value)."""
    at = {name: header.index(name) for name in ("ID", "Metric Name", "Metric Unit", "Metric Value")}
    for row in body:
        yield row[at["ID"]], row[at["Metric Name"]], row[at["Metric Unit"]], row[at["Metric Value"]]


def wide_rows(header: list[str], body: list[list[str]]):
    """The raw page: one column per metric, a row of units first, then one row per kernel."""
    has_units = bool(body) and body[0][0] == ""
    units = body[0] if has_units else [""] * len(header)
    for row in body[1:] if has_units else body:
        for metric in METRICS:
            if metric in header:
                i = header.index(metric)
                yield row[0], metric, units[i], row[i]


def parse_ncu_csv(text: str) -> Totals:
    """Sum dram__bytes_read.sum and dram__bytes_write.sum over every kernel in ncu's --csv output."""
    header, body = table(text)
    rows = long_rows(header, body) if "Metric Name" in header else wide_rows(header, body)
    sums = dict.fromkeys(METRICS, 0.0)
    seen: set[str] = set()
    kernels: set[str] = set()
    for kernel, metric, unit, value in rows:
        kernels.add(kernel)
        if metric in sums:
            sums[metric] += to_bytes(value, unit)
            seen.add(metric)
    missing = [m for m in METRICS if m not in seen]
    if kernels and missing:
        raise ValueError(f"ncu's table has no {', '.join(missing)} (is the metric supported on this GPU?)")
    return Totals(sums[METRICS[0]], sums[METRICS[1]], len(kernels))


# ---------------------------------------------------------------- the profiled child

def measure_child(spec: RunSpec) -> None:
    """Warm up once, then run the forward (and backward) once inside the profiler window."""
    if torch.device(spec.device).index is not None:
        torch.cuda.set_device(torch.device(spec.device))
    inputs = make_inputs(spec)
    run_once(spec, inputs)
    synchronize(spec.device)
    torch.cuda.profiler.start()
    try:
        run_once(spec, inputs)
        synchronize(spec.device)
    finally:
        torch.cuda.profiler.stop()


def child_main(spec_json: str) -> None:
    """The child's entry point (`CHILD`): one RunSpec as JSON."""
    measure_child(RunSpec(**json.loads(spec_json)))
