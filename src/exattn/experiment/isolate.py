"""Measured peak memory of one run, each CPU measurement in its own process.

CPU: a small fork server (`isolate.serve` in its own Python process, started
once, it imports torch and exattn and runs nothing) forks one fresh child
per measurement. The child builds the inputs, runs a small warm-up of the
same path, resets its peak-RSS mark (`/proc/self/clear_refs`), runs the
forward (and backward) once, and reports VmHWM - VmRSS-before: the peak
growth of resident memory during the run. CUDA:
`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, minus
what was allocated before the run; the caching allocator's counters already
isolate one run, so no process is needed.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import torch

from .workload import RunSpec, make_inputs, run_once, synchronize

WARMUP_LEN = 64


def status_kib(field: str) -> int | None:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM), or None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Set VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure_here(spec: RunSpec) -> dict:
    """Peak RSS growth (bytes) of one run of `spec` in this (fresh) process."""
    try:
        run_once(spec, make_inputs(tiny(spec)))
        inputs = make_inputs(spec)
        exact = reset_peak_rss()
        before = status_kib("VmRSS") if exact else status_kib("VmHWM")
        run_once(spec, inputs)
        peak = status_kib("VmHWM")
    except Exception as err:  # reported as a failed measurement, not a crash
        return {"error": f"{type(err).__name__}: {err}"}
    if before is None or peak is None:
        return {"error": "/proc/self/status is not readable: no peak RSS on this system"}
    method = "peak RSS growth in a fresh process (VmHWM reset by /proc/self/clear_refs)"
    if not exact:
        method = "peak RSS growth in a fresh process (VmHWM could not be reset: may read low)"
    return {"peak_bytes": max(0, peak - before) * 1024, "method": method}


def tiny(spec: RunSpec) -> RunSpec:
    return dataclasses.replace(spec, seq_len=min(spec.seq_len, WARMUP_LEN))


def serve_one(line: str, warmed: set) -> dict:
    """Fork a child for one request (a RunSpec as JSON) and return its answer.

    The server itself runs single-threaded (a forked child must not inherit a
    started OpenMP pool) and warms each code path once at a tiny size, so
    that children do not pay torch's lazy initialization.
    """
    request = json.loads(line)
    spec = RunSpec(**request["spec"])
    path = (spec.phase, spec.impl, spec.dtype, spec.causal, spec.dropout_p > 0)
    if path not in warmed:
        try:
            run_once(spec, make_inputs(tiny(spec)))
        except Exception:
            pass  # the child reports the failure
        warmed.add(path)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        torch.set_num_threads(request.get("threads") or 1)
        with os.fdopen(write_fd, "w") as pipe:
            pipe.write(json.dumps(measure_here(spec)))
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        answer = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not answer:
        return {"error": f"measurement process died (wait status {status}; out of memory?)"}
    return json.loads(answer)


def serve() -> None:
    """The fork server: one JSON request per stdin line, one JSON answer per stdout line."""
    torch.set_num_threads(1)
    warmed: set = set()
    for line in sys.stdin:
        sys.stdout.write(json.dumps(serve_one(line, warmed)) + "\n")
        sys.stdout.flush()


class ForkServer:
    """Client of the fork server; restarted if a measurement times out."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import serve; serve()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
            )
        return self.proc

    def measure(self, spec: RunSpec, timeout: float, threads: int | None = None) -> dict:
        proc = self.start()
        try:
            proc.stdin.write(json.dumps({"spec": dataclasses.asdict(spec), "threads": threads}) + "\n")
            proc.stdin.flush()
        except OSError as err:
            self.close()
            return {"error": f"memory server is gone ({err})"}
        ready, _, _ = select.select([proc.stdout], [], [], timeout + 60)
        line = proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            return {"error": f"no measurement within {timeout:g} s (+60 s start-up)" if not ready
                    else "memory server exited"}
        return json.loads(line)

    def close(self) -> None:
        """End the server (closing its stdin ends its loop) and anything left in its process group."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass  # a server that will not exit politely is killed just below
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it has already exited: nothing left to stop
        self.proc.wait()
        self.proc = None


SERVER = ForkServer()
atexit.register(SERVER.close)


def cuda_peak(spec: RunSpec) -> dict:
    inputs = make_inputs(spec)
    run_once(spec, inputs)
    for x in inputs[:3]:
        x.grad = None
    synchronize(spec.device)
    torch.cuda.reset_peak_memory_stats(spec.device)
    before = torch.cuda.memory_allocated(spec.device)
    run_once(spec, inputs)
    synchronize(spec.device)
    peak = torch.cuda.max_memory_allocated(spec.device) - before
    return {"peak_bytes": peak, "method": "torch.cuda.max_memory_allocated minus allocated before the run"}


def peak_memory(spec: RunSpec, timeout: float = 300.0) -> dict:
    """{"peak_bytes", "method"} or {"error"}: measured, never computed."""
    if spec.device.startswith("cuda"):
        try:
            return cuda_peak(spec)
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}"}
    return SERVER.measure(spec, timeout, torch.get_num_threads())

