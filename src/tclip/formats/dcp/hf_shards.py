"""DCP's Hugging Face storage saved per rank: a folder of
``shard-0000R-model-0000F-of-0000N.safetensors`` files read as one set of whole tensors.

``HuggingFaceStorageWriter(path, save_distributed=True)`` without consolidation has every rank
write its own pieces into safetensors files, ``R`` the rank plus one, ``F`` of ``N`` the file its
``fqn_to_index_mapping`` gives each tensor (1 of 1 without one). There is no ``.metadata`` and
no index: each file's ``__metadata__`` holds ``DCP_SHARDING_INFO``, a JSON object giving each of
its tensors' ``saved_offsets`` (where the piece starts in the whole tensor); the piece's shape is
the safetensors entry's. Nothing records a tensor's global shape: as torch's own reader
(``HuggingFaceStorageReader.read_metadata``) and ``consolidate_safetensors_files`` do, it is the
smallest box holding every piece (offset plus size, axis by axis).

What is checked when the folder is opened, each failure one error naming the folder: every file
is a valid safetensors file; ``DCP_SHARDING_INFO`` is a JSON object naming exactly the file's
tensors, each with ``saved_offsets`` of non-negative integers, one per axis; the pieces of a
tensor agree in dtype and number of axes, do not overlap and leave no part of their box
unwritten; the file names agree on ``N`` and number the ranks from 1 without a gap. (A folder
missing its *last* rank's files cannot be told from a smaller checkpoint: the files do not say
how many ranks saved.)

A block of a tensor reads only the pieces it meets, each part with one ``pread`` where it is one
run of the piece's file (a ``Shard(0)`` piece, a replicated tensor).

A piece file opened alone (named on the command line, or a glob matching only some of a folder's
pieces) is refused by the safetensors reader (:func:`.per_rank.piece_problem`): its shapes are a piece's,
and counting pieces as tensors would give a wrong norm. A glob matching every piece of a folder,
and a folder listed inside another, stand for the folder (:func:`fold_pieces`).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from ...core.units import Index
from ...errors import FormatError, TclipError, UnsupportedError
from .._blocks import contiguous_span
from .._io import pread_into
from ..base import TensorInfo, TensorReader
from ..safetensors import SafetensorsReader
from ._chunks import PieceReads, _c_strides, _coverage
from ._metadata import Chunk
from .per_rank import MAX_SHARDING_INFO, OFFSETS_KEY, PIECE_NAME, SHARDING_KEY, _order, is_piece_name, piece_files

_COVERAGE_PER_PIECE = 64
_COVERAGE_BASE = 1 << 22
# Past this many piece files (a run of hundreds of ranks, several files each), files are not kept
# open: a piece's file is opened for each read of it (the soft limit on open files is often 1024).
MAX_OPEN_FILES = 256


class _PieceFile(SafetensorsReader):
    """A piece file, opened by the folder's reader (where it is no error)."""

    def refuse_dcp_piece(self) -> None:
        return None


class _Piece:
    __slots__ = ("file", "name", "chunk", "fd", "start", "dtype", "size")

    def __init__(self, file: _PieceFile, name: str, chunk: Chunk) -> None:
        self.file, self.name, self.chunk = file, name, chunk
        self.fd, self.start = file._file.fileno(), file.offsets[name]
        self.size = os.fstat(self.fd).st_size  # (checked again where the file is opened for a read)
        self.dtype = file.tensors[name].dtype


