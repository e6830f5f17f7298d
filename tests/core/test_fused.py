"""The fused C statistics loop (tclip.core._fused) gives NumPy's bits, or is not used.

reduce_unit takes the C loop for a whole unit's sum of squares and extremes; these
tests hold every result of it against the NumPy code it stands in for (the module's
``_fused`` set to None), with its AVX2 copies and with its baseline ones.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from support.kernels import ROW_FACTORS, random_values, same_as_reference
import tclip.core.kernels as kernels
from tclip.core.kernels import Scratch, reduce_unit

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
SIZES = [1, 2, 7, 8, 9, 17, 127, 128, 129, 1000, 8191, 8192, 8193, 20_011, 65_536, 100_003, 1 << 18]


def test_the_extension_is_built():
    """setup.py builds it wherever a C compiler is (CI has one): a silent fallback would
    leave every fast-path test below comparing NumPy with itself."""
    assert kernels._fused is not None, "tclip.core._fused was not built: pip install -e . with a C compiler"
    assert kernels.fused_chunk() > 0
    assert kernels.fused_rows()


@pytest.fixture(params=["avx2", "baseline"])
def copies(request):
    wanted = request.param == "avx2"
    in_use = kernels._fused.set_avx2(wanted)
    if wanted and not in_use:
        pytest.skip("this CPU has no AVX2")
    yield
    kernels._fused.set_avx2(True)


def numpy_way(x, **kw):
    saved = kernels._fused
    kernels._fused = None
    try:
        return reduce_unit(x, Scratch(max(1, x.size)), **kw)
    finally:
        kernels._fused = saved


def assert_same(fast, slow):
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert type(a) is type(b) or (isinstance(a, float) and isinstance(b, float))
        if isinstance(a, float) and a == 0:
            assert math.copysign(1, a) == math.copysign(1, b), (fast, slow)
        assert a == b or (a != a and b != b), (fast, slow)


def uses_fused(x):
    return kernels._reduce_fused(x, True) is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
def test_sums_and_extremes_are_numpys(dtype, n, copies):
    for seed, spread in ((n, 30), (n + 1, 3)):
        with np.errstate(over="ignore"):
            x = random_values(dtype, n, seed, spread)
        assert uses_fused(x)
        assert_same(reduce_unit(x, Scratch(n)), numpy_way(x))
        assert_same(reduce_unit(x, Scratch(n), extremes=False), numpy_way(x, extremes=False))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("values", ["negative", "positive", "zeros", "minus zeros", "one", "subnormal"])
def test_signs_and_zeros(dtype, values, copies):
    rng = np.random.default_rng(5)
    tiny = float((ml_dtypes.finfo if dtype == ml_dtypes.bfloat16 else np.finfo)(dtype).smallest_subnormal)
    pick = {"negative": -np.abs(rng.standard_normal(3000)) - 0.25,
            "positive": np.abs(rng.standard_normal(3000)) + 0.25,
            "zeros": rng.choice([0.0, -0.0], 3000),
            "minus zeros": np.full(3000, -0.0),
            "one": np.array([-2.5]),
            "subnormal": rng.choice([tiny, -tiny, 0.0, -0.0], 3000)}[values]
    x = pick.astype(dtype)
    assert uses_fused(x)
    assert_same(reduce_unit(x, Scratch(x.size)), numpy_way(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_go_the_numpy_way(dtype, special, copies):
    """A unit whose sum of squares is not finite is counted by the NumPy code (NaN and Inf counts)."""
    x = random_values(dtype, 5000, seed=3, spread=3)
    x[[17, 4000]] = special
    assert not uses_fused(x)
    fast, slow = reduce_unit(x, Scratch(5000)), numpy_way(x)
    assert_same(fast, slow)
    assert (fast[3], fast[4]) == ((2, 0) if special != special else (0, 2))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,axes", [((64, 4096), (1,)), ((3, 1000), (1,)), ((7, 129), (1,)), ((5, 1), (1,)),
                                        ((4, 30, 100), (1, 2)), ((2, 3, 5, 7), (1, 2, 3)), ((1, 20_011), (1,))])
def test_per_row_sums_are_numpys(dtype, shape, axes, copies):
    x = random_values(dtype, math.prod(shape), seed=sum(shape), spread=20).reshape(shape)
    assert kernels._reduce_fused_rows(x, True) is not None
    fast, slow = reduce_unit(x, Scratch(x.size), axes=axes), numpy_way(x, axes=axes)
    assert fast[0].shape == slow[0].shape and fast[0].dtype == slow[0].dtype
    assert fast[0].tobytes() == slow[0].tobytes()
    assert_same(fast[1:], slow[1:])
    assert_same(reduce_unit(x, Scratch(x.size), axes=axes, extremes=False)[1:],
                numpy_way(x, axes=axes, extremes=False)[1:])


def test_per_row_sums_leave_other_axes_and_nan_to_numpy():
    x = random_values(np.float32, 4 * 30 * 100, seed=1).reshape(4, 30, 100)
    for axes in [(0,), (2,), (0, 1)]:  # not "every axis but the first": NumPy's order, NumPy's way
        fast, slow = reduce_unit(x, Scratch(x.size), axes=axes), numpy_way(x, axes=axes)
        assert fast[0].tobytes() == slow[0].tobytes()
    x[2, 5, 7] = np.nan
    assert kernels._reduce_fused_rows(x, True) is None
    fast, slow = reduce_unit(x, Scratch(x.size), axes=(1, 2)), numpy_way(x, axes=(1, 2))
    assert fast[0].tobytes() == slow[0].tobytes() and fast[3] == slow[3] == 1


def test_huge_float32_squares_overflowing_go_the_numpy_way():
    x = np.array([3e38, -3e38, 1.0], np.float32)  # finite values, squares that overflow float64? no: 9e76
    assert_same(reduce_unit(x, Scratch(3)), numpy_way(x))
    y = np.array([1e200, 1e200], np.float64)  # squares overflow float64: Inf sum, no Inf value
    assert not uses_fused(y)
    assert_same(reduce_unit(y, Scratch(2)), numpy_way(y))


def test_shapes_and_layouts():
    x = random_values(np.float32, 64 * 50, seed=9).reshape(64, 50)
    assert uses_fused(x)
    assert_same(reduce_unit(x, Scratch(x.size)), numpy_way(x))
    column = x[:, 3]  # not contiguous: NumPy's way
    assert not uses_fused(column)
    big_endian = x.astype(">f4")
    assert not uses_fused(big_endian)
    assert_same(reduce_unit(big_endian, Scratch(x.size)), numpy_way(x))
    # per-slice sums, L1 and moments stay NumPy's
    assert_same(reduce_unit(x, Scratch(x.size), axes=(1,))[1:], numpy_way(x, axes=(1,))[1:])


def test_rows_checked_first_in_a_fresh_process():
    """fused_rows() before anything else has asked for the chunk (a --axes run's first unit):
    it used to wait forever on its own lock."""
    import subprocess
    import sys

    code = ("import tclip.core.kernels as k, numpy as np\n"
            "x = np.arange(12, dtype=np.float32).reshape(3, 4)\n"
            "print(k.fused_rows(), k.reduce_unit(x, axes=(1,))[0].tolist())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("[")[0].strip() == "True"
    assert "[14.0, 126.0, 366.0]" in done.stdout


def test_the_probe_tells_the_two_orders_apart():
    """fused_chunk's check can fail: on its probes, summing in chunks of 8,192 (older NumPy)
    and in one run give different sums, and the one run is NumPy's here."""
    sums = {}
    for chunk in (1 << 62, 8192):
        sums[chunk] = [kernels._fused.unit_stats(kernels._probe(n).view(np.uint8), 0, chunk)[0]
                       for n in kernels.PROBE_SIZES]
    assert sums[1 << 62] != sums[8192]
    assert sums[1 << 62] == [float(np.add.reduce(kernels._probe(n) ** 2)) for n in kernels.PROBE_SIZES]


def test_a_numpy_that_sums_in_another_order_turns_the_loop_off(monkeypatch):
    monkeypatch.setattr(kernels, "_fused_state", {})
    real = kernels._fused

    class Skewed:  # a C loop that disagrees with NumPy in the last bit
        @staticmethod
        def unit_stats(data, kind, chunk):
            total, low, high = real.unit_stats(data, kind, chunk)
            return math.nextafter(total, math.inf), low, high

    monkeypatch.setattr(kernels, "_fused", Skewed)
    assert kernels.fused_chunk() == 0
    assert not kernels.fused_rows()
    x = random_values(np.float32, 1000, seed=1)
    assert not uses_fused(x)
    assert kernels._reduce_fused_rows(x.reshape(10, 100), True) is None
    monkeypatch.setattr(kernels, "_fused", None)
    expected = reduce_unit(x, Scratch(1000))
    monkeypatch.setattr(kernels, "_fused", Skewed)
    assert_same(reduce_unit(x, Scratch(1000)), expected)


def test_the_loop_rejects_what_it_cannot_read():
    with pytest.raises(ValueError):
        kernels._fused.unit_stats(b"\0\0\0", 1, 8)  # not a whole float32
    with pytest.raises(ValueError):
        kernels._fused.unit_stats(b"\0\0\0\0", 7, 8)  # no such kind
    with pytest.raises(ValueError):
        kernels._fused.unit_stats(b"", 1, 8)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
def test_a_whole_file_report_is_the_same_either_way(tmp_path, dtype, monkeypatch):
    """report_file over a safetensors file of many units, two threads, small blocks: the
    same statistics to the bit with the C loop and without it."""
    from safetensors.numpy import save_file

    from tclip.work.clip import report_file

    tensors = {f"model.layers.{i}.mlp.down_proj.weight": random_values(dtype, 300_000 + 7 * i, seed=i, spread=8)
               .reshape(-1, 1) for i in range(3)}
    path = tmp_path / "grads.safetensors"
    save_file(tensors, str(path))
    runs = {}
    for way in ("C", "NumPy"):
        if way == "NumPy":
            monkeypatch.setattr(kernels, "_fused", None)
        runs[way] = [report_file(path, threads=2, block_bytes=1 << 20),
                     report_file(path, threads=2, block_bytes=1 << 20, axes=1, max_norm=0.5)]
    for fast, slow in zip(runs["C"], runs["NumPy"]):
        assert fast.global_norm == slow.global_norm
        assert [t.to_json() for t in fast.tensors] == [t.to_json() for t in slow.tensors]
        assert fast.tensors[0].to_json()["norm"] > 0


# ------------------------------------------------------------------ the table lookups


@pytest.fixture(params=["C", "NumPy"])
def lookups(request, monkeypatch):
    if request.param == "NumPy":
        monkeypatch.setattr(kernels, "_fused", None)
    return request.param


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("factor", [0.3, 1 / 3, 0.999999, 2.0 ** -20, 1e-300, 0.0, 7.5])
def test_one_factor_through_the_table_every_value(dtype, factor, lookups):
    from tclip.core.kernels import scale_unit
    from tclip.core.modes import apply_scale

    every = np.arange(1 << (8 * np.dtype(dtype).itemsize), dtype=np.uint16 if np.dtype(dtype).itemsize == 2
                      else np.uint8).view(dtype)
    x = np.roll(np.tile(every, 3), 77)  # ordinary values at both ends
    assert scale_unit(x, factor, Scratch(x.size)) is None  # the table path
    assert x.tobytes() == np.roll(np.tile(apply_scale(every, factor), 3), 77).tobytes()


# Per-row factors for float16 and bfloat16 (scale16): besides test_kernel_steps' factors,
# ties at every rounding step (1 + 2**-11 and 1 + 2**-12 for float16's 11 bits, 1 + 2**-8
# and 1 + 2**-24 for bfloat16's double rounding through float32), results that are float16
# subnormals or zero (2**-24, 1.5 * 2**-25), products that are float64 subnormals (1e-310),
# overflow to Inf (1e5, 2**899) and 0.
EDGE_FACTORS = [1 + 2.0 ** -11, 1 + 2.0 ** -12, 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 2.0 ** -24, 1 - 2.0 ** -25,
                2.0 ** -24, 1.5 * 2.0 ** -25, 2.0 ** -25, 1e-310, 5e-324, 1e5, 2.0 ** 899, 0.0, 65519.99 / 65504]


def scale16_calls(monkeypatch):
    """What each call of the C loop returned (the rows it left to NumPy)."""
    calls = []
    real = kernels._fused.scale16

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(kernels._fused, "scale16", spy)
    return calls


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_per_row_scaling_every_finite_value(dtype, copies, monkeypatch):
    calls = scale16_calls(monkeypatch)
    bits = np.arange(1 << 16, dtype=np.uint16)
    field = 0x7C00 if dtype == np.float16 else 0x7F80  # the exponent: all ones for Inf and NaN
    finite = bits[bits & field != field].view(dtype)
    factors = np.array(ROW_FACTORS + EDGE_FACTORS).reshape(-1, 1)
    same_as_reference(np.tile(finite, (len(factors), 1)), factors, Scratch())
    same_as_reference(np.tile(finite[::-1], (len(factors), 1)), factors)
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((300, 1100)) * 3).astype(dtype)
    same_as_reference(x, rng.uniform(0.01, 1, (300, 1)), Scratch())
    assert calls == [0, 0, 0]  # every row in C


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_rows_with_inf_or_nan_are_left_to_numpy(dtype, copies, monkeypatch):
    calls = scale16_calls(monkeypatch)
    every = np.arange(1 << 16, dtype=np.uint16).view(dtype)  # Inf, quiet and signalling NaNs in every row
    factors = np.array([0.3, 1.0, 0.0, 2.0 ** -20]).reshape(-1, 1)
    same_as_reference(np.tile(every, (4, 1)), factors, Scratch())
    x = (np.random.default_rng(3).standard_normal((50, 300)) * 3).astype(dtype)
    x[[4, 17, 18, 49], [0, 299, 5, 100]] = [np.inf, -np.inf, np.nan, np.inf]
    x.view(np.uint16)[30, 7] = 0x7D01 if dtype == np.float16 else 0x7F81  # a signalling NaN, factor 1 below
    factors = np.random.default_rng(4).uniform(0, 1, (50, 1))
    factors[30] = 1.0
    same_as_reference(x, factors)
    assert calls == [4, 5]


