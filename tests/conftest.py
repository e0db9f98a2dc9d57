import os
import sys

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

# In CI every hypothesis test draws the same examples each run (a failure there reproduces);
# elsewhere they explore new ones.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Without a GPU, Triton kernels run through the interpreter (must be set before triton loads).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _language_namespaces() -> list:
    try:
        import triton.language as tl
    except ImportError:
        return []
    return [tl, tl.core, tl.math, tl.tensor, tl.core.tensor_descriptor_base]


_PRISTINE = [(space, dict(vars(space))) for space in _language_namespaces()]


@pytest.fixture(autouse=True)
def undo_interpreter_patches():
    """Triton 3.6's interpreter patches triton.language for every nested @jit call (tl.sum in a
    kernel, say) and never puts it back; a later Gluon compile in the same process then fails
    ("ir.value has no attribute dtype"). Put the namespaces back after each test."""
    yield
    for space, pristine in _PRISTINE:
        for name, value in pristine.items():
            if vars(space).get(name) is not value:
                setattr(space, name, value)


@pytest.fixture(autouse=True)
def forget_checked_calls():
    """A call signature's kept checks and backend choice (`exattn.checked_calls`) last a process; a test
    that patches the dispatch must not meet a choice an earlier test in its worker made."""
    from exattn import checked_calls

    yield
    checked_calls.KNOWN.clear()
