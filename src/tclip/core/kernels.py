"""The arithmetic applied to one unit of a tensor (see :mod:`tclip.core.units`).

Every statistic and every rewritten element goes through these few functions,
in the NumPy core and in the file pipeline alike, so the two cannot disagree:

- :func:`widen` converts a unit to float64 exactly (every float dtype tclip
  handles, float16/bfloat16/float8 included, is a subset of float64);
- :func:`reduce_unit` gives its sum of squares (whole, or per slice), its
  smallest and largest value, NaN/Inf counts and optional moments;
- :func:`scale_unit` and :func:`clip_unit` rewrite it in place: the float64
  product (or clamp) rounded once to the unit's dtype, exactly as
  :func:`tclip.core.modes.apply_scale` and :func:`tclip.core.modes.clip_values` compute it
  (the tests hold the two against each other over every 16-bit value).

Reductions never go through BLAS: a threaded BLAS dot splits a vector by its
own thread count, so the same data would sum differently on another machine
or under load. ``np.add.reduce`` of the squares sums in a fixed order on every
CPU and releases the GIL (``np.einsum`` measured 15% faster on one core but
holds the GIL, so threads could not share the work). max/min are taken on the float64 copy:
NumPy's and ml_dtypes' reductions over float16/bfloat16 run a scalar loop
(5.6 ns per element measured, 40 times the float64 reduction).

Where the optional C extension :mod:`tclip.core._fused` was built, the common case of
:func:`reduce_unit` (a whole unit's sum of squares and extremes, no NaN or Inf) is one
pass over the stored bytes in C that gives the same bits as the NumPy code below (the
same squares summed in ``np.add.reduce``'s own order; checked against it before first
use, and by the tests): float32 2.0 -> 0.5 ns an element, bfloat16 1.7 -> 0.3, float16
2.1 -> 0.3 (one core, data out of cache; 16-bit: 0.35 with AVX2 and no AVX-512).
Everything else is NumPy.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from .widening import _BFLOAT16, Scratch, _buffer, narrow_into, widen

_fused: ModuleType | None
try:  # optional: built where a C compiler was at install time (see setup.py)
    from . import _fused
except ImportError:  # pragma: no cover - depends on the install
    _fused = None

# Float64 exponent field values, for the log2-magnitude histogram.
EXPONENT_BINS = 2048


@dataclass
class UnitMoments:
    """Optional statistics for the report: sum of values, zeros, log2 magnitudes."""

    total: float = 0.0
    zeros: int = 0
    # counts per float64 exponent field (value 1023 + e for 2**e <= |x| < 2**(e+1))
    exponents: np.ndarray = field(default_factory=lambda: np.zeros(EXPONENT_BINS, np.int64))


def dot(a: np.ndarray, b: np.ndarray, buffer: np.ndarray | None = None) -> float:
    """``sum(a * b)`` of two float64 vectors in the fixed order of ``np.add.reduce`` (see :func:`reduce_unit`)."""
    products = np.multiply(a, b, out=None if buffer is None or buffer.size < a.size else buffer[: a.size])
    return float(np.add.reduce(products))


# ------------------------------------------------------------------ the fused C loop

_FUSED_KIND = {np.dtype(np.float64): 0, np.dtype(np.float32): 1, _BFLOAT16: 2, np.dtype(np.float16): 3}
_fused_state: dict[str, int] = {}
_fused_lock = threading.RLock()  # fused_rows holds it while fused_chunk takes it


def _probe(n: int) -> np.ndarray:
    """A fixed float64 vector whose sum of squares depends on the order of the terms (all
    of one magnitude, every bit of the mantissa used), for :func:`fused_chunk`'s check."""
    return 1.0 + 0.5 * np.sin(np.arange(n, dtype=np.float64))


PROBE_SIZES = (9, 1000, 20_011, 3 * 8192 + 5, 5 * 8192 + 3)


def fused_chunk() -> int:
    """Terms per call of ``np.add.reduce``'s inner loop, as the C loop must cut the sum to
    give its bits; 0 when the C loop is missing or matches NumPy in no way tried.

    NumPy 2.x reduces a contiguous vector in one call; older versions cut it into
    buffers of 8,192. Found once, by comparing the two on fixed vectors."""
    if "chunk" not in _fused_state:
        with _fused_lock:
            if "chunk" not in _fused_state:
                _fused_state["chunk"] = _find_chunk()
    return _fused_state["chunk"]


