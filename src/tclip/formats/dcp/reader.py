"""A DCP folder read as one tensor source: global names, shapes and dtypes, tensors assembled
from their chunks by offsets.

What is checked when the folder is opened, before any number is read (each failure is one
error naming the folder and what is wrong):

- ``.metadata`` through the allowlist of :mod:`._metadata` (nothing run);
- every ``storage_data`` file is a plain file inside the folder, and every item's byte range
  lies inside its file; items' ranges do not overlap (the SAFETENSORS variant's tensors
  share the offset of their embedded file by design: the file is counted once);
- every chunk lies inside its tensor, the chunks do not overlap and leave nothing unwritten;
- every tensor chunk (a complete ``torch.save`` zip) is read by tclip's own ``.pt`` reader
  (:mod:`..torch.archive`: its pickle through the allowlist interpreter), and its dtype and
  shape agree with the ``.metadata``; a chunk of the SAFETENSORS variant is found by name in
  the embedded safetensors header.

Items compressed with the ``ZStandard`` extension (``transform_descriptors ==
['stream.zstd/1']``) need the ``zstandard`` package; each is decompressed once, when first
read, into an anonymous temporary file (bounded by the chunk's size), and read from there; the
files stay until the reader is closed (a chunk may be read again, from any thread), so reading a
whole zstd checkpoint takes its uncompressed size in ``$TMPDIR``.

BYTE_IO items (``step``, ``lr``, a dataloader's state) are listed as not tensors; their value is
shown where the allowlist interpreter finds plain data in them, and anything else they hold is
never read (an item that refuses to be read is no error: it is not a tensor).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
import struct
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from ...core.units import Index
from ...errors import FormatError, TclipError, UnsupportedError
from .._blocks import contiguous_span
from .._io import pread_into
from ..torch.pickled import ADVICE, NOT_FLOATING_TORCH_DTYPES, TORCH_DTYPES, PickleLimits
from ..base import OtherObject, TensorInfo, TensorReader
from . import METADATA_NAME
from ._chunks import PieceReads, _c_strides, _coverage
from ._window import Window
from ._metadata import BytesEntry, Chunk, DcpMetadata, StorageItem, TensorEntry, load_dcp_metadata
from .layouts import MEGATRON_CONFIG, megatron_config, megatron_parts

ZSTD = "stream.zstd/1"
_ZIP_MAGIC = b"PK\x03\x04"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_MAX_VALUE_ITEM = 1 << 20          # BYTE_IO items read for their value: at most this long
_ZIP_OVERHEAD = 1 << 20            # a chunk's zip beyond its tensor's bytes (pickle, records, directory)
# Checking that chunks tile their tensors costs grid cells (or chunk pairs); a folder may spend
# this many per chunk it lists, plus a fixed allowance (a DTensor's shards cost one cell each).
_COVERAGE_PER_CHUNK = 64
_COVERAGE_BASE = 1 << 22
_SAFETENSORS_MAX_HEADER = 100_000_000
# A .metadata lists every chunk of every tensor: ~150 bytes and ~12 objects a chunk, so one of a
# run sharded over hundreds of ranks passes the 64 MiB a torch.save pickle may hold (a 70B model
# with AdamW on 256 ranks: ~550 000 chunks, ~80 MiB, estimated). Still caps, linear in the file.
METADATA_LIMITS = PickleLimits(max_bytes=512 << 20, max_objects=32_000_000, max_ops=256_000_000,
                               max_memo=32_000_000)


@dataclass
class _Piece:
    """Where one chunk's elements are: a strided view starting at ``start`` of file ``fd``
    (strides in elements). ``item`` is kept for zstd chunks, resolved when first read."""

    chunk: Chunk
    item: StorageItem
    fd: int = -1
    start: int = 0
    stride: tuple[int, ...] = ()
    dense: bool = True
    compressed: bool = False


class DcpReader(PieceReads, TensorReader):
    """A DCP checkpoint folder (given as the folder or its ``.metadata``)."""

    format_name = "dcp"

    def __init__(self, path: Path) -> None:
        path = Path(path)
        metadata_path = path / METADATA_NAME if path.is_dir() else path
        if path.name == MEGATRON_CONFIG:  # a Megatron folder named by its metadata.json
            metadata_path = path.parent / METADATA_NAME
        super().__init__(metadata_path.parent)
        self.metadata_path = metadata_path
        self.limits = PickleLimits()  # for the chunks' and items' own torch.save pickles
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._temps: list[int] = []
        self._values: dict[str, Any] = {}  # plain values of bytes items, by name
        self.byte_items: dict[str, StorageItem] = {}  # where each item saved as an object is
        self._scratch = -1  # a temporary file small zstd items are decompressed into, one after another
        self._lock = threading.Lock()
        self.pieces: dict[str, list[_Piece]] = {}
        self._blobs: dict[tuple[str, int], dict[str, Any]] = {}  # embedded safetensors headers, by (file, offset)
        self._located: set[str] = set()  # tensors whose chunks were read and checked
        self.entries: dict[str, TensorEntry] = {}
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ errors

    def bad(self, what: str) -> FormatError:
        return FormatError(what, self.path)

    def close(self) -> None:
        for fd in [*self._fds.values(), *self._temps]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds, self._temps = {}, []

    # ------------------------------------------------------------------ opening

    def _open(self) -> None:
        limits = METADATA_LIMITS
        megatron = megatron_config(self.path)  # (first: a zarr checkpoint has no .metadata to read)
        try:
            # O_NONBLOCK: a FIFO put there must not make the open wait for a writer
            fd = os.open(self.metadata_path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
            with os.fdopen(fd, "rb") as handle:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise self.bad(f"{METADATA_NAME} is not a regular file")
                size = os.fstat(fd).st_size
                if size > limits.max_bytes:
                    raise UnsupportedError(f"{METADATA_NAME} of {size} bytes is larger than the limit of "
                                           f"{limits.max_bytes} bytes", self.path)
                data = handle.read(limits.max_bytes + 1)
        except FileNotFoundError:
            raise self.bad(f"no {METADATA_NAME} file: not a DCP checkpoint folder") from None
        except OSError as error:
            raise self.bad(f"cannot read {METADATA_NAME} ({error.strerror or error})") from None
        meta = self._load_metadata(data, limits)
        self.metadata = {"dcp_version": meta.version} if meta.version else {}
        items = self._items_by_entry(meta)
        self._coverage_budget = [_COVERAGE_PER_CHUNK * len(meta.items) + _COVERAGE_BASE]
        # Items of the SAFETENSORS variant share the offset of the safetensors file they sit in:
        # found here (more than one tensor item at one offset of one file), read once, counted once.
        at: dict[tuple[str, int], int] = {}
        for item in meta.items:
            if item.index is not None and not item.transforms:
                at[item.relative_path, item.offset] = at.get((item.relative_path, item.offset), 0) + 1
        ranges: list[tuple[str, int, int, str]] = []
        embedded: set[tuple[str, int, str]] = set()
        for name, entry in meta.entries.items():
            if isinstance(entry, BytesEntry):
                item = items[name][0]
                self._check_range(item)
                ranges.append((item.relative_path, item.offset, item.offset + item.length, name))
                self.byte_items[name] = item
                self.others.append(self._bytes_item(name, item))
                continue
            self._check_chunks(name, entry)
            pieces = []
            for chunk, item in zip(entry.chunks, items[name]):
                self._check_range(item)
                if at.get((item.relative_path, item.offset), 0) > 1:
                    if (item.relative_path, item.offset, name) in embedded:
                        raise self.bad(f"{item.relative_path}: two chunks of {name!r} point at one safetensors "
                                       "tensor")
                    embedded.add((item.relative_path, item.offset, name))
                    self._embedded(_Piece(chunk, item), name, entry)  # checked now, located again when read
                else:
                    ranges.append((item.relative_path, item.offset, item.offset + item.length, name))
                pieces.append(_Piece(chunk, item, compressed=bool(item.transforms)))
            self.pieces[name] = pieces
            self.entries[name] = entry
            self.tensors[name] = self._info(name, entry)
        ranges += [(file, start, start + blob["size"], "the embedded safetensors file")
                   for (file, start), blob in self._blobs.items()]
        self._check_disjoint(ranges)
        self._mark_optimizer_state(meta)
        megatron_parts(self, megatron, self._values)

    def _load_metadata(self, data: bytes, limits: PickleLimits) -> DcpMetadata:
        """The checkpoint's metadata from the bytes of :attr:`metadata_path` (a folder of per-rank
        ``__R.metadata`` files merges them: :mod:`.rank_metadata`)."""
        return load_dcp_metadata(data, limits=limits, where=METADATA_NAME, path=self.path)

    def _items_by_entry(self, meta: DcpMetadata) -> dict[str, list[StorageItem]]:
        """Each entry's storage items, a tensor's in the order of its chunks, all checked present."""
        found: dict[str, dict[int | None, StorageItem]] = {}
        for item in meta.items:
            entry = meta.entries.get(item.fqn)
            if entry is None:
                raise self.bad(f"{METADATA_NAME}: storage_data names {item.fqn!r}, which state_dict_metadata "
                               "does not list")
            slots = found.setdefault(item.fqn, {})
            if item.index in slots:
                raise self.bad(f"{METADATA_NAME}: storage_data lists item {item.index} of {item.fqn!r} twice")
            slots[item.index] = item
        result: dict[str, list[StorageItem]] = {}
        for name, entry in meta.entries.items():
            slots = found.get(name, {})
            if isinstance(entry, BytesEntry):
                if list(slots) != [None]:
                    raise self.bad(f"{METADATA_NAME}: the item {name!r} has no single place in storage_data")
                result[name] = [slots[None]]
                continue
            listed = []
            for i, chunk in enumerate(entry.chunks):
                found_item = slots.get(i)
                if found_item is None:
                    raise self.bad(f"{METADATA_NAME}: chunk {i} of {name!r} (at {list(chunk.offsets)}) has no "
                                   "place in storage_data")
                item = found_item
                if item.chunk_offsets != chunk.offsets:
                    raise self.bad(f"{METADATA_NAME}: chunk {i} of {name!r} is at {list(chunk.offsets)}, its "
                                   f"storage_data key says {list(item.chunk_offsets or ())}")
                listed.append(item)
            if len(slots) != len(entry.chunks):
                raise self.bad(f"{METADATA_NAME}: storage_data lists {len(slots)} items of {name!r}, which has "
                               f"{len(entry.chunks)} chunks")
            result[name] = listed
        return result

    def _file(self, relative: str) -> tuple[int, int]:
        """(descriptor, size) of a file the metadata names, refused unless it is a plain
        file inside the folder (no absolute path, no ``..``, no link leading out)."""
        known = self._fds.get(relative)
        if known is not None:
            return known, self._sizes[relative]
        parts = relative.replace("\\", "/").split("/")
        if relative.startswith(("/", "\\")) or ":" in relative or "\x00" in relative \
                or any(p in ("", ".", "..") for p in parts):
            raise self.bad(f"{METADATA_NAME} names the file {relative!r}, which is not inside the folder")
        target = self.path.joinpath(*parts)
        try:
            inside = os.path.commonpath([os.path.realpath(target), os.path.realpath(self.path)])
        except ValueError:
            inside = ""
        if inside != os.path.realpath(self.path):
            raise self.bad(f"{METADATA_NAME} names the file {relative!r}, which leads out of the folder")
        try:
            fd = os.open(target, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise self.bad(f"{relative}: no such file (named by {METADATA_NAME})") from None
        except OSError as error:
            raise self.bad(f"{relative}: cannot read ({error.strerror or error})") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise self.bad(f"{relative}: not a regular file")
        self._fds[relative] = fd
        self._sizes[relative] = info.st_size
        return fd, info.st_size

    def _check_range(self, item: StorageItem) -> None:
        _, size = self._file(item.relative_path)
        if item.offset + item.length > size:
            raise self.bad(f"{item.relative_path}: the item {item.fqn!r} at bytes {item.offset}..."
                           f"{item.offset + item.length} runs past the end of the file ({size} bytes): "
                           "the file is truncated")
        if item.transforms and item.transforms != (ZSTD,):
            raise UnsupportedError(f"{item.relative_path}: the item {item.fqn!r} is stored through "
                                   f"{', '.join(item.transforms)}, which tclip does not read", self.path)

    def _check_chunks(self, name: str, entry: TensorEntry) -> None:
        shape = entry.shape
        for i, chunk in enumerate(entry.chunks):
            if any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, shape)):
                raise self.bad(f"{METADATA_NAME}: chunk {i} of {name!r} (offsets {list(chunk.offsets)}, sizes "
                               f"{list(chunk.sizes)}) lies outside its shape {list(shape)}")
        if math.prod(shape) == 0:
            return
        problem = _coverage(shape, [c for c in entry.chunks if math.prod(c.sizes)], self._coverage_budget)
        if problem:
            raise self.bad(f"{METADATA_NAME}: the chunks of {name!r} (shape {list(shape)}) {problem}")

    def _check_disjoint(self, ranges: list[tuple[str, int, int, str]]) -> None:
        ranges.sort()
        for (file, _, end, name), (other_file, start, _, other) in zip(ranges, ranges[1:]):
            if file == other_file and start < end:
                raise self.bad(f"{file}: the items {name!r} and {other!r} overlap in the file")

    # ------------------------------------------------------------------ chunks

    def _ensure(self, name: str) -> None:
        """Locate the elements of every chunk of a tensor, once, when it is first read: each chunk's
        own zip is read and checked against ``.metadata`` then (opening a folder of a million
        chunks reads only ``.metadata`` and the files' sizes)."""
        if name in self._located:
            return
        with self._lock:
            if name in self._located:
                return
            entry = self.entries[name]
            for piece in self.pieces[name]:
                if piece.fd < 0:
                    self._place(piece, name, entry)
            self._located.add(name)

    def _place(self, piece: _Piece, name: str, entry: TensorEntry) -> None:
        item = piece.item
        fd, _ = self._file(item.relative_path)
        if piece.compressed:
            if os.pread(fd, 4, item.offset) != _ZSTD_MAGIC:
                raise self.bad(f"{item.relative_path}: the item {name!r} is not a zstd frame")
            dtype = _dtype(entry.dtype)
            limit = math.prod(piece.chunk.sizes) * (dtype.itemsize if dtype is not None else 1) + _ZIP_OVERHEAD
            temp = self._decompress(item, limit)
            self._locate(piece, name, entry, temp, 0, os.fstat(temp).st_size, f"{item.relative_path} (decompressed)")
            return
        head = os.pread(fd, 9, item.offset)
        if head[:4] == _ZIP_MAGIC:
            self._locate(piece, name, entry, fd, item.offset, item.length, item.relative_path)
        elif len(head) == 9 and head[8:9] == b"{":
            self._embedded(piece, name, entry)
        else:
            raise self.bad(f"{item.relative_path}: the item {name!r} at byte {item.offset} is neither a "
                           "torch.save archive nor a safetensors file")

    def _locate(self, piece: _Piece, name: str, entry: TensorEntry, fd: int, start: int, length: int,
                where: str) -> None:
        """Read a chunk's ``torch.save`` zip (bytes ``[start, start + length)`` of ``fd``) and set
        where its elements are."""
        archive = self._archive(fd, start, length, where, name)
        chunk = piece.chunk
        if len(archive.tensors) != 1 or archive.others:
            raise self.bad(f"{where}: the chunk of {name!r} at byte {start} holds "
                           f"{len(archive.tensors)} tensors and {len(archive.others)} other values, not one tensor")
        ref = next(iter(archive.tensors.values()))
        storage = archive.storages[ref.storage.key]
        expected = _dtype(entry.dtype)
        if expected is None or ref.dtype != expected:
            raise self.bad(f"{where}: the chunk of {name!r} holds {ref.dtype.name}, {METADATA_NAME} says "
                           f"torch.{entry.dtype}")
        if ref.shape != chunk.sizes:
            raise self.bad(f"{where}: the chunk of {name!r} has shape {list(ref.shape)}, {METADATA_NAME} says "
                           f"{list(chunk.sizes)}")
        if ref.neg or ref.conj:
            raise UnsupportedError(f"{where}: the chunk of {name!r} is a lazily negated or conjugated view",
                                   self.path)
        pickle_offset, pickle_size = archive.pickle_member
        if storage.offset < start or storage.offset + storage.nbytes > start + length or pickle_offset < start \
                or pickle_offset + pickle_size > start + length:
            raise self.bad(f"{where}: the chunk of {name!r} at byte {start} points outside its own bytes")
        piece.start = storage.offset + ref.offset * ref.dtype.itemsize
        piece.stride = ref.stride
        piece.dense = ref.order() == tuple(range(len(ref.shape)))
        piece.fd = fd

    def _archive(self, fd: int, start: int, length: int, where: str, name: str) -> Any:
        from ..torch.archive import _load_zip

        window = Window(fd, start + length)
        try:
            return _load_zip(self.path, window, self.limits, name)
        except TclipError as error:
            # the .pt reader's advice (save the state_dict) is no help for a chunk DCP wrote
            detail = error.detail.replace(f": {ADVICE}", "")
            raise type(error)(f"{where}: the item {name!r} at byte {start}: {detail}", self.path) from None

    def _embedded(self, piece: _Piece, name: str, entry: TensorEntry) -> None:
        """A chunk of the SAFETENSORS variant: found by name in the safetensors file that starts at
        the item's offset (every chunk of that file points at its start)."""
        from ..safetensors import DTYPES

        item = piece.item
        fd, _ = self._file(item.relative_path)
        key = (item.relative_path, item.offset)
        blob = self._blobs.get(key)
        if blob is None:
            blob = self._blob(fd, item)
            self._blobs[key] = blob
        where = item.relative_path
        found = blob["entries"].get(name)
        if found is None:
            raise self.bad(f"{where}: the safetensors file at byte {item.offset} has no tensor {name!r}")
        code, shape, offsets = found.get("dtype"), found.get("shape"), found.get("data_offsets")
        expected = _dtype(entry.dtype)
        if DTYPES.get(code) != expected or expected is None:
            raise self.bad(f"{where}: the safetensors tensor {name!r} is {code}, {METADATA_NAME} says "
                           f"torch.{entry.dtype}")
        if shape != list(piece.chunk.sizes):
            raise self.bad(f"{where}: the safetensors tensor {name!r} has shape {shape}, {METADATA_NAME} says "
                           f"{list(piece.chunk.sizes)}")
        nbytes = math.prod(piece.chunk.sizes) * expected.itemsize
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] and offsets[1] - offsets[0] == nbytes == item.length
                and offsets[1] <= blob["size"] - blob["data"]):
            raise self.bad(f"{where}: the safetensors tensor {name!r} has data_offsets {str(offsets)[:60]}, "
                           f"which do not hold {nbytes} bytes inside the file")
        piece.start = item.offset + blob["data"] + offsets[0]
        piece.stride = _c_strides(piece.chunk.sizes)
        piece.fd = fd

    def _blob(self, fd: int, item: StorageItem) -> dict[str, Any]:
        from ..safetensors import _object_hook

        size = self._sizes[item.relative_path]
        where = item.relative_path
        (header_length,) = struct.unpack("<Q", os.pread(fd, 8, item.offset))
        if header_length > _SAFETENSORS_MAX_HEADER or item.offset + 8 + header_length > size:
            raise self.bad(f"{where}: the safetensors header at byte {item.offset} runs past the end of the file")
        raw = os.pread(fd, header_length, item.offset + 8)
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_object_hook)
        except (UnicodeDecodeError, ValueError, RecursionError) as error:
            raise self.bad(f"{where}: the safetensors header at byte {item.offset} is not valid JSON "
                           f"({str(error)[:100]})") from None
        if not isinstance(header, dict):
            raise self.bad(f"{where}: the safetensors header at byte {item.offset} is not a JSON object")
        header.pop("__metadata__", None)
        entries = {k: v for k, v in header.items() if isinstance(v, dict)}
        ends = [v["data_offsets"][1] for v in entries.values()
                if isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2
                and type(v["data_offsets"][1]) is int]
        _check_apart(entries, lambda what: self.bad(f"{where}: the safetensors file at byte {item.offset}: {what}"))
        data = 8 + header_length
        total = data + max(ends, default=0)
        if item.offset + total > size:
            raise self.bad(f"{where}: the safetensors file at byte {item.offset} runs past the end of the file: "
                           "the file is truncated")
        return {"entries": entries, "data": data, "size": total}

    def _decompress(self, item: StorageItem, limit: int) -> int:
        try:
            import zstandard
        except ImportError:
            raise UnsupportedError(f"{item.relative_path}: the item {item.fqn!r} is zstd-compressed "
                                   "(transform stream.zstd/1): install the 'zstandard' package "
                                   "(pip install 'tclip[dcp-zstd]')", self.path) from None
        fd, _ = self._file(item.relative_path)
        out = tempfile.TemporaryFile()
        temp = os.dup(out.fileno())
        out.close()
        self._temps.append(temp)
        # one frame per item, as torch's ZStandard extension writes it
        reader = zstandard.ZstdDecompressor().stream_reader(
            cast(Any, Window(fd, item.offset + item.length, item.offset)))  # a file-like zstandard reads
        written = 0
        try:
            while True:
                block = reader.read(1 << 20)
                if not block:
                    break
                written += len(block)
                if written > limit:
                    raise self.bad(f"{item.relative_path}: the item {item.fqn!r} decompresses to more than "
                                   f"{limit} bytes, more than its chunk can hold")
                os.write(temp, block)
        except zstandard.ZstdError as error:
            raise self.bad(f"{item.relative_path}: the item {item.fqn!r} is not valid zstd data "
                           f"({str(error)[:100]})") from None
        return temp

    # ------------------------------------------------------------------ listing

    def _info(self, name: str, entry: TensorEntry) -> TensorInfo:
        dtype = _dtype(entry.dtype)
        if entry.layout != "torch.strided":
            return TensorInfo(name, entry.shape, np.dtype("u1"), numeric=False, refused=f"a {entry.layout} tensor",
                              dtype_label=f"torch.{entry.dtype} ({entry.layout})")
        if dtype is None:
            return TensorInfo(name, entry.shape, np.dtype("u1"), numeric=False, unreadable_type=True,
                              not_floating=entry.dtype in NOT_FLOATING_TORCH_DTYPES,
                              refused=f"dtype torch.{entry.dtype}, which tclip cannot read",
                              dtype_label=f"torch.{entry.dtype} (not supported)")
        return TensorInfo(name, entry.shape, dtype)

    def _bytes_item(self, name: str, item: StorageItem) -> OtherObject:
        text = None
        if item.length <= _MAX_VALUE_ITEM and item.transforms in ((), (ZSTD,)):
            text = self._plain_value(name, item)
        reason = f"value {text}" if text is not None else "not a tensor; kept as it is"
        return OtherObject(name, "torch.save item", reason)

    def _plain_value(self, name: str, item: StorageItem) -> str | None:
        """The item's value as text when the allowlist interpreter finds one plain value in it
        (kept for :meth:`other_values` too)."""
        from ..torch.reader import _value_text

        fd, _ = self._file(item.relative_path)
        start, length = item.offset, item.length
        if item.transforms:
            found = self._small_decompressed(fd, item)
            if found is None:
                return None
            fd, start, length = found
        if os.pread(fd, 4, start) != _ZIP_MAGIC:
            return None
        try:
            archive = self._archive(fd, start, length, item.relative_path, name)
        except TclipError:
            return None  # a pickled object tclip does not read: not a tensor, and no error
        if archive.tensors or len(archive.others) != 1:
            return None
        value = archive.others[0].value
        if isinstance(value, list | tuple) and len(value) <= 8 and all(isinstance(v, bool | int | float)
                                                                      for v in value):
            text = repr(value)
            if len(text) > 60:
                return None
            self._values[name] = value  # (an optimizer's betas: read by report --summary --of grads)
            return text
        text = _value_text(value)
        if text:
            self._values[name] = value
        return text or None

    def _small_decompressed(self, fd: int, item: StorageItem) -> tuple[int, int, int] | None:
        """A small zstd item decompressed (at most :data:`_MAX_VALUE_ITEM` bytes) into the reader's
        one scratch file for values: (descriptor, 0, length); None when it cannot be (no zstandard
        package, bad data, too large): the item is then listed without its value."""
        try:
            import zstandard
        except ImportError:
            return None
        try:
            stream = zstandard.ZstdDecompressor().stream_reader(
                cast(Any, Window(fd, item.offset + item.length, item.offset)))  # a file-like zstandard reads
            data = stream.read(_MAX_VALUE_ITEM + 1)
        except zstandard.ZstdError:
            return None
        if len(data) > _MAX_VALUE_ITEM:
            return None
        if self._scratch < 0:
            with tempfile.TemporaryFile() as handle:
                self._scratch = os.dup(handle.fileno())
            self._temps.append(self._scratch)
        os.ftruncate(self._scratch, 0)
        os.pwrite(self._scratch, data, 0)
        return self._scratch, 0, len(data)

    def other_values(self, name: str, limit: int) -> np.ndarray | None:
        """A saved number or string (``step``, ``lr``), for comparing two checkpoints."""
        from ..torch.reader import _plain_value

        return _plain_value(self._values[name], limit) if name in self._values else None

    def other_stored_bytes(self, name: str, chunk: int = 1 << 20) -> Iterator[bytes] | None:
        """The stored bytes of an item saved as an object, or of an unread ``common.pt`` (for
        comparing two checkpoints); None for anything else, or a compressed item tclip cannot
        decompress here."""
        from .objects import common_bytes, range_bytes

        item = self.byte_items.get(name)
        if item is None:
            return common_bytes(self.path, name, any(o.name == name for o in self.others), chunk)
        fd, _ = self._file(item.relative_path)
        if item.transforms:
            found = self._small_decompressed(fd, item) if item.transforms == (ZSTD,) else None
            if found is None:
                return None
            scratch, start, length = found
            return iter([os.pread(scratch, length, start)])  # (read now: the scratch file is reused)
        return range_bytes(fd, item.offset, item.length, chunk)

    def plain_data(self, name: str) -> Any:
        """A saved object as plain data (an optimizer's ``param_groups.<fqn>.betas``), never code."""
        from ..torch.reader import _plain_data

        return _plain_data(self._values[name]) if name in self._values else None

    def _mark_optimizer_state(self, meta: DcpMetadata) -> None:
        """``<P>state.*`` tensors are optimizer state where ``<P>param_groups.*lr`` is saved, and
        ``optimizer.state.*`` always (torchtitan, Megatron, Accelerate name it so)."""
        prefixes = {"optimizer."}
        for name in meta.entries:
            head, found, tail = name.rpartition("param_groups.")
            if found and (not head or head.endswith(".")) and tail.endswith("lr"):
                prefixes.add(head)
        for name, info in self.tensors.items():
            if any(name.startswith(f"{prefix}state.") for prefix in prefixes):
                info.optimizer_state = True

    def chunk_files(self, name: str) -> list[str]:
        """The files holding a tensor's chunks, in chunk order (for people)."""
        return [piece.item.relative_path for piece in self.pieces[name]]

    def storage_files(self) -> dict[str, int]:
        """Every file ``storage_data`` names, relative to the folder, with its size in bytes."""
        return dict(self._sizes)

    # ------------------------------------------------------------------ reading

    def region(self, name: str) -> tuple[int, int] | None:
        pieces = self.pieces.get(name)
        if not pieces or len(pieces) != 1 or self.tensors[name].refused:
            return None
        piece = pieces[0]
        if piece.compressed or math.prod(piece.chunk.sizes) != self.tensors[name].size:
            return None
        self._ensure(name)
        return (piece.fd, piece.start) if piece.dense else None

    def runs(self, name: str) -> list[tuple[int, int, int, int]] | None:
        """Chunks that span whole rows (``Shard(0)``, as FSDP shards), each one run of the
        tensor's bytes: a writer copies them in the kernel. None for any other split."""
        info = self.tensors[name]
        pieces = self.pieces.get(name)
        if not pieces or info.refused or not info.shape or any(p.compressed for p in pieces):
            return None
        self._ensure(name)
        row = math.prod(info.shape[1:]) * info.dtype.itemsize
        found = [(p.chunk.offsets[0] * row, p.chunk.sizes[0] * row, p.fd, p.start) for p in pieces
                 if p.dense and p.chunk.sizes[1:] == info.shape[1:]]
        return sorted(f for f in found if f[1]) if len(found) == len(pieces) else None

    def parallel_safe(self, name: str) -> bool:
        return True  # preads and private maps; a zstd chunk is decompressed under a lock

    def _read_piece(self, piece: _Piece, local: Index, dest: np.ndarray, name: str) -> None:
        dtype = dest.dtype
        span = contiguous_span(local, piece.chunk.sizes, False) if local else (0, 1)
        if piece.dense and span is not None:
            offset = piece.start + span[0] * dtype.itemsize
            if dest.flags.c_contiguous:
                pread_into(piece.fd, dest.reshape(-1).view(np.uint8).data, offset, self.path, name)
            else:
                run = np.empty(dest.shape, dtype)
                pread_into(piece.fd, run.reshape(-1).view(np.uint8).data, offset, self.path, name)
                dest[...] = run
            return
        # A rectangle that is not one run of the file: copied from a private read-only map of
        # the bytes it spans (the resident memory stays the rectangle's).
        sizes = dest.shape
        itemsize = dtype.itemsize
        first = piece.start + sum(s.start * st for s, st in zip(local, piece.stride)) * itemsize
        last = first + (sum((n - 1) * st for n, st in zip(sizes, piece.stride)) + 1) * itemsize
        base = first - first % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(piece.fd, last - base, access=mmap.ACCESS_READ, offset=base) as mapped:
            raw = np.frombuffer(mapped, np.uint8, count=last - first, offset=first - base).view(dtype)
            view = np.lib.stride_tricks.as_strided(raw, sizes, [st * itemsize for st in piece.stride],
                                                   writeable=False)
            dest[...] = view
            del raw, view


def _check_apart(entries: dict[str, Any], bad: Any) -> None:
    """Refuse tensors of an embedded safetensors file whose byte ranges overlap: read as two
    tensors, the same bytes would be counted twice in a norm (safetensors itself refuses such a
    file; torch's DCP reader would load both)."""
    spans = sorted((o[0], o[1], k) for k, v in entries.items() if isinstance(o := v.get("data_offsets"), list)
                   and len(o) == 2 and type(o[0]) is int and type(o[1]) is int and o[1] > o[0])
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise bad(f"the tensors {first!r} and {second!r} have overlapping data_offsets (their bytes would be "
                      "counted twice)")


def _dtype(name: str) -> np.dtype | None:
    return TORCH_DTYPES.get(name)
