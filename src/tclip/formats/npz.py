""".npz archives: one tensor per ``NAME.npy`` member, in archive order.

Members are opened one at a time through ``zipfile`` and read in blocks, never
the whole archive (``np.load`` on an .npz is lazy too, but reads a member whole).
Stored members are read straight from the archive at their data offset; deflated
ones are decompressed as a stream. A rewrite keeps each member's name, order,
compression and timestamp.
"""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path
from typing import IO

import numpy as np

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
    contiguous_span,
    normalize_index,
    write_all,
)
from .npy import header_bytes, is_numeric, parse_header

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # the fixed 30 bytes of a zip local file header


class NpzReader(TensorReader):
    format_name = "npz"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        try:
            self._zip = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as error:
            raise FormatError(f"not a valid .npz archive ({error})", path) from None
        self._fd = self._zip.fp.fileno() if self._zip.fp is not None else -1
        self._source = RegionSource(self._fd, self.path)
        self.members: dict[str, zipfile.ZipInfo] = {}
        self.headers: dict[str, bytes] = {}
        self._data_start: dict[str, int] = {}
        self._absolute: dict[str, int] = {}
        self._stream: tuple[str, IO[bytes]] | None = None
        try:
            for member in self._zip.infolist():
                self._add_member(member)
        except BaseException:
            self._zip.close()
            raise

    def _add_member(self, member: zipfile.ZipInfo) -> None:
        path = self.path
        if member.is_dir():
            return
        if not member.filename.endswith(".npy"):
            raise FormatError(f"member {member.filename!r} is not a .npy array", path)
        if member.flag_bits & 0x1:
            raise UnsupportedError(f"member {member.filename!r} is encrypted", path)
        if member.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise UnsupportedError(f"member {member.filename!r} uses an unsupported compression", path)
        name = member.filename[: -len(".npy")]
        if name in self.tensors:
            raise FormatError(f"member {member.filename!r} appears twice", path)
        try:
            with self._zip.open(member) as stream:
                dtype, shape, fortran, header_length = parse_header(stream, path, member.filename)
                stream.seek(0)
                header = stream.read(header_length)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
            if isinstance(error, FormatError):
                raise
            raise FormatError(f"member {member.filename!r} cannot be read ({error})", path) from None
        nbytes = checked_size(shape, dtype.itemsize, path, name)
        if member.file_size != header_length + nbytes:
            raise FormatError(
                f"member {member.filename!r} is truncated or padded: its header promises "
                f"{nbytes} bytes of data, it holds {member.file_size - header_length}", path)
        self.tensors[name] = TensorInfo(name, shape, dtype, fortran, numeric=is_numeric(dtype))
        self.members[name] = member
        self.headers[name] = header
        self._data_start[name] = header_length
        if member.compress_type == zipfile.ZIP_STORED:
            self._absolute[name] = self._stored_data_offset(member) + header_length

    def _stored_data_offset(self, member: zipfile.ZipInfo) -> int:
        """Where a stored member's bytes begin in the archive (after its local header)."""
        raw = os.pread(self._fd, _LOCAL_HEADER.size, member.header_offset)
        if len(raw) != _LOCAL_HEADER.size or raw[:4] != b"PK\x03\x04":
            raise FormatError(f"member {member.filename!r}: bad local header", self.path)
        fields = _LOCAL_HEADER.unpack(raw)
        name_length, extra_length = fields[-2], fields[-1]
        offset = member.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        if offset + member.file_size > os.fstat(self._fd).st_size:
            raise FormatError(f"member {member.filename!r} is truncated", self.path)
        return offset

    def close(self) -> None:
        if self._stream is not None:
            self._stream[1].close()
            self._stream = None
        self._zip.close()

    def read(self, name: str, index: Index | None = None, scratch: bytearray | None = None) -> np.ndarray:
        info = self.tensors[name]
        if name in self._absolute:
            return self._source.read(self._absolute[name], info, index, scratch)
        index = normalize_index(index, info.shape)
        span = contiguous_span(index, info.shape, info.fortran_order)
        if span is None:
            # A deflated member is a stream: read the rows that cover the block, in
            # storage-order runs, and cut the block out of each.
            return self._read_by_runs(info, index)
        first, count = span
        shape = tuple(s.stop - s.start for s in index)
        raw = self._read_bytes(name, self._data_start[name] + first * info.dtype.itemsize,
                               count * info.dtype.itemsize)
        return np.frombuffer(bytearray(raw), dtype=info.dtype).reshape(
            shape, order="F" if info.fortran_order else "C")

    def _read_by_runs(self, info: TensorInfo, index: Index) -> np.ndarray:
        out = np.empty(tuple(s.stop - s.start for s in index), dtype=info.dtype,
                       order="F" if info.fortran_order else "C")
        # Iterate over the outermost storage axis one slab at a time (each slab contiguous).
        axis = len(info.shape) - 1 if info.fortran_order else 0
        for position in range(index[axis].start, index[axis].stop):
            slab = list(index)
            slab[axis] = slice(position, position + 1)
            whole = [slice(0, n) for n in info.shape]
            whole[axis] = slice(position, position + 1)
            part = self.read(info.name, tuple(whole))
            local = tuple(slice(s.start, s.stop) if i != axis else slice(0, 1) for i, s in enumerate(slab))
            target = [slice(None)] * len(info.shape)
            target[axis] = slice(position - index[axis].start, position - index[axis].start + 1)
            out[tuple(target)] = part[local]
        return out

    def _read_bytes(self, name: str, offset: int, nbytes: int) -> bytes:
        if self._stream is None or self._stream[0] != name:
            if self._stream is not None:
                self._stream[1].close()
            self._stream = (name, self._zip.open(self.members[name]))
        stream = self._stream[1]
        try:
            stream.seek(offset)  # forward seeks decompress and discard; backward ones restart
            data = stream.read(nbytes)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
            raise FormatError(f"member {self.members[name].filename!r} is corrupt ({error})", self.path) from None
        if len(data) != nbytes:
            raise FormatError(f"member {self.members[name].filename!r} is truncated", self.path)
        return data


