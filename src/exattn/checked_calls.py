"""The checks of a call to an entry point (`exattn.attention`, `attention_varlen`, `decode`), kept per
call signature: a later call with the same signature skips validation and the backend choice, and goes
straight to the kernels' passes.

A signature is what those depend on: the entry point, each tensor argument's layout (validation reads
no values, but for `attention_varlen`'s offsets, which a kept call still checks once per tensor), every
other argument's type and value (True and 1 differ), and whether Triton runs in its interpreter
(`TRITON_INTERPRET`). The entry points keep only calls whose checked form holds no
tensor made for the call, outside `torch.compile`'s tracing. A layout is what the kernels' launches are
specialized on as well (shape, strides, dtype, device, 16-byte alignment), so what a call keeps may
also hold the replay plans of its launches (`backends/planned.py`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

MAX_SIGNATURES = 256
ALIGNMENT = 16  # bytes: Triton specializes pointers on it
KNOWN: OrderedDict = OrderedDict()


def call_signature(entry: str, tensors: tuple, window, options: tuple) -> tuple | None:
    """The signature of a call to `entry` with these tensors (or None), window and other arguments; None
    where an argument that should be a tensor is not (validation says what is wrong). A signature holding
    something unhashable is never kept (`known_call`, `remember`)."""
    layout = []
    for x in tensors:
        if isinstance(x, torch.Tensor):
            layout.append(tensor_layout(x))
        elif x is None:
            layout.append(None)
        else:
            return None
    window_types = tuple(map(type, window)) if type(window) is tuple else type(window)
    return (entry, tuple(layout), window, window_types, options, tuple(map(type, options)),
            os.environ.get("TRITON_INTERPRET"))


def keepable(dropout_p, seed) -> bool:
    """Whether a call's checked form can be kept, as far as dropout and tracing go: its seed is given (a
    drawn one differs per call) or it has no dropout, and torch.compile is not tracing it."""
    return ((seed is not None or (type(dropout_p) in (int, float) and dropout_p == 0))
            and not torch.compiler.is_compiling())


def tensor_layout(x: torch.Tensor) -> tuple:
    """What a kernel launch is specialized on: shape, strides, dtype, device and 16-byte alignment."""
    return x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % ALIGNMENT == 0


def known_call(signature: tuple | None) -> Any:
    """What `remember` kept for this signature, or None."""
    try:
        return None if signature is None else KNOWN.get(signature)
    except TypeError:  # an unhashable argument
        return None


def remember(signature: tuple | None, checked: Any) -> None:
    if signature is None or torch.compiler.is_compiling():
        return
    try:
        KNOWN[signature] = checked
    except TypeError:  # an unhashable argument
        return
    if len(KNOWN) > MAX_SIGNATURES:
        KNOWN.popitem(last=False)
