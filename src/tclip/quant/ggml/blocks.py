"""How each supported ggml type lays out a block, and ggml's float32 dequantization of blocks
(the arithmetic is described in :mod:`tclip.quant.ggml`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ...core.kernels import code_moments
from ...formats.gguf.ggml_types import (
    BF16,
    F16,
    F32,
    GGML_TYPES,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    type_name,
)

_FLOAT_TYPES = (F32, F16, BF16)


# ----------------------------------------------------------------------------- layouts


# Per sub-block: Σc, Σc² (int64, c = u - bias) and, when asked, the smallest and largest c.
CodeStats = tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray]]


@dataclass(frozen=True)
class _Quant:
    """How a supported quantized type spreads one block over sub-blocks.

    A value is ``(d * A) * (u - bias) - m' * B`` (see the module doc).
    ``codes(blocks, order)`` gives the unsigned codes ``u`` as uint8 of shape
    (blocks, sub_blocks, sub_len) (Q8_0: its signed codes, bias 0);
    ``code_stats(blocks, order, extremes)`` gives :data:`CodeStats`;
    ``scales(blocks)`` gives the integer sub-scales ``A`` and minima ``B``
    (int64, (blocks, sub_blocks)), or None where ``A`` is 1 and ``B`` is ``unit_b``.
    """

    sub_blocks: int
    sub_len: int
    bias: int
    c_lo: int  # the range of c = u - bias
    c_hi: int
    d_at: int
    m_at: int | None
    unit_b: int  # B where scales() gives none: 0 (no minimum) or -1 (Q4_1/Q5_1: v = d u + m)
    codes: Callable[[np.ndarray, str], np.ndarray]
    code_stats: Callable[[np.ndarray, str, bool], CodeStats]
    scales: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None


def _code_stats(codes: np.ndarray, bias: int, extremes: bool) -> CodeStats:
    """:data:`CodeStats` of codes shaped (blocks, sub_blocks, sub_len).

    The codes are transposed (while converted to float32, one pass), so that every
    reduction adds whole rows across sub-blocks (SIMD) instead of 16 or 32 values at
    a time: 3-6x faster (measured). The sums are float32 of integers below 2**24,
    hence exact in any order.
    """
    blocks, subs, length = codes.shape
    fused = _fused_code_stats(codes, bias, extremes)
    if fused is not None:
        return fused
    values = np.empty((length, blocks * subs), np.float32)
    np.copyto(values, codes.reshape(-1, length).T)
    lo = hi = None
    if extremes:
        lo = np.minimum.reduce(values, axis=0).astype(np.int64).reshape(blocks, subs) - bias
        hi = np.maximum.reduce(values, axis=0).astype(np.int64).reshape(blocks, subs) - bias
    if bias:
        values -= np.float32(bias)
    sums = np.add.reduce(values, axis=0)
    np.multiply(values, values, out=values)
    squares = np.add.reduce(values, axis=0)
    return sums.astype(np.int64).reshape(blocks, subs), squares.astype(np.int64).reshape(blocks, subs), lo, hi


def _fused_code_stats(codes: np.ndarray, bias: int, extremes: bool) -> CodeStats | None:
    """:func:`_code_stats` in C (integers: the same numbers), or None without the extension."""
    if codes.dtype not in (np.uint8, np.int8) or not codes.size:
        return None
    blocks, subs, length = codes.shape
    moments = code_moments(np.ascontiguousarray(codes.reshape(-1, length)), bias)
    if moments is None:
        return None
    sums, squares, lo, hi = moments.reshape(4, blocks, subs)
    return sums, squares, lo if extremes else None, hi if extremes else None


def _stats_from_codes(codes_fn: Callable[[np.ndarray, str], np.ndarray], bias: int):
    def code_stats(blocks: np.ndarray, order: str, extremes: bool) -> CodeStats:
        return _code_stats(codes_fn(blocks, order), bias, extremes)
    return code_stats


@functools.cache
def _nibble_lut() -> np.ndarray:
    """For a uint16 holding two bytes of packed nibbles: four 16-bit fields,
    Σ low nibbles, Σ low², Σ high nibbles, Σ high² (no field overflows over 16 words)."""
    w = np.arange(1 << 16, dtype=np.uint64)
    a, b = w & np.uint64(0xFF), w >> np.uint64(8)
    lo_a, lo_b = a & np.uint64(15), b & np.uint64(15)
    hi_a, hi_b = a >> np.uint64(4), b >> np.uint64(4)
    return ((lo_a + lo_b) | ((lo_a * lo_a + lo_b * lo_b) << np.uint64(16))
            | ((hi_a + hi_b) << np.uint64(32)) | ((hi_a * hi_a + hi_b * hi_b) << np.uint64(48)))


def _words(blocks: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Bytes ``start:stop`` of each block as uint16 words (a view when the layout allows)."""
    if blocks.shape[1] % 2 == 0 and start % 2 == 0 and blocks.flags.c_contiguous:
        return blocks.view(np.uint16)[:, start // 2:stop // 2]
    return np.ascontiguousarray(blocks[:, start:stop]).view(np.uint16)


def _nibble_stats(blocks: np.ndarray, start: int, runs: int, length: int, extremes: bool) -> CodeStats:
    """Σu, Σu² (and smallest/largest u) of the low and of the high nibbles of ``runs``
    runs of ``length`` bytes from byte ``start``: arrays of shape (blocks, runs, 2).

    Σu and Σu² come from one table look-up per two bytes (four sums at once), 2x
    faster than unpacking the nibbles (measured); words and bytes are transposed as
    in :func:`_code_stats`. The high nibbles' extremes are the bytes' extremes >> 4."""
    count = blocks.shape[0]
    words = _words(blocks, start, start + runs * length).reshape(count * runs, length // 2)
    index = np.ascontiguousarray(words.T, dtype=np.intp)
    packed = np.add.reduce(np.take(_nibble_lut(), index), axis=0)
    fields = [((packed >> np.uint64(shift)) & np.uint64(0xFFFF)).astype(np.int64).reshape(count, runs)
              for shift in (0, 16, 32, 48)]
    sums = np.stack([fields[0], fields[2]], axis=-1)
    squares = np.stack([fields[1], fields[3]], axis=-1)
    if not extremes:
        return sums, squares, None, None
    rows = np.ascontiguousarray(blocks[:, start:start + runs * length].reshape(count * runs, length).T)
    low = rows & np.uint8(15)
    smallest = np.stack([np.minimum.reduce(low, axis=0), np.minimum.reduce(rows, axis=0) >> np.uint8(4)], axis=-1)
    largest = np.stack([np.maximum.reduce(low, axis=0), np.maximum.reduce(rows, axis=0) >> np.uint8(4)], axis=-1)
    return (sums, squares, smallest.astype(np.int64).reshape(count, runs, 2),
            largest.astype(np.int64).reshape(count, runs, 2))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(blocks, groups, 2, n): low then high nibbles of each group of n bytes (qs: (blocks, groups, n))."""
    out = np.empty(qs.shape[:2] + (2,) + qs.shape[2:], np.uint8)
    np.bitwise_and(qs, 15, out=out[:, :, 0])
    np.right_shift(qs, 4, out=out[:, :, 1])
    return out


# Q8_0: d, 32 int8 codes (kept signed: bias 0).
def _q8_0_codes(blocks: np.ndarray, order: str) -> np.ndarray:
    return blocks[:, 2:34].view(np.int8).reshape(-1, 1, 32)


# Q4_0 / Q4_1: element j is the low nibble of qs[j], element j + 16 its high nibble.
def _q4_codes(start: int) -> Callable[[np.ndarray, str], np.ndarray]:
    def codes(blocks: np.ndarray, order: str) -> np.ndarray:
        return _nibbles(blocks[:, start:start + 16].reshape(-1, 1, 16)).reshape(-1, 1, 32)
    return codes


def _q4_stats(start: int, bias: int) -> Callable[[np.ndarray, str, bool], CodeStats]:
    def code_stats(blocks: np.ndarray, order: str, extremes: bool) -> CodeStats:
        fused = _fused_code_stats(_q4_codes(start)(blocks, order), bias, extremes)
        if fused is not None:
            return fused
        sums, squares, lo, hi = _nibble_stats(blocks, start, 1, 16, extremes)
        sum_u, sum_u2 = sums.sum(axis=2), squares.sum(axis=2)  # one sub-block: both halves
        sum_c = sum_u - 32 * bias
        sum_c2 = sum_u2 - 2 * bias * sum_u + 32 * bias * bias
        if lo is None or hi is None:
            return sum_c, sum_c2, None, None
        return sum_c, sum_c2, lo.min(axis=2) - bias, hi.max(axis=2) - bias
    return code_stats


# Q5_0 / Q5_1: as Q4 plus a fifth bit: bit j of the 32-bit qh for element j.
def _q5_codes(qh_at: int) -> Callable[[np.ndarray, str], np.ndarray]:
    def codes(blocks: np.ndarray, order: str) -> np.ndarray:
        qh = blocks[:, qh_at:qh_at + 4]
        if order == ">":
            qh = qh[:, ::-1]
        low = _nibbles(blocks[:, qh_at + 4:qh_at + 20].reshape(-1, 1, 16)).reshape(-1, 32)
        high = np.unpackbits(qh, axis=-1, bitorder="little")
        return (low | (high << np.uint8(4))).reshape(-1, 1, 32)
    return codes


# Q2_K: scales[16] (A low nibble, B high nibble), qs[64], d, dmin; 16 sub-blocks of 16.
# Sub-block 8h + 2j + t holds bits 2j..2j+1 of qs[32h + 16t + l], l = 0..15.
def _crumbs(qs: np.ndarray) -> np.ndarray:
    """The 2-bit codes of 64 bytes per block in sub-block order: (blocks, 16, 16)."""
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1, 1)
    return ((qs.reshape(-1, 2, 1, 2, 16) >> shifts) & np.uint8(3)).reshape(-1, 16, 16)


def _q2_k_codes(blocks: np.ndarray, order: str) -> np.ndarray:
    return _crumbs(blocks[:, 16:80])


def _q2_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc = blocks[:, 0:16].astype(np.int64)
    return sc & 15, sc >> 4


# Q3_K: hmask[32], qs[64], scales[12], d; 16 sub-blocks of 16 with 6-bit signed scales.
# Sub-block s = 8h + 2j + t: low bits as Q2_K, high bit (set means +4) is bit 4h + j of
# hmask[16t + l]; c = low + 4 * high - 4.
def _q3_k_codes(blocks: np.ndarray, order: str) -> np.ndarray:
    hmask = blocks[:, 0:32].reshape(-1, 1, 2, 16)
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1, 1)
    high = ((hmask >> shifts) & np.uint8(1)).reshape(-1, 16, 16)  # bit 4h + j, half t
    return _crumbs(blocks[:, 32:96]) | (high << np.uint8(2))


def _q3_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """16 six-bit scales: low 4 bits from the nibbles of bytes 0-7, high 2 bits from
    bytes 8-11 (ggml unpacks them with 32-bit masks that act byte by byte, so the
    layout has no byte order)."""
    packed = blocks[:, 96:108].astype(np.int64)
    s = np.arange(16)
    low = (packed[:, s % 8] >> (4 * (s // 8))) & 15
    high = (packed[:, 8 + s % 4] >> (2 * (s // 4))) & 3
    return (low | (high << 4)) - 32, np.zeros_like(low)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and minima of a Q4_K/Q5_K block (ggml's get_scale_min_k4)."""
    q = packed.astype(np.int64)
    sc = np.empty(q.shape[:-1] + (8,), np.int64)
    mn = np.empty_like(sc)
    sc[:, :4] = q[:, 0:4] & 63
    mn[:, :4] = q[:, 4:8] & 63
    sc[:, 4:] = (q[:, 8:12] & 15) | ((q[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return sc, mn


# Q4_K: d, dmin, scales[12], qs[128]; sub-block 2g low nibbles / 2g + 1 high nibbles of qs[32g:32g+32].
def _q4_k_codes(blocks: np.ndarray, order: str) -> np.ndarray:
    return _nibbles(blocks[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 8, 32)


def _q4_k_stats(blocks: np.ndarray, order: str, extremes: bool) -> CodeStats:
    fused = _fused_code_stats(_q4_k_codes(blocks, order), 0, extremes)
    if fused is not None:
        return fused
    sums, squares, lo, hi = _nibble_stats(blocks, 16, 4, 32, extremes)
    count = blocks.shape[0]
    flat = [None if a is None else a.reshape(count, 8) for a in (sums, squares, lo, hi)]
    return flat[0], flat[1], flat[2], flat[3]  # type: ignore[return-value]


def _q45_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _k_scale_min(blocks[:, 4:16])


# Q5_K: d, dmin, scales[12], qh[32], qs[128]; the fifth bit of sub-block s is bit s of qh[l].
def _q5_k_codes(blocks: np.ndarray, order: str) -> np.ndarray:
    low = _nibbles(blocks[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    high = (blocks[:, 16:48].reshape(-1, 1, 32) >> shifts) & np.uint8(1)
    return low | (high << np.uint8(4))


# Q6_K: ql[128], qh[64], scales int8[16], d; 16 sub-blocks of 16, c = u - 32.
# Element 128n + 32k + l: nibble k // 2 of ql[64n + 32(k % 2) + l], bits 2k, 2k+1 of qh[32n + l].
def _q6_k_codes(blocks: np.ndarray, order: str) -> np.ndarray:
    ql = blocks[:, 0:128].reshape(-1, 2, 1, 2, 32)
    low = (ql >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1, 1)) & np.uint8(15)  # (n, k//2, k%2, l)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)  # (n, k, l)
    return (low.reshape(-1, 2, 4, 32) | (high << np.uint8(4))).reshape(-1, 16, 16)


def _q6_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = blocks[:, 192:208].view(np.int8).astype(np.int64)
    return a, np.zeros_like(a)


def _q(sub_blocks: int, sub_len: int, bias: int, c_range: tuple[int, int], d_at: int, m_at: int | None,
       codes: Callable[[np.ndarray, str], np.ndarray],
       code_stats: Callable[[np.ndarray, str, bool], CodeStats] | None = None,
       scales: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
       unit_b: int = 0) -> _Quant:
    return _Quant(sub_blocks, sub_len, bias, c_range[0], c_range[1], d_at, m_at, unit_b, codes,
                  code_stats or _stats_from_codes(codes, bias), scales)


_QUANTS: dict[int, _Quant] = {
    Q8_0: _q(1, 32, 0, (-128, 127), 0, None, _q8_0_codes),
    Q4_0: _q(1, 32, 8, (-8, 7), 0, None, _q4_codes(2), _q4_stats(2, 8)),
    Q4_1: _q(1, 32, 0, (0, 15), 0, 2, _q4_codes(4), _q4_stats(4, 0), unit_b=-1),
    Q5_0: _q(1, 32, 16, (-16, 15), 0, None, _q5_codes(2)),
    Q5_1: _q(1, 32, 0, (0, 31), 0, 2, _q5_codes(4), unit_b=-1),
    Q2_K: _q(16, 16, 0, (0, 3), 80, 82, _q2_k_codes, scales=_q2_k_scales),
    Q3_K: _q(16, 16, 4, (-4, 3), 108, None, _q3_k_codes, scales=_q3_k_scales),
    Q4_K: _q(8, 32, 0, (0, 15), 0, 2, _q4_k_codes, _q4_k_stats, _q45_k_scales),
    Q5_K: _q(8, 32, 0, (0, 31), 0, 2, _q5_k_codes, scales=_q45_k_scales),
    Q6_K: _q(16, 16, 32, (-32, 31), 208, None, _q6_k_codes, scales=_q6_k_scales),
}

SUPPORTED_TYPES = frozenset(_QUANTS) | frozenset(_FLOAT_TYPES)


def is_supported(type_id: int) -> bool:
    """Whether :func:`dequantize` and :func:`block_stats` handle this type."""
    return type_id in SUPPORTED_TYPES


def can_scan(type_id: int) -> bool:
    """Whether :func:`scan_scales` knows where this type keeps its scales (or values)."""
    info = GGML_TYPES.get(type_id)
    return info is not None and (type_id in _FLOAT_TYPES or bool(info.scale_fields))


def can_scale(type_id: int) -> bool:
    """Whether :func:`scale_blocks` can multiply this type's values by rewriting its f16 scales."""
    return type_id in _QUANTS


# ----------------------------------------------------------------------------- helpers


def as_blocks(raw: Any, type_id: int) -> np.ndarray:
    """``raw`` (bytes-like or uint8 array) as a (blocks, block_bytes) uint8 array, no copy.

    Raises:
        ValueError: the type is unknown or ``raw`` is not a whole number of blocks.
    """
    info = GGML_TYPES.get(type_id)
    if info is None:
        raise ValueError(f"unknown ggml type {type_id}")
    data = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, np.uint8)
    if data.dtype != np.uint8:
        raise ValueError(f"expected uint8 bytes, got {data.dtype}")
    data = data.reshape(-1)
    if data.size % info.block_bytes:
        raise ValueError(
            f"{data.size} bytes are not a whole number of {info.name} blocks ({info.block_bytes} bytes each)"
        )
    return data.reshape(-1, info.block_bytes)


def _check_order(byteorder: str) -> str:
    if byteorder not in ("<", ">"):
        raise ValueError(f"byteorder: expected '<' or '>', got {byteorder!r}")
    return byteorder


def _f16_bits(blocks: np.ndarray, at: int, order: str) -> np.ndarray:
    """The f16 field at byte ``at`` of every block, as native uint16 bits."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(order + "u2")[:, 0].astype(np.uint16)


def _f16_value(bits: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # signalling NaNs flag the cast; they stay NaN
        return bits.view(np.float16).astype(np.float32)


def _f16_parts(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Finite f16 bits as ``significand * 2**exponent`` with integer significands (int64),
    and a mask of the non-finite ones (their parts are 0)."""
    b = bits.astype(np.int64)
    field = (b >> 10) & 31
    mantissa = b & 1023
    significand = np.where(field == 0, mantissa, mantissa | 1024)
    exponent = np.where(field == 0, -24, field - 25)
    nonfinite = field == 31
    significand = np.where(nonfinite, 0, np.where(b >> 15, -significand, significand))
    return significand, np.where(nonfinite, 0, exponent), nonfinite


# Work in chunks of about this many values: the temporaries stay near the core.
_CHUNK_VALUES = 1 << 18


def _chunks(blocks: np.ndarray, block_elements: int) -> Iterator[tuple[int, np.ndarray]]:
    step = max(1, _CHUNK_VALUES // block_elements)
    for start in range(0, blocks.shape[0], step):
        yield start, blocks[start:start + step]


# ----------------------------------------------------------------------------- dequantize


def dequantize(type_id: int, raw: Any, byteorder: str = "<") -> np.ndarray:
    """The float32 values of whole blocks, exactly as ggml's ``dequantize_row_*`` gives them.

    Args:
        type_id: ggml type id (F32, F16, BF16 or a quantized type of :data:`SUPPORTED_TYPES`).
        raw: the blocks' bytes.
        byteorder: ``'<'`` or ``'>'``, the file's byte order.

    Returns:
        A 1-D float32 array of ``blocks * block_elements`` values, in storage order.

    Example:
        >>> dequantize(8, bytes([0x00, 0x3C]) + bytes(range(32))).tolist()[:3]  # Q8_0, d = 1.0
        [0.0, 1.0, 2.0]
    """
    order = _check_order(byteorder)
    if type_id not in SUPPORTED_TYPES:
        raise ValueError(f"dequantize: {type_name(type_id)} is not supported")
    blocks = as_blocks(raw, type_id)
    if type_id in _FLOAT_TYPES:
        return _float_values(type_id, blocks.reshape(-1), order)
    info = GGML_TYPES[type_id]
    out = np.empty(blocks.shape[0] * info.block_elements, np.float32)
    for start, chunk in _chunks(blocks, info.block_elements):
        values = _dequantize_quant(type_id, chunk, order)
        out[start * info.block_elements:start * info.block_elements + values.size] = values.reshape(-1)
    return out


def dequantize_bands(type_id: int, raw: Any, byteorder: str = "<",
                     max_values: int = _CHUNK_VALUES) -> Iterator[np.ndarray]:
    """:func:`dequantize` a band of whole blocks at a time (at most ``max_values``
    values, at least one block), so that a caller's memory stays bounded."""
    order = _check_order(byteorder)
    if type_id not in SUPPORTED_TYPES:
        raise ValueError(f"dequantize: {type_name(type_id)} is not supported")
    blocks = as_blocks(raw, type_id)
    info = GGML_TYPES[type_id]
    step = max(1, max_values // info.block_elements)
    for start in range(0, blocks.shape[0], step):
        yield dequantize(type_id, blocks[start:start + step].reshape(-1), order)


def _float_values(type_id: int, data: np.ndarray, order: str) -> np.ndarray:
    if type_id == F32:
        return data.view(order + "f4").astype(np.float32)
    if type_id == F16:
        with np.errstate(invalid="ignore"):  # signalling NaNs flag the cast; they stay NaN
            return data.view(order + "f2").astype(np.float32)
    bits = data.view(order + "u2").astype(np.uint32) << np.uint32(16)  # BF16: the top half of a float32
    return bits.view(np.float32)


def _dequantize_quant(type_id: int, blocks: np.ndarray, order: str) -> np.ndarray:
    """(blocks, sub_blocks, sub_len) float32, with ggml's float32 operations:
    ``(d * A) * c`` is exact, then ``- m' * B`` (exact product) rounds once."""
    quant = _QUANTS[type_id]
    d = _f16_value(_f16_bits(blocks, quant.d_at, order))[:, None, None]
    c = quant.codes(blocks, order).astype(np.float32)
    if quant.bias:
        c -= np.float32(quant.bias)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf scales (signalling NaNs too) give NaN/Inf
        if quant.scales is not None:
            a, b = quant.scales(blocks)
            scale = d * a.astype(np.float32)[:, :, None]
        else:
            b = None
            scale = d
        values = scale * c
        if quant.m_at is not None:
            m = _f16_value(_f16_bits(blocks, quant.m_at, order))[:, None, None]
            if b is None:  # Q4_1 / Q5_1: d * u + m
                values += m
            else:
                values -= m * b.astype(np.float32)[:, :, None]
    return values
