"""GGUF block statistics with the C code moments give the NumPy way's numbers, bit for bit.

``_fused.code_moments`` sums each sub-block's codes, their squares, and finds their extremes
(integers, so any order gives the same numbers); ``_across`` reduces the per-block integer
arrays column-wise. These tests hold :func:`tclip.quant.ggml.block_stats` of every quantized
type (both byte orders, per block, per row and whole, with and without extremes) against the
same call with the C loop switched off, on random blocks with fixed seeds, including every
code value of a byte at the ends of the range, and NaN/Inf scales (the dequantized blocks).
"""

from __future__ import annotations

import numpy as np
import pytest

from support import gguf_helpers as gh
from tclip.core import kernels
from tclip.quant import ggml as gb
from tclip.quant.ggml import blocks as ggml_blocks

QUANT_NAMES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]

pytestmark = pytest.mark.skipif(kernels._fused is None, reason="the C extension is not built")


def stats_bytes(stats: gb.BlockStats) -> tuple:
    return tuple(np.asarray(getattr(stats, name)).tobytes() for name in
                 ("sum_of_squares", "total", "minimum", "maximum", "nan_count", "inf_count"))


def both_ways(monkeypatch, type_id: int, raw: bytes, order: str, group: int, extremes: bool) -> tuple[tuple, tuple]:
    fused = stats_bytes(gb.block_stats(type_id, raw, order, group_blocks=group, extremes=extremes))
    with monkeypatch.context() as patch:
        patch.setattr(ggml_blocks, "code_moments", lambda codes, bias: None)
        numpy = stats_bytes(gb.block_stats(type_id, raw, order, group_blocks=group, extremes=extremes))
    return fused, numpy


@pytest.mark.parametrize("name", QUANT_NAMES)
@pytest.mark.parametrize("order", ["<", ">"])
def test_block_stats_with_c_are_the_numpy_ways(monkeypatch, name, order):
    rng = np.random.default_rng(sum(map(ord, name)) + (order == ">"))
    elements = gh.BLOCKS[gh.TYPE_IDS[name]][0]
    rows, cols = 6, 4 * max(elements, 256)
    raw = gh.blocks_for(name, rows, cols, rng, order)
    blocks = rows * cols // elements
    for group in (1, blocks // rows, blocks):
        for extremes in (True, False):
            fused, numpy = both_ways(monkeypatch, gh.TYPE_IDS[name], raw, order, group, extremes)
            assert fused == numpy


@pytest.mark.parametrize("name", QUANT_NAMES)
def test_codes_at_both_ends_and_nonfinite_scales(monkeypatch, name):
    """All-zero and all-0xFF code bytes (the smallest and largest codes of every type), and
    blocks whose f16 scale is NaN or Inf (dequantized instead)."""
    type_id = gh.TYPE_IDS[name]
    elements, nbytes, fields = gh.BLOCKS[type_id]
    rng = np.random.default_rng(3)
    raw = np.frombuffer(gh.random_blocks(type_id, 12, rng), np.uint8).reshape(12, nbytes).copy()
    keep = np.zeros(nbytes, bool)
    for at in fields:
        keep[at:at + 2] = True
    raw[0, ~keep] = 0x00
    raw[1, ~keep] = 0xFF
    raw[2, fields[0]:fields[0] + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    raw[3, fields[0]:fields[0] + 2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    for group in (1, 12):
        fused, numpy = both_ways(monkeypatch, type_id, raw.tobytes(), "<", group, True)
        assert fused == numpy


def test_code_moments_by_hand():
    codes = np.array([[0, 1, 2, 3], [15, 15, 0, 7]], np.uint8)
    assert kernels.code_moments(codes, 8).tolist() == [[-26, 5], [174, 163], [-8, -8], [-5, 7]]
    signed = np.array([[-128, 127, 1, 0]], np.int8)
    assert kernels.code_moments(signed, 0).tolist() == [[0], [128 * 128 + 127 * 127 + 1], [-128], [127]]
