"""The Triton backend (fused GPU kernels). Being written under issue 4."""

from __future__ import annotations


class TritonBackend:
    name = "triton"

    def not_supported_reasons(self, problem) -> list[str]:
        return ["the Triton kernels are not part of this build yet"]

    def run(self, problem):
        raise ValueError("backend 'triton' cannot serve these inputs: " + self.not_supported_reasons(problem)[0])
