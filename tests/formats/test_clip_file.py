"""clip_file over every format and mode equals the NumPy core, in any block size."""

from __future__ import annotations

import io

import h5py
import ml_dtypes
import numpy as np
import pytest
from rich.console import Console

from support.formats_helpers import read_all, safetensors_bytes
import tclip
from tclip.cli.render.report import render_file
from tclip.cli.render.table import shorten_middle
from tclip.core.modes import AverageNormClip, GlobalNormClip, NormClip, ValueClip
from tclip.work.clip import clip_file, report_file
from tclip.work.options import ClipOptions
from tclip.work.selection import Selection

RNG = np.random.default_rng(11)
TENSORS = {
    "enc/w": (RNG.standard_normal((6, 5)) * 4).astype(np.float32),
    "enc/b": (RNG.standard_normal(5) * 4).astype(np.float64),
    "dec/w": (RNG.standard_normal((3, 4, 5)) * 4).astype(np.float16),
    "step": np.array(7, np.int64),
}


def write(path, tensors):
    suffix = path.suffix
    if suffix == ".npz":
        np.savez(path, **tensors)
    elif suffix == ".safetensors":
        path.write_bytes(safetensors_bytes(tensors))
    else:
        with h5py.File(path, "w") as f:
            for name, t in tensors.items():
                f.create_dataset(name, data=t, chunks=t.shape if t.ndim and t.size else None)


def expected(mode, tensors):
    floats = {k: v for k, v in tensors.items() if v.dtype != np.int64}
    if isinstance(mode, GlobalNormClip):
        clipped, _ = tclip.clip_by_global_norm(list(floats.values()), mode.clip_norm)
        out = dict(zip(floats, clipped))
    elif isinstance(mode, NormClip):
        out = {k: tclip.clip_by_norm(v, mode.clip_norm, axes=mode.axes) if v.ndim > max(mode.axes or [0]) else v
               for k, v in floats.items()}
    elif isinstance(mode, AverageNormClip):
        out = {k: tclip.clip_by_average_norm(v, mode.clip_norm) for k, v in floats.items()}
    else:
        out = {k: tclip.clip_by_value(v, mode.clip_value_min, mode.clip_value_max) for k, v in floats.items()}
    return {**tensors, **out}


MODES = [
    pytest.param(NormClip(3.0), id="norm"),
    pytest.param(NormClip(2.0, axes=(1,)), id="norm-axes1"),
    pytest.param(NormClip(2.0, axes=(-1,)), id="norm-axes-1"),
    pytest.param(AverageNormClip(0.2), id="average"),
    pytest.param(GlobalNormClip(5.0), id="global"),
    pytest.param(ValueClip(-1.0, 0.5), id="value"),
]


@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".h5"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("two_pass", [False, True], ids=["in-memory", "two-pass"])
def test_clip_file_equals_the_core(tmp_path, suffix, mode, two_pass):
    source = tmp_path / f"g{suffix}"
    write(source, TENSORS)
    report = clip_file(source, mode, ClipOptions(block_bytes=24, hold_bytes=0 if two_pass else 1 << 20))
    got = read_all(tmp_path / f"g.clipped{suffix}")
    want = expected(mode, TENSORS)
    for name, array in want.items():
        assert got[name].dtype == array.dtype, name
        np.testing.assert_array_equal(got[name], array, err_msg=name)
    entries = {t.name: t for t in report.tensors}
    assert entries["step"].skipped == "int64 is not floating-point"
    for name in TENSORS:
        if entries[name].skipped is None:
            assert entries[name].norm == pytest.approx(tclip.global_norm([TENSORS[name]]), rel=1e-12)
            assert entries[name].norm_after == pytest.approx(tclip.global_norm([got[name]]), rel=1e-12)


def test_bfloat16_global_clip(tmp_path):
    t = {"a": (RNG.standard_normal((10, 10)) * 5).astype(ml_dtypes.bfloat16), "b": np.ones(3, np.float32)}
    source = tmp_path / "g.safetensors"
    write(source, t)
    report = clip_file(source, GlobalNormClip(1.0))
    assert report.global_norm == pytest.approx(tclip.global_norm(list(t.values())), rel=1e-12)
    got = read_all(tmp_path / "g.clipped.safetensors")
    want, _ = tclip.clip_by_global_norm(list(t.values()), 1.0)
    np.testing.assert_array_equal(got["a"], want[0])
    assert report.global_norm_after == pytest.approx(tclip.global_norm([got["a"], got["b"]]), rel=1e-12)


def test_exclude_leaves_tensor_byte_identical(tmp_path):
    source = tmp_path / "g.safetensors"
    write(source, TENSORS)
    clip_file(source, NormClip(0.1), ClipOptions(selection=Selection(exclude=("enc/*",))))
    got = read_all(tmp_path / "g.clipped.safetensors")
    assert got["enc/w"].tobytes() == TENSORS["enc/w"].tobytes()
    assert not np.array_equal(got["dec/w"], TENSORS["dec/w"])


