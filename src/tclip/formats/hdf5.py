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
(:mod:`tclip.formats._h5probe`), never in tclip's own, so that a file malformed
enough to crash the HDF5 library ends one child, not tclip. A dataset that
claims far more data than the file stores (a decompression bomb, or a huge
dataset of fill values) is refused before anything is read.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import posixpath
import threading
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from ..children import HDF5_SUFFIXES
from ..core.dtypes import ML_FLOAT_TYPES
from ..core.units import Index, flat_rectangles
from ..errors import FormatError, UnsupportedError
from ._blocks import contiguous_span, normalize_index
from ._h5probe import Child, beat, decode_values, walk_seconds
from ._h5mask import MaskedFile
from ._h5probe import isolated as isolated_by_default
from ._io import copy_except, copy_range, flat_result, pread_into, pwrite_all
from .atomic import AtomicOutput
from .base import OtherObject, TensorInfo, TensorReader, TensorWriter, read_region

if TYPE_CHECKING:
    import h5py

NAME = "hdf5"
SUFFIXES = HDF5_SUFFIXES  # (the command line starts the HDF5 child early for these)
HOLDS_METADATA = True
# Keras 3 loads weights only from names ending so: tclip's outputs keep the ending whole.
KEPT_ENDINGS = (".weights.h5",)
SIGNATURE = b"\x89HDF\r\n\x1a\n"


def sniff(head: bytes, size: int) -> bool:
    return head.startswith(SIGNATURE)


def sniff_file(handle: BinaryIO, size: int) -> bool:
    """The signature behind a user block of 512, 1024, 2048... bytes (HDF5 allows one)."""
    offset = 512
    while offset + 8 <= size:
        handle.seek(offset)
        if handle.read(8) == SIGNATURE:
            return True
        offset *= 2
    return False


_H5PY: Any = None


def import_h5py() -> Any:
    """h5py, imported on first use with hdf5plugin's filters (blosc, blosc2, bzip2, lz4,
    zstd...) registered where installed: the format registry imports this module, and a
    run that never meets an HDF5 file never pays for h5py."""
    global _H5PY
    if _H5PY is None:
        import h5py

        try:
            import hdf5plugin  # noqa: F401
        except ImportError:  # the optional extra tclip[hdf5-filters]
            pass
        _H5PY = h5py
    return _H5PY

_H5_ERRORS = (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError, IndexError, OverflowError,
              SystemError)

# A dataset may hold at most this much more data than the file stores for it
# (compression of a constant, or chunks never written, read as the fill value).
BOMB_FLOOR_BYTES = 4 << 30
BOMB_RATIO = 4096
# Rewriting a dataset of more chunks than this is refused (HDF5 spends microseconds per chunk).
MAX_REWRITTEN_CHUNKS = 1 << 22
# Attributes larger than this are described, not read (a crafted attribute can
# claim a dataspace of 2**60 elements).
ATTRIBUTE_LIMIT_BYTES = 1 << 20


def foreign_storage(dataset: h5py.Dataset) -> str | None:
    """Why a dataset's data is not in this file (external storage, virtual), or None.

    Such data lives in other files, named by the file itself: reading it would
    read any file the author chose, writing it would write there. tclip does
    neither (see README, Security).
    """
    if dataset.is_virtual:
        sources = sorted({str(m.file_name) for m in dataset.virtual_sources()})
        shown = ", ".join(repr(s) for s in sources[:3]) + (" ..." if len(sources) > 3 else "")
        return f"virtual dataset: its data lives in other files ({shown}), which tclip never reads or writes"
    external = dataset.external
    if external:
        names = sorted({e[0].decode("utf-8", "replace") if isinstance(e[0], bytes) else str(e[0]) for e in external})
        shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
        return f"external storage: its data lives in other files ({shown}), which tclip never reads or writes"
    return None


# The kind of a dataset of a type tclip cannot read (times, bitfields, opaque data, quad
# floats...): it may hold numbers, so no check passes over it (OtherObject.unreadable_type).
UNSUPPORTED = "unsupported type"


