"""One run of the study: its description, its inputs, and the call that runs it.

This is the only module that knows how each phase calls exattn: prefill is
`exattn.attention` over all queries; decode is one new query against the
whole context, through `decode_call` (`exattn.decode`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

import exattn

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class RunSpec:
    """One implementation on one setting. Prefill: Nq = Nk = seq_len; decode: Nq = 1, Nk = seq_len.

    impl is "naive" (the baseline, no tiles) or a backend name ("tiled", "triton").
    """

    phase: str
    impl: str
    dtype: str
    seq_len: int
    causal: bool
    dropout_p: float
    block_m: int | None
    block_n: int | None
    batch: int
    heads: int
    heads_k: int
    head_dim: int
    seed: int
    device: str

    @property
    def len_q(self) -> int:
        return self.seq_len if self.phase == "prefill" else 1

    @property
    def backward(self) -> bool:
        """Prefill is measured forward and backward; decoding is inference, forward only."""
        return self.phase == "prefill"

    @property
    def tile(self) -> str:
        return "-" if self.block_m is None else f"{self.block_m}x{self.block_n}"

    @property
    def setting(self) -> tuple:
        """What the implementations of one comparison share: same inputs, same oracle."""
        return (self.phase, self.dtype, self.seq_len, self.causal, self.dropout_p)

    def as_dict(self) -> dict:
        return asdict(self)


class Inputs(NamedTuple):
    """q (B, Hq, Nq, D), k and v (B, Hk, Nk, D), dout (B, Hq, Nq, D) or None for decode."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor | None


def make_inputs(spec: RunSpec) -> Inputs:
    """Standard-normal inputs rounded to the run's dtype; the same draw for every impl, tile and dtype."""
    stream = spec.seed * 1_000_003 + spec.seq_len * 2 + (spec.phase == "decode")
    gen = torch.Generator().manual_seed(stream)
    shapes = {
        "q": (spec.batch, spec.heads, spec.len_q, spec.head_dim),
        "k": (spec.batch, spec.heads_k, spec.seq_len, spec.head_dim),
        "v": (spec.batch, spec.heads_k, spec.seq_len, spec.head_dim),
        "dout": (spec.batch, spec.heads, spec.len_q, spec.head_dim),
    }
    dtype, device = DTYPES[spec.dtype], torch.device(spec.device)
    tensors = {
        name: torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
        for name, shape in shapes.items()
    }
    for name in ("q", "k", "v"):
        tensors[name].requires_grad_(spec.backward)
    return Inputs(tensors["q"], tensors["k"], tensors["v"], tensors["dout"] if spec.backward else None)


def decode_call(spec: RunSpec, q, k_cache, v_cache) -> torch.Tensor:
    """One new query (B, Hq, 1, D) against the whole cache (B, Hk, N, D).

    The baseline is the naive formula with Nq = 1; a backend runs
    `exattn.decode`, split-KV with one split per `block_n` keys.
    """
    if spec.impl == "naive":
        return exattn.attention(q, k_cache, v_cache, causal=True, backend="naive")
    splits = math.ceil(spec.seq_len / spec.block_n)
    return exattn.decode(q, k_cache, v_cache, num_splits=splits, backend=spec.impl)


def forward(spec: RunSpec, inputs: Inputs) -> torch.Tensor:
    """The output (B, Hq, Nq, D) of this run's implementation."""
    if spec.phase == "decode":
        return decode_call(spec, inputs.q, inputs.k, inputs.v)
    return exattn.attention(
        inputs.q, inputs.k, inputs.v, causal=spec.causal, dropout_p=spec.dropout_p,
        seed=spec.seed, backend=spec.impl, block_m=spec.block_m, block_n=spec.block_n,
    )


def run_once(spec: RunSpec, inputs: Inputs) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Forward, and backward with `dout` for prefill: (out, (dq, dk, dv) or None)."""
    for x in (inputs.q, inputs.k, inputs.v):
        x.grad = None
    out = forward(spec, inputs)
    if not spec.backward:
        return out.detach(), None
    out.backward(inputs.dout)
    return out.detach(), (inputs.q.grad, inputs.k.grad, inputs.v.grad)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
