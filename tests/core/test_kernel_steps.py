"""The scale kernels' table lookups and skipped rows against the reference arithmetic."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from support.kernels import ROW_FACTORS, random_values, same_as_reference
from tclip.core.kernels import Scratch, scale_unit, widen

FLOATS = [np.float16, ml_dtypes.bfloat16, np.float32, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]
SKIPPABLE = [np.float16, ml_dtypes.bfloat16, np.float32]
SIGNALLING_NAN = {np.float16: 0x7D01, ml_dtypes.bfloat16: 0x7F81, np.float32: 0x7F80_0001}
BITS = {2: np.uint16, 4: np.uint32}


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(37, 5001), (3, 100_003), (1, 200_000), (200_000,)])
def test_per_row_factors_on_large_units(dtype, shape):
    x = random_values(dtype, int(np.prod(shape)), seed=21).reshape(shape)
    factors = np.random.default_rng(22).uniform(0, 1.2, (shape[0],) + (1,) * (len(shape) - 1))
    same_as_reference(x, factors)
    same_as_reference(x, factors, Scratch())


@pytest.mark.parametrize("dtype", SKIPPABLE, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("scaled", [[(30, 40)], [(0, 2), (37, 40)], [(5, 6), (20, 22), (39, 40)], []])
def test_rows_with_factor_one_are_left_alone(dtype, scaled):
    x = random_values(dtype, 40 * 3000, seed=24).reshape(40, 3000)
    factors = np.ones((40, 1))
    rng = np.random.default_rng(25)
    for start, stop in scaled:
        factors[start:stop] = rng.uniform(0, 1, (stop - start, 1))
    same_as_reference(x, factors, Scratch())
    same_as_reference(x, factors)


@pytest.mark.parametrize("dtype", SKIPPABLE, ids=lambda d: np.dtype(d).name)
def test_rows_of_factor_one_holding_a_nan_are_scaled_like_the_others(dtype):
    # x * 1.0 turns a signalling NaN into a quiet one: so does the reference, and so must the kernel.
    x = random_values(dtype, 40 * 3000, seed=26).reshape(40, 3000)
    factors = np.ones((40, 1))
    factors[35:] = 0.37
    x[5, 7] = np.nan
    x[12, 8:10] = np.array([SIGNALLING_NAN[dtype]] * 2, BITS[np.dtype(dtype).itemsize]).view(dtype)
    x[13, 0] = -np.inf
    same_as_reference(x, factors, Scratch())


def test_many_runs_of_rows_with_factor_one():
    x = random_values(np.float16, 300 * 64, seed=27).reshape(300, 64)
    for pattern in (np.arange(300) % 2 == 0, np.arange(300) % 100 < 90, np.arange(300) < 299):
        same_as_reference(x, np.where(pattern, 1.0, 0.37).reshape(300, 1), Scratch())
    wide = np.random.default_rng(28).standard_normal((8, 70_000)).astype(np.float16)
    same_as_reference(wide, np.array([1, 1, 0.5, 1, 1, 1, 0.25, 1.0]).reshape(8, 1), Scratch())


def test_a_unit_whose_factors_are_all_one_keeps_its_bits():
    x = random_values(np.float16, 40 * 3000, seed=29).reshape(40, 3000)
    fast = x.copy()
    assert scale_unit(fast, np.ones((40, 1)), Scratch()) is None
    assert fast.tobytes() == x.tobytes()


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_per_slice_factors_on_other_axes(dtype):
    x = random_values(dtype, 6 * 7 * 5000, seed=30).reshape(6, 7, 5000)
    rng = np.random.default_rng(31)
    for shape in [(6, 7, 1), (1, 7, 1), (6, 1, 1), (1, 1, 5000)]:
        factors = rng.uniform(0, 1, shape)
        factors.reshape(-1)[::3] = 1.0
        same_as_reference(x, factors, Scratch())
    factors = np.ones((6, 7, 1))
    factors[5, 3] = 0.5  # rows (the first axis) with several factors, some of them not 1
    same_as_reference(x, factors, Scratch())


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_one_factor_on_large_units(dtype):
    for shape in [(3 * 65536 + 7,), (1, 2 * 65536 + 1), (2, 3, 65535)]:
        x = random_values(dtype, int(np.prod(shape)), seed=32).reshape(shape)
        same_as_reference(x, 0.3, Scratch())
        same_as_reference(x, 1e-300)


def test_every_16_bit_value_through_the_table():
    for dtype in (np.float16, ml_dtypes.bfloat16):
        every = np.tile(np.arange(1 << 16, dtype=np.uint16), 3).view(dtype)
        same_as_reference(every, 0.7071, Scratch())
        same_as_reference(every, 3.0)
        same_as_reference(every, 1.0)


def test_units_that_are_not_contiguous_still_scale():
    x = random_values(np.float16, 200 * 400, seed=33).reshape(200, 400)[:, ::2]
    factors = np.ones((200, 1))
    factors[7] = 0.3
    same_as_reference(x, factors)
    same_as_reference(x, 0.3)


def test_float16_widening_with_infinities_and_no_nan():
    x = np.array([1.0, np.inf, -np.inf, 65504.0, -0.0], np.float16)
    assert widen(x, Scratch()).tolist() == [1.0, np.inf, -np.inf, 65504.0, -0.0]


# ------------------------------------------------------------------ per-row factors (float16, bfloat16)
# Two fast paths, each held against the reference: the C loop (kernels._scale_rows16_fused)
# where the extension is built, and the per-row tables in NumPy (kernels._scale_rows_by_tables)
# where it is not. Each test runs both: "C" as installed, "tables" with the extension hidden.

import tclip.core.kernels as kernels_module  # noqa: E402

ROW_TABLE_DTYPES = [np.float16, ml_dtypes.bfloat16]
ROW_PATHS = {"C": "_scale_rows16_fused", "tables": "_scale_rows_by_tables"}


class Used(list):
    path = ""


@pytest.fixture(params=list(ROW_PATHS))
def row_path(request, monkeypatch):
    """The fast path under test; returns the list its spy appends each call's result to."""
    if request.param == "tables":
        monkeypatch.setattr(kernels_module, "_fused", None)
    elif kernels_module._fused is None:
        pytest.skip("tclip.core._fused is not built")
    name = ROW_PATHS[request.param]
    used = Used()
    real = getattr(kernels_module, name)

    def spy(x, factor, scratch):
        used.append(real(x, factor, scratch))
        return used[-1]

    monkeypatch.setattr(kernels_module, name, spy)
    used.path = request.param
    return used


