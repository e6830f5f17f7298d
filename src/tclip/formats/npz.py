""".npz archives: one tensor per ``NAME.npy`` member, in archive order.

Members are opened one at a time through ``zipfile`` and read in runs, never
the whole archive. Stored members (what ``np.savez`` writes) are read straight
from the archive at their data offset, from any thread; deflated ones are
decompressed as a stream, in order.

Two writers: rewriting an archive whose rewritten members are all stored
patches a copy of it (:class:`NpzPatchWriter`: the new data is written in
place with ``pwrite`` and each member's CRC-32 is combined from the CRCs of its
runs), which is as fast as the disk; anything else (deflated members, another
source format) streams through ``zipfile`` (:class:`NpzWriter`), keeping each
member's name, order, compression and timestamp.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

import numpy as np

from ..core.units import Index
from ..errors import FormatError, UnsupportedError
from ._blocks import contiguous_span, normalize_index
from ._io import copy_except, write_all
from .atomic import AtomicOutput
from .base import (
    PositionalWriter,
    TensorInfo,
    TensorReader,
    TensorWriter,
    checked_size,
    read_region,
)
from .npy import array_info, header_bytes, parse_header

if TYPE_CHECKING:
    import zipfile

NAME = "npz"
SUFFIXES = (".npz",)
HOLDS_METADATA = False

def sniff(head: bytes, size: int) -> bool:
    return head.startswith((b"PK\x03\x04", b"PK\x05\x06"))  # a zip archive (an empty one too)


_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # the fixed 30 bytes of a zip local file header
def zip_errors() -> tuple[type[BaseException], ...]:
    """What zipfile and zlib raise on a damaged archive; all mean "this file is malformed".

    (zipfile is imported where it is used, not with this module: the format registry
    imports every format module, and a run without .npz files need not pay for it.)"""
    import zipfile

    return (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, NotImplementedError,
            IndexError, KeyError, struct.error, zlib.error, RuntimeError, UnicodeDecodeError, OverflowError,
            TypeError)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:200]


class NpzReader(TensorReader):
    format_name = "npz"

    def __init__(self, path: Path) -> None:
        import zipfile

        super().__init__(path)
        try:
            self._zip = zipfile.ZipFile(path)
        except zip_errors() as error:
            raise FormatError(f"not a valid .npz archive ({_first_line(error)})", path) from None
        except RecursionError:
            raise FormatError("not a valid .npz archive", path) from None
        self._fd = self._zip.fp.fileno() if self._zip.fp is not None else -1
        self.members: dict[str, zipfile.ZipInfo] = {}
        self.headers: dict[str, bytes] = {}
        self._data_start: dict[str, int] = {}
        self.absolute: dict[str, int] = {}  # stored members: file offset of the array data
        self._stream: tuple[str, IO[bytes]] | None = None
        self._lock = threading.Lock()
        try:
            self._file_size = os.fstat(self._fd).st_size
            self._check_extents()
            for member in self._zip.infolist():
                self._add_member(member)
        except BaseException:
            self._zip.close()
            raise

    def _add_member(self, member: zipfile.ZipInfo) -> None:
        import zipfile

        path = self.path
        if member.is_dir():
            return
        if not member.filename.endswith(".npy"):
            names = set(self._zip.namelist())
            if {"metadata.json", "config.json", "model.weights.h5"} <= names:
                raise FormatError("a Keras .keras archive, not an .npz: its weights are the member "
                                  "model.weights.h5 (extract it, e.g. with unzip, and give that file)", path)
            raise FormatError(f"member {member.filename!r} is not a .npy array", path)
        if member.flag_bits & 0x1:
            raise UnsupportedError(f"member {member.filename!r} is encrypted", path)
        if member.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise UnsupportedError(f"member {member.filename!r} uses an unsupported compression "
                                   f"(method {member.compress_type})", path)
        name = member.filename[: -len(".npy")]
        if name in self.tensors:
            raise FormatError(f"member {member.filename!r} appears twice", path)
        try:
            with self._zip.open(member) as stream:
                dtype, shape, fortran, header_length = parse_header(stream, path, member.filename,
                                                                    allow_objects=True)
                stream.seek(0)
                header = stream.read(header_length)
        except FormatError:
            raise
        except UnsupportedError:
            raise
        except zip_errors() as error:
            raise FormatError(f"member {member.filename!r} cannot be read ({_first_line(error)})", path) from None
        if dtype.hasobject:
            # A pickle: never read (that would run code), only carried byte for byte.
            self.tensors[name] = TensorInfo(name, shape, dtype, fortran, numeric=False,
                                            dtype_label="Python objects (pickle)")
            self.members[name] = member
            self.headers[name] = header
            self._data_start[name] = header_length
            return
        nbytes = checked_size(shape, dtype.itemsize, path, name)
        if member.file_size != header_length + nbytes:
            raise FormatError(
                f"member {member.filename!r} is truncated or padded: its header promises "
                f"{nbytes} bytes of data, it holds {member.file_size - header_length}", path)
        self.tensors[name] = array_info(name, shape, dtype, fortran)
        self.members[name] = member
        self.headers[name] = header
        self._data_start[name] = header_length
        if member.compress_type == zipfile.ZIP_STORED:
            self.absolute[name] = self._stored_data_offset(member) + header_length

    def _check_extents(self) -> None:
        """Each member's bytes (local header, name, extra field, data) are its own: members
        sharing bytes with each other or with the central directory are refused, as
        rewriting one would change another and a report would count bytes twice."""
        spans = []
        for member in self._zip.infolist():
            raw = os.pread(self._fd, _LOCAL_HEADER.size, member.header_offset)
            if len(raw) != _LOCAL_HEADER.size or raw[:4] != b"PK\x03\x04":
                continue  # opening the member reports it
            fields = _LOCAL_HEADER.unpack(raw)
            end = member.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1] + member.compress_size
            name = member.filename[: -len(".npy")] if member.filename.endswith(".npy") else member.filename
            spans.append((member.header_offset, end, f"tensor {name!r}"))
        spans.append((self._zip.start_dir, self._file_size, "the archive's central directory"))
        reach: tuple[int, int, str] | None = None
        for span in sorted(spans):
            if reach is not None and span[0] < reach[1]:
                raise FormatError(f"{reach[2]} and {span[2]} share bytes of the archive (at offset {span[0]}); "
                                  "refused as malformed", self.path)
            if reach is None or span[1] > reach[1]:
                reach = span

    def _stored_data_offset(self, member: zipfile.ZipInfo) -> int:
        """Where a stored member's bytes begin in the archive (after its local header)."""
        raw = os.pread(self._fd, _LOCAL_HEADER.size, member.header_offset)
        if len(raw) != _LOCAL_HEADER.size or raw[:4] != b"PK\x03\x04":
            raise FormatError(f"member {member.filename!r}: bad local header", self.path)
        fields = _LOCAL_HEADER.unpack(raw)
        name_length, extra_length = fields[-2], fields[-1]
        offset = member.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        if offset + member.file_size > self._file_size or member.compress_size != member.file_size:
            raise FormatError(f"member {member.filename!r} is truncated", self.path)
        return offset

    def close(self) -> None:
        if self._stream is not None:
            try:
                self._stream[1].close()
            except zip_errors():
                pass
            self._stream = None
        self._zip.close()

    def region(self, name: str) -> tuple[int, int] | None:
        if name in self.absolute:
            return self._fd, self.absolute[name]
        return None

    def stored_bytes(self, name: str, chunk: int = 1 << 20) -> Iterator[bytes] | None:
        """The member's bytes after its .npy header, stored or deflated (a pickle too:
        its bytes are compared or copied, never loaded)."""
        member, skip = self.members[name], self._data_start[name]

        def chunks() -> Iterator[bytes]:
            try:
                with self._zip.open(member) as stream:  # its own stream: zipfile shares the file safely
                    stream.read(skip)
                    while True:
                        data = stream.read(chunk)
                        if not data:
                            return
                        yield data
            except zip_errors() as error:
                raise FormatError(f"member {member.filename!r} cannot be read ({_first_line(error)})",
                                  self.path) from None

        return chunks()

    def read(self, name: str, index: Index | None = None, scratch: bytearray | None = None) -> np.ndarray:
        info = self.tensors[name]
        if name in self.absolute:
            return read_region(self, name, index)
        index = normalize_index(index, info.shape)
        span = contiguous_span(index, info.shape, info.fortran_order) if info.shape else (0, 1)
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

    def read_flat(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        if name in self.absolute:
            return super().read_flat(name, start, stop, out)
        info = self.tensors[name]
        raw = self._read_bytes(name, self._data_start[name] + start * info.dtype.itemsize,
                               (stop - start) * info.dtype.itemsize)
        if out is not None and out.size >= len(raw):
            out[: len(raw)] = np.frombuffer(raw, np.uint8)
            return out[: len(raw)].view(info.dtype)
        return np.frombuffer(bytearray(raw), dtype=info.dtype)

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
        with self._lock:  # one decompressing stream, read in order
            if self._stream is None or self._stream[0] != name:
                if self._stream is not None:
                    self._stream[1].close()
                    self._stream = None
                try:
                    self._stream = (name, self._zip.open(self.members[name]))
                except zip_errors() as error:
                    raise FormatError(f"member {self.members[name].filename!r} cannot be read "
                                      f"({_first_line(error)})", self.path) from None
            stream = self._stream[1]
            try:
                stream.seek(offset)  # forward seeks decompress and discard; backward ones restart
                data = stream.read(nbytes)
            except zip_errors() as error:
                raise FormatError(f"member {self.members[name].filename!r} is corrupt ({_first_line(error)})",
                                  self.path) from None
        if len(data) != nbytes:
            raise FormatError(f"member {self.members[name].filename!r} is truncated", self.path)
        return data


def _check_member_name(name: str, target: Path) -> None:
    """A member name must not climb out of the folder an unzip tool extracts into."""
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or ".." in parts or (len(name) > 1 and name[1] == ":") or "\0" in name:
        raise UnsupportedError(f"tensor name {name!r} would be an unsafe .npz member path (unzip would write "
                               "it outside its folder); write .safetensors instead", target)


class NpzWriter(TensorWriter):
    format_name = "npz"

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput, *,
                 like: TensorReader | None) -> None:
        import zipfile

        super().__init__(target, tensors, output)
        self._like = like if isinstance(like, NpzReader) else None
        self._order_names = [t.name for t in tensors]
        self._positions = {name: i for i, name in enumerate(self._order_names)}
        self._position = 0  # index of the member being written
        self._written = 0  # elements of the current member written so far
        self._member: IO[bytes] | None = None
        for info in tensors:  # refuse what .npy cannot record before writing anything
            if not info.numeric and self._template_header(info) is None:  # (a source member is copied as is)
                raise UnsupportedError(f"tensor {info.name!r} of dtype {info.dtype} cannot be written", target)
            if self._template_header(info) is None:
                header_bytes(info.dtype, info.shape, info.fortran_order)
                _check_member_name(info.name, target)
        self._file = os.fdopen(output.open(), "wb")
        try:
            self._zip = zipfile.ZipFile(self._file, "w", allowZip64=True)
        except BaseException:
            self._file.close()
            raise

    def _template_header(self, info: TensorInfo) -> bytes | None:
        if self._like is not None and self._like.tensors.get(info.name) == info:
            return self._like.headers[info.name]
        return None

    def _zipinfo(self, info: TensorInfo) -> zipfile.ZipInfo:
        import zipfile

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
        self._written = 0

    def _close_member(self) -> None:
        name = self._order_names[self._position]
        if self._member is None:
            self._open_member(self._position)
        if self._written != self.tensors[name].size:
            raise FormatError(f"internal error: tensor {name!r} incomplete", self.target)
        assert self._member is not None
        self._member.close()
        self._member = None
        self._position += 1

    def _advance_to(self, name: str) -> None:
        target = self._positions[name]
        if target < self._position:
            raise FormatError(f"internal error: tensor {name!r} written out of order", self.target)
        while self._position < target:
            self._close_member()
        if self._member is None:
            self._open_member(self._position)

    def write_flat(self, name: str, start: int, data: np.ndarray) -> None:
        self._advance_to(name)
        info = self.tensors[name]
        if start != self._written:
            raise FormatError(f"internal error: tensor {name!r} written out of order", self.target)
        assert self._member is not None
        write_all(self._member, np.asarray(data, dtype=info.dtype))
        self._written += data.size

    def write(self, name: str, index: Index, data: np.ndarray) -> None:
        info = self.tensors[name]
        index = normalize_index(index, info.shape)
        span = contiguous_span(index, info.shape, info.fortran_order) if info.shape else (0, 1)
        if span is None:
            raise FormatError(f"internal error: block {index} of {name!r} is not contiguous", self.target)
        array = np.asarray(data, dtype=info.dtype)
        self.write_flat(name, span[0], (array.T if info.fortran_order else array).reshape(-1))

    def copy_tensor(self, reader: TensorReader, name: str, max_bytes: int = 8 << 20) -> None:
        info = self.tensors[name]
        if reader is self._like and self._template_header(info) is not None:
            self._copy_member(name)  # unchanged: the source member's bytes, strings and dates included
            return
        step = max(1, max_bytes // max(1, info.dtype.itemsize))
        if info.size == 0:
            self._advance_to(name)
        for start in range(0, info.size, step):
            self.write_flat(name, start, reader.read_flat(name, start, min(info.size, start + step)))

    def _copy_member(self, name: str) -> None:
        target = self._positions[name]
        if target < self._position or (target == self._position and self._member is not None):
            raise FormatError(f"internal error: tensor {name!r} written out of order", self.target)
        while self._position < target:
            self._close_member()
        assert self._like is not None
        source = self._like.members[name]
        with self._zip.open(self._zipinfo(self.tensors[name]), "w", force_zip64=True) as write:
            try:
                read = self._like._zip.open(source)
            except zip_errors() as error:
                raise FormatError(f"member {source.filename!r} cannot be read ({_first_line(error)})",
                                  self._like.path) from None
            with read:
                while True:
                    try:
                        chunk = read.read(1 << 20)
                    except zip_errors() as error:  # a corrupt stream (its CRC is checked at the end)
                        raise FormatError(f"member {source.filename!r} cannot be read ({_first_line(error)})",
                                          self._like.path) from None
                    if not chunk:
                        break
                    write.write(chunk)
        self._position += 1

    def _finish(self) -> None:
        while self._position < len(self._order_names):
            self._close_member()
        self._zip.close()
        self._file.close()  # a ZipFile given an open file leaves closing it to its owner

    def _close_quietly(self) -> None:
        try:
            if self._member is not None:
                self._member.close()
        except Exception:  # the file is being thrown away
            pass
        try:
            self._zip.close()
        except Exception:
            pass
        # A ZipFile that failed to close still holds its file and would complain
        # when collected; it is being thrown away.
        fp = getattr(self._zip, "fp", None)
        if fp is not None:
            try:
                fp.close()
            except Exception:
                pass
        self._zip.fp = None
        try:
            self._file.close()
        except Exception:
            pass


# --------------------------------------------------------------------------- patching stored members


def _central_directory(fd: int, size: int) -> list[int]:
    """File offsets of the central directory entries, in directory order (zipfile's order)."""
    tail_length = min(size, 22 + 65535)
    tail = os.pread(fd, tail_length, size - tail_length)
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or end + 22 > len(tail):
        raise ValueError("no end of central directory")
    end_position = size - tail_length + end
    entries, directory_size, directory_offset = struct.unpack("<HLL", tail[end + 10:end + 20])
    record_position = end_position
    if entries == 0xFFFF or directory_offset == 0xFFFFFFFF or directory_size == 0xFFFFFFFF:
        locator = os.pread(fd, 20, end_position - 20)
        if len(locator) != 20 or locator[:4] != b"PK\x06\x07":
            raise ValueError("no zip64 locator")
        (record_position,) = struct.unpack("<Q", locator[8:16])
        record = os.pread(fd, 56, record_position)
        if len(record) != 56 or record[:4] != b"PK\x06\x06":
            raise ValueError("no zip64 end record")
        entries, directory_size, directory_offset = struct.unpack("<QQQ", record[32:56])
    start = record_position - directory_size
    directory = os.pread(fd, directory_size, start)
    offsets, position = [], 0
    for _ in range(entries):
        if directory[position:position + 4] != b"PK\x01\x02":
            raise ValueError("bad central directory entry")
        name_length, extra_length, comment_length = struct.unpack("<HHH", directory[position + 28:position + 34])
        offsets.append(start + position)
        position += 46 + name_length + extra_length + comment_length
    return offsets


_CRC_POLY = 0xEDB88320


def _gf2_apply(matrix: list[int], vector: int) -> int:
    result, i = 0, 0
    while vector:
        if vector & 1:
            result ^= matrix[i]
        vector >>= 1
        i += 1
    return result


_ZERO_OPERATORS: dict[int, list[int]] = {}


def _zeros_operator(length: int) -> list[int]:
    """The GF(2) matrix that advances a raw CRC-32 register over ``length`` zero bytes."""
    cached = _ZERO_OPERATORS.get(length)
    if cached is not None:
        return cached
    # One zero bit: shift right, xor the polynomial when the low bit falls out.
    operator = [_CRC_POLY] + [1 << (i - 1) for i in range(1, 32)]
    result = [1 << i for i in range(32)]  # identity
    bits = 8 * length
    while bits:
        if bits & 1:
            result = [_gf2_apply(operator, column) for column in result]
        bits >>= 1
        if bits:
            operator = [_gf2_apply(operator, column) for column in operator]
    if len(_ZERO_OPERATORS) < 64:
        _ZERO_OPERATORS[length] = result
    return result


def crc32_combine(first: int, second: int, second_length: int) -> int:
    """CRC-32 of A+B from crc(A), crc(B) and len(B) (CRC-32 is affine over GF(2))."""
    if second_length == 0:
        return first
    return _gf2_apply(_zeros_operator(second_length), first) ^ second


class NpzPatchWriter(PositionalWriter):
    """Rewrites stored members of an archive in place, in a copy of it.

    The copy takes every byte of the source but the data of the members to be
    rewritten; those are written with ``pwrite`` (any order, any thread), and
    at the end each rewritten member's CRC-32 (in its local header and its
    central directory entry) is set from the CRCs of its runs. Names, order,
    timestamps, extra fields and comments stay exactly as they were.
    """

    format_name = "npz"

    @staticmethod
    def usable(like: TensorReader, tensors: list[TensorInfo], rewritten: Collection[str] | None) -> bool:
        if not isinstance(like, NpzReader) or rewritten is None:
            return False
        if len(tensors) != len(like.tensors) or any(like.tensors.get(t.name) != t for t in tensors):
            return False
        return all(name in like.absolute and not like.members[name].flag_bits & 0x8 for name in rewritten)

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput,
                 like: NpzReader, rewritten: Collection[str]) -> None:
        super().__init__(target, tensors, output)
        self.like = like
        self.rewritten = set(rewritten)
        try:
            directory = _central_directory(like._fd, like._file_size)
        except (ValueError, struct.error, OSError) as error:
            raise FormatError(f"not a valid .npz archive ({error})", like.path) from None
        members = [m for m in like._zip.infolist()]
        if len(directory) != len(members):
            raise FormatError("not a valid .npz archive (central directory mismatch)", like.path)
        entry_of = {m.filename: offset for m, offset in zip(members, directory)}
        self._entries = {name: entry_of[like.members[name].filename] for name in self.rewritten}
        self._crcs: dict[str, list[tuple[int, int, int]]] = {name: [] for name in self.rewritten}
        for t in tensors:
            if t.name in like.absolute:
                self.offsets[t.name] = like.absolute[t.name]
        self._fd = output.open()
        os.ftruncate(self._fd, like._file_size)
        holes = [(like.absolute[name], self.tensors[name].nbytes) for name in self.rewritten]
        copy_except(like._fd, self._fd, like._file_size, holes, like.path)
        for name in self.tensors:  # everything not rewritten is in the copy already
            if name not in self.rewritten:
                self._written[name] = self.tensors[name].size

    def parallel_safe(self, name: str) -> bool:
        return name in self.rewritten

    def write_flat(self, name: str, start: int, data: np.ndarray) -> None:
        if name not in self.rewritten:
            raise FormatError(f"internal error: tensor {name!r} was not announced as rewritten", self.target)
        array = np.ascontiguousarray(data, dtype=self.tensors[name].dtype)
        raw = array.reshape(-1).view(np.uint8).data
        crc = zlib.crc32(raw)  # the GIL is released for large buffers: runs check in parallel
        super().write_flat(name, start, array)
        with self._lock:
            self._crcs[name].append((start, array.size, crc))

    def copy_tensor(self, reader: TensorReader, name: str, max_bytes: int = 8 << 20) -> None:
        if name in self.rewritten:
            super().copy_tensor(reader, name, max_bytes)

    def _finish(self) -> None:
        self._check_complete()
        for name in self.rewritten:
            member = self.like.members[name]
            crc = zlib.crc32(self.like.headers[name])
            itemsize = self.tensors[name].dtype.itemsize
            position = 0
            for start, count, part in sorted(self._crcs[name]):
                if start != position:
                    raise FormatError(f"internal error: tensor {name!r} written with gaps", self.target)
                crc = crc32_combine(crc, part, count * itemsize)
                position = start + count
            packed = struct.pack("<L", crc)
            os.pwrite(self._fd, packed, member.header_offset + 14)
            os.pwrite(self._fd, packed, self._entries[name] + 16)
        super()._finish()


def Writer(target: Path, tensors: list[TensorInfo], output: AtomicOutput, *,  # noqa: N802 (the format's writer)
           like: TensorReader | None, metadata: dict[str, str] | None,
           rewritten: Collection[str] | None) -> TensorWriter:
    """The patching writer where it applies, else the streaming one (.npz holds no metadata:
    a conversion reports it lost)."""
    if like is not None and NpzPatchWriter.usable(like, tensors, rewritten):
        assert isinstance(like, NpzReader) and rewritten is not None
        return NpzPatchWriter(target, tensors, output, like, rewritten)
    return NpzWriter(target, tensors, output, like=like)


Reader = NpzReader
