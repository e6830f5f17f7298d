"""GGUF files (llama.cpp, ollama, LM Studio) as a format module.

The header is parsed by :mod:`~tclip.formats.gguf.header` (every count and length checked
against the file, long arrays summarised); the types' sizes are
:mod:`~tclip.formats.gguf.ggml_types`. What the reader lists:

- F32, F16, BF16, F64 and the integer types as plain tensors (NumPy-order shape, the
  file's byte order): measured and clipped like the tensors of every other format;
- every quantized type ggml defines (Q4_0 ... Q6_K, IQ*, TQ*, Q8_K, MXFP4, ...) as one stored
  tensor of blocks each, under its GGUF name, tagged with its ggml type
  (:class:`GgmlStored`): the blocks' arithmetic (values, statistics, the scan of their
  scales, rescales) is :mod:`tclip.quant.ggml`, which decodes the types it understands and
  refuses the others;
- a type ggml does not define as an :class:`~tclip.formats.base.OtherObject` of an
  unreadable type (its size is unknown: its bytes are carried as they are).

A GGUF output is always a rewrite of its input: the file is copied byte for byte
(header, metadata, padding, untouched tensors) and only the data of the rewritten
tensors is written anew, at the same offsets. Nothing is converted to or from GGUF.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import FormatError, TclipError, UnsupportedError
from .._io import copy_except, flat_result, pread_into
from ..atomic import AtomicOutput
from ..base import (
    Encoding,
    EncodingSummary,
    OtherObject,
    PositionalWriter,
    TensorInfo,
    TensorReader,
    read_region,
)
from .ggml_types import type_name

if TYPE_CHECKING:
    from .header import GgufHeader, GgufTensor

NAME = "gguf"
SUFFIXES = (".gguf",)
HOLDS_METADATA = True

# Plain types: the stored elements are the values (F16/F32/F64 in the file's byte order).
_PLAIN = {0: "f4", 1: "f2", 28: "f8", 24: "i1", 25: "i2", 26: "i4", 27: "i8"}
BF16 = 30


def sniff(head: bytes, size: int) -> bool:
    """GGUF's magic (the same four bytes in little- and big-endian files)."""
    return head.startswith(b"GGUF")  # header.GGUF_MAGIC


def _bfloat16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


# --------------------------------------------------------------------------- metadata


def _metadata_value(value: Any, kind: Any) -> Any:
    """A metadata value as plain data (long arrays and strings summarised, never whole)."""
    from .header import GgufArray, GgufLongString

    if isinstance(value, GgufArray):
        return {"array": value.element_type.name, "length": value.length,
                "first": [_metadata_value(v, value.element_type) for v in value.head]}
    if isinstance(value, GgufLongString):
        return {"string_bytes": value.nbytes, "first": value.head}
    return value


# --------------------------------------------------------------------------- quantized blocks


class GgmlStored(Encoding):
    """A GGUF tensor of ggml blocks as the file stores it: ``nbytes`` bytes of blocks of ggml
    type ``type_id`` (a row, the last NumPy axis, is whole blocks) in ``byteorder``.

    Listed, never computed here: :mod:`tclip.quant.ggml` decodes it (its values, statistics
    and rescales)."""

    def __init__(self, name: str, shape: tuple[int, ...], type_id: int, byteorder: str, nbytes: int) -> None:
        self.name, self.shape, self.type_id, self.byteorder = name, shape, type_id, byteorder
        self.type_name = type_name(type_id)
        self._nbytes = nbytes
        self._summary = EncodingSummary(self.type_name, "GGUF (ggml blocks)", ((name, "blocks", "uint8", (nbytes,)),),
                                        (), "none")

    @property
    def summary(self) -> EncodingSummary:
        return self._summary

    @property
    def nbytes(self) -> int:
        return self._nbytes


# --------------------------------------------------------------------------- reader