def classify(dataset: h5py.Dataset) -> tuple[str, str, bool] | None:
    """(kind, reason, numeric) for a dataset that is not a tensor tclip reads; None for a tensor."""
    h5py = import_h5py()
    try:
        dtype = dataset.dtype
    except _H5_ERRORS:
        type_class = dataset.id.get_type().get_class()
        names = {h5py.h5t.TIME: "an HDF5 time type", h5py.h5t.BITFIELD: "a bitfield type",
                 h5py.h5t.OPAQUE: "an opaque type"}
        return UNSUPPORTED, f"{names.get(type_class, 'a type NumPy cannot hold')} is not supported", False
    if dataset.shape is None:
        return "empty dataset", "holds no data (null dataspace)", False
    if h5py.h5ds.is_scale(dataset.id):
        return "dimension scale", "coordinates of another dataset's axis, not a tensor", dtype.kind in "biuf"
    if h5py.check_enum_dtype(dtype) is not None:
        return "enum dataset", "enumerated values, not numbers", False
    if h5py.check_ref_dtype(dtype) is not None:
        return "reference dataset", "object or region references, not numbers", False
    if h5py.check_vlen_dtype(dtype) is not None or h5py.check_string_dtype(dtype) is not None \
            or dtype.kind in "SUO":
        return "string dataset", "strings, not numbers", False
    if dtype.fields is not None:
        return "compound dataset", "compound records, not numbers", False
    if dtype.kind not in "biufc":
        return UNSUPPORTED, f"{dtype} is not a numeric type", False
    if dtype.kind in "fc" and dtype.itemsize > (16 if dtype.kind == "c" else 8):
        return UNSUPPORTED, f"{dtype.itemsize * 8}-bit floats (quad precision) are not supported", False
    if dtype.kind == "f" and dataset.id.get_type().get_size() != dtype.itemsize:
        return UNSUPPORTED, "a non-standard floating-point layout is not supported", False
    return None


