"""Host-side tile arithmetic of the Triton backend: the same numbers as Triton's own helpers,
which are JIT functions and cost microseconds per host call."""

from __future__ import annotations

import triton
from hypothesis import given
from hypothesis import strategies as st

from exattn.backends.triton.configs import ceil_div, padded_dim


@given(st.integers(0, 2**40), st.integers(1, 2**20))
def test_ceil_div_is_tritons_cdiv(a, b):
    assert ceil_div(a, b) == triton.cdiv(a, b)


@given(st.integers(1, 2**20))
def test_padded_dim_is_the_next_power_of_two_from_16(n):
    assert padded_dim(n) == max(16, triton.next_power_of_2(n))
