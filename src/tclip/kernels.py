"""The arithmetic applied to one unit of a tensor (see :mod:`tclip.units`).

Every statistic and every rewritten element goes through these few functions,
in the NumPy core and in the file pipeline alike, so the two cannot disagree:

- :func:`widen` converts a unit to float64 exactly (every float dtype tclip
  handles, float16/bfloat16/float8 included, is a subset of float64);
- :func:`reduce_unit` gives its sum of squares (whole, or per slice), its
  smallest and largest value, NaN/Inf counts and optional moments;
- :func:`scale_unit` and :func:`clip_unit` rewrite it in place: the float64
  product (or clamp) rounded once to the unit's dtype, exactly as
  :func:`tclip.plan.apply_scale` and :func:`tclip.plan.clip_values` compute it.

Reductions never go through BLAS: a threaded BLAS dot splits a vector by its
own thread count, so the same data would sum differently on another machine
or under load. ``np.einsum`` sums in a fixed order (and measured 4 times faster
than ``np.add.reduce`` of the squares). max/min are taken on the float64 copy:
NumPy's and ml_dtypes' reductions over float16/bfloat16 run a scalar loop
(5.6 ns per element measured, 40 times the float64 reduction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .dtypes import is_complex

# Float64 exponent field values, for the log2-magnitude histogram.
EXPONENT_BINS = 2048


@dataclass
class UnitMoments:
    """Optional statistics for the report: sum of values, zeros, log2 magnitudes."""

    total: float = 0.0
    zeros: int = 0
    # counts per float64 exponent field (value 1023 + e for 2**e <= |x| < 2**(e+1))
    exponents: np.ndarray = field(default_factory=lambda: np.zeros(EXPONENT_BINS, np.int64))


def widen(x: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """``x`` as float64 (complex128 for complex), exactly, contiguous, in ``x``'s shape.

    Returns ``x`` itself when it already is contiguous float64, else a view of
    ``scratch`` (a float64 buffer) when it is large enough, else a new array.
    """
    if is_complex(x.dtype):
        return np.ascontiguousarray(x, dtype=np.complex128)
    if x.dtype == np.float64 and x.flags.c_contiguous:
        return x
    if scratch is not None and scratch.size >= x.size:
        wide = scratch[: x.size].reshape(x.shape)
    else:
        wide = np.empty(x.shape, np.float64)
    np.copyto(wide, x, casting="unsafe")
    return wide


def narrow_into(wide: np.ndarray, out: np.ndarray) -> None:
    """Round float64 values to ``out``'s dtype (to nearest, ties to even, once) into ``out``."""
    with np.errstate(invalid="ignore", over="ignore"):
        np.copyto(out, wide, casting="unsafe")


def reduce_unit(x: np.ndarray, scratch: np.ndarray | None = None, kept: str | None = None,
                l1: bool = False, moments: UnitMoments | None = None) -> tuple:
    """Statistics of one unit ``x`` (its rectangle's shape).

    Args:
        kept: None for one sum of squares over the whole unit; else an einsum
            output spec (e.g. ``"a"`` for per-row sums of a 2-D unit ``"ab"``)
            for per-slice sums, returned in the reduced (not keepdims) shape.
        l1: also return the sum of ``|x|`` over non-NaN elements (else 0.0).
        moments: add the unit's sum, zeros and exponent counts to it.

    Returns:
        ``(sum_of_squares, smallest, largest, nan_count, inf_count, sum_abs)``;
        smallest/largest ignore NaN (``inf``/``-inf`` when all are NaN).
    """
    wide = widen(x, scratch)
    if wide.dtype == np.complex128:
        return _reduce_complex(wide, kept, l1)
    if kept is None:
        flat = wide.reshape(-1)
        sum_sq: float | np.ndarray = float(np.einsum("i,i->", flat, flat))
        finite = math.isfinite(sum_sq)  # a finite sum of squares rules out NaN and Inf
    else:
        letters = "abcdefghijklmnopqrstuvwxyz"[: wide.ndim]
        sum_sq = np.einsum(f"{letters},{letters}->{kept}", wide, wide)
        finite = bool(np.isfinite(sum_sq).all())
    nans = infs = 0
    values = wide
    if not finite:
        nan_mask = np.isnan(wide)
        nans = int(np.count_nonzero(nan_mask))
        infs = int(np.count_nonzero(np.isinf(wide)))
        if nans:
            values = wide[~nan_mask]
    if values.size:
        smallest, largest = float(values.min()), float(values.max())
    else:
        smallest, largest = math.inf, -math.inf
    if moments is not None:
        _add_moments(values, moments)
    sum_abs = 0.0
    if l1 and values.size:
        sum_abs = float(np.einsum("i->", np.abs(values.reshape(-1))))
    return sum_sq, smallest, largest, nans, infs, sum_abs


def _add_moments(values: np.ndarray, moments: UnitMoments) -> None:
    flat = values.reshape(-1)
    if not flat.size:
        return
    moments.total += float(np.add.reduce(flat))
    moments.zeros += int(flat.size - np.count_nonzero(flat))
    exponents = (flat.view(np.uint64) >> np.uint64(52)).astype(np.uint16) & np.uint16(0x7FF)
    moments.exponents += np.bincount(exponents, minlength=EXPONENT_BINS)


def _reduce_complex(wide: np.ndarray, kept: str | None, l1: bool) -> tuple:
    squares = (wide * wide.conj()).real
    if kept is None:
        sum_sq: float | np.ndarray = float(np.add.reduce(squares.reshape(-1)))
        finite = math.isfinite(sum_sq)
    else:
        letters = "abcdefghijklmnopqrstuvwxyz"[: wide.ndim]
        sum_sq = np.einsum(f"{letters}->{kept}", squares)
        finite = bool(np.isfinite(sum_sq).all())
    nans = infs = 0
    magnitude = np.abs(wide)
    if not finite:
        nan_mask = np.isnan(wide)
        nans = int(np.count_nonzero(nan_mask))
        infs = int(np.count_nonzero(np.isinf(wide)))
        magnitude = magnitude[~nan_mask]
    largest = float(magnitude.max()) if magnitude.size else -math.inf
    sum_abs = float(np.add.reduce(magnitude.reshape(-1))) if l1 and magnitude.size else 0.0
    return sum_sq, -largest, largest, nans, infs, sum_abs


def scale_unit(x: np.ndarray, factor: np.ndarray | float, scratch: np.ndarray | None = None) -> None:
    """``x *= factor`` computed in float64 and rounded once to ``x``'s dtype, in place.

    ``factor`` broadcasts against ``x`` (a scalar or per-slice factors in keepdims form).
    """
    wide = widen(x, scratch)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 is NaN, as in TensorFlow
        np.multiply(wide, factor, out=wide)
    if wide is not x:
        narrow_into(wide, x)


def clip_unit(x: np.ndarray, lo: float, hi: float, scratch: np.ndarray | None = None) -> int:
    """Clamp ``x`` to ``[lo, hi]`` in place (NaN stays NaN); returns how many elements changed.

    ``lo`` and ``hi`` are values of ``x``'s dtype (as floats), so the result is
    exact and equals ``minimum(maximum(x, lo), hi)`` in that dtype.
    """
    wide = widen(x, scratch)
    changed = int(np.count_nonzero(wide < lo)) + int(np.count_nonzero(wide > hi))
    if changed:
        np.maximum(wide, lo, out=wide)
        np.minimum(wide, hi, out=wide)
        if wide is not x:
            narrow_into(wide, x)
    return changed