def fused_rows() -> bool:
    """Whether the C loop's per-row sums are ``np.add.reduce`` over a unit's trailing axes
    here (checked once, on a fixed probe): True with NumPy 2.x, which sums each row in one call."""
    if "rows" not in _fused_state:
        with _fused_lock:
            if "rows" not in _fused_state:
                _fused_state["rows"] = _rows_agree()
    return bool(_fused_state["rows"])


def _find_chunk() -> int:
    if _fused is None:
        return 0
    probes = [_probe(n) for n in PROBE_SIZES]
    expected = [float(np.add.reduce(p * p)) for p in probes]
    for chunk in (1 << 62, 8192):
        if all(_fused.unit_stats(p.view(np.uint8), 0, chunk)[0] == e for p, e in zip(probes, expected)):
            return chunk
    return 0  # pragma: no cover - a NumPy that sums in yet another order: NumPy's way then


def _rows_agree() -> bool:
    if _fused is None or fused_chunk() != 1 << 62:
        return False
    probe = _probe(7 * 24_581).reshape(7, 1, 24_581)
    sums = np.empty(7)
    _fused.row_stats(probe.view(np.uint8), 0, 24_581, sums)
    return bool((sums == np.add.reduce(probe * probe, axis=(1, 2))).all())


def _fused_kind(x: np.ndarray) -> int | None:
    """The C loop's code for ``x``'s dtype where it can read ``x`` (contiguous, this machine's
    byte order, not empty), else None."""
    kind = _FUSED_KIND.get(x.dtype)
    if kind is None or not x.size or not x.flags.c_contiguous or x.dtype.byteorder not in "=<|":
        return None
    return kind


class UnitSums(NamedTuple):
    """What :func:`reduce_unit` gives for one unit: the sum of squares (one float, or an array
    of one sum per slice with ``axes``), the smallest and largest value that is not NaN
    (``inf``/``-inf`` where none was asked or found), the NaN and +-Inf counts, and the sum of
    ``|x|`` (0.0 unless asked)."""

    sum_of_squares: Any
    smallest: float
    largest: float
    nan_count: int
    inf_count: int
    sum_abs: float


def _fused_result(x: np.ndarray, sums: float | np.ndarray, low: int, high: int, extremes: bool) -> UnitSums:
    """:func:`reduce_unit`'s result from the C loop's sums and extreme bit patterns (no NaN or Inf)."""
    smallest, largest = math.inf, -math.inf
    if extremes:
        patterns = np.array([low, high], _UNSIGNED[x.dtype.itemsize]).view(x.dtype)
        smallest, largest = float(patterns[0]), float(patterns[1])
    return UnitSums(sums, smallest, largest, 0, 0, 0.0)


def _reduce_fused(x: np.ndarray, extremes: bool) -> UnitSums | None:
    """:func:`reduce_unit`'s result for a whole unit by the C loop, or None where it does not
    apply (no extension, another dtype or layout, NaN or Inf in the unit: NumPy's way then)."""
    kind = _fused_kind(x)
    chunk = fused_chunk() if kind is not None else 0
    if not chunk or kind is None or _fused is None:
        return None
    sum_sq, low, high = _fused.unit_stats(x.reshape(-1).view(np.uint8), kind, chunk)
    if not math.isfinite(sum_sq):  # NaN or Inf are in there: counted by the NumPy code
        return None
    return _fused_result(x, sum_sq, low, high, extremes)


