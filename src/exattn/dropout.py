"""Counter-based dropout: Philox 4x32-10 in PyTorch, bit-identical to Triton.

Whether weight `(b, h, i, j)` of a `(B, Hq, Nq, Nk)` attention is kept is a
pure function of `(seed, offset, p)` with the counter

    offset = ((b * Hq + h) * Nq + i) * Nk + j        (64-bit)

and the rule `keep = tl.rand(seed, offset) >= p` (float32 compare). This file
reproduces `triton.language.rand` exactly: Philox 4x32 with 10 rounds, key
`(seed_lo, seed_hi)`, counter `(offset_lo, offset_hi, 0, 0)`, first output
word mapped to [0, 1) by `uint_to_uniform_float`. So a Triton kernel that
calls `tl.rand(seed, offset) >= dropout_p` draws the same mask as the tiled
backend, for every tile size, forward and backward.
"""

from __future__ import annotations

import math
import operator

import torch

from .problem import check_dropout

PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF
# Triton's scale: the largest float32 with (2**31 - 1) * scale < 1.
UNIFORM_SCALE = 4.6566127342e-10


def mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of the 64-bit product a * b, in int64 without overflow."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    low_part = a_lo * b
    mid = a_hi * b + (low_part >> 16)
    hi = mid >> 16
    lo = ((mid & 0xFFFF) << 16) | (low_part & 0xFFFF)
    return hi, lo


def philox_first_word(seed: int, offset: torch.Tensor) -> torch.Tensor:
    """First output word (as int64 in [0, 2**32)) of Philox 4x32-10 at counter `offset`."""
    c0 = offset & MASK32
    c1 = (offset >> 32) & MASK32
    c2 = torch.zeros_like(offset)
    c3 = torch.zeros_like(offset)
    k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = mulhilo32(PHILOX_ROUND_B, c2)
        hi_a, lo_a = mulhilo32(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & MASK32
        k1 = (k1 + PHILOX_KEY_B) & MASK32
    return c0


def uniform(seed: int, offset: torch.Tensor) -> torch.Tensor:
    """`tl.rand(seed, offset)`: float32 in [0, 1)."""
    word = philox_first_word(seed, offset)
    signed = torch.where(word >= 2**31, word - 2**32, word)
    folded = torch.where(signed < 0, -signed - 1, signed)
    return folded.to(torch.float32) * torch.tensor(UNIFORM_SCALE, dtype=torch.float32)


def keep_tile(
    seed: int,
    dropout_p: float,
    shape: tuple[int, int, int, int],
    batch: range,
    heads: range,
    rows: range,
    cols: range,
    device=None,
) -> torch.Tensor:
    """Bool keep-mask of the tile `[batch, heads, rows, cols]` of a (B, Hq, Nq, Nk) attention."""
    _, heads_q, len_q, len_k = shape

    def axis(r: range) -> torch.Tensor:
        return torch.arange(r.start, r.stop, dtype=torch.int64, device=device)

    b = axis(batch)[:, None, None, None]
    h = axis(heads)[None, :, None, None]
    i = axis(rows)[None, None, :, None]
    j = axis(cols)[None, None, None, :]
    offset = ((b * heads_q + h) * len_q + i) * len_k + j
    threshold = torch.tensor(dropout_p, dtype=torch.float32)
    return uniform(seed, offset) >= threshold


def dropout_mask(seed: int, shape, dropout_p: float, device=None) -> torch.Tensor:
    """The keep-mask (True = kept) that every backend applies, for shape (B, Hq, Nq, Nk).

    Quadratic by nature: for tests and small analyses only. Kept weights are
    scaled by 1 / (1 - dropout_p) by the attention functions, not here.
    """
    if seed is None:
        raise TypeError("seed must be an int, got None")
    dropout_p, seed = check_dropout(dropout_p, seed)
    shape = check_mask_shape(shape)
    return keep_tile(seed, dropout_p, shape, *(range(n) for n in shape), device=device)


def check_mask_shape(shape) -> tuple[int, int, int, int]:
    """`dropout_mask`'s shape: four non-negative ints (numpy's and 0-d int tensors count) whose product a
    tensor can hold."""
    try:
        dims = tuple(shape)
        if any(isinstance(n, bool) for n in dims):
            raise TypeError
        dims = tuple(operator.index(n) for n in dims)
    except TypeError:
        raise TypeError(f"shape must be a sequence of four ints (B, Hq, Nq, Nk), got {shape!r}") from None
    if len(dims) != 4 or min(dims) < 0:
        raise ValueError(f"shape must be (B, Hq, Nq, Nk) of four non-negative ints, got {dims}")
    if math.prod(dims) >= 2**63:
        raise ValueError(f"shape {dims} has {math.prod(dims)} elements, more than a tensor can hold (2**63 - 1)")
    return dims
