"""The format layer: round trips, what survives a rewrite, conversions, other libraries."""

from __future__ import annotations

import os
import zipfile

import h5py
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from safetensors import deserialize, safe_open
from safetensors.numpy import load_file, save_file

from support.formats_helpers import read_all, rewrite, safetensors_bytes
from tclip.cli.words import flag
from tclip.errors import OutputExistsError, TclipError, UnsupportedError
from tclip.formats import create_writer, detect_format, open_reader

NUMPY_DTYPES = ["float64", "float32", "float16", "int8", "int16", "int32", "int64", "uint8", "uint16",
                "uint32", "uint64", "bool"]
ML_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
             "float8_e5m2": ml_dtypes.float8_e5m2}


def make_array(dtype_name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype_name == "bool":
        return rng.random(shape) < 0.5
    dtype = ML_DTYPES.get(dtype_name, dtype_name)
    if np.issubdtype(np.dtype(dtype), np.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), shape, endpoint=True).astype(dtype)
    return (rng.standard_normal(shape) * 100).astype(dtype)


shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=7)
hypo = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------ round trips per format


@hypo
@given(shape=shapes, dtype=st.sampled_from(NUMPY_DTYPES), fortran=st.booleans(), big=st.booleans())
def test_npy_round_trip_is_byte_identical(tmp_path, shape, dtype, fortran, big):
    array = make_array(dtype, shape)
    if big:
        array = array.astype(array.dtype.newbyteorder(">"))
    if fortran:
        array = np.asfortranarray(array)
    source, target = tmp_path / "a.npy", tmp_path / "out.npy"
    np.save(source, array)
    rewrite(source, target, overwrite=True)
    assert target.read_bytes() == source.read_bytes()
    loaded = np.load(target, allow_pickle=False)
    assert loaded.dtype == array.dtype and loaded.shape == array.shape
    np.testing.assert_array_equal(loaded, array)
    (got,) = read_all(source).values()
    np.testing.assert_array_equal(got, array)


@hypo
@given(shapes=st.lists(shapes, min_size=1, max_size=4), dtype=st.sampled_from(NUMPY_DTYPES),
       compressed=st.booleans())
def test_npz_round_trip_keeps_members_order_and_compression(tmp_path, shapes, dtype, compressed):
    arrays = {f"t{len(shapes) - i}": make_array(dtype, s, i) for i, s in enumerate(shapes)}
    source, target = tmp_path / "a.npz", tmp_path / "out.npz"
    (np.savez_compressed if compressed else np.savez)(source, **arrays)
    rewrite(source, target, overwrite=True)
    with zipfile.ZipFile(source) as a, zipfile.ZipFile(target) as b:
        assert [i.filename for i in a.infolist()] == [i.filename for i in b.infolist()]
        assert [i.compress_type for i in a.infolist()] == [i.compress_type for i in b.infolist()]
    with np.load(target, allow_pickle=False) as loaded:
        assert list(loaded.keys()) == list(arrays)
        for name, array in arrays.items():
            assert loaded[name].dtype == array.dtype
            np.testing.assert_array_equal(loaded[name], array)
    assert target.read_bytes() == source.read_bytes()


@hypo
@given(shapes=st.lists(shapes, min_size=1, max_size=4),
       dtype=st.sampled_from(NUMPY_DTYPES + list(ML_DTYPES)))
def test_safetensors_round_trip_is_byte_identical(tmp_path, shapes, dtype):
    arrays = {f"layer{i}.weight": make_array(dtype, s, i) for i, s in enumerate(shapes)}
    source, target = tmp_path / "a.safetensors", tmp_path / "out.safetensors"
    source.write_bytes(safetensors_bytes(arrays, metadata={"format": "np", "step": "41200"}))
    rewrite(source, target, overwrite=True)
    assert target.read_bytes() == source.read_bytes()
    got = read_all(target)
    for name, array in arrays.items():
        assert got[name].dtype == array.dtype
        np.testing.assert_array_equal(got[name], array)


def test_safetensors_written_by_numpy_api_reads_exactly(tmp_path):
    arrays = {"w": make_array("float32", (3, 4)), "b": make_array("float16", (4,)), "step": np.array(7, np.int64)}
    path = tmp_path / "np.safetensors"
    save_file(arrays, str(path), metadata={"note": "from safetensors.numpy"})
    with open_reader(path) as reader:
        assert reader.metadata == {"note": "from safetensors.numpy"}
        for name, array in arrays.items():
            np.testing.assert_array_equal(reader.read(name), array)


def test_safetensors_output_is_valid_for_the_library(tmp_path):
    arrays = {"bf": make_array("bfloat16", (2, 3)), "f8": make_array("float8_e4m3fn", (5,)),
              "f32": make_array("float32", (4, 4)), "flag": make_array("bool", (3,))}
    source = tmp_path / "src.npz"
    # .npz cannot hold bfloat16: build the source as safetensors, convert to .h5-free formats below
    st_source = tmp_path / "src.safetensors"
    st_source.write_bytes(safetensors_bytes(arrays))
    target = tmp_path / "copy.safetensors"
    rewrite(st_source, target, block_bytes=8)
    parsed = dict(deserialize(target.read_bytes()))
    assert set(parsed) == set(arrays)
    for name, array in arrays.items():
        assert bytes(parsed[name]["data"]) == array.tobytes()
    with safe_open(str(target), "np") as f:
        np.testing.assert_array_equal(f.get_tensor("f32"), arrays["f32"])
    del source