def _reduce_fused_rows(x: np.ndarray, extremes: bool) -> UnitSums | None:
    """:func:`reduce_unit` over every axis but the first by the C loop (one sum per index of
    the first axis), or None where it does not apply (as :func:`_reduce_fused`)."""
    kind = _fused_kind(x)
    if kind is None or not fused_rows() or _fused is None:
        return None
    sums = np.empty(x.shape[0], np.float64)
    low, high = _fused.row_stats(x.reshape(-1).view(np.uint8), kind, x.size // x.shape[0], sums)
    if not np.isfinite(sums).all():
        return None
    return _fused_result(x, sums, low, high, extremes)


_UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def reduce_unit(x: np.ndarray, scratch: Scratch | None = None, axes: tuple[int, ...] | None = None,
                l1: bool = False, moments: UnitMoments | None = None, wide: np.ndarray | None = None,
                extremes: bool = True) -> UnitSums:
    """Statistics of one unit ``x`` (its rectangle's shape).

    Args:
        axes: None for one sum of squares over the whole unit; else the axes of
            the unit to sum over, for per-slice sums (returned without those axes).
        l1: also return the sum of ``|x|`` over non-NaN elements (else 0.0).
        moments: add the unit's sum, zeros and exponent counts to it.
        wide: ``x`` in float64 when the caller has it already.
        extremes: also the smallest and largest value (else ``inf, -inf``) and NaN/Inf counts.

    Returns:
        ``(sum_of_squares, smallest, largest, nan_count, inf_count, sum_abs)``;
        smallest/largest ignore NaN (``inf``/``-inf`` when all are NaN).

    The squares are summed by ``np.add.reduce`` (pairwise summation: plain C, the
    same order on every CPU, and it lets other threads run; ``np.einsum`` holds
    the GIL and its SIMD dispatch sums in another order on another CPU).
    """
    if not l1 and moments is None and _fused is not None:  # same bits; ``wide``, when given, is ``x`` widened
        fused = None
        if axes is None:
            fused = _reduce_fused(x, extremes)
        elif x.ndim >= 2 and tuple(axes) == tuple(range(1, x.ndim)):
            fused = _reduce_fused_rows(x, extremes)
        if fused is not None:
            return fused
    owned = wide is None
    if wide is None:
        wide = widen(x, scratch)
        owned = wide is not x
    else:
        wide = wide.reshape(x.shape)
    if wide.dtype == np.complex128:
        return _reduce_complex(wide, axes, l1)
    by_bits = extremes and wide.size and _ordered_bits(x) is not None
    if by_bits:  # found after the sum, from the stored bits (below)
        smallest, largest = math.inf, -math.inf
    else:
        smallest, largest = (float(wide.min()), float(wide.max())) if wide.size and extremes else (math.inf, -math.inf)
    # Squared in place when the float64 copy is this function's own and nothing below needs
    # its values (the NaN path widens again): the unit's working set stays one buffer.
    # Measured, squares + sum: 0.99 -> 0.54 ns an element (float32, one core).
    in_place = owned and moments is None and not l1
    squares = wide if in_place else _buffer(scratch, "work", wide.size, np.float64).reshape(wide.shape)
    with np.errstate(over="ignore", invalid="ignore"):
        np.multiply(wide, wide, out=squares)
        if axes is None:
            sum_sq: float | np.ndarray = float(np.add.reduce(squares.reshape(-1)))
            finite = math.isfinite(sum_sq)  # a finite sum of squares rules out NaN and Inf
        else:
            sum_sq = np.add.reduce(squares, axis=axes)
            finite = bool(np.isfinite(sum_sq).all())
    nans = infs = 0
    if not finite and extremes and in_place:
        wide = widen(x, scratch)  # the squares took its place (sum_sq is a copy)
    if by_bits:
        if finite:  # no NaN or Inf: the order of the bit patterns is the order of the values
            smallest, largest = _extremes_from_bits(x)
        else:
            smallest, largest = float(wide.min()), float(wide.max())
    values = wide
    if not finite and extremes:
        nan_mask = np.isnan(wide)
        nans = int(np.count_nonzero(nan_mask))
        infs = int(np.count_nonzero(np.isinf(wide)))
        if nans:
            values = wide[~nan_mask]
            smallest, largest = (float(values.min()), float(values.max())) if values.size else (math.inf, -math.inf)
    if moments is not None:
        _add_moments(values, moments)
    sum_abs = 0.0
    if l1 and values.size:
        with np.errstate(over="ignore"):  # an L1 norm past float64's largest is inf, as the L2 one
            sum_abs = float(np.add.reduce(np.abs(values.reshape(-1))))
    return UnitSums(sum_sq, smallest, largest, nans, infs, sum_abs)


_SIGNED = {2: np.int16, 4: np.int32, 8: np.int64}


def _ordered_bits(x: np.ndarray) -> np.ndarray | None:
    """``x``'s bits as signed integers of its width (a flat view), for binary floats of this
    machine's byte order stored contiguously (float16, bfloat16, float32, float64); else None."""
    if not x.flags.c_contiguous or x.dtype.byteorder not in "=<|" or x.dtype.itemsize not in _SIGNED:
        return None
    if not (x.dtype in (np.float16, np.float32, np.float64) or x.dtype == _BFLOAT16):
        return None
    return x.reshape(-1).view(_SIGNED[x.dtype.itemsize])


def _extremes_from_bits(x: np.ndarray) -> tuple[float, float]:
    """The smallest and largest of ``x`` (no NaN or Inf in it) from its bit patterns.

    A binary float is sign and magnitude: read as a signed integer, the non-negative
    values keep their order, and every negative value (sign bit set) reads as negative.
    So the largest value is the largest signed pattern when that is non-negative, else
    (all negative) the negative of least magnitude, the smallest unsigned pattern; the
    smallest value is the largest unsigned pattern when that has the sign bit (a negative
    of greatest magnitude), else the smallest signed pattern. Two integer reductions over
    the stored width instead of two float64 ones over the widened copy (measured on
    bfloat16: 0.54 -> 0.06 ns an element). Zeros: -0 is smaller than +0.
    """
    signed = _ordered_bits(x)
    assert signed is not None
    unsigned = signed.view(signed.dtype.str.replace("i", "u"))
    pair = np.empty(2, unsigned.dtype)  # the two patterns, as unsigned integers
    top = signed.max()
    pair[1] = np.asarray(top).view(unsigned.dtype) if top >= 0 else unsigned.min()
    bottom = unsigned.max()
    if bottom >> (8 * unsigned.itemsize - 1):  # the sign bit: a negative value is there
        pair[0] = bottom
    else:
        pair[0] = np.asarray(signed.min()).view(unsigned.dtype)
    values = pair.view(x.dtype)
    return float(values[0]), float(values[1])


def _add_moments(values: np.ndarray, moments: UnitMoments) -> None:
    flat = values.reshape(-1)
    if not flat.size:
        return
    with np.errstate(over="ignore"):  # values near float64's largest can sum past it: the mean is then inf
        moments.total += float(np.add.reduce(flat))
    moments.zeros += int(flat.size - np.count_nonzero(flat))
    exponents = (flat.view(np.uint64) >> np.uint64(52)).astype(np.uint16) & np.uint16(0x7FF)
    moments.exponents += np.bincount(exponents, minlength=EXPONENT_BINS)


def _reduce_complex(wide: np.ndarray, axes: tuple[int, ...] | None, l1: bool) -> UnitSums:
    # |z|**2 as re**2 + im**2: z * conj(z) would also form re*im - im*re, which is inf - inf
    # (NaN, and a NumPy warning) once the parts pass 1e154; an overflow to inf is the norm's.
    with np.errstate(over="ignore", invalid="ignore"):
        squares = np.square(wide.real)
        squares += np.square(wide.imag)
        if axes is None:
            sum_sq: float | np.ndarray = float(np.add.reduce(squares.reshape(-1)))
            finite = math.isfinite(sum_sq)
        else:
            sum_sq = np.add.reduce(squares, axis=axes)
            finite = bool(np.isfinite(sum_sq).all())
    nans = infs = 0
    magnitude = np.abs(wide)
    if not finite:
        nan_mask = np.isnan(wide)
        nans = int(np.count_nonzero(nan_mask))
        infs = int(np.count_nonzero(np.isinf(wide)))
        magnitude = magnitude[~nan_mask]
    largest = float(magnitude.max()) if magnitude.size else -math.inf
    with np.errstate(over="ignore"):
        sum_abs = float(np.add.reduce(magnitude.reshape(-1))) if l1 and magnitude.size else 0.0
    return UnitSums(sum_sq, -largest, largest, nans, infs, sum_abs)


def scale_unit(x: np.ndarray, factor: np.ndarray | float, scratch: Scratch | None = None) -> np.ndarray | None:
    """``x *= factor`` computed in float64 and rounded once to ``x``'s dtype, in place.

    ``factor`` broadcasts against ``x`` (a scalar or per-slice factors in keepdims form).
    Returns the new values in float64 when they are at hand (else None).

    The same bits by every path: 16- and 8-bit floats with one factor through a table of
    all their results; float16/bfloat16 with one factor per row element by element in C
    (through per-row tables without the extension); rows whose factors are all 1 left
    alone; float32 in one C or NumPy call; the rest widened, multiplied and rounded back.
    """
    if x.dtype.itemsize <= 2 and np.ndim(factor) == 0 and x.flags.c_contiguous and x.dtype.kind in "fV":
        _scale_by_table(x, float(factor), scratch)
        return None
    if x.ndim and x.shape[0] > 1 and np.ndim(factor) == x.ndim and np.shape(factor)[0] == x.shape[0] \
            and x.flags.c_contiguous and x.dtype in _INF_BITS:
        factors = np.asarray(factor, np.float64)
        if x.dtype in _ROW_TABLES and (_scale_rows16_fused(x, factors, scratch)
                                       or _scale_rows_by_tables(x, factors, scratch)):
            return None
        return _scale_rows(x, np.asarray(factor), scratch)
    return _scale_whole(x, factor, scratch)


def _scale_whole(x: np.ndarray, factor: np.ndarray | float, scratch: Scratch | None) -> np.ndarray | None:
    # The whole unit in a few NumPy calls: with two threads, every call may wait for the
    # GIL, and cutting a unit into steps that stay in L2 measured 5-28% faster on one
    # thread but 30-55% slower on two (float32; per-row bfloat16).
    if x.dtype == np.float32 and _fused is not None and _scale_float32_fused(x, factor):
        return None
    if x.dtype == np.float32:
        # One call: NumPy widens, multiplies in float64 and rounds back a few thousand
        # elements at a time through its own small buffers -- the same casts and product
        # as widen/multiply/narrow_into, without the unit-sized float64 copy. Measured on
        # 64 x 4096 units, one core: 1.25 -> 0.81 ns an element (one factor), 1.64 -> 1.36
        # ns (one per row). The float64 values are then not at hand (None).
        with np.errstate(invalid="ignore", over="ignore"):
            np.multiply(x, factor, out=x, dtype=np.float64, casting="same_kind")
        return None
    wide = widen(x, scratch)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 is NaN, as in TensorFlow
        np.multiply(wide, factor, out=wide)
    if wide is x:
        return wide
    return wide if narrow_into(wide, x, scratch) else None


def _scale_float32_fused(x: np.ndarray, factor: np.ndarray | float) -> bool:
    """The float32 case of :func:`_scale_whole` in C, where ``x`` is contiguous in this
    machine's byte order and ``factor`` is one value or one per row (first axis); False
    (nothing done) otherwise. The same product and rounding as NumPy's call below:
    0.8 -> 0.3 ns an element (one core)."""
    if _fused is None or not x.flags.c_contiguous or x.dtype.byteorder not in "=<|" or not x.size:
        return False
    factors = np.asarray(factor, np.float64)
    if factors.size == 1:
        columns = x.size
    elif x.ndim and factors.shape == (x.shape[0],) + (1,) * (x.ndim - 1):
        columns = x.size // x.shape[0]
    else:
        return False
    if np.isnan(factors).any():  # NaN times NaN: which payload wins is the order of NumPy's operands
        return False
    _fused.scale_f32(x.reshape(-1), columns, np.ascontiguousarray(factors).reshape(-1))
    return True


# Rows whose every factor is exactly 1 are left alone (x * 1.0 is x, bit for bit, except
# that a signalling NaN would come out quiet: rows with a NaN are scaled like the others).
# Each run of rows to scale costs some 20 NumPy calls, and with two threads each call may
# wait for the GIL: rows are skipped only when the elements saved outweigh, at this many
# elements a run, the runs' calls.
_ELEMENTS_PER_RUN = 1 << 14
# The bits of +Inf: a larger magnitude is a NaN (for the dtypes whose rows may be left alone).
_INF_BITS = {np.dtype(np.float16): 0x7C00, np.dtype(ml_dtypes.bfloat16): 0x7F80,
             np.dtype(np.float32): 0x7F80_0000}


def _scale_rows(x: np.ndarray, factor: np.ndarray, scratch: Scratch | None) -> np.ndarray | None:
    """:func:`scale_unit` with one factor per row, skipping rows whose factors are all 1.

    Returns the unit's new values in float64 when they are at hand and no row was skipped.
    """
    spans = _rows_to_scale(x, factor, scratch)
    if spans is None:
        return _scale_whole(x, factor, scratch)
    for start, stop in spans:
        _scale_whole(x[start:stop], factor[start:stop], scratch)
    return None


def _rows_to_scale(x: np.ndarray, factor: np.ndarray, scratch: Scratch | None) -> list[tuple[int, int]] | None:
    """The runs ``[start, stop)`` of rows to scale, all but those whose factors are all
    exactly 1 and which hold no NaN; None when skipping would not pay."""
    rows = x.shape[0]
    per_row = x.size // rows
    ones = factor == 1.0
    if not ones.any():  # the common case (every row clipped) in two small calls
        return None
    alone = ones.reshape(rows, -1).all(axis=1)
    skipped = int(np.count_nonzero(alone))
    if skipped * per_row <= _ELEMENTS_PER_RUN:
        return None
    kept = _runs(alone)
    if (len(kept) + 1) * _ELEMENTS_PER_RUN >= skipped * per_row:
        return None
    inf_bits = _INF_BITS[x.dtype]
    bits_type = np.uint16 if x.dtype.itemsize == 2 else np.uint32
    for start, stop in kept:
        bits = x[start:stop].reshape(-1).view(bits_type)
        magnitude = _buffer(scratch, "bits", bits.size, np.uint32).view(bits_type)[: bits.size]
        np.bitwise_and(bits, bits_type(inf_bits | (inf_bits - 1)), out=magnitude)  # the sign bit cleared
        if magnitude.max() > inf_bits:
            alone[start:stop] = False
    spans = _runs(~alone)
    return spans if (len(spans) - 1) * _ELEMENTS_PER_RUN < int(np.count_nonzero(alone)) * per_row else None


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """``[start, stop)`` of each run of True in a 1-D boolean array."""
    edges = np.flatnonzero(mask[1:] != mask[:-1]) + 1
    bounds = [0, *edges.tolist(), mask.size]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if mask[a]]


