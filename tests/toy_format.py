"""A toy tensor format for the tests: one module, registered, is all a format needs.

A ``.toy`` file is ``TOYTENSR``, a little-endian u32 tensor count, then per
tensor: u16 name length, the UTF-8 name, u8 rank, u32 per dimension, a u8 dtype
code (0 float32, 1 int8), and the raw little-endian data. A tensor named
``X.codes`` (int8) next to ``X.scale`` (one float32) is read as one *logical*
tensor ``X`` of float32 values ``codes * scale``, through an encoding: the seam
that quantized checkpoints will use.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Collection
from pathlib import Path

import numpy as np

from tclip.errors import FormatError
from tclip.formats.atomic import AtomicOutput
from tclip.formats.base import PositionalWriter, TensorInfo, TensorReader, read_region

NAME = "toy"
SUFFIXES = (".toy",)
MAGIC = b"TOYTENSR"
DTYPES = {0: np.dtype("<f4"), 1: np.dtype("i1")}
CODES = {dtype: code for code, dtype in DTYPES.items()}


def sniff(head: bytes, size: int) -> bool:
    return head.startswith(MAGIC)


class ScaledCodes:
    """A logical float32 tensor stored as int8 codes times one float32 scale."""

    def __init__(self, codes: str, scale: str) -> None:
        self.parts = (codes, scale)

    def source(self, reader: TensorReader, info: TensorInfo) -> "ScaledSource":
        return ScaledSource(reader, *self.parts)

    def sink(self, writer: object, info: TensorInfo) -> object:
        raise NotImplementedError("the toy encoding is read-only")


class ScaledSource:
    dtype = np.dtype(np.float32)
    parallel_safe = True
    align = 0

    def __init__(self, reader: TensorReader, codes: str, scale: str) -> None:
        self.reader, self.codes = reader, codes
        self.scale = np.float32(reader.read_flat(scale, 0, 1)[0])

    def read(self, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
        values = self.reader.read_flat(self.codes, start, stop).astype(np.float32) * self.scale
        result = out[: values.nbytes].view(np.float32) if out is not None and out.size >= values.nbytes \
            else np.empty(values.size, np.float32)
        result[...] = values
        return result


def header(tensors: list[TensorInfo]) -> bytes:
    parts = [MAGIC, struct.pack("<I", len(tensors))]
    for info in tensors:
        name = info.name.encode("utf-8")
        parts += [struct.pack("<H", len(name)), name, struct.pack("<B", len(info.shape)),
                  struct.pack(f"<{len(info.shape)}I", *info.shape), struct.pack("<B", CODES[info.dtype])]
    return b"".join(parts)


class ToyReader(TensorReader):
    format_name = NAME

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._file = open(path, "rb")
        try:
            self.offsets: dict[str, int] = {}
            stored: dict[str, TensorInfo] = {}
            data = self._file.read()
            if not data.startswith(MAGIC):
                raise FormatError("not a toy file", path)
            (count,) = struct.unpack_from("<I", data, 8)
            position, infos = 12, []
            for _ in range(count):
                (length,) = struct.unpack_from("<H", data, position)
                name = data[position + 2:position + 2 + length].decode("utf-8")
                position += 2 + length
                (rank,) = struct.unpack_from("<B", data, position)
                shape = struct.unpack_from(f"<{rank}I", data, position + 1)
                (code,) = struct.unpack_from("<B", data, position + 1 + 4 * rank)
                position += 2 + 4 * rank
                infos.append(TensorInfo(name, tuple(shape), DTYPES[code]))
            for info in infos:
                self.offsets[info.name] = position
                position += info.nbytes
                stored[info.name] = info
            if position != os.fstat(self._file.fileno()).st_size:
                raise FormatError("the data does not fill the file", path)
            for name, info in stored.items():
                base = name[: -len(".codes")]
                if name.endswith(".codes") and f"{base}.scale" in stored:
                    self.tensors[base] = TensorInfo(base, info.shape, np.dtype(np.float32),
                                                    encoding=ScaledCodes(name, f"{base}.scale"))
                elif not (name.endswith(".scale") and f"{name[:-len('.scale')]}.codes" in stored):
                    self.tensors[name] = info
            self.stored = stored
        except BaseException:
            self._file.close()  # a reader that cannot open leaves nothing open
            raise

    def region(self, name: str) -> tuple[int, int] | None:
        return (self._file.fileno(), self.offsets[name]) if name in self.offsets else None

    def read_flat(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        if name in self.tensors and self.tensors[name].encoding is not None:
            # Only its encoding's source reads a logical tensor (what the test of the seam relies on).
            raise TypeError(f"{name!r} is a logical tensor: read it through its encoding")
        if name not in self.tensors:  # a stored part of a logical tensor
            info = self.stored[name]
            raw = os.pread(self._file.fileno(), (stop - start) * info.dtype.itemsize,
                           self.offsets[name] + start * info.dtype.itemsize)
            return np.frombuffer(raw, info.dtype).copy()
        return super().read_flat(name, start, stop, out)

    def read(self, name: str, index=None, scratch=None) -> np.ndarray:
        return read_region(self, name, index)

    def close(self) -> None:
        self._file.close()


class ToyWriter(PositionalWriter):
    format_name = NAME

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput, *,
                 like: TensorReader | None, metadata: dict[str, str] | None,
                 rewritten: Collection[str] | None) -> None:
        plain = [TensorInfo(t.name, t.shape, t.dtype) for t in tensors]
        super().__init__(target, plain, output)
        head = header(plain)
        position = len(head)
        for info in plain:
            self.offsets[info.name] = position
            position += info.nbytes
        self._open(head, position)


Reader = ToyReader
Writer = ToyWriter


def write(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A .toy file of ``tensors`` (float32 or int8), written directly (not through tclip)."""
    infos = [TensorInfo(name, tuple(array.shape), np.dtype(array.dtype).newbyteorder("<")) for name, array in
             tensors.items()]
    with open(path, "wb") as handle:
        handle.write(header(infos))
        for array in tensors.values():
            handle.write(np.ascontiguousarray(array).astype(np.dtype(array.dtype).newbyteorder("<")).tobytes())


def read(path: Path) -> dict[str, np.ndarray]:
    with ToyReader(path) as reader:
        return {name: reader.read_flat(name, 0, info.size).reshape(info.shape)
                for name, info in reader.tensors.items() if info.encoding is None}
