"""ggml's tensor types as raw blocks: sizes, dequantization, exact statistics, scale rewrites.

No files here: every function takes the bytes of whole blocks (a ``bytes``-like
object or a uint8 array) and the file's byte order, and returns NumPy arrays.

What the numbers mean
---------------------
A quantized block stores codes ``u`` (small unsigned integers), one or two
float16 fields (``d``, and ``dmin`` or ``m``) and, in the K types, small integer
sub-block scales ``A`` and minima ``B``. Every value is

    v = (d * A) * (u - bias) - m' * B

(``m' * B`` is ``dmin * m`` in Q2_K/Q4_K/Q5_K and ``-m`` in Q4_1/Q5_1; it is 0
in the other types). ggml dequantizes in float32 (``dequantize_row_*`` in
ggml-quants.c). For every type here the products are exact in float32 — at most
11 (f16 significand) + 8 (sub-scale) + 6 (code) = 23 significant bits — so the
only rounding ggml ever does is the final subtraction of the minimum; with FMA
contraction or without, the float32 value is the exact real value rounded once
to float32. :func:`dequantize` computes exactly those float32 values.

The statistics (:func:`block_stats`) are of **ggml's float32 values**, exactly:
the sum of squares of a sub-block is ``D^2 Σc^2 - 2 D M Σc + n M^2`` with the
integer sums of the codes. The f16 scales are split into integer significands
and a power of two, so the closed form runs in int64 without any rounding; it is
used where every value of the sub-block is provably representable in float32
(``|P c - Q| < 2**24`` at both ends of the code range, in units of the block's
lowest scale bit), which makes the rounded float32 values equal the exact ones.
That holds for every block of the types without a minimum, and for blocks with
a minimum whose ``d`` and ``dmin`` exponents are within a few binades (real
quantized weights). Any other block, and any block with a NaN/Inf scale, is
dequantized here with ggml's float32 arithmetic and summed in float64 — the same
numbers by a slower road. One block's sum of squares is exact before its single
rounding to float64; blocks are added in float64, in order.

Scale rewrites (:func:`scale_blocks`) multiply each block's f16 ``d`` (and its
``dmin``/``m``) by a factor and round the exact product once to float16, round
to nearest even: every value becomes ``factor * value`` up to the f16 rounding
of its block's scales (relative 2**-12 for normal results); codes keep their bytes.

Big-endian files (GGUF v3) store the f16 fields, F16/BF16/F32 values and the
32-bit ``qh`` of Q5_0/Q5_1 big-endian, as a big-endian build of ggml reads them
through its structs; byte arrays (codes, packed sub-scales) have no byte order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "GGML_TYPES",
    "BlockStats",
    "GgmlType",
    "ScaleScan",
    "ScaledBlocks",
    "block_stats",
    "can_scale",
    "can_scan",
    "dequantize",
    "dequantize_bands",
    "is_supported",
    "scale_blocks",
    "scan_scales",
    "tensor_nbytes",
    "type_info",
    "type_name",
]


@dataclass(frozen=True)
class GgmlType:
    """One of ggml's tensor types: ``block_elements`` values stored in ``block_bytes`` bytes.

    ``scale_fields`` are the (byte offset in the block, encoding) of the block's
    scale and minimum fields, for the NaN/Inf scan; encodings: ``f16``, ``f32``,
    ``e8m0`` (a power of two, 0xFF is NaN).
    """

    id: int
    name: str
    block_elements: int
    block_bytes: int
    scale_fields: tuple[tuple[int, str], ...] = ()


def _t(id_: int, name: str, elements: int, nbytes: int, *fields: tuple[int, str]) -> GgmlType:
    return GgmlType(id_, name, elements, nbytes, tuple(fields))


_F16 = "f16"
# ggml.h's enum ggml_type with the block sizes of ggml-common.h. Ids 4, 5, 31-33 and
# 36-38 were removed from ggml and never appear in valid files.
GGML_TYPES: dict[int, GgmlType] = {t.id: t for t in (
    _t(0, "F32", 1, 4),
    _t(1, "F16", 1, 2),
    _t(2, "Q4_0", 32, 18, (0, _F16)),
    _t(3, "Q4_1", 32, 20, (0, _F16), (2, _F16)),
    _t(6, "Q5_0", 32, 22, (0, _F16)),
    _t(7, "Q5_1", 32, 24, (0, _F16), (2, _F16)),
    _t(8, "Q8_0", 32, 34, (0, _F16)),
    _t(9, "Q8_1", 32, 36, (0, _F16), (2, _F16)),  # gguf-py's table still says 40 (float d, s)
    _t(10, "Q2_K", 256, 84, (80, _F16), (82, _F16)),
    _t(11, "Q3_K", 256, 110, (108, _F16)),
    _t(12, "Q4_K", 256, 144, (0, _F16), (2, _F16)),
    _t(13, "Q5_K", 256, 176, (0, _F16), (2, _F16)),
    _t(14, "Q6_K", 256, 210, (208, _F16)),
    _t(15, "Q8_K", 256, 292, (0, "f32")),
    _t(16, "IQ2_XXS", 256, 66, (0, _F16)),
    _t(17, "IQ2_XS", 256, 74, (0, _F16)),
    _t(18, "IQ3_XXS", 256, 98, (0, _F16)),
    _t(19, "IQ1_S", 256, 50, (0, _F16)),
    _t(20, "IQ4_NL", 32, 18, (0, _F16)),
    _t(21, "IQ3_S", 256, 110, (0, _F16)),
    _t(22, "IQ2_S", 256, 82, (0, _F16)),
    _t(23, "IQ4_XS", 256, 136, (0, _F16)),
    _t(24, "I8", 1, 1),
    _t(25, "I16", 1, 2),
    _t(26, "I32", 1, 4),
    _t(27, "I64", 1, 8),
    _t(28, "F64", 1, 8),
    _t(29, "IQ1_M", 256, 56),  # its f16 scale is spread over the sub-scale bits
    _t(30, "BF16", 1, 2),
    _t(34, "TQ1_0", 256, 54, (52, _F16)),
    _t(35, "TQ2_0", 256, 66, (64, _F16)),
    _t(39, "MXFP4", 32, 17, (0, "e8m0")),
    _t(40, "NVFP4", 64, 36),  # four UE4M3 scales; not scanned
    _t(41, "Q1_0", 128, 18, (0, _F16)),
    _t(42, "Q2_0", 64, 18, (0, _F16)),
)}

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30
_FLOAT_TYPES = (F32, F16, BF16)


def type_info(type_id: int) -> GgmlType | None:
    """The type with ggml id ``type_id``, or None for an id ggml does not define."""
    return GGML_TYPES.get(type_id)


def type_name(type_id: int) -> str:
    """ggml's name of a type id, or ``type <id>`` for an unknown one."""
    info = GGML_TYPES.get(type_id)
    return info.name if info is not None else f"type {type_id}"


