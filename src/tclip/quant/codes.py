"""Codes times scales: the arithmetic of weights stored as quantized codes plus scale tensors. No files.

A weight of logical shape ``[..., R, C]`` is stored as *codes* (one byte per
element, or two 4-bit codes per byte, low nibble first) and a *block scale*
tensor ``S`` of shape ``[..., ceil(R / bh), ceil(C / bw)]``, optionally with one
*global* scalar ``g`` that multiplies or divides::

    W[..., i, j] = value(code[..., i, j]) * S[..., i // bh, j // bw]   (* g, or / g)

That one form covers every convention tclip reads (see README, "Quantized
checkpoints"): 128x128 blocks (DeepSeek), one scale per tensor (``bh = R``,
``bw = C``), per row (``bh = 1``, ``bw = C``), per group of 16 or 32 along a row
(NVFP4, MXFP4).

Statistics in closed form
-------------------------
``||W||^2 = g^2 * sum_blocks S_b^2 * sum_{i in b} value_i^2``. The code squares are
summed per row and block first. For E4M3 and E2M1 codes those sums are exact in
float64 (every square is a multiple of 2**-18 below 2**17.7, and a block holds at
most 2**16 of them; E2M1 squares are multiples of 1/4); the product with the
squared scale (exact for scales of up to 26 significant bits) is rounded once,
the products are summed per row, then per unit. No dequantized copy is made for
the norm; extremes come from per-block code extremes times the scale. A unit
holding a NaN/Inf (a NaN code, a NaN or infinite scale) is dequantized instead,
so the counts and extremes are those of its real values.

Rescaling
---------
Multiplying a weight by ``f`` is multiplying its scales: :func:`round_product`
rounds each exact product ``s * f`` once to the scale's dtype (to nearest, ties
to even); E8M0 scales (powers of two) take only ``f = 2**k`` and add ``k`` to the
exponent byte (:func:`shift_e8m0`), exactly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import cast

import ml_dtypes
import numpy as np

from ..core.kernels import byte_lookup, quant_sums

# --------------------------------------------------------------------------- element formats

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float64)


@dataclass(frozen=True)
class CodeFormat:
    """How codes are stored: ``per_byte`` elements per byte (2: 4-bit codes, element
    ``2k`` in the low nibble) and ``name`` (``e4m3fn``, ``e5m2``, ``e4m3fnuz``,
    ``e5m2fnuz``, ``int8``, ``e2m1``)."""

    name: str
    per_byte: int

    @property
    def label(self) -> str:
        return {"e4m3fn": "e4m3", "e2m1": "fp4"}.get(self.name, self.name)

    def bytes_for(self, elements: int) -> int:
        return elements // self.per_byte


CODE_FORMATS = {name: CodeFormat(name, 2 if name == "e2m1" else 1)
                for name in ("e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz", "int8", "e2m1")}

_ML_CODES = {"e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2", "e4m3fnuz": "float8_e4m3fnuz",
             "e5m2fnuz": "float8_e5m2fnuz"}


@functools.cache
def byte_values(fmt: CodeFormat) -> np.ndarray:
    """float64 values of each byte's elements: shape ``[256, per_byte]`` (NaN codes are NaN)."""
    byte = np.arange(256, dtype=np.uint8)
    if fmt.name == "e2m1":
        return np.stack([E2M1_VALUES[byte & 0x0F], E2M1_VALUES[byte >> 4]], axis=1)
    if fmt.name == "int8":
        return byte.view(np.int8).astype(np.float64)[:, None]
    with np.errstate(invalid="ignore"):
        return byte.view(getattr(ml_dtypes, _ML_CODES[fmt.name])).astype(np.float64)[:, None]


@functools.cache
def square_table(fmt: CodeFormat) -> np.ndarray:
    """The sum of the squares of the codes a uint16 index holds (two one-byte codes, or four
    4-bit ones): half or a quarter of the lookups of one code at a time (measured 2.5x faster
    than a lookup per byte, whose uint8 indices NumPy first widens)."""
    values = byte_values(fmt)
    with np.errstate(invalid="ignore", over="ignore"):
        squares = np.sum(values * values, axis=1)
    low, high = (squares[None, :], squares[:, None]) if np.little_endian else (squares[:, None], squares[None, :])
    return (low + high).reshape(-1)


