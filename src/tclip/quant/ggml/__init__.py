"""ggml's quantized blocks: dequantization, exact statistics, the NaN/Inf scan, scale rewrites.

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

The types' ids, names and sizes are the GGUF format's (:mod:`tclip.formats.gguf.ggml_types`);
:mod:`~tclip.quant.ggml.blocks` holds each type's layout and :func:`dequantize`,
:mod:`~tclip.quant.ggml.arithmetic` the statistics, the scan and the scale rewrites.
"""

from __future__ import annotations

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
    GgmlType,
    tensor_nbytes,
    type_info,
    type_name,
)
from .arithmetic import BlockStats, ScaledBlocks, ScaleScan, block_stats, round_f16_product, scale_blocks, scan_scales
from .blocks import can_scale, can_scan, dequantize, dequantize_bands, is_supported

__all__ = [
    "BF16",
    "F16",
    "F32",
    "GGML_TYPES",
    "Q2_K",
    "Q3_K",
    "Q4_0",
    "Q4_1",
    "Q4_K",
    "Q5_0",
    "Q5_1",
    "Q5_K",
    "Q6_K",
    "Q8_0",
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
    "round_f16_product",
    "scale_blocks",
    "scan_scales",
    "tensor_nbytes",
    "type_info",
    "type_name",
]
