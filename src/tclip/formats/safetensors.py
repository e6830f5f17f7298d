"""safetensors files: an 8-byte header length, a JSON header, then raw little-endian data.

The header is parsed and validated here rather than by the ``safetensors``
library because its NumPy loader cannot represent float8 (``numpy has no
attribute float8_e4m3fn``) and its writer needs every tensor in memory at once;
tclip reads and writes tensors in blocks. The files written are checked against
the library in the tests.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Collection, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import ml_dtypes
import numpy as np

from ..core.units import Index
from ..errors import FormatError, UnsupportedError
from .atomic import AtomicOutput
from .base import PositionalWriter, TensorInfo, TensorReader, checked_size, read_region

NAME = "safetensors"
SUFFIXES = (".safetensors",)
HOLDS_METADATA = True

def sniff(head: bytes, size: int) -> bool:
    """An 8-byte little-endian header length that fits the file, then a JSON object."""
    if len(head) < 9:
        return False
    (header_length,) = struct.unpack("<Q", head[:8])
    return 8 + header_length <= size and head[8:9] == b"{"


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
METADATA_KEY = "__metadata__"

# Every dtype of the format's spec that NumPy or ml_dtypes can hold.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "U8": np.dtype("u1"),
    "U16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "U64": np.dtype("<u8"),
    "BOOL": np.dtype("?"),
    "C64": np.dtype("<c8"),
}
if hasattr(ml_dtypes, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = np.dtype(ml_dtypes.float8_e8m0fnu)
# AMD's float8 variants (safetensors 0.8): one NaN (0x80), no negative zero, bias one higher.
DTYPES["F8_E4M3FNUZ"] = np.dtype(ml_dtypes.float8_e4m3fnuz)
DTYPES["F8_E5M2FNUZ"] = np.dtype(ml_dtypes.float8_e5m2fnuz)

# Dtypes of the spec that tclip carries byte for byte without reading them, with their
# bits per element, so that a header's byte count is checked as the library checks it.
# The sub-byte types record the logical element count: an F4 tensor of shape [3, 8]
# (what torch calls float4_e2m1fn_x2 of shape [3, 4]) holds 12 bytes (safetensors >= 0.6).
# The 8-bit ones are read (DTYPES) where ml_dtypes has them; listed here for older ml_dtypes.
CARRIED_BITS: dict[str, int] = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "F8_E8M0": 8,
                                "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8}


def dtype_code(dtype: np.dtype) -> str:
    """The header's name for a NumPy dtype (byte order ignored: data is written little-endian)."""
    little = dtype.newbyteorder("<") if dtype.byteorder not in ("|", "=") else dtype
    for code, candidate in DTYPES.items():
        if candidate == little or candidate == dtype:
            return code
    raise UnsupportedError(f"safetensors has no dtype for {dtype.name}")


_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