def _scale_rows16_fused(x: np.ndarray, factor: np.ndarray, scratch: Scratch | None) -> bool:
    """``x *= factor`` for float16 or bfloat16 with one factor per row, in C (see scale16
    in the C source): every finite value computed and rounded as :func:`_scale_whole`
    does, in one pass; rows with Inf or NaN are then scaled by :func:`_scale_whole`.
    False (x untouched) where C is not at hand or does not apply. Measured on gradient-like
    64 x 4096 units, one core, per element: float16 1.9-2.2 ns with the per-row tables
    that came before it (built in C, misses scaled with NumPy) -> 0.8 ns; bfloat16 0.7 ->
    0.45 ns. (The per-row tables in NumPy, the way without the extension: 4.0 and 2.4.)"""
    if _fused is None or not (x.flags.c_contiguous and x.flags.aligned) or x.dtype.byteorder not in "=<|" \
            or not x.size:
        return False
    rows = x.shape[0]
    factors = np.ascontiguousarray(factor, np.float64).reshape(-1)
    if factors.size != rows:
        return False
    with np.errstate(invalid="ignore"):
        if not (bool((factors >= 0).all()) and bool((factors < 2.0 ** 900).all())):
            return False
    columns = x.size // rows
    left = np.empty(rows, np.int64)
    count = _fused.scale16(x.reshape(-1).view(np.uint16), _FUSED_KIND[x.dtype], columns, factors, left)
    if count < 0:  # this FPU flushes subnormals: NumPy's way
        return False
    if count:
        which = left[:count]
        rows_of = x.reshape(rows, columns)
        part = rows_of[which]  # untouched by C
        _scale_whole(part, factors[which].reshape(-1, 1), scratch)
        rows_of[which] = part
    return True


