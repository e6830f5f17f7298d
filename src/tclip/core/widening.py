"""Exact conversions of a unit to float64 and back, the first and last step of every kernel.

Moved out of :mod:`tclip.core.kernels` (which re-exports :class:`Scratch`, :func:`widen` and
:func:`narrow_into`).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .dtypes import is_complex
from .units import UNIT_ELEMENTS


class Scratch:
    """One thread's buffers for the kernels: the unit in float64 and room for temporaries.

    Fresh multi-MiB arrays per unit would cost page faults every time; these live as long
    as the thread does.
    """

    def __init__(self, elements: int = UNIT_ELEMENTS) -> None:
        self.wide = np.empty(elements, np.float64)
        self.work = np.empty(elements, np.float64)
        self.extra = np.empty(elements, np.float64)
        self.bits = np.empty(elements, np.uint32)

    BYTES_PER_ELEMENT = 28


def _buffer(scratch: Scratch | None, name: str, count: int, dtype: Any) -> np.ndarray:
    if scratch is not None:
        array = getattr(scratch, name)
        if array.size >= count:
            return array[:count]
    return np.empty(count, dtype)


def widen(x: np.ndarray, scratch: Scratch | None = None) -> np.ndarray:
    """``x`` as float64 (complex128 for complex), exactly, contiguous, in ``x``'s shape.

    Returns ``x`` itself when it already is contiguous float64, else a view of
    the scratch buffer when it is large enough, else a new array.
    """
    if is_complex(x.dtype):
        return np.ascontiguousarray(x, dtype=np.complex128)
    if x.dtype == np.float64 and x.flags.c_contiguous:
        return x
    wide = _buffer(scratch, "wide", x.size, np.float64).reshape(x.shape)
    if x.dtype == np.float16 and x.flags.c_contiguous and x.dtype.byteorder in "=<|":
        _widen_float16(x.reshape(-1), wide.reshape(-1), _buffer(scratch, "bits", x.size, np.uint32))
        return wide
    if x.dtype == _BFLOAT16 and x.flags.c_contiguous:
        _widen_bfloat16(x.reshape(-1), wide.reshape(-1), _buffer(scratch, "bits", x.size, np.uint32))
        return wide
    with np.errstate(invalid="ignore", over="ignore"):  # a signalling NaN is still a NaN
        np.copyto(wide, x, casting="unsafe")
    return wide


def narrow_into(wide: np.ndarray, out: np.ndarray, scratch: Scratch | None = None) -> bool:
    """Round float64 values to ``out``'s dtype (to nearest, ties to even, once) into ``out``.

    Returns True when ``wide`` was left holding the exact values written (so they need
    not be widened again); ``wide`` may be overwritten either way.
    """
    if out.dtype == np.float16 and out.flags.c_contiguous and wide.flags.c_contiguous \
            and out.dtype.byteorder in "=<|":
        with np.errstate(all="ignore"):  # huge values and NaN are settled by NumPy at the end
            return _narrow_float16(wide.reshape(-1), out.reshape(-1).view(np.uint16),
                                   _buffer(scratch, "work", wide.size, np.float64),
                                   _buffer(scratch, "extra", wide.size, np.float64),
                                   _buffer(scratch, "bits", wide.size, np.uint32))
    if out.dtype == _BFLOAT16 and out.flags.c_contiguous and wide.flags.c_contiguous:
        with np.errstate(all="ignore"):
            return _narrow_bfloat16(wide.reshape(-1), out.reshape(-1).view(np.uint16),
                                    _buffer(scratch, "work", wide.size, np.float64),
                                    _buffer(scratch, "extra", wide.size, np.float64),
                                    _buffer(scratch, "bits", wide.size, np.uint32))
    with np.errstate(invalid="ignore", over="ignore"):
        np.copyto(out, wide, casting="unsafe")
    return False


# float16 <-> float64 with integer and float64 operations. NumPy's own conversions run a
# scalar loop here: 1.1 ns per element to float64, 2.8 ns back -- and 72 ns for results
# that are float16 subnormals, which clipped float16 gradients mostly are. These give
# the same bits (checked over every float16 value, every midpoint and its neighbours).

_F16_SIGN_EXTENDED = np.uint32(0x8FFFE000)
_TWO_112 = np.float32(2.0 ** 112)
_EXPONENT = np.uint64(0x7FF0_0000_0000_0000)
_MIN_EXPONENT = np.uint64(1009 << 52)              # 2**-14, below which the float16 quantum stays 2**-24
_ROUNDER = np.uint64((42 << 52) | (1 << 51))         # 1.5 * 2**42 times the quantum's binade
_TOO_BIG = np.uint64(1038 << 52)                     # 2**15: from here numpy decides (overflow, NaN)


def _widen_float16(x: np.ndarray, out: np.ndarray, bits: np.ndarray) -> None:
    # The float16 bits, sign-extended, shifted into a float32 whose exponent is 112 too
    # small; multiplying by 2**112 is exact (subnormals included).
    np.copyto(bits.view(np.int32), x.view(np.int16))
    np.left_shift(bits, np.uint32(13), out=bits)
    np.bitwise_and(bits, _F16_SIGN_EXTENDED, out=bits)
    single = bits.view(np.float32)
    np.multiply(single, _TWO_112, out=single)
    np.copyto(out, single)
    # Inf and NaN came out finite. Looked for in the float16 bits (two passes over 2 bytes
    # an element, not over 8 as a max and a min of the float64 values would be).
    magnitude = bits.view(np.uint16)[: x.size]
    np.bitwise_and(x.view(np.uint16), np.uint16(0x7FFF), out=magnitude)
    if magnitude.size and magnitude.max() >= 0x7C00:
        bad = magnitude >= 0x7C00
        out[bad] = x[bad].astype(np.float64)


def _narrow_float16(wide: np.ndarray, out: np.ndarray, work: np.ndarray, extra: np.ndarray,
                    bits: np.ndarray) -> bool:
    exponent = work.view(np.uint64)
    np.bitwise_and(wide.view(np.uint64), _EXPONENT, out=exponent)
    special = bool(exponent.size) and exponent.max() >= _TOO_BIG
    if special:
        mask = ~(np.abs(wide) < 65520.0)
        keep = wide[mask].astype(np.float16)  # overflow to Inf, Inf, NaN: NumPy decides
    # Adding and subtracting 1.5 * 2**(e+42) rounds |x| to float16's quantum 2**(e-10), ties
    # to even, where e is the value's binade (at least -14, the subnormal quantum).
    np.maximum(exponent, _MIN_EXPONENT, out=exponent)
    np.add(exponent, _ROUNDER, out=exponent)
    rounder = exponent.view(np.float64)
    magnitude = np.abs(wide, out=extra)
    np.add(magnitude, rounder, out=magnitude)
    np.subtract(magnitude, rounder, out=magnitude)
    np.copysign(magnitude, wide, out=wide)  # -0.0 and values rounding to zero keep their sign
    # Now exactly float16 values: scaled by 2**-112 they are float32s whose bits 13.. are the float16's.
    np.multiply(wide, 2.0 ** -112, out=wide)
    single = bits.view(np.float32)
    np.copyto(single, wide, casting="unsafe")
    sign = work.view(np.uint32)[: bits.size]
    np.right_shift(bits, np.uint32(16), out=sign)
    np.bitwise_and(sign, np.uint32(0x8000), out=sign)
    np.right_shift(bits, np.uint32(13), out=bits)
    np.bitwise_and(bits, np.uint32(0x7FFF), out=bits)
    np.bitwise_or(bits, sign, out=bits)
    np.copyto(out, bits, casting="unsafe")
    if special:
        out[mask] = keep.view(np.uint16)
        return False
    np.multiply(wide, 2.0 ** 112, out=wide)  # the exact values written
    return True


# bfloat16 is the upper half of a float32. ml_dtypes' casts hold the GIL (measured: two
# threads convert no faster than one), so threads could not share the work; these
# integer operations release it. ml_dtypes narrows a float64 to bfloat16 through float32
# (two roundings, each to nearest even); so does this, to give the same bits (checked
# over every bfloat16 value, every midpoint and its neighbours).

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def _widen_bfloat16(x: np.ndarray, out: np.ndarray, bits: np.ndarray) -> None:
    np.copyto(bits, x.view(np.uint16))
    np.left_shift(bits, np.uint32(16), out=bits)
    with np.errstate(invalid="ignore"):  # a signalling NaN is still a NaN
        np.copyto(out, bits.view(np.float32))


def _narrow_bfloat16(wide: np.ndarray, out: np.ndarray, work: np.ndarray, extra: np.ndarray,
                     bits: np.ndarray) -> bool:
    single = bits.view(np.float32)
    np.copyto(single, wide, casting="unsafe")
    odd = work.view(np.uint32)[: bits.size]
    np.right_shift(bits, np.uint32(16), out=odd)
    np.bitwise_and(odd, np.uint32(1), out=odd)
    np.add(odd, np.uint32(0x7FFF), out=odd)
    np.add(bits, odd, out=bits)  # round to nearest, ties to even (Inf stays Inf)
    np.right_shift(bits, np.uint32(16), out=bits)
    np.copyto(out, bits, casting="unsafe")
    nan = np.isnan(wide)
    if nan.any():  # NaN payloads are ml_dtypes' business
        out[nan] = wide[nan].astype(ml_dtypes.bfloat16).view(np.uint16)
    return False
