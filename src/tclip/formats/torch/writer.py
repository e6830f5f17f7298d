"""PyTorch rewrites in place: the output starts as a byte copy of the source without the bytes that will
be rewritten, and the rewritten tensors' elements are written where their views put them, so the pickle,
the zip structure, the member order and the 64-byte alignment stay byte for byte. The CRC-32 of every
rewritten member is set anew (local header, data descriptor, central directory); a file saved with
CRC-32s off is rewritten with them left 0. Writing a PyTorch file from another format is refused:
there is no pickle to keep.
"""

from __future__ import annotations

import math
import os
import struct
import threading
import zlib
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ...core.units import Index, flat_rectangles
from ...errors import FormatError, UnsupportedError
from .._blocks import contiguous_span, normalize_index
from .._io import as_bytes, copy_except, pread_into, pwrite_all
from ..atomic import AtomicOutput
from ..base import TensorInfo, TensorReader, TensorWriter
from .reader import _CHUNK, _LOCAL_HEADER, NAME, TorchReader, View, _pieces, _strided

if TYPE_CHECKING:
    from .pickled import TensorRef


class _Member(NamedTuple):
    """Where a storage member's CRC-32 lives in the output."""

    name: str
    data_offset: int
    size: int
    crc_offsets: tuple[int, ...]  # local header (when set there), data descriptor, central directory