class GgufReader(TensorReader):
    """A GGUF file, v2 or v3, either byte order, opened lazily (the header only)."""

    format_name = NAME

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        from .header import parse_gguf

        # A file cut after its header is listed (info reads headers only); reading its data is refused.
        self.header: GgufHeader = parse_gguf(path, data_may_be_missing=True)
        self.damage = self.header.truncated
        self.split = self.header.split  # (keys out of range are an error, whether or not it stands for a set)
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if os.fstat(self._fd).st_size != self.header.file_size:
                raise FormatError("the file changed while it was opened", path)
            order = self.header.byteorder
            self.offsets: dict[str, int] = {}
            self.ggml_types: dict[str, int] = {}
            self._swapped: set[str] = set()  # big-endian BF16: NumPy has no such dtype
            for key, value in self.header.metadata.items():
                self.metadata[key] = _metadata_value(value, self.header.metadata_types[key])
            for tensor in self.header.tensors:
                self._add(tensor, order)
        except BaseException:
            os.close(self._fd)
            raise

    def _add(self, tensor: GgufTensor, order: str) -> None:
        name, shape, kind = tensor.name, tensor.shape, tensor.ggml_type
        if not tensor.known:
            self.others.append(OtherObject(name, f"tensor of unknown ggml type {kind}", "tclip cannot read it; its "
                                           "bytes are carried as they are", shape, tensor.type_name,
                                           unreadable_type=True))
            return
        assert tensor.nbytes is not None
        self.offsets[name] = tensor.offset
        self.ggml_types[name] = kind
        if kind in _PLAIN:
            self.tensors[name] = TensorInfo(name, shape, np.dtype(order + _PLAIN[kind]))
        elif kind == BF16:
            if order == ">":
                self._swapped.add(name)
            self.tensors[name] = TensorInfo(name, shape, _bfloat16())
        else:  # blocks: tclip.quant.ggml computes their values
            self.tensors[name] = TensorInfo(name, shape, np.dtype(np.float16), dtype_label=tensor.type_name,
                                            encoding=GgmlStored(name, shape, kind, order, tensor.nbytes))

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def region(self, name: str) -> tuple[int, int] | None:
        info = self.tensors.get(name)
        if info is None or info.encoding is not None or name in self._swapped:
            return None
        return self._fd, self.offsets[name]

    def parallel_safe(self, name: str) -> bool:
        return True

    def part_parallel_safe(self, name: str) -> bool:
        return True

    def raw(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Bytes ``[start, stop)`` of a tensor's data."""
        result = flat_result(np.dtype(np.uint8), stop - start, out)
        pread_into(self._fd, result.data, self.offsets[name] + start, self.path, name)
        return result

    def read_part(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        if self.tensors[name].encoding is not None:  # the blocks' raw bytes
            return self.raw(name, start, stop, out)
        return self.read_flat(name, start, stop, out)

    def read_flat(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        info = self.tensors[name]
        if info.encoding is not None:
            raise TclipError(f"tensor {name!r} is {info.dtype_label} blocks: read it through its encoding", self.path)
        if name in self._swapped:
            data = self.raw(name, start * 2, stop * 2, out).view(">u2")
            data.byteswap(inplace=True)
            return data.view(info.dtype)
        return super().read_flat(name, start, stop, out)

    def read(self, name: str, index: Any = None, scratch: bytearray | None = None) -> np.ndarray:
        info = self.tensors[name]
        if name in self._swapped:
            return self.read_flat(name, 0, info.size).reshape(info.shape)[index if index is not None else ...]
        return read_region(self, name, index)

    def lost_in_conversion(self) -> list[str]:
        return [f"{t.name} ({t.dtype_label} blocks)" for t in self.tensors.values() if t.encoding is not None]


# --------------------------------------------------------------------------- writer


class GgufWriter(PositionalWriter):
    """A rewrite of a GGUF file: everything copied byte for byte at its offset, then the
    rewritten tensors' data written in place (values, or blocks with new scales)."""

    format_name = NAME

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput, *,
                 like: TensorReader | None, metadata: dict[str, str] | None,
                 rewritten: Collection[str] | None) -> None:
        if not isinstance(like, GgufReader):
            raise UnsupportedError("tclip writes GGUF files only by rewriting a GGUF file (no conversion into "
                                   "GGUF: its quantized types and metadata come from llama.cpp's converters)",
                                   target)
        if metadata is not None or {t.name for t in tensors} != set(like.tensors):
            raise UnsupportedError("a GGUF file is rewritten with all of its tensors and metadata as they are",
                                   target)
        super().__init__(target, [like.tensors[t.name] for t in tensors], output)
        self.like = like
        self.offsets = {name: like.offsets[name] for name in self.tensors}
        self._swapped = {name for name in like._swapped if name in self.tensors}
        self._fd = self.output.open()
        size = like.header.file_size
        os.ftruncate(self._fd, size)
        anew = set(self.tensors) if rewritten is None else {n for n in rewritten if n in self.tensors}
        holes = [(self.offsets[n], self.tensors[n].nbytes) for n in anew]
        copy_except(like._fd, self._fd, size, holes, like.path)
        self._copied = set(self.tensors) - anew

    def write_flat(self, name: str, start: int, data: np.ndarray) -> None:
        if name in self._swapped:  # back to the file's big-endian bfloat16
            data = np.asarray(data).astype(self.tensors[name].dtype).view("<u2").byteswap()
            super().write_flat(name, start, data.view(self.tensors[name].dtype))
            return
        super().write_flat(name, start, data)

    def copy_tensor(self, reader: TensorReader, name: str, max_bytes: int = 1 << 20) -> None:
        if name in self._copied:  # copied with the rest of the file
            with self._lock:
                self._written[name] = self._written.get(name, 0) + self._items(name)
            return
        super().copy_tensor(reader, name, max_bytes)


Reader = GgufReader
Writer = GgufWriter
