"""Dispatch to the C loop over whole GGUF blocks (``_fused.ggml_sums``; kernels.py is full).

:func:`ggml_sums` gives, per block, what :func:`tclip.quant.ggml.arithmetic._quant_stats`
computes in NumPy before it dequantizes the blocks it cannot do in closed form: the same
numbers (integers and the same float64 operations; the tests hold the two against each other),
without unpacking the codes into arrays. None where the extension is not built.
"""

from __future__ import annotations

import numpy as np

from . import kernels

# ggml type ids the C loop knows (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K)
GGML_SUMS_TYPES = frozenset((2, 3, 6, 7, 8, 10, 11, 12, 13, 14))


def ggml_sums(type_id: int, blocks: np.ndarray, big_endian: bool, extremes: bool
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray] | None:
    """Per block of ``blocks`` ((blocks, block_bytes) uint8): sum of squares, sum, smallest and
    largest value (None unless ``extremes``) as float64, and a bool mask of the blocks whose
    numbers are exact (the others hold 0: the caller dequantizes them). None without the C loop."""
    fused = kernels._fused  # looked up per call: the tests switch it off there
    if fused is None or type_id not in GGML_SUMS_TYPES or not blocks.size:
        return None
    count = blocks.shape[0]
    out = np.empty((4, count), np.float64)
    ok = np.empty(count, np.uint8)
    fused.ggml_sums(np.ascontiguousarray(blocks), type_id, int(big_endian), int(extremes), out, ok)
    return out[0], out[1], (out[2] if extremes else None), (out[3] if extremes else None), ok.view(np.bool_)