def _object_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (the library refuses such headers too).

    Called for every object of a header that may list a million tensors: the common
    case costs one dict creation in C.
    """
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"key {key!r} appears twice")
            seen.add(key)
    return result


class SafetensorsReader(TensorReader):
    format_name = "safetensors"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.offsets: dict[str, int] = {}  # tensor name -> file offset of its data
        self._file = open(path, "rb")
        try:
            self._parse()
        except BaseException:
            self._file.close()
            raise

    def _parse(self) -> None:
        path = self.path
        file_size = os.fstat(self._file.fileno()).st_size
        prefix = self._file.read(8)
        if len(prefix) != 8:
            raise FormatError("not a safetensors file: shorter than its 8-byte header length", path)
        (header_length,) = struct.unpack("<Q", prefix)
        if header_length > MAX_HEADER_BYTES:
            raise FormatError(f"header length {header_length} exceeds the limit of {MAX_HEADER_BYTES} bytes", path)
        if 8 + header_length > file_size:
            raise FormatError(f"header length {header_length} runs past the end of the file ({file_size} bytes)", path)
        raw = self._file.read(header_length)
        try:
            text = raw.decode("utf-8")
            header = json.loads(text, object_pairs_hook=_object_hook)
        except (UnicodeDecodeError, ValueError) as error:
            raise FormatError(f"header is not valid JSON ({str(error)[:200]})", path) from None
        except RecursionError:
            raise FormatError("header is not valid JSON (nested too deeply)", path) from None
        if not isinstance(header, dict):
            raise FormatError("header is not a JSON object", path)
        if "\\ud" in text.lower() and _has_lone_surrogate(header):
            raise FormatError("header holds a string with a lone UTF-16 surrogate (not valid Unicode text)", path)
        self.header_bytes = prefix + raw
        self.data_start = 8 + header_length
        data_size = file_size - self.data_start
        metadata = header.pop(METADATA_KEY, None)
        if metadata is not None:
            if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
                raise FormatError("__metadata__ must map strings to strings", path)
            self.metadata = dict(metadata)
            if "DCP_SHARDING_INFO" in self.metadata:
                self.refuse_dcp_piece()
        entries = []
        for name, entry in header.items():
            entries.append((name, *self._check_entry(name, entry, data_size)))
        entries.sort(key=lambda e: (e[3], e[4]))
        position = 0
        for name, dtype, shape, begin, end in entries:
            if begin < position:
                raise FormatError(f"tensor {name!r}: data_offsets [{begin}, {end}] overlap the previous tensor", path)
            if begin > position:
                raise FormatError(f"tensor {name!r}: {begin - position} bytes before it belong to no tensor", path)
            position = end
            code = header[name]["dtype"]
            if code in DTYPES:
                self.tensors[name] = TensorInfo(name, shape, dtype, attrs=_NO_ATTRS)
            else:
                self.tensors[name] = TensorInfo(name, shape, dtype, numeric=False, attrs=_NO_ATTRS,
                                                dtype_label=f"{code} {header[name]['shape']} (not supported)",
                                                unreadable_type=True)
            self.offsets[name] = self.data_start + begin
        if position != data_size:
            raise FormatError(f"the data is {data_size} bytes but the tensors cover {position}", path)

    def _check_entry(self, name: str, entry: Any, data_size: int) -> tuple[np.dtype, tuple[int, ...], int, int]:
        path = self.path
        if not isinstance(entry, dict) or len(entry) != 3 or not _ENTRY_KEYS.issuperset(entry):
            raise FormatError(f"tensor {name!r}: expected dtype, shape and data_offsets", path)
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(code, str) or not code or len(code) > 32 or not code.isprintable():
            raise FormatError(f"tensor {name!r}: invalid dtype {str(code)[:40]!r}", path)
        if not isinstance(shape, list):
            raise FormatError(f"tensor {name!r}: invalid shape {shape!r}", path)
        if code not in DTYPES:
            # A dtype tclip cannot read (F4, F6_E2M3, a newer spec's name): its
            # bytes are carried unchanged, never read. They are described as that many single
            # bytes (a void type of the whole size cannot pass 2**31 - 1 bytes).
            elements = checked_size(tuple(shape), 1, path, name)
            begin, end = self._offsets(name, offsets, data_size)
            bits = CARRIED_BITS.get(code)
            if bits is not None and elements * bits % 8:
                raise FormatError(f"tensor {name!r}: shape {shape} of {code} ({bits} bits each) does not fill "
                                  "whole bytes", path)
            if bits is not None and elements * bits // 8 != end - begin:
                raise FormatError(f"tensor {name!r}: shape {shape} of {code} ({bits} bits each) needs "
                                  f"{elements * bits // 8} bytes, data_offsets give {end - begin}", path)
            return np.dtype("V1"), (end - begin,), begin, end
        nbytes = checked_size(tuple(shape), DTYPES[code].itemsize, path, name)
        begin, end = self._offsets(name, offsets, data_size)
        if end - begin != nbytes:
            raise FormatError(f"tensor {name!r}: shape {shape} of {code} needs {nbytes} bytes, "
                              f"data_offsets give {end - begin}", path)
        return DTYPES[code], tuple(shape), begin, end

    def _offsets(self, name: str, offsets: Any, data_size: int) -> tuple[int, int]:
        path = self.path
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise FormatError(f"tensor {name!r}: invalid data_offsets {offsets!r}", path)
        begin, end = offsets
        if not 0 <= begin <= end:
            raise FormatError(f"tensor {name!r}: invalid data_offsets {offsets!r}", path)
        if end > data_size:
            raise FormatError(f"tensor {name!r}: data_offsets {offsets!r} run past the end of the data "
                              f"({data_size} bytes); the file is truncated", path)
        return begin, end

    def refuse_dcp_piece(self) -> None:
        """One rank's pieces of a DCP checkpoint are not read as a file of their own (their
        shapes are pieces'): :mod:`.dcp.hf_shards` reads their folder as whole tensors."""
        from .dcp.per_rank import piece_problem

        problem = piece_problem(self.path, self.metadata)
        if problem:
            raise UnsupportedError(problem, self.path)

    def close(self) -> None:
        self._file.close()

    def region(self, name: str) -> tuple[int, int] | None:
        return self._file.fileno(), self.offsets[name]

    def read(self, name: str, index: Index | None = None, scratch: bytearray | None = None) -> np.ndarray:
        return read_region(self, name, index)