def test_per_row_scaling_where_the_fpu_flushes_subnormals(monkeypatch):
    """scale16 answers -1 (nothing done) where this thread's FPU flushes subnormals; then
    NumPy's way is taken."""
    monkeypatch.setattr(kernels._fused, "scale16", lambda *args: -1)
    x = (np.random.default_rng(5).standard_normal((40, 2048)) * 1e-3).astype(np.float16)
    factors = np.random.default_rng(6).uniform(0, 1, (40, 1))
    assert not kernels._scale_rows16_fused(x.copy(), factors, None)
    same_as_reference(x, factors)


def test_the_c_loops_reject_what_they_cannot_read():
    data = np.zeros(10, np.uint16)
    with pytest.raises(ValueError):
        kernels._fused.lookup(data, np.zeros(1000, np.uint16))  # no table of 65,536
    with pytest.raises(TypeError):
        kernels._fused.lookup(b"\0\0", np.zeros(1 << 16, np.uint16))  # not writable
    left = np.zeros(4, np.int64)
    with pytest.raises(ValueError):  # 10 is no whole number of rows of 3
        kernels._fused.scale16(data, 3, 3, np.ones(3), left)
    with pytest.raises(ValueError):  # room for 4 row indices, not 5
        kernels._fused.scale16(data, 3, 2, np.ones(5), left)
    with pytest.raises(ValueError):  # a factor of 2**900
        kernels._fused.scale16(data, 3, 5, np.array([0.5, 2.0 ** 900]), left)
    with pytest.raises(ValueError):  # a NaN factor
        kernels._fused.scale16(data, 2, 5, np.array([0.5, np.nan]), left)
    with pytest.raises(ValueError):  # no float32
        kernels._fused.scale16(data, 1, 5, np.ones(2), left)
    assert data.tobytes() == bytes(20)


