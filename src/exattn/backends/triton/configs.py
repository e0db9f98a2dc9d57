"""Tile configurations of the Triton kernels, and which inputs they can serve.

The tables were chosen by `benchmarks/triton_tiles.py` on the lent H200
(bf16, N = 4k..16k; see docs/triton.md): no run-time autotuning, so a call
never pays for a search and the same inputs always run the same kernel.
`block_m` / `block_n` given by the user replace the table's tiles; the
pipeline depth then shrinks until the tiles fit in shared memory.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

MIN_BLOCK = 16
MAX_BLOCK = 256
MAX_HEAD_DIM = 256
# Hopper's per-block shared memory (227 KiB), less room for the compiler's own buffers.
SHARED_MEMORY_BYTES = 232448 - 16384
TMA_ALIGN_BYTES = 16
# Integer kernel arguments that count tiles or heads. Triton specializes an integer argument on whether it
# is divisible by 16 or equal to 1, which for these changes no code but would compile again for each new
# value: 1k and 2k tokens are 8 and 16 tiles of 128 rows. Not specialized, lengths share compiled kernels.
COUNTS = ("num_row_tiles", "num_col_tiles", "heads_per_group")


@dataclass(frozen=True)
class TileConfig:
    """block_m: query rows per tile; block_n: keys per tile; launch options of one kernel.

    warp_specialize (forward only, 4 warps, for tuning experiments): one masked
    key loop that the compiler splits into producer and consumer warp groups.
    No table entry uses it: on the H200 it gave NaN at d=64 and under causal
    masks with Triton 3.6 (docs/triton.md).
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    warp_specialize: bool = False


@dataclass(frozen=True)
class BackwardConfig:
    """dkdv: block_n keys per program sweeping block_m query rows; dq: the reverse."""

    dkdv: TileConfig
    dq: TileConfig


