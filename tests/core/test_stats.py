"""Streaming statistics: any chunking and any merge order give the whole-array result."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tclip
from tclip.core.modes import (
    AverageNormClip,
    GlobalNormClip,
    NormClip,
    ValueClip,
    apply_scale,
    plan_scales,
    scale_for_piece,
)
from tclip.core.stats import TensorStats, normalize_axes


@st.composite
def blocked_arrays(draw):
    """An array, axes to reduce over, and a split of it into rectangular blocks."""
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=7))
    values = draw(hnp.arrays(np.float32, shape, elements=st.floats(-1e3, 1e3, width=32)))
    axes = draw(st.none() | st.lists(st.integers(0, len(shape) - 1), unique=True, min_size=1))
    cuts = []
    for n in shape:
        inner = draw(st.lists(st.integers(1, n - 1), unique=True, max_size=3)) if n > 1 else []
        points = [0, *sorted(inner), n]
        cuts.append([slice(a, b) for a, b in zip(points, points[1:])])
    blocks = list(itertools.product(*cuts))
    order = draw(st.permutations(range(len(blocks))))
    return values, axes, [blocks[i] for i in order]


def assert_same_stats(a: TensorStats, b: TensorStats) -> None:
    np.testing.assert_allclose(a.sum_of_squares, b.sum_of_squares, rtol=1e-12)
    assert a.total_sum_of_squares == pytest.approx(b.total_sum_of_squares, rel=1e-12)
    assert a.l1_norm == pytest.approx(b.l1_norm, rel=1e-12)
    assert (a.max_abs, a.nan_count, a.inf_count, a.count) == (b.max_abs, b.nan_count, b.inf_count, b.count)


@settings(max_examples=150, deadline=None)
@given(blocked_arrays())
def test_any_chunking_gives_the_whole_array_statistics(case):
    values, axes, blocks = case
    whole = TensorStats.of(values, axes, track_l1=True)
    streamed = TensorStats.empty(values.shape, axes, track_l1=True)
    for index in blocks:
        streamed.add(values[index], index)
    assert streamed.complete
    assert_same_stats(streamed, whole)


@settings(max_examples=100, deadline=None)
@given(blocked_arrays(), st.integers(1, 10))
def test_merging_partial_statistics(case, split):
    values, axes, blocks = case
    first = TensorStats.empty(values.shape, axes, track_l1=True)
    second = TensorStats.empty(values.shape, axes, track_l1=True)
    for i, index in enumerate(blocks):
        (first if i % split == 0 else second).add(values[index], index)
    whole = TensorStats.of(values, axes, track_l1=True)
    assert_same_stats(first.merge(second), whole)
    assert_same_stats(second.merge(first), whole)


@settings(max_examples=100, deadline=None)
@given(blocked_arrays(), st.floats(0.1, 1e4))
def test_piecewise_clipping_equals_whole_array_clipping(case, clip_norm):
    values, axes, blocks = case
    stats = TensorStats.empty(values.shape, axes)
    for index in blocks:
        stats.add(values[index], index)
    scale = plan_scales(NormClip(clip_norm, axes), {"t": stats})["t"]
    out = np.empty_like(values)
    for index in blocks:
        piece_scale = scale_for_piece(scale, index, values.ndim, stats.axes)
        out[index] = apply_scale(values[index], piece_scale)
    np.testing.assert_array_equal(out, tclip.clip_by_norm(values, clip_norm, axes=axes))


def test_counts_nan_inf_and_max_abs():
    t = np.array([1.0, -7.0, np.nan, np.inf, -np.inf, np.nan, 2.0], np.float32)
    stats = TensorStats.empty(t.shape)
    stats.add(t[:3], (slice(0, 3),))
    stats.add(t[3:], (slice(3, 7),))
    assert (stats.nan_count, stats.inf_count) == (2, 2)
    assert stats.max_abs == math.inf
    assert math.isnan(stats.total_sum_of_squares)
    finite = TensorStats.of(np.array([[3.0, -4.0]], np.float16), axes=[1], track_l1=True)
    assert (finite.max_abs, finite.l1_norm, finite.norm) == (4.0, 7.0, 5.0)
    np.testing.assert_array_equal(finite.slice_norms(), [[5.0]])


def test_chunks_larger_than_one_blas_call():
    rng = np.random.default_rng(7)
    t = rng.standard_normal(300_001).astype(np.float32)
    exact = math.fsum((t.astype(np.float64) ** 2).tolist())
    assert TensorStats.of(t).total_sum_of_squares == pytest.approx(exact, rel=1e-14)


def test_plan_scales_per_mode():
    a, b = np.array([3.0, 4.0]), np.array([[0.0, 12.0]])
    stats = {"a": TensorStats.of(a), "b": TensorStats.of(b)}
    assert float(plan_scales(NormClip(1.0), stats)["a"]) == pytest.approx(0.2)
    assert float(plan_scales(NormClip(100.0), stats)["b"]) == 1.0
    assert float(plan_scales(AverageNormClip(1.0), stats)["a"]) == pytest.approx(0.4)
    scales = plan_scales(GlobalNormClip(6.5), stats)
    assert float(scales["a"]) == float(scales["b"]) == pytest.approx(0.5)
    assert float(plan_scales(GlobalNormClip(1.0, use_norm=2.0), stats)["a"]) == 0.5
    assert plan_scales(ValueClip(-1, 1), stats) == {}


def test_merge_refuses_different_tensors():
    with pytest.raises(ValueError, match="cannot merge"):
        TensorStats.empty((2, 3)).merge(TensorStats.empty((3, 2)))


def test_normalize_axes_forms():
    assert normalize_axes(None, 3) is None
    assert normalize_axes([], 3) == ()
    assert normalize_axes(-1, 3) == (2,)
    assert normalize_axes(np.array([2, 0]), 3) == (0, 2)
    with pytest.raises(TypeError, match="expected integers"):
        normalize_axes([1.5], 3)
