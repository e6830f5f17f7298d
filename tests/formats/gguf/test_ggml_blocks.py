"""ggml block arithmetic: dequantization as ggml does it, exact closed-form statistics,
the f16 scale scan and the scale rewrite."""

from __future__ import annotations

import hashlib
import json
import math
from fractions import Fraction

import numpy as np
import pytest

import support
from support import gguf_helpers as gh
from tclip.formats.gguf.header import parse_gguf
from tclip.quant import ggml as gb
from tclip.quant.ggml.blocks import _QUANTS

FIXTURES = support.FIXTURES / "gguf"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
QUANT_NAMES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
ALL_NAMES = ["F32", "F16", "BF16", *QUANT_NAMES]


def f16(value: float) -> bytes:
    return np.float16(value).astype("<f2").tobytes()


def blocks_of(name: str, count: int, seed: int = 0, **scales: float) -> bytes:
    return gh.random_blocks(gh.TYPE_IDS[name], count, np.random.default_rng(seed), **scales)


def fsum_squares(values: np.ndarray) -> float:
    wide = values.astype(np.float64)
    return math.fsum((wide * wide).tolist())


# ----------------------------------------------------------------------------- layouts by hand


def test_q8_0_by_hand():
    block = f16(0.5) + np.array([-128, 127, 1] + [0] * 29, np.int8).tobytes()
    assert gb.dequantize(8, block).tolist()[:4] == [-64.0, 63.5, 0.5, 0.0]


def test_q4_0_and_q4_1_nibble_order():
    qs = bytes([0x1F]) + bytes([0x88] * 15)
    values = gb.dequantize(2, f16(2.0) + qs)
    assert (values[0], values[16], values[1], values[17]) == (14.0, -14.0, 0.0, 0.0)
    values = gb.dequantize(3, f16(1.0) + f16(-0.5) + bytes([0x21]) + bytes(15))
    assert (values[0], values[16], values[1]) == (0.5, 1.5, -0.5)


def test_q5_0_fifth_bit():
    qh = (1 | (1 << 16) | (1 << 31)).to_bytes(4, "little")
    values = gb.dequantize(6, f16(1.0) + qh + bytes([0x21]) + bytes(15))
    # element 0: 1 | 16 = 17 -> 1; element 16: 2 | 16 = 18 -> 2; element 31: 0 | 16 -> 0; element 1: 0 -> -16
    assert (values[0], values[16], values[31], values[1]) == (1.0, 2.0, 0.0, -16.0)
    big = gb.dequantize(6, f16(1.0)[::-1] + qh[::-1] + bytes([0x21]) + bytes(15), ">")
    assert np.array_equal(big, values)


def test_q4_k_scale_and_min_unpacking():
    scales = bytearray(12)
    scales[0] = 3  # sub-block 0: scale 3, min from scales[4]
    scales[4] = 2
    scales[9] = 0x75  # sub-block 5: scale 5 | (scales[1] >> 6) << 4, min 7 | (scales[5] >> 6) << 4
    scales[1] = 0x40  # -> scale 5 + 16 = 21
    scales[5] = 0x80  # -> min 7 + 32 = 39
    qs = bytearray(128)
    qs[0] = 0x0A  # sub-block 0, element 0: 10
    qs[64] = 0x40  # sub-block 5 (group 2, high nibbles), element 0: 4
    values = gb.dequantize(12, f16(1.0) + f16(0.25) + bytes(scales) + bytes(qs))
    assert values[0] == 3 * 10 - 0.25 * 2
    assert values[5 * 32] == 21 * 4 - 0.25 * 39


def test_q6_k_layout():
    ql, qh, sc = bytearray(128), bytearray(64), bytearray(16)
    ql[0] = 0x50  # element 0: low nibble 0; element 64: high nibble 5
    qh[0] = 0b00100000  # bits 4-5 -> element 64 gets high bits 2: 5 | 32 = 37 -> c = 5
    sc[0], sc[4] = 1, 3  # element 0 in sub-block 0, element 64 in sub-block 4
    values = gb.dequantize(14, bytes(ql) + bytes(qh) + bytes(sc) + f16(0.5))
    assert (values[0], values[64]) == (0.5 * 1 * -32, 0.5 * 3 * 5)