@functools.cache
def _key_values(fmt: CodeFormat) -> np.ndarray:
    """The value of each order key (see :func:`_keys`), indexed by ``key + 128``."""
    table = np.full(256, np.nan)
    if fmt.per_byte == 2:
        nibbles = np.arange(16)
        table[_nibble_keys(nibbles.astype(np.uint8)).astype(np.int64) + 128] = E2M1_VALUES
        return table
    codes = np.arange(256, dtype=np.uint8)
    table[_keys(fmt, codes).astype(np.int64) + 128] = byte_values(fmt)[:, 0]
    return table


def _keys(fmt: CodeFormat, raw: np.ndarray) -> np.ndarray:
    """int8 keys in the order of the codes' values: sign-magnitude codes ``s|m`` become ``m``
    or ``-1 - m``, integer codes are their own keys (a few byte operations, no lookup)."""
    signed = raw.view(np.int8)
    if fmt.name == "int8":
        return signed
    magnitude = np.bitwise_and(signed, np.int8(0x7F))
    return np.bitwise_xor(magnitude, np.right_shift(signed, 7), out=magnitude)


def _nibble_keys(raw: np.ndarray) -> np.ndarray:
    """Order keys of 4-bit sign-magnitude codes (low nibbles of ``raw``)."""
    magnitude = np.bitwise_and(raw, np.uint8(7)).view(np.int8)
    sign = np.negative(np.right_shift(raw, 3).view(np.int8) & np.int8(1))
    return np.bitwise_xor(magnitude, sign, out=magnitude)


# --------------------------------------------------------------------------- scales


def e8m0_values(raw: np.ndarray) -> np.ndarray:
    """E8M0 bytes as float64 powers of two, ``2**(byte - 127)``; byte 0xFF is NaN."""
    raw = np.asarray(raw).view(np.uint8)
    return _E8M0_TABLE[raw]


_E8M0_TABLE = np.where(np.arange(256) == 255, np.nan, np.ldexp(1.0, np.arange(256) - 127))


def scale_values(raw: np.ndarray, e8m0: bool) -> np.ndarray:
    """A scale tensor's stored elements as float64 values (exact for every float dtype)."""
    if e8m0:
        return e8m0_values(raw)
    raw = np.asarray(raw)
    if raw.dtype.itemsize == 1 and raw.dtype.kind == "V":  # ml_dtypes float8 (E4M3, E8M0, ...)
        table = _byte_scale_table(raw.dtype)  # NVFP4's E4M3 scales: ml_dtypes' cast is slow, NumPy's indexing too
        looked_up = byte_lookup(raw.view(np.uint8), table)
        return table[raw.view(np.uint8)] if looked_up is None else looked_up
    with np.errstate(invalid="ignore", over="ignore"):
        return raw.astype(np.float64)


def byte_scale_table(raw: np.ndarray, e8m0: bool) -> np.ndarray | None:
    """The float64 value of every byte of one-byte scales (E8M0, or an ml_dtypes float8 such as
    NVFP4's E4M3), whose values are then ``table[byte]``; None for wider scales."""
    if e8m0:
        return _E8M0_TABLE
    raw = np.asarray(raw)
    return _byte_scale_table(raw.dtype) if raw.dtype.itemsize == 1 and raw.dtype.kind in "Vf" else None


def widen_bytes(raw: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``table[raw]`` for scale bytes ``raw`` (uint8), in C where it is built."""
    raw = np.asarray(raw).view(np.uint8)
    looked_up = byte_lookup(raw, table)
    return table[raw] if looked_up is None else looked_up


@functools.cache
def _byte_scale_table(dtype: np.dtype) -> np.ndarray:
    """Every byte of a one-byte float dtype as ml_dtypes casts it to float64 (the same bits)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)


def is_power_of_two(factor: float) -> bool:
    return math.isfinite(factor) and factor > 0 and math.frexp(factor)[0] == 0.5


