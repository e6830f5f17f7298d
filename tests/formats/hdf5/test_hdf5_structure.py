"""HDF5 files whose structure is legal but unusual, or hostile: data placed inside the file's own
metadata is refused before anything is written; a group graph with a cycle (a hard link back to the
root) is read and rewritten with its links kept."""

from __future__ import annotations

import struct
from pathlib import Path

import h5py
import numpy as np
import pytest

from support.cli import run
from tclip.errors import FormatError
from tclip.formats import open_reader


def _data_inside(tmp_path: Path, signature: bytes) -> Path:
    """A v0 HDF5 file whose contiguous tensor 'b' claims the bytes of a metadata record
    (``TREE``: the root group's B-tree, ``SNOD``: its symbol table node, ``HEAP``: its local heap)."""
    path = tmp_path / "inside.h5"
    with h5py.File(path, "w", libver="earliest") as f:
        f.create_group("model.layers.0")["weight"] = np.arange(16, dtype=np.float32) / 16
        f["b"] = np.full(8, 0.5, np.float32)  # 32 bytes: within each record's size
        offset = f["b"].id.get_offset()
    data = bytearray(path.read_bytes())
    packed = struct.pack("<Q", offset)
    assert data.count(packed) == 1
    at = data.find(packed)
    data[at:at + 8] = struct.pack("<Q", data.find(signature))
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("signature", [b"SNOD", b"TREE", b"HEAP"])
def test_data_inside_the_files_metadata_is_refused(tmp_path, signature):
    path = _data_inside(tmp_path, signature)
    before = path.read_bytes()
    with pytest.raises(FormatError, match="lies inside the file's own structure"):
        open_reader(path)
    for command in (["norm", "--clip", "1e-3"], ["global", "--clip", "1e-3"], ["report"]):
        result = run(*command, path)
        assert result.exit_code == 1, result.output
        assert result.stderr.splitlines() == [
            f"Error: {path}: the data of tensor 'b' lies inside the file's own structure (object headers, "
            "B-trees or heaps); refused as malformed"], result.stderr
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["inside.h5"]


def test_data_beside_metadata_is_read(tmp_path):
    # Every dataset right after its own object header, as HDF5 writes small files: no false alarm.
    path = tmp_path / "small.h5"
    with h5py.File(path, "w", libver="earliest") as f:
        for i in range(20):
            f[f"model.layers.{i}.self_attn.k_proj.weight"] = np.full((4, i + 1), i, np.float32)
    with open_reader(path) as reader:
        assert len(reader.tensors) == 20


@pytest.mark.parametrize("libver", ["earliest", "latest"])
def test_a_hard_link_back_to_the_root_is_read_and_kept(tmp_path, libver):
    # Cycles in the group graph are legal HDF5: each object is visited once, under its first name.
    path = tmp_path / "cycle.h5"
    weight = np.arange(12, dtype=np.float32).reshape(3, 4)
    with h5py.File(path, "w", libver=libver) as f:
        layer = f.create_group("model.layers.0.self_attn")
        layer["k_proj.weight"] = weight
        layer["root"] = f["/"]
    with open_reader(path) as reader:
        assert list(reader.tensors) == ["model.layers.0.self_attn/k_proj.weight"]
    result = run("norm", "--clip", "1", path)
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "cycle.clipped.h5", "r") as out:
        layer = out["model.layers.0.self_attn"]
        assert h5py.h5o.get_info(layer["root"].id).addr == h5py.h5o.get_info(out["/"].id).addr
        clipped = layer["k_proj.weight"][()]
        np.testing.assert_allclose(clipped, weight / np.linalg.norm(weight.astype(np.float64)), rtol=1e-6)
        assert np.array_equal(out["model.layers.0.self_attn/root/model.layers.0.self_attn/k_proj.weight"][()],
                              clipped)


def test_a_chunk_inside_the_files_metadata_is_refused(tmp_path):
    path = tmp_path / "chunks.h5"
    with h5py.File(path, "w", libver="earliest") as f:
        f.create_group("model.layers.0")["bias"] = np.ones(4, np.float32)
        f.create_dataset("model.layers.0/weight", data=np.ones((8, 2), np.float32), chunks=(2, 2))
        offsets = []
        f["model.layers.0/weight"].id.chunk_iter(lambda chunk: offsets.append(chunk.byte_offset))
    data = bytearray(path.read_bytes())
    packed = struct.pack("<Q", offsets[1])
    assert data.count(packed) == 1
    at = data.find(packed)
    data[at:at + 8] = struct.pack("<Q", data.find(b"SNOD"))  # the second chunk on a symbol table node
    path.write_bytes(bytes(data))
    result = run("norm", "--clip", "1", path)
    assert result.exit_code == 1 and result.stderr == (
        f"Error: {path}: the data of tensor 'model.layers.0/weight' lies inside the file's own structure (object "
        "headers, B-trees or heaps); refused as malformed\n"), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunks.h5"]


@pytest.mark.parametrize("libver", ["earliest", "latest"])
def test_a_file_with_a_user_block_is_read_and_clipped(tmp_path, libver):
    # Object header addresses count from the superblock (after the user block), data offsets from
    # the file's start: a header 1072 bytes past the superblock is no overlap with it.
    path = tmp_path / "ub.h5"
    weight = np.arange(1, 17, dtype=np.float32).reshape(4, 4)
    with h5py.File(path, "w", userblock_size=1024, libver=libver) as f:
        f["model.layers.0/weight"] = weight
        f.create_dataset("model.layers.0/bias", data=np.ones((8, 8)), chunks=(2, 8))
        f["model.layers.0"].attrs["note"] = "y" * 30
    result = run("norm", "--clip", "1", path)
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "ub.clipped.h5", "r") as out:
        assert out.userblock_size == 1024
        np.testing.assert_allclose(out["model.layers.0/weight"][()],
                                   weight / np.linalg.norm(weight.astype(np.float64)), rtol=1e-6)