class TorchWriter(TensorWriter):
    """Rewrites tensors of a ``torch.save`` file in a copy of it (see the module's docstring)."""

    format_name = NAME

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput, *,
                 like: TorchReader, rewritten: Collection[str] | None) -> None:
        super().__init__(target, tensors, output)
        self.like = like
        chosen = None if rewritten is None else set(rewritten)
        names = [n for n in like.tensors if chosen is None or n in chosen]
        self.rewritten = set(names)
        # Identical views are written once, by the first: the others' writes carry the same bytes.
        first_of: dict[tuple[Any, ...], str] = {}
        self._silent: set[str] = set()
        for name in names:
            key = like.views[name].identity
            if key in first_of:
                self._silent.add(name)
            else:
                first_of[key] = name
        # A storage with a rewritten view that is not one run is patched by read-modify-write
        # of pieces: every write into it then takes the storage's lock.
        self._locks = {like.views[n].storage.key: threading.Lock() for n in names
                       if not like.views[n].dense and n not in self._silent}
        self._lock = threading.Lock()
        self._written: dict[str, int] = {}
        self._runs: dict[str, list[tuple[int, int, int]]] = {}  # storage key -> (file offset, bytes, crc)
        size = os.fstat(like._fd).st_size
        self._size = size
        # A file saved with CRC-32s off keeps them off (0): one real CRC among zeros would
        # read as damage, here and in zip tools alike.
        self._members = self._locate_members() if like.archive.format == "zip" and like.archive.crc32 else {}
        # (an empty view has no bytes, and its offset may lie anywhere: torch loads one at 2**62)
        holes = [(like.views[n].first_byte, like.views[n].ref.nbytes) for n in names
                 if like.views[n].dense and n not in self._silent and like.views[n].ref.nbytes
                 and like.views[n].storage.key not in self._locks]
        self._fd = output.open()
        try:
            os.ftruncate(self._fd, size)
            copy_except(like._fd, self._fd, size, holes, like.path)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise

    def _locate_members(self) -> dict[str, _Member]:
        """The CRC fields of each storage member that will be rewritten, checked."""
        like = self.like
        keys = {like.views[n].storage.key for n in self.rewritten}
        with os.fdopen(os.dup(like._fd), "rb") as handle:
            return locate_members(like._fd, handle, {key: like.archive.storages[key] for key in keys}, like.path)

    def parallel_safe(self, name: str) -> bool:
        return True

    def write_flat(self, name: str, start: int, data: np.ndarray) -> None:
        self._check_rewritten(name)
        view = self.like.views[name]
        values = np.asarray(data)
        if values.dtype != view.ref.dtype:
            values = values.astype(view.ref.dtype)
        count = values.size
        if name not in self._silent and count:
            if view.dense:
                self._write_run(view, view.first_byte + start * view.ref.dtype.itemsize, values)
            else:
                position = 0
                for rect in flat_rectangles(view.ref.shape, start, start + count):
                    sizes = tuple(s.stop - s.start for s in rect)
                    n = math.prod(sizes)
                    self._scatter(view, tuple(s.start for s in rect), values[position:position + n].reshape(sizes))
                    position += n
        with self._lock:
            self._written[name] = self._written.get(name, 0) + count

    def write(self, name: str, index: Index, data: np.ndarray) -> None:
        self._check_rewritten(name)
        view = self.like.views[name]
        index = normalize_index(index, view.ref.shape)
        values = np.asarray(data, dtype=view.ref.dtype)
        if view.dense:
            span = contiguous_span(index, view.ref.shape, False) if index else (0, 1)
            if span is None:
                raise FormatError(f"internal error: block {index} of {name!r} is not contiguous", self.target)
            self.write_flat(name, span[0], values.reshape(-1))
            return
        if name not in self._silent and values.size:
            self._scatter(view, tuple(s.start for s in index), values.reshape(tuple(s.stop - s.start for s in index)))
        with self._lock:
            self._written[name] = self._written.get(name, 0) + values.size

    def _check_rewritten(self, name: str) -> None:
        if name not in self.rewritten:
            raise FormatError(f"internal error: tensor {name!r} was not announced as rewritten", self.target)

    def _write_run(self, view: View, offset: int, values: np.ndarray) -> None:
        raw = as_bytes(_stored(view.ref, values))
        lock = self._locks.get(view.storage.key)
        if lock is not None:
            with lock:
                pwrite_all(self._fd, raw, offset)
            return
        crc = zlib.crc32(raw)  # the GIL is released for large buffers: runs check in parallel
        pwrite_all(self._fd, raw, offset)
        with self._lock:
            self._runs.setdefault(view.storage.key, []).append((offset, len(raw), crc))

    def _scatter(self, view: View, lo: tuple[int, ...], values: np.ndarray) -> None:
        """Write a block of a view that is not one run: each piece is read from the output,
        its elements set, and written back, under its storage's lock (the gaps between
        the elements may belong to other tensors)."""
        ref = view.ref
        itemsize = ref.dtype.itemsize
        stored = _stored(ref, values)
        lock = self._locks[view.storage.key]
        for index, first, span in _pieces(view, lo, stored.shape):
            offset = view.storage.offset + first * itemsize
            raw = np.empty(span * itemsize, np.uint8)
            with lock:
                pread_into(self._fd, raw.data, offset, self.target, ref.storage.key)
                target = _strided(raw.view(ref.dtype), ref, stored[index].shape, writeable=True)
                target[...] = stored[index]
                pwrite_all(self._fd, raw.data, offset)

    def copy_tensor(self, reader: TensorReader, name: str, max_bytes: int = 8 << 20) -> None:
        """Tensors not rewritten are in the copy already."""
        if reader is not self.like:
            raise FormatError("internal error: a PyTorch file is written only from itself", self.target)

    def _finish(self) -> None:
        for name in self.rewritten:
            if self._written.get(name, 0) != self.like.tensors[name].size:
                raise FormatError(f"internal error: tensor {name!r} incomplete", self.target)
        for key, member in self._members.items():
            runs = None if key in self._locks else self._runs.get(key, [])
            packed = struct.pack("<L", self._member_crc(member, runs))
            for offset in member.crc_offsets:
                os.pwrite(self._fd, packed, offset)
        fd, self._fd = self._fd, -1
        os.close(fd)

    def _member_crc(self, member: _Member, runs: list[tuple[int, int, int]] | None) -> int:
        return member_crc(self._fd, member, runs, self.target)

    def _close_quietly(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass


def locate_members(fd: int, handle: Any, storages: dict[str, Any], path: object) -> dict[str, _Member]:
    """Where the CRC-32 of each zip member holding one of ``storages`` (key -> the archive's
    storage record: ``member``, ``offset``, ``nbytes``) lives, checked: ``handle`` is the file
    object ``zipfile`` reads the zip from (a window ending at the zip's end, for a zip inside a
    larger file), ``fd`` the file's descriptor; offsets are the file's."""
    import zipfile

    try:
        with zipfile.ZipFile(handle) as archive:
            infos = archive.infolist()
            entries = _directory_entries(fd, archive.start_dir, len(infos))
    except (zipfile.BadZipFile, ValueError, struct.error, OSError) as error:
        raise FormatError(f"not a valid zip archive ({error})", path) from None
    by_name = {info.filename: (info, entry) for info, entry in zip(infos, entries)}
    members: dict[str, _Member] = {}
    for key, storage in storages.items():
        info, entry = by_name[storage.member]
        offsets = [entry + 16]
        fields = _LOCAL_HEADER.unpack(os.pread(fd, _LOCAL_HEADER.size, info.header_offset))
        flags, local_crc = fields[2], fields[6]
        if not flags & 0x8 or local_crc != 0:
            if local_crc != info.CRC:
                raise FormatError(f"member {storage.member!r}: its local header and the central directory "
                                  "disagree on its CRC-32", path)
            offsets.append(info.header_offset + 14)
        if flags & 0x8:
            end = storage.offset + storage.nbytes
            tail = os.pread(fd, 8, end)
            crc = struct.pack("<L", info.CRC)
            if tail[:4] == b"PK\x07\x08" and tail[4:8] == crc:
                offsets.append(end + 4)
            elif tail[:4] == crc:
                offsets.append(end)
            else:
                raise FormatError(f"member {storage.member!r}: no data descriptor with its CRC-32 after "
                                  "its data", path)
        members[key] = _Member(storage.member, storage.offset, storage.nbytes, tuple(offsets))
    return members


def member_crc(fd: int, member: _Member, runs: list[tuple[int, int, int]] | None, path: object) -> int:
    """A member's CRC-32 from the CRCs of the runs ``(offset, bytes, crc)`` written into it and
    of the bytes between them (read back from ``fd``); with ``runs`` None, or runs that overlap,
    from all its bytes read back."""
    from ..npz import crc32_combine

    start, stop = member.data_offset, member.data_offset + member.size
    ordered = sorted(runs or [])
    if runs is None or any(b[0] < a[0] + a[1] for a, b in zip(ordered, ordered[1:])):
        return crc_of(fd, start, stop, path)
    total, position = 0, start  # 0: the CRC-32 of no bytes
    for offset, length, crc in ordered:
        if offset > position:
            total = crc32_combine(total, crc_of(fd, position, offset, path), offset - position)
        total = crc32_combine(total, crc, length)
        position = offset + length
    if position < stop:
        total = crc32_combine(total, crc_of(fd, position, stop, path), stop - position)
    return total


def crc_of(fd: int, start: int, stop: int, path: object) -> int:
    """The CRC-32 of bytes ``[start, stop)`` of ``fd``."""
    crc = 0
    position = start
    while position < stop:
        chunk = os.pread(fd, min(_CHUNK, stop - position), position)
        if not chunk:
            raise FormatError("internal error: the output is shorter than its source", path)
        crc = zlib.crc32(chunk, crc)
        position += len(chunk)
    return crc


def _directory_entries(fd: int, start: int, count: int) -> list[int]:
    """File offsets of the central directory's entries, in order (``start``: where zipfile
    found the directory, past any zip64 records and data prepended to the archive)."""
    offsets, position = [], start
    for _ in range(count):
        head = os.pread(fd, 46, position)
        if len(head) != 46 or head[:4] != b"PK\x01\x02":
            raise ValueError("bad central directory entry")
        name_length, extra_length, comment_length = struct.unpack("<HHH", head[28:34])
        offsets.append(position)
        position += 46 + name_length + extra_length + comment_length
    return offsets


def _stored(ref: TensorRef, values: np.ndarray) -> np.ndarray:
    """The values as the storage holds them (a view with torch's lazy negative bit stores -x)."""
    values = np.ascontiguousarray(values, dtype=ref.dtype)
    return np.negative(values) if ref.neg else values


def Writer(target: Path, tensors: list[TensorInfo], output: AtomicOutput, *,  # noqa: N802 (the format's writer)
           like: TensorReader | None, metadata: dict[str, str] | None,
           rewritten: Collection[str] | None) -> TensorWriter:
    """A rewrite of a PyTorch file itself; from another format, refused (no pickle to keep)."""
    if not isinstance(like, TorchReader):
        raise UnsupportedError("tclip writes a PyTorch file only as a rewrite of one (its pickle is kept byte "
                               "for byte); write .safetensors instead", target)
    if [t.name for t in tensors] != list(like.tensors):
        raise UnsupportedError("a PyTorch file is rewritten with all its tensors; write .safetensors to leave "
                               "some out", target)
    return TorchWriter(target, tensors, output, like=like, rewritten=rewritten)
