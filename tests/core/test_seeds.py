"""Every worked example of ../shared/seeds, to the printed digits.

TensorFlow rounds the norm to float32 before dividing, so some of its printed
float32 results are one ulp away from the correctly rounded value, which is what
tclip returns. Those cases assert both: within one ulp of TensorFlow's digits,
and equal to the exact result rounded once.
"""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import correctly_rounded, ulp_distance
import tclip

F32 = np.float32


def test_clip_by_norm_docs_example():
    t = np.array([[1, 2, 3, 4, 5]], F32)
    got = tclip.clip_by_norm(t, 2.0)
    printed = np.array([[0.26967996, 0.5393599, 0.80903983, 1.0787199, 1.3483998]], F32)
    assert got.dtype == F32 and got.shape == (1, 5)
    assert ulp_distance(got, printed).max() <= 1
    exact = np.arange(1, 6) * 2 / np.sqrt(55.0)
    np.testing.assert_array_equal(got, correctly_rounded(exact, F32)[None])


NUM2 = np.linspace(-2, 3, 6).reshape((2, 3)).astype(F32)


@pytest.mark.parametrize(
    "clip_norm,axes,printed",
    [
        pytest.param(4, None, [[-1.8353258, -0.9176629, 0.0], [0.9176629, 1.8353258, 2.7529888]], id="clip4"),
        pytest.param(5, None, [[-2.0, -1.0, 0.0], [1.0, 2.0, 3.0]], id="clip5-unchanged"),
        pytest.param(3, 1, [[-2.0, -1.0, 0.0], [0.8017837, 1.6035674, 2.4053512]], id="clip3-axes1"),
    ],
)
def test_clip_by_norm_article_examples(clip_norm, axes, printed):
    got = tclip.clip_by_norm(NUM2, clip_norm, axes=axes)
    assert got.dtype == F32
    assert ulp_distance(got, np.array(printed, F32)).max() <= 1
    # and ours is the exact value rounded once
    n = np.sqrt(np.sum(NUM2.astype(np.float64) ** 2, axis=axes, keepdims=True))
    exact = NUM2.astype(np.float64) * clip_norm / np.maximum(n, clip_norm)
    np.testing.assert_array_equal(got, correctly_rounded(exact, F32))


def test_clip_by_norm_unchanged_is_bit_identical():
    np.testing.assert_array_equal(tclip.clip_by_norm(NUM2, 5), NUM2)


def test_clip_by_global_norm_article_example():
    c1 = np.array([[0, 1, 2], [3, 4, 5]], F32)
    c2 = np.array([[-2, -4], [2, 4]], F32)
    (o1, o2), g = tclip.clip_by_global_norm([c1, c2], clip_norm=9)
    np.testing.assert_array_equal(o1, np.array([[0.0, 0.9233805, 1.846761], [2.7701416, 3.693522, 4.6169024]], F32))
    np.testing.assert_array_equal(o2, np.array([[-1.846761, -3.693522], [1.846761, 3.693522]], F32))
    assert g == pytest.approx(np.sqrt(95.0), rel=1e-15)
    assert isinstance(g, float)


def test_clip_by_global_norm_tutorial_unclipped_returns_norm():
    w = np.array(
        [[-0.1529, -0.3025, -0.2745, -0.7379, 0.6346], [-0.7407, 0.5338, -0.2375, -0.7452, 0.4232],
         [0.7719, 0.5403, 0.4836, -0.7039, 0.5534], [-0.7702, 0.0088, 0.5766, 0.2401, -0.5267],
         [0.7486, 0.7236, -0.1808, -0.7242, 0.7003]], F32)
    (out,), g = tclip.clip_by_global_norm([w], 3.0)
    np.testing.assert_array_equal(out, w)
    assert g == pytest.approx(2.8421102, abs=1e-3)  # the printed inputs are rounded to 4 digits


def test_clip_by_value_article_example():
    num1 = np.linspace(-4, 6, 6)
    ints = tclip.clip_by_value(num1.astype(np.int32), -2, 2)
    floats = tclip.clip_by_value(num1.astype(F32), -2.0, 2.0)
    assert ints.dtype == np.int32 and floats.dtype == F32
    np.testing.assert_array_equal(ints, [-2, -2, 0, 2, 2, 2])
    np.testing.assert_array_equal(floats, [-2.0, -2.0, 0.0, 2.0, 2.0, 2.0])


def test_chinese_article_clip_to_5():
    t = np.array([1, 1, 3, 4, 2, 2, 1, 4, 2, 3], np.float64)
    assert tclip.norm(t) == pytest.approx(8.0622577482985491, rel=1e-15)
    out = tclip.clip_by_norm(t, 5)
    np.testing.assert_allclose(out[:4], [0.62017367, 0.62017367, 1.86052102, 2.48069469], atol=5e-9)
    assert tclip.norm(out) == pytest.approx(5.0, rel=1e-15)


NUM3 = np.linspace(-10, 8, 12).reshape((3, 4)).astype(F32)


def test_norm_article_examples():
    p15 = tclip.norm(NUM3, ord=1.5, axis=0)
    assert ulp_distance(p15, np.array([12.364525, 11.0871725, 10.408293, 10.876119], F32)).max() <= 1
    exact = np.sum(np.abs(NUM3.astype(np.float64)) ** 1.5, axis=0) ** (1 / 1.5)
    np.testing.assert_array_equal(p15, correctly_rounded(exact, F32))
    np.testing.assert_array_equal(tclip.norm(NUM3, ord=np.inf, axis=1), np.array([10.0, 3.4545455, 8.0], F32))


# TensorFlow's own test vectors (clip_ops_test.py).
X = np.array([[-3.0, 0.0, 0.0], [4.0, 0.0, 3.0]])  # column norms 5, 0, 3; row norms 3, 5
X0 = np.array([[-3.0, 0.0, 0.0], [4.0, 0.0, 0.0]])  # norm 5


@pytest.mark.parametrize(
    "x,clip_norm,axes,expected",
    [
        pytest.param(X0, 4.0, None, [[-2.4, 0.0, 0.0], [3.2, 0.0, 0.0]], id="all-axes"),
        pytest.param(X0, 4.0, [0, 1], [[-2.4, 0.0, 0.0], [3.2, 0.0, 0.0]], id="axes01"),
        pytest.param(X0, 5.0, None, [[-3.0, 0.0, 0.0], [4.0, 0.0, 0.0]], id="at-limit"),
        pytest.param(X, 4.0, 0, [[-2.4, 0.0, 0.0], [3.2, 0.0, 3.0]], id="axis0"),
        pytest.param(X, 4.0, 1, [[-3.0, 0.0, 0.0], [3.2, 0.0, 2.4]], id="axis1"),
        pytest.param(X, 4.0, -1, [[-3.0, 0.0, 0.0], [3.2, 0.0, 2.4]], id="axis-minus1"),
        pytest.param(X, 2.0, [], [[-2.0, 0.0, 0.0], [2.0, 0.0, 2.0]], id="per-element"),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tensorflow_clip_by_norm_vectors(x, clip_norm, axes, expected, dtype):
    got = tclip.clip_by_norm(x.astype(dtype), clip_norm, axes=axes)
    assert got.dtype == dtype
    np.testing.assert_allclose(got, np.array(expected, dtype), rtol=1e-7 if dtype == np.float32 else 1e-15)