@pytest.mark.parametrize("dtype", ROW_TABLE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_row_paths_on_every_value_and_many_factors(dtype, row_path, monkeypatch):
    monkeypatch.setattr(kernels_module, "_ROW_TABLE_MISSES", 1)  # the arithmetic path may take any share
    every = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    factors = np.array(ROW_FACTORS).reshape(-1, 1)
    same_as_reference(np.tile(every, (len(ROW_FACTORS), 1)), factors, Scratch())
    same_as_reference(np.tile(every, (len(ROW_FACTORS), 1))[::-1].copy(), factors)
    assert row_path == [True, True]


@pytest.mark.parametrize("dtype", ROW_TABLE_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(64, 4096), (150, 1031), (3, 600, 7), (2, 70_000)])
def test_row_paths_on_gradient_like_units(dtype, shape, row_path):
    rng = np.random.default_rng(34)
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    x.reshape(-1)[::997] = 0  # zeros, a few subnormals and an Inf take the arithmetic path
    x.reshape(-1)[5::1999] = np.array(2.0 ** -20, dtype)
    x.reshape(-1)[7] = np.inf
    factors = rng.uniform(0.001, 1, (shape[0],) + (1,) * (len(shape) - 1))
    factors.reshape(-1)[::5] = 1.0
    same_as_reference(x, factors, Scratch())
    assert row_path == [True]


@pytest.mark.parametrize("dtype", ROW_TABLE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_row_paths_step_aside(dtype, row_path):
    rng = np.random.default_rng(35)
    x = (rng.standard_normal((64, 2048)) * 3).astype(dtype)
    for factors in (np.zeros((64, 1)), np.full((64, 1), np.nan), np.full((64, 1), np.inf), np.full((64, 1), 1e-300),
                    np.full((64, 1), 1e300)):
        same_as_reference(x, factors, Scratch())
    x[:, ::4] = 0  # a quarter of zeros: the tables' arithmetic path would take too many
    same_as_reference(x, rng.uniform(0, 1, (64, 1)), Scratch())
    same_as_reference(x[:, :100].copy(), rng.uniform(0, 1, (64, 1)), Scratch())  # rows too short for a table
    # C takes any factor in [0, 2**900) and any row length; the tables step aside for all of these
    assert row_path == ([True, False, False, True, False, True, True] if row_path.path == "C" else [False] * 7)


@pytest.mark.parametrize("factor", [0.5, 0.0, 1e300, 1e-300, np.nan, np.inf])
def test_float32_in_one_call_with_specials(factor):
    x = random_values(np.float32, 5000, seed=36).reshape(50, 100)
    x[0, :6] = [np.nan, np.inf, -np.inf, 3.4028235e38, -1.4e-45, -0.0]
    x[1, :2] = np.array([0x7F80_0001, 0xFFC0_0123], np.uint32).view(np.float32)  # signalling and quiet NaN
    same_as_reference(x, factor, Scratch())
    same_as_reference(x, np.full((50, 1), factor))
    factors = np.random.default_rng(37).uniform(0, 2, (50, 1))
    factors[3:40] = 1.0
    same_as_reference(x, factors, Scratch())


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("values", ["mixed", "negative", "positive", "zeros", "tiny", "nonfinite"])
def test_extremes_from_the_stored_bits_are_those_of_the_values(dtype, values):
    """reduce_unit finds min and max of binary floats from their bit patterns: the same as
    the float64 values' min and max, whatever the signs, zeros and subnormals."""
    from tclip.core.kernels import reduce_unit

    rng = np.random.default_rng(11)
    pick = {"mixed": rng.standard_normal(4096) * 3,
            "negative": -np.abs(rng.standard_normal(4096)) - 0.5,
            "positive": np.abs(rng.standard_normal(4096)) + 0.5,
            "zeros": rng.choice([0.0, -0.0], 4096),
            "tiny": rng.choice([0.0, -0.0, 1e-42, -1e-42, 3e-8, -3e-8, 1e-300, -1e-300], 4096),
            "nonfinite": np.where(rng.random(4096) < 0.01, np.inf, rng.standard_normal(4096))}[values]
    with np.errstate(over="ignore", under="ignore"):
        x = pick.astype(dtype).reshape(64, 64)
    wide = x.astype(np.float64)
    finite = wide[np.isfinite(wide)]
    _, smallest, largest, nans, infs, _ = reduce_unit(x, Scratch())
    assert (smallest, largest) == (float(wide.min()), float(wide.max()))
    if smallest == 0 and largest == 0:  # IEEE 754-2019 minimum and maximum: -0 < +0
        signs = np.signbit(wide)
        assert math.copysign(1, smallest) == (-1 if signs.any() else 1)
        assert math.copysign(1, largest) == (1 if not signs.all() else -1)
    assert infs == int(np.count_nonzero(np.isinf(wide))) and nans == 0
    assert finite.size > 0
