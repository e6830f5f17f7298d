"""Write torch.save files without torch, for tests: the pickle opcode by opcode, the zip by hand.

The zip is laid out as torch's own writer lays it out (``<prefix>/data.pkl`` first,
storages ``<prefix>/data/<key>`` 64-byte aligned by an extra field, a data
descriptor after each member, zip64 end records), or with CRCs in the local
headers and no descriptors (``descriptors=False``), as other zip writers do.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

STORAGE_KINDS = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage",
    "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage",
}


def glob(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def num(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if -(1 << 31) <= value < 1 << 31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def real(value: float) -> bytes:
    return b"G" + struct.pack(">d", value)


def tup(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def mapping(pairs: list[tuple[str, bytes]]) -> bytes:
    return b"}(" + b"".join(text(k) + v for k, v in pairs) + b"u"


@dataclass(frozen=True)
class View:
    """A tensor viewing storage ``key``: offset, shape and stride in elements."""

    key: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    neg: bool = False


def contiguous(key: str, shape: tuple[int, ...], offset: int = 0) -> View:
    strides, inner = [], 1
    for n in reversed(shape):
        strides.append(inner)
        inner *= n
    return View(key, offset, tuple(shape), tuple(reversed(strides)))


def dtype_name(dtype: np.dtype) -> str:
    if dtype == np.dtype(ml_dtypes.bfloat16):
        return "bfloat16"
    return np.dtype(dtype).name


def tensor_opcodes(view: View, storage: np.ndarray) -> bytes:
    kind = STORAGE_KINDS[dtype_name(storage.dtype)]
    pid = tup(text("storage"), glob("torch", kind), text(view.key), text("cpu"), num(storage.size)) + b"Q"
    metadata = b"}" + text("neg") + b"\x88s" if view.neg else b""
    return glob("torch._utils", "_rebuild_tensor_v2") + tup(
        pid, num(view.offset), tup(*map(num, view.shape)), tup(*map(num, view.stride)), b"\x89",
        glob("collections", "OrderedDict") + b")R", metadata) + b"R"


def save(path: Path, storages: dict[str, np.ndarray], views: dict[str, View], *,
         values: dict[str, bytes] | None = None, prefix: str = "archive", descriptors: bool = True,
         byteorder: str = "little", crc32: bool = True) -> Path:
    """A torch.save zip of ``views`` (name -> view of a 1-D storage array) and plain
    ``values`` (name -> opcodes of a scalar, see :func:`num` and :func:`real`), in that order
    (``crc32=False``: every CRC 0, as torch writes with ``set_crc32_options(False)``)."""
    pairs = [(name, tensor_opcodes(view, storages[view.key])) for name, view in views.items()]
    pairs += list((values or {}).items())
    pickle = b"\x80\x02" + mapping(pairs) + b"."
    members = [("data.pkl", pickle), ("byteorder", byteorder.encode())]
    for key, array in storages.items():
        order = ">" if byteorder == "big" else "<"
        data = array.astype(array.dtype.newbyteorder(order)) if array.dtype.itemsize > 1 else array
        members.append((f"data/{key}", np.ascontiguousarray(data).tobytes()))
    members.append(("version", b"3\n"))
    Path(path).write_bytes(zip_archive([(f"{prefix}/{name}", data) for name, data in members], descriptors, crc32))
    return Path(path)


def save_arrays(path: Path, arrays: dict[str, np.ndarray], **kwargs) -> Path:
    """Each array its own contiguous storage (what ``torch.save(state_dict)`` writes)."""
    storages = {str(i): np.ascontiguousarray(a).reshape(-1) for i, a in enumerate(arrays.values())}
    views = {name: contiguous(str(i), a.shape) for i, (name, a) in enumerate(arrays.items())}
    return save(path, storages, views, **kwargs)


_LOCAL = struct.Struct("<4s5H3L2H")
_CENTRAL = struct.Struct("<4s6H3L5H2L")


def zip_archive(members: list[tuple[str, bytes]], descriptors: bool = True, crc32: bool = True) -> bytes:
    body, central = bytearray(), bytearray()
    for name, data in members:
        raw = name.encode()
        crc = zlib.crc32(data) if crc32 else 0
        offset = len(body)
        # pad with an extra field so the data starts 64-byte aligned, as torch does
        start = offset + _LOCAL.size + len(raw) + 4
        padding = -start % 64
        extra = b"FB" + struct.pack("<H", padding) + b"Z" * padding
        flags = 0x808 if descriptors else 0x800
        local_crc, size = (0, 0) if descriptors else (crc, len(data))
        body += _LOCAL.pack(b"PK\x03\x04", 20, flags, 0, 0, 0x21, local_crc, size, size, len(raw), len(extra))
        body += raw + extra + data
        if descriptors:
            body += struct.pack("<4s3L", b"PK\x07\x08", crc, len(data), len(data))
        central += _CENTRAL.pack(b"PK\x01\x02", 20, 20, flags, 0, 0, 0x21, crc, len(data), len(data),
                                 len(raw), 0, 0, 0, 0, 0, offset) + raw
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central), len(body), 0)
    return bytes(body + central + end)