@functools.cache
def device_capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device `index` (cached: it is on every launch's host path)."""
    return torch.cuda.get_device_capability(index)


def device_index(device: torch.device) -> int:
    """The CUDA device index of `device` (the current device when it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def capability_of(device: torch.device) -> tuple[int, int]:
    return device_capability(device_index(device))


@functools.cache
def device_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """SMs of CUDA device `device` (cached: it is on every launch's host path)."""
    return device_multiprocessors(device_index(device))


def interpreting() -> bool:
    """True when TRITON_INTERPRET=1: kernels run on the CPU through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def gluon_device_reasons(device: torch.device) -> list[str]:
    """Why the Gluon (sm_90) kernels cannot run on `device` (empty: they can)."""
    if interpreting():
        return ["TRITON_INTERPRET=1 is set: Gluon kernels do not run in Triton's interpreter"]
    if device.type != "cuda":
        return [f"needs CUDA tensors on an sm_90 GPU, got device {device}"]
    if capability_of(device) != (9, 0):
        return [f"needs an sm_90 GPU, got compute capability {capability_of(device)}"]
    return []


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for host integers (`triton.cdiv` is a JIT function: microseconds per host call)."""
    return -(-a // b)


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def padded_dim(n: int) -> int:
    """n rounded up to a power of two >= 16: a head dim as the kernels pad it (masked loads), or a
    tile of n rows."""
    return max(MIN_BLOCK, next_power_of_two(n))


def dim_bucket(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


# 16-bit inputs on sm_90, by (padded head dim bucket, causal). Chosen from the
# tile sweep of benchmarks/triton_tiles.py (bf16, N = 16k).
FORWARD_TILES = {
    (64, False): TileConfig(128, 64, 4, 3),
    (64, True): TileConfig(128, 64, 4, 3),
    (128, False): TileConfig(128, 64, 8, 3),
    (128, True): TileConfig(128, 64, 8, 3),
    (256, False): TileConfig(64, 64, 4, 2),
    (256, True): TileConfig(64, 64, 4, 2),
}
BACKWARD_TILES = {
    64: BackwardConfig(TileConfig(64, 64, 4, 2), TileConfig(64, 64, 4, 3)),
    128: BackwardConfig(TileConfig(64, 64, 4, 2), TileConfig(128, 64, 8, 3)),
    256: BackwardConfig(TileConfig(32, 64, 8, 1), TileConfig(64, 64, 8, 1)),
}
# A user mask or dropout adds registers per score element (mask loads, Philox):
# smaller tiles keep those kernels free of spills.
GENERAL_TILES = {
    "forward": TileConfig(64, 64, 4, 2),
    "dkdv": TileConfig(32, 64, 4, 2),
    "dq": TileConfig(64, 64, 4, 2),
}
# float32 (IEEE dots, no tensor cores) and the CPU interpreter: small tiles.
FLOAT32_TILES = TileConfig(32, 32, 4, 1)
INTERPRETER_TILES = TileConfig(32, 32, 4, 1)


def tile_problems(block_m: int | None, block_n: int | None) -> list[str]:
    """Why user tile sizes cannot be used (empty if they can)."""
    reasons = []
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value is not None and (value & (value - 1) or not MIN_BLOCK <= value <= MAX_BLOCK):
            reasons.append(
                f"{name}={value} is not a power of two in [{MIN_BLOCK}, {MAX_BLOCK}]"
            )
    return reasons


def base_config(kind: str, head_dim: int, dtype: torch.dtype, causal: bool, general: bool, interpret: bool):
    """Table entry for `kind` in ("forward", "dkdv", "dq"); `general`: a user mask or dropout."""
    if interpret:
        return INTERPRETER_TILES
    if dtype == torch.float32:
        return FLOAT32_TILES
    if general:
        return GENERAL_TILES[kind]
    bucket = dim_bucket(head_dim)
    if kind == "forward":
        return FORWARD_TILES[(bucket, causal)]
    return getattr(BACKWARD_TILES[bucket], kind)


def shared_bytes(kind: str, cfg: TileConfig, dims: tuple[int, int], elem: int) -> int:
    """Rough shared memory of one program: resident tiles plus `num_stages` streamed tiles."""
    d, dv = padded_dim(dims[0]), padded_dim(dims[1])
    if kind == "dkdv":
        resident, streamed = cfg.block_n * (d + dv), cfg.block_m * (d + dv)
    else:
        resident, streamed = cfg.block_m * (d + dv), cfg.block_n * (d + dv)
    return (resident + max(1, cfg.num_stages) * streamed) * elem


def choose_config(
    kind: str, dims: tuple[int, int], dtype: torch.dtype, causal: bool, general: bool,
    interpret: bool, block_m: int | None, block_n: int | None,
) -> TileConfig | None:
    """The tiles of one kernel for these inputs; None if even one stage exceeds shared memory."""
    cfg = base_config(kind, max(dims), dtype, causal, general, interpret)
    if block_m is not None or block_n is not None:
        bm, bn = block_m or cfg.block_m, block_n or cfg.block_n
        warps = 8 if bm * bn >= 128 * 128 and not interpret else 4
        cfg = replace(cfg, block_m=bm, block_n=bn, num_warps=warps, warp_specialize=False)
    if interpret:
        return cfg
    elem = torch.finfo(dtype).bits // 8
    while cfg.num_stages > 1 and shared_bytes(kind, cfg, dims, elem) > SHARED_MEMORY_BYTES:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    if shared_bytes(kind, cfg, dims, elem) > SHARED_MEMORY_BYTES:
        return None
    return cfg


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """True if every tensor can back a TMA descriptor: 16-byte aligned base and strides, unit last stride."""
    for x in tensors:
        elem = x.element_size()
        if x.data_ptr() % TMA_ALIGN_BYTES or x.stride(-1) != 1:
            return False
        row_stride = x.stride(-2)
        if row_stride <= 0 or (row_stride * elem) % TMA_ALIGN_BYTES:
            return False
        if any(n > 1 and (s * elem) % TMA_ALIGN_BYTES for n, s in zip(x.shape[:-2], x.stride()[:-2])):
            return False
    return True