def test_report_file_slice_norms(tmp_path):
    source = tmp_path / "g.npz"
    write(source, TENSORS)
    report = report_file(source, axes=(1,))
    entries = {t.name: t for t in report.tensors}
    rows = np.sqrt(np.sum(TENSORS["enc/w"].astype(np.float64) ** 2, axis=1))
    assert entries["enc/w"].max_slice_norm == pytest.approx(rows.max(), rel=1e-12)
    assert entries["enc/b"].skipped == "rank 1 has no axis 1"


# ------------------------------------------------------------------ rendering


def render(report, width=100):
    console = Console(file=io.StringIO(), width=width, color_system=None)
    render_file(report, console)
    return console.file.getvalue()


def test_rendered_report_in_a_fixed_width_console(tmp_path):
    long_name = "model.encoder.layers.11.attention.self.query_key_value.weight"
    t = {long_name: np.full((4, 4), 10.0, np.float32), "small": np.full(3, 0.001, np.float32)}
    source = tmp_path / "g.npz"
    write(source, t)
    text = render(clip_file(source, NormClip(5.0)))
    lines = text.splitlines()
    assert lines[0] == f"{source} → {tmp_path / 'g.clipped.npz'}"  # paths are never folded
    assert all(len(line) <= 100 for line in lines[1:])
    # Issue 8: a name is shown whole when other columns can give way (the bar first) ...
    row = next(line for line in lines if line.startswith("model."))
    assert row.split()[0] == long_name and "40" in row and "×0.125" in row and "█" not in row
    # ... and when it must be shortened, what tells it apart stays.
    narrow_row = next(line for line in render(clip_file(source, NormClip(5.0), ClipOptions(dry_run=True)),
                                               width=60).splitlines() if line.startswith("model."))
    shown_name = narrow_row.split()[0]
    assert "…" in shown_name and "layers.11" in shown_name and shown_name.endswith("query_key_value.weight")
    assert "global norm 40 → 5" in text
    assert "1 clipped  ·  0 skipped" in text
    wide = render(clip_file(source, NormClip(5.0), ClipOptions(overwrite=True)), width=160)
    row = next(line for line in wide.splitlines() if line.startswith("model."))
    assert row.split()[0] == long_name and "float32" in row and "█" in row  # room for all: nothing cut
    narrow = render(clip_file(source, NormClip(5.0), ClipOptions(overwrite=True)), width=80)
    assert all(len(line) <= 80 for line in narrow.splitlines()[1:])
    header = next(line for line in narrow.splitlines() if line.startswith("tensor"))
    assert header.rstrip().endswith("NaN/Inf")  # nothing cropped at the right edge; the bar gave way


def test_shorten_middle_keeps_both_ends():
    name = "a" * 30 + "MIDDLE" + "z" * 30
    short = shorten_middle(name, 40)
    assert len(short) == 40 and short.startswith("aaaa") and short.endswith("zzzz") and "…" in short
    assert shorten_middle("short", 40) == "short"


def test_value_clip_counts_changes_but_not_nans(tmp_path):
    source = tmp_path / "g.npz"
    np.savez(source, t=np.array([np.nan, -5.0, 0.5, 7.0, np.nan], np.float32))
    report = clip_file(source, ValueClip(-1.0, 1.0), ClipOptions(nonfinite="propagate", block_bytes=8))
    (entry,) = report.tensors
    assert entry.changed == 2 and entry.nan == 2
    got = read_all(tmp_path / "g.clipped.npz")["t"]
    np.testing.assert_array_equal(got, [np.nan, -1.0, 0.5, 1.0, np.nan])


@pytest.mark.parametrize("suffix", [".npy", ".safetensors", ".npz", ".h5"])
def test_file_within_the_limit_comes_back_byte_identical(tmp_path, suffix):
    source = tmp_path / f"g{suffix}"
    tensors = {"w": np.asfortranarray((RNG.standard_normal((5, 7)) * 0.01).astype(np.float32))}
    if suffix == ".npy":
        np.save(source, tensors["w"])
    else:
        write(source, {"w": np.ascontiguousarray(tensors["w"]), "step": np.array(3, np.int64)})
    report = clip_file(source, GlobalNormClip(1000.0))
    assert report.clipped_count == 0 and report.global_norm_after == report.global_norm
    output = tmp_path / f"g.clipped{suffix}"
    if suffix in (".npy", ".safetensors", ".npz"):
        assert output.read_bytes() == source.read_bytes()
    else:
        got = read_all(output)
        assert got["w"].tobytes() == np.ascontiguousarray(tensors["w"]).tobytes()


@pytest.mark.parametrize("axes", [None, (0,), (1,), (0, 2)])
def test_fortran_order_npy_clips_like_the_core(tmp_path, axes):
    t = np.asfortranarray((RNG.standard_normal((6, 5, 4)) * 3).astype(np.float32))
    source = tmp_path / "f.npy"
    np.save(source, t)
    clip_file(source, NormClip(2.0, axes=axes), ClipOptions(block_bytes=40))
    out = np.load(tmp_path / "f.clipped.npy")
    assert out.flags.f_contiguous and not out.flags.c_contiguous
    np.testing.assert_array_equal(out, tclip.clip_by_norm(t, 2.0, axes=axes))
