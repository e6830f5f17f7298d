"""The AVX-512 copy of the 16-bit statistics that also uses AVX512-BW (level 3 of
tclip.core._fused.set_copies) gives np.add.reduce's bits and the C loops' extremes.

It reads each leaf 32 values at a time, finds the extremes in the same registers from three
integer reductions of the patterns (no key per value; the values a leaf's 32-value loads do
not reach by a masked load), widens bfloat16 by a permutation, and adds the eight leaves of a
node lane-wise in their tree order. The tests of test_fused_16bit.py run here once more at
that level, beside cases for the new extremes: all values of one sign, zeros of one sign
only, lengths around 32, the extremes in the values the 32-value loads leave out.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_fused_16bit import (  # noqa: F401  (collected here again, with this module's copies)
    KINDS,
    c_stats,
    expected,
    extremes,
    same_float,
    test_every_finite_value_in_many_orders,
    test_inf_or_nan_anywhere_makes_the_sum_not_finite,
    test_magnitudes_where_order_matters,
    test_row_sums,
    test_sums_and_extremes_at_every_boundary,
    values,
)

import tclip.core.kernels as kernels

LEVEL = 3


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


HAS_LEVEL = {"avx512f", "avx512bw", "f16c", "fma", "avx2"} <= cpu_flags()


@pytest.fixture
def copies():
    if kernels._fused.set_copies(LEVEL) != LEVEL:
        kernels._fused.set_copies(LEVEL)
        pytest.skip("this CPU cannot run the AVX512-BW copy")
    yield


@pytest.mark.skipif(not HAS_LEVEL, reason="the CPU lacks AVX512-BW")
def test_the_level_is_used_where_the_cpu_has_it():
    assert kernels._fused.set_copies(LEVEL) == LEVEL
    assert kernels._fused.set_copies(99) == LEVEL  # the highest the CPU has, by default too


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("n", [1, 31, 32, 33, 63, 64, 65, 1000, 4095, 4096, 4097, 9000])
@pytest.mark.parametrize("signs", ["positive", "negative", "mixed", "+0 only", "-0 only", "-0 and negative",
                                   "+0 and positive", "zeros of both signs"])
def test_extremes_of_one_sign_and_of_zeros(name, n, signs, copies):
    dtype, kind = KINDS[name]
    rng = np.random.default_rng(n)
    magnitude = np.abs(values(dtype, n, n).astype(np.float64))
    x = {"positive": magnitude, "negative": -magnitude, "mixed": magnitude * rng.choice([-1.0, 1.0], n),
         "+0 only": np.zeros(n), "-0 only": np.full(n, -0.0),
         "-0 and negative": np.where(rng.random(n) < 0.5, -0.0, -magnitude),
         "+0 and positive": np.where(rng.random(n) < 0.5, 0.0, magnitude),
         "zeros of both signs": np.where(rng.random(n) < 0.5, 0.0, -0.0)}[signs].astype(dtype)
    total, low, high = c_stats(x, kind)
    want_low, want_high = extremes(x)
    assert same_float(low, want_low) and same_float(high, want_high), (low, high, want_low, want_high)
    assert total == expected(x)


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("n", [40, 200, 1000, 1023, 2056, 4136])
def test_the_extremes_found_at_every_position(name, n, copies):
    """The smallest and the largest value at each position in turn: in a leaf's 32-value loads,
    in the eights after them, in the last n % 8 terms, in every leaf of a node."""
    dtype, kind = KINDS[name]
    for where in range(n):
        x = np.full(n, 1.5, dtype)
        largest = (where * 7 + 3) % n
        x[largest if largest != where else (where + 1) % n] = 9
        x[where] = -7
        _, low, high = c_stats(x, kind)
        assert (low, high) == (-7.0, 9.0), (n, where)
