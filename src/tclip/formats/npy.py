""".npy files: one tensor, named after the file's stem.

The header is parsed here, as data (``ast.literal_eval`` of a bounded text: no
code runs, no pickle), for the format's versions 1.0, 2.0 and 3.0, with
Python 2's ``2L`` integers accepted; only NumPy's documented
``numpy.lib.format`` functions are used (descriptor <-> dtype, header writers).
The data is read and written in runs straight from and to the file, never
through ``np.load``. A rewrite reuses the original header bytes, so an
unclipped round trip is byte-identical.
"""

from __future__ import annotations

import ast
import io
import os
import re
import struct
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import IO, Any

import numpy as np
from numpy.lib import format as npy_format

from ..core.dtypes import ML_FLOAT_TYPES
from ..core.units import Index
from ..errors import FormatError, UnsupportedError
from .atomic import AtomicOutput
from .base import (
    PositionalWriter,
    TensorInfo,
    TensorReader,
    checked_size,
    read_region,
)

NAME = "npy"
SUFFIXES = (".npy",)
HOLDS_METADATA = False

MAGIC = b"\x93NUMPY"


def sniff(head: bytes, size: int) -> bool:
    return head.startswith(MAGIC)
# numpy's own default limit on header size; larger headers are refused, not parsed.
MAX_HEADER_SIZE = 10000
_PY2_LONG = re.compile(r"(?<=[0-9])L\b")


def parse_header(stream: IO[bytes], path: object, name: str,
                 allow_objects: bool = False) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """Read an .npy header from ``stream``: (dtype, shape, fortran_order, header length).

    An object array (a pickle) is an error unless ``allow_objects``: then the caller
    gets its dtype and must never read its data (only copy its bytes)."""
    where = f"member {name!r}: " if name else ""

    def bad(message: str) -> FormatError:
        return FormatError(f"{where}not a valid .npy header ({message})", path)

    prefix = stream.read(8)
    if len(prefix) != 8 or not prefix.startswith(MAGIC):
        raise bad("no .npy magic string")
    version = (prefix[6], prefix[7])
    if version == (1, 0):
        raw = stream.read(2)
        length = struct.unpack("<H", raw)[0] if len(raw) == 2 else -1
    elif version in ((2, 0), (3, 0)):
        raw = stream.read(4)
        length = struct.unpack("<I", raw)[0] if len(raw) == 4 else -1
    else:
        raise bad(f"unsupported format version {version[0]}.{version[1]}")
    if length < 0:
        raise bad("file ends inside the header")
    if length > MAX_HEADER_SIZE:
        raise bad(f"header of {length} bytes exceeds the limit of {MAX_HEADER_SIZE}")
    text_bytes = stream.read(length)
    if len(text_bytes) != length:
        raise bad("file ends inside the header")
    try:
        text = text_bytes.decode("utf-8" if version == (3, 0) else "latin-1")
    except UnicodeDecodeError:
        raise bad("header is not UTF-8 text") from None
    header = _literal(text)
    if header is None:
        header = _literal(_PY2_LONG.sub("", text))  # Python 2 wrote shapes as (2L, 3L)
    if header is None:
        raise bad("header is not a Python literal")
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise bad("header must hold exactly 'descr', 'fortran_order' and 'shape'")
    shape, fortran = header["shape"], header["fortran_order"]
    if not isinstance(shape, tuple) or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
        raise bad(f"shape {shape!r} is not a tuple of integers")
    if not isinstance(fortran, bool):
        raise bad(f"fortran_order {fortran!r} is not True or False")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy warns about some old descriptors; the dtype is what counts
            dtype = npy_format.descr_to_dtype(header["descr"])
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, MemoryError):
        raise bad(f"unknown dtype descriptor {str(header['descr'])[:80]!r}") from None
    if dtype.hasobject and not allow_objects:
        what = f"tensor {name.removesuffix('.npy')!r}" if name else "the array"
        raise UnsupportedError(f"{what} holds Python objects; loading it would need pickle, which tclip never runs",
                               path)
    if dtype.itemsize == 0:
        raise bad(f"dtype {dtype} has no size")
    checked_size(shape, dtype.itemsize, path, name or "array")
    return dtype, shape, fortran, stream.tell()


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


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


def array_info(name: str, shape: tuple[int, ...], dtype: np.dtype, fortran: bool) -> TensorInfo:
    """A .npy array's :class:`TensorInfo`. Raw records (``|V2``: no fields) are what ``np.save``
    writes for a type it cannot name -- bfloat16 or float8 of ml_dtypes: they may hold floats,
    so they are of a type tclip cannot read (never measured; no check passes over them)."""
    if dtype.kind == "V" and dtype.fields is None and dtype.subdtype is None:
        return TensorInfo(name, shape, dtype, fortran, numeric=False, unreadable_type=True,
                          dtype_label=f"raw {dtype.itemsize}-byte records (not supported)")
    return TensorInfo(name, shape, dtype, fortran, numeric=is_numeric(dtype))


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
            self.tensors[name] = array_info(name, shape, dtype, fortran)
        except BaseException:
            self._file.close()
            raise

    def close(self) -> None:
        self._file.close()

    def region(self, name: str) -> tuple[int, int] | None:
        return self._file.fileno(), self.data_offset

    def read(self, name: str, index: Index | None = None, scratch: bytearray | None = None) -> np.ndarray:
        return read_region(self, name, index)


class NpyWriter(PositionalWriter):
    format_name = "npy"

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput, *,
                 like: TensorReader | None, metadata: dict[str, str] | None,
                 rewritten: Collection[str] | None) -> None:
        # metadata: .npy holds none (a conversion reports it lost); rewritten: every write is positional
        if len(tensors) != 1:
            names = ", ".join(t.name for t in tensors[:5])
            raise UnsupportedError(f".npy holds exactly one tensor, this would need {len(tensors)} ({names}); "
                                   "write .npz or .safetensors instead", target)
        super().__init__(target, tensors, output)
        (self.info,) = tensors
        if self.info.dtype.hasobject or self.info.dtype.kind not in "biufcmMSUV":
            # Records, strings and dates are raw bytes under a header NumPy writes (and are copied
            # byte for byte); Python objects would be a pickle, never written from its values.
            raise UnsupportedError(f"tensor {self.info.name!r} of dtype {self.info.dtype} cannot be written",
                                   target)
        if isinstance(like, NpyReader) and like.tensors.get(self.info.name) == self.info:
            header = like.header
        else:
            header = header_bytes(self.info.dtype, self.info.shape, self.info.fortran_order)
        self.offsets[self.info.name] = len(header)
        self._open(header, len(header) + self.info.nbytes)


Reader = NpyReader
Writer = NpyWriter