def test_type_table():
    assert gb.type_info(12).block_bytes == 144 and gb.type_name(12) == "Q4_K"
    assert gb.type_info(4) is None and gb.type_name(4) == "type 4"
    assert gb.tensor_nbytes(12, (3, 512)) == 6 * 144
    assert gb.tensor_nbytes(0, ()) == 4 and gb.tensor_nbytes(8, (0, 32)) == 0
    with pytest.raises(ValueError, match="not a whole number of Q4_K blocks"):
        gb.tensor_nbytes(12, (2, 100))
    assert all(gb.is_supported(gh.TYPE_IDS[name]) for name in ALL_NAMES)
    assert not gb.is_supported(16) and gb.can_scan(16) and not gb.can_scan(29) and not gb.can_scale(0)


# ----------------------------------------------------------------------------- committed fixtures


def _fixture_tensors():
    for file, tensors in EXPECTED.items():
        for name in tensors:
            yield file, name


@pytest.mark.parametrize(("file", "name"), list(_fixture_tensors()))
def test_fixture_values_and_statistics(file, name):
    """Dequantized bits and statistics against what the gguf package computed (stored)."""
    expected = EXPECTED[file][name]
    header = parse_gguf(FIXTURES / file)
    tensor = header.tensor(name)
    raw = np.fromfile(FIXTURES / file, np.uint8)[tensor.offset:tensor.offset + tensor.nbytes]
    with np.errstate(invalid="ignore"):
        values = gb.dequantize(tensor.ggml_type, raw, header.byteorder)
    assert hashlib.sha256(values.astype("<f4").tobytes()).hexdigest() == expected["sha256_f32"]
    blocks = raw.size // gb.GGML_TYPES[tensor.ggml_type].block_bytes
    stats = gb.block_stats(tensor.ggml_type, raw, header.byteorder, group_blocks=blocks)
    squares, total = float(expected["sum_of_squares"]), float(expected["sum"])
    if math.isnan(squares):
        assert math.isnan(stats.sum_of_squares[0])
    else:
        assert stats.sum_of_squares[0] == pytest.approx(squares, rel=1e-15, abs=0)
        assert stats.total[0] == pytest.approx(total, rel=1e-13, abs=1e-15 * math.sqrt(squares))
    assert (stats.minimum[0], stats.maximum[0]) == (float(expected["min"]), float(expected["max"]))
    assert (stats.nan_count[0], stats.inf_count[0]) == (expected["nan"], expected["inf"])
    if tensor.ggml_type not in (0, 1, 30):
        scan = gb.scan_scales(tensor.ggml_type, raw, header.byteorder)
        assert (scan.nan_count, scan.inf_count, scan.first_bad_block) == (
            expected["scale_nan"], expected["scale_inf"], expected["first_bad_block"])
    if name == "q4_k.spread":
        assert stats.dequantized_blocks == blocks  # ggml rounds these values: the slow road


# ----------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("order", ["<", ">"])
def test_block_sums_are_exact(name, order):
    """Every block's sum of squares is the correctly rounded sum of ggml's float32 values squared."""
    type_id = gh.TYPE_IDS[name]
    count = 64 if type_id not in (0, 1, 30) else 2048
    raw = blocks_of(name, count, seed=len(name))
    if order == ">":
        raw = gh.swap_block_fields(raw, type_id)
    values = gb.dequantize(type_id, raw, order).astype(np.float64)
    group = 1 if type_id not in (0, 1, 30) else 32
    stats = gb.block_stats(type_id, raw, order, group_blocks=group)
    per_group = values.reshape(stats.sum_of_squares.size, -1)
    if type_id not in (0, 1, 30):
        assert stats.dequantized_blocks == 0
        assert stats.sum_of_squares.tolist() == [fsum_squares(v) for v in per_group]
        assert stats.total.tolist() == [math.fsum(v.tolist()) for v in per_group]
    else:
        np.testing.assert_allclose(stats.sum_of_squares, [fsum_squares(v) for v in per_group], rtol=1e-15)
    assert np.array_equal(stats.minimum, per_group.min(axis=1))
    assert np.array_equal(stats.maximum, per_group.max(axis=1))
    assert not stats.nan_count.any() and not stats.inf_count.any()


