"""HDF5 files through h5py: every numeric dataset is a tensor named by its path.

A rewrite starts from a byte copy of the source and overwrites the rewritten
tensors' data in place, so everything else is exactly as it was: the group
tree, attributes (object references and dimension scales included), links,
creation order, chunking, compression filters, fill values and every dataset
tclip does not change (strings, compound data, dimension scales, untouched
tensors).
"""

from __future__ import annotations

import posixpath
import shutil
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ..dtypes import ML_FLOAT_TYPES
from ..errors import FormatError, UnsupportedError
from .base import (
    AtomicOutput,
    Index,
    TensorInfo,
    TensorReader,
    TensorWriter,
    layout_blocks,
)

_H5_ERRORS = (OSError, ValueError, RuntimeError, KeyError, TypeError)


def _is_numeric(dataset: h5py.Dataset) -> bool:
    dtype = dataset.dtype
    if dataset.shape is None or h5py.check_enum_dtype(dtype) is not None:
        return False
    if h5py.h5ds.is_scale(dataset.id):  # coordinates of another dataset's axis, not a tensor
        return False
    if h5py.check_vlen_dtype(dtype) is not None or h5py.check_string_dtype(dtype) is not None:
        return False
    return dtype.kind in "biufc" and dtype.fields is None


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


def attributes(obj: h5py.HLObject) -> dict[str, Any]:
    """An object's attributes as plain values (for reports), in the file's order."""
    out: dict[str, Any] = {}
    for key in obj.attrs:
        try:
            value = obj.attrs[key]
        except _H5_ERRORS:
            value = "<unreadable>"
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        elif isinstance(value, np.ndarray):
            value = value.tolist()
        elif isinstance(value, np.generic):
            value = value.item()
        out[key] = value
    return out


