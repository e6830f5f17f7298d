"""Exact statistics, the NaN/Inf scan and scale rewrites of ggml blocks (see :mod:`tclip.quant.ggml`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...core.block_kernels import ggml_sums
from ...formats.gguf.ggml_types import BF16, F16, F32, GGML_TYPES, type_name
from .blocks import (
    _CHUNK_VALUES,
    _FLOAT_TYPES,
    _QUANTS,
    SUPPORTED_TYPES,
    _check_order,
    _dequantize_quant,
    _f16_bits,
    _f16_parts,
    _float_values,
    _Quant,
    as_blocks,
    can_scan,
)

# ----------------------------------------------------------------------------- statistics


@dataclass
class BlockStats:
    """Statistics of ggml's float32 values, one entry per group of ``group_blocks`` blocks.

    Attributes:
        sum_of_squares: float64; a group's blocks are exact before their rounding
            to float64 and added in order.
        total: the sum of the values, float64 (exact per block, like the squares).
        minimum, maximum: the smallest and largest value that is not NaN (``inf``
            and ``-inf`` where every value is NaN); float32 values held as float64.
        nan_count, inf_count: int64 counts of NaN and +-Inf values.
        dequantized_blocks: how many blocks went the slow road (dequantized here
            because a scale is non-finite or the closed form could not be proven exact).
    """

    sum_of_squares: np.ndarray
    total: np.ndarray
    minimum: np.ndarray
    maximum: np.ndarray
    nan_count: np.ndarray
    inf_count: np.ndarray
    dequantized_blocks: int = 0


_EXACT_LIMIT = float(1 << 24)  # integers below this are float32 values


def block_stats(type_id: int, raw: Any, byteorder: str = "<", group_blocks: int = 1,
                extremes: bool = True) -> BlockStats:
    """Sums of squares (and sums, extremes, NaN/Inf counts) of whole blocks, in closed form.

    Args:
        type_id: a type of :data:`SUPPORTED_TYPES` (for F32/F16/BF16 a block is one value).
        raw: the blocks' bytes, a whole number of groups.
        byteorder: the file's byte order, ``'<'`` or ``'>'``.
        group_blocks: blocks per result entry, e.g. the blocks of one row (a GGUF
            row is always a whole number of blocks), or all of them.
        extremes: also compute minimum/maximum (else they are ``inf``/``-inf``);
            for quantized types this costs a pass over the unpacked codes.

    Returns:
        A :class:`BlockStats` with ``blocks / group_blocks`` entries.

    Example:
        >>> s = block_stats(8, bytes([0x00, 0x3C]) + bytes([1, 2] + [0] * 30))  # Q8_0, d = 1.0
        >>> s.sum_of_squares.tolist(), s.maximum.tolist()
        ([5.0], [2.0])
    """
    order = _check_order(byteorder)
    if type_id not in SUPPORTED_TYPES:
        raise ValueError(f"statistics: {type_name(type_id)} is not supported")
    blocks = as_blocks(raw, type_id)
    if group_blocks < 1 or blocks.shape[0] % group_blocks:
        raise ValueError(f"{blocks.shape[0]} blocks are not a whole number of groups of {group_blocks}")
    if type_id in _FLOAT_TYPES:
        return _float_stats(type_id, blocks.reshape(-1), order, group_blocks, extremes)
    groups = blocks.shape[0] // group_blocks
    out = BlockStats(np.zeros(groups), np.zeros(groups), np.full(groups, math.inf),
                     np.full(groups, -math.inf), np.zeros(groups, np.int64), np.zeros(groups, np.int64))
    chunk = max(1, _CHUNK_VALUES // GGML_TYPES[type_id].block_elements)
    if group_blocks <= chunk:  # whole groups per chunk: each written once
        step = chunk // group_blocks * group_blocks
        for start in range(0, blocks.shape[0], step):
            part = _quant_stats(type_id, blocks[start:start + step], order, extremes)
            _add_groups(out, start // group_blocks, part, group_blocks)
    else:  # a group in pieces, added in order
        for group in range(groups):
            for start in range(group * group_blocks, (group + 1) * group_blocks, chunk):
                stop = min(start + chunk, (group + 1) * group_blocks)
                part = _quant_stats(type_id, blocks[start:stop], order, extremes)
                _add_groups(out, group, part, stop - start)
    return out


@dataclass
class _Part:
    """Per-block results of one chunk; extremes None when not asked; ``slow`` are the
    indices of the dequantized blocks, with their NaN/Inf counts."""

    sum_of_squares: np.ndarray
    total: np.ndarray
    minimum: np.ndarray | None
    maximum: np.ndarray | None
    slow: np.ndarray
    slow_nans: np.ndarray
    slow_infs: np.ndarray


def _add_groups(out: BlockStats, first: int, part: _Part, group_blocks: int) -> None:
    """Fold per-block results into groups ``first, first + 1, ...`` (adding to what is there)."""
    count = part.sum_of_squares.size // group_blocks
    where = slice(first, first + count)

    def grouped(values: np.ndarray) -> np.ndarray:
        return values.reshape(count, group_blocks)

    with np.errstate(invalid="ignore", over="ignore"):
        out.sum_of_squares[where] += np.add.reduce(grouped(part.sum_of_squares), axis=1)
        out.total[where] += np.add.reduce(grouped(part.total), axis=1)
    if part.minimum is not None and part.maximum is not None:
        np.minimum(out.minimum[where], grouped(part.minimum).min(axis=1), out=out.minimum[where])
        np.maximum(out.maximum[where], grouped(part.maximum).max(axis=1), out=out.maximum[where])
    if part.slow.size:
        targets = first + part.slow // group_blocks
        np.add.at(out.nan_count, targets, part.slow_nans)
        np.add.at(out.inf_count, targets, part.slow_infs)
        out.dequantized_blocks += int(part.slow.size)


def _quant_stats(type_id: int, blocks: np.ndarray, order: str, extremes: bool) -> _Part:
    fused = ggml_sums(type_id, blocks, order == ">", extremes)  # the same numbers, in C
    if fused is not None:
        ss, total, lo, hi, ok = fused
    else:
        ss, total, lo, hi, ok = _numpy_sums(type_id, blocks, order, extremes)
    slow = np.flatnonzero(~ok)
    nans = infs = np.zeros(0, np.int64)
    if slow.size:
        values = _dequantize_quant(type_id, blocks[slow], order).reshape(slow.size, -1).astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            ss[slow] = np.add.reduce(values * values, axis=1)
            total[slow] = np.add.reduce(values, axis=1)
        nan_mask = np.isnan(values)
        nans = nan_mask.sum(axis=1)
        infs = np.isinf(values).sum(axis=1)
        if lo is not None and hi is not None:
            lo[slow] = np.where(nan_mask, math.inf, values).min(axis=1)
            hi[slow] = np.where(nan_mask, -math.inf, values).max(axis=1)
    return _Part(ss, total, lo, hi, slow, nans, infs)


def _numpy_sums(type_id: int, blocks: np.ndarray, order: str, extremes: bool) -> tuple:
    """Per block: sum of squares, sum, extremes (or None) and the mask of exact blocks."""
    quant = _QUANTS[type_id]
    sum_c, sum_c2, c_min, c_max = quant.code_stats(blocks, order, extremes)
    a, b = quant.scales(blocks) if quant.scales is not None else (None, None)
    if quant.m_at is None:
        return _scaled_sums(quant, blocks, order, a, sum_c, sum_c2, c_min, c_max)
    return _affine_sums(quant, blocks, order, a, b, sum_c, sum_c2, c_min, c_max)


def _across(ufunc: np.ufunc, x: np.ndarray) -> Any:
    """``ufunc``-reduce each row of ``x`` (blocks x sub-blocks, integers): the transposed rows
    combined as whole vectors (NumPy reduces a short last axis a row at a time: measured
    3x slower); integers, so any order gives the same numbers."""
    return ufunc.reduce(np.ascontiguousarray(x.T), axis=0)


def _scaled_sums(quant: _Quant, blocks: np.ndarray, order: str, a: np.ndarray | None, sum_c: np.ndarray,
                 sum_c2: np.ndarray, c_min: np.ndarray | None, c_max: np.ndarray | None) -> tuple:
    """Types without a minimum: v = d * (A c), every value exact in float32.

    ``d**2`` (22 bits) times the integer ``Σ A² Σc²`` (at most 33 bits) rounds once."""
    with np.errstate(invalid="ignore"):  # signalling NaNs flag the cast; they are masked below
        d = _f16_bits(blocks, quant.d_at, order).view(np.float16).astype(np.float64)
    ok = np.isfinite(d)
    d[~ok] = 0.0
    if a is None:  # one sub-block, A = 1
        ss = (d * d) * sum_c2[:, 0]
        total = d * sum_c[:, 0]
        ends = None if c_min is None or c_max is None else (c_min[:, 0], c_max[:, 0])
    else:
        ss = (d * d) * _across(np.add, a * a * sum_c2)
        total = d * _across(np.add, a * sum_c)
        ends = None
        if c_min is not None and c_max is not None:
            ends_lo, ends_hi = a * c_min, a * c_max  # A may be negative
            ends = _across(np.minimum, np.minimum(ends_lo, ends_hi)), _across(np.maximum, np.maximum(ends_lo, ends_hi))
    if ends is None:
        return ss, total, None, None, ok
    smallest, largest = ends[0] * d, ends[1] * d
    return ss, total, np.minimum(smallest, largest), np.maximum(smallest, largest), ok  # d may be negative


def _affine_sums(quant: _Quant, blocks: np.ndarray, order: str, a: np.ndarray | None,
                 b: np.ndarray | None, sum_c: np.ndarray, sum_c2: np.ndarray, c_min: np.ndarray | None,
                 c_max: np.ndarray | None) -> tuple:
    """Types with a minimum: v = (d A) c - m' B, which ggml rounds once to float32.

    With ``d = Sd 2**ed`` and ``m' = Sm 2**em`` (integer significands), every value is
    ``(P A c - Q B) 2**e`` with ``e = min(ed, em)``, ``P = Sd 2**(ed-e)``, ``Q = Sm 2**(em-e)``.
    Where ``|P A c - Q B| < 2**24`` for every sub-block at both ends of the code range
    (c >= 0 here, so the test is on the largest ``|P A|`` and ``|Q B|``), every value
    is a float32 value, ggml's rounding did nothing, and the block's sums are exact
    integers, e.g. ``Σ(P A c - Q B)² = P² ΣA²Σc² - 2 P Q ΣAB Σc + n Q² ΣB²``.
    Other blocks are left to the caller (``ok`` False)."""
    n = quant.sub_len
    if a is None or b is None:  # Q4_1/Q5_1: one sub-block, A = 1, B = -1
        unit = quant.unit_b
        a_top, b_top, b_sign = 1, abs(unit), unit
        w_aa, w_ab, w_bb = sum_c2[:, 0], unit * sum_c[:, 0], unit * unit
        w_a, w_b = sum_c[:, 0], unit
    else:
        a_top, b_top, b_sign = _across(np.maximum, a), _across(np.maximum, b), 1  # K types: A, B >= 0
        w_aa = _across(np.add, a * a * sum_c2)
        w_ab = _across(np.add, a * b * sum_c)
        w_bb = _across(np.add, b * b)
        w_a, w_b = _across(np.add, a * sum_c), _across(np.add, b)
    d_sig, d_exp, bad = _f16_parts(_f16_bits(blocks, quant.d_at, order))
    m_sig, m_exp, m_bad = _f16_parts(_f16_bits(blocks, quant.m_at, order))  # type: ignore[arg-type]
    bad |= m_bad  # ggml multiplies dmin even by a zero minimum: NaN from inf * 0
    uses_m = (m_sig != 0) & (np.asarray(b_top) != 0)
    low_exp = np.where(uses_m, np.minimum(d_exp, m_exp), d_exp)
    # Exact in float64 (at most 17 significant bits times powers of two), so the test is.
    p_top = np.abs(np.ldexp((d_sig * a_top).astype(np.float64), d_exp - low_exp)) * quant.c_hi
    q_top = np.abs(np.ldexp((m_sig * b_top).astype(np.float64), m_exp - low_exp))
    same_sign = (d_sig >= 0) == (m_sig * b_sign >= 0)
    reach = np.where(same_sign, np.maximum(p_top, q_top), p_top + q_top)
    ok = (reach < _EXACT_LIMIT) & ~bad
    p = np.where(ok, d_sig, 0) << np.where(ok, d_exp - low_exp, 0)
    q = np.where(ok & uses_m, m_sig, 0) << np.where(ok, m_exp - low_exp, 0)
    # every partial result is bounded by the final one: below 2**60
    squares = p * p * w_aa - 2 * p * q * w_ab + n * q * q * w_bb
    totals = p * w_a - n * q * w_b
    ss = np.ldexp(squares.astype(np.float64), 2 * low_exp)
    total = np.ldexp(totals.astype(np.float64), low_exp)
    if c_min is None or c_max is None:
        return ss, total, None, None, ok
    pa = p[:, None] * (1 if a is None else a)
    qb = q[:, None] * (quant.unit_b if b is None else b)
    ends_lo, ends_hi = pa * c_min - qb, pa * c_max - qb
    lo = np.ldexp(_across(np.minimum, np.minimum(ends_lo, ends_hi)).astype(np.float64), low_exp)
    hi = np.ldexp(_across(np.maximum, np.maximum(ends_lo, ends_hi)).astype(np.float64), low_exp)
    return ss, total, lo, hi, ok


def _float_stats(type_id: int, data: np.ndarray, order: str, group: int, extremes: bool) -> BlockStats:
    """F32/F16/BF16: the values widened to float64 piece by piece (whole groups, or
    pieces of one group added in order); NaN/Inf are looked for only where a sum of
    squares is not finite."""
    itemsize = GGML_TYPES[type_id].block_bytes
    groups = data.size // itemsize // group
    out = BlockStats(np.zeros(groups), np.zeros(groups), np.full(groups, math.inf),
                     np.full(groups, -math.inf), np.zeros(groups, np.int64), np.zeros(groups, np.int64))
    if group <= _CHUNK_VALUES:
        rows = _CHUNK_VALUES // group
        pieces = ((first, min(groups, first + rows), first * group, min(groups, first + rows) * group)
                  for first in range(0, groups, rows))
    else:
        pieces = ((g, g + 1, start, min(start + _CHUNK_VALUES, (g + 1) * group))
                  for g in range(groups) for start in range(g * group, (g + 1) * group, _CHUNK_VALUES))
    for first, last, start, stop in pieces:
        values = _float_values(type_id, data[start * itemsize:stop * itemsize], order)
        with np.errstate(invalid="ignore", over="ignore"):  # signalling NaNs flag the cast
            wide = values.astype(np.float64).reshape(last - first, -1)
            squares = np.add.reduce(wide * wide, axis=1)
            out.sum_of_squares[first:last] += squares
            out.total[first:last] += np.add.reduce(wide, axis=1)
        odd = np.flatnonzero(~np.isfinite(squares))  # a finite sum of squares rules out NaN and Inf
        if extremes:
            lo, hi = wide.min(axis=1), wide.max(axis=1)
            for row in odd:
                finite_or_inf = wide[row][~np.isnan(wide[row])]
                lo[row] = finite_or_inf.min() if finite_or_inf.size else math.inf
                hi[row] = finite_or_inf.max() if finite_or_inf.size else -math.inf
            np.minimum(out.minimum[first:last], lo, out=out.minimum[first:last])
            np.maximum(out.maximum[first:last], hi, out=out.maximum[first:last])
        for row in odd:
            out.nan_count[first + row] += int(np.count_nonzero(np.isnan(wide[row])))
            out.inf_count[first + row] += int(np.count_nonzero(np.isinf(wide[row])))
    return out


# ----------------------------------------------------------------------------- NaN/Inf scan


@dataclass(frozen=True)
class ScaleScan:
    """Non-finite scale fields (quantized types) or values (F32/F16/BF16; a block is one value).

    ``bad_blocks`` counts blocks with at least one non-finite field;
    ``first_bad_block`` is the index of the first (None when there is none).
    """

    blocks: int
    nan_count: int
    inf_count: int
    bad_blocks: int
    first_bad_block: int | None


def scan_scales(type_id: int, raw: Any, byteorder: str = "<") -> ScaleScan:
    """Count NaN/Inf in every block's f16 ``d``/``dmin``/``m`` (only those bytes are read).

    For F32/F16/BF16 the values themselves are scanned, with integer bit tests.

    Raises:
        ValueError: the type's scale fields are not known (see :func:`can_scan`).
    """
    order = _check_order(byteorder)
    if not can_scan(type_id):
        raise ValueError(f"scan: the scale fields of {type_name(type_id)} are not known")
    blocks = as_blocks(raw, type_id)
    if type_id in _FLOAT_TYPES:
        fields = [(0, {F32: "f32", F16: "f16", BF16: "bf16"}[type_id])]
    else:
        fields = list(GGML_TYPES[type_id].scale_fields)
    nan_total = inf_total = 0
    bad = None
    for at, encoding in fields:
        special = _nonfinite(blocks, at, encoding, order)
        if special is None:
            continue
        nan, inf = special
        nan_total += int(np.count_nonzero(nan))
        inf_total += int(np.count_nonzero(inf))
        bad = nan | inf if bad is None else bad | nan | inf
    where = np.flatnonzero(bad) if bad is not None else np.zeros(0, np.intp)
    return ScaleScan(blocks.shape[0], nan_total, inf_total, int(where.size),
                     int(where[0]) if where.size else None)


def _nonfinite(blocks: np.ndarray, at: int, encoding: str, order: str
               ) -> tuple[np.ndarray, np.ndarray] | None:
    """(NaN mask, Inf mask) of one field of every block, or None when all are finite
    (the common case costs one AND, one compare and one count)."""
    if encoding == "e8m0":
        nan = blocks[:, at] == 0xFF
        return (nan, np.zeros_like(nan)) if nan.any() else None
    width = 4 if encoding == "f32" else 2
    if blocks.shape[1] == width:  # F32/F16/BF16: the values themselves, no copy
        bits = blocks.reshape(-1).view(order + ("u4" if width == 4 else "u2"))
    else:
        bits = np.ascontiguousarray(blocks[:, at:at + width]).view(order + ("u4" if width == 4 else "u2"))[:, 0]
    exponent: np.unsignedinteger
    mantissa: np.unsignedinteger
    if encoding == "f32":
        exponent, mantissa = np.uint32(0x7F800000), np.uint32(0x007FFFFF)
    elif encoding == "f16":
        exponent, mantissa = np.uint16(0x7C00), np.uint16(0x03FF)
    else:
        exponent, mantissa = np.uint16(0x7F80), np.uint16(0x007F)
    special = (bits & exponent) == exponent
    if not special.any():
        return None
    has_mantissa = (bits & mantissa) != 0
    return special & has_mantissa, special & ~has_mantissa


# ----------------------------------------------------------------------------- scale rewrite


@dataclass(frozen=True)
class ScaledBlocks:
    """The rewritten blocks and what the f16 rounding of their scale fields did.

    ``underflowed``: non-zero scale fields that became zero (their block's values,
    or its minimum, became 0); ``subnormal``: fields that became subnormal f16
    (fewer than 11 significant bits, relative rounding above 2**-11).
    """

    data: np.ndarray
    underflowed: int
    subnormal: int


def scale_blocks(type_id: int, raw: Any, factor: float, byteorder: str = "<") -> ScaledBlocks:
    """Multiply every value of the blocks by ``factor`` by rewriting their f16 scale fields.

    Each block's ``d`` (and ``dmin`` in Q2_K/Q4_K/Q5_K, ``m`` in Q4_1/Q5_1) becomes the
    exact product ``field * factor`` rounded once to float16 (to nearest, ties to
    even); codes and sub-block scales keep their bytes. Non-finite fields stay as they are.

    Args:
        factor: finite and > 0.

    Returns:
        A :class:`ScaledBlocks` with a new uint8 array of the same length.

    Raises:
        ValueError: unsupported type (F32/F16/BF16 are values, not blocks: scale
            them as floats), a bad factor, or a field that would overflow to Inf.
    """
    order = _check_order(byteorder)
    if type_id not in _QUANTS:
        raise ValueError(f"scale: {type_name(type_id)} has no block scales to rewrite")
    factor = float(factor)
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"factor: expected a finite number > 0, got {factor!r}")
    blocks = as_blocks(raw, type_id).copy()
    quant = _QUANTS[type_id]
    underflowed = subnormal = 0
    fields = [at for at in (quant.d_at, quant.m_at) if at is not None]
    # With one factor the result depends on the 16 bits alone: past a few thousand fields
    # a table of all 65536 patterns is cheaper than the exact arithmetic per field.
    table = round_f16_product(np.arange(1 << 16, dtype=np.uint16), factor) \
        if blocks.shape[0] * len(fields) > 1 << 13 else None
    for at in fields:
        bits = _f16_bits(blocks, at, order)
        new = np.take(table, bits) if table is not None else round_f16_product(bits, factor)
        magnitude = new & np.uint16(0x7FFF)
        if np.any((magnitude == 0x7C00) & ((bits & np.uint16(0x7C00)) != 0x7C00)):
            raise ValueError(f"factor {factor!r} overflows a float16 scale of {type_name(type_id)}")
        underflowed += int(np.count_nonzero((magnitude == 0) & ((bits & np.uint16(0x7FFF)) != 0)))
        subnormal += int(np.count_nonzero((magnitude != 0) & (magnitude < 0x0400)))
        blocks[:, at:at + 2] = new.astype(order + "u2").view(np.uint8).reshape(-1, 2)
    return ScaledBlocks(blocks.reshape(-1), underflowed, subnormal)


# Below this factor every f16 product is under half the smallest subnormal (2**-25).
_TINY_FACTOR = 2.0 ** -60


def round_f16_product(bits: np.ndarray, factor: float) -> np.ndarray:
    """float16 bits of ``value * factor`` rounded once (to nearest, ties to even) from the
    exact product; NaN/Inf inputs are returned unchanged.

    The product of an 11-bit significand and a 53-bit one needs 64 bits, so a float64
    product would round twice. The factor is split into a 42-bit head and a short
    tail, which makes both partial products exact; their float64 sum ``s`` and its
    error ``t`` (TwoSum) are the exact product. Rounding ``s`` to float16 is right
    unless ``s`` lies exactly halfway between two float16 values, where the sign of
    ``t`` decides.
    """
    bits = np.asarray(bits, np.uint16)
    finite = (bits & np.uint16(0x7C00)) != np.uint16(0x7C00)
    with np.errstate(invalid="ignore"):  # signalling NaNs flag the cast; they are kept as they are
        value = bits.view(np.float16).astype(np.float64)
    if factor < _TINY_FACTOR:
        return np.where(finite, bits & np.uint16(0x8000), bits).astype(np.uint16)
    head = np.array(factor).view(np.int64) & ~np.int64((1 << 11) - 1)
    f_head = float(head.view(np.float64))
    f_tail = factor - f_head
    with np.errstate(invalid="ignore", over="ignore"):
        p1 = value * f_head
        p2 = value * f_tail
        s = p1 + p2
        bb = s - p1
        t = (p1 - (s - bb)) + (p2 - bb)
        rounded = s.astype(np.float16)
    r_bits = rounded.view(np.uint16)
    r_mag = r_bits & np.uint16(0x7FFF)
    # the other float16 neighbour of s, by magnitude (inf counts as 65536 here)
    away = np.abs(s) > np.abs(rounded.astype(np.float64))
    n_mag = np.where(away, r_mag + np.uint16(1), r_mag - np.uint16(1)).astype(np.uint16)
    n_mag = np.where(r_mag == 0, np.uint16(1), n_mag).astype(np.uint16)  # from 0 only upwards
    sign = r_bits & np.uint16(0x8000)
    r_abs = np.where(r_mag == 0x7C00, 65536.0, r_mag.view(np.float16).astype(np.float64))
    n_abs = np.where(n_mag == 0x7C00, 65536.0, n_mag.view(np.float16).astype(np.float64))
    with np.errstate(invalid="ignore"):  # NaN inputs, masked below
        midpoint = np.abs(s) == (r_abs + n_abs) / 2
        # exact |product| = |s| + t * sign(s): beyond the midpoint means the larger magnitude
        beyond = np.where(s < 0, -t, t)
        use_n = midpoint & (beyond != 0) & ((beyond > 0) == (n_abs > r_abs))
    out = np.where(use_n, sign | n_mag, r_bits).astype(np.uint16)
    return np.where(finite, out, bits).astype(np.uint16)
