"""Malformed files: one clean TclipError naming the file and what is wrong, nothing run."""

from __future__ import annotations

import io
import json
import struct
import zipfile

import h5py
import numpy as np
import pytest

from tclip.errors import TclipError
from tclip.formats import open_reader


def st_file(header: object, data: bytes = b"", raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buffer.getvalue()


def h5_bytes(tmp_path) -> bytes:
    with h5py.File(tmp_path / "ok.h5", "w") as f:
        f.create_dataset("w", data=np.arange(10000, dtype=np.float32), compression="gzip")
    return (tmp_path / "ok.h5").read_bytes()


GOOD_ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
PICKLED = npy_bytes(np.array([{"a": 1}], dtype=object)) if False else None  # built lazily below

CASES = [
    # safetensors
    ("st-short", "x.safetensors", lambda p: b"\x01\x02", "shorter than its 8-byte header length"),
    ("st-length-past-end", "x.safetensors", lambda p: struct.pack("<Q", 500) + b"{}", "runs past the end of the file"),
    ("st-huge-header", "x.safetensors", lambda p: struct.pack("<Q", 200_000_000) + b"{" * 16,
     "exceeds the limit of 100000000 bytes"),
    ("st-bad-json", "x.safetensors", lambda p: st_file(None, raw_header=b"{not json"), "header is not valid JSON"),
    ("st-not-object", "x.safetensors", lambda p: st_file([1, 2]), "header is not a JSON object"),
    # (a dtype name tclip does not know, such as a newer spec's "F4", is carried unchanged: test_real_files)
    ("st-bad-dtype", "x.safetensors", lambda p: st_file({"a": {**GOOD_ENTRY, "dtype": 5}}, b"\0" * 8),
     "tensor 'a': invalid dtype '5'"),
    ("st-shape-mismatch", "x.safetensors", lambda p: st_file({"a": {**GOOD_ENTRY, "shape": [3]}}, b"\0" * 8),
     "tensor 'a': shape [3] of F32 needs 12 bytes, data_offsets give 8"),
    ("st-truncated", "x.safetensors", lambda p: st_file({"a": GOOD_ENTRY}, b"\0" * 5),
     "run past the end of the data (5 bytes); the file is truncated"),
    ("st-overlap", "x.safetensors", lambda p: st_file({"a": GOOD_ENTRY, "b": {**GOOD_ENTRY, "data_offsets": [4, 12]}},
                                                     b"\0" * 12), "overlap the previous tensor"),
    ("st-hole", "x.safetensors", lambda p: st_file({"a": {**GOOD_ENTRY, "data_offsets": [4, 12]}}, b"\0" * 12),
     "4 bytes before it belong to no tensor"),
    ("st-trailing", "x.safetensors", lambda p: st_file({"a": GOOD_ENTRY}, b"\0" * 9),
     "the data is 9 bytes but the tensors cover 8"),
    ("st-negative-shape", "x.safetensors", lambda p: st_file({"a": {**GOOD_ENTRY, "shape": [-2]}}, b"\0" * 8),
     "tensor 'a': invalid shape [-2]"),
    ("st-impossible-shape", "x.safetensors",
     lambda p: st_file({"a": {**GOOD_ENTRY, "shape": [2**40, 2**40]}}, b"\0" * 8), "impossibly large"),
    ("st-bad-offsets", "x.safetensors", lambda p: st_file({"a": {**GOOD_ENTRY, "data_offsets": [8, 0]}}, b"\0" * 8),
     "invalid data_offsets [8, 0]"),
    ("st-missing-field", "x.safetensors", lambda p: st_file({"a": {"dtype": "F32"}}), "expected dtype, shape and data_offsets"),
    ("st-metadata-not-strings", "x.safetensors", lambda p: st_file({"__metadata__": {"a": 1}}),
     "__metadata__ must map strings to strings"),
    ("st-duplicate-key", "x.safetensors",
     lambda p: st_file(None, b"\0" * 8, raw_header=b'{"a":' + json.dumps(GOOD_ENTRY).encode() + b',"a":'
                       + json.dumps(GOOD_ENTRY).encode() + b"}"), "key 'a' appears twice"),
    # npy
    ("npy-truncated", "x.npy", lambda p: npy_bytes(np.arange(100.0))[:-8],
     "file is truncated: the header promises 800 bytes of data, 792 are there"),
    ("npy-bad-header", "x.npy", lambda p: b"\x93NUMPY\x01\x00\x10\x00{'descr': nope}  \n", "not a valid .npy header"),
    ("npy-pickle", "x.npy", lambda p: npy_bytes(np.array([None, 1], dtype=object)),
     "the array holds Python objects; loading it would need pickle, which tclip never runs"),
    ("npy-magic-only", "x.npy", lambda p: b"\x93NUMPY", "not a valid .npy header"),
    # npz
    ("npz-not-npy-member", "x.npz", lambda p: zip_bytes({"readme.txt": b"hi"}),
     "member 'readme.txt' is not a .npy array"),
    ("npz-truncated", "x.npz", lambda p: zip_bytes({"a.npy": npy_bytes(np.arange(1000.0))})[:4000],
     "not a valid .npz archive"),
    ("npz-member-truncated", "x.npz", lambda p: zip_bytes({"a.npy": npy_bytes(np.arange(10.0))[:-16]}),
     "member 'a.npy' is truncated or padded"),
    ("npz-pickle-bad-shape", "x.npz",
     lambda p: zip_bytes({"a.npy": b"\x93NUMPY\x01\x00" + (lambda h: len(h).to_bytes(2, "little") + h)(
         b"{'descr': '|O', 'fortran_order': False, 'shape': (-3,), }".ljust(118) + b"\n") + b"\x80\x04N."}),
     "invalid shape [-3]"),
    ("npz-garbage-member", "x.npz", lambda p: zip_bytes({"a.npy": b"garbage"}), "member 'a.npy': not a valid .npy header"),
    # hdf5
    ("h5-truncated", "x.h5", lambda p: h5_bytes(p)[:1500], "x.h5: "),
    ("h5-garbage", "x.h5", lambda p: b"\x89HDF\r\n\x1a\n" + b"\0" * 100, "not a valid HDF5 file"),
    # unknown
    ("unknown", "x.bin", lambda p: b"hello world", "not a tensor file tclip knows"),
    ("empty-npy", "x.npy", lambda p: b"", "not a valid .npy header"),
]


@pytest.mark.parametrize("filename,make,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_file_is_one_clean_error(tmp_path, filename, make, message):
    path = tmp_path / filename
    path.write_bytes(make(tmp_path))
    with pytest.raises(TclipError) as info:
        with open_reader(path) as reader:
            for name in reader.tensors:
                reader.read(name)
    text = str(info.value)
    assert text.startswith(str(path) + ": ")
    assert message in text
    assert "\n" not in text