def plain_value(value: Any, file: h5py.File | None = None) -> Any:
    """An attribute value as plain data for reports and JSON: str, int, float, bool,
    None, lists and dicts. Byte strings are decoded (UTF-8, else Latin-1),
    references become the path they point to, empty attributes None."""
    h5py = import_h5py()
    if isinstance(value, h5py.Empty):
        return None
    if isinstance(value, (bytes, np.bytes_)):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("latin-1")
    if isinstance(value, h5py.RegionReference):
        return f"<region reference to {_deref(value, file)}>"
    if isinstance(value, h5py.Reference):
        return f"<reference to {_deref(value, file)}>"
    if isinstance(value, np.void):
        if value.dtype.fields:
            return {key: plain_value(value[key], file) for key in value.dtype.names}
        return bytes(value).hex()
    if isinstance(value, np.ndarray):
        if value.dtype.fields:
            return [plain_value(v, file) for v in value.reshape(-1)]
        if value.dtype.kind in "OSUV":
            return _nested([plain_value(v, file) for v in value.reshape(-1)], value.shape)
        if value.dtype.kind == "c":
            return _nested([str(v) for v in value.reshape(-1).tolist()], value.shape)
        return value.tolist()
    if isinstance(value, np.generic):
        item = value.item()
        return str(item) if isinstance(item, complex) else item
    if isinstance(value, complex):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _nested(flat: list[Any], shape: tuple[int, ...]) -> Any:
    if not shape:
        return flat[0] if flat else None
    if len(shape) == 1:
        return flat
    step = math.prod(shape[1:])
    return [_nested(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def _deref(reference: Any, file: h5py.File | None) -> str:
    h5py = import_h5py()
    if not reference or file is None:
        return "nothing"
    try:
        return str(h5py.h5r.get_name(reference, file.id).decode("utf-8", "replace"))
    except _H5_ERRORS:
        return "an unreadable object"


def attributes(obj: h5py.HLObject) -> dict[str, Any]:
    """An object's attributes as plain values (for reports), in the file's order."""
    out: dict[str, Any] = {}
    try:
        names = list(obj.attrs)
    except _H5_ERRORS:
        return {"<attributes>": "<unreadable>"}
    for key in names:
        beat()
        out[key] = _attribute(obj, key)
    return out


def _attribute(obj: h5py.HLObject, key: str) -> Any:
    h5py = import_h5py()
    try:
        attr = h5py.h5a.open(obj.id, key.encode("utf-8"))
        shape, dtype = attr.shape, attr.dtype
        if shape is not None and math.prod(shape) * max(dtype.itemsize, 1) > ATTRIBUTE_LIMIT_BYTES:
            return f"<{'x'.join(map(str, shape))} attribute of {dtype}, not shown>"
        return plain_value(obj.attrs[key], obj.file)
    except _H5_ERRORS:
        return "<unreadable>"


def _standard_type(dataset: h5py.Dataset) -> bool:
    """The stored type is the IEEE/two's complement layout of the dataset's NumPy dtype."""
    h5py = import_h5py()
    try:
        return bool(dataset.id.get_type().equal(h5py.h5t.py_create(dataset.dtype)))
    except _H5_ERRORS:
        return False


class Hdf5Reader(TensorReader):
    """An HDF5 file's tensors.

    By default (``isolated``) the HDF5 library works on the file in a child process
    (:mod:`tclip.formats._h5probe`): this object holds the child's description of the
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
        differently once its data regions read as other bytes (:mod:`._h5mask`); the dataset
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


def chunk_blocks(shape: tuple[int, ...], chunks: tuple[int, ...]) -> Any:
    """Whole chunks in C order of the chunk grid (as h5py's ``iter_chunks``), so each is decompressed once."""
    for corner in itertools.product(*(range(0, n, c) for n, c in zip(shape, chunks))):
        yield tuple(slice(c, min(c + k, n)) for c, k, n in zip(corner, chunks, shape))


class RawChunks:
    """The chunks of an unfiltered chunked dataset as raw regions of the file.

    A chunk is stored whole (edge chunks too), in C order of the chunk's shape.
    :meth:`transfer` moves a flat run of the dataset between a buffer and the chunks
    that hold it; when chunks span whole trailing dimensions (a chunk is then a run
    of whole rows) the bytes go straight between file and buffer.
    """

    def __init__(self, chunks: tuple[int, ...], shape: tuple[int, ...], itemsize: int) -> None:
        self.chunks, self.shape, self.itemsize = chunks, shape, itemsize
        self.nbytes = math.prod(chunks) * itemsize
        self.offsets: dict[tuple[int, ...], int] | None = None
        self.rows = len(shape) >= 1 and tuple(chunks[1:]) == tuple(shape[1:])
        self._locks: dict[tuple[int, ...], threading.Lock] = {}
        self._guard = threading.Lock()

    def _lock(self, corner: tuple[int, ...]) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(corner, threading.Lock())

    def transfer(self, fd: int, flat: np.ndarray, start: int, stop: int, path: object, write: bool) -> None:
        """Read elements ``[start, stop)`` into ``flat`` (or, with ``write``, write them from it)."""
        assert self.offsets is not None
        row = math.prod(self.shape[1:])
        if self.rows and start % row == 0 and (stop % row == 0 or stop == math.prod(self.shape)):
            first_row, last_row = start // row, -(-stop // row)
            for corner_row in range(first_row - first_row % self.chunks[0], last_row, self.chunks[0]):
                lo, hi = max(corner_row, first_row), min(corner_row + self.chunks[0], last_row)
                offset = self.offsets[(corner_row,) + (0,) * (len(self.shape) - 1)]
                part = flat[(lo - first_row) * row:(hi - first_row) * row]
                position = offset + (lo - corner_row) * row * self.itemsize
                if write:
                    pwrite_all(fd, part.view(np.uint8).data, position)
                else:
                    pread_into(fd, part.view(np.uint8).data, position, path, "chunk")
            return
        position = 0
        buffer = np.empty(math.prod(self.chunks), flat.dtype)
        for rect in flat_rectangles(self.shape, start, stop):
            extent = tuple(s.stop - s.start for s in rect)
            size = math.prod(extent)
            view = flat[position:position + size].reshape(extent)
            position += size
            ranges = [range(s.start - s.start % c, s.stop, c) for s, c in zip(rect, self.chunks)]
            for corner in itertools.product(*ranges):
                inside = tuple(slice(max(s.start, c), min(s.stop, c + n)) for s, c, n in zip(rect, corner, self.chunks))
                in_chunk = tuple(slice(i.start - c, i.stop - c) for i, c in zip(inside, corner))
                in_view = tuple(slice(i.start - s.start, i.stop - s.start) for i, s in zip(inside, rect))
                offset = self.offsets[corner]
                chunk = buffer.reshape(self.chunks)
                with self._lock(corner):  # a chunk shared by two blocks: read, patch, write
                    pread_into(fd, buffer.view(np.uint8).data, offset, path, "chunk")
                    if write:
                        chunk[in_chunk] = view[in_view]
                        pwrite_all(fd, buffer.view(np.uint8).data, offset)
                if not write:
                    view[in_view] = chunk[in_chunk]


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]


# HDF5 filter ids of the registered filters h5py does not ship, and the package
# that provides them (https://github.com/HDFGroup/hdf5_plugins/blob/master/docs/RegisteredFilterPlugins.md).
_PLUGIN_FILTERS = {
    307: "bzip2", 32001: "blosc", 32004: "lz4", 32008: "bitshuffle", 32015: "zstd", 32026: "blosc2",
    32013: "zfp", 32017: "sz", 32024: "sz3", 32018: "fcidecomp",
}


def _filter_message(error: BaseException) -> str:
    text = _first_line(error)
    if "filter" in text.lower() or "can't open directory" in text.lower():
        return (f"{text}; it is compressed with an HDF5 filter this installation lacks: "
                "pip install 'tclip[hdf5-filters]' (hdf5plugin) provides blosc, blosc2, bzip2, lz4, zstd and more")
    return f"{text}; the file may be truncated or corrupt"


def missing_filters(dataset: h5py.Dataset) -> list[str]:
    """Names of the filters of a dataset that HDF5 cannot apply here."""
    h5py = import_h5py()
    missing = []
    plist = dataset.id.get_create_plist()
    for i in range(plist.get_nfilters()):
        filter_id = plist.get_filter(i)[0]
        if not h5py.h5z.filter_avail(filter_id):
            missing.append(_PLUGIN_FILTERS.get(filter_id, f"filter {filter_id}"))
    return missing


def _unreadable_filters(dataset: h5py.Dataset) -> str | None:
    missing = missing_filters(dataset)
    if not missing:
        return None
    return (f"compressed with {', '.join(missing)}, which this installation of HDF5 cannot read: "
            "pip install 'tclip[hdf5-filters]' (the hdf5plugin package)")


# Registered HDF5 filters that do not give back the bytes they were given.
_LOSSY_PLUGINS = {32013: "ZFP", 32017: "SZ", 32024: "SZ3", 32019: "JPEG", 32028: "SPERR"}


def lossy_filter(dataset: h5py.Dataset) -> str | None:
    """The lossy filter a float dataset's chunks pass (None: they come back as written).

    HDF5's scale-offset filter keeps a float to the decimal digits its scale factor
    says (``scaleoffset=3``: three), so a value written is not the value read back;
    on integers (with the minimum bits computed) it is lossless.
    """
    h5py = import_h5py()
    plist = dataset.id.get_create_plist()
    for i in range(plist.get_nfilters()):
        code, _, values, _ = plist.get_filter(i)
        if code == h5py.h5z.FILTER_SCALEOFFSET and dataset.dtype.kind in "fc":
            digits = f", {values[1]} decimal digits" if len(values) > 1 else ""
            return f"HDF5's scale-offset filter{digits}"
        if code in _LOSSY_PLUGINS:
            return f"the {_LOSSY_PLUGINS[code]} filter"
    return None


def _check_path(name: str, target: Path) -> None:
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") for p in parts):
        raise UnsupportedError(f"tensor name {name!r} is not a valid HDF5 path", target)


def _check_tree(names: list[str], target: Path) -> None:
    """Refuse names that need one path to be a dataset and a group at once (``a`` and ``a/b``)."""
    datasets = set(names)
    for name in names:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            group = "/".join(parts[:depth])
            if group in datasets:
                raise UnsupportedError(f"tensors {group!r} and {name!r} cannot both be written to HDF5: "
                                       f"{group!r} would have to be a dataset and the group holding {name!r}; "
                                       "rename one, or write .safetensors or .npz", target)


class DatasetWrites:
    """Blocks written into an HDF5 file's datasets through h5py, one dataset open at a time
    (HDF5 holds several MiB per open dataset being written, which would grow with the
    tensor count). Every exception of h5py becomes a :class:`FormatError` naming ``label``.

    ``create``: a new file whose datasets are created from these tensors where missing
    (a conversion), with ``metadata`` as root attributes. None: tclip's copy of a file,
    opened for writing; every dataset written must exist, and one whose data lives in
    other files is refused.
    """

    def __init__(self, path: Path, label: Path | None = None, create: dict[str, TensorInfo] | None = None,
                 metadata: dict[str, Any] | None = None) -> None:
        h5py = import_h5py()
        self.label = label or path
        self._create = create
        self._current: tuple[str, h5py.Dataset] | None = None
        try:
            self.file: h5py.File | None = h5py.File(path, "w" if create is not None else "r+")
        except _H5_ERRORS as error:
            raise FormatError(f"cannot open the copy for writing ({_first_line(error)})", self.label) from None
        try:
            for key, value in (metadata or {}).items():
                self.file.attrs[key] = value
        except _H5_ERRORS as error:
            self.abandon()
            raise UnsupportedError(f"cannot write HDF5 ({_first_line(error)})", self.label) from None

    def _dataset(self, name: str) -> h5py.Dataset:
        if self._current is not None and self._current[0] == name:
            return self._current[1]
        assert self.file is not None
        self._current = None
        if name in self.file:
            dataset = self.file[name]
            # Never write through to another file (external storage, virtual sources).
            reason = foreign_storage(dataset)
            if reason is not None:
                raise UnsupportedError(f"tensor {name!r}: {reason}", self.label)
            # Asking loads the filter plugins the dataset names: HDF5 skips an optional filter
            # it has not loaded when it writes, and the chunks would be stored without it.
            missing = missing_filters(dataset)
            if missing:
                raise UnsupportedError(f"tensor {name!r}: compressed with {', '.join(missing)}, which this "
                                       "installation of HDF5 cannot write", self.label)
        elif self._create is not None:
            info = self._create[name]
            parent_name, base = posixpath.split(name)
            parent = self.file.require_group(parent_name) if parent_name else self.file
            dataset = parent.create_dataset(base, shape=info.shape, dtype=info.dtype)
        else:
            raise FormatError(f"tensor {name!r} is missing from the copy of the file", self.label)
        self._current = (name, dataset)
        return dataset

    def write(self, name: str, index: Index, data: np.ndarray) -> None:
        try:
            dataset = self._dataset(name)
            if dataset.shape == ():
                dataset[()] = data
            else:
                dataset[index] = data
        except (FormatError, UnsupportedError):
            raise
        except _H5_ERRORS as error:
            raise FormatError(f"tensor {name!r} cannot be written ({_filter_message(error)})", self.label) from None

    def close(self) -> None:
        """Create what was never written (empty tensors of a conversion), flush and close."""
        try:
            if self._create is not None:
                for name in self._create:  # empty tensors never receive a block
                    assert self.file is not None
                    if name not in self.file:
                        self._dataset(name)
            self._current = None
            if self.file is not None:
                self.file.flush()
                self.file.close()
                self.file = None
        except (FormatError, UnsupportedError):
            raise
        except _H5_ERRORS as error:
            raise FormatError(f"cannot finish writing HDF5 ({_first_line(error)})", self.label) from None

    def abandon(self) -> None:
        """Close without caring how (the file is being thrown away)."""
        self._current = None
        try:
            if self.file is not None:
                self.file.close()
        except Exception:  # noqa: BLE001 - whatever h5py raises, the file is being thrown away
            pass
        self.file = None


class Hdf5Writer(TensorWriter):
    """Writes HDF5. Created like an HDF5 reader, it starts from a byte copy of the
    source file without the data of the tensors it will rewrite, and writes
    those in place (contiguous ones as raw byte regions, chunked ones through
    h5py), so every structure HDF5 can hold survives as it was. (Rewritten
    compressed chunks that no longer fit their old space are stored anew; the
    file can grow a little.) From another format, datasets are created at the
    tensors' paths.

    HDF5 writes into the copy of an untrusted file (whose metadata came from that file)
    are done by a child process, as its reads are (:mod:`tclip.formats._h5probe`).
    """

    format_name = "hdf5"

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput, *,
                 like: TensorReader | None, metadata: dict[str, Any] | None,
                 rewritten: Collection[str] | None) -> None:
        super().__init__(target, tensors, output)
        self._like = like if isinstance(like, Hdf5Reader) else None
        for info in tensors:
            if info.dtype.type in ML_FLOAT_TYPES:
                raise UnsupportedError(f"HDF5 has no {info.dtype.name} type (tensor {info.name!r}); "
                                       "write .safetensors instead", target)
            if not info.numeric:
                raise UnsupportedError(f"tensor {info.name!r} of dtype {info.dtype} cannot be written to HDF5",
                                       target)
            if self._like is None:
                _check_path(info.name, target)
        if self._like is None:
            _check_tree([info.name for info in tensors], target)
        self._lock = threading.RLock()
        self._fd = -1
        self._writes: DatasetWrites | None = None
        self._child: Child | None = None
        self._raw: dict[str, int] = {}
        self._chunked: dict[str, RawChunks] = {}
        self.rewritten = set(self.tensors) if rewritten is None else set(rewritten)
        try:
            if self._like is not None:
                self._start_from_copy(self._like)
            else:
                output.check()  # h5py opens it by name
                self._writes = DatasetWrites(output.temp, target, create=dict(self.tensors), metadata=metadata)
        except OSError as error:
            self._close_quietly()
            raise UnsupportedError(f"cannot write HDF5 ({_first_line(error)})", target) from None
        except BaseException:
            self._close_quietly()
            raise

    def _start_from_copy(self, like: Hdf5Reader) -> None:
        for name in self.rewritten:
            info, chunks = like.tensors[name], like.chunk_shapes.get(name)
            if chunks is not None:
                count = math.prod(-(-n // c) for n, c in zip(info.shape, chunks))
                if count > MAX_REWRITTEN_CHUNKS:
                    raise UnsupportedError(f"tensor {name!r} is split into {count:,} chunks of "
                                           f"{math.prod(chunks) * info.dtype.itemsize} bytes; rewriting so "
                                           "many chunks is refused (rechunk it first, e.g. with h5repack -l)",
                                           like.path)
        holes = {name: like.contiguous_raw[name] for name in self.rewritten if name in like.contiguous_raw}
        self._chunked = {name: like.chunk_offsets(name) for name in self.rewritten if name in like.raw_chunks}
        chunk_holes = [(offset, chunks.nbytes) for chunks in self._chunked.values()
                       for offset in (chunks.offsets or {}).values()]
        source_fd = os.open(like.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(source_fd).st_size
            self._fd = self.output.open()
            os.ftruncate(self._fd, size)
            copy_except(source_fd, self._fd, size, list(holes.values()) + chunk_holes, like.path)
        finally:
            os.close(source_fd)
        self._raw = {name: offset for name, (offset, _) in holes.items()}
        if any(name not in self._raw and name not in self._chunked for name in self.rewritten):
            self.output.check()  # h5py opens it by name
            if like.file is None:  # an untrusted file: HDF5 writes its copy in a child
                self._child = Child(like.path, "write", self.output.temp, walk_seconds(self.output.temp))
            else:
                self._writes = DatasetWrites(self.output.temp, like.path)

    def parallel_safe(self, name: str) -> bool:
        return name in self._raw or name in self._chunked

    def blocks(self, name: str, max_bytes: int = 8 << 20) -> Any:
        if self._like is not None and name in self._like.tensors:
            return self._like.blocks(name, max_bytes)
        return self.tensors[name].blocks(max_bytes)

    def write_flat(self, name: str, start: int, data: np.ndarray) -> None:
        if name in self._chunked:
            array = np.ascontiguousarray(data, dtype=self.tensors[name].dtype)
            self._chunked[name].transfer(self._fd, array.reshape(-1), start, start + array.size, self.target,
                                         write=True)
            return
        offset = self._raw.get(name)
        if offset is None:
            with self._lock:
                super().write_flat(name, start, data)
            return
        dtype = self.tensors[name].dtype
        array = np.ascontiguousarray(data, dtype=dtype)
        pwrite_all(self._fd, array.reshape(-1).view(np.uint8).data, offset + start * dtype.itemsize)

    def write(self, name: str, index: Index, data: np.ndarray) -> None:
        if name in self._chunked:
            info = self.tensors[name]
            index = normalize_index(index, info.shape)
            block = np.asarray(data, dtype=info.dtype).reshape(tuple(s.stop - s.start for s in index))
            strides = [math.prod(info.shape[i + 1:]) for i in range(len(info.shape))]
            for lead in itertools.product(*(range(s.start, s.stop) for s in index[:-1])):
                first = sum(i * st for i, st in zip(lead, strides)) + index[-1].start if info.shape else 0
                run = block[tuple(i - s.start for i, s in zip(lead, index[:-1]))].reshape(-1)
                self.write_flat(name, first, run)
            return
        if name in self._raw:
            info = self.tensors[name]
            index = normalize_index(index, info.shape)
            span = contiguous_span(index, info.shape, False) if info.shape else (0, 1)
            if span is not None:
                self.write_flat(name, span[0], np.asarray(data).reshape(-1))
                return
            raise FormatError(f"internal error: block {index} of {name!r} is not contiguous", self.target)
        with self._lock:
            if self._child is not None:
                info = self.tensors[name]
                full = normalize_index(index, info.shape) if info.shape else ()
                array = np.ascontiguousarray(np.asarray(data, dtype=info.dtype).reshape(
                    tuple(s.stop - s.start for s in full)))
                self._child.request({"op": "write", "name": name, "index": [[s.start, s.stop] for s in full],
                                     "dtype": array.dtype.str, "shape": list(array.shape)},
                                    array.reshape(-1).view(np.uint8), what=f"writing tensor {name!r}")
                return
            assert self._writes is not None
            self._writes.write(name, index, data)

    def copy_tensor(self, reader: TensorReader, name: str, max_bytes: int = 8 << 20) -> None:
        if reader is self._like:
            if name in self._raw:  # announced as rewritten, so left out of the copy
                offset, nbytes = self._like.contiguous_raw[name]
                region = reader.region(name)
                assert region is not None
                copy_range(region[0], region[1], nbytes, self._fd, offset, reader.path)
            return  # already there, byte for byte
        super().copy_tensor(reader, name, max_bytes)

    def _finish(self) -> None:
        with self._lock:
            if self._child is not None:
                self._child.request({"op": "finish", "name": ""}, what="writing the output")
                child, self._child = self._child, None
                child.close()
            if self._writes is not None:
                writes, self._writes = self._writes, None
                writes.close()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def _close_quietly(self) -> None:
        if self._child is not None:
            child, self._child = self._child, None
            child.kill()
        if self._writes is not None:
            writes, self._writes = self._writes, None
            writes.abandon()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass


Reader = Hdf5Reader
Writer = Hdf5Writer
