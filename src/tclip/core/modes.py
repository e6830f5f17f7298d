"""Turn statistics and a clip mode into scale factors, and apply them to pieces.

Between pass 1 (statistics, :mod:`tclip.core.stats`) and pass 2 (the rewrite) sits
the plan: for every tensor, the factor by which each slice is multiplied.
Everything here is plain float64 arithmetic on small arrays; nothing reads or
writes files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .dtypes import ML_FLOAT_TYPES, is_bool, is_floating, is_integral
from .stats import TensorStats, kept_index, normalize_axes
from .units import Index

# --------------------------------------------------------------------------- arguments


def check_clip_norm(clip_norm: object) -> float:
    """Validate ``clip_norm``: a real scalar > 0 (``inf`` allowed: no clipping).

    TensorFlow clamps a negative ``clip_norm`` to 0 and so returns zeros (or NaN);
    we refuse it instead, since it is always a mistake.
    """
    value = np.asarray(clip_norm)
    if value.ndim != 0:
        raise ValueError(f"clip_norm: expected a scalar, got an array of shape {value.shape}")
    if not (np.issubdtype(value.dtype, np.number) or value.dtype.type in ML_FLOAT_TYPES) or np.iscomplexobj(value):
        raise TypeError(f"clip_norm: expected a real number, got {clip_norm!r}")
    number = float(value)
    if math.isnan(number) or number <= 0:
        raise ValueError(f"clip_norm: expected a number > 0, got {number!r}")
    return number


def check_norm_dtype(dtype: np.dtype, function: str) -> None:
    """Norm-based clipping takes real floating tensors only (TypeError otherwise)."""
    if not is_floating(dtype):
        raise TypeError(
            f"{function}: expected a floating-point tensor "
            f"(float16, bfloat16, float8, float32, float64), got {np.dtype(dtype).name}"
        )


# --------------------------------------------------------------------------- scale factors


def norm_scale(sum_of_squares: np.ndarray | float, clip_norm: float) -> np.ndarray:
    """``c / max(n, c)`` with ``n = sqrt(sum_of_squares)``, elementwise, float64.

    A zero norm gives 1 (the tensor is left as it is), a NaN norm gives NaN and an
    infinite norm gives 0, as in TensorFlow. ``clip_norm = inf`` gives 1.
    """
    norms = np.sqrt(np.asarray(sum_of_squares, dtype=np.float64))
    if math.isinf(clip_norm):
        return np.ones_like(norms)
    # np.maximum propagates NaN, so a NaN norm yields a NaN scale as in TensorFlow.
    return clip_norm / np.maximum(norms, clip_norm)


def average_norm_scale(sum_of_squares: float, size: int, clip_norm: float) -> float:
    """``c / max(n / size, c)``: TensorFlow's clip_by_average_norm factor."""
    if size == 0 or math.isinf(clip_norm):
        return 1.0
    average = float(np.sqrt(sum_of_squares)) / size  # NaN and Inf pass through
    return float(clip_norm / np.maximum(average, clip_norm))


def global_norm_scale(global_norm: float, clip_norm: float) -> float:
    """The one factor of clip_by_global_norm: ``c / max(g, c)``; NaN when g is not finite.

    TensorFlow computes ``c * min(1/g, 1/c)``, which for a negative ``use_norm``
    is ``c / g``; that case is kept for compatibility. TensorFlow's result for
    ``g <= c`` can be one ulp below 1; ours is exactly 1, so nothing changes:
    ``c = inf`` with ``g = inf`` (float64 squares that overflow, ``[3e200, 1.0]``)
    gives 1 where TensorFlow gives NaN; a NaN ``g`` still gives NaN.
    """
    g = float(global_norm)
    if math.isinf(clip_norm) and not math.isnan(g):
        return 1.0
    if not math.isfinite(g):
        return math.nan
    if g < 0:
        return clip_norm / g
    return clip_norm / max(g, clip_norm)


# --------------------------------------------------------------------------- application


def _work_dtype(dtype: np.dtype) -> np.dtype:
    """float64, or the input's own dtype when it is wider (longdouble)."""
    if dtype.type not in ML_FLOAT_TYPES and np.dtype(dtype).itemsize > 8:
        return np.dtype(dtype)
    return np.dtype(np.float64)


