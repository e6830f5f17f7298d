"""The quantized closed form in C (``_fused.quant_sums``) gives the NumPy closed form's bits.

:func:`tclip.quant.codes.closed_form` sums the squares of FP8/FP4/int8 codes per block,
times each block's scale squared, per group of rows, and takes the extremes from the
blocks' extreme codes. The C loop does the same in NumPy's order (``fast=0``), or, for
E4M3FN codes whose sums are exact, in any order with AVX2 (``fast=1``) or AVX-512
(``fast=2``). These tests hold every way the CPU can run against
:func:`~tclip.quant.codes.closed_form_numpy`: every code of every format (E4M3FN and E5M2:
all 256, E2M1: all 16, NaN and Inf codes included) under every kind of scale (128x128
blocks, per row, per tensor, groups of 16 and 32, partial last blocks), random blocks with
fixed seeds, sums past the exact range, and a whole file's statistics with and without C.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tclip.quant.codes as codes
from tclip.core import kernels
from tclip.quant.codes import CODE_FORMATS, UnitCodes

pytestmark = pytest.mark.skipif(kernels._fused is None, reason="the C extension is not built")

FAST = (0, 1, 2)


def same(fused, numpy) -> None:
    """Bit for bit (NaN where NaN): the sums, and the extremes as floats (sign of zero included)."""
    assert fused is not None
    sums, largest, smallest = fused
    want_sums, want_largest, want_smallest = numpy
    assert sums.dtype == np.float64 and sums.shape == want_sums.shape
    nan = np.isnan(want_sums)
    assert np.array_equal(np.isnan(sums), nan)
    assert sums[~nan].tobytes() == want_sums[~nan].tobytes()
    for got, want in ((largest, want_largest), (smallest, want_smallest)):
        assert (np.isnan(got) and np.isnan(want)) or (got == want and np.signbit(got) == np.signbit(want))


def check(unit: UnitCodes, per_row_too: bool = True) -> None:
    for per_row in (False, True) if per_row_too else (False,):
        want = codes.closed_form_numpy(unit, per_row)
        for fast in FAST:
            got = codes._closed_form_fused(unit, per_row, check=False, fast=fast)
            if got is None:  # a zero extreme: closed_form takes NumPy's way (asserted below)
                assert want[1] == 0 or want[2] == 0
                continue
            same(got, want)
        same_or_numpy = codes.closed_form(unit, per_row)
        same(same_or_numpy, want)


def unit_of(fmt: str, raw: np.ndarray, bw: int, bh: int | None, rng: np.random.Generator,
            scale_kind: str = "positive") -> UnitCodes:
    """Rows ``raw`` (uint8) with one scale per ``bh`` rows (None: per row) and ``bw`` columns."""
    code_format = CODE_FORMATS[fmt]
    rows, width = raw.shape[0], raw.shape[1] * code_format.per_byte
    blocks = -(-width // bw)
    if bh is None:
        runs, groups = None, rows
    else:
        runs = [(a, min(rows, a + bh)) for a in range(0, rows, bh)]
        groups = len(runs)
    scales = rng.uniform(1e-4, 4.0, (groups, blocks))
    if scale_kind == "mixed":
        scales *= rng.choice([-1.0, 1.0], scales.shape)
        scales.reshape(-1)[::7] = 0.0
    elif scale_kind == "float16":
        scales = scales.astype(np.float16).astype(np.float64)
    return UnitCodes(code_format, np.ascontiguousarray(raw), 0, width, bw, scales, runs)


# Each byte-code format: rows that hold every one of the 256 codes, in a shuffled order.
BYTE_LAYOUTS = [  # (rows, bytes per row, bw, bh): 128x128 blocks, per row, per tensor, partial blocks
    (256, 256, 128, 128), (16, 512, 512, None), (64, 256, 256, 64), (40, 320, 128, 16), (32, 96, 64, 7),
    (8, 1024, 32, None), (130, 192, 128, 128)]


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz", "int8"])
@pytest.mark.parametrize("layout", BYTE_LAYOUTS, ids=lambda l: "x".join(map(str, l)))
def test_every_byte_code_under_every_kind_of_scale(fmt, layout):
    rows, cols, bw, bh = layout
    rng = np.random.default_rng(sum(map(ord, fmt)) + rows)
    raw = np.concatenate([rng.permutation(256).astype(np.uint8) for _ in range(rows * cols // 256 + 1)])
    raw = raw[:rows * cols].reshape(rows, cols)
    check(unit_of(fmt, raw, bw, bh, rng))  # NaN/Inf codes included: the results are NaN/Inf


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "int8"])
@pytest.mark.parametrize("scale_kind", ["positive", "mixed", "float16"])
def test_every_finite_code_alone_in_its_block(fmt, scale_kind):
    """One code at a time (all the others zero) in 128-code blocks: each code's square and
    extreme, the finite ones only, so that the results are finite and every byte is seen."""
    rng = np.random.default_rng(7)
    values = codes.byte_values(CODE_FORMATS[fmt])[:, 0]
    finite = np.flatnonzero(np.isfinite(values)).astype(np.uint8)
    raw = np.zeros((finite.size, 256), np.uint8)
    raw[np.arange(finite.size), rng.integers(0, 256, finite.size)] = finite
    raw[:, 255] = 1  # a positive and a negative value in every row: no zero extreme
    raw[:, 0] = 0x81 if fmt != "int8" else 0xFF
    for bh in (None, 1, 16, finite.size):
        check(unit_of(fmt, raw, 128, bh, rng, scale_kind))


@pytest.mark.parametrize("bw", [16, 32, 64, 48])
@pytest.mark.parametrize("bh", [None, 1, 8, 64])
@pytest.mark.parametrize("cols", [256, 200])
def test_every_fp4_code_pair_under_every_kind_of_scale(bw, bh, cols):
    """E2M1: every byte (every pair of the 16 codes, NaN-free by construction) in groups of
    16 and 32 (NVFP4, MXFP4), longer blocks and a partial last block (200 bytes: 400 codes a
    row, a partial block for 48 and 32, and rows the AVX-512 loop does not take)."""
    rng = np.random.default_rng(bw * 100 + (bh or 0) + cols)
    rows = 64
    raw = np.concatenate([rng.permutation(256).astype(np.uint8) for _ in range(rows * cols // 256 + 1)])
    raw = raw[:rows * cols].reshape(rows, cols)
    for scale_kind in ("positive", "mixed", "float16"):
        check(unit_of("e2m1", raw, bw, bh, rng, scale_kind))


@pytest.mark.parametrize("seed", range(6))
def test_random_units_with_fixed_seeds(seed):
    rng = np.random.default_rng(1000 + seed)
    fmt = ["e4m3fn", "e5m2", "e2m1"][seed % 3]
    per_byte = CODE_FORMATS[fmt].per_byte
    bw = int(rng.choice([16, 32, 64, 128, 256]))
    rows, cols = int(rng.integers(1, 300)), int(rng.integers(1, 40)) * 64 // per_byte
    raw = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    if fmt != "e2m1":
        nan = (raw & 0x7F) == 0x7F if fmt == "e4m3fn" else (raw & 0x7C) == 0x7C
        raw[nan] = 0x38
    bh = [None, 1, 128, rows][seed % 4]
    check(unit_of(fmt, raw, bw, bh, rng))


def test_one_nan_code_makes_the_result_nan_in_every_lane_position():
    rng = np.random.default_rng(3)
    for position in (0, 1, 15, 16, 63, 64, 127, 200, 255):
        raw = rng.integers(0, 0x70, (32, 256), dtype=np.uint8)
        raw[17, position] = 0x7F if position % 2 else 0xFF
        unit = unit_of("e4m3fn", raw, 128, 16, rng)
        check(unit)
        assert np.isnan(codes.closed_form(unit)[1])


def test_e4m3_sums_past_the_exact_range_are_summed_in_numpys_order():
    """A per-tensor scale over 2**18 codes of 448: the block's sum (past 2**35) rounds, so
    the fast loops must not take it; the result is NumPy's order's."""
    rng = np.random.default_rng(5)
    raw = np.full((256, 1024), 0x7E, np.uint8)  # 448
    raw[:, ::3] = rng.integers(0, 0x7E, raw[:, ::3].shape, dtype=np.uint8) | 0x80
    unit = unit_of("e4m3fn", raw, 1024, 256, rng)
    assert float(codes.closed_form_numpy(unit)[0][0] / unit.scales[0, 0] ** 2) > 2.0 ** 35
    check(unit, per_row_too=False)


def test_rows_that_start_inside_a_block_take_numpys_way():
    rng = np.random.default_rng(11)
    raw = rng.integers(0, 0x70, (1, 256), dtype=np.uint8)
    unit = UnitCodes(CODE_FORMATS["e4m3fn"], raw, 64, 256, 128, rng.uniform(0.1, 1, (1, 3)), None)
    assert codes._closed_form_fused(unit, False, check=False) is None
    same(codes.closed_form(unit), codes.closed_form_numpy(unit))


def test_the_probe_agrees():
    assert codes._fused_agrees()


def _deepseek_file(path):
    """A DeepSeek-style FP8 checkpoint: E4M3 codes with float32 128x128 block scales."""
    rng = np.random.default_rng(9)
    header, blobs, offset = {}, [], 0
    tensors = {}
    for i, (rows, cols) in enumerate([(384, 512), (256, 640), (200, 256)]):
        name = f"model.layers.{i}.self_attn.k_proj.weight"
        raw = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0x40
        tensors[name] = ("F8_E4M3", raw)
        tensors[name + "_scale_inv"] = ("F32", rng.uniform(1e-4, 1e-2, (-(-rows // 128), -(-cols // 128)))
                                        .astype(np.float32))
    for name, (code, array) in tensors.items():
        data = array.tobytes()
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.mkdir()
    (path / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))
    (path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    return path / "model.safetensors"


@pytest.mark.parametrize("threads", [1, 2])
def test_a_files_statistics_are_the_same_with_and_without_c(tmp_path, monkeypatch, threads):
    from tclip.work.budget import Budget
    from tclip.work.statistics import file_statistics

    path = _deepseek_file(tmp_path / "fp8")

    def run():
        stats = file_statistics(path, budget=Budget(threads=threads))
        return {name: (np.asarray(t.sum_of_squares, np.float64).tobytes(), t.min_value, t.max_value, t.count)
                for name, t in stats.stats.items()}

    calls = []
    real = codes.quant_sums

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(codes, "quant_sums", counted)
    fused = run()
    assert calls, "the C loop was not used"
    monkeypatch.setattr(codes, "quant_sums", lambda *args: None)
    assert run() == fused and len(fused) == 3


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                  "float8_e8m0fnu", "float4_e2m1fn"])
def test_one_byte_scales_by_table_are_ml_dtypes_casts(name):
    import ml_dtypes

    raw = np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, name)).reshape(4, 64)
    with np.errstate(invalid="ignore", over="ignore"):
        assert codes.scale_values(raw, False).tobytes() == raw.astype(np.float64).tobytes()


def test_scale_findings_of_good_and_bad_scales():
    """ScaleFindings.add's shortcut (every scale finite and non-zero) and its full count agree."""
    found = codes.ScaleFindings("w_scale", (2, 4))
    found.add(np.array([0.5, -2.0, 0.25, 1.0]), 0)
    assert (found.count, found.nan, found.inf, found.zero, found.smallest, found.largest) == (4, 0, 0, 0, 0.25, 2.0)
    found.add(np.array([0.0, np.nan, -np.inf, 8.0]), 4)
    assert (found.count, found.nan, found.inf, found.zero) == (8, 1, 1, 1)
    assert (found.first_bad, found.first_zero, found.smallest, found.largest) == (5, 4, 0.25, 8.0)