def test_more_misses_than_the_limit_change_nothing():
    x = np.zeros((4, 2048), np.float16)  # all zeros: every element a miss
    x[:, ::2] = 1.5
    before = x.copy()
    assert not kernels._scale_rows_by_tables(x, np.full((4, 1), 0.3), Scratch(x.size))
    assert x.tobytes() == before.tobytes()


# ------------------------------------------------------------------ float32 scaling


def float32_specials(n, seed):
    """float32 values of every kind: normal over many binades, subnormal, zeros of both signs,
    Inf, quiet and signalling NaN with payloads, the largest finite."""
    x = random_values(np.float32, n, seed, spread=60)
    bits = x.view(np.uint32)
    bits[3::101] = 0x7F800000  # +Inf
    bits[4::103] = 0xFF800000  # -Inf
    bits[5::107] = 0x7FC01234  # quiet NaN with a payload
    bits[6::109] = 0x7F801234  # signalling NaN
    bits[7::113] = 0xFFA00001  # negative signalling NaN
    bits[8::127] = 0x7F7FFFFF  # the largest finite
    bits[9::131] = 0x00000001  # the smallest subnormal
    return x


@pytest.mark.parametrize("factor", [0.5, 1 / 3, 0.999999, 1.0, 2.0, 3e38, 1e-40, 1e-300, 0.0, -0.0, -1.5,
                                    np.inf, np.nan])
