"""The Triton passes over packed variable-length batches (`exattn.attention_varlen`).

The dense kernels serve them with VARLEN set (the Gluon kernels with their VARLEN bit): sequence
b's programs read its rows from the int32 offsets on the device (no host sync), the grid is sized by
the longest lengths, and programs past a sequence's end return at once.
"""

from __future__ import annotations

import torch

from ...problem import AttentionParams
from . import (
    GLUON_FORWARD_MIN_LEN,
    GLUON_PACKED_BACKWARD_MIN_LEN,
    gluon_backward_faster,
    gluon_usable,
    replay_key,
    replays,
)
from .passes import Packing, triton_backward, triton_forward
from .replay import replayable


@replayable(replay_key, lambda q, k, v, cu_q, cu_k, max_q, max_k, params, rules=None: replays(q, params.dropout_p))
def triton_varlen_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, params: AttentionParams, rules=None):
    """out (total_q, Hq, Dv) in q's dtype, lse (Hq, total_q) float32 natural log (-inf: no key).
    rules: softcap, ALiBi slopes (B, Hq) of the sequences and sinks, as the dense kernels take them.
    On Hopper the Gluon forward serves what it can (`gluon_forward.gluon_supports`)."""
    packing = Packing(cu_q, cu_k, max_q, max_k)
    if gluon_usable(q, GLUON_FORWARD_MIN_LEN, max_q):
        from .gluon_forward import gluon_supports, run_gluon_forward

        if not gluon_supports(q, k, v, None, params, rules, packing):
            return run_gluon_forward(q, k, v, params, rules, packing)
    return triton_forward(q, k, v, None, params, packing, rules)


@replayable(replay_key, lambda dout, q, k, v, cu_q, cu_k, max_q, max_k, out, lse, params, rules=None:
            replays(q, params.dropout_p))
def triton_varlen_backward(dout, q, k, v, cu_q, cu_k, max_q: int, max_k: int, out, lse, params: AttentionParams,
                           rules=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in the dtypes and token-major shapes of q, k, v. On Hopper the Gluon backward serves
    what it can (`gluon_backward.gluon_backward_supports`) where it is measured faster
    (`gluon_backward_faster`)."""
    packing = Packing(cu_q, cu_k, max_q, max_k)
    if gluon_usable(q, GLUON_PACKED_BACKWARD_MIN_LEN, max_q) and gluon_backward_faster(q.shape[-1], params, rules, packing):
        from . import gluon_backward as gb

        if not gb.gluon_backward_supports(q, k, v, None, params, dout, False, rules, packing):
            return gb.run_gluon_backward(dout, q, k, v, out, lse, params, None, False, rules, packing)
    return triton_backward(dout, q, k, v, None, out, lse, params, packing=packing, rules=rules)