def shift_e8m0(raw: np.ndarray, factor: float) -> np.ndarray:
    """E8M0 bytes of ``value * factor`` for ``factor = 2**k``: each byte plus ``k``, exactly
    (NaN bytes stay NaN). Raises ValueError when a byte would leave 0..254."""
    if not is_power_of_two(factor):
        raise ValueError(f"factor {factor!r} is not a power of two")
    k = math.frexp(factor)[1] - 1
    raw = np.asarray(raw).view(np.uint8)
    shifted = raw.astype(np.int16) + k
    nan = raw == 0xFF
    if np.any(((shifted < 0) | (shifted > 254)) & ~nan):
        raise ValueError(f"factor 2**{k} takes an E8M0 scale out of its range 2**-127..2**127")
    return np.where(nan, 0xFF, shifted).astype(np.uint8)


def round_product(values: np.ndarray, factor: float | np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``values * factor`` (float64 values of ``dtype``) rounded once to ``dtype`` from the exact
    product, to nearest with ties to even.

    The float64 product is rounded already, so rounding it again to ``dtype`` is wrong
    only where it lands exactly halfway between two ``dtype`` values: those few products
    are settled exactly (with fractions).
    """
    dtype = np.dtype(dtype)
    values = np.asarray(values, np.float64)
    factor_array = np.broadcast_to(np.asarray(factor, np.float64), values.shape)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        product = values * factor_array
        result = _round_to(product, dtype)
        if dtype == np.float64:
            return result
        back = result.astype(np.float64)
        other = _neighbour(result, product, dtype).astype(np.float64)
        tie = np.isfinite(product) & (back != product) & (np.abs(product - back) == np.abs(other - product))
    for at in zip(*np.nonzero(tie)):
        exact = Fraction(float(values[at])) * Fraction(float(factor_array[at]))
        midpoint = Fraction(float(product[at]))
        if exact != midpoint and (exact > midpoint) == (float(other[at]) > float(back[at])):
            result[at] = _neighbour(result[at], np.asarray(product[at]), dtype)
    return result


def round_quotient(value: float, divisor: float, dtype: np.dtype) -> np.generic:
    """``value / divisor`` rounded once to ``dtype`` from the exact quotient (a scalar); a zero
    or non-finite operand gives IEEE's quotient (a NaN norm's factor makes the scale NaN)."""
    if not (math.isfinite(value) and math.isfinite(divisor)) or divisor == 0:
        with np.errstate(divide="ignore", invalid="ignore"):
            # indexing a 0-d array with () gives its scalar (NumPy's stubs say ndarray)
            return cast(np.generic, np.asarray(np.float64(value) / np.float64(divisor)).astype(dtype)[()])
    exact = Fraction(value) / Fraction(divisor)
    return _round_fraction(exact, np.dtype(dtype))


def _round_fraction(exact: Fraction, dtype: np.dtype) -> np.generic:
    guess = _round_to(np.asarray([float(exact)]), dtype)
    candidates = [guess, _neighbour(guess, np.array([math.inf]), dtype), _neighbour(guess, np.array([-math.inf]), dtype)]
    finite = [c for c in candidates if math.isfinite(float(c[0]))]
    best = min(finite, key=lambda c: (abs(Fraction(float(c[0])) - exact), _odd(c)))
    return best[0]


def _odd(value: np.ndarray) -> int:
    return int(value.view(f"u{value.dtype.itemsize}")[0]) & 1


def _round_to(product: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype == ml_dtypes.bfloat16:
        from ..core.kernels import narrow_into

        out = np.empty(np.shape(product), dtype)
        narrow_into(np.ascontiguousarray(product, np.float64), out)
        return out
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(product).astype(dtype)


def _neighbour(result: np.ndarray, toward: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Per element, the ``dtype`` value next to ``result`` on the side of ``toward``."""
    result = np.asarray(result, dtype)
    up = np.asarray(toward, np.float64) > result.astype(np.float64)
    if dtype in (np.float16, np.float32, np.float64):
        return np.nextafter(result, np.where(up, np.inf, -np.inf).astype(dtype))
    width = 8 * dtype.itemsize
    bits = result.view(f"u{dtype.itemsize}").astype(np.int64)
    sign, magnitude = bits >> (width - 1), bits & ((1 << (width - 1)) - 1)
    key = np.where(sign == 1, -magnitude, magnitude) + np.where(up, 1, -1)  # ordered: -0 and +0 alike
    stepped = np.where(key < 0, (1 << (width - 1)) | -key, key)
    return stepped.astype(f"u{dtype.itemsize}").view(dtype)


