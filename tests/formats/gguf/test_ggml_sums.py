"""The C loop over whole GGUF blocks (``_fused.ggml_sums``) gives NumPy's numbers, bit for bit.

:func:`tclip.core.block_kernels.ggml_sums` unpacks each quantized type's codes, sums them per
sub-block and combines them with the f16 scales as
:func:`tclip.quant.ggml.arithmetic._numpy_sums` does with whole arrays. These tests hold the two
against each other per block (which blocks are exact, and every exact block's sum of squares,
sum and extremes), and :func:`tclip.quant.ggml.block_stats` with the loop on against it off
(and against NumPy alone, the C code moments off too), for every type and both byte orders, on
random valid blocks, on random bytes (every f16 scale: NaN, Inf, subnormal, negative, huge, so
also affine blocks past 2**24), at both ends of the code range, and with zero scales of
either sign (the extremes' signed zeros).
"""

from __future__ import annotations

import numpy as np
import pytest

from support import gguf_helpers as gh
from tclip.core import block_kernels, kernels
from tclip.quant import ggml as gb
from tclip.quant.ggml import arithmetic, blocks as ggml_blocks

QUANT_NAMES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]

pytestmark = pytest.mark.skipif(kernels._fused is None, reason="the C extension is not built")


def hard_blocks(name: str, seed: int) -> np.ndarray:
    """Random valid blocks, random bytes, all-0x00 and all-0xFF codes, and +-0 scales (the first
    field: d; the last: m, or d again)."""
    type_id = gh.TYPE_IDS[name]
    elements, nbytes, fields = gh.BLOCKS[type_id]
    rng = np.random.default_rng(seed)
    valid = np.frombuffer(gh.blocks_for(name, 8, 4 * elements, rng), np.uint8).reshape(-1, nbytes)
    noise = rng.integers(0, 256, (600, nbytes), dtype=np.uint8)
    ends = np.repeat(valid[:4], 6, axis=0).copy()
    keep = np.zeros(nbytes, bool)
    for at in fields:
        keep[at:at + 2] = True
    ends[0::2, ~keep] = 0x00
    ends[1::2, ~keep] = 0xFF
    for row, bits in enumerate((0x0000, 0x8000, 0x0000, 0x8000, 0x0001, 0x8001)):  # +-0, +-smallest subnormal
        ends[row * 4 % ends.shape[0], fields[0]:fields[0] + 2] = np.frombuffer(np.uint16(bits).tobytes(), np.uint8)
        ends[(row * 4 + 1) % ends.shape[0], fields[-1]:fields[-1] + 2] = \
            np.frombuffer(np.uint16(bits).tobytes(), np.uint8)
    zeros = np.repeat(valid[:4], 4, axis=0).copy()  # d = +0 or -0 with random codes: ties of signed zeros
    zeros[:, fields[0]:fields[0] + 2] = 0
    zeros[1::2, fields[0] + 1] = 0x80
    return np.concatenate([valid, noise, ends, zeros])


@pytest.mark.parametrize("name", QUANT_NAMES)
@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("extremes", [True, False])
def test_each_block_as_numpy(name, order, extremes):
    type_id = gh.TYPE_IDS[name]
    data = hard_blocks(name, sum(map(ord, name)))
    fused = block_kernels.ggml_sums(type_id, data, order == ">", extremes)
    assert fused is not None
    with np.errstate(invalid="ignore", over="ignore"):
        numpy = arithmetic._numpy_sums(type_id, data, order, extremes)
    ok = numpy[4]
    assert fused[4].tolist() == ok.tolist()
    assert 0 < ok.sum() < ok.size  # both roads are taken
    for i, (got, want) in enumerate(zip(fused[:4], numpy[:4])):
        if not extremes and want is None:
            assert got is None
            continue
        if i >= 2:  # the extremes: which zero a tie of +0 and -0 gives is NumPy's SIMD choice, which
            got, want = unsigned_zero(got), unsigned_zero(want)  # differs between CPUs; both are zero
        assert got[ok].tobytes() == want[ok].tobytes()


