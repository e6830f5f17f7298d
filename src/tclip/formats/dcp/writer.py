"""A DCP folder rewritten as a copy of itself: every file at the same size, ``.metadata`` byte for byte.

Every tensor chunk of a ``.distcp`` file is a complete ``torch.save`` zip whose storage is stored
uncompressed, so a rewritten chunk keeps its size: its elements are written where the chunk's
view puts them and the CRC-32 of its storage member is set anew (local header, data descriptor,
central directory: :func:`..torch.writer.locate_members`). A chunk of the SAFETENSORS variant is
a run of the embedded safetensors file, which has no checksum. Every item's offset and length
stays, so ``.metadata`` (its ``planner_data`` too) is copied byte for byte, and so is every item
not rewritten (objects saved with ``torch.save``, tensors without work, optimizer state).

Refused, before anything is written (each one line): rewriting an item compressed through
``stream.zstd/1`` (compressed anew it would change length, and ``.metadata`` with it; items
not rewritten are copied as they are), a folder whose items sit in subfolders, an output that
is not a folder's ``.metadata`` (``--out-dir DIR`` names the folder), and the input folder itself.

The output's files appear one by one on commit, the ``.distcp`` files first and ``.metadata``
last (a folder without its ``.metadata`` is no DCP checkpoint); a failed commit removes those
it renamed, and :meth:`DcpWriter.also_written` tells the run which ``.distcp`` files are new, so
that a run failing or interrupted after the commit removes them with ``.metadata``.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...core.units import Index, flat_rectangles
from ...errors import FormatError, UnsupportedError
from .._blocks import contiguous_span, normalize_index
from .._io import as_bytes, copy_except, copy_range, pread_into, pwrite_all
from ..atomic import AtomicOutput, remove_if_same
from ..base import TensorInfo, TensorReader, TensorWriter
from ..torch.writer import _Member, locate_members, member_crc
from . import METADATA_NAME
from ._window import Window
from .reader import _ZIP_MAGIC, DcpReader, _Piece


@dataclass
class _Chunk:
    """A rewritten chunk: where its elements are (``piece``, the same offsets in the output as in
    the source), the zip member whose CRC-32 covers them (None for the SAFETENSORS variant), the
    runs written into it (``(offset, bytes, crc)``; None once a strided write read back bytes)."""

    piece: _Piece
    file: str
    member: _Member | None
    runs: list[tuple[int, int, int]] | None = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class DcpWriter(TensorWriter):
    """Rewrites tensors of a DCP folder in a copy of it (see the module's docstring)."""

    format_name = "dcp"

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput, *, like: DcpReader,
                 rewritten: Collection[str] | None) -> None:
        super().__init__(target, tensors, output)
        self.like = like
        self.rewritten = set(like.tensors if rewritten is None else rewritten)
        self._lock = threading.Lock()
        self._written: dict[str, int] = {}
        self._outputs: dict[str, AtomicOutput] = {}
        self._fresh: set[str] = set()  # the .distcp files where nothing was before (see also_written)
        self._fds: dict[str, int] = {}
        self.chunks: dict[str, list[_Chunk | None]] = {}  # per rewritten tensor, per piece (None: empty)
        holes: dict[str, list[tuple[int, int]]] = {}
        for name in sorted(self.rewritten):
            self.chunks[name] = [self._chunk(name, piece, holes) for piece in like.pieces[name]]
        self._check_disjoint()
        try:
            self._copy_files(holes)
        except BaseException:
            self._close_quietly()
            for out in self._outputs.values():
                out.abort()
            raise

    def _chunk(self, name: str, piece: _Piece, holes: dict[str, list[tuple[int, int]]]) -> _Chunk | None:
        """A rewritten piece, checked: its zip's storage member located; a dense piece is a hole in the copy."""
        like, item = self.like, piece.item
        if piece.compressed:
            raise UnsupportedError(f"{item.relative_path}: the tensor {name!r} is stored zstd-compressed "
                                   f"({', '.join(item.transforms)}); tclip does not write compressed DCP items "
                                   "(compressed anew they would change length, and .metadata with them); nothing "
                                   "was written", like.path)
        info = like.tensors[name]
        nbytes = int(np.prod(piece.chunk.sizes, dtype=np.int64)) * info.dtype.itemsize
        if not nbytes:
            return None
        like._ensure(name)
        fd, _ = like._file(item.relative_path)
        member = None
        if os.pread(fd, 4, item.offset) == _ZIP_MAGIC and piece.fd == fd:
            archive = like._archive(fd, item.offset, item.length, item.relative_path, name)
            if archive.format != "zip":
                raise FormatError(f"{item.relative_path}: the chunk of {name!r} is not a zip archive", like.path)
            if archive.crc32:  # (saved with CRC-32s off: they stay 0)
                key = next(iter(archive.tensors.values())).storage.key
                members = locate_members(fd, Window(fd, item.offset + item.length), {key: archive.storages[key]},
                                         f"{like.path}: {item.relative_path}")
                member = members[key]
        if piece.dense:
            holes.setdefault(item.relative_path, []).append((piece.start, nbytes))
        return _Chunk(piece, item.relative_path, member)

    def _check_disjoint(self) -> None:
        """Refuse rewritten chunks whose bytes overlap (tensors of an embedded safetensors file
        whose data_offsets overlap): writing one would change the other."""
        spans: list[tuple[str, int, int, str]] = []
        for name, chunks in self.chunks.items():
            itemsize = self.like.tensors[name].dtype.itemsize
            for chunk in chunks:
                if chunk is not None:
                    piece = chunk.piece
                    reach = sum((n - 1) * st for n, st in zip(piece.chunk.sizes, piece.stride)) + 1
                    spans.append((chunk.file, piece.start, piece.start + reach * itemsize, name))
        spans.sort()
        for (file, _, end, name), (other_file, start, _, other) in zip(spans, spans[1:]):
            if file == other_file and start < end:
                raise FormatError(f"{file}: the tensors {name!r} and {other!r} share bytes of the file; tclip "
                                  "does not rewrite either", self.like.path)

    def _copy_files(self, holes: dict[str, list[tuple[int, int]]]) -> None:
        """Each ``.distcp`` file into a temporary file of its own beside ``.metadata``'s, but for
        the bytes that will be rewritten; ``.metadata`` byte for byte."""
        like, folder = self.like, self.target.parent
        for relative in sorted(like._sizes):
            fd, size = like._file(relative)
            out = AtomicOutput(folder / relative, overwrite=self.output.overwrite, mode_from=like.path / relative)
            if not os.path.lexists(folder / relative):
                self._fresh.add(relative)
            self._outputs[relative] = out
            self._fds[relative] = out.open()
            os.ftruncate(self._fds[relative], size)
            copy_except(fd, self._fds[relative], size, holes.get(relative, []), like.path / relative)
        source = os.open(like.metadata_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            # the output took the mode of the reader's path, the folder: .metadata takes its own
            self.output.mode = os.fstat(source).st_mode & 0o777
            fd = self.output.open()
            os.fchmod(fd, self.output.mode)
            try:
                size = os.fstat(source).st_size
                os.ftruncate(fd, size)
                copy_range(source, 0, size, fd, 0, like.metadata_path)
            finally:
                os.close(fd)
        finally:
            os.close(source)

    # ------------------------------------------------------------------ writing

    def parallel_safe(self, name: str) -> bool:
        return True

    def write_flat(self, name: str, start: int, data: np.ndarray) -> None:
        info = self._rewritten(name)
        values = np.asarray(data).reshape(-1)
        position = 0
        for rect in flat_rectangles(info.shape, start, start + values.size):
            sizes = tuple(s.stop - s.start for s in rect)
            n = int(np.prod(sizes, dtype=np.int64))
            self._write_block(name, rect, values[position:position + n].reshape(sizes))
            position += n
        with self._lock:
            self._written[name] = self._written.get(name, 0) + values.size

    def write(self, name: str, index: Index, data: np.ndarray) -> None:
        info = self._rewritten(name)
        index = normalize_index(index, info.shape)
        values = np.asarray(data).reshape(tuple(s.stop - s.start for s in index))
        self._write_block(name, index, values)
        with self._lock:
            self._written[name] = self._written.get(name, 0) + values.size

    def _rewritten(self, name: str) -> TensorInfo:
        if name not in self.rewritten:
            raise FormatError(f"internal error: tensor {name!r} was not announced as rewritten", self.target)
        return self.like.tensors[name]

    def _write_block(self, name: str, index: Index, values: np.ndarray) -> None:
        """The block ``index`` of a tensor, each chunk's part where that chunk holds it."""
        if values.size == 0:
            return
        dtype = self.like.tensors[name].dtype
        for chunk in self.chunks[name]:
            if chunk is None:
                continue
            sizes, offsets = chunk.piece.chunk.sizes, chunk.piece.chunk.offsets
            local, source = [], []
            for s, o, n in zip(index, offsets, sizes):
                lo, hi = max(s.start, o), min(s.stop, o + n)
                if lo >= hi:
                    break
                local.append(slice(lo - o, hi - o))
                source.append(slice(lo - s.start, hi - s.start))
            else:
                part = np.ascontiguousarray(values[tuple(source)], dtype=dtype)
                self._write_piece(chunk, tuple(local), part)

    def _write_piece(self, chunk: _Chunk, local: Index, values: np.ndarray) -> None:
        piece, itemsize = chunk.piece, values.dtype.itemsize
        fd = self._fds[chunk.file]
        span = contiguous_span(local, piece.chunk.sizes, False) if local else (0, 1)
        if piece.dense and span is not None:
            raw = as_bytes(values)
            offset = piece.start + span[0] * itemsize
            crc = zlib.crc32(raw) if chunk.member is not None else 0
            pwrite_all(fd, raw, offset)
            with chunk.lock:
                if chunk.runs is not None:
                    chunk.runs.append((offset, len(raw), crc))
            return
        # Elements that are not one run (a chunk saved as a strided view): the bytes they span are
        # read from the output, set, and written back under the chunk's lock (the gaps are its own).
        first = piece.start + sum(s.start * st for s, st in zip(local, piece.stride)) * itemsize
        last = first + (sum((n - 1) * st for n, st in zip(values.shape, piece.stride)) + 1) * itemsize
        spanned = np.empty(last - first, np.uint8)
        with chunk.lock:
            pread_into(fd, spanned.data, first, self.target, chunk.file)
            target = np.lib.stride_tricks.as_strided(spanned.view(values.dtype), values.shape,
                                                     [st * itemsize for st in piece.stride])
            target[...] = values
            pwrite_all(fd, spanned.data, first)
            chunk.runs = None  # its CRC-32 is taken from all its bytes at the end

    def copy_tensor(self, reader: TensorReader, name: str, max_bytes: int = 8 << 20) -> None:
        """Tensors not rewritten are in the copy already; one announced as rewritten is written
        from the reader (its values as they are)."""
        if reader is not self.like:
            raise FormatError("internal error: a DCP folder is written only from itself", self.target)
        if name not in self.rewritten:
            return
        info = reader.tensors[name]
        step = max(1, max_bytes // info.dtype.itemsize)
        for start in range(0, info.size, step):
            self.write_flat(name, start, reader.read_flat(name, start, min(info.size, start + step)))

    # ------------------------------------------------------------------ finishing

    def _finish(self) -> None:
        for name in self.rewritten:
            if self._written.get(name, 0) != self.like.tensors[name].size:
                raise FormatError(f"internal error: tensor {name!r} incomplete", self.target)
        for chunks in self.chunks.values():
            for chunk in chunks:
                if chunk is None or chunk.member is None:
                    continue
                fd = self._fds[chunk.file]
                packed = np.uint32(member_crc(fd, chunk.member, chunk.runs, self.target)).astype("<u4").tobytes()
                for offset in chunk.member.crc_offsets:
                    pwrite_all(fd, memoryview(packed), offset)
        self._close_quietly()

    def commit(self, marker: Path | None = None) -> None:
        """The ``.distcp`` files first, ``.metadata`` last; a failure removes what was renamed."""
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise
        done: list[tuple[Path, tuple[int, int, int]]] = []
        try:
            for out in self._outputs.values():
                out.commit()
                if out.written is not None:
                    done.append((out.target, out.written))
            self.output.commit(marker)
        except BaseException:
            for path, identity in done:
                remove_if_same(path, identity)
            self.abort()
            raise

    def written_size(self) -> int:
        return sum(os.stat(path).st_size for path in [*(out.target for out in self._outputs.values()), self.target])

    def also_written(self) -> dict[str, tuple[int, int, int]]:
        """The ``.distcp`` files committed where nothing was before: a run interrupted after this
        commit removes them with ``.metadata`` (a folder of .distcp files alone is no checkpoint)."""
        return {str(out.target): out.written for relative, out in self._outputs.items()
                if relative in self._fresh and out.written is not None}

    def abort(self) -> None:
        try:
            self._close_quietly()
        finally:
            for out in self._outputs.values():
                out.abort()
            self.output.abort()

    def _close_quietly(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass


def _checked_target(target: Path, like: DcpReader, tensors: list[TensorInfo]) -> None:
    """Refuse what a DCP folder cannot be written as (before anything is written)."""
    if target.name != METADATA_NAME:
        raise UnsupportedError("a DCP checkpoint is a folder: name it with --out-dir DIR (or -o DIR/.metadata)",
                               target)
    if [t.name for t in tensors] != list(like.tensors):
        raise UnsupportedError("a DCP folder is rewritten with all its tensors; write .safetensors to leave some "
                               "out", target)
    if any(len(Path(relative).parts) != 1 for relative in like._sizes):
        raise UnsupportedError("the folder's items sit in subfolders, which tclip does not write; write "
                               ".safetensors instead", like.path)
    try:
        same = os.path.samefile(target.parent, like.path)
    except OSError:
        same = False
    if same:
        raise UnsupportedError("a DCP folder is not rewritten in place; write it into another folder with "
                               "--out-dir DIR", like.path)


def Writer(target: Path, tensors: list[TensorInfo], output: AtomicOutput, *,  # noqa: N802 (the format's writer)
           like: TensorReader | None, metadata: Any, rewritten: Collection[str] | None) -> TensorWriter:
    """A rewrite of a DCP folder itself into another folder; from another format, refused."""
    if not isinstance(like, DcpReader):
        raise UnsupportedError("tclip writes a DCP folder only as a rewrite of one (its .metadata is kept byte for "
                               "byte); write .safetensors instead", target)
    _checked_target(Path(target), like, tensors)
    return DcpWriter(Path(target), tensors, output, like=like, rewritten=rewritten)
