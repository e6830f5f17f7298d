"""A malformed HDF5 file can make the HDF5 library loop forever inside one call (a global heap
object whose size runs past its neighbours): the child walking the file says it makes progress
as it goes, so a silent one is refused after a few seconds, while a long walk that keeps making
progress is not cut short."""

from __future__ import annotations

import struct
from pathlib import Path

import h5py
import pytest

from tclip.errors import FormatError
from tclip.formats.hdf5 import probe as h5probe
from tclip.formats import open_reader


def _looping_heap(tmp_path: Path) -> Path:
    """A file whose group attributes (variable-length strings) live in a global heap collection
    in which one object claims 255 bytes instead of 7: HDF5 loops reading the attributes."""
    path = tmp_path / "heap.h5"
    with h5py.File(path, "w", libver="latest") as f:
        group = f.create_group("model.layers.0.self_attn")
        for i in range(12):
            group.attrs[f"a{i}"] = f"value {i}"
    data = bytearray(path.read_bytes())
    at = data.find(b"GCOL")
    assert at > 0 and data.count(b"GCOL") == 1
    position = at + 16  # signature, version, reserved, collection size
    for _ in range(6):  # the objects: index, reference count, reserved, size, data (8-byte aligned)
        size = struct.unpack_from("<Q", data, position + 8)[0]
        position += 16 + -(-size // 8) * 8
    index, _, _, size = struct.unpack_from("<HHIQ", data, position)
    assert (index, size) == (7, 7)  # "value 6"
    data[position + 8] = 0xFF
    path.write_bytes(bytes(data))
    return path


def test_a_library_looping_in_a_heap_is_refused_after_a_short_silence(tmp_path, monkeypatch):
    path = _looping_heap(tmp_path)
    monkeypatch.setattr(h5probe, "STALL_SECONDS", 1, raising=False)
    with pytest.raises(FormatError, match="reading the file's structure: the HDF5 library made no progress for 1 s "
                                          "in a separate process; refused as malformed"):
        open_reader(path)