def tensor_nbytes(type_id: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``shape`` (NumPy order: the last axis is ggml's rows).

    Raises:
        ValueError: the type is unknown, or the row length is not a whole number of blocks.
    """
    info = GGML_TYPES.get(type_id)
    if info is None:
        raise ValueError(f"unknown ggml type {type_id}")
    count = math.prod(shape)
    if count == 0:
        return 0
    row = shape[-1] if shape else 1
    if row % info.block_elements:
        raise ValueError(
            f"a row of {row} values is not a whole number of {info.name} blocks "
            f"({info.block_elements} values each)"
        )
    return count // info.block_elements * info.block_bytes


# ----------------------------------------------------------------------------- layouts


# Per sub-block: Σc, Σc² (int64, c = u - bias) and, when asked, the smallest and largest c.
CodeStats = tuple[np.ndarray, np.ndarray, "np.ndarray | None", "np.ndarray | None"]


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


def _nibble_stats(blocks: np.ndarray, start: int, runs: int, length: int, extremes: bool
                  ) -> tuple[np.ndarray, ...]:
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
    quant = _QUANTS[type_id]
    sum_c, sum_c2, c_min, c_max = quant.code_stats(blocks, order, extremes)
    a, b = quant.scales(blocks) if quant.scales is not None else (None, None)
    if quant.m_at is None:
        ss, total, lo, hi, ok = _scaled_sums(quant, blocks, order, a, sum_c, sum_c2, c_min, c_max)
    else:
        ss, total, lo, hi, ok = _affine_sums(quant, blocks, order, a, b, sum_c, sum_c2, c_min, c_max)
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
        ss = (d * d) * (a * a * sum_c2).sum(axis=1)
        total = d * (a * sum_c).sum(axis=1)
        ends = None
        if c_min is not None and c_max is not None:
            ends_lo, ends_hi = a * c_min, a * c_max  # A may be negative
            ends = np.minimum(ends_lo, ends_hi).min(axis=1), np.maximum(ends_lo, ends_hi).max(axis=1)
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
        a_top, b_top, b_sign = a.max(axis=1), b.max(axis=1), 1  # K types: A, B >= 0
        w_aa = (a * a * sum_c2).sum(axis=1)
        w_ab = (a * b * sum_c).sum(axis=1)
        w_bb = (b * b).sum(axis=1)
        w_a, w_b = (a * sum_c).sum(axis=1), b.sum(axis=1)
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
    lo = np.ldexp(np.minimum(ends_lo, ends_hi).min(axis=1).astype(np.float64), low_exp)
    hi = np.ldexp(np.maximum(ends_lo, ends_hi).max(axis=1).astype(np.float64), low_exp)
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