def unsigned_zero(values: np.ndarray) -> np.ndarray:
    """The values with -0.0 as +0.0 (NaN and every other value, bits included, as they are)."""
    values = np.array(values, copy=True)
    values[values == 0] = 0.0
    return values


def stats_bytes(stats: gb.BlockStats) -> tuple:
    return tuple((unsigned_zero(getattr(stats, name)) if name in ("minimum", "maximum")  # (see above)
                  else np.asarray(getattr(stats, name))).tobytes() for name in
                 ("sum_of_squares", "total", "minimum", "maximum", "nan_count", "inf_count")) \
        + (stats.dequantized_blocks,)


@pytest.mark.parametrize("name", QUANT_NAMES)
@pytest.mark.parametrize("order", ["<", ">"])
def test_block_stats_with_and_without_the_loop(monkeypatch, name, order):
    type_id = gh.TYPE_IDS[name]
    data = hard_blocks(name, 7 + (order == ">"))
    count = data.shape[0] - data.shape[0] % 8
    raw = data[:count].tobytes()
    for group in (1, count // 8, count):
        for extremes in (True, False):
            runs = []
            for off in ((), ("ggml_sums",), ("ggml_sums", "code_moments")):
                with monkeypatch.context() as patch:
                    if "ggml_sums" in off:
                        patch.setattr(arithmetic, "ggml_sums", lambda *args: None)
                    if "code_moments" in off:
                        patch.setattr(ggml_blocks, "code_moments", lambda codes, bias: None)
                    runs.append(stats_bytes(gb.block_stats(type_id, raw, order, group_blocks=group,
                                                           extremes=extremes)))
            assert runs[0] == runs[1] == runs[2]


def test_by_hand():
    q8 = np.frombuffer(bytes([0x00, 0x3C]) + bytes([1, 2] + [0] * 29 + [0xFE]), np.uint8).reshape(1, 34)
    ss, total, lo, hi, ok = block_kernels.ggml_sums(8, q8, False, True)  # type: ignore[misc]
    assert (ss.tolist(), total.tolist(), lo.tolist(), hi.tolist(), ok.tolist()) == ([9.0], [1.0], [-2.0], [2.0], [True])
    # Q4_1, d = 1, m = 0.5: v = u + 0.5 for codes 0 (low nibbles) and 15 (high nibbles)
    q41 = np.frombuffer(bytes([0x00, 0x3C, 0x00, 0x38]) + bytes([0xF0] * 16), np.uint8).reshape(1, 20)
    ss, total, lo, hi, ok = block_kernels.ggml_sums(3, q41, False, True)  # type: ignore[misc]
    assert (ss.tolist(), total.tolist(), lo.tolist(), hi.tolist()) == \
        ([16 * (0.25 + 15.5 ** 2)], [16 * 16.0], [0.5], [15.5])
    nan_d = q41.copy()
    nan_d[0, 1] = 0x7E
    assert block_kernels.ggml_sums(3, nan_d, False, True)[4].tolist() == [False]  # type: ignore[index]


def test_bad_arguments_are_refused():
    fused = kernels._fused
    assert fused is not None
    with pytest.raises(ValueError, match="ggml_sums"):  # not a whole number of Q8_0 blocks
        fused.ggml_sums(np.zeros(35, np.uint8), 8, 0, 1, np.zeros(4), np.zeros(1, np.uint8))
    with pytest.raises(ValueError, match="ggml_sums"):  # type 9 (Q8_1) is not one of them
        fused.ggml_sums(np.zeros(34, np.uint8), 9, 0, 1, np.zeros(4), np.zeros(1, np.uint8))


def test_without_the_extension_numpy_does_it(monkeypatch):
    """With ``kernels._fused`` gone (no C compiler at install) the dispatcher declines and
    block_stats gives the same numbers through NumPy."""
    raw = hard_blocks("Q4_K", 5)[:40].tobytes()
    with_c = stats_bytes(gb.block_stats(12, raw, "<", group_blocks=8))
    monkeypatch.setattr(kernels, "_fused", None)
    assert block_kernels.ggml_sums(12, np.frombuffer(raw, np.uint8).reshape(-1, 144), False, True) is None
    assert stats_bytes(gb.block_stats(12, raw, "<", group_blocks=8)) == with_c
