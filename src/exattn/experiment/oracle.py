"""The float64 oracle for one setting: `exattn.reference.attention_ref`, in query-row chunks.

Long sequences would need a float64 (B, Hq, N, N) matrix and its gradient
graph at once; evaluating the oracle over chunks of query rows keeps each
matrix at most `CHUNK_ELEMENTS` entries. Each chunk is exactly
`attention_ref` on those rows, with the causal band given as a bool mask
(the one mask rule, `exattn.masks.band_mask`) and the rows of the same
`exattn.dropout_mask`, so the result equals the unchunked oracle.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..backends.tiled import spans
from ..dropout import dropout_mask
from ..masks import band_mask
from ..problem import UNBOUNDED
from ..reference import attention_ref
from .workload import Inputs, RunSpec

CHUNK_ELEMENTS = 1 << 24


class Reference(NamedTuple):
    """out (B, Hq, Nq, Dv) and, for prefill, grads (dq, dk, dv), all float64."""

    out: torch.Tensor
    grads: tuple[torch.Tensor, ...] | None


def chunk_rows(spec: RunSpec) -> int:
    per_row = spec.batch * spec.heads * spec.seq_len
    return max(1, min(spec.len_q, CHUNK_ELEMENTS // per_row))


def oracle(spec: RunSpec, inputs: Inputs) -> Reference:
    """Float64 output and gradients for the inputs of `spec` (dropout: the shared keep-mask)."""
    q, k, v = (x.detach().to(torch.float64).requires_grad_(spec.backward) for x in inputs[:3])
    len_q, len_k = spec.len_q, spec.seq_len
    window = (UNBOUNDED, 0) if spec.causal or spec.phase == "decode" else (UNBOUNDED, UNBOUNDED)
    keep = None
    if spec.dropout_p > 0:
        shape = (spec.batch, spec.heads, len_q, len_k)
        keep = dropout_mask(spec.seed, shape, spec.dropout_p, device=q.device)
    outs = []
    for rows in spans(0, len_q, chunk_rows(spec)):
        band = band_mask(rows, range(len_k), len_q, len_k, window, q.device)
        out = attention_ref(
            q[:, :, rows.start:rows.stop], k, v, mask=band,
            dropout_mask=None if keep is None else keep[:, :, rows.start:rows.stop],
            dropout_p=spec.dropout_p if keep is not None else None,
        )
        if spec.backward:
            out.backward(inputs.dout[:, :, rows.start:rows.stop].to(torch.float64))
        outs.append(out.detach())
    grads = (q.grad, k.grad, v.grad) if spec.backward else None
    return Reference(torch.cat(outs, dim=2), grads)