@dataclass(frozen=True)
class _RowTable:
    """The layout of a 16-bit float, and the shortest row worth a table."""

    mantissa_bits: int
    top: int  # the largest exponent field of a finite value
    bias: int
    min_columns: int


# float16 and bfloat16 rows scaled by one factor each, where the C extension is not built
# (with it, _scale_rows16_fused computes every element directly). A normal value 2**e * (1 + m/M)
# times f = 2**k * g (1 <= g < 2) is 2**(e+k) * (1 + m/M) * g, and rounding it (to
# float64, then to the dtype; for bfloat16 through float32, as ml_dtypes does) does not
# depend on the power of two while everything stays normal. So a row's results come
# from M = 2**mantissa_bits reference results, those of (1 + m/M) * g (1,024 for float16,
# 128 for bfloat16), each stored as what to add to the input's bits: sign and exponent
# carry over, the mantissa is replaced, and a rounding up into the next binade adds to
# the exponent. Elements for which that does not hold -- zeros, subnormal, Inf and NaN
# inputs, results that would leave the normal range -- take the arithmetic path.
# Measured on 64 x 4096 units, one core: float16
# 9.0 -> 4.7 ns an element, bfloat16 3.5 -> 2.4 ns (np.take alone is 0.7 ns an element:
# NumPy's gather is a scalar loop). A row shorter than min_columns would spend more on
# its table than it saves.
_ROW_TABLES = {np.dtype(np.float16): _RowTable(10, 30, 15, 1024),
               np.dtype(ml_dtypes.bfloat16): _RowTable(7, 254, 127, 512)}
