"""Every knob of the experiment, settable from flags or a TOML file.

Precedence, lowest first: the defaults below, the `quick` preset, the TOML
file (`--config`), explicit flags. A TOML file uses the flag names, with
dashes or underscores, at top level or under an `[experiment]` table:

    seq-lens = [256, 1024]
    tiles = ["32x32", "64x128"]
    dtypes = ["fp32", "bf16"]
    dropout = [0.0, 0.1]
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DTYPE_NAMES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
}
PHASES = ("prefill", "decode")
BACKENDS = ("tiled", "triton")
BOOL_WORDS = {"on": True, "true": True, "yes": True, "1": True,
              "off": False, "false": False, "no": False, "0": False}


class ConfigError(ValueError):
    """A knob was given a value it cannot take; the message names knob, value and expectation."""


@dataclass(frozen=True)
class ExperimentConfig:
    """The whole sweep. Lengths are N (prefill: Nq = Nk = N; decode: Nq = 1, Nk = N)."""

    out: str = "experiment-out"
    device: str = "cpu"
    seq_lens: tuple[int, ...] = (256, 512, 1024, 2048)
    tiles: tuple[tuple[int, int], ...] = ((64, 64), (128, 64), (64, 256), (128, 128))
    dtypes: tuple[str, ...] = ("fp32", "fp16", "bf16")
    phases: tuple[str, ...] = PHASES
    causal: tuple[bool, ...] = (False, True)
    dropout: tuple[float, ...] = (0.0, 0.1)
    dropout_seq_lens: tuple[int, ...] = (256,)
    backends: tuple[str, ...] = ("tiled",)
    batch: int = 1
    heads: int = 2
    kv_heads: int | None = None
    head_dim: int = 64
    repeats: int = 3
    warmup: int = 1
    naive_max_len: int = 4096
    memory: bool = True
    memory_timeout: float = 300.0
    dram: bool = False
    on_chip_bytes: int | None = None
    seed: int = 0
    threads: int | None = None
    plots: bool = True
    quick: bool = False
    config: str | None = None

    @property
    def heads_k(self) -> int:
        return self.kv_heads or self.heads


QUICK = {
    "seq_lens": (128, 256, 512),
    "tiles": ((16, 16), (32, 64), (64, 64)),
    "dropout_seq_lens": (128,),
    "repeats": 2,
}

DEFAULTS_CUDA = {"backends": ("triton", "tiled"), "seq_lens": (1024, 2048, 4096, 8192),
                 "dropout_seq_lens": (1024,), "naive_max_len": 16384}


def parse_list(name: str, value, item):
    """A comma string or a list, each element through `item`; never empty."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise ConfigError(f"{name} must be a comma-separated list, got {value!r}")
    if not parts:
        raise ConfigError(f"{name} must name at least one value, got {value!r}")
    return tuple(dict.fromkeys(item(name, p) for p in parts))


def positive_int(name: str, value) -> int:
    try:
        number = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or number <= 0:
        raise ConfigError(f"{name} must hold positive integers, got {value!r}")
    return number


def tile(name: str, value) -> tuple[int, int]:
    """'64x128' or [64, 128] -> (block_m, block_n)."""
    parts = value if isinstance(value, (list, tuple)) else str(value).lower().split("x")
    if len(parts) != 2:
        raise ConfigError(f"{name} must hold tiles written BLOCK_MxBLOCK_N like 32x64, got {value!r}")
    return positive_int(name, parts[0]), positive_int(name, parts[1])


def dtype_name(name: str, value) -> str:
    key = str(value).strip().lower()
    if key not in DTYPE_NAMES:
        raise ConfigError(f"{name} must hold fp32, fp16 or bf16, got {value!r}")
    return DTYPE_NAMES[key]


def choice(options: tuple[str, ...]):
    def check(name: str, value) -> str:
        key = str(value).strip().lower()
        if key not in options:
            raise ConfigError(f"{name} must hold values from {', '.join(options)}, got {value!r}")
        return key
    return check