@pytest.mark.parametrize("name", QUANT_NAMES)
def test_norm_of_a_tensor_within_1e_12(name):
    type_id = gh.TYPE_IDS[name]
    raw = blocks_of(name, 4096 if type_id in (8, 2, 3, 6, 7) else 512, seed=7)
    values = gb.dequantize(type_id, raw)
    exact = fsum_squares(values)
    stats = gb.block_stats(type_id, raw, group_blocks=len(raw) // gb.GGML_TYPES[type_id].block_bytes)
    assert abs(stats.sum_of_squares[0] - exact) <= 1e-12 * exact


@pytest.mark.parametrize("name", ["Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"])
def test_blocks_that_ggml_rounds_take_the_slow_road(name):
    """d and its minimum 30 binades apart: ggml's float32 subtraction rounds, the closed form
    cannot be proven exact, and the statistics are still those of ggml's float32 values."""
    type_id = gh.TYPE_IDS[name]
    raw = blocks_of(name, 32, seed=3, d=1e-7, dmin=3e3)
    values = gb.dequantize(type_id, raw)
    stats = gb.block_stats(type_id, raw)
    assert stats.dequantized_blocks == 32
    np.testing.assert_allclose(stats.sum_of_squares, [fsum_squares(v) for v in values.reshape(32, -1)],
                               rtol=1e-15)
    # and ggml's values really differ from the exact reals here, so the choice shows
    quant = _QUANTS[type_id]
    d = np.frombuffer(raw, np.uint8).reshape(32, -1)[:, quant.d_at:quant.d_at + 2].copy().view("<f2")
    assert np.all(np.abs(d.astype(np.float64)) < 2e-7)
    exact_block = _exact_real_sum_of_squares(type_id, np.frombuffer(raw, np.uint8).reshape(32, -1)[0])
    assert exact_block != Fraction(fsum_squares(values[:gb.GGML_TYPES[type_id].block_elements]))


def _exact_real_sum_of_squares(type_id: int, block: np.ndarray) -> Fraction:
    """Σ (d A c - m' B)² with exact rationals (no float32 rounding at all)."""
    quant = _QUANTS[type_id]
    blocks = block.reshape(1, -1)
    d = Fraction(float(blocks[0, quant.d_at:quant.d_at + 2].copy().view("<f2")[0]))
    m = Fraction(float(blocks[0, quant.m_at:quant.m_at + 2].copy().view("<f2")[0]))
    codes = quant.codes(blocks, "<")[0].astype(int) - quant.bias
    if quant.scales is not None:
        a, b = (x[0] for x in quant.scales(blocks))
    else:
        a, b = [1], [quant.unit_b]
    return sum((d * int(a[s]) * int(c) - m * int(b[s])) ** 2 for s in range(codes.shape[0]) for c in codes[s])


@pytest.mark.parametrize("name", QUANT_NAMES)
def test_nonfinite_scales(name):
    type_id = gh.TYPE_IDS[name]
    raw = bytearray(blocks_of(name, 8, seed=1))
    info, quant = gb.GGML_TYPES[type_id], _QUANTS[type_id]
    raw[3 * info.block_bytes + quant.d_at:3 * info.block_bytes + quant.d_at + 2] = b"\x00\x7c"  # +Inf
    if quant.m_at is not None:
        raw[6 * info.block_bytes + quant.m_at:6 * info.block_bytes + quant.m_at + 2] = b"\x01\xfe"  # NaN
    with np.errstate(invalid="ignore"):
        values = gb.dequantize(type_id, bytes(raw)).reshape(8, -1).astype(np.float64)
    stats = gb.block_stats(type_id, bytes(raw))
    assert stats.nan_count.tolist() == np.isnan(values).sum(axis=1).tolist()
    assert stats.inf_count.tolist() == np.isinf(values).sum(axis=1).tolist()
    assert stats.nan_count[3] + stats.inf_count[3] == info.block_elements or math.isnan(stats.sum_of_squares[3])
    assert not math.isfinite(stats.sum_of_squares[3]) and math.isfinite(stats.sum_of_squares[0])
    scan = gb.scan_scales(type_id, bytes(raw))
    assert (scan.inf_count, scan.nan_count, scan.first_bad_block) == (1, int(quant.m_at is not None), 3)
    assert scan.bad_blocks == 1 + int(quant.m_at is not None) and scan.blocks == 8


def test_groups_and_pieces_add_up():
    raw = blocks_of("Q8_0", 8192 + 32, seed=2)  # more than one chunk
    per_block = gb.block_stats(8, raw)
    rows = gb.block_stats(8, raw, group_blocks=32)
    np.testing.assert_allclose(rows.sum_of_squares, per_block.sum_of_squares.reshape(-1, 32).sum(axis=1),
                               rtol=1e-15)
    whole = gb.block_stats(8, raw, group_blocks=8192 + 32)  # one group in several pieces
    assert whole.sum_of_squares[0] == pytest.approx(fsum_squares(gb.dequantize(8, raw)), rel=1e-14)
    assert whole.minimum[0] == per_block.minimum.min() and whole.maximum[0] == per_block.maximum.max()
    assert gb.block_stats(8, b"").sum_of_squares.size == 0


def test_float_types_with_nan_and_inf():
    values = np.array([1.0, np.nan, -np.inf, 2.0, 3.0, 0.0, np.nan, np.nan], np.float32)
    for type_id, raw in ((0, values.astype("<f4").tobytes()), (1, values.astype("<f2").tobytes())):
        stats = gb.block_stats(type_id, raw, group_blocks=4)
        assert stats.nan_count.tolist() == [1, 2] and stats.inf_count.tolist() == [1, 0]
        assert stats.minimum.tolist() == [-math.inf, 0.0] and stats.maximum.tolist() == [2.0, 3.0]
        assert math.isnan(stats.sum_of_squares[0]) and math.isnan(stats.sum_of_squares[1])
        scan = gb.scan_scales(type_id, raw)
        assert (scan.nan_count, scan.inf_count, scan.first_bad_block) == (3, 1, 1)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: gb.block_stats(8, bytes(33)), "not a whole number of Q8_0 blocks"),
    (lambda: gb.block_stats(8, bytes(68), group_blocks=3), "not a whole number of groups"),
    (lambda: gb.block_stats(16, bytes(66)), "IQ2_XXS is not supported"),
    (lambda: gb.dequantize(99, b""), "is not supported"),
    (lambda: gb.dequantize(8, bytes(34), byteorder="="), "byteorder"),
    (lambda: gb.scan_scales(29, bytes(56)), "scale fields of IQ1_M are not known"),
    (lambda: gb.scale_blocks(0, bytes(4), 0.5), "F32 has no block scales"),
    (lambda: gb.scale_blocks(8, bytes(34), 0.0), "factor"),
    (lambda: gb.scale_blocks(8, bytes(34), math.nan), "factor"),
])
def test_argument_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ----------------------------------------------------------------------------- scan


