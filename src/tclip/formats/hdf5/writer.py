"""HDF5 rewrites: a byte copy of the source (minus the data about to be replaced), the rewritten
tensors' data written in place (raw regions where the layout allows, h5py in a child otherwise).
"""

from __future__ import annotations

import itertools
import math
import os
import posixpath
import threading
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core.dtypes import ML_FLOAT_TYPES
from ...core.units import Index
from ...errors import FormatError, UnsupportedError
from .._blocks import contiguous_span, normalize_index
from .._io import copy_except, copy_range, pwrite_all
from ..atomic import AtomicOutput
from ..base import TensorInfo, TensorReader, TensorWriter
from .chunks import RawChunks
from .probe import Child, walk_seconds
from .reader import Hdf5Reader
from .safety import (
    _H5_ERRORS,
    MAX_REWRITTEN_CHUNKS,
    _check_path,
    _check_tree,
    _filter_message,
    _first_line,
    foreign_storage,
    import_h5py,
    missing_filters,
)

if TYPE_CHECKING:
    import h5py


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
    are done by a child process, as its reads are (:mod:`tclip.formats.hdf5.probe`).
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


Writer = Hdf5Writer
