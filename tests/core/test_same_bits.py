"""The kernels against the whole-array core, exact sums and the unit grid, and the same bits for every
thread count and --memory (the pass driver, work/passes.py); start-up imports."""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.formats_helpers import read_all, safetensors_bytes
from support.kernels import random_values
import tclip
from tclip.cli.words import flag
from tclip.core.exact import ExactSum
from tclip.core.kernels import Scratch, clip_unit, reduce_unit, scale_unit
from tclip.core.modes import (
    AverageNormClip,
    GlobalNormClip,
    NormClip,
    ValueClip,
    apply_scale,
    clip_values,
)
from tclip.core.stats import TensorStats
from tclip.core.units import UNIT_ELEMENTS, UnitGrid
from tclip.work.clip import clip_file, report_file
from tclip.work.options import ClipOptions
from tclip.work.statistics import file_statistics
from tclip.work.budget import Budget

FLOATS = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


# ------------------------------------------------------------------ kernels against the reference


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("factor", [0.3, 1 / 3, 0.999999, 2.0 ** -20, 1e-300, 0.0])
def test_scale_kernel_equals_apply_scale(dtype, factor):
    x = random_values(dtype, 5000, seed=1)
    fast = x.copy()
    wide = scale_unit(fast, factor, Scratch(5000))
    reference = apply_scale(x, factor)
    assert fast.dtype == reference.dtype
    assert fast.tobytes() == reference.tobytes()
    if wide is not None:  # the float64 values handed to the after-statistics are those written
        assert wide.tobytes() == fast.astype(np.float64).tobytes()


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_per_slice_scale_kernel_equals_apply_scale(dtype):
    x = random_values(dtype, 60 * 50, seed=2).reshape(60, 50)
    factors = np.random.default_rng(3).uniform(0, 1, (60, 1))
    fast = x.copy()
    scale_unit(fast, factors)
    assert fast.tobytes() == apply_scale(x, factors).tobytes()


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_value_kernel_equals_clip_values(dtype):
    x = random_values(dtype, 4000, seed=4, spread=6)
    lo, hi = np.array(-1.5, dtype), np.array(2.25, dtype)
    fast = x.copy()
    changed, wide = clip_unit(fast, float(lo), float(hi))
    assert wide.tobytes() == fast.astype(np.float64).tobytes()
    reference = clip_values(x, lo, hi)
    assert fast.tobytes() == reference.tobytes()
    assert changed == int(np.count_nonzero(reference.astype(np.float64) != x.astype(np.float64)))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_statistics_kernel_matches_float64_arithmetic(dtype):
    x = random_values(dtype, 3000, seed=5, spread=8)
    x[7], x[9] = np.nan, np.inf
    sum_sq, smallest, largest, nans, infs, _ = reduce_unit(x)
    wide = x.astype(np.float64)
    finite = wide[np.isfinite(wide)]
    assert math.isnan(sum_sq)
    assert (nans, infs) == (int(np.isnan(wide).sum()), int(np.isinf(wide).sum()))  # float8_e4m3fn has no Inf
    assert (smallest, largest) == (float(np.nanmin(wide)), float(np.nanmax(wide)))
    clean = x.copy()
    clean[7] = clean[9] = 0
    exact = math.fsum((finite.astype(np.float64) ** 2).tolist())
    assert reduce_unit(clean)[0] == pytest.approx(exact, rel=1e-12)


# ------------------------------------------------------------------ exact sums and the unit grid


@settings(max_examples=100)
@given(st.lists(st.floats(0, 1e300), min_size=1, max_size=40), st.randoms(use_true_random=False))
def test_exact_sum_is_independent_of_order(values, random):
    a, b = ExactSum(), ExactSum()
    for v in values:
        a.add(v)
    shuffled = list(values)
    random.shuffle(shuffled)
    half = len(shuffled) // 2
    c = ExactSum()
    for v in shuffled[:half]:
        b.add(v)
    for v in shuffled[half:]:
        c.add(v)
    b.merge(c)
    assert a.value == b.value == math.fsum(values)


