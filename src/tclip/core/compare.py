"""The arithmetic of comparing two units of equal shape, exactly and in a fixed order.

Per unit: the sums of ``(a-b)²``, ``a²``, ``b²`` and ``a·b`` over the positions where
both values are finite, the largest ``|a-b|``, the elements outside
``|a-b| <= atol + rtol·|b|`` and the NaN/Inf positions that differ (NaN equals NaN, an
infinity the same infinity). :class:`DiffSums` adds the units' sums exactly, so the
result does not depend on how a tensor was cut into blocks or threads.
"""

from __future__ import annotations

import numpy as np

from .dtypes import is_complex
from .exact import ExactSum
from .kernels import dot


def _values(x: np.ndarray) -> np.ndarray:
    if is_complex(x.dtype):
        return x.astype(np.complex128)
    if x.dtype == np.float64:
        return x
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(np.float64)


def compare_unit(a: np.ndarray, b: np.ndarray, rtol: float, atol: float, exact_ints: bool,
                  buffer: np.ndarray | None = None) -> tuple:
    """(sum (a-b)², sum a², sum b², sum a·b, max|a-b|, outside, nonfinite mismatches) of one unit."""
    if exact_ints:
        outside = int(np.count_nonzero(a != b)) if rtol == 0 and atol == 0 else -1
    else:
        outside = -1
    x, y = _values(a).reshape(-1), _values(b).reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        finite = np.isfinite(x) & np.isfinite(y)
        all_finite = bool(finite.all())
        mismatched_nonfinite = 0
        if not all_finite:
            both_nan = np.isnan(x) & np.isnan(y)
            same_inf = np.isinf(x) & (x == y)
            mismatched_nonfinite = int(np.count_nonzero(~finite & ~both_nan & ~same_inf))
            x, y = x[finite], y[finite]
        d = x - y
        if np.iscomplexobj(d):
            dd = float(np.add.reduce((d * d.conj()).real))
            aa = float(np.add.reduce((x * x.conj()).real))
            bb = float(np.add.reduce((y * y.conj()).real))
            ab = float(np.add.reduce((x * y.conj()).real))
            magnitude = np.abs(d)
        else:
            dd, aa, bb, ab = dot(d, d, buffer), dot(x, x, buffer), dot(y, y, buffer), dot(x, y, buffer)
            magnitude = np.abs(d)
        largest = float(magnitude.max()) if magnitude.size else 0.0
        if outside < 0:
            if rtol == 0 and atol == 0:
                outside = int(np.count_nonzero(x != y))
            else:
                outside = int(np.count_nonzero(~(magnitude <= atol + rtol * np.abs(y))))
    return dd, aa, bb, ab, largest, outside, mismatched_nonfinite


class DiffSums:
    """The sums of a tensor's units, added exactly; the largest difference; the counts."""

    def __init__(self) -> None:
        self.dd, self.aa, self.bb, self.ab = ExactSum(), ExactSum(), ExactSum(), ExactSum()
        self.largest = 0.0
        self.outside = 0
        self.nonfinite = 0

    def add(self, result: tuple) -> None:
        dd, aa, bb, ab, largest, outside, nonfinite = result
        self.dd.add(dd)
        self.aa.add(aa)
        self.bb.add(bb)
        self.ab.add(ab)
        self.largest = max(self.largest, largest)
        self.outside += outside
        self.nonfinite += nonfinite


def identical_unit(x: np.ndarray, buffer: np.ndarray | None = None) -> tuple:
    """A unit whose bytes are the same on both sides: no difference, one sum of squares."""
    values = _values(x).reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        finite = np.isfinite(values)
        if not finite.all():
            values = values[finite]
        aa = dot(values, values, buffer)
    return 0.0, aa, aa, aa, 0.0, 0, 0
