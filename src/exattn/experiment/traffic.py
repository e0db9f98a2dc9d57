"""Modeled bytes moved between main memory (HBM / DRAM) and fast on-chip memory.

A MODEL, not a measurement. It counts the bytes a FlashAttention-2 style
schedule must move for given tiles, assuming each tile is loaded once per
use, nothing stays cached between uses, and the band is skipped at tile
granularity with the one mask rule (`exattn.masks.band_bounds`):

- forward (outer loop over query tiles of block_m rows): Q tile read once,
  K and V read once per query tile over the keys its band allows, O and the
  float32 lse written once. K/V re-reads fall as block_m grows.
- backward (outer loop over key tiles of block_n columns): K, V read and
  dK, dV written once; per key tile, Q, dO, lse and delta read, and the
  float32 dQ accumulator read and written, for the rows the band allows;
  plus the delta = rowsum(dO * O) pre-pass. Q/dO re-reads fall as block_n grows.
- decode (one query, split-KV): K and V read once; each of the
  ceil(N / block_n) splits writes and the merge reads a float32 partial
  output and lse.
- naive (the textbook schedule): inputs once, plus the (B, Hq, Nq, Nk)
  scores S and weights P in the input dtype, written and read: 4 passes
  forward (S write, S read, P write, P read) and 7 backward (P read twice,
  dP write and read, dS write, dS read twice).

Measured DRAM bytes, where hardware counters exist (NVIDIA GPUs, through
Nsight Compute), come from `exattn.experiment.dram`, next to this model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..backends.tiled import spans
from ..masks import band_bounds, band_rows
from ..problem import UNBOUNDED

FP32 = 4


@dataclass(frozen=True)
class Shape:
    """Attention sizes: q (B, Hq, Nq, D), k/v (B, Hk, Nk, D|Dv); elem = bytes per input element."""

    batch: int
    heads: int
    len_q: int
    len_k: int
    head_dim: int
    value_dim: int
    elem: int
    causal: bool = False

    @property
    def window(self) -> tuple[int, int]:
        return (UNBOUNDED, 0) if self.causal else (UNBOUNDED, UNBOUNDED)

    @property
    def heads_total(self) -> int:
        return self.batch * self.heads


def io_bytes(s: Shape, backward: bool) -> int:
    """Reading q, k, v and writing out (and lse) once; with backward, also dout, dq, dk, dv."""
    q = s.len_q * s.head_dim
    kv = s.len_k * (s.head_dim + s.value_dim)
    o = s.len_q * s.value_dim
    fwd = (q + kv + o) * s.elem + s.len_q * FP32
    bwd = 2 * (o + q + kv) * s.elem + s.len_q * FP32 if backward else 0
    return s.heads_total * (fwd + bwd)


def tiled_forward_bytes(s: Shape, block_m: int) -> int:
    keys_read = sum(
        hi - lo for rows in spans(0, s.len_q, block_m)
        for lo, hi in [band_bounds(rows, s.len_q, s.len_k, s.window)]
    )
    per_head = (
        s.len_q * s.head_dim * s.elem
        + keys_read * (s.head_dim + s.value_dim) * s.elem
        + s.len_q * (s.value_dim * s.elem + FP32)
    )
    return s.heads_total * per_head


def tiled_backward_bytes(s: Shape, block_n: int) -> int:
    rows_read = sum(
        hi - lo for cols in spans(0, s.len_k, block_n)
        for lo, hi in [band_rows(cols, s.len_q, s.len_k, s.window)]
    )
    per_row = (s.head_dim + s.value_dim) * s.elem + 2 * FP32 + 2 * s.head_dim * FP32
    kv = s.len_k * (s.head_dim + s.value_dim) * s.elem * 2
    delta_pass = s.len_q * (2 * s.value_dim * s.elem + FP32)
    cast_dq = s.len_q * s.head_dim * (FP32 + s.elem)
    return s.heads_total * (rows_read * per_row + kv + delta_pass + cast_dq)


def decode_bytes(s: Shape, block_n: int) -> int:
    splits = math.ceil(s.len_k / block_n)
    partials = 2 * splits * s.len_q * (s.value_dim + 1) * FP32
    return io_bytes(s, backward=False) + s.heads_total * partials


def naive_bytes(s: Shape, backward: bool) -> int:
    matrix = s.heads_total * s.len_q * s.len_k * s.elem
    return io_bytes(s, backward) + matrix * (4 + (7 if backward else 0))


def modeled_traffic(s: Shape, block_m: int | None, block_n: int | None, phase: str) -> dict:
    """Modeled bytes for one run; block_m None = the naive schedule."""
    backward = phase == "prefill"
    if block_m is None:
        total = naive_bytes(s, backward)
        return {"traffic_model_bytes": total, "traffic_model_fwd_bytes": naive_bytes(s, False)}
    if phase == "decode":
        total = decode_bytes(s, block_n)
        return {"traffic_model_bytes": total, "traffic_model_fwd_bytes": total}
    fwd = tiled_forward_bytes(s, block_m)
    return {"traffic_model_bytes": fwd + tiled_backward_bytes(s, block_n), "traffic_model_fwd_bytes": fwd}


def on_chip_footprint(block_m: int, block_n: int, head_dim: int, value_dim: int, elem: int) -> int:
    """Bytes of fast memory one tile program needs (max of forward and backward), by the same model."""
    fwd = (block_m * head_dim + block_n * (head_dim + value_dim)) * elem \
        + block_m * (value_dim + 2) * FP32 + block_m * block_n * FP32
    bwd = (block_n + block_m) * (head_dim + value_dim) * elem \
        + block_n * (head_dim + value_dim) * FP32 + 2 * block_m * block_n * FP32
    return max(fwd, bwd)


def cpu_cache_bytes() -> tuple[int, str]:
    """The per-core L2 size from sysfs, else 1 MiB."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2":
                text = (index / "size").read_text().strip().upper()
                scale = {"K": 1024, "M": 1 << 20}.get(text[-1], 1)
                return int(text.rstrip("KM")) * scale, f"L2 cache of cpu0 ({text}) from sysfs"
        except (OSError, ValueError):
            continue
    return 1 << 20, "assumed 1 MiB (no L2 size in sysfs)"


def default_on_chip_bytes(device: str) -> tuple[int, str]:
    """Fast memory per tile program: CUDA shared memory per block (opt-in), or the CPU's L2."""
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        size = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
        return int(size), f"shared memory per block of {props.name}"
    return cpu_cache_bytes()