class Hdf5Reader(TensorReader):
    format_name = "hdf5"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        try:
            self.file = h5py.File(path, "r")
        except _H5_ERRORS as error:
            raise FormatError(f"not a valid HDF5 file ({_first_line(error)})", path) from None
        try:
            self.metadata = attributes(self.file)
            self._walk(self.file, set())
        except FormatError:
            self.file.close()
            raise
        except _H5_ERRORS as error:
            self.file.close()
            raise FormatError(f"cannot read the file's structure ({_first_line(error)})", path) from None

    def _walk(self, group: h5py.Group, seen: set[Any]) -> None:
        """Datasets in the file's own order (creation order where it is tracked),
        each object once; soft and external links are not followed."""
        for key in group:
            if not isinstance(group.get(key, getlink=True), h5py.HardLink):
                continue
            obj = group[key]
            if obj.id in seen:  # h5py object ids compare equal for hard links to one object
                continue
            seen.add(obj.id)
            if isinstance(obj, h5py.Group):
                self._walk(obj, seen)
            elif isinstance(obj, h5py.Dataset) and _is_numeric(obj):
                name = obj.name.lstrip("/")
                self.tensors[name] = TensorInfo(name, tuple(obj.shape), obj.dtype, attrs=attributes(obj),
                                                refused=foreign_storage(obj))

    def close(self) -> None:
        try:
            self.file.close()
        except _H5_ERRORS:
            pass

    def blocks(self, name: str, max_bytes: int = 8 << 20) -> Any:
        dataset = self.file[name]
        if dataset.chunks is None or dataset.size == 0:
            return layout_blocks(self.tensors[name], max_bytes)
        return self._chunk_blocks(dataset, max_bytes)

    @staticmethod
    def _chunk_blocks(dataset: h5py.Dataset, max_bytes: int) -> Any:
        # Whole chunks, in the file's chunk order, so each is decompressed once.
        for chunk in dataset.iter_chunks():
            yield tuple(slice(s.start, s.stop) for s in chunk)

    def read(self, name: str, index: Index | None = None, scratch: bytearray | None = None) -> np.ndarray:
        if self.tensors[name].refused:
            raise UnsupportedError(f"tensor {name!r}: {self.tensors[name].refused}", self.path)
        dataset = self.file[name]
        try:
            data = dataset[()] if index is None or not index else dataset[index]
        except _H5_ERRORS as error:
            raise FormatError(f"tensor {name!r} cannot be read ({_first_line(error)}); "
                              "the file may be truncated or corrupt", self.path) from None
        return np.asarray(data)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class Hdf5Writer(TensorWriter):
    """Writes HDF5. Created like an HDF5 reader, it starts from a byte copy of the
    source file and overwrites the rewritten tensors' data in place, so every
    structure HDF5 can hold survives as it was: groups, attributes (object
    references and dimension scales included), links, named types, creation
    order, chunking, filters and fill values. (Rewritten compressed chunks that
    no longer fit their old space are stored anew; the file can grow a little.)
    From another format, datasets are created at the tensors' paths.
    """

    format_name = "hdf5"

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput,
                 like: TensorReader | None = None, metadata: dict[str, Any] | None = None) -> None:
        super().__init__(target, tensors, output)
        for info in tensors:
            if info.dtype.type in ML_FLOAT_TYPES:
                raise UnsupportedError(f"HDF5 has no {info.dtype.name} type (tensor {info.name!r}); "
                                       "write .safetensors instead", target)
            if not info.numeric:
                raise UnsupportedError(f"tensor {info.name!r} of dtype {info.dtype} cannot be written to HDF5",
                                       target)
        self._like = like if isinstance(like, Hdf5Reader) else None
        self._current: tuple[str, h5py.Dataset] | None = None
        try:
            if self._like is not None:
                shutil.copyfile(self._like.path, output.temp)  # the kernel's copy, as cp does
                self.file = h5py.File(output.temp, "r+")
            else:
                self.file = h5py.File(output.temp, "w")
                for key, value in (metadata or {}).items():
                    self.file.attrs[key] = value
        except OSError as error:
            self._close_quietly()
            raise UnsupportedError(f"cannot write HDF5 ({_first_line(error)})", target) from None
        except BaseException:
            self._close_quietly()
            raise

    def _dataset(self, name: str) -> h5py.Dataset:
        # Only the dataset being written is kept open: HDF5 holds several MiB
        # per open dataset being written, which would grow with the tensor count.
        if self._current is not None and self._current[0] == name:
            return self._current[1]
        if name in self.file:
            dataset = self.file[name]
            # Never write through to another file (external storage, virtual sources).
            reason = foreign_storage(dataset)
            if reason is not None:
                raise UnsupportedError(f"tensor {name!r}: {reason}", self.target)
        else:
            info = self.tensors[name]
            parent_name, base = posixpath.split(name)
            parent = self.file.require_group(parent_name) if parent_name else self.file
            dataset = parent.create_dataset(base, shape=info.shape, dtype=info.dtype)
        self._current = (name, dataset)
        return dataset

    def blocks(self, name: str, max_bytes: int = 8 << 20) -> Any:
        if self._like is not None and name in self._like.tensors:
            return self._like.blocks(name, max_bytes)
        return layout_blocks(self.tensors[name], max_bytes)

    def write(self, name: str, index: Index, data: np.ndarray) -> None:
        dataset = self._dataset(name)
        if dataset.shape == ():
            dataset[()] = data
        else:
            dataset[index] = data

    def copy_tensor(self, reader: TensorReader, name: str, max_bytes: int = 8 << 20) -> None:
        if reader is self._like:
            return  # already there, byte for byte
        super().copy_tensor(reader, name, max_bytes)

    def _finish(self) -> None:
        for name in self.tensors:  # empty tensors never receive a block
            if name not in self.file:
                self._dataset(name)
        self._current = None
        self.file.flush()
        self.file.close()

    def _close_quietly(self) -> None:
        self._current = None
        try:
            self.file.close()
        except Exception:  # the file is being thrown away
            pass