def test_float32_scaled_in_c_as_numpy_scales_it(factor, copies):
    from tclip.core.kernels import scale_unit
    from tclip.core.modes import apply_scale

    x = float32_specials(20_000, seed=4).reshape(40, 500)
    fast, slow = x.copy(), x.copy()
    assert kernels._scale_float32_fused(x.copy(), factor) == (factor == factor)  # C, but for a NaN factor
    scale_unit(fast, factor, Scratch(x.size))
    saved, kernels._fused = kernels._fused, None
    try:
        scale_unit(slow, factor, Scratch(x.size))
    finally:
        kernels._fused = saved
    assert fast.tobytes() == slow.tobytes()
    if factor != 1.0:  # (apply_scale copies a factor of 1: signalling NaNs stay signalling there)
        assert fast.tobytes() == apply_scale(x, factor).tobytes()


def test_float32_per_row_factors_in_c(copies):
    from tclip.core.kernels import scale_unit
    from tclip.core.modes import apply_scale

    x = float32_specials(300 * 77, seed=6).reshape(300, 77)
    factors = np.random.default_rng(8).uniform(0, 2, (300, 1))
    factors[::7] = 1.0
    factors[3] = 0.0
    factors[5] = np.inf
    factors[6] = -0.0
    for shape in [(300, 1), (300, 77)]:
        f = np.broadcast_to(factors, shape) if shape[1] == 77 else factors
        expected = apply_scale(x, f)
        fast = x.copy()
        scale_unit(fast, f, Scratch(x.size))
        assert fast.tobytes() == expected.tobytes()
    cube = x.reshape(300, 7, 11)
    expected = apply_scale(cube, factors.reshape(300, 1, 1))
    fast = cube.copy()
    assert kernels._scale_float32_fused(fast.copy(), factors.reshape(300, 1, 1))
    scale_unit(fast, factors.reshape(300, 1, 1), Scratch(x.size))
    assert fast.tobytes() == expected.tobytes()


