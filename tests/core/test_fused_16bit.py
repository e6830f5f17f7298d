"""The 16-bit statistics loops of tclip.core._fused give np.add.reduce's bits.

The AVX2 and AVX-512 copies sum float16 and bfloat16 units two, four or eight leaves of
the pairwise tree side by side, eight values at a time widened and squared straight from
the stored bits (float16 through F16C, bfloat16 squares added by FMA), the extremes found
4,096 at a time; the baseline copy sums one leaf at a time. These tests hold the C results,
every copy the CPU can run, against NumPy's: every finite float16 and bfloat16 value,
lengths on every side of 8, the leaf (128), the split points (multiples of 8), the nodes
summed side by side (256, 512, 1,024) and the chunks whose extremes are found at once
(4,096), subnormals, signed zeros, Inf or NaN in every lane position, and row sums.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import tclip.core.kernels as kernels

KINDS = {"float16": (np.float16, 3), "bfloat16": (ml_dtypes.bfloat16, 2)}
AROUND = (1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 128, 129, 130, 136, 255, 256, 257, 263, 264, 383, 384, 385,
          511, 512, 513, 520, 1015, 1016, 1023, 1024, 1025, 1032, 2047, 2048, 2049, 2056, 3001, 4097, 8191, 8193)
CHUNK = 1 << 62  # NumPy 2.x: one call sums a contiguous vector


LEVELS = {"avx512": 2, "avx2": 1, "baseline": 0}


@pytest.fixture(params=list(LEVELS))
def copies(request):
    level = LEVELS[request.param]
    if kernels._fused.set_copies(level) != level:
        kernels._fused.set_copies(99)  # back to the highest, the default
        pytest.skip(f"this CPU cannot run the {request.param} copies")
    yield
    kernels._fused.set_copies(99)


def expected(x):
    wide = x.astype(np.float64)
    return float(np.add.reduce(wide * wide))


def extremes(x):
    wide = x.astype(np.float64)
    low, high = wide.min(), wide.max()
    if low == 0:  # -0 is below +0 for the C loop: the pattern of the one present
        low = -0.0 if np.signbit(wide[wide == 0]).any() else 0.0
    if high == 0:
        high = 0.0 if (~np.signbit(wide[wide == 0])).any() else -0.0
    return low, high


def c_stats(x, kind):
    total, low, high = kernels._fused.unit_stats(x.view(np.uint8), kind, CHUNK)
    patterns = np.array([low, high], np.uint16).view(x.dtype).astype(np.float64)
    return total, float(patterns[0]), float(patterns[1])


def same_float(a, b):
    return a == b and np.signbit(a) == np.signbit(b)


def values(dtype, n, seed):
    """Many binades, zeros of both signs and subnormals, all finite."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    exponent = np.uint16(0x7C00) if dtype == np.float16 else np.uint16(0x7F80)
    bits[(bits & exponent) == exponent] ^= np.uint16(0x4000)  # Inf and NaN turned finite
    x = bits.view(dtype).copy()
    x[:: 11] = np.array(-0.0, dtype)
    x[5:: 13] = 0
    x[3:: 7] = x[3:: 7].view(np.uint16) & np.uint16(0x803F)  # subnormals (bfloat16: and zeros)
    return x


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("n", AROUND)
def test_sums_and_extremes_at_every_boundary(name, n, copies):
    dtype, kind = KINDS[name]
    for seed in range(3):
        x = values(dtype, n, seed + 17 * n)
        total, low, high = c_stats(x, kind)
        assert total == expected(x), (n, seed)
        want_low, want_high = extremes(x)
        assert same_float(low, want_low) and same_float(high, want_high)


@pytest.mark.parametrize("name", KINDS)
def test_every_finite_value_in_many_orders(name, copies):
    dtype, kind = KINDS[name]
    bits = np.arange(1 << 16, dtype=np.uint16)
    field = np.uint16(0x7C00) if dtype == np.float16 else np.uint16(0x7F80)
    finite = bits[(bits & field) != field].view(dtype)
    rng = np.random.default_rng(4)
    for order in range(3):
        x = finite if order == 0 else finite[rng.permutation(finite.size)]
        for n in (x.size, 1000, 4097):
            assert c_stats(x[:n], kind)[0] == expected(x[:n])


@pytest.mark.parametrize("name", KINDS)
def test_magnitudes_where_order_matters(name, copies):
    """Terms of very different sizes, where any other order of the additions rounds differently."""
    dtype, kind = KINDS[name]
    rng = np.random.default_rng(9)
    for n in (130, 1000, 1030, 5000):
        x = (rng.choice([1.0, 2.0 ** -7, 2.0 ** 7, 3.0], n) * (1 + rng.uniform(0, 1, n))).astype(dtype)
        assert c_stats(x, kind)[0] == expected(x)


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("special", [np.inf, -np.inf, np.nan])
def test_inf_or_nan_anywhere_makes_the_sum_not_finite(name, special, copies):
    dtype, kind = KINDS[name]
    for n in (1, 9, 16, 129, 1024, 1031):
        for where in {0, n // 2, n - 1, min(n - 1, 8), min(n - 1, 1023)}:
            x = values(dtype, n, n + where)
            x[where] = special
            total = c_stats(x, kind)[0]
            assert total != total or total == np.inf, (n, where)


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("columns", [1, 7, 8, 129, 1000, 1024, 1025, 4097])
def test_row_sums(name, columns, copies):
    dtype, kind = KINDS[name]
    rows = 5
    x = values(dtype, rows * columns, columns).reshape(rows, columns)
    sums = np.empty(rows)
    kernels._fused.row_stats(x.reshape(-1).view(np.uint8), kind, columns, sums)
    wide = x.astype(np.float64)
    assert sums.tobytes() == np.add.reduce(wide * wide, axis=1).tobytes()