# --------------------------------------------------------------------------- findings


@dataclass
class ScaleFindings:
    """What the elements of one scale tensor (or one kind of scale field) held.

    Attributes:
        part: the stored tensor's name; ``shape``: the grid of its scales.
        count: scales seen; ``nan``, ``inf``, ``zero``: how many were NaN, +-Inf, zero.
        first_bad, first_zero: flat index (in ``shape``) of the first NaN/Inf scale
            and of the first zero scale, -1 when there is none.
        smallest, largest: the smallest and largest finite magnitude (inf/0 before any).
    """

    part: str
    shape: tuple[int, ...]
    count: int = 0
    nan: int = 0
    inf: int = 0
    zero: int = 0
    first_bad: int = -1
    first_zero: int = -1
    smallest: float = math.inf
    largest: float = 0.0

    def add(self, values: np.ndarray, first_index: int) -> None:
        """Count the scales ``values`` (float64, flat) that start at ``first_index``."""
        flat = np.asarray(values, np.float64).reshape(-1)
        if not flat.size:
            return
        magnitude = np.abs(flat)
        low, high = float(magnitude.min()), float(magnitude.max())
        if low > 0 and high < math.inf:  # all finite and non-zero (a NaN fails both): nothing to count
            self.count += flat.size
            self.smallest, self.largest = min(self.smallest, low), max(self.largest, high)
            return
        self.count += flat.size
        finite = np.isfinite(magnitude)
        if not finite.all():
            bad = np.flatnonzero(~finite)
            self.nan += int(np.count_nonzero(np.isnan(flat)))
            self.inf += int(np.count_nonzero(np.isinf(flat)))
            self.first_bad = _first(self.first_bad, first_index + int(bad[0]))
        zeros = np.flatnonzero(magnitude == 0)
        if zeros.size:
            self.zero += int(zeros.size)
            self.first_zero = _first(self.first_zero, first_index + int(zeros[0]))
        usable = magnitude[finite & (magnitude > 0)]
        if usable.size:
            self.smallest = min(self.smallest, float(usable.min()))
            self.largest = max(self.largest, float(usable.max()))

    def add_bytes(self, raw: np.ndarray, table: np.ndarray, first_index: int) -> None:
        """:meth:`add` for one-byte scales ``raw`` (uint8) whose values are ``table[raw]``: where
        magnitudes grow with the masked byte (:func:`_magnitude_order`), the smallest and largest
        byte tell whether every scale is finite and non-zero, and their magnitudes (two NumPy
        passes over the bytes, not a float64 copy); else, or where some are not, :meth:`add`."""
        flat = np.asarray(raw).view(np.uint8).reshape(-1)
        if not flat.size:
            return
        order = _magnitude_order(table.tobytes())
        if order is not None:
            mask, first, last, magnitudes = order
            low, high = int(flat.min()), int(flat.max())
            if high <= mask and first <= low and high <= last:  # (a masked-off sign bit: see add)
                self.count += flat.size
                self.smallest = min(self.smallest, float(magnitudes[low]))
                self.largest = max(self.largest, float(magnitudes[high]))
                return
        self.add(widen_bytes(flat, table), first_index)

    def merge(self, other: "ScaleFindings") -> None:
        self.count += other.count
        self.nan += other.nan
        self.inf += other.inf
        self.zero += other.zero
        self.first_bad = _first(self.first_bad, other.first_bad)
        self.first_zero = _first(self.first_zero, other.first_zero)
        self.smallest = min(self.smallest, other.smallest)
        self.largest = max(self.largest, other.largest)

    def where(self, index: int) -> list[int]:
        """A flat index of ``shape`` as a position."""
        return [int(i) for i in np.unravel_index(index, self.shape)] if self.shape else []