def test_float32_layouts_the_c_loop_leaves_to_numpy():
    x = float32_specials(600, seed=7).reshape(20, 30)
    assert not kernels._scale_float32_fused(x[:, ::2], 0.5)  # not contiguous
    assert not kernels._scale_float32_fused(x.astype(">f4"), 0.5)  # big-endian
    assert not kernels._scale_float32_fused(x.copy(), np.full((1, 30), 0.5))  # a factor per column
    with pytest.raises(ValueError):
        kernels._fused.scale_f32(np.zeros(10, np.float32), 3, np.ones(1))
    with pytest.raises(ValueError):
        kernels._fused.scale_f32(np.zeros(10, np.float32), 5, np.ones(3))


def test_the_lookup_on_misaligned_data():
    """A view that starts on an odd byte takes the byte-copy loop: the same results."""
    table = np.arange(1 << 16, dtype=np.uint16)[::-1].copy()
    backing = np.zeros(2 * 1000 + 1, np.uint8)
    data = backing[1:].view(np.uint16)
    assert not data.flags.aligned
    data[:] = np.arange(1000, dtype=np.uint16) * 37
    kernels._fused.lookup(data, table)
    assert data.tolist() == [65535 - (i * 37) for i in range(1000)]


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("columns", [100, 2048])
def test_units_that_start_on_an_odd_byte_scale_per_row_as_the_reference(dtype, columns, copies):
    """A unit NumPy holds at an odd address (np.frombuffer at an offset) is not the C loops'
    to scale (they read aligned elements): another path takes it, with the same bits."""
    from tclip.core.kernels import scale_unit
    from tclip.core.modes import apply_scale

    itemsize = np.dtype(dtype).itemsize
    values = (np.random.default_rng(7).standard_normal((64, columns)) * 3).astype(dtype)
    for factor in (np.random.default_rng(8).uniform(0, 1, (64, 1)), 0.37):
        x = np.frombuffer(bytearray(itemsize * values.size + 1), dtype=dtype, offset=1).reshape(values.shape)
        assert not x.flags.aligned
        x[...] = values
        scale_unit(x, factor, Scratch(x.size))  # in place: a copy would be aligned
        assert x.tobytes() == apply_scale(values, factor).tobytes()