# Past this share of elements for the arithmetic path, the tables do not pay.
_ROW_TABLE_MISSES = 8


def _scale_rows_by_tables(x: np.ndarray, factor: np.ndarray, scratch: Scratch | None) -> bool:
    """``x *= factor`` (one factor per row) through per-row tables, in place; False (x
    untouched) where they do not apply."""
    spec = _ROW_TABLES[x.dtype]
    rows = x.shape[0]
    columns = x.size // rows
    if factor.size != rows or columns < spec.min_columns:
        return False
    factors = factor.reshape(rows)
    with np.errstate(invalid="ignore"):
        # positive, finite and far from float64's limits (so every power of two above is exact)
        if not (bool((factors > 2.0 ** -800).all()) and bool((factors < 2.0 ** 800).all())):
            return False
    mantissa, powers = np.frexp(factors)
    powers = powers.astype(np.int64) - 1  # f = 2**k * g with 1 <= g < 2
    # Inputs whose exponent field lies in [lo, hi] give normal results (g rounded may reach 4).
    lo = np.maximum(1, 1 - powers)
    hi = np.minimum(spec.top, spec.top - 2 - powers)
    if bool((lo > hi).any()):
        return False
    shift = spec.mantissa_bits
    bits = x.reshape(rows, columns).view(np.uint16)
    field = _buffer(scratch, "bits", x.size, np.uint32).view(np.uint16)[: x.size].reshape(rows, columns)
    np.bitwise_and(bits, np.uint16((spec.top + 1) << shift), out=field)
    np.subtract(field, (lo << shift).astype(np.uint16).reshape(rows, 1), out=field)  # below lo wraps round
    missed = _buffer(scratch, "extra", x.size, np.float64).view(np.bool_)[: x.size].reshape(rows, columns)
    np.greater(field, ((hi - lo) << shift).astype(np.uint16).reshape(rows, 1), out=missed)
    count = int(np.count_nonzero(missed))
    if count * _ROW_TABLE_MISSES > x.size:
        return False
    flat = x.reshape(-1)
    if count:
        positions = np.flatnonzero(missed)
        kept = flat[positions]
    size = 1 << shift
    base = np.uint16(spec.bias << shift) + np.arange(size, dtype=np.uint16)  # 1 + m/M
    # The reference results (1 + m/M) * g: the float64 product rounded once to the dtype,
    # the same bits as tclip.plan.apply_scale (tested on every value). float16 through
    # NumPy's cast (about 2 ns an element for these normal values, and it lets the other
    # threads run); bfloat16 through narrow_into (ml_dtypes' cast would hold the GIL).
    wide = (1.0 + np.arange(size) / size) * (2 * mantissa).reshape(rows, 1)
    if x.dtype == np.float16:
        results = wide.astype(np.float16)
    else:
        results = np.empty((rows, size), x.dtype)
        narrow_into(wide, results)
    add = results.view(np.uint16).astype(np.int64) - base + (powers << shift).reshape(rows, 1)
    add = (add & 0xFFFF).astype(np.uint16)  # modulo 2**16: the sum with an input's bits is exact
    _row_add(bits, field, add, shift, scratch)
    if count:
        _scale_whole(kept, factors[positions // columns], None)
        flat[positions] = kept
    return True


def _row_add(bits: np.ndarray, field: np.ndarray, add: np.ndarray, shift: int, scratch: Scratch | None) -> None:
    """``bits[r, c] += add[r, bits[r, c] & (2**shift - 1)]`` (modulo 2**16) with NumPy.

    Indices into the rows' tables side by side: as uint16 (rows * 2**shift <= 65,536 at a
    time), then as intp, the one index type np.take reads without a copy of its own."""
    rows, columns = bits.shape
    size = 1 << shift
    group = (1 << 16) >> shift
    offsets = (np.arange(min(rows, group), dtype=np.uint16) << shift).reshape(-1, 1)
    index = _buffer(scratch, "work", min(rows, group) * columns, np.float64).view(np.intp)
    for start in range(0, rows, group):
        stop = min(rows, start + group)
        part, where = bits[start:stop], field[start:stop]
        np.bitwise_and(part, np.uint16(size - 1), out=where)
        np.bitwise_or(where, offsets[: stop - start], out=where)
        positions_here = index[: where.size].reshape(where.shape)
        np.copyto(positions_here, where)
        np.take(add[start:stop].reshape(-1), positions_here, out=where, mode="clip")
        np.add(part, where, out=part)


# A 16- or 8-bit float scaled by one factor has at most 65,536 results: a table of
# them, computed by the reference arithmetic (the float64 product, rounded once by
# NumPy's cast, as tclip.core.modes.apply_scale computes it), maps every element in
# one lookup. Same bits by construction; 3.5 times faster than the arithmetic for
# float16 and 1.7 times for bfloat16 (measured, per element).
_TABLES: dict[tuple[str, float], np.ndarray] = {}
_TABLES_KEPT = 64


def _scale_by_table(x: np.ndarray, factor: float, scratch: Scratch | None) -> None:
    bits_type = np.uint16 if x.dtype.itemsize == 2 else np.uint8
    key = (x.dtype.str if x.dtype.kind == "f" else x.dtype.name, factor)
    table = _TABLES.get(key)
    if table is None:
        every = np.arange(1 << (8 * x.dtype.itemsize), dtype=bits_type).view(x.dtype)
        table = _reference_scale(every, factor).view(bits_type)
        if len(_TABLES) >= _TABLES_KEPT:
            _TABLES.clear()
        _TABLES[key] = table
    bits = x.reshape(-1).view(bits_type)
    if _fused is not None:  # the lookup alone, in C (np.take below: 0.7 ns an element)
        _fused.lookup(bits, table)
        return
    # np.take turns any other index type into a fresh intp array of its own, and with
    # mode="raise" it also writes through a buffer: the indices go into a reused intp
    # buffer instead and the results straight back into x (two NumPy calls a unit, as
    # before). Every index is in range, so mode="clip" changes nothing. Measured per
    # element, one core: 14-25% less time for bfloat16, 25-34% for float16; pass 2 over
    # 512 MiB on two threads 0.56 -> 0.43 s (bfloat16), 0.53 -> 0.40 s (float16).
    index = _buffer(scratch, "work", bits.size, np.float64).view(np.intp)
    np.copyto(index, bits)
    np.take(table, index, out=bits, mode="clip")


def _reference_scale(x: np.ndarray, factor: float) -> np.ndarray:
    """``x * factor`` in float64, rounded once to ``x``'s dtype by NumPy's cast; a factor of
    exactly 1 returns the bits unchanged (NaN payloads included)."""
    if factor == 1.0:
        return x.copy()
    product = np.empty(x.shape, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 is NaN, as in TensorFlow
        np.multiply(x, np.asarray(factor, dtype=np.float64), out=product)
        result = np.empty_like(x)
        result[...] = product
    return result


def clip_unit(x: np.ndarray, lo: float, hi: float, scratch: Scratch | None = None) -> tuple[int, np.ndarray]:
    """Clamp ``x`` to ``[lo, hi]`` in place (NaN stays NaN).

    ``lo`` and ``hi`` are values of ``x``'s dtype (as floats), so the result is
    exact and equals ``minimum(maximum(x, lo), hi)`` in that dtype. Returns how
    many elements changed, and the new values in float64.
    """
    wide = widen(x, scratch)
    changed = int(np.count_nonzero(wide < lo)) + int(np.count_nonzero(wide > hi))
    if changed:
        np.maximum(wide, lo, out=wide)
        np.minimum(wide, hi, out=wide)
        if wide is not x:
            np.copyto(x, wide, casting="unsafe")  # exact: every value is one of x's dtype
    return changed, wide


def quant_sums(raw: np.ndarray, block_pairs: int, byte_squares: np.ndarray, key_kind: int, key_values: np.ndarray,
               scales: np.ndarray, bounds: np.ndarray, fast: int, table: np.ndarray | None = None) -> Any:
    """:func:`tclip.quant.codes.closed_form` in C (``_fused.quant_sums``: sums, largest, smallest), or None."""
    if _fused is None:
        return None
    sums = np.empty(bounds.size - 1, np.float64)
    largest, smallest = _fused.quant_sums(raw, raw.shape[1], block_pairs, byte_squares, key_kind, key_values,
                                          scales, scales.shape[1], bounds, sums, fast, table)
    return sums, largest, smallest


def code_moments(codes: np.ndarray, bias: int) -> np.ndarray | None:
    """Per row of ``codes`` (2-D, uint8 or int8), of ``code - bias``: sums, sums of squares, smallest, largest."""
    if _fused is None:
        return None
    out = np.empty((4, codes.shape[0]), np.int64)
    _fused.code_moments(codes, codes.shape[1], int(codes.dtype == np.int8), bias, out)
    return out


def byte_lookup(raw: np.ndarray, table: np.ndarray) -> np.ndarray | None:
    """``table[raw]`` (uint8 into a float64 table of 256) in C, or None without the extension."""
    if _fused is None:
        return None
    out = np.empty(raw.shape, np.float64)
    _fused.byte_lookup(np.ascontiguousarray(raw), table, out)
    return out