@settings(max_examples=200)
@given(st.lists(st.integers(0, 40), min_size=0, max_size=4), st.integers(1, 5000))
def test_units_tile_the_tensor_in_storage_order(shape, unit):
    grid = UnitGrid.of(tuple(shape), unit)
    whole = np.arange(math.prod(shape)).reshape(shape)
    position = 0
    for k in range(grid.count):
        start, stop = grid.bounds(k)
        assert start == position and 0 < stop - start <= max(unit, 1)
        index = grid.index(k)
        extent = math.prod(s.stop - s.start for s in index)
        assert extent == stop - start
        flat = whole[index].reshape(-1)
        assert flat[0] == start and flat[-1] == stop - 1
        position = stop
    assert position == math.prod(shape)
    covered = [grid.span(a, b) for a, b in grid.blocks(3 * unit)]
    assert [c[0] for c in covered[1:]] == [c[1] for c in covered[:-1]]


# ------------------------------------------------------------------ the same bits for any budget


def _file(tmp_path, dtype, shape=(300, 700)):
    rng = np.random.default_rng(9)
    tensors = {
        "model.layers.0.w": (rng.standard_normal(shape) * 3).astype(dtype),
        "model.layers.1.w": (rng.standard_normal((shape[0] * shape[1] + 123,)) * 0.01).astype(dtype),
        "model.layers.1.b": (rng.standard_normal((3, 5, 7)) * 5).astype(dtype),
        "step": np.array(41200, np.int64),
    }
    path = tmp_path / "g.safetensors"
    path.write_bytes(safetensors_bytes(tensors))
    return path, tensors


BUDGETS = [dict(threads=1), dict(threads=2), dict(threads=5), dict(threads=3, block_bytes=1),
           dict(threads=2, memory=16 << 20), dict(threads=1, block_bytes=UNIT_ELEMENTS * 3)]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.float64],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("mode", [GlobalNormClip(1.0), NormClip(2.0, axes=(-1,)), NormClip(0.5, axes=(0,)),
                                  AverageNormClip(1e-4), ValueClip(-0.01, 0.02)], ids=str)
def test_every_thread_count_and_memory_gives_the_same_bytes(tmp_path, dtype, mode):
    source, tensors = _file(tmp_path, dtype)
    outputs = []
    for i, budget in enumerate(BUDGETS):
        out = tmp_path / f"out{i}.safetensors"
        report = clip_file(source, mode, ClipOptions(output=out, **budget))
        outputs.append((out.read_bytes(), report.global_norm, [t.norm_after for t in report.tensors]))
    assert all(o == outputs[0] for o in outputs[1:])
    got = read_all(tmp_path / "out0.safetensors")
    if isinstance(mode, GlobalNormClip):
        floats = [v for v in tensors.values() if v.dtype != np.int64]
        want, _ = tclip.clip_by_global_norm(floats, 1.0)
        for name, array in zip([k for k in tensors if k != "step"], want):
            assert got[name].tobytes() == array.tobytes()


def test_report_statistics_do_not_depend_on_the_budget(tmp_path):
    source, _ = _file(tmp_path, np.float32)
    first = report_file(source, axes=(1,), moments=True, threads=1).to_json()
    for budget in BUDGETS[1:]:
        other = report_file(source, axes=(1,), moments=True, threads=budget.get("threads", 0),
                            memory=budget.get("memory", Budget.memory), block_bytes=budget.get("block_bytes"))
        again = other.to_json()
        for key in ("bytes_read", "elapsed_s"):
            again[key] = first[key]
        assert again == first


def test_file_pipeline_equals_the_core_for_a_tensor_larger_than_many_units(tmp_path):
    rng = np.random.default_rng(12)
    t = (rng.standard_normal(5 * UNIT_ELEMENTS + 17) * 7).astype(np.float32)
    path = tmp_path / "big.npy"
    np.save(path, t)
    stats = file_statistics(path, budget=Budget(threads=3, block_bytes=UNIT_ELEMENTS * 4))
    assert stats.stats["big"].total_sum_of_squares == TensorStats.of(t).total_sum_of_squares
    clip_file(path, NormClip(10.0), ClipOptions(threads=3, block_bytes=UNIT_ELEMENTS * 4))
    assert np.load(tmp_path / "big.clipped.npy").tobytes() == tclip.clip_by_norm(t, 10.0).tobytes()


def test_memory_budget_sizes_blocks_and_threads():
    threads, inflight, block = Budget(memory=256 << 20, threads=16).layout(4)
    assert threads == 16 and inflight == 18
    assert inflight * block + threads * UNIT_ELEMENTS * Scratch.BYTES_PER_ELEMENT <= 256 << 20
    threads, inflight, block = Budget(memory=16 << 20, threads=64).layout(8)
    assert inflight * block + threads * UNIT_ELEMENTS * Scratch.BYTES_PER_ELEMENT <= 16 << 20
    assert threads < 64  # fewer threads rather than more memory


