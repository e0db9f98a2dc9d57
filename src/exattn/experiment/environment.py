"""What a run was measured on: versions, device, threads, and how each quantity was obtained."""

from __future__ import annotations

import dataclasses
import platform
import sys
import time
from pathlib import Path

import torch

import exattn

from .dram import dram_status
from .traffic import default_on_chip_bytes


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass  # no /proc/cpuinfo (not Linux): fall back to the platform module below
    return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{cpu_name()} ({torch.get_num_threads()} threads)"


def optional_version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


def describe_environment(config, argv: list[str] | None) -> dict:
    """Everything a reader needs to name the baseline and reproduce the run."""
    on_chip, on_chip_source = (config.on_chip_bytes, "--on-chip-bytes") if config.on_chip_bytes \
        else default_on_chip_bytes(config.device)
    return {
        "command": "exattn " + " ".join(argv) if argv is not None else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "versions": {
            "exattn": exattn.__version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "triton": optional_version("triton"),
            "numpy": optional_version("numpy"),
        },
        "device": config.device,
        "device_name": device_name(config.device),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "config": dataclasses.asdict(config),
        "baseline": "naive",
        "oracle": "exattn.reference.attention_ref in float64 on the same (dtype-rounded) inputs",
        "memory_method": ("torch.cuda.max_memory_allocated" if config.device.startswith("cuda")
                          else "peak RSS growth of a fresh process per run"),
        "traffic_model": "modeled bytes between main and on-chip memory (exattn.experiment.traffic)",
        "on_chip_bytes": on_chip,
        "on_chip_source": on_chip_source,
        "dram_measured": dram_status(config.device, config.dram),
    }
