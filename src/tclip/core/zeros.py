"""Non-zero values that a scaling turns into zero: the underflow of 16- and 8-bit floats.

Scaling float16 gradients by 0.004 flushes every value below about 1.5e-5 to zero
(bfloat16 keeps float32's range, float8 has very little): the clipped tensor then
holds fewer non-zero values than the input, which no norm shows. The counts are
exact and read bit patterns only:

- one factor (a whole tensor, or ``global``): rounding is monotone, so the values
  that flush are those whose magnitude code is 1..k, k found once per dtype and
  factor by scaling every code with the kernel itself; each unit then costs one
  range count (about 0.23 ns an element), and nothing when k is 0 (a factor
  above about 1/2 flushes nothing);
- one factor per slice: a scaling never turns a zero into anything else and NaN
  stays NaN, so ``nonzero(before) - nonzero(after)`` is the number flushed (two
  counts of about 0.15 ns an element each).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .dtypes import is_floating


@functools.lru_cache(maxsize=None)
def _zero_codes(dtype: np.dtype) -> tuple[int, ...] | None:
    """The bit patterns (as unsigned integers of the dtype's width) that hold zero, or
    None for dtypes this count does not cover (wider than 2 bytes, not floating)."""
    if dtype.itemsize > 2 or not is_floating(dtype):
        return None
    codes = _all_codes(dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        values = codes.view(dtype).astype(np.float64)
    return tuple(int(c) for c in np.flatnonzero(values == 0))


def _unsigned(dtype: np.dtype) -> type[np.unsignedinteger[Any]]:
    return np.uint8 if dtype.itemsize == 1 else np.uint16


def _all_codes(dtype: np.dtype) -> np.ndarray:
    return np.arange(1 << (8 * dtype.itemsize), dtype=np.int64).astype(_unsigned(dtype))


def counted(dtype: np.dtype) -> bool:
    """Whether flushes of ``dtype`` are counted: 16- and 8-bit floats."""
    return _zero_codes(np.dtype(dtype)) is not None


def counts_flushes(dtype: np.dtype, smallest_factor: float) -> bool:
    """Whether scaling ``dtype`` values by factors down to ``smallest_factor`` is counted:
    16- and 8-bit floats, with a factor below 1 (at 1 or above nothing can underflow)."""
    return smallest_factor < 1 and counted(dtype)


@functools.lru_cache(maxsize=4096)
def flush_limit(dtype: np.dtype, factor: float) -> int | None:
    """k such that scaling ``dtype`` values by ``factor`` makes zero exactly the values
    whose magnitude code (the bits without the sign) is 1..k (0: none); None when the
    flushed codes are not such a range (then :func:`nonzero_count` before and after)."""
    from .kernels import scale_unit  # the very arithmetic pass 2 runs

    dtype = np.dtype(dtype)
    codes = _zero_codes(dtype)
    sign = 1 << (8 * dtype.itemsize - 1)
    if codes is None or not set(codes) <= {0, sign}:
        return None  # e.g. float4 kept in a byte: its sign is not the top bit
    before = _all_codes(dtype)
    after = before.copy()
    scale_unit(after.view(dtype), float(factor))
    flushed = np.zeros(before.size, bool)
    for code in codes:
        flushed |= after == code
    for code in codes:
        flushed &= before != code
    magnitude = before & (sign - 1)
    k = int(magnitude[flushed].max(initial=0))
    expected = (magnitude >= 1) & (magnitude <= k)
    return k if np.array_equal(flushed, expected) else None


def flushed_count(x: np.ndarray, k: int, scratch: np.ndarray | None = None) -> int:
    """How many elements of ``x`` have a magnitude code in 1..k (see :func:`flush_limit`):
    before scaling, the number the scaling will make zero. ``scratch``: an optional buffer
    of at least ``x.nbytes * 3 // 2`` bytes."""
    if k == 0:
        return 0
    unsigned = _unsigned(x.dtype)
    bits = np.ascontiguousarray(x).reshape(-1).view(unsigned)
    sign = 1 << (8 * x.dtype.itemsize - 1)
    work = below = None
    if scratch is not None and scratch.nbytes >= bits.nbytes + bits.size:
        raw = scratch.view(np.uint8)
        work = raw[:bits.nbytes].view(unsigned)
        below = raw[bits.nbytes:bits.nbytes + bits.size].view(np.bool_)
    magnitude = np.bitwise_and(bits, sign - 1, out=work)
    np.subtract(magnitude, 1, out=magnitude)  # 0 wraps to the largest code: never below k
    return int(np.count_nonzero(np.less(magnitude, k, out=below)))


def nonzero_count(x: np.ndarray, scratch: np.ndarray | None = None) -> int:
    """How many elements of ``x`` (a 16- or 8-bit float array) are not zero (NaN counts
    as not zero). ``scratch``: an optional buffer of at least ``x.nbytes`` bytes."""
    codes = _zero_codes(x.dtype)
    assert codes is not None, x.dtype
    unsigned = _unsigned(x.dtype)
    bits = np.ascontiguousarray(x).reshape(-1).view(unsigned)
    sign = 1 << (8 * x.dtype.itemsize - 1)
    if codes == (0, sign):
        # +0 and -0: shifting the sign bit out leaves 0 for both and only for them.
        out = scratch.view(unsigned)[:bits.size] if scratch is not None and scratch.nbytes >= x.nbytes else None
        return int(np.count_nonzero(np.left_shift(bits, 1, out=out)))
    if codes == (0,):
        return int(np.count_nonzero(bits))
    return bits.size - sum(int(np.count_nonzero(bits == c)) for c in codes)  # e.g. float4 in a byte
