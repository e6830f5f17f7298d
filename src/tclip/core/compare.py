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


_TWO_32 = 2.0 ** 32


def _wide_integer(dtype: np.dtype) -> bool:
    """Integers float64 cannot hold exactly (beyond 2**53): 64-bit ones."""
    return dtype.kind in "iu" and dtype.itemsize >= 8


def _split(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact float64 parts of numbers: ``values == high * 2**32 + low + fraction`` with
    ``0 <= low < 2**32`` an integer and ``0 <= fraction < 1`` (finite floats, or integers of
    any width: the parts of a 64-bit integer each fit float64's 53 bits)."""
    values = values.reshape(-1)
    if values.dtype.kind == "u":
        wide = values.astype(np.uint64)
        return (wide >> np.uint64(32)).astype(np.float64), (wide & np.uint64(0xFFFFFFFF)).astype(np.float64), \
            np.zeros(wide.shape)
    if values.dtype.kind == "i":
        wide = values.astype(np.int64)
        return (wide >> 32).astype(np.float64), (wide & 0xFFFFFFFF).astype(np.float64), np.zeros(wide.shape)
    values = values.astype(np.float64)
    whole = np.floor(values)
    fraction = values - whole  # exact: Sterbenz
    high = np.floor(whole / _TWO_32)  # a power of two: exact
    return high, whole - high * _TWO_32, fraction  # the low part is exact (within a factor 2 of whole)


def _exact_difference(a: np.ndarray, b: np.ndarray, finite: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``a - b`` to float64's precision (rounded once where both are integers) and which elements
    are exactly equal, at the ``finite`` positions, for a 64-bit integer against an integer or
    a float of any width."""
    with np.errstate(invalid="ignore", over="ignore"):
        high_a, low_a, fraction_a = _split(a.reshape(-1)[finite])
        high_b, low_b, fraction_b = _split(b.reshape(-1)[finite])
        equal = (high_a == high_b) & (low_a == low_b) & (fraction_a == fraction_b)
        difference = (high_a - high_b) * _TWO_32 + ((low_a - low_b) + (fraction_a - fraction_b))
    return difference, equal


def compare_unit(a: np.ndarray, b: np.ndarray, rtol: float, atol: float,
                 buffer: np.ndarray | None = None) -> tuple:
    """(sum (a-b)², sum a², sum b², sum a·b, max|a-b|, outside, nonfinite mismatches) of one unit.

    A 64-bit integer is compared with the other side (an integer or a float) as the exact
    values both hold, not through float64 (where ``2**53 + 1 == 2**53``): its differences
    and the elements counted outside the tolerance are exact.
    """
    exact = (_wide_integer(a.dtype) or _wide_integer(b.dtype)) and not (is_complex(a.dtype) or is_complex(b.dtype))
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
        if exact:
            d, equal = _exact_difference(a, b, finite)
            if rtol == 0 and atol == 0:
                outside = int(equal.size - np.count_nonzero(equal))
        else:
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