_NO_ATTRS: Mapping[str, Any] = MappingProxyType({})


def _has_lone_surrogate(header: dict[str, Any]) -> bool:
    def bad(text: object) -> bool:
        if not isinstance(text, str):
            return False
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False

    metadata = header.get(METADATA_KEY)
    items = list(metadata.items()) if isinstance(metadata, dict) else []
    return any(bad(k) for k in header) or any(bad(k) or bad(v) for k, v in items)


class SafetensorsWriter(PositionalWriter):
    format_name = "safetensors"

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput, *,
                 like: TensorReader | None, metadata: dict[str, str] | None,
                 rewritten: Collection[str] | None) -> None:
        # rewritten: every write is positional, whatever is rewritten
        if isinstance(like, SafetensorsReader) and len(like.tensors) == len(tensors) and metadata is None \
                and all(like.tensors.get(t.name) == t for t in tensors):
            # A byte-identical rewrite of the source's header (every dtype it holds, even ones
            # tclip cannot read, which are then copied byte for byte).
            super().__init__(target, tensors, output)
            little = list(tensors)
            header = like.header_bytes
            for t in little:
                self.offsets[t.name] = like.offsets[t.name]
        else:
            little = [TensorInfo(t.name, t.shape, self._little_endian(t, target), numeric=t.numeric) for t in tensors]
            super().__init__(target, little, output)
            header = self._header(little, metadata if metadata is not None else {})
            position = len(header)
            for t in little:
                self.offsets[t.name] = position
                position += t.nbytes
        self._open(header, len(header) + sum(t.nbytes for t in little))

    @staticmethod
    def _little_endian(info: TensorInfo, target: Path) -> np.dtype:
        if not info.numeric:
            raise UnsupportedError(f"tensor {info.name!r} of dtype {info.dtype} has no safetensors dtype", target)
        dtype_code(info.dtype)  # raises for dtypes the format lacks
        return info.dtype.newbyteorder("<") if info.dtype.byteorder == ">" else info.dtype

    @staticmethod
    def _header(tensors: list[TensorInfo], metadata: dict[str, str]) -> bytes:
        header: dict[str, Any] = {}
        if metadata:
            header[METADATA_KEY] = {str(k): str(v) for k, v in metadata.items()}
        position = 0
        for info in tensors:
            header[info.name] = {"dtype": dtype_code(info.dtype), "shape": list(info.shape),
                                 "data_offsets": [position, position + info.nbytes]}
            position += info.nbytes
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        text += b" " * (-len(text) % 8)  # pad so the data starts 8-byte aligned, as the library does
        return struct.pack("<Q", len(text)) + text


Reader = SafetensorsReader
Writer = SafetensorsWriter