@pytest.mark.parametrize(("type_id", "at", "encoding"), [
    (16, 0, "f16"), (23, 0, "f16"), (34, 52, "f16"), (35, 64, "f16"), (15, 0, "f32"), (39, 0, "e8m0"),
    (9, 2, "f16"),
])
def test_scan_other_types(type_id, at, encoding):
    info = gb.GGML_TYPES[type_id]
    raw = bytearray(info.block_bytes * 5)
    bad = {"f16": b"\x00\x7e", "f32": b"\x00\x00\xc0\x7f", "e8m0": b"\xff"}[encoding]
    raw[4 * info.block_bytes + at:4 * info.block_bytes + at + len(bad)] = bad
    scan = gb.scan_scales(type_id, bytes(raw))
    assert (scan.nan_count, scan.inf_count, scan.bad_blocks, scan.first_bad_block) == (1, 0, 1, 4)
    assert gb.scan_scales(type_id, bytes(info.block_bytes)).first_bad_block is None


# ----------------------------------------------------------------------------- scale rewrite


def _f16_exact_round(value: float, factor: float) -> int:
    """Bits of the float16 nearest to value * factor (exact rationals), ties to even."""
    exact = Fraction(value) * Fraction(factor)
    with np.errstate(over="ignore"):
        guess = np.array([float(exact)], np.float64).astype(np.float16).view(np.uint16)[0]
    best = None
    for bits in {int(guess), int(guess) - 1, int(guess) + 1, int(guess) ^ 0x8000}:
        if not 0 <= bits < 1 << 16 or (bits & 0x7C00) == 0x7C00:
            continue
        candidate = Fraction(float(np.uint16(bits).view(np.float16)))
        key = (abs(candidate - exact), bits & 1)
        if best is None or key < best[0]:
            best = (key, bits)
    assert best is not None
    bits = best[1]
    if abs(exact) >= 65520:  # past the largest float16 and its half ulp
        bits = 0x7C00 | (0x8000 if exact < 0 else 0)
    if bits & 0x7FFF == 0:
        bits = 0x8000 if exact < 0 or (exact == 0 and math.copysign(1, value) < 0) else 0
    return bits


