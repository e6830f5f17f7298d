"""One-byte scales (NVFP4's E4M3, MXFP4's E8M0) looked up in C give the float64 scales' bits.

Pass 1 hands one-byte scales to ``_fused.quant_sums`` as bytes with a table of their 256
values (no float64 copy), and counts them (:meth:`ScaleFindings.add_bytes`) from their
smallest and largest byte. Both are held here against the float64 way
(:func:`~tclip.quant.codes.closed_form_numpy` on the widened scales, :meth:`ScaleFindings.add`)
for every byte of every one-byte scale dtype -- NaN, Inf, zero, negative and subnormal
scales included -- under every way the CPU can run, with fixed seeds.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import tclip.quant.codes as codes
from tclip.core import kernels
from tclip.quant.codes import CODE_FORMATS, ScaleFindings, UnitCodes

pytestmark = pytest.mark.skipif(kernels._fused is None, reason="the C extension is not built")

SCALE_DTYPES = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
                "e4m3fnuz": ml_dtypes.float8_e4m3fnuz, "e8m0": None}


def table_of(kind: str) -> np.ndarray:
    raw = np.zeros(1, np.uint8)
    if kind == "e8m0":
        table = codes.byte_scale_table(raw, True)
    else:
        table = codes.byte_scale_table(raw.view(SCALE_DTYPES[kind]), False)
    assert table is not None and table.shape == (256,)
    return table


def scale_bytes(kind: str, contents: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """``contents``: "finite" (positive, finite, non-zero), "every" (each of the 256 bytes, in a
    shuffled order: NaN, Inf, zeros and negatives among them), "zeros" (finite, some zero and
    some negative)."""
    values = table_of(kind)
    finite = np.flatnonzero(np.isfinite(values) & (values > 0)).astype(np.uint8)
    if contents == "every":
        flat = np.concatenate([rng.permutation(256) for _ in range(shape[0] * shape[1] // 256 + 1)]).astype(np.uint8)
        return flat[:shape[0] * shape[1]].reshape(shape)
    chosen = rng.choice(finite, shape)
    if contents == "zeros":
        usable = np.flatnonzero(np.isfinite(values)).astype(np.uint8)
        chosen = rng.choice(usable, shape)
        chosen.reshape(-1)[::5] = zero_byte(values)
    return chosen


def zero_byte(values: np.ndarray) -> int:
    """A byte of value zero (E8M0 has none: its smallest, 2**-127)."""
    zeros = np.flatnonzero(values == 0)
    return int(zeros[0]) if zeros.size else int(np.nanargmin(np.where(np.isfinite(values), values, np.nan)))


def same(fused, numpy) -> None:
    assert fused is not None
    sums, largest, smallest = fused
    want_sums, want_largest, want_smallest = numpy
    assert sums.shape == want_sums.shape
    nan = np.isnan(want_sums)
    assert np.array_equal(np.isnan(sums), nan)
    assert sums[~nan].tobytes() == want_sums[~nan].tobytes()
    for got, want in ((largest, want_largest), (smallest, want_smallest)):
        assert (np.isnan(got) and np.isnan(want)) or (got == want and np.signbit(got) == np.signbit(want))


LAYOUTS = [  # (code format, rows, bytes a row, bw, bh): NVFP4 and MXFP4 groups, FP8 blocks; rows of 64 bytes or not
    ("e2m1", 48, 256, 16, None), ("e2m1", 40, 200, 16, None), ("e2m1", 64, 256, 16, 8), ("e2m1", 32, 256, 32, None),
    ("e2m1", 16, 512, 16, 1), ("e4m3fn", 64, 256, 128, 16), ("e4m3fn", 8, 256, 32, None), ("e5m2", 32, 256, 128, 8)]


@pytest.mark.parametrize("kind", ["e4m3fn", "e8m0", "e5m2", "e4m3fnuz"])
@pytest.mark.parametrize("contents", ["finite", "every", "zeros"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "-".join(map(str, l)))
def test_byte_scales_give_the_float_scales_bits(kind, contents, layout):
    fmt, rows, cols, bw, bh = layout
    rng = np.random.default_rng(rows * 1000 + cols + bw + len(kind) + len(contents))
    raw = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    if fmt != "e2m1":
        raw[(raw & 0x7F) >= 0x7C] = 0x11  # finite codes: the scales' NaN/Inf are what is tested
    width = cols * CODE_FORMATS[fmt].per_byte
    runs = None if bh is None else [(a, min(rows, a + bh)) for a in range(0, rows, bh)]
    groups = rows if runs is None else len(runs)
    stored = scale_bytes(kind, contents, (groups, -(-width // bw)), rng)
    table = table_of(kind)
    as_bytes = UnitCodes(CODE_FORMATS[fmt], raw, 0, width, bw, stored, runs, table)
    as_floats = UnitCodes(CODE_FORMATS[fmt], raw, 0, width, bw, table[stored], runs)
    assert as_bytes.scales.tobytes() == as_floats.scales.tobytes()
    taken = 0
    for per_row in (False, True):
        want = codes.closed_form_numpy(as_floats, per_row)
        for fast in (0, 1, 2):
            got = codes._closed_form_fused(as_bytes, per_row, check=False, fast=fast)
            if got is None:  # a zero extreme: NumPy's way (closed_form, below)
                assert want[1] == 0 or want[2] == 0
                continue
            taken += 1
            same(got, want)
        same(codes.closed_form(as_bytes, per_row), want)
    if contents == "finite":
        assert taken == 6  # the C loop ran every time


FINDINGS_CASES = ["finite", "every", "zeros", "negative", "nan", "inf", "empty", "one"]


def findings_bytes(kind: str, case: str, rng: np.random.Generator) -> np.ndarray:
    values = table_of(kind)
    if case == "empty":
        return np.zeros((0, 4), np.uint8)
    base = scale_bytes(kind, "every" if case == "every" else "finite", (37, 11), rng)
    if case == "one":
        return base[:1, :1]
    flat = base.reshape(-1)
    if case == "zeros":
        flat[[5, 17]] = zero_byte(values)
    elif case == "negative":
        negative = np.flatnonzero(np.isfinite(values) & (values < 0))
        if negative.size:
            flat[9] = negative[-1]
    elif case in ("nan", "inf"):
        bad = np.flatnonzero(np.isnan(values) if case == "nan" else np.isinf(values))
        if bad.size:
            flat[[30, 3]] = bad[0]
    return base


@pytest.mark.parametrize("kind", ["e4m3fn", "e8m0", "e5m2", "e4m3fnuz"])
@pytest.mark.parametrize("case", FINDINGS_CASES)
def test_findings_from_bytes_are_the_findings_of_their_values(kind, case):
    rng = np.random.default_rng(FINDINGS_CASES.index(case) + 10 * len(kind))
    raw = findings_bytes(kind, case, rng)
    table = table_of(kind)
    from_bytes, from_values = ScaleFindings("w_scale", (1000,)), ScaleFindings("w_scale", (1000,))
    for start in (0, 400):  # two adds: the counts add, first positions keep the smallest
        from_bytes.add_bytes(raw, table, start)
        from_values.add(table[raw].reshape(-1), start)
    assert from_bytes == from_values


def test_magnitude_order_of_each_byte_dtype():
    """E4M3FN and E5M2 have a sign bit (mask 0x7F), E8M0 none (0xFF); E4M3FNUZ's NaN is 0x80,
    the pattern of -0: neither, so its findings go through the values."""
    orders = {kind: codes._magnitude_order(table_of(kind).tobytes()) for kind in SCALE_DTYPES}
    assert orders["e4m3fnuz"] is None
    e4m3, e8m0, e5m2 = orders["e4m3fn"], orders["e8m0"], orders["e5m2"]
    assert e4m3 is not None and e4m3[:3] == (0x7F, 1, 0x7E)
    assert e8m0 is not None and e8m0[:3] == (0xFF, 0, 0xFE)
    assert e5m2 is not None and e5m2[:3] == (0x7F, 1, 0x7B)
    assert e4m3[3][1] == 2.0 ** -9 and e4m3[3][0x7E] == 448.0


def test_nvfp4_file_statistics_are_those_of_the_float_scales(tmp_path, monkeypatch):
    """A ModelOpt NVFP4 file's pass 1 through the byte scales gives the statistics (and the
    scale findings) of the float64 way, with NaN and zero scales in some rows."""
    import json

    from tclip.work.budget import Budget
    from tclip.work.statistics import file_statistics

    rng = np.random.default_rng(33)
    rows, cols = 64, 512
    tensors = {}
    for i in range(3):
        name = f"model.layers.{i}.self_attn.k_proj.weight"
        scales = rng.integers(0x08, 0x60, (rows, cols // 16), dtype=np.uint8)
        if i == 1:
            scales[3, 5], scales[40, 0] = 0x7F, 0x00  # a NaN and a zero scale
        tensors[name] = ("U8", rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8))
        tensors[name + "_scale"] = ("F8_E4M3", scales)
        tensors[name + "_scale_2"] = ("F32", np.asarray(rng.uniform(1e-4, 1e-3), np.float32).reshape(()))
    header, offset, blobs = {}, 0, []
    for name, (code, array) in tensors.items():
        data = array.tobytes()
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "modelopt", "quant_algo": "NVFP4",
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}}))
    fast = file_statistics(path, budget=Budget(threads=1))
    monkeypatch.setattr("tclip.quant.encoding.byte_scale_table", lambda raw, e8m0: None)
    slow = file_statistics(path, budget=Budget(threads=1))
    fast.elapsed_s = slow.elapsed_s = 0.0
    assert repr(fast) == repr(slow)
    weight = "model.layers.1.self_attn.k_proj.weight"
    found = fast.findings[weight].scales[weight + "_scale"]
    assert (found.nan, found.zero, found.first_bad, found.first_zero) == (1, 1, 3 * 32 + 5, 40 * 32)


def test_magnitude_order_refuses_tables_it_cannot_read_from_two_bytes():
    """A table whose magnitudes do not grow with the byte, or with a NaN between finite ones:
    no order (findings from the values), as a byte's min and max would not bound the rest."""
    growing = np.ldexp(1.0, np.arange(256) - 127)
    assert codes._magnitude_order(growing.tobytes()) is not None
    shuffled = growing[np.random.default_rng(3).permutation(256)]
    assert codes._magnitude_order(shuffled.tobytes()) is None
    holed = growing.copy()
    holed[100] = np.nan
    assert codes._magnitude_order(holed.tobytes()) is None
    findings, expected = ScaleFindings("s", (4,)), ScaleFindings("s", (4,))
    raw = np.asarray([99, 101, 100, 98], np.uint8)
    findings.add_bytes(raw, holed, 0)
    expected.add(holed[raw], 0)
    assert findings == expected and findings.nan == 1