def _h5_source(path):
    with h5py.File(path, "w") as f:
        f.attrs["framework"] = "jax"
        f.attrs["step"] = np.int64(41200)
        encoder = f.create_group("encoder/layer0")
        encoder.attrs["kind"] = np.bytes_("dense")
        w = encoder.create_dataset("weight", data=make_array("float32", (16, 8)), chunks=(4, 8),
                                   compression="gzip", compression_opts=6, shuffle=True, fillvalue=1.5)
        w.attrs["units"] = "grad"
        encoder.create_dataset("bias", data=make_array("float16", (8,)))
        f.create_dataset("labels", data=np.array([b"cat", b"dog"]))
        f.create_dataset("pairs", data=np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]))
        f.create_dataset("step", data=np.int64(3))
        f["alias"] = h5py.SoftLink("/encoder/layer0/weight")


def test_hdf5_round_trip_keeps_tree_attributes_and_layout(tmp_path):
    source, target = tmp_path / "a.h5", tmp_path / "out.h5"
    _h5_source(source)
    with open_reader(source) as reader:
        assert list(reader.tensors) == ["encoder/layer0/bias", "encoder/layer0/weight", "step"]
    rewrite(source, target, block_bytes=40)
    with h5py.File(source, "r") as a, h5py.File(target, "r") as b:
        assert dict(a.attrs) == dict(b.attrs)
        assert b["encoder/layer0"].attrs["kind"] == b"dense"
        w_a, w_b = a["encoder/layer0/weight"], b["encoder/layer0/weight"]
        assert (w_b.chunks, w_b.compression, w_b.compression_opts, w_b.shuffle, w_b.fillvalue) == \
            (w_a.chunks, w_a.compression, w_a.compression_opts, w_a.shuffle, w_a.fillvalue)
        assert w_b.attrs["units"] == "grad"
        np.testing.assert_array_equal(w_a[()], w_b[()])
        assert list(b["labels"][()]) == [b"cat", b"dog"]
        assert b["pairs"].dtype == a["pairs"].dtype and b["pairs"][0]["b"] == 2.0
        assert b.get("alias", getlink=True).path == "/encoder/layer0/weight"
        assert b["step"][()] == 3
        np.testing.assert_array_equal(b["encoder/layer0/bias"][()], a["encoder/layer0/bias"][()])


def test_hdf5_reads_follow_chunks(tmp_path):
    source = tmp_path / "a.h5"
    _h5_source(source)
    with open_reader(source) as reader:
        blocks = list(reader.blocks("encoder/layer0/weight"))
    assert len(blocks) == 4 and blocks[0] == (slice(0, 4), slice(0, 8))


# ------------------------------------------------------------------ conversions


@pytest.mark.parametrize("source_suffix", [".npz", ".safetensors", ".h5"])
@pytest.mark.parametrize("target_suffix", [".npz", ".safetensors", ".h5"])
def test_conversion_keeps_names_and_values(tmp_path, source_suffix, target_suffix):
    arrays = {"fc1/weight": make_array("float32", (5, 3)), "fc1/bias": make_array("float64", (3,)),
              "step": np.array(12, np.int64)}
    source = tmp_path / f"src{source_suffix}"
    if source_suffix == ".npz":
        np.savez(source, **arrays)
    elif source_suffix == ".safetensors":
        save_file(arrays, str(source), metadata={"origin": "test"})
    else:
        with h5py.File(source, "w") as f:
            for name, array in arrays.items():
                f[name] = array
    target = tmp_path / f"out{target_suffix}"
    rewrite(source, target)
    got = read_all(target)
    assert set(got) == set(arrays)
    for name, array in arrays.items():
        assert got[name].dtype == array.dtype
        np.testing.assert_array_equal(got[name], array)
    if source_suffix == ".safetensors" and target_suffix == ".h5":
        with h5py.File(target, "r") as f:
            assert f.attrs["origin"] == "test"


def test_big_endian_npy_to_safetensors_becomes_little_endian(tmp_path):
    array = np.arange(6, dtype=">f4").reshape(2, 3)
    np.save(tmp_path / "be.npy", array)
    rewrite(tmp_path / "be.npy", tmp_path / "le.safetensors")
    loaded = load_file(str(tmp_path / "le.safetensors"))
    np.testing.assert_array_equal(loaded["be"], array)


