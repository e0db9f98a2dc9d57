"""Arguments every rank must agree on, checked once per call with one small all_gather.

A rank whose shard has another shape (or dtype, causal flag, window, layout,
scale) than its peers would otherwise send and receive buffers of the wrong
size: a hang or a wrong result. `agree` gathers a short vector of integers
from every rank of the group and raises the same ValueError on every rank,
naming the field and each rank's value, before any data moves.
"""

from __future__ import annotations

import contextlib
import struct

import torch
import torch.distributed as dist

DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def encode(value) -> list[int]:
    """A field as integers: ints and bools as they are, floats by their bits, tuples flattened."""
    if isinstance(value, (tuple, list, torch.Size)):
        return [x for item in value for x in encode(item)]
    if isinstance(value, torch.dtype):
        return [DTYPE_CODES.get(value, 0)]
    if isinstance(value, float):
        return [struct.unpack("<q", struct.pack("<d", value))[0]]
    if value is None:
        return [-(2**62)]
    return [int(value)]


@contextlib.contextmanager
def peer_failure(message: str):
    """A collective's RuntimeError raised again as one that says which call failed and why (`message`),
    with the cause appended: every rank of a failed exchange fails with a clear error."""
    try:
        yield
    except RuntimeError as exc:
        raise RuntimeError(f"{message}. Cause: {exc}") from exc


def agree(what: str, group, device: torch.device, **fields) -> None:
    """Raise ValueError on every rank of `group` if any field differs between ranks."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    codes = [encode(v) for v in fields.values()]
    flat = torch.tensor([len(c) for c in codes] + [x for c in codes for x in c], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        flat = flat.to(device)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    with peer_failure(f"{what}: the ranks of the group could not compare their arguments (a rank did not "
                      "make the same call, or its shapes differ in rank count)"):
        dist.all_gather(gathered, flat, group=group)
    rows = [g.tolist() for g in gathered]
    if all(row == rows[0] for row in rows):
        return
    offset = len(codes)
    for (name, value), code in zip(fields.items(), codes):
        values = [tuple(row[offset: offset + len(code)]) for row in rows]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {decode(value, v)}" for r, v in enumerate(values))
            raise ValueError(
                f"{what}: every rank of the group must pass the same {name}, but they differ "
                f"({shown}); shard every tensor the same way on every rank"
            )
        offset += len(code)
    raise ValueError(f"{what}: the ranks of the group passed different arguments")


def decode(like, codes: tuple[int, ...]):
    """The value a rank sent, read back with the type of this rank's own value (for the message)."""
    if isinstance(like, torch.dtype):
        return {c: d for d, c in DTYPE_CODES.items()}.get(codes[0], "unknown dtype")
    if isinstance(like, float):
        return struct.unpack("<d", struct.pack("<q", codes[0]))[0]
    if isinstance(like, (tuple, list, torch.Size)):
        return tuple(None if c == -(2**62) else c for c in codes)
    if like is None or codes[0] == -(2**62):
        return None
    return type(like)(codes[0]) if isinstance(like, (bool, int)) else codes[0]