def boolean(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    key = str(value).strip().lower()
    if key not in BOOL_WORDS:
        raise ConfigError(f"{name} must hold on/off (or true/false), got {value!r}")
    return BOOL_WORDS[key]


def probability(name: str, value) -> float:
    try:
        p = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        p = -1.0
    if not 0.0 <= p < 1.0:
        raise ConfigError(f"{name} must hold dropout probabilities in [0, 1), got {value!r}")
    return p


def scalar(kind, minimum=1):
    def check(name: str, value):
        try:
            number = None if isinstance(value, bool) or value is None else kind(value)
        except (TypeError, ValueError):
            number = None
        if number is None or number < minimum:
            noun = "an integer" if kind is int else "a number"
            raise ConfigError(f"{name} must be {noun} >= {minimum}, got {value!r}")
        return number
    return check


def device_name(name: str, value) -> str:
    key = str(value).strip().lower()
    if key != "cpu" and not key.startswith("cuda"):
        raise ConfigError(f"{name} must be cpu or cuda[:index], got {value!r}")
    return key


LISTS = {
    "seq_lens": positive_int, "tiles": tile, "dtypes": dtype_name, "phases": choice(PHASES),
    "causal": boolean, "dropout": probability, "dropout_seq_lens": positive_int,
    "backends": choice(BACKENDS),
}
SCALARS = {
    "batch": scalar(int), "heads": scalar(int), "kv_heads": scalar(int), "head_dim": scalar(int),
    "repeats": scalar(int), "warmup": scalar(int, 0), "naive_max_len": scalar(int),
    "memory_timeout": scalar(float), "on_chip_bytes": scalar(int), "seed": scalar(int, 0),
    "threads": scalar(int), "device": device_name,
}
FLAGS = {"memory": boolean, "dram": boolean, "plots": boolean, "quick": boolean}
TEXT = ("out", "config")


def normalize(name: str, value):
    """One knob's value, checked and converted; ConfigError names the knob."""
    flag = "--" + name.replace("_", "-")
    if name in LISTS:
        return parse_list(flag, value, LISTS[name])
    if name in SCALARS:
        return SCALARS[name](flag, value)
    if name in FLAGS:
        return FLAGS[name](flag, value)
    if name in TEXT:
        return str(value)
    known = ", ".join(sorted(f.name.replace("_", "-") for f in dataclasses.fields(ExperimentConfig)))
    raise ConfigError(f"unknown setting {name.replace('_', '-')!r}; known settings: {known}")


def read_toml(path: str) -> dict:
    """Settings from a TOML file, keys normalized to field names."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config file {path!r} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"--config file {path!r} is not valid TOML: {err}") from None
    data = data.get("experiment", data)
    return {key.replace("-", "_"): value for key, value in data.items()}


def build_config(flags: dict) -> ExperimentConfig:
    """Merge defaults, the quick preset, the TOML file and explicit flags (None = not given)."""
    given = {k: v for k, v in flags.items() if v is not None}
    from_file = read_toml(given["config"]) if "config" in given else {}
    settings: dict = {}
    for source in (from_file, given):
        for name, value in source.items():
            settings[name] = normalize(name, value)
    merged: dict = {}
    if settings.get("device", "cpu").startswith("cuda"):
        merged.update(DEFAULTS_CUDA)
    if settings.get("quick", False):
        merged.update(QUICK)
    merged.update(settings)
    config = ExperimentConfig(**merged)
    check_consistent(config)
    return config


def check_consistent(config: ExperimentConfig) -> None:
    if config.heads % config.heads_k != 0:
        raise ConfigError(
            f"--heads ({config.heads}) must be a multiple of --kv-heads ({config.heads_k})"
        )
    if config.dram and not config.device.startswith("cuda"):
        raise ConfigError(
            f"--dram needs --device cuda, got --device {config.device}: measured DRAM bytes come from "
            "an NVIDIA GPU's hardware counters, read by Nsight Compute; on the CPU there are none to read"
        )
