"""Which positions of the sequence each rank holds, and conversions between full tensors and shards.

With W ranks and a sequence of length N:

    contiguous  rank r holds positions [r N/W, (r+1) N/W)
    zigzag      the sequence is cut into 2W chunks of N/(2W); rank r holds
                chunks r and 2W-1-r, in that order

Zigzag balances causal attention: every rank holds one early and one late
chunk, so every rank does the same work. For W = 2 (chunks a b c d):

    rank 0: a d        rank 1: b c
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

LAYOUTS = ("contiguous", "zigzag")


class Segment(NamedTuple):
    """A run of positions held by one rank: `length` positions that sit at
    `local` in the shard and at `start` in the full sequence."""

    local: int
    start: int
    length: int


def check_layout(layout: object) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def check_rank_world(rank: object, world: object) -> tuple[int, int]:
    for name, value in (("rank", rank), ("world", world)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world) = [0, {world}), got {rank}")
    return rank, world


def chunks_per_rank(layout: str) -> int:
    return 1 if layout == "contiguous" else 2


def check_divisible(name: str, length: int, world: int, layout: str) -> int:
    """The chunk size for a full length `length`; ValueError if the layout cannot cut it."""
    pieces = world * chunks_per_rank(layout)
    if length % pieces:
        raise ValueError(
            f"{name} has length {length}, which layout {layout!r} cannot split over "
            f"world={world} ranks: it must be a multiple of {pieces}"
        )
    return length // pieces


def chunk_ids(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The chunks rank `rank` holds, in shard order."""
    if layout == "contiguous":
        return (rank,)
    return (rank, 2 * world - 1 - rank)


def segments(rank: int, world: int, length: int, layout: str) -> list[Segment]:
    """The positions of a full sequence of `length` that `rank` holds, in shard order."""
    chunk = check_divisible("the sequence", length, world, layout)
    return [Segment(i * chunk, c * chunk, chunk) for i, c in enumerate(chunk_ids(rank, world, layout))]


def check_dim(x: torch.Tensor, dim: object) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be in [{-x.dim()}, {x.dim()}) for a {x.dim()}-dim tensor, got {dim}")
    return dim % x.dim()


def shard(
    x: torch.Tensor, rank: int, world: int, layout: str = "contiguous", dim: int = 2
) -> torch.Tensor:
    """The part of the full tensor `x` that `rank` of `world` holds.

    x: (..., N, ...) with the sequence on `dim` (2 for (B, H, N, D)).
    Returns (..., N / world, ...): a view for "contiguous", a copy for
    "zigzag" (chunks r and 2W-1-r of N / (2W), concatenated).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    rank, world = check_rank_world(rank, world)
    layout, dim = check_layout(layout), check_dim(x, dim)
    chunk = check_divisible("x", x.shape[dim], world, layout)
    parts = [x.narrow(dim, c * chunk, chunk) for c in chunk_ids(rank, world, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard(shards: Sequence[torch.Tensor], layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """The full tensor from every rank's shard, `shards[r]` being rank r's.

    Inverse of `shard`: `unshard([shard(x, r, W, layout) for r in range(W)], layout) == x`.
    To gather shards across processes, `torch.distributed.all_gather` them first.
    """
    if isinstance(shards, torch.Tensor) or not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError(f"shards must be a non-empty list of tensors (one per rank), got {type(shards).__name__}")
    for r, s in enumerate(shards):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"shards[{r}] must be a torch.Tensor, got {type(s).__name__}")
        if s.shape != shards[0].shape:
            raise ValueError(f"shards[{r}] has shape {tuple(s.shape)} but shards[0] has {tuple(shards[0].shape)}")
    layout, dim = check_layout(layout), check_dim(shards[0], dim)
    world = len(shards)
    per_rank = chunks_per_rank(layout)
    check_divisible("each shard", shards[0].shape[dim], 1, layout)
    chunk = shards[0].shape[dim] // per_rank
    chunks: list[torch.Tensor | None] = [None] * (world * per_rank)
    for r, s in enumerate(shards):
        for i, c in enumerate(chunk_ids(r, world, layout)):
            chunks[c] = s.narrow(dim, i * chunk, chunk)
    return torch.cat(chunks, dim=dim)
