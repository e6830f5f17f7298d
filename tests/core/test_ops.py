"""Properties and named cases of the NumPy core (tclip.ops)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tclip
from tclip.core.stats import TensorStats

FLOAT_DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
EPS = {np.float16: 2**-10, ml_dtypes.bfloat16: 2**-7, np.float32: 2**-23, np.float64: 2**-52}


@st.composite
def float_arrays(draw, dtypes=(np.float32, np.float64), min_dims=0, max_dims=4):
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=1, max_side=6))
    finite = draw(hnp.arrays(np.float64, shape, elements=st.floats(-1e4, 1e4, allow_nan=False)))
    return finite.astype(dtype)


@st.composite
def arrays_and_axes(draw):
    t = draw(float_arrays(dtypes=tuple(FLOAT_DTYPES), min_dims=1))
    axes = draw(st.none() | st.lists(st.integers(0, t.ndim - 1), unique=True, min_size=1))
    return t, axes


def norms(t, axes):
    x = t.astype(np.float64)
    return np.sqrt(np.sum(x * x, axis=None if axes is None else tuple(axes), keepdims=True))


clip_norms = st.floats(1e-3, 1e5)


@settings(max_examples=150, deadline=None)
@given(arrays_and_axes(), clip_norms)
def test_clip_by_norm_bounds_the_norm(t_axes, clip_norm):
    t, axes = t_axes
    out = tclip.clip_by_norm(t, clip_norm, axes=axes)
    assert out.shape == t.shape and out.dtype == t.dtype
    # each element rounds by at most half an ulp, so the norm by at most that ratio
    assert np.all(norms(out, axes) <= clip_norm * (1 + EPS[t.dtype.type] + 1e-12))


@settings(max_examples=150, deadline=None)
@given(arrays_and_axes(), clip_norms)
def test_clip_by_norm_within_limit_is_unchanged(t_axes, clip_norm):
    t, axes = t_axes
    limit = float(np.max(norms(t, axes))) * 1.001 + clip_norm
    np.testing.assert_array_equal(tclip.clip_by_norm(t, limit, axes=axes), t)


@settings(max_examples=150, deadline=None)
@given(arrays_and_axes(), clip_norms)
def test_clip_by_norm_is_idempotent_up_to_rounding(t_axes, clip_norm):
    t, axes = t_axes
    once = tclip.clip_by_norm(t, clip_norm, axes=axes)
    twice = tclip.clip_by_norm(once, clip_norm, axes=axes)
    eps = EPS[t.dtype.type]
    if t.dtype == np.float64:
        # float64 squares are rounded and summed in float64: the norm of `once` is only
        # guaranteed within about (size + 1) units of roundoff, and so is the second factor.
        eps = eps * (t.size + 4) / 2
    np.testing.assert_allclose(twice.astype(np.float64), once.astype(np.float64),
                               rtol=4 * eps, atol=4 * eps * clip_norm)


@settings(max_examples=100, deadline=None)
@given(float_arrays(dtypes=(np.float32,)), clip_norms)
def test_clip_by_norm_matches_exact_formula(t, clip_norm):
    # float32 only: the float64 intermediate is then ~2**29 times finer than the result
    x = t.astype(np.float64)
    n = math.sqrt(math.fsum((x * x).ravel()))
    expected = (x * (clip_norm / max(n, clip_norm))).astype(t.dtype)
    np.testing.assert_array_equal(tclip.clip_by_norm(t, clip_norm), expected)


@settings(max_examples=100, deadline=None)
@given(st.lists(float_arrays(dtypes=tuple(FLOAT_DTYPES)), min_size=1, max_size=4), clip_norms)
def test_clip_by_global_norm_properties(tensors, clip_norm):
    clipped, g = tclip.clip_by_global_norm(tensors, clip_norm)
    exact = math.sqrt(math.fsum(float(np.sum(t.astype(np.float64) ** 2)) for t in tensors))
    assert g == pytest.approx(exact, rel=1e-12)
    assert tclip.global_norm(tensors) == g
    for t, c in zip(tensors, clipped):
        assert c.shape == t.shape and c.dtype == t.dtype
    worst = max(EPS[t.dtype.type] for t in tensors)
    assert tclip.global_norm(clipped) <= clip_norm * (1 + worst + 1e-12)
    if g <= clip_norm:
        for t, c in zip(tensors, clipped):
            np.testing.assert_array_equal(c, t)


@settings(max_examples=100, deadline=None)
@given(float_arrays(dtypes=tuple(FLOAT_DTYPES)), st.floats(1e-6, 1e3))
def test_clip_by_average_norm_bounds_the_average(t, clip_norm):
    out = tclip.clip_by_average_norm(t, clip_norm)
    assert out.dtype == t.dtype and out.shape == t.shape
    average = float(norms(out, None).item()) / t.size
    # subnormal results round by up to half the smallest subnormal, not by a relative eps
    subnormal = float(ml_dtypes.finfo(t.dtype).smallest_subnormal)
    assert average <= clip_norm * (1 + EPS[t.dtype.type] + 1e-12) + subnormal
    if float(norms(t, None).item()) / t.size <= clip_norm:
        np.testing.assert_array_equal(out, t)


@settings(max_examples=100, deadline=None)
@given(float_arrays(dtypes=tuple(FLOAT_DTYPES)), st.floats(-1e4, 1e4), st.floats(0, 1e4))
def test_clip_by_value_properties(t, lo, width):
    hi = lo + width
    out = tclip.clip_by_value(t, lo, hi)
    assert out.dtype == t.dtype and out.shape == t.shape
    lo_t, hi_t = np.asarray(lo).astype(t.dtype), np.asarray(hi).astype(t.dtype)
    assert np.all(out.astype(np.float64) >= lo_t.astype(np.float64))
    assert np.all(out.astype(np.float64) <= hi_t.astype(np.float64))
    np.testing.assert_array_equal(tclip.clip_by_value(out, lo, hi), out)


# ------------------------------------------------------------------ named cases


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_narrow_norms_do_not_overflow(dtype):
    # TensorFlow squares in the input dtype: float16 300**2 = inf, so it returns [0, 0].
    out = tclip.clip_by_norm(np.array([300, 0], dtype), 1.0)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out.astype(np.float64), [1.0, 0.0])


def test_float32_norm_beyond_float32_range():
    t = np.array([3e38, 3e38], np.float32)  # norm 4.2e38 > float32 max
    assert tclip.norm(t.astype(np.float64)) == pytest.approx(math.sqrt(2) * 3e38, rel=1e-7)
    out = tclip.clip_by_norm(t, 1.0)
    np.testing.assert_allclose(out, [math.sqrt(0.5)] * 2, rtol=1e-7)
    assert tclip.global_norm([t]) == pytest.approx(float(np.float32(3e38)) * math.sqrt(2), rel=1e-15)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_inputs(name):
    dtype = getattr(ml_dtypes, name)
    t = np.array([[3.0, 4.0], [0.5, -1.0]], dtype)
    out = tclip.clip_by_norm(t, 2.5, axes=1)
    assert out.dtype == dtype
    np.testing.assert_allclose(out.astype(np.float32), np.array([[1.5, 2.0], [0.5, -1.0]]), rtol=0.07)
    assert tclip.global_norm([t]) == pytest.approx(math.sqrt(9 + 16 + 0.25 + 1))
    assert tclip.norm(t).dtype == dtype


def test_bfloat16_clip_by_value_and_norm():
    t = np.array([-3.0, 0.5, 2.0], ml_dtypes.bfloat16)
    np.testing.assert_array_equal(tclip.clip_by_value(t, -1.0, 1.0).astype(np.float32), [-1.0, 0.5, 1.0])
    assert float(tclip.norm(t, ord=np.inf)) == 3.0


def test_zero_norm_is_unchanged():
    z = np.zeros((2, 3), np.float32)
    np.testing.assert_array_equal(tclip.clip_by_norm(z, 1.0), z)
    np.testing.assert_array_equal(tclip.clip_by_norm(z, 1.0, axes=1), z)
    (out,), g = tclip.clip_by_global_norm([z], 1.0)
    assert g == 0.0
    np.testing.assert_array_equal(out, z)
    np.testing.assert_array_equal(tclip.clip_by_average_norm(z, 1.0), z)


def test_clip_norm_inf_returns_t():
    t = np.array([1e30, -1e30], np.float32)
    np.testing.assert_array_equal(tclip.clip_by_norm(t, math.inf), t)
    np.testing.assert_array_equal(tclip.clip_by_global_norm([t], math.inf)[0][0], t)


def test_nan_and_inf_follow_tensorflow():
    nan_out = tclip.clip_by_norm(np.array([np.nan, 5, -5], np.float32), 1.0)
    assert np.isnan(nan_out).all()
    inf_out = tclip.clip_by_norm(np.array([np.inf, 5, -5], np.float32), 1.0)
    assert np.isnan(inf_out[0]) and inf_out[1] == 0 and inf_out[2] == 0
    clipped, g = tclip.clip_by_global_norm([np.array([1.0, np.inf]), np.array([2.0])], 1.0)
    assert math.isinf(g) and all(np.isnan(c).all() for c in clipped)
    np.testing.assert_array_equal(tclip.clip_by_value(np.array([np.nan, 5.0]), -1, 1), [np.nan, 1.0])


def test_global_norm_edge_cases():
    assert tclip.global_norm([]) == 0.0
    assert tclip.global_norm([None, np.array([3.0], np.float16), np.array([[4.0]])]) == 5.0
    clipped, g = tclip.clip_by_global_norm((None, np.array([6.0, 8.0])), 5.0)
    assert clipped[0] is None and g == 10.0
    np.testing.assert_array_equal(clipped[1], [3.0, 4.0])


def test_use_norm_overrides_the_computed_norm():
    t = np.array([3.0, 4.0])
    clipped, g = tclip.clip_by_global_norm([t], 1.0, use_norm=10.0)
    assert g == 10.0
    np.testing.assert_allclose(clipped[0], [0.3, 0.4])
    clipped, _ = tclip.clip_by_global_norm([t], 1.0, use_norm=np.float32(0.5))
    np.testing.assert_array_equal(clipped[0], t)


def test_clip_by_value_int_and_broadcast():
    t = np.array([[0, 10], [-10, 5]], np.int16)
    out = tclip.clip_by_value(t, np.array([-1, -2]), 3.0)
    assert out.dtype == np.int16
    np.testing.assert_array_equal(out, [[0, 3], [-1, 3]])
    out = tclip.clip_by_value(np.array([0, 200], np.uint8), -5, 1000)  # bounds beyond the range
    np.testing.assert_array_equal(out, [0, 200])


def test_per_element_axes():
    t = np.array([[-3.0, 0.5], [2.0, -0.25]], np.float32)
    np.testing.assert_array_equal(tclip.clip_by_norm(t, 1.0, axes=[]), [[-1.0, 0.5], [1.0, -0.25]])


@pytest.mark.parametrize(
    "ord,axis,expected",
    [
        pytest.param("fro", (0, 1), math.sqrt(30), id="fro"),
        pytest.param(1, (0, 1), 6.0, id="matrix-1-max-column-sum"),
        pytest.param(np.inf, (0, 1), 7.0, id="matrix-inf-max-row-sum"),
        pytest.param(np.inf, (-1, -2), 6.0, id="matrix-inf-swapped-axes"),
        pytest.param(2, (0, 1), 5.116672736016927, id="spectral"),
        pytest.param(1, None, 10.0, id="vector-1"),
        pytest.param(3, None, (1 + 8 + 27 + 64) ** (1 / 3), id="vector-3"),
    ],
)
def test_norm_orders(ord, axis, expected):
    m = np.array([[1.0, -2.0], [3.0, 4.0]])
    assert float(tclip.norm(m, ord=ord, axis=axis)) == pytest.approx(expected, rel=1e-9)


def test_norm_keepdims_and_complex():
    m = np.ones((2, 3, 4), np.float32)
    assert tclip.norm(m, axis=1, keepdims=True).shape == (2, 1, 4)
    assert tclip.norm(m, ord="fro", axis=(0, 2)).shape == (3,)
    assert tclip.norm(m, keepdims=True).shape == (1, 1, 1)
    z = np.array([3 + 4j, 0], np.complex64)
    out = tclip.norm(z)
    assert out.dtype == np.float32 and out == 5.0


def test_norm_of_float32_large_array_is_exact():
    rng = np.random.default_rng(1)
    t = (rng.standard_normal(3_000_000) * 1e3).astype(np.float32)
    exact = math.sqrt(math.fsum((t.astype(np.float64) ** 2).tolist()))
    assert abs(tclip.global_norm([t]) - exact) <= 1e-13 * exact
    assert abs(TensorStats.of(t).norm - exact) <= 1e-13 * exact


# ------------------------------------------------------------------ errors


ERROR_CASES = [
    ("clip_norm zero", lambda: tclip.clip_by_norm([1.0], 0), ValueError, "clip_norm: expected a number > 0, got 0.0"),
    ("clip_norm negative", lambda: tclip.clip_by_global_norm([np.ones(2)], -1.0), ValueError,
     "clip_norm: expected a number > 0, got -1.0"),
    ("clip_norm nan", lambda: tclip.clip_by_average_norm([1.0], math.nan), ValueError,
     "clip_norm: expected a number > 0, got nan"),
    ("clip_norm array", lambda: tclip.clip_by_norm([1.0], [1.0, 2.0]), ValueError,
     "clip_norm: expected a scalar, got an array of shape (2,)"),
    ("min > max", lambda: tclip.clip_by_value([1.0], 2.0, 1.0), ValueError,
     "clip_value_min must be <= clip_value_max, got min 2.0 > max 1.0"),
    ("axis out of range", lambda: tclip.clip_by_norm(np.ones((2, 3)), 1.0, axes=2), ValueError,
     "axes: axis 2 is out of range for a tensor of rank 2"),
    ("negative axis out of range", lambda: tclip.clip_by_norm(np.ones((2, 3)), 1.0, axes=[-3]), ValueError,
     "axes: axis -3 is out of range for a tensor of rank 2"),
    ("axis repeated", lambda: tclip.clip_by_norm(np.ones((2, 3)), 1.0, axes=[1, -1]), ValueError,
     "axes: axis -1 is repeated (as 1 and -1) for a tensor of rank 2"),
    ("int tensor", lambda: tclip.clip_by_norm(np.array([1, 2], np.int32), 1.0), TypeError,
     "clip_by_norm: expected a floating-point tensor (float16, bfloat16, float8, float32, float64), got int32"),
    ("bool tensor", lambda: tclip.clip_by_average_norm(np.array([True]), 1.0), TypeError, "got bool"),
    ("complex tensor", lambda: tclip.global_norm([np.ones(2, np.complex64)]), TypeError,
     "global_norm: t_list[0]: expected a floating-point tensor (float16, bfloat16, float8, float32, float64), got complex64"),
    ("int in global list", lambda: tclip.clip_by_global_norm([np.ones(2), np.ones(2, np.int64)], 1.0),
     TypeError, "clip_by_global_norm: t_list[1]: expected a floating-point tensor"),
    ("t_list not a sequence", lambda: tclip.global_norm(np.ones(3)), TypeError,
     "t_list: expected a sequence (list or tuple) of arrays, got ndarray"),
    ("t_list a string", lambda: tclip.clip_by_global_norm("abc", 1.0), TypeError,
     "t_list: expected a sequence (list or tuple) of arrays, got str"),
    ("t_list a tensor", lambda: tclip.clip_by_global_norm(7.0, 1.0), TypeError,
     "t_list: expected a sequence (list or tuple) of arrays, got float"),
    ("value on bool", lambda: tclip.clip_by_value(np.array([True]), 0, 1), TypeError,
     "clip_by_value: expected a real numeric tensor, got bool"),
    ("fractional bound on int", lambda: tclip.clip_by_value(np.array([1, 2]), 0.5, 1), TypeError,
     "clip_value_min: expected an integer bound for a int64 tensor, got 0.5"),
    ("bounds broadcast", lambda: tclip.clip_by_value(np.ones(3), np.zeros((2, 3)), 1.0), ValueError,
     "do not broadcast to t's shape (3,) without changing it"),
    ("norm ord 0", lambda: tclip.norm(np.ones(3), ord=0), ValueError, "ord: expected a supported vector norm"),
    ("norm fro on a vector", lambda: tclip.norm(np.ones(3), ord="fro"), ValueError,
     "ord: expected a supported vector norm ('euclidean' or a number > 0), got 'fro'"),
    ("matrix ord 3", lambda: tclip.norm(np.ones((2, 2)), ord=3, axis=(0, 1)), ValueError,
     "ord: expected a supported matrix norm in ['euclidean', 'fro', 1, 2, inf], got 3"),
    ("matrix axes equal", lambda: tclip.norm(np.ones((2, 2)), axis=(1, 1)), ValueError,
     "axis: expected None, an integer, or a tuple of 2 unique integers, got (1, 1)"),
    ("axis of 3", lambda: tclip.norm(np.ones((2, 2, 2)), axis=(0, 1, 2)), ValueError,
     "axis: expected None, an integer, or a tuple of 2 unique integers, got (0, 1, 2)"),
    ("norm of ints", lambda: tclip.norm(np.array([1, 2])), TypeError,
     "norm: expected a floating or complex tensor, got int64"),
]


@pytest.mark.parametrize("call,error,message", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_errors_name_the_argument(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert message in str(info.value)