def test_per_slice_statistics_beyond_the_budget_are_refused(tmp_path):
    path = tmp_path / "tall.npy"
    np.save(path, np.ones((600_000, 2), np.float32))
    from tclip.errors import TclipError

    with pytest.raises(TclipError) as refused:  # the command line names the option as its flag
        clip_file(path, NormClip(1.0, axes=(1,)), ClipOptions(memory=16 << 20, dry_run=True))
    assert re.search("per-slice statistics of 600,000 slices need .* raise --memory", refused.value.spelled(flag))
    report = clip_file(path, NormClip(1.0, axes=(1,)), ClipOptions(memory=128 << 20, dry_run=True))
    assert report.tensors[0].slices == 600_000


def test_float16_conversions_match_numpy_on_every_value_and_midpoint():
    from tclip.core.kernels import narrow_into, widen

    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    wide = widen(every)
    reference = every.astype(np.float64)
    same = (wide.view(np.uint64) == reference.view(np.uint64)) | (np.isnan(wide) & np.isnan(reference))
    assert same.all()
    values = np.unique(reference[np.isfinite(reference)])
    middles = (values[:-1] + values[1:]) / 2
    rng = np.random.default_rng(16)
    tests = np.concatenate([values, middles, np.nextafter(middles, np.inf), np.nextafter(middles, -np.inf),
                            *(rng.standard_normal(200_000) * s for s in (1e-9, 3e-8, 6e-5, 1e-3, 1, 3e4)),
                            [65504.0, 65519.99, 65520.0, 65536.0, 1e300, np.inf, -np.inf, np.nan, -0.0, 1e-300]])
    out = np.empty(tests.size, np.float16)
    narrow_into(tests.copy(), out)  # (it may overwrite its input)
    with np.errstate(over="ignore"):
        reference = tests.astype(np.float16)
    assert ((out.view(np.uint16) == reference.view(np.uint16)) | np.isnan(tests)).all()
    finite = tests[np.abs(tests) < 32768]  # below the overflow check: the exact values written come back
    wide, out = finite.copy(), np.empty(finite.size, np.float16)
    assert narrow_into(wide, out)
    assert (wide.view(np.uint64) == out.astype(np.float64).view(np.uint64)).all()  # signs of zero too


def test_bfloat16_conversions_match_ml_dtypes_on_every_value_and_midpoint():
    from tclip.core.kernels import narrow_into, widen

    every = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    wide = widen(every)
    with np.errstate(invalid="ignore"):  # signalling NaNs
        reference = every.astype(np.float64)
    same = (wide.view(np.uint64) == reference.view(np.uint64)) | (np.isnan(wide) & np.isnan(reference))
    assert same.all()
    values = np.unique(reference[np.isfinite(reference)])
    middles = (values[:-1] + values[1:]) / 2
    rng = np.random.default_rng(17)
    tests = np.concatenate([values, middles, np.nextafter(middles, np.inf), np.nextafter(middles, -np.inf),
                            *(rng.standard_normal(200_000) * s for s in (1e-40, 1e-38, 1e-3, 1, 1e30, 1e38)),
                            [3.3895313892515355e38, 3.3961775292304744e38, 3.4e38, 1e300, np.inf, -np.inf,
                             np.nan, -0.0, 1e-300, -1e-300, 2.0 ** -134, 2.0 ** -133 * 1.5]])
    out = np.empty(tests.size, ml_dtypes.bfloat16)
    narrow_into(tests.copy(), out)
    with np.errstate(over="ignore", invalid="ignore"):
        reference = tests.astype(ml_dtypes.bfloat16)
    assert ((out.view(np.uint16) == reference.view(np.uint16)) | np.isnan(tests)).all()


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["norm", "--help"], ["report", "--help"],
                                  ["diff", "--help"], ["complete"]])
def test_start_up_imports_no_numpy_rich_or_format_library(args):
    import json as _json
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    if args == ["complete"]:
        env.update({"_TCLIP_COMPLETE": "bash_complete", "COMP_WORDS": "tclip no", "COMP_CWORD": "1"})
        args = []
    code = ("import sys, json\n"
            f"sys.argv = ['tclip', *{args!r}]\n"
            "from tclip.cli.entry import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'rich', 'h5py', 'safetensors', "
            "'ml_dtypes', 'hdf5plugin'})\n"
            "print(json.dumps(heavy), file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert _json.loads(result.stderr.strip().splitlines()[-1]) == []