def test_fortran_npy_to_safetensors(tmp_path):
    array = np.asfortranarray(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    np.save(tmp_path / "f.npy", array)
    rewrite(tmp_path / "f.npy", tmp_path / "c.safetensors", block_bytes=16)
    np.testing.assert_array_equal(load_file(str(tmp_path / "c.safetensors"))["f"], array)


def test_fortran_deflated_npz_to_safetensors(tmp_path):
    array = np.asfortranarray(np.arange(60, dtype=np.float32).reshape(3, 4, 5))
    np.savez_compressed(tmp_path / "f.npz", m=array)
    rewrite(tmp_path / "f.npz", tmp_path / "c.safetensors", block_bytes=16)
    np.testing.assert_array_equal(load_file(str(tmp_path / "c.safetensors"))["m"], array)


@pytest.mark.parametrize("suffix,message", [
    (".npz", ".npy cannot record the dtype bfloat16"),
    (".h5", "HDF5 has no bfloat16 type"),
])
def test_bfloat16_to_formats_that_cannot_hold_it(tmp_path, suffix, message):
    source = tmp_path / "bf.safetensors"
    source.write_bytes(safetensors_bytes({"w": make_array("bfloat16", (2,))}))
    with pytest.raises(UnsupportedError, match=message):
        rewrite(source, tmp_path / f"out{suffix}")
    assert os.listdir(tmp_path) == ["bf.safetensors"]


def test_many_tensors_to_npy_is_refused(tmp_path):
    np.savez(tmp_path / "two.npz", a=np.zeros(2), b=np.zeros(2))
    with pytest.raises(UnsupportedError, match="holds exactly one tensor"):
        rewrite(tmp_path / "two.npz", tmp_path / "one.npy")


# ------------------------------------------------------------------ detection and safe writing


def test_detection_by_content_then_suffix(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros(2))
    os.rename(tmp_path / "x.npy", tmp_path / "renamed.bin")
    assert detect_format(tmp_path / "renamed.bin") == "npy"
    save_file({"a": np.zeros(2)}, str(tmp_path / "s.data"))
    assert detect_format(tmp_path / "s.data") == "safetensors"
    with h5py.File(tmp_path / "h.dat", "w", userblock_size=512) as f:
        f["x"] = np.zeros(2)
    assert detect_format(tmp_path / "h.dat") == "hdf5"


def test_existing_output_is_refused_and_untouched(tmp_path):
    np.save(tmp_path / "a.npy", np.ones(3))
    (tmp_path / "out.npy").write_bytes(b"keep me")
    with pytest.raises(OutputExistsError) as refused:
        rewrite(tmp_path / "a.npy", tmp_path / "out.npy")
    assert "pass --force" in refused.value.spelled(flag)  # as the command line says it
    assert (tmp_path / "out.npy").read_bytes() == b"keep me"


def test_failure_midway_leaves_nothing(tmp_path):
    np.savez(tmp_path / "a.npz", a=np.ones(100), b=np.ones(100))
    with open_reader(tmp_path / "a.npz") as reader:
        writer = create_writer(tmp_path / "out.npz", reader)
        with pytest.raises(RuntimeError):
            with writer:
                writer.write("a", (slice(0, 100),), reader.read("a"))
                raise RuntimeError("interrupted")
    assert sorted(os.listdir(tmp_path)) == ["a.npz"]


def test_rewrite_in_place_keeps_permissions(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"a": np.ones(3, np.float32)}, str(path))
    os.chmod(path, 0o640)
    rewrite(path, path, overwrite=True)
    assert (os.stat(path).st_mode & 0o777) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors"]


def test_unknown_output_suffix(tmp_path):
    np.save(tmp_path / "a.npy", np.ones(3))
    with pytest.raises(TclipError, match="unknown output format"):
        rewrite(tmp_path / "a.npy", tmp_path / "out.txt")


def test_hdf5_clip_keeps_references_dimension_scales_and_order(tmp_path):
    from tclip.core.modes import NormClip
    from tclip.work.clip import clip_file

    source = tmp_path / "g.h5"
    with h5py.File(source, "w", track_order=True) as f:
        steps = f.create_dataset("steps", data=np.arange(4.0))
        steps.make_scale("steps")
        grad = f.create_dataset("grad", data=np.full((4, 3), 10.0, np.float32), chunks=(2, 3),
                                compression="lzf", fletcher32=True, maxshape=(None, 3))
        grad.dims[0].attach_scale(steps)
        grad.attrs["source"] = steps.ref
        f["float_type"] = np.dtype("f4")
        f.create_dataset("b_after_a", data=np.ones(2, np.float32))
    report = clip_file(source, NormClip(1.0))
    assert [t.name for t in report.tensors] == ["grad", "b_after_a"]  # the scale is not a tensor
    with h5py.File(tmp_path / "g.clipped.h5", "r") as f:
        assert list(f.keys()) == ["steps", "grad", "float_type", "b_after_a"]
        assert f[f["grad"].attrs["source"]].name == "/steps"
        assert f["grad"].dims[0].keys() == ["steps"]
        np.testing.assert_array_equal(f["steps"][()], np.arange(4.0))
        assert (f["grad"].compression, f["grad"].fletcher32, f["grad"].maxshape) == ("lzf", True, (None, 3))
        assert np.linalg.norm(f["grad"][()]) == pytest.approx(1.0, rel=1e-6)
