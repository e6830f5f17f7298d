"""TensorFlow's clipping functions for NumPy arrays, computed exactly.

Every function takes array-likes, keeps the input's shape and dtype, accumulates
norms in float64 and rounds each result once back to the input's dtype. They are
thin uses of :mod:`tclip.core.stats` (pass 1) and :mod:`tclip.core.modes` (scale factors),
the same code the file pipeline runs piece by piece. No I/O happens here.

Where these differ from TensorFlow 2.21 on purpose, the docstring says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .dtypes import is_bool, is_complex, is_floating, real_dtype
from .modes import (
    apply_scale,
    average_norm_scale,
    check_clip_norm,
    check_norm_dtype,
    clip_values,
    global_norm_of,
    global_norm_scale,
    norm_scale,
    value_bounds,
)
from .stats import TensorStats, normalize_axes

__all__ = [
    "clip_by_value",
    "clip_by_norm",
    "clip_by_average_norm",
    "global_norm",
    "clip_by_global_norm",
    "norm",
]


def _as_array(t: Any, argname: str = "t") -> np.ndarray:
    if t is None:
        raise TypeError(f"{argname}: expected an array, got None")
    array = np.asarray(t)
    if array.dtype == object:
        raise TypeError(f"{argname}: expected a numeric array, got an object array")
    return array


def _check_sequence(t_list: Any) -> list[Any]:
    if not isinstance(t_list, Sequence) or isinstance(t_list, (str, bytes)):
        raise TypeError(
            f"t_list: expected a sequence (list or tuple) of arrays, got {type(t_list).__name__}"
        )
    return list(t_list)


def clip_by_value(t: Any, clip_value_min: Any, clip_value_max: Any) -> np.ndarray:
    """Clip every element of ``t`` to ``[clip_value_min, clip_value_max]``.

    Args:
        t: a real numeric array (float, bfloat16/float8, or integer).
        clip_value_min, clip_value_max: scalars, or arrays that broadcast to
            ``t``'s shape without changing it. They are converted to ``t``'s
            dtype; for an integer ``t`` they must be integral.

    Returns:
        ``min(max(t, lo), hi)`` with ``t``'s shape and dtype. NaN stays NaN.

    Raises:
        ValueError: ``clip_value_min > clip_value_max`` anywhere (TensorFlow
            silently returns ``clip_value_min`` there), or the bounds would
            change ``t``'s shape.
        TypeError: bool tensors, or a non-integral bound for an integer tensor.

    Example:
        >>> clip_by_value(np.array([-4, 0, 6]), -2, 2)
        array([-2,  0,  2])
    """
    array = _as_array(t)
    lo, hi = value_bounds(array.dtype, clip_value_min, clip_value_max)
    try:
        target = np.broadcast_shapes(array.shape, lo.shape, hi.shape)
    except ValueError:
        target = None
    if target != array.shape:
        raise ValueError(
            f"clip_value_min/clip_value_max of shapes {lo.shape} and {hi.shape} "
            f"do not broadcast to t's shape {array.shape} without changing it"
        )
    return clip_values(array, lo, hi)


def clip_by_norm(t: Any, clip_norm: Any, axes: Any = None) -> np.ndarray:
    """Scale ``t`` so that its L2 norm (per slice along ``axes``) is at most ``clip_norm``.

    Computes ``t * clip_norm / max(n, clip_norm)`` where ``n`` is the L2 norm of
    ``t`` over ``axes``; slices with ``n <= clip_norm`` (or ``n == 0``) are left
    as they are.

    Args:
        t: a floating-point array (float16/32/64, bfloat16, float8).
        clip_norm: a scalar > 0; ``inf`` returns ``t`` unchanged.
        axes: None (the whole tensor), an int or a sequence of ints (negatives
            allowed); ``[]`` clips every element on its own.

    Returns:
        An array of ``t``'s shape and dtype.

    Raises:
        TypeError: ``t`` is an integer, bool or complex array.
        ValueError: ``clip_norm <= 0`` or NaN (TensorFlow clamps it to 0), or an
            axis is out of range or repeated.

    Differences from TensorFlow: the norm is accumulated in float64, so float16,
    bfloat16 and float32 inputs never overflow (TensorFlow squares in the input
    dtype: float16 ``[300, 0]`` clipped to 1 gives ``[0, 0]`` there, ``[1, 0]``
    here), and the product is rounded once.

    Example:
        >>> clip_by_norm(np.array([[1., 2, 3, 4, 5]], np.float32), 2.0)
        array([[0.26967996, 0.5393599 , 0.80903983, 1.0787199 , 1.3483998 ]], dtype=float32)
    """
    array = _as_array(t)
    check_norm_dtype(array.dtype, "clip_by_norm")
    limit = check_clip_norm(clip_norm)
    reduce_over = normalize_axes(axes, array.ndim)
    stats = TensorStats.of(array, reduce_over)
    sum_of_squares = stats.total_sum_of_squares if reduce_over is None else stats.sum_of_squares
    return apply_scale(array, norm_scale(sum_of_squares, limit))


def clip_by_average_norm(t: Any, clip_norm: Any) -> np.ndarray:
    """Scale ``t`` so that its L2 norm divided by its element count is at most ``clip_norm``.

    Computes ``t * clip_norm / max(n / t.size, clip_norm)``.

    Args:
        t: a floating-point array.
        clip_norm: a scalar > 0; ``inf`` returns ``t`` unchanged.

    Returns:
        An array of ``t``'s shape and dtype.

    Raises:
        TypeError: ``t`` is not floating. ValueError: ``clip_norm <= 0`` or NaN.

    Differences from TensorFlow: any floating dtype is accepted (TensorFlow:
    float32 only), and the norm is accumulated in float64.

    Example:
        >>> clip_by_average_norm(np.array([[3., 4.]]), 1.0)
        array([[0.6, 0.8]])
    """
    array = _as_array(t)
    check_norm_dtype(array.dtype, "clip_by_average_norm")
    limit = check_clip_norm(clip_norm)
    stats = TensorStats.of(array)
    return apply_scale(array, average_norm_scale(stats.total_sum_of_squares, array.size, limit))


def _stats_of_list(tensors: list[Any], function: str) -> list[TensorStats]:
    stats = []
    for i, t in enumerate(tensors):
        if t is None:
            continue
        array = _as_array(t, f"t_list[{i}]")
        check_norm_dtype(array.dtype, f"{function}: t_list[{i}]")
        stats.append(TensorStats.of(array))
    return stats


def global_norm(t_list: Sequence[Any]) -> float:
    """The L2 norm of all elements of all tensors together: ``sqrt(sum(n_i ** 2))``.

    Args:
        t_list: a list or tuple of floating arrays; None entries are skipped.
            Tensors of different dtypes may be mixed (TensorFlow raises).

    Returns:
        A Python float (0.0 for an empty list); NaN or inf when any element is.

    Raises:
        TypeError: ``t_list`` is not a sequence, or holds a non-floating array.

    Example:
        >>> global_norm([np.array([3.0]), None, np.array([[4.0]])])
        5.0
    """
    return global_norm_of(_stats_of_list(_check_sequence(t_list), "global_norm"))


def clip_by_global_norm(
    t_list: Sequence[Any], clip_norm: Any, use_norm: Any = None
) -> tuple[list[np.ndarray | None], float]:
    """Scale every tensor of ``t_list`` by one factor so that their global norm is at most ``clip_norm``.

    Each tensor becomes ``t * clip_norm / max(global_norm, clip_norm)`` in its own
    dtype. When the global norm is NaN or infinite every output is NaN, as in
    TensorFlow.

    Args:
        t_list: a list or tuple of floating arrays (None entries are kept as None).
        clip_norm: a scalar > 0; ``inf`` returns the tensors unchanged.
        use_norm: the global norm to use instead of computing it.

    Returns:
        ``(list_clipped, global_norm)``: the clipped arrays and the global norm
        used, as a Python float.

    Raises:
        TypeError: ``t_list`` is not a sequence or holds a non-floating array.
        ValueError: ``clip_norm <= 0`` or NaN.

    Differences from TensorFlow: mixed dtypes are allowed; a global norm below
    ``clip_norm`` leaves every tensor bit-identical (TensorFlow's factor
    ``c * min(1/g, 1/c)`` can round to one ulp below 1), and so does
    ``clip_norm = inf`` with an infinite global norm (TensorFlow: NaN).

    Example:
        >>> clipped, g = clip_by_global_norm([np.array([3.0]), np.array([4.0])], 1.0)
        >>> g, clipped[0]
        (5.0, array([0.6]))
    """
    tensors = _check_sequence(t_list)
    limit = check_clip_norm(clip_norm)
    stats = _stats_of_list(tensors, "clip_by_global_norm")
    if use_norm is None:
        g = global_norm_of(stats)
    else:
        used = np.asarray(use_norm)
        if used.ndim != 0 or not np.isrealobj(used) or used.dtype.kind not in "fiu":
            raise TypeError(f"use_norm: expected a real scalar, got {use_norm!r}")
        g = float(used)
    factor = global_norm_scale(g, limit)
    clipped = [None if t is None else apply_scale(np.asarray(t), factor) for t in tensors]
    return clipped, g


_VECTOR_ORDS = ("euclidean", 1, 2, math.inf)
_MATRIX_ORDS = ("euclidean", "fro", 1, 2, math.inf)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_norm_args(ord: Any, axis: Any) -> bool:
    """Validate as tf.norm does; return True for a matrix norm."""
    is_matrix = isinstance(axis, (tuple, list)) and len(axis) == 2
    if is_matrix:
        if not (_is_int(axis[0]) and _is_int(axis[1])) or axis[0] == axis[1]:
            raise ValueError(f"axis: expected None, an integer, or a tuple of 2 unique integers, got {axis}")
        if not any(ord == o and type(ord) is not bool for o in _MATRIX_ORDS if isinstance(ord, str) == isinstance(o, str)):
            raise ValueError(f"ord: expected a supported matrix norm in {list(_MATRIX_ORDS)}, got {ord!r}")
        return True
    if not (axis is None or _is_int(axis)):
        raise ValueError(f"axis: expected None, an integer, or a tuple of 2 unique integers, got {axis!r}")
    if ord == "euclidean":
        return False
    if isinstance(ord, (str, bool, np.bool_)) or not isinstance(ord, (int, float, np.integer, np.floating)):
        raise ValueError(f"ord: expected a supported vector norm ('euclidean' or a number > 0), got {ord!r}")
    if not ord > 0:  # also rejects NaN
        raise ValueError(f"ord: expected a supported vector norm ('euclidean' or a number > 0), got {ord!r}")
    return False


def norm(tensor: Any, ord: Any = "euclidean", axis: Any = None, keepdims: bool = False) -> Any:
    """Vector and matrix norms with tf.norm's rules, accumulated in float64.

    Args:
        tensor: a floating or complex array.
        ord: for vector norms (``axis`` None or an int) ``'euclidean'`` or any
            number > 0, ``np.inf`` included; for matrix norms (``axis`` a pair of
            ints) one of ``'fro'``, ``'euclidean'``, 1, 2, ``np.inf``.
        axis: None (the whole tensor as one vector), an int, or a 2-tuple.
        keepdims: keep the reduced axes with size 1.

    Returns:
        The norm(s) in the real dtype of ``tensor`` (complex64 -> float32): a
        NumPy scalar when everything is reduced, else an array.

    Raises:
        ValueError: an unsupported ``ord``/``axis`` combination, or an axis out of
            range. TypeError: integer or bool input.

    Example:
        >>> norm(np.array([[3.0, 4.0]]), ord=np.inf, axis=1)
        array([4.])
    """
    array = _as_array(tensor, "tensor")
    if not (is_floating(array.dtype) or is_complex(array.dtype)) or is_bool(array.dtype):
        raise TypeError(f"norm: expected a floating or complex tensor, got {array.dtype.name}")
    is_matrix = _check_norm_args(ord, axis)
    if is_matrix:
        axes = normalize_axes(list(axis), array.ndim, argname="axis")
        assert axes is not None
        if len(axes) != 2:  # e.g. (0, -2) on a rank-2 tensor
            raise ValueError(f"axis: expected 2 distinct axes, got {axis}")
        row_axis, col_axis = (a % array.ndim for a in axis)
        result = _matrix_norm(array, ord, row_axis, col_axis)
    else:
        axes = normalize_axes(axis, array.ndim, argname="axis")
        result = _vector_norm(array, ord, axes)
    if not keepdims:
        squeeze = tuple(range(array.ndim)) if axes is None else axes
        result = np.squeeze(result, axis=squeeze)
    return result.astype(real_dtype(array.dtype))[()]


def _magnitudes(array: np.ndarray) -> np.ndarray:
    return np.abs(array.astype(np.complex128 if is_complex(array.dtype) else np.float64))


def _vector_norm(array: np.ndarray, ord: Any, axes: tuple[int, ...] | None) -> np.ndarray:
    if ord in ("euclidean", 2):
        stats = TensorStats.of(array, axes)
        if axes is None:
            return np.sqrt(np.full((1,) * array.ndim, stats.total_sum_of_squares))
        return stats.slice_norms()
    magnitude = _magnitudes(array)
    if ord == 1:
        return np.sum(magnitude, axis=axes, keepdims=True)
    if ord == math.inf:
        return np.max(magnitude, axis=axes, keepdims=True, initial=0.0)
    p = float(ord)
    return np.power(np.sum(np.power(magnitude, p), axis=axes, keepdims=True), 1.0 / p)


def _matrix_norm(array: np.ndarray, ord: Any, row_axis: int, col_axis: int) -> np.ndarray:
    if ord in ("fro", "euclidean"):
        return TensorStats.of(array, (row_axis, col_axis)).slice_norms()
    if ord == 2:
        moved = np.moveaxis(array.astype(np.complex128 if is_complex(array.dtype) else np.float64),
                            (row_axis, col_axis), (-2, -1))
        singular = np.linalg.svd(moved, compute_uv=False)
        largest = np.max(singular, axis=-1, initial=0.0)
        return np.expand_dims(largest, axis=(row_axis, col_axis))
    magnitude = _magnitudes(array)
    if ord == 1:  # largest column sum
        sums = np.sum(magnitude, axis=row_axis, keepdims=True)
        return np.max(sums, axis=col_axis, keepdims=True, initial=0.0)
    # ord == inf: largest row sum
    sums = np.sum(magnitude, axis=col_axis, keepdims=True)
    return np.max(sums, axis=row_axis, keepdims=True, initial=0.0)
