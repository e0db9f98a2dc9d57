"""Backend registry and the `"auto"` dispatcher.

Each backend has `name`, `not_supported_reasons(problem) -> list[str]` and
`run(problem) -> (out, lse)` (differentiable in q, k, v). The fused backends
("tiled", "triton") also expose the raw passes that ring attention and
decoding reuse, with no autograd:

    forward(q, k, v, mask, params, rules=None) -> (out, lse)
    backward(dout, q, k, v, mask, out, lse, params, accumulate_into=None, rules=None) -> (dq, dk, dv)

(`accumulate_into=(dq, dk, dv)` in the compute dtype: add into those, return them.)
`rules` is None or a `ScoreRules` (segment ids, prefix, ALiBi slopes, sinks; softcap is
`params.softcap`); both fused backends take it, and callers pass it only when it is not
None. The sinks' gradient is not a pass's: `masks.sinks_grad` computes it from lse.

`mask` is None or broadcast to (B, Hq, Nq, Nk); `params` is an
`AttentionParams`; lse is natural log, float32 (float64 for float64 inputs). `"auto"` walks `AUTO_PRIORITY` and takes the
first backend with no reasons; `choose_backend` says which ran and why.
A backend may add `auto_reasons(problem) -> list[str]`: why `"auto"` passes
it over although it could run when asked by name (triton in the CPU interpreter).
"""

from __future__ import annotations

from typing import NamedTuple

from ..problem import AttentionProblem
from .naive import NaiveBackend
from .tiled_ops import TiledBackend

BACKEND_NAMES = ("auto", "triton", "tiled", "naive")
AUTO_PRIORITY = ("triton", "tiled")


class BackendChoice(NamedTuple):
    """The backend that runs, and for every backend passed over, why."""

    name: str
    rejected: dict[str, list[str]]


def get_backend(name: str):
    if name == "naive":
        return NaiveBackend()
    if name == "tiled":
        return TiledBackend()
    if name == "triton":
        from .triton import TritonBackend

        return TritonBackend()
    raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")


def check_backend_name(name: object) -> str:
    if not isinstance(name, str) or name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    return name


def choose_backend(problem: AttentionProblem, name: str = "auto") -> BackendChoice:
    """Resolve `name` for this problem, or raise ValueError listing every reason."""
    check_backend_name(name)
    candidates = AUTO_PRIORITY if name == "auto" else (name,)
    rejected: dict[str, list[str]] = {}
    for candidate in candidates:
        backend = get_backend(candidate)
        reasons = backend.not_supported_reasons(problem)
        if name == "auto" and hasattr(backend, "auto_reasons"):
            reasons = reasons + backend.auto_reasons(problem)
        if not reasons:
            return BackendChoice(candidate, rejected)
        rejected[candidate] = reasons
    details = "; ".join(f"{n}: {', '.join(r)}" for n, r in rejected.items())
    raise ValueError(f"backend {name!r} cannot serve these inputs ({details})")
