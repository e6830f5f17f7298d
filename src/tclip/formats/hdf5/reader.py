"""HDF5 files through h5py: every numeric dataset is a tensor named by its path.

What is not a tensor is listed in ``others`` with the reason (string,
compound, enum and reference datasets, dimension scales, types NumPy cannot
hold), never read as numbers and carried unchanged by an HDF5 rewrite.

A rewrite starts from a byte copy of the source (minus the data about to be
replaced) and writes the rewritten tensors' data in place, so everything else
is exactly as it was: the group tree, attributes (object references and
dimension scales included), links, creation order, chunking, compression
filters, fill values and every dataset tclip does not change. Contiguous
datasets and unfiltered chunks are read and written as raw byte regions
(``pread``/``pwrite``, any thread); other chunked ones through h5py, one thread
at a time.

Untrusted files (see README, Security): external links are not followed, and
datasets whose data lives in other files (external storage, virtual
datasets) are never read nor written. h5py works on a file in a child process
(:mod:`tclip.formats.hdf5.probe`), never in tclip's own, so that a file malformed
enough to crash the HDF5 library ends one child, not tclip. A dataset that
claims far more data than the file stores (a decompression bomb, or a huge
dataset of fill values) is refused before anything is read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core.units import Index, flat_rectangles
from ...errors import FormatError, UnsupportedError
from .._blocks import normalize_index
from .._io import flat_result
from ..base import OtherObject, TensorInfo, TensorReader, read_region
from .chunks import RawChunks, chunk_blocks
from .mask import MaskedFile
from .probe import Child, beat, decode_values, walk_seconds
from .probe import isolated as isolated_by_default
from .safety import (
    _H5_ERRORS,
    BOMB_FLOOR_BYTES,
    BOMB_RATIO,
    _filter_message,
    _first_line,
    _unreadable_filters,
    foreign_storage,
    import_h5py,
    lossy_filter,
)
from .values import UNSUPPORTED, _standard_type, attributes, classify

if TYPE_CHECKING:
    import h5py

class Hdf5Reader(TensorReader):
    """An HDF5 file's tensors.

    By default (``isolated``) the HDF5 library works on the file in a child process
    (:mod:`tclip.formats.hdf5.probe`): this object holds the child's description of the
    file, reads raw byte regions itself and asks the child for what HDF5 must decode.
    With ``isolated=False`` (``TCLIP_HDF5_PROBE=0``, and inside that child) h5py works
    here, and every exception it raises becomes a :class:`FormatError`.
    """

    format_name = "hdf5"

    def __init__(self, path: Path, isolated: bool | None = None,
                 masked: list[tuple[int, int]] | None = None) -> None:
        super().__init__(path)
        self.file: h5py.File | None = None
        self._child: Child | None = None
        self._lock = threading.RLock()
        self._raw_fd = -1
        self._regions: dict[str, int] = {}
        self._align: dict[str, int] = {}
        self._sparse: dict[str, dict[int, list[tuple[int, ...]]] | None] = {}
        self.contiguous_raw: dict[str, tuple[int, int]] = {}  # name -> (offset, nbytes) of raw data
        self.raw_chunks: dict[str, RawChunks] = {}  # unfiltered chunked datasets
        self.chunk_shapes: dict[str, tuple[int, ...]] = {}  # every chunked tensor's chunk shape
        self.group_attributes: dict[str, dict[str, Any]] = {}  # groups (not the root) that have attributes
        self._spans: list[tuple[int, int, str]] = []  # (start, end, what) of every region of the file named
        self._data_spans: dict[str, list[tuple[int, int]]] = {}  # what -> the regions of its raw data
        self._chunk_table: dict[str, list[tuple[tuple[int, ...], int, int]]] = {}  # (corner, offset, size)
        self.lossy: dict[str, str] = {}  # tensor -> the lossy filter its chunks pass
        if isolated is None:
            isolated = isolated_by_default()
        if isolated:
            self._open_in_child()
            return
        h5py = import_h5py()
        self._masked_file = None if masked is None else MaskedFile(path, masked)
        try:
            self.file = h5py.File(path if self._masked_file is None else self._masked_file, "r")
        except _H5_ERRORS as error:
            self.close()
            raise FormatError(f"not a valid HDF5 file ({_first_line(error)})", path) from None
        try:
            self._base = self.file.userblock_size
            self.metadata = attributes(self.file)
            self._note_header(self.file, "the root group")
            self._walk(self.file, {self.file["/"].id})  # a link back to the root is a legal cycle
            self._mark_optimizer_state()
            self._check_overlaps()
            if masked is None:
                self._check_data_apart()
        except (FormatError, UnsupportedError):
            self.close()
            raise
        except RecursionError:
            self.close()
            raise FormatError("cannot read the file's structure (groups nested too deeply)", path) from None
        except _H5_ERRORS as error:
            self.close()
            raise FormatError(f"cannot read the file's structure ({_first_line(error)})", path) from None

    # ------------------------------------------------------------------ the walk (h5py in this process)

    def _walk(self, group: h5py.Group, seen: set[Any]) -> None:
        """Datasets in the file's own order (creation order where it is tracked),
        each object once; soft and external links are not followed."""
        h5py = import_h5py()
        for key in group:
            beat()
            if not isinstance(group.get(key, getlink=True), h5py.HardLink):
                continue
            obj = group[key]
            if obj.id in seen:  # h5py object ids compare equal for hard links to one object
                continue
            seen.add(obj.id)
            self._note_header(obj, f"{obj.name.lstrip('/')!r}")
            if isinstance(obj, h5py.Group):
                if len(obj.attrs):
                    self.group_attributes[obj.name.lstrip("/")] = attributes(obj)
                self._walk(obj, seen)
            elif isinstance(obj, h5py.Dataset):
                self._add_dataset(obj)

    def _mark_optimizer_state(self) -> None:
        """Flag the variables of the optimizer a Keras file saved beside the weights: under
        ``optimizer/`` in Keras 3's layout (``layers/``, ``vars``, ``optimizer/vars``), under
        ``optimizer_weights/`` in the legacy one (``model_weights/`` or a ``keras_version``)."""
        h5py = import_h5py()
        root = self.file

        def group(name: str) -> bool:
            try:
                link = root.get(name, getlink=True)
                return isinstance(link, h5py.HardLink) and isinstance(root.get(name), h5py.Group)
            except _H5_ERRORS:
                return False

        prefixes = []
        if group("optimizer") and group("optimizer/vars") and (group("layers") or group("vars")):
            prefixes.append("optimizer/")
        if group("optimizer_weights") and (group("model_weights") or "keras_version" in self.metadata):
            prefixes.append("optimizer_weights/")
        if not prefixes:
            return
        for name, info in self.tensors.items():
            if name.startswith(tuple(prefixes)):
                info.optimizer_state = True

    def _add_dataset(self, dataset: h5py.Dataset) -> None:
        h5py = import_h5py()
        name = dataset.name.lstrip("/")
        other = classify(dataset)
        chunks = self._note_data(dataset, f"{'dataset' if other is not None else 'tensor'} {name!r}")
        if other is not None:
            kind, reason, numeric = other
            try:
                shape, dtype = dataset.shape, str(dataset.dtype)
            except _H5_ERRORS:
                shape, dtype = None, "?"
            self.others.append(OtherObject(name, kind, reason, shape, dtype, numeric,
                                           unreadable_type=kind == UNSUPPORTED))
            return
        info = TensorInfo(name, tuple(dataset.shape), dataset.dtype, attrs=attributes(dataset),
                          refused=foreign_storage(dataset) or self._bomb(dataset) or _unreadable_filters(dataset))
        self.tensors[name] = info
        if info.refused:
            return
        lossy = lossy_filter(dataset)
        if lossy is not None:
            self.lossy[name] = lossy
        layout = dataset.id.get_create_plist().get_layout()
        if layout == h5py.h5d.CONTIGUOUS and _standard_type(dataset):
            offset = dataset.id.get_offset()
            if offset is not None and info.nbytes:
                self._regions[name] = offset
                self.contiguous_raw[name] = (offset, info.nbytes)
        elif dataset.chunks is not None and len(info.shape) >= 1:
            self.chunk_shapes[name] = tuple(dataset.chunks)
            self._align[name] = dataset.chunks[0] * math.prod(info.shape[1:])
            logical = math.prod(-(-n // c) for n, c in zip(info.shape, dataset.chunks))
            allocated = dataset.id.get_num_chunks()
            if logical > 64 and allocated * 2 < logical:
                # Mostly chunks never written: HDF5 would make up each one's fill values
                # one at a time (12 s per million measured); tclip fills them itself and
                # reads only the chunks the file holds.
                self._sparse[name] = None
            elif allocated == logical and dataset.id.get_create_plist().get_nfilters() == 0 \
                    and _standard_type(dataset) and info.nbytes:
                # Every chunk stored as it is (no filter): each chunk is a raw region of the
                # file, read and written with pread/pwrite from any thread, no h5py in between.
                self.raw_chunks[name] = RawChunks(tuple(dataset.chunks), tuple(info.shape), info.dtype.itemsize)
                if chunks is not None and len(chunks) == logical:  # (a damaged index may list more)
                    self._chunk_table[name] = chunks

    def _note_header(self, obj: h5py.HLObject, label: str) -> None:
        h5py = import_h5py()
        try:
            # (HDF5 addresses count from the superblock, after any user block; data offsets
            # and the spans noted here count from the file's start)
            address = h5py.h5o.get_info(obj.id).addr + self._base
        except _H5_ERRORS:
            return
        # The fixed start of an object header (16 bytes in version 1; a version 2
        # header with its one message and checksum is longer): no data may lie there.
        self._spans.append((address, address + 16, f"the object header of {label}"))

    def _note_data(self, dataset: h5py.Dataset, label: str) -> list[tuple[tuple[int, ...], int, int]] | None:
        """Note the regions of the file that hold a dataset's data: its contiguous block,
        or each stored chunk; the chunks (corner, offset, size) of a chunked one."""
        h5py = import_h5py()
        try:
            if dataset.is_virtual or dataset.external:
                return None  # in other files, never read nor written
            layout = dataset.id.get_create_plist().get_layout()
            if layout == h5py.h5d.CONTIGUOUS:
                offset, size = dataset.id.get_offset(), dataset.id.get_storage_size()
                if offset is not None and size:
                    self._spans.append((offset, offset + size, label))
                    self._data_spans.setdefault(label, []).append((offset, offset + size))
            elif layout == h5py.h5d.CHUNKED and hasattr(dataset.id, "chunk_iter"):
                chunks: list[tuple[tuple[int, ...], int, int]] = []
                # A damaged index can list chunks without end (a B-tree with a cycle): no more
                # than the dataset can hold are noted (reading it reports the problem).
                most = math.prod(-(-n // c) for n, c in zip(dataset.shape, dataset.chunks))

                def note(chunk: Any) -> int | None:
                    beat()
                    if len(chunks) >= most:
                        return 1  # stops the iteration
                    chunks.append((tuple(chunk.chunk_offset), chunk.byte_offset, chunk.size))
                    if chunk.size:
                        self._spans.append((chunk.byte_offset, chunk.byte_offset + chunk.size, label))
                        self._data_spans.setdefault(label, []).append((chunk.byte_offset,
                                                                       chunk.byte_offset + chunk.size))
                    return None

                dataset.id.chunk_iter(note)
                return chunks
        except _H5_ERRORS:
            pass  # reading it reports the problem
        return None

    def _check_overlaps(self) -> None:
        """Refuse a file whose datasets share bytes with each other or with the file's own
        metadata: rewriting one would change the other (even one left out with --exclude),
        and a report would count the same bytes twice."""
        assert self.file is not None
        base = self.file.userblock_size
        head = os.pread(self._raw_file(), 16, base)
        if len(head) == 16 and head[:8] == b"\x89HDF\r\n\x1a\n":
            if head[8] in (0, 1):
                offsets = head[13]
                length = (24 if head[8] == 0 else 28) + 6 * offsets + 24
            else:
                offsets = head[9]
                length = 16 + 4 * offsets
            self._spans.append((base, base + length, "the file's superblock"))
        spans = sorted(self._spans)
        reach: tuple[int, int, str] | None = None
        for span in spans:
            if reach is not None and span[0] < reach[1]:
                both = f"{reach[2]} and {span[2]}" if span[2] != reach[2] else f"two chunks of {span[2]}"
                raise FormatError(f"{both} share bytes of the file (at offset {span[0]}); refused as malformed",
                                  self.path)
            if reach is None or span[1] > reach[1]:
                reach = span

    def _check_data_apart(self) -> None:
        """Refuse a file that keeps a dataset's data inside its own structure (object headers,
        B-trees, heaps): a rewrite of that data would overwrite the structure. Such a file walks
        differently once its data regions read as other bytes (:mod:`.mask`); the dataset
        named is found by halving the set of masked datasets."""
        if not self._data_spans:
            return
        expected = self._fingerprint()
        suspects = list(self._data_spans)
        if self._masked_fingerprint(suspects) == expected:
            return
        while len(suspects) > 1:
            half = suspects[:len(suspects) // 2]
            if self._masked_fingerprint(half) != expected:
                suspects = half
            elif self._masked_fingerprint(suspects[len(half):]) != expected:
                suspects = suspects[len(half):]
            else:  # only some datasets together: name none
                break
        what = f"the data of {suspects[0]}" if len(suspects) == 1 else "the data of its datasets"
        raise FormatError(f"{what} lies inside the file's own structure (object headers, B-trees or heaps); "
                          "refused as malformed", self.path)

    def _fingerprint(self) -> str:
        description, table = self.describe()
        digest = hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode("utf-8"))
        digest.update(table)
        return digest.hexdigest()

    def _masked_fingerprint(self, labels: list[str]) -> str | None:
        spans = [span for label in labels for span in self._data_spans[label]]
        try:
            masked = Hdf5Reader(self.path, isolated=False, masked=spans)
        except Exception:  # noqa: BLE001 - whatever the masked walk raises, it saw another file
            return None
        try:
            return masked._fingerprint()
        finally:
            masked.close()

    def _bomb(self, dataset: h5py.Dataset) -> str | None:
        logical = math.prod(dataset.shape) * dataset.dtype.itemsize
        stored = dataset.id.get_storage_size()
        if logical > BOMB_FLOOR_BYTES + BOMB_RATIO * stored:
            return (f"claims {logical:,} bytes of data but the file stores {stored:,} for it "
                    f"(more than {BOMB_RATIO} times as much plus 4 GiB): refused as a decompression bomb")
        return None

    # ------------------------------------------------------------------ the walk done by a child

    def needs_library(self) -> bool:
        """Whether reading the tensors needs HDF5 itself (compressed chunks, chunks never
        written, odd types), not only raw byte regions."""
        return any(not info.refused and info.nbytes and name not in self.contiguous_raw
                   and not (name in self.raw_chunks and name in self._chunk_table)
                   for name, info in self.tensors.items())

    def describe(self) -> tuple[dict[str, Any], bytes]:
        """What a child that walked the file sends back: plain data (JSON) and the chunk table
        of the raw-chunked tensors (int64 rows: corner..., offset, size)."""
        tables: list[int] = []
        for name in self.raw_chunks:
            for i, (corner, offset, size) in enumerate(self._chunk_table.get(name, ())):
                if not i & 0xFFFF:
                    beat()
                tables += (*corner, offset, size)
        description = {
            # every field the walk sets: a field left out here is lost for every file read in a child
            "tensors": [[t.name, list(t.shape), t.dtype.str, dict(t.attrs), t.refused, t.optimizer_state]
                        for t in self.tensors.values()],
            "others": [[o.name, o.kind, o.reason, None if o.shape is None else list(o.shape), o.dtype, o.numeric,
                        o.unreadable_type] for o in self.others],
            "metadata": self.metadata,
            "groups": self.group_attributes,
            "contiguous": {name: list(span) for name, span in self.contiguous_raw.items()},
            "align": self._align,
            "chunks": {name: list(shape) for name, shape in self.chunk_shapes.items()},
            "raw_chunks": [[name, len(self._chunk_table[name])] for name in self.raw_chunks
                           if name in self._chunk_table],
            "sparse": list(self._sparse),
            "lossy": self.lossy,
        }
        return description, np.asarray(tables, np.int64).tobytes()

    def _open_in_child(self) -> None:
        key = _identity(self.path)
        with _WALKED_LOCK:
            walked = _WALKED.get(key) if key is not None else None
        if walked is not None:  # opened before in this run (pass 1, then pass 2): no second walk
            self._load(json.loads(walked[0]), walked[1])
            return
        child = Child(self.path, "read", self.path, walk_seconds(self.path))
        header, payload = child.first
        try:
            self._load(header["description"], payload)
        except (KeyError, TypeError, ValueError) as error:
            child.kill()
            raise FormatError(f"the process that reads the file sent a description tclip cannot use ({error})",
                              self.path) from None
        if header.get("serving"):
            self._child = child
        else:
            child.close()
        if key is not None and len(payload) <= WALKED_TABLE_BYTES:
            with _WALKED_LOCK:
                _WALKED[key] = (json.dumps(header["description"]), payload)
                while len(_WALKED) > WALKED_FILES:
                    del _WALKED[next(iter(_WALKED))]

    def _load(self, description: dict[str, Any], table: bytes) -> None:
        for name, shape, dtype, attrs, refused, optimizer_state in description["tensors"]:
            self.tensors[name] = TensorInfo(name, tuple(shape), np.dtype(dtype), attrs=attrs, refused=refused,
                                            optimizer_state=bool(optimizer_state))
        self.others = [OtherObject(name, kind, reason, None if shape is None else tuple(shape), dtype, numeric,
                                   unreadable_type=bool(unreadable))
                       for name, kind, reason, shape, dtype, numeric, unreadable in description["others"]]
        self.metadata = description["metadata"]
        self.group_attributes = description["groups"]
        self.contiguous_raw = {name: (int(offset), int(nbytes)) for name, (offset, nbytes)
                               in description["contiguous"].items()}
        self._regions = {name: offset for name, (offset, _) in self.contiguous_raw.items()}
        self._align = {name: int(n) for name, n in description["align"].items()}
        self.chunk_shapes = {name: tuple(shape) for name, shape in description["chunks"].items()}
        self._sparse = {name: None for name in description["sparse"]}
        self.lossy = {str(name): str(text) for name, text in description["lossy"].items()}
        rows = np.frombuffer(table, np.int64)
        position = 0
        for name, count in description["raw_chunks"]:
            info = self.tensors[name]
            width = len(info.shape) + 2
            block = rows[position:position + count * width].reshape(count, width)
            position += count * width
            self.raw_chunks[name] = RawChunks(self.chunk_shapes[name], tuple(info.shape), info.dtype.itemsize)
            self._chunk_table[name] = [(tuple(int(c) for c in row[:-2]), int(row[-2]), int(row[-1])) for row in block]
        if position != rows.size:
            raise ValueError("chunk table of the wrong size")

    def _ask(self, header: dict[str, Any], what: str, nbytes: int = 0) -> tuple[dict[str, Any], bytes]:
        """One request to the child, started again if it had ended after its walk."""
        with self._lock:
            if self._child is None:
                self._child = Child(self.path, "read", self.path, walk_seconds(self.path))
            child = self._child
        return child.request(header, what=what, nbytes=nbytes)

    def _array_from_child(self, header: dict[str, Any], what: str, nbytes: int) -> np.ndarray:
        reply, payload = self._ask(header, what, nbytes)
        dtype = np.dtype(reply["dtype"])
        shape = tuple(reply["shape"])
        if dtype.hasobject or len(payload) != math.prod(shape) * dtype.itemsize:
            raise FormatError(f"the process that reads the file sent {len(payload)} bytes {what}", self.path)
        return np.frombuffer(payload, dtype).reshape(shape)

    # ------------------------------------------------------------------ the reader protocol

    def _raw_file(self) -> int:
        with self._lock:
            if self._raw_fd < 0:
                self._raw_fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return self._raw_fd

    def lost_in_conversion(self) -> list[str]:
        """The attributes of datasets and groups: only HDF5 holds them (the root's are the file's metadata)."""
        with_attrs = [t.name for t in self.tensors.values() if t.attrs] + list(self.group_attributes)
        if not with_attrs:
            return []
        return [f"the attributes of {len(with_attrs)} dataset(s) or group(s) ({', '.join(with_attrs[:3])}"
                f"{' ...' if len(with_attrs) > 3 else ''})"]

    def lossy_filters(self) -> dict[str, str]:
        return dict(self.lossy)

    def other_values(self, name: str, limit: int) -> np.ndarray | None:
        """A string, compound, enum or scale dataset's values (h5py decodes them as data)."""
        if self.file is None:
            try:
                reply, payload = self._ask({"op": "values", "name": name, "limit": limit},
                                           f"reading dataset {name!r}", limit)
            except FormatError:
                return None
            try:
                return decode_values(reply, payload)
            except (KeyError, TypeError, ValueError):
                return None
        h5py = import_h5py()
        with self._lock:
            try:
                dataset = self.file[name]
                if not isinstance(dataset, h5py.Dataset) or foreign_storage(dataset) or self._bomb(dataset):
                    return None
                if dataset.shape is None or math.prod(dataset.shape) * max(dataset.dtype.itemsize, 16) > limit:
                    return None
                return np.asarray(dataset[()])
            except _H5_ERRORS:
                return None

    def close(self) -> None:
        masked = getattr(self, "_masked_file", None)
        if masked is not None:
            self._masked_file = None
            self._close_file()
            masked.close()
            return
        self._close_file()

    def _close_file(self) -> None:
        if getattr(self, "_raw_fd", -1) >= 0:
            os.close(self._raw_fd)
            self._raw_fd = -1
        child = getattr(self, "_child", None)
        if child is not None:
            self._child = None
            child.close()
        file = getattr(self, "file", None)
        if file is None:
            return
        try:
            file.close()
        except _H5_ERRORS:
            pass
        self.file = None

    def region(self, name: str) -> tuple[int, int] | None:
        offset = self._regions.get(name)
        if offset is None:
            return None
        return self._raw_file(), offset

    def align(self, name: str) -> int:
        return self._align.get(name, 0)

    def parallel_safe(self, name: str) -> bool:
        return name in self._regions or name in self.raw_chunks

    def chunk_offsets(self, name: str) -> RawChunks:
        """The file offsets of a raw-chunked tensor's chunks (read from the chunk index once)."""
        chunks = self.raw_chunks[name]
        with self._lock:
            if chunks.offsets is None:
                table = self._chunk_table.get(name)
                if table is None:
                    table = self._local_chunk_table(name)
                offsets = {}
                for i, (corner, offset, size) in enumerate(table):
                    if size != chunks.nbytes:
                        raise FormatError(f"tensor {name!r}: chunk {i} holds {size} bytes, not {chunks.nbytes}",
                                          self.path)
                    offsets[corner] = offset
                expected = math.prod(-(-n // c) for n, c in zip(chunks.shape, chunks.chunks))
                if len(offsets) != expected or any(any(c % n for c, n in zip(corner, chunks.chunks))
                                                   or any(c >= s for c, s in zip(corner, chunks.shape))
                                                   for corner in offsets):
                    raise FormatError(f"tensor {name!r}: its chunk index does not cover the dataset", self.path)
                chunks.offsets = offsets
        self._raw_file()
        return chunks

    def _local_chunk_table(self, name: str) -> list[tuple[tuple[int, ...], int, int]]:
        assert self.file is not None
        try:
            dataset = self.file[name]
            return [(tuple(info.chunk_offset), info.byte_offset, info.size)
                    for info in map(dataset.id.get_chunk_info, range(dataset.id.get_num_chunks()))]
        except _H5_ERRORS as error:
            raise FormatError(f"tensor {name!r}: its chunk index cannot be read ({_first_line(error)})",
                              self.path) from None

    def read_flat(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        info = self.tensors[name]
        if info.refused:
            raise UnsupportedError(f"tensor {name!r}: {info.refused}", self.path)
        if name in self.raw_chunks:
            result = flat_result(info.dtype, stop - start, out)
            chunks = self.chunk_offsets(name)
            chunks.transfer(self._raw_fd, result, start, stop, self.path, write=False)
            return result
        if self.file is None and name not in self._regions:
            if stop <= start:
                return flat_result(info.dtype, 0, out)
            data = self._array_from_child({"op": "flat", "name": name, "start": start, "stop": stop},
                                          f"reading tensor {name!r}", (stop - start) * info.dtype.itemsize)
            if data.shape != (stop - start,) or data.dtype != info.dtype:
                raise FormatError(f"the process that reads the file sent {data.dtype}{list(data.shape)} "
                                  f"for elements {start}..{stop} of tensor {name!r}", self.path)
            result = flat_result(info.dtype, stop - start, out)
            result[...] = data
            return result
        if name not in self._sparse:
            return super().read_flat(name, start, stop, out)
        assert self.file is not None
        with self._lock:
            try:
                return self._read_sparse(name, start, stop, out)
            except _H5_ERRORS as error:
                raise FormatError(f"tensor {name!r} cannot be read ({_filter_message(error)})", self.path) from None

    def _read_sparse(self, name: str, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
        assert self.file is not None
        info = self.tensors[name]
        dataset = self.file[name]
        by_row = self._sparse[name]
        if by_row is None:
            by_row = self._sparse[name] = self._allocated_chunks(dataset)
        result = flat_result(info.dtype, stop - start, out)
        fill = dataset.fillvalue
        result[...] = fill if fill is not None else 0
        chunks = dataset.chunks
        position = 0
        for rect in flat_rectangles(info.shape, start, stop):
            extent = tuple(s.stop - s.start for s in rect)
            size = math.prod(extent)
            view = result[position:position + size].reshape(extent)
            position += size
            first_row, last_row = rect[0].start // chunks[0], (rect[0].stop - 1) // chunks[0]
            for row in range(first_row, last_row + 1):
                for corner in by_row.get(row, ()):
                    overlap = []
                    for s, c, n in zip(rect, corner, chunks):
                        lo, hi = max(s.start, c), min(s.stop, c + n)
                        if lo >= hi:
                            break
                        overlap.append((lo, hi))
                    else:
                        data = dataset[tuple(slice(lo, hi) for lo, hi in overlap)]
                        view[tuple(slice(lo - s.start, hi - s.start) for (lo, hi), s in zip(overlap, rect))] = data
        return result

    @staticmethod
    def _allocated_chunks(dataset: h5py.Dataset) -> dict[int, list[tuple[int, ...]]]:
        by_row: dict[int, list[tuple[int, ...]]] = {}
        for i in range(dataset.id.get_num_chunks()):
            corner = tuple(dataset.id.get_chunk_info(i).chunk_offset)
            by_row.setdefault(corner[0] // dataset.chunks[0], []).append(corner)
        return by_row

    def blocks(self, name: str, max_bytes: int = 8 << 20) -> Any:
        info = self.tensors[name]
        chunks = self.chunk_shapes.get(name)
        if chunks is None or info.size == 0:
            return info.blocks(max_bytes)
        return chunk_blocks(info.shape, chunks)

    def read(self, name: str, index: Index | None = None, scratch: bytearray | None = None) -> np.ndarray:
        info = self.tensors[name]
        if info.refused:
            raise UnsupportedError(f"tensor {name!r}: {info.refused}", self.path)
        if self.file is None:
            full = normalize_index(index, info.shape) if info.shape else ()
            if not info.size:
                return np.empty(tuple(s.stop - s.start for s in full), info.dtype)
            if name in self._regions:
                return read_region(self, name, index)
            nbytes = math.prod(s.stop - s.start for s in full) * info.dtype.itemsize
            data = self._array_from_child({"op": "read", "name": name,
                                           "index": [[s.start, s.stop] for s in full]},
                                          f"reading tensor {name!r}", nbytes)
            if data.shape != tuple(s.stop - s.start for s in full) or data.dtype != info.dtype:
                raise FormatError(f"the process that reads the file sent {data.dtype}{list(data.shape)} "
                                  f"for a block of tensor {name!r}", self.path)
            return data
        with self._lock:
            try:
                dataset = self.file[name]
                data = dataset[()] if index is None or not index else dataset[index]
            except _H5_ERRORS as error:
                raise FormatError(f"tensor {name!r} cannot be read ({_filter_message(error)})",
                                  self.path) from None
        return np.asarray(data)


# Descriptions of files walked in this process, by identity (device, inode, size, time
# of change): a file opened again unchanged is not walked again. Bounded: the last few.
WALKED_FILES = 64
WALKED_TABLE_BYTES = 16 << 20
_WALKED: dict[tuple[int, int, int, int], tuple[str, bytes]] = {}
_WALKED_LOCK = threading.Lock()


def _identity(path: Path) -> tuple[int, int, int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


Reader = Hdf5Reader