@dataclass
class Findings:
    """What a pass over an encoded tensor found in its stored parts (plain, picklable,
    merged in any order: counts add, first positions take the smallest).

    Attributes:
        codes: the stored tensor of the codes (or of the blocks).
        shape: the logical shape, in which ``first_bad_code`` is a flat index.
        nan_codes, inf_codes: elements whose code itself is NaN (E4M3 0x7F/0xFF, ...) or +-Inf.
        first_bad_code: flat index of the first such element, -1 when there is none.
        scales: per scale tensor (or scale field), what its elements held.
        global_value: the value of a global (per-tensor) scale, when the encoding has one.
    """

    codes: str
    shape: tuple[int, ...]
    nan_codes: int = 0
    inf_codes: int = 0
    first_bad_code: int = -1
    scales: dict[str, ScaleFindings] = field(default_factory=dict)
    global_value: float | None = None

    def merge(self, other: "Findings | None") -> None:
        if other is None:
            return
        self.nan_codes += other.nan_codes
        self.inf_codes += other.inf_codes
        self.first_bad_code = _first(self.first_bad_code, other.first_bad_code)
        for name, found in other.scales.items():
            if name in self.scales:
                self.scales[name].merge(found)
            else:
                self.scales[name] = ScaleFindings(found.part, found.shape)
                self.scales[name].merge(found)
        if other.global_value is not None:
            self.global_value = other.global_value

    @property
    def bad_scales(self) -> int:
        return sum(s.nan + s.inf for s in self.scales.values())

    @property
    def zero_scales(self) -> int:
        return sum(s.zero for s in self.scales.values())


@functools.cache
def _magnitude_order(table: bytes) -> tuple[int, int, int, np.ndarray] | None:
    """For the values of the 256 bytes (``table``, float64): (mask, first, last, magnitudes) where
    ``|value(b)|`` is ``magnitudes[b & mask]`` for every byte (mask 0x7F: a sign bit, as E4M3's;
    0xFF: none, as E8M0's) and ``magnitudes[first..last]`` are every finite non-zero one, strictly
    increasing; None where neither mask does (E4M3FNUZ, whose 0x80 is NaN)."""
    values = np.abs(np.frombuffer(table, np.float64))
    for mask in (0x7F, 0xFF):
        magnitudes = values[:mask + 1]
        if not np.array_equal(values, magnitudes[np.arange(256) & mask], equal_nan=True):
            continue
        usable = np.flatnonzero(np.isfinite(magnitudes) & (magnitudes > 0))
        if usable.size and usable[-1] - usable[0] + 1 == usable.size \
                and np.all(np.diff(magnitudes[usable]) > 0):
            return mask, int(usable[0]), int(usable[-1]), magnitudes.copy()
    return None


def _first(a: int, b: int) -> int:
    if a < 0:
        return b
    if b < 0:
        return a
    return min(a, b)


# --------------------------------------------------------------------------- per-unit kernels


def _segments(width: int, offset: int, per_block: int) -> tuple[int, int, int] | None:
    """(head, full blocks, tail) of a run of ``width`` items that starts ``offset`` items into
    a block of ``per_block``; None when the run does not start on a block boundary."""
    if offset % per_block:
        return None
    full = width // per_block
    return 0, full, width - full * per_block


def _block_reduce(ufunc: np.ufunc, items: np.ndarray, offset: int, per_block: int) -> np.ndarray:
    """``ufunc``-reduce each row of ``items`` ([n, m]) per block of ``per_block`` items, the run
    starting ``offset`` items into its first block: ``[n, blocks touched]``."""
    n, m = items.shape
    split = _segments(m, offset, per_block)
    if split is not None:
        _, full, tail = split
        parts = []
        if full:
            blocks = items[:, :full * per_block].reshape(n, full, per_block)
            if per_block <= 32:  # a reduction along a short axis costs a loop per block: add columns instead
                total = blocks[:, :, 0].copy()
                for j in range(1, per_block):
                    ufunc(total, blocks[:, :, j], out=total)
                parts.append(total)
            else:
                parts.append(ufunc.reduce(blocks, axis=2))
        if tail:
            parts.append(ufunc.reduce(items[:, full * per_block:], axis=1)[:, None])
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    first = per_block - offset % per_block
    bounds = [0] + list(range(first, m, per_block))
    return ufunc.reduceat(items, bounds, axis=1)


