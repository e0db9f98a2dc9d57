"""The tiled backend as the dispatcher runs it: eagerly through `autograd.recomputing_attention`
(`RecomputingAttention` where a gradient is wanted, the forward pass alone otherwise), and under
`torch.compile` through the custom ops `exattn::tiled_forward` / `exattn::tiled_backward`
(`custom_ops.py`), so `torch.compile(fullgraph=True)` can trace `attention`.
"""

from __future__ import annotations

import torch

from ..problem import AttentionProblem
from .autograd import recomputing_attention
from .custom_ops import compiled_attention
from .tiled import tiled_backward, tiled_forward


class TiledBackend:
    """Pure PyTorch tiles; serves every input the contract allows, on any device."""

    name = "tiled"
    forward = staticmethod(tiled_forward)
    backward = staticmethod(tiled_backward)

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        return []

    def run(self, problem: AttentionProblem) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            return compiled_attention(self.name, problem)  # the same passes, opaque to the compiler
        return recomputing_attention(problem, self)
