"""A per-rank memory ledger: the bytes of named live buffers, and their peak at every step.

The sequence-parallel passes (`ring`, `ulysses`, `hybrid`) record every
tensor they hold, by name, when it is allocated (`add`) and when it is let go
(`free`), and close each step with `step(label)`. The ledger keeps the live
set, the overall peak with the buffers live at that moment, and, per step,
the step's peak. Tests read it on the CPU (gloo), so memory is asserted in CI
and not only measured on GPUs.

What a ledger counts (the rules; docs/distributed.md, "Memory"):

- every tensor the pass holds: the caller's q, k, v, dout and the out it
  returns and autograd keeps, saved tensors, communication buffers, accumulators
  and the gradients it returns, at their real sizes (`numel * element_size`);
- of a local attention call, what the call allocates at the size of the
  problem: its out and lse, and the float32 `delta = rowsum(dO * O)` of a
  backward pass; not a backend's per-tile scratch (score tiles, a few MiB at
  most, the same on one device and in the ring).

`single_device_ledger` applies the same rules to `exattn.attention` forward +
backward on one device, read from what the tiled and Triton passes allocate,
so the two figures compare like with like.

    ledger = MemoryLedger()
    out = ring_attention(q, k, v, causal=True, ledger=ledger)
    out.backward(dout)
    ledger.peak, ledger.at_peak, ledger.steps   # bytes, {name: bytes}, [StepPeak]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..problem import compute_dtype


def nbytes(x: torch.Tensor | int) -> int:
    """Bytes of a tensor's elements (what it holds, not a larger storage it views), or an int as is."""
    return int(x) if isinstance(x, int) else x.numel() * x.element_size()


class StepPeak(NamedTuple):
    """The largest live total within one step, and the buffers live at that moment."""

    label: str
    peak: int
    buffers: dict[str, int]


class MemoryLedger:
    """Bytes of live buffers, keyed by name; `peak` over its life, `steps` per step.

    `add(name, x)` records tensor `x` (or a byte count) under a new name;
    `free(name)` lets it go; `step(label)` closes a step, recording its peak.
    Names are unique among live buffers: adding a live name is an error, so a
    forgotten `free` cannot hide.
    """

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.total = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.steps: list[StepPeak] = []
        self._step_peak = 0
        self._step_at_peak: dict[str, int] = {}

    def add(self, name: str, x: torch.Tensor | int) -> None:
        if name in self.live:
            raise ValueError(f"ledger: buffer {name!r} is already live")
        size = nbytes(x)
        self.live[name] = size
        self.total += size
        if self.total > self._step_peak:
            self._step_peak, self._step_at_peak = self.total, dict(self.live)
        if self.total > self.peak:
            self.peak, self.at_peak = self.total, dict(self.live)

    def free(self, *names: str) -> None:
        for name in names:
            self.total -= self.live.pop(name)

    def replace(self, name: str, x: torch.Tensor | int) -> None:
        """Free `name` if live, then add it again (a buffer reallocated under the same name)."""
        if name in self.live:
            self.free(name)
        self.add(name, x)

    def size(self, name: str) -> int:
        """Bytes of the live buffer `name`."""
        return self.live[name]

    def step(self, label: str) -> None:
        """Close a step: record its peak (at least the live total now) and start the next."""
        if self.total > self._step_peak:
            self._step_peak, self._step_at_peak = self.total, dict(self.live)
        self.steps.append(StepPeak(label, self._step_peak, self._step_at_peak))
        self._step_peak, self._step_at_peak = self.total, dict(self.live)

    def __repr__(self) -> str:
        return f"MemoryLedger(live={self.total} B, peak={self.peak} B, steps={len(self.steps)})"


class NullLedger:
    """The ledger of a call nobody reads: every method does nothing."""

    def add(self, name, x) -> None:
        pass

    def free(self, *names) -> None:
        pass

    def replace(self, name, x) -> None:
        pass

    def step(self, label) -> None:
        pass

    def size(self, name) -> int:
        return 0


class Prefixed:
    """A ledger whose names all get `prefix`: a pass inside another (the ring inside the hybrid)."""

    def __init__(self, ledger, prefix: str) -> None:
        self.ledger, self.prefix = ledger, prefix

    def add(self, name, x) -> None:
        self.ledger.add(self.prefix + name, x)

    def free(self, *names) -> None:
        self.ledger.free(*(self.prefix + n for n in names))

    def replace(self, name, x) -> None:
        self.ledger.replace(self.prefix + name, x)

    def step(self, label) -> None:
        self.ledger.step(f"{self.prefix}{label}")

    def size(self, name) -> int:
        return self.ledger.size(self.prefix + name)


def as_ledger(ledger: object) -> MemoryLedger | NullLedger:
    if ledger is None:
        return NullLedger()
    if not isinstance(ledger, MemoryLedger):
        raise TypeError(f"ledger must be an exattn.distributed.MemoryLedger or None, got {type(ledger).__name__}")
    return ledger


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel * torch.empty((), dtype=dtype).element_size()


def single_device_ledger(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "triton") -> MemoryLedger:
    """What `exattn.attention(q, k, v)` forward + backward holds on one device, by the ledger's rules.

    Only shapes and dtypes are read. `backend`:

    - "triton": the backward writes dq, dk, dv in the input dtype (the dQ kernel
      path: no float32 dQ), plus the float32 delta;
    - "tiled": the backward accumulates dq, dk, dv in the compute dtype and casts
      each to the input dtype on return (a copy unless they already match).

    Live at the backward's peak: q, k, v, out, lse, dout, delta and the gradients.
    """
    if backend not in ("triton", "tiled"):
        raise ValueError(f"backend must be 'triton' or 'tiled', got {backend!r}")
    ledger = MemoryLedger()
    acc = compute_dtype(q.dtype)
    rows = q.shape[:3]
    out_shape = (*rows, v.shape[3])
    for name, x in (("q", q), ("k", k), ("v", v)):
        ledger.add(name, x)
    ledger.add("out", tensor_bytes(out_shape, q.dtype))
    ledger.add("lse", tensor_bytes(rows, acc))
    ledger.step("forward")
    ledger.add("dout", tensor_bytes(out_shape, q.dtype))
    ledger.add("delta", tensor_bytes(rows, acc))
    grads = (("dq", q), ("dk", k), ("dv", v))
    if backend == "triton":
        for name, x in grads:
            ledger.add(name, tensor_bytes(x.shape, x.dtype))
    else:
        for name, x in grads:
            ledger.add(f"{name}_acc", tensor_bytes(x.shape, acc))
        if acc != q.dtype:
            for name, x in grads:
                ledger.add(name, tensor_bytes(x.shape, x.dtype))
    ledger.step("backward")
    return ledger