class NpzWriter(TensorWriter):
    format_name = "npz"

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput,
                 like: TensorReader | None = None) -> None:
        super().__init__(target, tensors, output)
        self._like = like if isinstance(like, NpzReader) else None
        self._order_names = [t.name for t in tensors]
        self._position = 0  # index of the member being written
        self._member: IO[bytes] | None = None
        self._blocks = SequentialBlocks()
        for info in tensors:  # refuse what .npy cannot record before writing anything
            if self._template_header(info) is None:
                header_bytes(info.dtype, info.shape, info.fortran_order)
        self._zip = zipfile.ZipFile(output.temp, "w", allowZip64=True)

    def _template_header(self, info: TensorInfo) -> bytes | None:
        if self._like is not None and self._like.tensors.get(info.name) == info:
            return self._like.headers[info.name]
        return None

    def _zipinfo(self, info: TensorInfo) -> zipfile.ZipInfo:
        if self._like is not None and info.name in self._like.members:
            original = self._like.members[info.name]
            member = zipfile.ZipInfo(original.filename, original.date_time)
            member.compress_type = original.compress_type
            member.external_attr = original.external_attr
            return member
        member = zipfile.ZipInfo(info.name + ".npy", (1980, 1, 1, 0, 0, 0))
        member.compress_type = zipfile.ZIP_STORED  # what np.savez writes
        member.external_attr = 0o600 << 16
        return member

    def _open_member(self, index: int) -> None:
        info = self.tensors[self._order_names[index]]
        self._member = self._zip.open(self._zipinfo(info), "w", force_zip64=True)
        header = self._template_header(info) or header_bytes(info.dtype, info.shape, info.fortran_order)
        self._member.write(header)

    def _close_member(self) -> None:
        name = self._order_names[self._position]
        if self._member is None:
            self._open_member(self._position)
        if self._blocks.expected.get(name, 0) != self.tensors[name].size:
            raise FormatError(f"internal error: tensor {name!r} incomplete", self.target)
        assert self._member is not None
        self._member.close()
        self._member = None
        self._position += 1

    def write(self, name: str, index: Index, data: np.ndarray) -> None:
        target = self._order_names.index(name)
        if target < self._position:
            raise FormatError(f"internal error: tensor {name!r} written out of order", self.target)
        while self._position < target:
            self._close_member()
        if self._member is None:
            self._open_member(self._position)
        info = self.tensors[name]
        self._blocks.check(info, index)
        assert self._member is not None
        write_all(self._member, np.asarray(data, dtype=info.dtype), info.fortran_order)

    def _finish(self) -> None:
        while self._position < len(self._order_names):
            self._close_member()
        self._zip.close()

    def _close_quietly(self) -> None:
        try:
            if self._member is not None:
                self._member.close()
            self._zip.close()
        except Exception:  # the file is being thrown away
            pass