class HfShardsReader(PieceReads, TensorReader):
    """A folder of per-rank ``shard-*-model-*.safetensors`` pieces, as whole tensors."""

    format_name = "dcp"

    def __init__(self, path: Path) -> None:
        super().__init__(Path(path))
        self.files: list[_PieceFile] = []
        self.pieces: dict[str, list[_Piece]] = {}
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def bad(self, what: str) -> FormatError:
        return FormatError(what, self.path)

    def close(self) -> None:
        for file in self.files:
            file.close()
        self.files = []

    # ------------------------------------------------------------------ opening

    def _open(self) -> None:
        paths = piece_files(self.path)
        if not paths:
            raise self.bad("no shard-*-model-*-of-*.safetensors files: not a DCP Hugging Face folder")
        self._check_names(paths)
        for path in paths:
            try:
                file = _PieceFile(path)
            except TclipError as error:
                raise type(error)(f"{path.name}: {error.detail}", self.path) from None
            except OSError as error:
                raise self.bad(f"{path.name}: cannot read ({error.strerror or error})") from None
            self.files.append(file)
            for name, chunk in self._sharding(file).items():
                piece = _Piece(file, name, chunk)
                self.pieces.setdefault(name, []).append(piece)
                if len(paths) > MAX_OPEN_FILES:
                    piece.fd = -1
            if len(paths) > MAX_OPEN_FILES:
                file.close()
        budget = [_COVERAGE_PER_PIECE * sum(len(p) for p in self.pieces.values()) + _COVERAGE_BASE]
        for name in sorted(self.pieces):
            self.tensors[name] = self._assemble(name, self.pieces[name], budget)
        self.metadata = {"dcp_storage": "huggingface, per rank", "ranks": len({_order(p)[0] for p in paths})}

    def _check_names(self, paths: list[Path]) -> None:
        counts = {m["count"] for m in (PIECE_NAME.fullmatch(p.name) for p in paths) if m}
        if len({int(c) for c in counts}) > 1:
            raise self.bad(f"the shard files disagree on their file count (-of-{', -of-'.join(sorted(counts))})")
        count = int(next(iter(counts)))
        for path in paths:
            if not 1 <= _order(path)[1] <= count:
                raise self.bad(f"{path.name}: file number outside 1..{count}")
        ranks = sorted({_order(p)[0] for p in paths})
        missing = sorted(set(range(1, ranks[-1] + 1)) - set(ranks))
        if missing:
            raise self.bad(f"no shard files of rank {missing[0]} (shard-{missing[0]:05d}-*), though files of "
                           f"ranks up to {ranks[-1]} are there: part of the checkpoint is missing")

    def _sharding(self, file: _PieceFile) -> dict[str, Chunk]:
        """Each tensor of a piece file with its place: its ``saved_offsets`` and its shape."""
        where = file.path.name
        text = file.metadata.get(SHARDING_KEY)
        if not isinstance(text, str):
            raise self.bad(f"{where}: no {SHARDING_KEY} in its __metadata__: not a piece of a DCP checkpoint")
        try:
            info = json.loads(text) if len(text) <= MAX_SHARDING_INFO else None
        except (ValueError, RecursionError) as error:
            raise self.bad(f"{where}: {SHARDING_KEY} is not valid JSON ({str(error)[:100]})") from None
        if not isinstance(info, dict):
            raise self.bad(f"{where}: {SHARDING_KEY} is not a JSON object")
        if set(info) != set(file.tensors):
            extra, lacking = sorted(set(info) - set(file.tensors)), sorted(set(file.tensors) - set(info))
            what = f"names {extra[0]!r}, which the file does not hold" if extra else f"does not place {lacking[0]!r}"
            raise self.bad(f"{where}: {SHARDING_KEY} {what}")
        out = {}
        for name, tensor in file.tensors.items():
            if not tensor.numeric:
                code = (tensor.dtype_label or "?").split(" ")[0]
                raise UnsupportedError(f"{where}: the piece of {name!r} is {code}, which tclip cannot read", self.path)
            entry = info[name]
            offsets = entry.get(OFFSETS_KEY) if isinstance(entry, dict) else None
            if not (isinstance(offsets, list) and all(type(o) is int and o >= 0 for o in offsets)):
                raise self.bad(f"{where}: {SHARDING_KEY} gives {name!r} no {OFFSETS_KEY} of non-negative integers "
                               f"({str(entry)[:60]})")
            if len(offsets) != len(tensor.shape):
                raise self.bad(f"{where}: {OFFSETS_KEY} {offsets} of {name!r} do not match its shape "
                               f"{list(tensor.shape)}")
            out[name] = Chunk(tuple(offsets), tuple(tensor.shape))
        return out

    def _assemble(self, name: str, pieces: list[_Piece], budget: list[int]) -> TensorInfo:
        first = pieces[0]
        for piece in pieces[1:]:
            if piece.dtype != first.dtype:
                raise self.bad(f"the pieces of {name!r} disagree in dtype ({first.dtype.name} in "
                               f"{first.file.path.name}, {piece.dtype.name} in {piece.file.path.name})")
            if len(piece.chunk.sizes) != len(first.chunk.sizes):
                raise self.bad(f"the pieces of {name!r} disagree in their number of axes "
                               f"({first.file.path.name}, {piece.file.path.name})")
        shape = tuple(max(p.chunk.offsets[a] + p.chunk.sizes[a] for p in pieces) for a in range(len(first.chunk.sizes)))
        if math.prod(shape):
            problem = _coverage(shape, [p.chunk for p in pieces if math.prod(p.chunk.sizes)], budget)
            if problem:
                raise self.bad(f"the pieces of {name!r} (shape {list(shape)}, from {len(pieces)} files) {problem}")
        return TensorInfo(name, shape, first.dtype)

    def chunk_files(self, name: str) -> list[str]:
        """The files holding a tensor's pieces, in the order read (for people)."""
        return [piece.file.path.name for piece in self.pieces[name]]

    def storage_files(self) -> dict[str, int]:
        """Every piece file of the folder with its size in bytes (for ``info``, as a DCP folder's files)."""
        return {path.name: os.stat(path).st_size for path in piece_files(self.path)}

    # ------------------------------------------------------------------ reading

    def region(self, name: str) -> tuple[int, int] | None:
        pieces = self.pieces.get(name)
        if not pieces or len(pieces) != 1 or self.tensors[name].refused:
            return None
        return (pieces[0].fd, pieces[0].start) if pieces[0].fd >= 0 else None

    def parallel_safe(self, name: str) -> bool:
        return True  # preads and private maps

    def _read_piece(self, piece: _Piece, local: Index, dest: np.ndarray, name: str = "") -> None:
        if piece.fd >= 0:
            self._read_from(piece.fd, piece, local, dest)
            return
        path = piece.file.path
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as error:
            raise self.bad(f"{path.name}: cannot read ({error.strerror or error})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != piece.size:
                raise self.bad(f"{path.name}: changed since the folder was opened")
            self._read_from(fd, piece, local, dest)
        finally:
            os.close(fd)

    def _read_from(self, fd: int, piece: _Piece, local: Index, dest: np.ndarray) -> None:
        dtype, sizes = dest.dtype, piece.chunk.sizes
        span = contiguous_span(local, sizes, False) if local else (0, 1)
        if span is not None:
            offset = piece.start + span[0] * dtype.itemsize
            run = dest if dest.flags.c_contiguous else np.empty(dest.shape, dtype)
            pread_into(fd, run.reshape(-1).view(np.uint8).data, offset, self.path, piece.name)
            if run is not dest:
                dest[...] = run
            return
        # not one run of the file: copied from a private read-only map of the bytes it spans
        stride, itemsize = _c_strides(sizes), dtype.itemsize
        first = piece.start + sum(s.start * st for s, st in zip(local, stride)) * itemsize
        last = first + (sum((s.stop - s.start - 1) * st for s, st in zip(local, stride)) + 1) * itemsize
        base = first - first % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(fd, last - base, access=mmap.ACCESS_READ, offset=base) as mapped:
            raw = np.frombuffer(mapped, np.uint8, count=last - first, offset=first - base).view(dtype)
            view = np.lib.stride_tricks.as_strided(raw, dest.shape, [st * itemsize for st in stride],
                                                   writeable=False)
            dest[...] = view
            del raw, view