# Elements scaled per step: the float64 intermediate (1 MiB) stays in cache.
SCALE_CHUNK_ELEMENTS = 1 << 17


def apply_scale(piece: np.ndarray, scale: np.ndarray | float, out: bytearray | None = None, *,
                after: TensorStats | None = None, index: Index | None = None) -> np.ndarray:
    """``piece * scale`` computed in float64 and rounded once to ``piece.dtype``.

    ``scale`` broadcasts against ``piece`` (a scalar, or a keepdims block of
    per-slice factors). Where every factor is exactly 1 the piece is returned
    unchanged (a copy), so unclipped tensors stay bit-identical. The work goes
    in runs of rows through one small float64 buffer, never a float64 copy of
    the whole piece. With ``out`` (a buffer of at least ``piece.nbytes``) the
    result is a view of it, valid until the buffer is used again.

    With ``after``, the statistics of the result (block ``index`` of its tensor)
    are added to it run by run, while each run is still in cache.
    """
    scale_array = np.asarray(scale, dtype=np.float64)
    result = _result_array(piece, out)
    if np.all(scale_array == 1.0) or piece.ndim == 0 or piece.size == 0:
        if np.all(scale_array == 1.0):
            result[...] = piece
        else:
            with np.errstate(invalid="ignore", over="ignore"):
                result[...] = np.multiply(piece.astype(_work_dtype(piece.dtype)), scale_array)
        if after is not None:
            after.add(result, index)
        return result
    work = _work_dtype(piece.dtype)
    rows = piece.shape[0]
    per_row = piece.size // rows
    step = max(1, SCALE_CHUNK_ELEMENTS // max(per_row, 1))
    buffer = np.empty((min(step, rows),) + piece.shape[1:], dtype=work)
    row_scaled = scale_array.ndim == piece.ndim and scale_array.shape[0] == rows and rows > 1
    first_row = 0 if index is None else (index[0].start or 0)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 is NaN, as in TensorFlow
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            part = buffer[: stop - start]
            factor = scale_array[start:stop] if row_scaled else scale_array
            np.multiply(piece[start:stop], factor, out=part)
            result[start:stop] = part
            if after is not None:
                rest = index[1:] if index is not None else tuple(slice(0, n) for n in piece.shape[1:])
                after.add(result[start:stop], (slice(first_row + start, first_row + stop),) + tuple(rest))
    return result


def _result_array(piece: np.ndarray, out: bytearray | None) -> np.ndarray:
    if out is not None and len(out) >= piece.nbytes:
        return np.frombuffer(out, dtype=piece.dtype, count=piece.size).reshape(piece.shape)
    return np.empty(piece.shape, dtype=piece.dtype)


def value_bounds(dtype: np.dtype, clip_value_min: object, clip_value_max: object) -> tuple[np.ndarray, np.ndarray]:
    """Check and convert the bounds of clip_by_value to ``dtype``.

    Raises ValueError when min > max anywhere (TensorFlow silently returns min),
    TypeError for bool tensors or non-integral bounds on an integer tensor.
    """
    dtype = np.dtype(dtype)
    lo, hi = np.asarray(clip_value_min), np.asarray(clip_value_max)
    for name, bound in (("clip_value_min", lo), ("clip_value_max", hi)):
        if bound.dtype.kind in "OSUc" or is_bool(bound.dtype):
            raise TypeError(f"{name}: expected a real number, got {bound!r}")
    if is_bool(dtype) or not (is_floating(dtype) or is_integral(dtype)):
        raise TypeError(f"clip_by_value: expected a real numeric tensor, got {dtype.name}")
    lo64, hi64 = lo.astype(np.float64), hi.astype(np.float64)
    if np.any(lo64 > hi64):
        raise ValueError(
            f"clip_value_min must be <= clip_value_max, got min {_short(lo)} > max {_short(hi)}"
        )
    if is_integral(dtype):
        for name, bound in (("clip_value_min", lo), ("clip_value_max", hi)):
            if not is_integral(bound.dtype) and not np.all(np.mod(bound.astype(np.float64), 1) == 0):
                raise TypeError(
                    f"{name}: expected an integer bound for a {dtype.name} tensor, got {_short(bound)}"
                )
        return _within_int_range(lo, dtype), _within_int_range(hi, dtype)
    return lo.astype(dtype), hi.astype(dtype)


def _within_int_range(bound: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """An integral bound as ``dtype``; beyond the dtype's range it clips nothing on that side."""
    info = np.iinfo(dtype)
    exact = bound if is_integral(bound.dtype) else bound.astype(np.float64)  # int64 stays exact
    return np.clip(exact, info.min, info.max).astype(dtype)


def _short(value: np.ndarray) -> str:
    return repr(value.item()) if value.ndim == 0 else f"array of shape {value.shape}"


def clip_values(piece: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``min(max(piece, lo), hi)`` in the piece's dtype; NaN stays NaN."""
    if piece.dtype.type in ML_FLOAT_TYPES:
        # Exact: lo/hi are already values of the piece's dtype, and so is the result.
        wide = np.minimum(np.maximum(piece.astype(np.float32), lo.astype(np.float32)), hi.astype(np.float32))
        return wide.astype(piece.dtype)
    return np.minimum(np.maximum(piece, lo), hi)


# --------------------------------------------------------------------------- modes


@dataclass(frozen=True)
class NormClip:
    """clip_by_norm per tensor, over ``axes`` (None: the whole tensor)."""

    clip_norm: float
    axes: object = None

    name = "norm"


@dataclass(frozen=True)
class AverageNormClip:
    """clip_by_average_norm per tensor."""

    clip_norm: float

    name = "average"


@dataclass(frozen=True)
class GlobalNormClip:
    """clip_by_global_norm over all tensors given; ``use_norm`` overrides the norm."""

    clip_norm: float
    use_norm: float | None = None

    name = "global"


@dataclass(frozen=True)
class ValueClip:
    """clip_by_value with scalar bounds."""

    clip_value_min: float
    clip_value_max: float

    name = "value"


Mode = NormClip | AverageNormClip | GlobalNormClip | ValueClip


def stats_axes(mode: Mode, ndim: int) -> tuple[int, ...] | None:
    """The axes pass 1 must reduce over for ``mode`` on a tensor of rank ``ndim``."""
    if isinstance(mode, NormClip):
        return normalize_axes(mode.axes, ndim)
    return None


def global_norm_of(stats: Sequence[TensorStats]) -> float:
    """sqrt of the sum of every tensor's sum of squares (float64, compensated)."""
    return math.sqrt(math.fsum(s.total_sum_of_squares for s in stats)) if stats else 0.0


def plan_scales(mode: Mode, stats: Mapping[str, TensorStats]) -> dict[str, np.ndarray]:
    """Scale factors per tensor: a 0-d array, or a keepdims array per slice.

    ``stats`` must be complete statistics, reduced over :func:`stats_axes` of the
    mode. Value clipping has no scale factors (an empty dict).
    """
    if isinstance(mode, ValueClip):
        return {}
    clip_norm = check_clip_norm(mode.clip_norm)
    if isinstance(mode, NormClip):
        return {name: norm_scale(s.sum_of_squares if s.axes is not None else s.total_sum_of_squares, clip_norm)
                for name, s in stats.items()}
    if isinstance(mode, AverageNormClip):
        return {
            name: np.asarray(average_norm_scale(s.total_sum_of_squares, s.size, clip_norm))
            for name, s in stats.items()
        }
    g = global_norm_of(list(stats.values())) if mode.use_norm is None else float(mode.use_norm)
    factor = np.asarray(global_norm_scale(g, clip_norm))
    return {name: factor for name in stats}


def scale_for_piece(scale: np.ndarray, index: Index | None, ndim: int, axes: tuple[int, ...] | None) -> np.ndarray:
    """The part of a tensor's scale array that applies to the block ``index``."""
    scale = np.asarray(scale)
    if scale.ndim == 0:
        return scale
    return scale[kept_index(index, ndim, axes)]
