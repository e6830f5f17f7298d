"""Odd but valid files (issues 20.19, 20.20, 21.6, 21.10, 21.16): lossy HDF5 filters, names HDF5 cannot
hold, safetensors dtypes tclip does not read, records, metadata a conversion would lose."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import h5py
import numpy as np
import pytest

from support.cli import run
from support.formats_helpers import safetensors_bytes
from tclip.errors import FormatError
from tclip.formats import open_reader
from tclip.formats._io import copy_range, file_holes

RNG = np.random.default_rng(2120)


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------ 21.6 lossy HDF5 filters


@pytest.fixture
def scale_offset(tmp_path):
    path = tmp_path / "grads.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("model.layers.17.mlp.down_proj.weight", data=(RNG.standard_normal((64, 48)) * 0.05)
                         .astype(np.float32), chunks=(16, 48), scaleoffset=2)  # two decimal digits
        f.create_dataset("model.layers.17.mlp.up_proj.weight", data=(RNG.standard_normal((64, 48)) * 0.05)
                         .astype(np.float32), chunks=(16, 48), compression="gzip")
    return path


def file_norm(path: Path, name: str) -> float:
    with h5py.File(path, "r") as f:
        return float(np.linalg.norm(f[name][()].astype(np.float64)))


def test_norm_after_a_lossy_filter_is_what_the_file_holds(scale_offset):
    lossy, lossless = "model.layers.17.mlp.down_proj.weight", "model.layers.17.mlp.up_proj.weight"
    result = run("norm", "--clip", "1", "--json", scale_offset)
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    after = {t["name"]: t["norm_after"] for t in report["tensors"]}
    out = scale_offset.with_name("grads.clipped.h5")
    assert after[lossy] == file_norm(out, lossy) != pytest.approx(1.0, abs=1e-4)  # rounded to 0.01 steps
    assert after[lossless] == pytest.approx(1.0, rel=1e-6)
    assert report["global_norm_after"] == pytest.approx(np.hypot(after[lossy], after[lossless]), rel=1e-12)
    warning = [line for line in result.stderr.splitlines() if line.startswith("Warning: ")]
    assert len(warning) == 1 and lossy in warning[0] and lossless not in warning[0]
    assert "lossy filter (HDF5's scale-offset filter, 2 decimal digits)" in warning[0]
    assert "the norms after were measured from the file" in warning[0]


def test_norm_after_per_slice_is_measured_too(scale_offset):
    result = run("norm", "--clip", "0.05", "--axes", "1", "--json", "-o", scale_offset.with_name("o.h5"),
                 scale_offset)
    assert result.exit_code == 0, result.stderr
    entry = json.loads(result.stdout)["tensors"][0]
    with h5py.File(scale_offset.with_name("o.h5"), "r") as f:
        rows = np.linalg.norm(f[entry["name"]][()].astype(np.float64), axis=1)
    assert entry["max_slice_norm_after"] == pytest.approx(rows.max(), rel=1e-12)
    assert entry["norm_after"] == pytest.approx(np.sqrt(np.sum(rows ** 2)), rel=1e-12)


def test_a_dry_run_warns_that_the_filter_is_lossy(scale_offset):
    result = run("norm", "--clip", "1", "--dry-run", scale_offset)
    assert result.exit_code == 0, result.stderr
    assert "a rewrite would hold other values than those computed" in result.stderr
    assert listing(scale_offset.parent) == ["grads.h5"]


def test_a_conversion_leaves_the_filter_behind_and_says_nothing(scale_offset, tmp_path):
    result = run("norm", "--clip", "1", "--json", "-o", tmp_path / "g.safetensors", scale_offset)
    assert result.exit_code == 0, result.stderr
    assert "lossy" not in result.stderr
    assert all(t["norm_after"] == pytest.approx(1.0, rel=1e-6) for t in json.loads(result.stdout)["tensors"])


# ------------------------------------------------------------------ 21.10 a dataset and a group of one name


@pytest.mark.parametrize("names", [("a", "a/b"), ("model/layers/0/w", "model/layers"), ("x/y/z", "x/y", "x")])
def test_a_dataset_and_a_group_of_one_name_is_one_clean_error(tmp_path, names):
    source = tmp_path / "g.npz"
    np.savez(source, **{name: np.ones(3, np.float32) for name in names})
    result = run("norm", "--clip", "1", "-o", tmp_path / "g.h5", source)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "internal error" not in lines[0], lines
    assert "cannot both be written to HDF5" in lines[0]
    assert sum(f"'{name}'" in lines[0] for name in names) >= 2
    assert listing(tmp_path) == ["g.npz"]


# ------------------------------------------------------------------ 21.16 safetensors dtypes tclip does not read


def st_raw(header: dict) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def sparse_safetensors(path: Path, code: str, shape: list[int], nbytes: int) -> bytes:
    """A file of one tensor of ``nbytes`` (a hole: no disk) and a float32 tensor of norm 5 after it."""
    header = {"__metadata__": {"format": "pt"},
              "model.layers.0.mlp.experts.down_proj.weight": {"dtype": code, "shape": shape,
                                                               "data_offsets": [0, nbytes]},
              "model.norm.weight": {"dtype": "F32", "shape": [2], "data_offsets": [nbytes, nbytes + 8]}}
    head = st_raw(header)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + nbytes)
        f.seek(len(head) + nbytes)
        f.write(np.array([3, 4], np.float32).tobytes())
    return head


BIG = 2_199_999_999  # past 2**31 - 1 bytes; a multiple of 3 (6-bit types)


@pytest.mark.parametrize("code,shape", [("F4", [2, BIG]), ("F6_E2M3", [BIG // 3, 4]),
                                        ("F6_E3M2", [4, BIG // 3]), ("X9_FUTURE", [BIG])])
def test_a_tensor_of_a_dtype_tclip_does_not_read_past_2_gib_is_carried(tmp_path, code, shape):
    path = tmp_path / "experts.safetensors"
    head = sparse_safetensors(path, code, shape, BIG)
    if os.stat(path).st_blocks * 512 > 1 << 20:
        pytest.skip("this file system stores no holes: the test would write 2.2 GB")
    info = run("info", "--json", path)
    assert info.exit_code == 0, info.stderr
    tensors = json.loads(info.stdout)["tensors"]
    assert tensors[0]["nbytes"] == BIG and f"{code} {shape}" in tensors[0]["dtype"]
    report = run("report", "--json", path)
    assert report.exit_code == 0, report.stderr
    assert json.loads(report.stdout)["global_norm"] == 5.0
    assert run("norm", "--clip", "1", path).exit_code == 1  # selected, it may hold floats: the clip says so
    result = run("norm", "--clip", "1", "--exclude", "*.experts.*", "--json", path)
    assert result.exit_code == 0, result.stderr
    entry = json.loads(result.stdout)["tensors"][0]
    assert entry["name"] == "model.layers.0.mlp.experts.down_proj.weight" and not entry["selected"]
    out = tmp_path / "experts.clipped.safetensors"
    assert os.stat(out).st_size == os.stat(path).st_size
    assert os.stat(out).st_blocks * 512 < 1 << 20  # the zeros were not written: a hole, as in the input
    with open(out, "rb") as f:
        assert f.read(len(head)) == head  # the header byte for byte
        f.seek(len(head) + BIG)
        assert np.frombuffer(f.read(8), np.float32).tolist() == pytest.approx([0.6, 0.8])
    holes = file_holes(os.open(out, os.O_RDONLY), len(head), len(head) + BIG)
    assert sum(stop - start for start, stop in holes) >= BIG - (1 << 20)


def test_f4_records_the_logical_element_count(tmp_path):
    path = tmp_path / "fp4.safetensors"
    # float4_e2m1fn_x2 of shape [3, 4] as safetensors >= 0.6 saves it: F4 of shape [3, 8], 12 bytes
    packed = bytes(range(12))
    header = {"w": {"dtype": "F4", "shape": [3, 8], "data_offsets": [0, 12]},
              "s": {"dtype": "F8_E8M0", "shape": [3], "data_offsets": [12, 15]},
              "b": {"dtype": "F6_E3M2", "shape": [4], "data_offsets": [15, 18]}}
    path.write_bytes(st_raw(header) + packed + b"\x7f\x80\x81" + b"\x01\x02\x03")
    with open_reader(path) as reader:
        assert reader.tensors["w"].nbytes == 12 and reader.tensors["b"].nbytes == 3
    assert run("norm", "--clip", "1", path).exit_code == 1  # selected, they may hold floats: the clip says so
    result = run("norm", "--clip", "1", "--exclude", "[wb]", path)
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "fp4.clipped.safetensors").read_bytes()[-18:-6] == packed
    for shape, nbytes, needs in (([3, 4], 12, "needs 6 bytes, data_offsets give 12"),
                                 ([3], 2, "does not fill whole bytes")):
        header = {"w": {"dtype": "F4", "shape": shape, "data_offsets": [0, nbytes]}}
        path.write_bytes(st_raw(header) + bytes(nbytes))
        with pytest.raises(FormatError, match=re.escape(f"tensor 'w': shape {shape} of F4 (4 bits each) {needs}")):
            open_reader(path)


def test_f4_written_by_the_safetensors_library(tmp_path):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    from safetensors.torch import save_file

    path = tmp_path / "nvfp4.safetensors"
    packed = torch.arange(24, dtype=torch.uint8).reshape(4, 6)
    save_file({"model.layers.0.mlp.gate_proj.weight": packed.view(torch.float4_e2m1fn_x2),
               "model.layers.0.mlp.gate_proj.bias": torch.ones(4)}, str(path))
    header = json.loads(path.read_bytes()[8:8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
    assert header["model.layers.0.mlp.gate_proj.weight"]["shape"] == [4, 12]  # two values a byte
    assert run("norm", "--clip", "1", path).exit_code == 1  # selected, it may hold floats: the clip says so
    result = run("norm", "--clip", "1", "--exclude", "*.weight", path)
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "nvfp4.clipped.safetensors"
    from safetensors.torch import load_file

    loaded = load_file(str(out))
    assert torch.equal(loaded["model.layers.0.mlp.gate_proj.weight"].view(torch.uint8), packed)
    assert float(loaded["model.layers.0.mlp.gate_proj.bias"].norm()) == pytest.approx(1.0, rel=1e-6)


def test_a_copy_skips_holes_only_where_the_target_has_them_too(tmp_path):
    size = 8 << 20
    source, target = tmp_path / "s", tmp_path / "t"
    with open(source, "wb") as f:
        f.truncate(size)
        f.seek(3 << 20)
        f.write(b"data in the middle")
    with open(target, "wb") as f:
        f.truncate(size)
        f.seek(6 << 20)
        f.write(b"x" * 4096)  # not a hole: must be overwritten with the source's zeros
    fd_in, fd_out = os.open(source, os.O_RDONLY), os.open(target, os.O_RDWR)
    try:
        copy_range(fd_in, 0, size, fd_out, 0, source)
    finally:
        os.close(fd_in)
        os.close(fd_out)
    assert target.read_bytes() == source.read_bytes()


def test_a_copy_from_a_file_shorter_than_claimed_is_an_error(tmp_path):
    source, target = tmp_path / "s", tmp_path / "t"
    source.write_bytes(b"abc")
    with open(target, "wb") as f:
        f.truncate(4 << 20)
    fd_in, fd_out = os.open(source, os.O_RDONLY), os.open(target, os.O_RDWR)
    try:
        with pytest.raises(FormatError, match="truncated"):
            copy_range(fd_in, 0, 4 << 20, fd_out, 0, source)
    finally:
        os.close(fd_in)
        os.close(fd_out)


# ------------------------------------------------------------------ 20.19 records copied byte for byte

RECORDS = np.array([(1.5, 2), (3.0, 4), (-2.5, 7)], dtype=[("x", "<f4"), ("n", "<i4")])


def test_a_structured_npy_is_copied_and_reported_skipped(tmp_path):
    source = tmp_path / "records.npy"
    np.save(source, RECORDS)
    result = run("norm", "--clip", "1", "--json", "-o", tmp_path / "out.npy", source)
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out.npy").read_bytes() == source.read_bytes()
    entry = json.loads(result.stdout)["tensors"][0]
    assert entry["skipped"] is not None and "not numeric" in entry["skipped"]
    assert "cannot be written" not in result.stderr
    assert run("value", "--min", "-1", "--max", "1", source).exit_code == 0
    assert (tmp_path / "records.clipped.npy").read_bytes() == source.read_bytes()


def test_records_in_npz_and_hdf5_are_copied_and_reported_skipped(tmp_path):
    weight = (RNG.standard_normal((8, 4)) * 3).astype(np.float32)
    npz = tmp_path / "g.npz"
    np.savez(npz, records=RECORDS, weight=weight)
    h5 = tmp_path / "g.h5"
    with h5py.File(h5, "w") as f:
        f["records"] = RECORDS
        f["weight"] = weight
    for source in (npz, h5):
        out = tmp_path / f"out{source.suffix}"
        result = run("norm", "--clip", "1", "--json", "-o", out, source)
        assert result.exit_code == 0, result.stderr
        with open_reader(out) as reader:
            if source.suffix == ".npz":
                entry = {t["name"]: t for t in json.loads(result.stdout)["tensors"]}["records"]
                assert "not numeric" in entry["skipped"]
                assert reader.read("records").tobytes() == RECORDS.tobytes()
            else:
                assert [o.name for o in reader.others] == ["records"]
                assert reader.other_values("records", 1 << 20).tobytes() == RECORDS.tobytes()
            assert float(np.linalg.norm(reader.read("weight"))) == pytest.approx(1.0, rel=1e-6)


# ------------------------------------------------------------------ 20.20 metadata a conversion cannot hold


def test_converting_a_save_pretrained_shard_names_the_metadata_keys_and_the_option(tmp_path):
    shard = tmp_path / "model-00001-of-00002.safetensors"
    shard.write_bytes(safetensors_bytes({"model.layers.0.mlp.up_proj.weight": np.ones((4, 4), np.float32)},
                                        metadata={"format": "pt"}))
    result = run("norm", "--clip", "1", "-o", tmp_path / "shard.npz", shard)
    assert result.exit_code == 1
    line = result.stderr.strip()
    assert "npz cannot hold the file's metadata (key 'format')" in line
    assert "--drop-nonnumeric" in line and "nothing was written" in line
    many = tmp_path / "many.safetensors"
    many.write_bytes(safetensors_bytes({"w": np.ones(2, np.float32)},
                                       metadata={f"key{i}": "v" for i in range(6)}))
    result = run("norm", "--clip", "1", "-o", tmp_path / "many.npz", many)
    assert re.search(r"\(keys ('key\d', ){3}'key\d' and 2 more\)", result.stderr), result.stderr
    dropped = run("norm", "--clip", "1", "--drop-nonnumeric", "-o", tmp_path / "shard.npz", shard)
    assert dropped.exit_code == 0, dropped.stderr
    assert listing(tmp_path) == ["many.safetensors", "model-00001-of-00002.safetensors", "shard.npz"]
