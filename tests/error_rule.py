"""The project's one accuracy rule, shared by every test.

An implementation passes when its error against the float64 oracle is at most
twice the error of the naive implementation in the same dtype, plus a floor:

    err(ours) <= 2 * err(naive) + floor[dtype] * max(1, max|ref|)
"""

from __future__ import annotations

import torch

from exattn.reference import max_abs_error

FLOORS = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.5e-2,
}


def assert_matches_oracle(name: str, ours, naive, ref, dtype: torch.dtype, floor: float | None = None):
    """Assert the rule for one tensor; NaN anywhere fails."""
    assert not torch.isnan(ours).any(), f"{name}: NaN in output"
    floor = FLOORS[dtype] if floor is None else floor
    floor *= max(1.0, float(ref.detach().abs().nan_to_num(posinf=0, neginf=0).max()) if ref.numel() else 1.0)
    err, base = max_abs_error(ours, ref), max_abs_error(naive, ref)
    assert err <= 2 * base + floor, f"{name}: err {err:.3e} > 2 * naive {base:.3e} + {floor:.1e}"


def floor_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype whose floor judges tensor `name` of inputs in `dtype`: lse (float32 from any input
    dtype) float32's; every other, d sinks too, the inputs' (d sinks = -sum P_sink * delta, with
    delta from the stored output, carries that output's rounding: docs/error-bound.md)."""
    return torch.float32 if name == "lse" and dtype in (torch.float16, torch.bfloat16) else dtype
