"""Statistics of a tensor that can be accumulated piece by piece and merged.

This is pass 1 of every norm-based clip: one read of the data yields, per tensor,
the sum of squares (in float64, over the whole tensor or per slice along
``axes``), the sum and maximum of ``|x|`` and the NaN/Inf counts. Pieces may come
in any order and any shape, as long as each is a rectangular block of the tensor
named by a tuple of slices (``index``); two accumulators over disjoint blocks of
the same tensor (or two workers' shares) merge into the statistics of the union.

The whole-array functions in :mod:`tclip.ops` use exactly this code, so the file
pipeline and the NumPy API cannot disagree.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .dtypes import is_bool as is_bool_dtype
from .dtypes import is_complex

# Elements squared and summed at a time. The float64 copy of a chunk stays in
# cache (1 MiB), and a sum of at most 2**17 float64 products keeps the
# worst-case relative rounding error below 2**17 * 2**-53 ~= 1.5e-11; the chunk
# totals are then added with compensated (Neumaier) summation.
CHUNK_ELEMENTS = 1 << 17

Index = tuple[slice, ...]


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
    if isinstance(axes, np.ndarray):
        axes = axes.tolist()
    items = [axes] if not isinstance(axes, Sequence) or isinstance(axes, str) else list(axes)
    seen: dict[int, object] = {}
    for item in items:
        if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, np.integer)):
            raise TypeError(f"{argname}: expected integers, got {item!r}")
        axis = operator.index(item)
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"{argname}: axis {axis} is out of range for a tensor of rank {ndim}"
            )
        positive = axis % ndim
        if positive in seen:
            raise ValueError(
                f"{argname}: axis {axis} is repeated (as {seen[positive]!r} and {item!r}) "
                f"for a tensor of rank {ndim}"
            )
        seen[positive] = item
    return tuple(sorted(seen))


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


def _compensated_add(total: float, carry: float, value: float) -> tuple[float, float]:
    """Neumaier summation: ``total + value``, keeping in ``carry`` the low bits the addition drops."""
    new_total = total + value
    if math.isfinite(new_total):
        if abs(total) >= abs(value):
            carry += (total - new_total) + value
        else:
            carry += (value - new_total) + total
    return new_total, carry


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
        nan_count, inf_count: how many elements are NaN / +-Inf.
        count: how many elements have been added.
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
    # Neumaier compensation terms for the scalar sums (whole-tensor case).
    _ss_carry: float = field(default=0.0, repr=False)
    _abs_carry: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        self.shape = tuple(int(n) for n in self.shape)
        if self.sum_of_squares is None:
            target = () if self.axes is None else reduced_shape(self.shape, self.axes)
            self.sum_of_squares = np.zeros(target, dtype=np.float64)

    @classmethod
    def empty(cls, shape: Sequence[int], axes: object = None, *, track_l1: bool = False) -> "TensorStats":
        """Statistics of nothing yet, for a tensor of ``shape`` reduced over ``axes``."""
        return cls(tuple(shape), normalize_axes(axes, len(shape)), track_l1=track_l1)

    @classmethod
    def of(cls, array: np.ndarray, axes: object = None, *, track_l1: bool = False) -> "TensorStats":
        """Statistics of a whole in-memory array."""
        array = np.asarray(array)
        stats = cls.empty(array.shape, axes, track_l1=track_l1)
        stats.add(array)
        return stats

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def complete(self) -> bool:
        """True once every element of the tensor has been added exactly once."""
        return self.count == self.size

    @property
    def total_sum_of_squares(self) -> float:
        """Sum of squares over the whole tensor, whatever ``axes`` is."""
        if self.axes is None:
            return float(self.sum_of_squares) + self._ss_carry
        return float(np.sum(self.sum_of_squares))

    @property
    def norm(self) -> float:
        """L2 norm of the whole tensor."""
        return float(np.sqrt(self.total_sum_of_squares))

    @property
    def nonfinite_count(self) -> int:
        return self.nan_count + self.inf_count

    def slice_norms(self) -> np.ndarray:
        """L2 norm per slice (keepdims shape); a 0-d array when axes is None."""
        if self.axes is None:
            return np.sqrt(np.asarray(self.total_sum_of_squares))
        return np.sqrt(self.sum_of_squares)

    def add(self, piece: np.ndarray, index: Index | None = None) -> None:
        """Add one block of the tensor; ``index`` locates it (None: the whole tensor)."""
        piece = np.asarray(piece)
        if index is None and piece.shape != self.shape:
            raise ValueError(f"piece of shape {piece.shape} given without an index "
                             f"for a tensor of shape {self.shape}")
        if piece.size == 0:
            return
        if self.axes is None:
            self._add_whole(piece)
        else:
            self._add_per_slice(piece, index)
        self.count += piece.size

    def _add_whole(self, piece: np.ndarray) -> None:
        flat = piece.reshape(-1)
        finite = True
        wide = np.complex128 if is_complex(piece.dtype) else np.float64
        # One float64 buffer for all chunks: a fresh 1 MiB array per chunk costs
        # page faults whenever the allocator hands the memory back to the system.
        buffer = np.empty(min(CHUNK_ELEMENTS, flat.size), dtype=wide)
        for start in range(0, flat.size, CHUNK_ELEMENTS):
            chunk = flat[start : start + CHUNK_ELEMENTS]
            x = buffer[: chunk.size]
            x[...] = chunk
            # einsum, not np.dot: a BLAS dot of this size spends more time
            # waking its threads than summing (measured 1.7 vs 5 GB/s).
            pairs = x.view(np.float64) if x.dtype == np.complex128 else x
            sum_sq = float(np.einsum("i,i->", pairs, pairs))
            self._add_sum_of_squares(sum_sq)
            finite = finite and math.isfinite(sum_sq)
        self._add_magnitudes(flat, finite)

    def _add_per_slice(self, piece: np.ndarray, index: Index | None) -> None:
        if is_complex(piece.dtype):
            x = piece.astype(np.complex128)
            block = np.sum((x * x.conj()).real, axis=self.axes, keepdims=True)
        else:
            # einsum squares and sums in float64 without a float64 copy of the piece.
            letters = "abcdefghijklmnopqrstuvwxyz"[: piece.ndim]
            kept = "".join(c for i, c in enumerate(letters) if i not in self.axes)
            block = np.einsum(f"{letters},{letters}->{kept}", piece, piece, dtype=np.float64)
            block = block.reshape(reduced_shape(piece.shape, self.axes))
        self.sum_of_squares[kept_index(index, len(self.shape), self.axes)] += block
        self._add_magnitudes(piece, bool(np.isfinite(block).all()))

    def _add_sum_of_squares(self, value: float) -> None:
        total, self._ss_carry = _compensated_add(float(self.sum_of_squares), self._ss_carry, value)
        self.sum_of_squares = np.asarray(total)

    def _add_magnitudes(self, piece: np.ndarray, finite: bool) -> None:
        """max |x|, NaN/Inf counts and (if tracked) the sum of |x| of one block."""
        if is_complex(piece.dtype) or piece.dtype.kind == "V" or is_bool_dtype(piece.dtype):
            magnitude = np.abs(piece.astype(np.complex128 if is_complex(piece.dtype) else np.float64))
        else:
            magnitude = piece
        if not finite:
            # Only now pay for the NaN/Inf scans; a finite sum of squares rules them out.
            wide = magnitude.astype(np.float64) if magnitude.dtype.kind not in "fc" else magnitude
            nan_mask = np.isnan(wide)
            nans = int(np.count_nonzero(nan_mask))
            self.nan_count += nans
            self.inf_count += int(np.count_nonzero(np.isinf(wide)))
            if nans:
                magnitude = magnitude[~nan_mask]
        if magnitude.size:
            if magnitude is piece:  # real numbers: |x| max without an |x| array
                largest = max(float(magnitude.max()), -float(magnitude.min()))
            else:
                largest = float(magnitude.max())
            self.max_abs = max(self.max_abs, abs(largest))
            if self.track_l1:
                part = float(np.abs(magnitude).sum(dtype=np.float64))
                self.sum_abs, self._abs_carry = _compensated_add(self.sum_abs, self._abs_carry, part)

    @property
    def l1_norm(self) -> float:
        """Sum of ``|x|`` over the non-NaN elements (needs ``track_l1``)."""
        if not self.track_l1:
            raise ValueError("the L1 norm was not tracked: create the statistics with track_l1=True")
        return self.sum_abs + self._abs_carry

    def merge(self, other: "TensorStats") -> "TensorStats":
        """Statistics of the union of two disjoint parts of the same tensor."""
        if other.shape != self.shape or other.axes != self.axes:
            raise ValueError(
                f"cannot merge statistics of shape {other.shape} axes {other.axes} "
                f"into shape {self.shape} axes {self.axes}"
            )
        merged = TensorStats(self.shape, self.axes, np.array(self.sum_of_squares, copy=True),
                             track_l1=self.track_l1 and other.track_l1)
        merged.sum_abs, merged._abs_carry = self.sum_abs, self._abs_carry
        merged.max_abs = self.max_abs
        merged.nan_count, merged.inf_count = self.nan_count, self.inf_count
        merged.count, merged._ss_carry = self.count, self._ss_carry
        if self.axes is None:
            merged._add_sum_of_squares(float(other.sum_of_squares))
            merged._ss_carry += other._ss_carry
        else:
            merged.sum_of_squares += other.sum_of_squares
        merged.sum_abs += other.sum_abs
        merged._abs_carry += other._abs_carry
        merged.max_abs = max(self.max_abs, other.max_abs)
        merged.nan_count += other.nan_count
        merged.inf_count += other.inf_count
        merged.count += other.count
        return merged
