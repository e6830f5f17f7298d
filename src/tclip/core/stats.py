"""Statistics of a tensor that can be accumulated piece by piece and merged.

This is pass 1 of every norm-based clip: one read of the data yields, per tensor,
the sum of squares (in float64, over the whole tensor or per slice along
``axes``), the smallest and largest value, the sum of ``|x|`` on request and the
NaN/Inf counts. Pieces may come in any order and any shape, as long as each is
a rectangular block of the tensor named by a tuple of slices (``index``); two
accumulators over disjoint blocks of the same tensor (or two workers' shares)
merge into the statistics of the union.

Each piece is reduced unit by unit (:mod:`tclip.core.units`, :mod:`tclip.core.kernels`)
and the whole-tensor sums of the units are added *exactly* (the running sum
is kept as a list of non-overlapping floats, rounded once when read), so the
order in which units, blocks, threads or files arrive cannot change a bit of
the result. Per-slice sums are added in unit order. The whole-array
functions in :mod:`tclip.core.ops` use exactly this code, so the file pipeline and
the NumPy API cannot disagree.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .exact import ExactSum
from .kernels import EXPONENT_BINS, Scratch, UnitMoments, reduce_unit
from .units import UNIT_ELEMENTS, Index, UnitGrid


@dataclass(frozen=True)
class AxesFault:
    """The first axis a tensor cannot take: ``kind`` "type" (not an integer), "range"
    (no such axis at this rank) or "repeat" (the axis ``earlier`` named already)."""

    kind: str
    axis: object
    earlier: object = None


def axes_fault(items: Sequence[object], ndim: int) -> AxesFault | None:
    """Why a tensor of rank ``ndim`` cannot take the axes ``items`` (None: it can).

    The one check behind :func:`normalize_axes` (which raises) and the command
    line's skip reasons (which leave such a tensor unchanged).
    """
    seen: dict[int, object] = {}
    for item in items:
        if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, np.integer)):
            return AxesFault("type", item)
        axis = operator.index(item)
        if not -ndim <= axis < ndim:
            return AxesFault("range", item)
        positive = axis % ndim
        if positive in seen:
            return AxesFault("repeat", item, seen[positive])
        seen[positive] = item
    return None


def axes_items(axes: object) -> list[object]:
    """``axes`` (an int or a sequence of ints) as a list of its items."""
    if isinstance(axes, np.ndarray):
        axes = axes.tolist()
    return [axes] if not isinstance(axes, Sequence) or isinstance(axes, str) else list(axes)


class UnitResult(NamedTuple):
    """What one unit adds to a tensor's statistics (:meth:`TensorStats.reduce`, a reducer's
    ``reduce``; :meth:`TensorStats.add_unit` takes it).

    ``sum_of_squares`` is per slice (an array) when the statistics keep ``axes``;
    ``sum_abs`` is 0.0 unless they track the L1 norm; ``moments`` is None unless they track
    moments."""

    sum_of_squares: Any
    smallest: float
    largest: float
    nan_count: int
    inf_count: int
    sum_abs: Any
    size: int
    moments: UnitMoments | None


def normalize_axes(axes: object, ndim: int, *, argname: str = "axes") -> tuple[int, ...] | None:
    """Turn ``axes`` (None, an int or a sequence of ints) into sorted non-negative axes.

    None means "all dimensions" and is returned as None; ``[]`` means "no
    dimension" (every element is its own slice) and is returned as ``()``.

    Raises:
        ValueError: an axis is out of range for ``ndim`` or given twice.
        TypeError: an axis is not an integer.
    """
    if axes is None:
        return None
    items = axes_items(axes)
    fault = axes_fault(items, ndim)
    if fault is not None:
        if fault.kind == "type":
            raise TypeError(f"{argname}: expected integers, got {fault.axis!r}")
        axis = operator.index(fault.axis)  # type: ignore[arg-type]
        if fault.kind == "range":
            raise ValueError(f"{argname}: axis {axis} is out of range for a tensor of rank {ndim}")
        raise ValueError(f"{argname}: axis {axis} is repeated (as {fault.earlier!r} and {fault.axis!r}) "
                         f"for a tensor of rank {ndim}")
    return tuple(sorted({operator.index(item) % ndim for item in items}))  # type: ignore[arg-type]


def reduced_shape(shape: Sequence[int], axes: tuple[int, ...] | None) -> tuple[int, ...]:
    """The keepdims shape of a reduction over ``axes`` (None: over everything)."""
    if axes is None:
        return tuple(1 for _ in shape)
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


def kept_index(index: Index | None, ndim: int, axes: tuple[int, ...] | None) -> Index:
    """Where a block ``index`` of the tensor lands in a keepdims per-slice array."""
    if index is None or axes is None:
        return (slice(None),) * ndim
    return tuple(slice(None) if i in axes else s for i, s in enumerate(index))


@dataclass
class Moments:
    """Mean, spread, zeros and a log2-magnitude histogram, accumulated exactly."""

    total: ExactSum = field(default_factory=ExactSum)
    zeros: int = 0
    exponents: np.ndarray = field(default_factory=lambda: np.zeros(EXPONENT_BINS, np.int64))

    def add(self, unit: UnitMoments) -> None:
        self.total.add(unit.total)
        self.zeros += unit.zeros
        self.exponents += unit.exponents

    def merge(self, other: "Moments") -> "Moments":
        merged = Moments(self.total.copy(), self.zeros + other.zeros, self.exponents + other.exponents)
        merged.total.merge(other.total)
        return merged

    def histogram(self) -> tuple[int, list[int]]:
        """(lowest power of two, counts per power) over the non-zero finite magnitudes:
        ``counts[i]`` values have ``2**(lowest+i) <= |x| < 2**(lowest+i+1)``."""
        finite = self.exponents[1:EXPONENT_BINS - 1]
        present = np.flatnonzero(finite)
        if not present.size:
            return 0, []
        first, last = int(present[0]), int(present[-1])
        return first + 1 - 1023, [int(c) for c in finite[first:last + 1]]


@dataclass
class TensorStats:
    """Running statistics of one tensor (or of the part of it added so far).

    Attributes:
        shape: the whole tensor's shape.
        axes: the reduced axes of ``sum_of_squares``: None for one value over
            the whole tensor, a tuple of non-negative axes for one value per slice.
        sum_of_squares: float64 array of the keepdims shape (``()`` when axes is
            None); for complex data the sum of ``|z|**2``.
        sum_abs: sum of ``|x|`` over the tensor (the L1 norm), float64; only
            accumulated when ``track_l1`` (it costs a pass over the data).
        max_abs: largest ``|x|`` that is not NaN (0.0 before any element).
        min_value, max_value: smallest and largest value that is not NaN
            (``inf``/``-inf`` before any; for complex data, of the magnitudes).
        nan_count, inf_count: how many elements are NaN / +-Inf.
        count: how many elements have been added.
        moments: mean/zeros/histogram accumulators when ``track_moments``.
    """

    shape: tuple[int, ...]
    axes: tuple[int, ...] | None = None
    sum_of_squares: np.ndarray = field(default=None)  # type: ignore[assignment]
    sum_abs: float = 0.0
    max_abs: float = 0.0
    nan_count: int = 0
    inf_count: int = 0
    count: int = 0
    track_l1: bool = False
    min_value: float = math.inf
    max_value: float = -math.inf
    track_moments: bool = False
    moments: Moments | None = None
    _total: ExactSum = field(default_factory=ExactSum, repr=False)
    _abs_total: ExactSum = field(default_factory=ExactSum, repr=False)

    def __post_init__(self) -> None:
        self.shape = tuple(int(n) for n in self.shape)
        if self.sum_of_squares is None:
            if self.axes is None:
                self.sum_of_squares = np.zeros((), dtype=np.float64)
            elif math.prod(self.shape) == 0:
                # An empty tensor has nothing to reduce, whatever its other dimensions
                # claim: no (possibly huge) per-slice array for it.
                self.sum_of_squares = np.zeros(tuple(0 for _ in self.shape), dtype=np.float64)
            else:
                self.sum_of_squares = np.zeros(reduced_shape(self.shape, self.axes), dtype=np.float64)
        if self.track_moments and self.moments is None:
            self.moments = Moments()

    @classmethod
    def empty(cls, shape: Sequence[int], axes: object = None, *, track_l1: bool = False,
              track_moments: bool = False) -> "TensorStats":
        """Statistics of nothing yet, for a tensor of ``shape`` reduced over ``axes``."""
        return cls(tuple(shape), normalize_axes(axes, len(shape)), track_l1=track_l1,
                   track_moments=track_moments)

    @classmethod
    def of(cls, array: np.ndarray, axes: object = None, *, track_l1: bool = False,
           track_moments: bool = False) -> "TensorStats":
        """Statistics of a whole in-memory array."""
        array = np.asarray(array)
        stats = cls.empty(array.shape, axes, track_l1=track_l1, track_moments=track_moments)
        stats.add(array)
        return stats

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def complete(self) -> bool:
        """True once every element of the tensor has been added exactly once."""
        return self.count == self.size

    @property
    def total_sum_of_squares(self) -> float:
        """Sum of squares over the whole tensor, whatever ``axes`` is."""
        if self.axes is None:
            return self._total.value
        with np.errstate(over="ignore"):  # rows each below float64's largest may sum past it: inf
            return float(np.sum(self.sum_of_squares))

    @property
    def norm(self) -> float:
        """L2 norm of the whole tensor."""
        return float(np.sqrt(self.total_sum_of_squares))

    @property
    def nonfinite_count(self) -> int:
        return self.nan_count + self.inf_count

    @property
    def mean(self) -> float | None:
        """Mean of the non-NaN values (needs ``track_moments``)."""
        n = self.count - self.nan_count
        if self.moments is None or n <= 0:
            return None
        return self.moments.total.value / n

    @property
    def std(self) -> float | None:
        """Standard deviation of the non-NaN values (needs ``track_moments``; whole-tensor sums)."""
        n = self.count - self.nan_count
        mean = self.mean
        if mean is None or self.axes is not None and self.moments is None:
            return None
        if not math.isfinite(mean):
            return math.nan
        variance = self.total_sum_of_squares / n - mean * mean
        return math.sqrt(max(variance, 0.0))

    def slice_norms(self) -> np.ndarray:
        """L2 norm per slice (keepdims shape); a 0-d array when axes is None."""
        if self.axes is None:
            return np.sqrt(np.asarray(self.total_sum_of_squares))
        return np.sqrt(self.sum_of_squares)

    # ------------------------------------------------------------------ adding data

    def add(self, piece: np.ndarray, index: Index | None = None, scratch: Scratch | None = None) -> None:
        """Add one block of the tensor; ``index`` locates it (None: the whole tensor).

        The block is reduced unit by unit in its memory order, so the whole
        tensor added at once gives the same bits as the file pipeline reading it.
        """
        piece = np.asarray(piece)
        if index is None and piece.shape != self.shape:
            raise ValueError(f"piece of shape {piece.shape} given without an index "
                             f"for a tensor of shape {self.shape}")
        if piece.size == 0:
            return
        index = tuple(slice(0, n) for n in piece.shape) if index is None else tuple(
            slice(*s.indices(n)[:2]) for s, n in zip(index, self.shape))
        target = self.sum_of_squares
        axes = self.axes
        if piece.ndim >= 2 and piece.flags.f_contiguous and not piece.flags.c_contiguous:
            # Reduce in memory order (as a Fortran-order .npy file is read).
            piece, index = piece.T, index[::-1]
            if axes is not None:
                target = target.T
                axes = tuple(sorted(piece.ndim - 1 - a for a in axes))
        grid = UnitGrid.of(piece.shape)
        if scratch is None:
            scratch = Scratch(min(piece.size, UNIT_ELEMENTS))
        for k in range(grid.count):
            rect = grid.index(k)
            unit = piece[rect]
            at = tuple(slice(s.start + r.start, s.start + r.stop) for s, r in zip(index, rect))
            self.add_unit(self.reduce(unit, scratch, axes), at, target, axes)

    def reduce(self, unit: np.ndarray, scratch: Scratch | None, axes: tuple[int, ...] | None = None,
               wide: np.ndarray | None = None, extremes: bool = True) -> UnitResult:
        """The kernel's result for one unit (``axes``: of the unit's own layout; ``wide``:
        the unit in float64 when the caller has it; ``extremes``: also min/max and NaN/Inf
        counts, which the after-statistics of a rewrite do without)."""
        axes = self.axes if axes is None and self.axes is not None else axes
        moments = UnitMoments() if self.track_moments else None
        result = reduce_unit(unit, scratch, None if self.axes is None else axes, self.track_l1, moments, wide,
                             extremes)
        return UnitResult(*result, unit.size, moments)

    def add_unit(self, result: UnitResult, at: Index, target: np.ndarray | None = None,
                 axes: tuple[int, ...] | None = None) -> None:
        """Add a unit's kernel result (from :meth:`reduce`) for the rectangle ``at``.

        ``target``/``axes`` default to ``sum_of_squares``/``self.axes``; the
        pipeline passes their storage-order views for Fortran-order tensors.
        """
        sum_sq, smallest, largest, nans, infs, sum_abs, size, moments = result
        if self.axes is None:
            self._total.add(sum_sq)
            self.sum_of_squares = np.asarray(self._total.value)
        else:
            target = self.sum_of_squares if target is None else target
            axes = self.axes if axes is None else axes
            keep = kept_index(at, len(at), axes)
            target[keep] += np.reshape(sum_sq, reduced_shape([s.stop - s.start for s in at], axes))
        self.nan_count += nans
        self.inf_count += infs
        self.count += size
        if smallest <= largest:
            self.min_value = min(self.min_value, smallest)
            self.max_value = max(self.max_value, largest)
            self.max_abs = max(self.max_abs, largest, -smallest)
        if self.track_l1:
            self._abs_total.add(sum_abs)
            self.sum_abs = self._abs_total.value
        if moments is not None and self.moments is not None:
            self.moments.add(moments)

    @property
    def l1_norm(self) -> float:
        """Sum of ``|x|`` over the non-NaN elements (needs ``track_l1``)."""
        if not self.track_l1:
            raise ValueError("the L1 norm was not tracked: create the statistics with track_l1=True")
        return self._abs_total.value

    def merge(self, other: "TensorStats") -> "TensorStats":
        """Statistics of the union of two disjoint parts of the same tensor."""
        if other.shape != self.shape or other.axes != self.axes:
            raise ValueError(
                f"cannot merge statistics of shape {other.shape} axes {other.axes} "
                f"into shape {self.shape} axes {self.axes}"
            )
        merged = TensorStats(self.shape, self.axes, np.array(self.sum_of_squares, copy=True),
                             track_l1=self.track_l1 and other.track_l1,
                             track_moments=self.track_moments and other.track_moments)
        merged._total = self._total.copy()
        merged._abs_total = self._abs_total.copy()
        if self.axes is None:
            merged._total.merge(other._total)
            merged.sum_of_squares = np.asarray(merged._total.value)
        else:
            merged.sum_of_squares += other.sum_of_squares
        merged._abs_total.merge(other._abs_total)
        merged.sum_abs = merged._abs_total.value
        merged.max_abs = max(self.max_abs, other.max_abs)
        merged.min_value = min(self.min_value, other.min_value)
        merged.max_value = max(self.max_value, other.max_value)
        merged.nan_count = self.nan_count + other.nan_count
        merged.inf_count = self.inf_count + other.inf_count
        merged.count = self.count + other.count
        if merged.track_moments and self.moments is not None and other.moments is not None:
            merged.moments = self.moments.merge(other.moments)
        return merged
