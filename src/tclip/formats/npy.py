""".npy files: one tensor, named after the file's stem.

The header is parsed by ``numpy.lib.format`` (a literal parser: no code runs);
the data is then read in blocks straight from the file rather than through
``np.load``, which would load or map the whole array. A rewrite reuses the
original header bytes, so an unclipped round trip is byte-identical.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np
from numpy.lib import format as npy_format

from ..dtypes import ML_FLOAT_TYPES
from ..errors import FormatError, UnsupportedError
from .base import (
    AtomicOutput,
    Index,
    RegionSource,
    SequentialBlocks,
    TensorInfo,
    TensorReader,
    TensorWriter,
    checked_size,
    copy_bytes,
    write_all,
)

# numpy's own default limit on header size; larger headers are refused, not parsed.
MAX_HEADER_SIZE = 10000


def parse_header(stream: BinaryIO, path: object, name: str) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """Read an .npy header from ``stream``: (dtype, shape, fortran_order, header length)."""
    try:
        version = npy_format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = npy_format.read_array_header_1_0(stream, max_header_size=MAX_HEADER_SIZE)
        elif version == (2, 0):
            shape, fortran, dtype = npy_format.read_array_header_2_0(stream, max_header_size=MAX_HEADER_SIZE)
        elif version == (3, 0):
            # numpy has no public reader for version 3.0 (utf-8 field names); this
            # private one is what np.load itself calls, with the same literal parser.
            shape, fortran, dtype = npy_format._read_array_header(stream, version, max_header_size=MAX_HEADER_SIZE)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except (ValueError, EOFError, SyntaxError, TypeError, UnicodeDecodeError) as error:
        where = f"member {name!r}: " if name else ""
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise FormatError(f"{where}not a valid .npy header ({message})", path) from None
    if dtype.hasobject:
        raise UnsupportedError(
            f"tensor {name!r} holds Python objects; loading it would need pickle, which tclip never runs",
            path,
        )
    return dtype, tuple(shape), bool(fortran), stream.tell()


def header_bytes(dtype: np.dtype, shape: tuple[int, ...], fortran: bool) -> bytes:
    """A fresh .npy header as numpy writes it (version 1.0 unless it does not fit)."""
    if dtype.type in ML_FLOAT_TYPES:
        raise UnsupportedError(f".npy cannot record the dtype {dtype.name} (it would read back as raw bytes); "
                               "write .safetensors instead")
    header = {"descr": npy_format.dtype_to_descr(dtype), "fortran_order": fortran, "shape": shape}
    buffer = io.BytesIO()
    try:
        npy_format.write_array_header_1_0(buffer, header)
    except ValueError:
        buffer = io.BytesIO()
        npy_format.write_array_header_2_0(buffer, header)
    return buffer.getvalue()


def is_numeric(dtype: np.dtype) -> bool:
    return dtype.kind in "biufc" or dtype.type in ML_FLOAT_TYPES


class NpyReader(TensorReader):
    format_name = "npy"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._file = open(path, "rb")
        try:
            name = self.path.stem
            dtype, shape, fortran, self.data_offset = parse_header(self._file, path, "")
            nbytes = checked_size(shape, dtype.itemsize, path, name)
            available = os.fstat(self._file.fileno()).st_size - self.data_offset
            if available < nbytes:
                raise FormatError(f"file is truncated: the header promises {nbytes} bytes of data, "
                                  f"{available} are there", path)
            self._file.seek(0)
            self.header = self._file.read(self.data_offset)
            self.tensors[name] = TensorInfo(name, shape, dtype, fortran, numeric=is_numeric(dtype))
            self._source = RegionSource(self._file.fileno(), self.path)
        except BaseException:
            self._file.close()
            raise

    def close(self) -> None:
        self._file.close()

    def fileno(self) -> int:
        return self._file.fileno()

    def read(self, name: str, index: Index | None = None, scratch: bytearray | None = None) -> np.ndarray:
        return self._source.read(self.data_offset, self.tensors[name], index, scratch)


class NpyWriter(TensorWriter):
    format_name = "npy"

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput,
                 like: TensorReader | None = None) -> None:
        if len(tensors) != 1:
            names = ", ".join(t.name for t in tensors[:5])
            raise UnsupportedError(f".npy holds exactly one tensor, this would need {len(tensors)} ({names}); "
                                   "write .npz or .safetensors instead", target)
        super().__init__(target, tensors, output)
        (self.info,) = tensors
        if isinstance(like, NpyReader) and like.tensors.get(self.info.name) == self.info:
            header = like.header
        else:
            header = header_bytes(self.info.dtype, self.info.shape, self.info.fortran_order)
        self._order = SequentialBlocks()
        self._file = open(output.temp, "wb")
        self._file.write(header)

    def write(self, name: str, index: Index, data: np.ndarray) -> None:
        self._order.check(self.info, index)
        write_all(self._file, np.asarray(data, dtype=self.info.dtype), self.info.fortran_order)

    def copy_tensor(self, reader: TensorReader, name: str, max_bytes: int = 8 << 20) -> None:
        if not (isinstance(reader, NpyReader) and reader.tensors[name] == self.info):
            return super().copy_tensor(reader, name, max_bytes)
        # Same dtype, shape and order: the data region is copied byte for byte.
        self._order.check(self.info, tuple(slice(0, n) for n in self.info.shape))
        copy_bytes(reader.fileno(), reader.data_offset, self.info.nbytes, self._file, reader.path)

    def _finish(self) -> None:
        if self._order.expected.get(self.info.name, 0) != self.info.size:
            raise FormatError(f"internal error: tensor {self.info.name!r} incomplete", self.target)
        self._file.flush()
        self._file.close()

    def _close_quietly(self) -> None:
        self._file.close()