@dataclass
class UnitCodes:
    """The codes of one unit as rows: ``raw`` uint8 ``[n, bytes per row]`` for logical columns
    ``[col0, col0 + width)`` of ``n`` consecutive rows, with ``scales`` float64 ``[k, blocks]``:
    the scales of the column blocks ``col0 // bw ..`` the rows touch, one row of them per run
    of rows in ``runs`` (``(first, stop)`` row ranges covering ``0..n``; None: one per row).

    ``stored``: the scales as given -- float64, or with ``table`` one-byte scales (uint8), each
    the table's value at its byte (NVFP4's E4M3, E8M0): the C closed form looks them up itself,
    and ``scales`` widens them only where something else asks."""

    fmt: CodeFormat
    raw: np.ndarray
    col0: int
    width: int
    bw: int
    stored: np.ndarray
    runs: list[tuple[int, int]] | None = None
    table: np.ndarray | None = None
    _widened: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def scales(self) -> np.ndarray:
        if self.table is None:
            return self.stored
        if self._widened is None:
            self._widened = widen_bytes(self.stored, self.table)
        return self._widened

    def row_scales(self) -> np.ndarray:
        """``scales`` with one row per row of codes."""
        if self.runs is None:
            return self.scales
        return np.repeat(self.scales, [b - a for a, b in self.runs], axis=0)


def closed_form(unit: UnitCodes, per_row: bool = False, out: np.ndarray | None = None
                ) -> tuple[np.ndarray, float, float]:
    """The sum of squares of the real values -- per row with ``per_row``, else per run of rows
    sharing their scales -- and the largest and smallest value, without dequantizing (see
    the module's docstring). Non-finite inputs give non-finite results. ``out``: a float64
    buffer of at least half the unit's elements for the squares.

    Where the C extension is built this is one pass in C (:func:`_closed_form_fused`, the
    same bits); :func:`closed_form_numpy` is the NumPy way, which takes what C does not."""
    fused = _closed_form_fused(unit, per_row)
    return fused if fused is not None else closed_form_numpy(unit, per_row, out)


_KEY_KINDS = {"int8": 1, "e2m1": 2}  # how _fused.quant_sums orders codes: else sign-magnitude bytes


@functools.cache
def _fused_tables(fmt: CodeFormat) -> tuple[np.ndarray, int, np.ndarray]:
    """What ``_fused.quant_sums`` looks codes up in: each byte's sum of squares (the terms of
    :func:`square_table`), how its keys are made, and each key's value."""
    values = byte_values(fmt)
    with np.errstate(invalid="ignore", over="ignore"):
        squares = np.sum(values * values, axis=1)
    return np.ascontiguousarray(squares), _KEY_KINDS.get(fmt.name, 0), np.ascontiguousarray(_key_values(fmt))