def test_round_f16_product_against_exact_rationals():
    patterns = np.arange(0, 1 << 16, 37, dtype=np.uint16)
    patterns = patterns[(patterns & 0x7C00) != 0x7C00]
    values = patterns.view(np.float16).astype(np.float64)
    for factor in (0.5, 1 / 3, 0.7071067811865476, 1e-3, 0.999999999, 3e-8, 1.7):
        ours = gb.round_f16_product(patterns, factor)
        reference = [_f16_exact_round(float(v), factor) for v in values]
        assert ours.tolist() == reference, factor


def test_round_f16_product_breaks_float64_ties_by_the_exact_product():
    """Products whose float64 rounding lands exactly halfway between two float16 values:
    rounding the float64 product to float16 would round twice, wrongly half the time."""
    value = 1025 / 1024
    cases = differ = 0
    for mid in range(1024, 1124):
        midpoint = (2 * mid + 1) / 2048  # halfway between float16 mid/1024 and (mid+1)/1024
        factor = float(np.nextafter(midpoint / value, 0.0))
        for _ in range(4):
            if value * factor == midpoint and Fraction(value) * Fraction(factor) != midpoint:
                cases += 1
                bits = int(gb.round_f16_product(np.array([np.float16(value)]).view(np.uint16), factor)[0])
                assert bits == _f16_exact_round(value, factor)
                differ += bits != int(np.array([value * factor]).astype(np.float16).view(np.uint16)[0])
            factor = float(np.nextafter(factor, 2.0))
    assert cases > 50 and differ > 20