def _closed_form_fused(unit: UnitCodes, per_row: bool, check: bool = True, fast: int = 2
                       ) -> tuple[np.ndarray, float, float] | None:
    """:func:`closed_form` in C, or None where it does not apply: no extension, rows that do
    not start on a block or hold an odd number of bytes, or a zero extreme (NumPy's max
    chooses between -0 and +0 by its own order). ``check``: only once the probe agreed;
    ``fast``: E4M3FN and E2M1 codes summed in any order where that is exact, at most with AVX2
    (1, E4M3FN only) or AVX-512 (2) (0: NumPy's order)."""
    fmt, raw = unit.fmt, unit.raw
    pair = 2 * fmt.per_byte  # elements in two bytes
    n = raw.shape[0]
    if not n or unit.width % pair or unit.bw % pair or unit.col0 % unit.bw or raw.dtype != np.uint8 \
            or not raw.flags.c_contiguous or (check and not _fused_agrees()):
        return None
    stored, table = unit.stored, unit.table  # one-byte scales go to C as they are, with their table
    if table is None or stored.dtype != np.uint8:
        stored, table = unit.scales, None
    if per_row and unit.runs is not None:
        scales, bounds = np.repeat(stored, [b - a for a, b in unit.runs], axis=0), _row_bounds(n)
    elif unit.runs is None:
        scales, bounds = stored, _row_bounds(n)
    else:
        scales, bounds = stored, np.asarray([0] + [b for _, b in unit.runs], np.int64)
    squares, kind, key_values = _fused_tables(fmt)
    blocks = -(-unit.width // unit.bw)
    scales = np.ascontiguousarray(scales[:, :blocks], np.float64 if table is None else np.uint8)
    result: tuple[np.ndarray, float, float] | None = quant_sums(
        raw, unit.bw // pair, squares, kind, key_values, scales, bounds,
        fast if fmt.name in ("e4m3fn", "e2m1") else 0, table)
    if result is None or result[1] == 0 or result[2] == 0:
        return None
    return result


@functools.lru_cache(maxsize=64)
def _row_bounds(n: int) -> np.ndarray:
    """``0, 1, .., n`` (int64, read-only): a group per row, made once per row count (a unit's)."""
    bounds = np.arange(n + 1, dtype=np.int64)
    bounds.flags.writeable = False
    return bounds


@functools.cache
def _fused_agrees() -> bool:
    """Whether ``_fused.quant_sums`` gives :func:`closed_form_numpy`'s bits on a probe: E5M2
    codes (whose sums round) in 128x128 blocks and per row, E2M1 in blocks of 16 and 32 with
    partial last blocks. NumPy's order of summation is its own: where it ever changes, the
    C loop is not used."""
    rng = np.random.default_rng(20261128)
    for name, rows, cols, bw, runs in (("e5m2", 300, 264, 128, [(0, 128), (128, 256), (256, 300)]),
                                       ("e5m2", 5, 1000, 1000, None), ("e2m1", 7, 200, 16, None),
                                       ("e2m1", 6, 72, 32, [(0, 6)])):
        fmt = CODE_FORMATS[name]
        raw = rng.integers(0, 256, (rows, cols // fmt.per_byte), dtype=np.uint8)
        if name == "e5m2":
            raw[(raw & 0x7C) == 0x7C] = 0x3C  # no Inf/NaN codes
        groups = rows if runs is None else len(runs)
        scales = rng.uniform(1e-3, 10.0, (groups, -(-cols // bw)))
        unit = UnitCodes(fmt, raw, 0, cols, bw, scales, runs)
        for per_row in (False, True):
            fused, numpy = _closed_form_fused(unit, per_row, check=False), closed_form_numpy(unit, per_row)
            if fused is None or fused[0].tobytes() != numpy[0].tobytes() or fused[1:] != numpy[1:]:
                return False
    return True


def closed_form_numpy(unit: UnitCodes, per_row: bool = False, out: np.ndarray | None = None
                      ) -> tuple[np.ndarray, float, float]:
    """:func:`closed_form` with NumPy (every unit where the C extension is not built)."""
    fmt, raw = unit.fmt, unit.raw
    n = raw.shape[0]
    elements_per_index = 2 * fmt.per_byte
    if unit.width % elements_per_index or unit.col0 % elements_per_index or unit.bw % elements_per_index \
            or not raw.flags.c_contiguous:
        return _closed_form_slow(unit, per_row)
    index = raw.view(np.uint16)
    per_block, offset = unit.bw // elements_per_index, (unit.col0 % unit.bw) // elements_per_index
    squares = np.take(square_table(fmt), index, mode="clip",
                      out=None if out is None or out.size < index.size else out[:index.size].reshape(index.shape))
    if fmt.per_byte == 2:
        low, high = _nibble_keys(raw), _nibble_keys(np.right_shift(raw, 4))
        key_high, key_low = np.maximum(low, high), np.minimum(low, high, out=low)
        key_per_block, key_offset = unit.bw // 2, (unit.col0 % unit.bw) // 2
    else:
        key_high = key_low = _keys(fmt, raw)
        key_per_block, key_offset = unit.bw, unit.col0 % unit.bw
    if per_row or unit.runs is None:  # a scale per row (or rows asked for): reduce each row's blocks
        code_sums = _block_reduce(np.add, squares, offset, per_block)
        extremes = np.concatenate([_block_reduce(np.maximum, key_high, key_offset, key_per_block),
                                   _block_reduce(np.minimum, key_low, key_offset, key_per_block)])
        scales = unit.row_scales()
    else:  # rows that share their scales are added column by column first (cheap), then per block
        runs = unit.runs
        columns = np.concatenate([np.add.reduce(squares[a:b], axis=0, keepdims=True) for a, b in runs])
        code_sums = _block_reduce(np.add, columns, offset, per_block)
        keys = np.concatenate([np.maximum.reduce(key_high[a:b], axis=0, keepdims=True) for a, b in runs]
                              + [np.minimum.reduce(key_low[a:b], axis=0, keepdims=True) for a, b in runs])
        extremes = np.concatenate([_block_reduce(np.maximum, keys[:len(runs)], key_offset, key_per_block),
                                   _block_reduce(np.minimum, keys[len(runs):], key_offset, key_per_block)])
        scales = unit.scales
    scales = scales[:, :code_sums.shape[1]]
    with np.errstate(invalid="ignore", over="ignore"):
        sums = np.add.reduce(scales * scales * code_sums, axis=1)
        products = np.concatenate([scales, scales]) * _key_values(fmt)[extremes.astype(np.intp) + 128]
        largest, smallest = (float(products.max()), float(products.min())) if n else (-math.inf, math.inf)
    return sums, largest, smallest


def _closed_form_slow(unit: UnitCodes, per_row: bool) -> tuple[np.ndarray, float, float]:
    """Rows of odd lengths or offsets: through the dequantized values (exact, slower)."""
    values = dequantize(unit)
    with np.errstate(invalid="ignore", over="ignore"):
        sums = np.add.reduce(values * values, axis=1)
        if not per_row:
            sums = np.asarray([np.add.reduce(sums)])
        finite = values[~np.isnan(values)]
        largest = float(finite.max()) if finite.size else math.nan
        smallest = float(finite.min()) if finite.size else math.nan
    if np.isnan(values).any():
        largest = smallest = math.nan
    return sums, largest, smallest


def dequantize(unit: UnitCodes, out: np.ndarray | None = None) -> np.ndarray:
    """The unit's real values (before any global scale) in float64, ``[n, width]``; exact:
    every code times its scale is a float64 number."""
    raw, fmt = unit.raw, unit.fmt
    n = raw.shape[0]
    values: np.ndarray = np.take(byte_values(fmt), raw, axis=0, mode="clip").reshape(n, unit.width)
    if out is not None and out.size >= values.size:
        out = out[:values.size].reshape(values.shape)
        out[...] = values
        values = out
    first = unit.col0 // unit.bw
    columns = np.arange(unit.col0, unit.col0 + unit.width) // unit.bw - first
    scales = unit.row_scales()
    with np.errstate(invalid="ignore", over="ignore"):
        if unit.col0 % unit.bw == 0 and unit.width % unit.bw == 0:
            blocks = unit.width // unit.bw
            values.reshape(n, blocks, unit.bw)[...] *= scales[:, :blocks, None]
        else:
            values *= scales[:, columns]
    return values


def code_faults(unit: UnitCodes) -> tuple[int, int, int]:
    """(NaN codes, infinite codes, flat index in the unit of the first of either, -1 if none)."""
    values = np.take(byte_values(unit.fmt), unit.raw, axis=0, mode="clip").reshape(unit.raw.shape[0], unit.width)
    nan, inf = np.isnan(values), np.isinf(values)
    bad = np.flatnonzero(nan | inf)
    return int(np.count_nonzero(nan)), int(np.count_nonzero(inf)), int(bad[0]) if bad.size else -1