@pytest.mark.parametrize("name", QUANT_NAMES)
@pytest.mark.parametrize("order", ["<", ">"])
def test_scale_blocks_rewrites_only_scales(name, order):
    type_id = gh.TYPE_IDS[name]
    info, quant = gb.GGML_TYPES[type_id], _QUANTS[type_id]
    raw = blocks_of(name, 256, seed=5)
    if order == ">":
        raw = gh.swap_block_fields(raw, type_id)
    factor = 0.3
    scaled = gb.scale_blocks(type_id, raw, factor, order)
    before = np.frombuffer(raw, np.uint8).reshape(-1, info.block_bytes)
    after = scaled.data.reshape(-1, info.block_bytes)
    fields = [at for at in (quant.d_at, quant.m_at) if at is not None]
    keep = np.ones(info.block_bytes, bool)
    for at in fields:
        keep[at:at + 2] = False
        old = before[:, at:at + 2].copy().view(order + "f2")[:, 0].astype(np.float64)
        new = after[:, at:at + 2].copy().view(order + "u2")[:, 0].astype(np.uint16)
        assert new.tolist() == [_f16_exact_round(v, factor) for v in old[:32]] + new[32:].tolist()
    assert np.array_equal(before[:, keep], after[:, keep])  # codes and sub-scales byte-identical
    # every value became factor * value up to the f16 rounding of the scales
    old_norm = math.sqrt(fsum_squares(gb.dequantize(type_id, raw, order)))
    new_norm = math.sqrt(fsum_squares(gb.dequantize(type_id, scaled.data, order)))
    assert abs(new_norm / (factor * old_norm) - 1) < 2.0 ** -11
    assert (scaled.underflowed, scaled.subnormal) == (0, 0)


def test_scale_blocks_underflow_and_overflow():
    raw = f16(1e-3) + bytes(range(32))
    scaled = gb.scale_blocks(8, raw, 1e-6)
    assert scaled.underflowed == 1 and not gb.dequantize(8, scaled.data).any()
    scaled = gb.scale_blocks(8, raw, 1e-2)  # 1e-5: a subnormal float16
    assert scaled.subnormal == 1 and scaled.underflowed == 0
    with pytest.raises(ValueError, match="overflows a float16 scale of Q8_0"):
        gb.scale_blocks(8, f16(60000.0) + bytes(32), 2.0)
    nan = f16(math.nan) + bytes(32)
    assert gb.scale_blocks(8, nan, 0.5).data.tobytes() == nan  # non-finite fields stay


# ----------------------------------------------------------------------------- the gguf package


@pytest.mark.parametrize("name", ALL_NAMES)
def test_dequantize_matches_gguf_package_bit_for_bit(name):
    gguf = pytest.importorskip("gguf")
    type_id = gh.TYPE_IDS[name]
    rng = np.random.default_rng(11)
    info = gb.GGML_TYPES[type_id]
    raws = [blocks_of(name, 300, seed=11), rng.integers(0, 256, 300 * info.block_bytes, dtype=np.uint8).tobytes()]
    qtype = gguf.GGMLQuantizationType(type_id)
    if name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"):
        weights = rng.standard_normal((8, 256)).astype(np.float32)
        raws.append(gguf.quants.quantize(weights, qtype).tobytes())
    for raw in raws:
        blocks = np.frombuffer(raw, np.uint8).reshape(-1, info.block_bytes)
        with np.errstate(invalid="ignore", over="ignore"):
            theirs = gguf.quants.dequantize(blocks, qtype).astype(np.float32).reshape(-1)
            ours = gb.dequantize(type_id, raw)
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_type_table_matches_gguf_package():
    gguf = pytest.importorskip("gguf")
    for qtype, (elements, nbytes) in gguf.GGML_QUANT_SIZES.items():
        if int(qtype) == 9:  # Q8_1: ggml's block is two f16 and 32 bytes (36); the package says 40
            assert gb.GGML_TYPES[9].block_bytes == 36
            continue
        info = gb.GGML_TYPES[int(qtype)]
        assert (info.name, info.block_elements, info.block_bytes) == (qtype.name, elements, nbytes)


def test_scale_blocks_table_road_equals_exact_road():
    """Many blocks go through a 65536-entry table of the rounding; it must agree with the direct road."""
    raw = blocks_of("Q4_K", 9000, seed=9)
    scaled = gb.scale_blocks(12, raw, 0.37).data.reshape(-1, 144)
    before = np.frombuffer(raw, np.uint8).reshape(-1, 144)
    for at in (0, 2):
        direct = gb.round_f16_product(before[:, at:at + 2].copy().view("<u2")[:, 0], 0.37)
        assert np.array_equal(scaled[:, at:at + 2].copy().view("<u2")[:, 0], direct)
