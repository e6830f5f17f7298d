"""The one reader/writer protocol every format implements, and the parts they share.

A :class:`TensorReader` opens a file lazily: names, shapes, dtypes and metadata
come from the header alone, and data is read in rectangular blocks (a tuple of
slices, the same ``index`` that :mod:`tclip.stats` takes). A
:class:`TensorWriter` is created "like" a reader (same tensors, layout and
metadata), receives every tensor in the blocks it asks for via
:meth:`TensorWriter.blocks`, in order, and only appears at its target path when
:meth:`TensorWriter.commit` has flushed, fsynced and renamed it.
"""

from __future__ import annotations

import errno
import itertools
import math
import os
import secrets
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..errors import FormatError, OutputExistsError, TclipError

Index = tuple[slice, ...]

# Upper bound of one block read or written. The scale step holds a float64 copy
# of a block (twice a float32 block) plus the result, so peak memory is a small
# multiple of this whatever the file size.
DEFAULT_BLOCK_BYTES = 8 << 20


@dataclass(frozen=True)
class TensorInfo:
    """What a header says about one tensor.

    Attributes:
        name: the tensor's name in its file (HDF5: path without the leading '/').
        shape, dtype: as stored (dtype with its byte order).
        fortran_order: the data is stored column-major (.npy only).
        numeric: False for data tclip never changes nor reads as numbers
            (void/opaque types); such tensors are copied as they are.
        refused: why tclip will not read this tensor's data at all (None: it
            will), e.g. HDF5 external storage or a virtual dataset, whose data
            lives in other files. Such a tensor is never read nor written.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool = False
    numeric: bool = True
    attrs: Mapping[str, Any] = field(default_factory=dict, compare=False)
    refused: str | None = field(default=None, compare=False)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def checked_size(shape: tuple[int, ...], itemsize: int, path: object, name: str) -> int:
    """Byte size of a tensor, refusing negative or absurd dimensions before allocating."""
    for n in shape:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise FormatError(f"tensor {name!r}: invalid shape {list(shape)}", path)
    nbytes = math.prod(shape) * itemsize
    if nbytes > 1 << 62:
        raise FormatError(f"tensor {name!r}: shape {list(shape)} is impossibly large", path)
    return nbytes


# --------------------------------------------------------------------------- blocks


def c_order_blocks(shape: tuple[int, ...], itemsize: int, max_bytes: int) -> Iterator[Index]:
    """Blocks of at most ``max_bytes`` that are each contiguous in C order, in file order."""
    ndim = len(shape)
    if math.prod(shape) == 0:
        return
    inner, axis = 1, ndim
    while axis > 0 and inner * shape[axis - 1] * itemsize <= max_bytes:
        inner *= shape[axis - 1]
        axis -= 1
    if axis == 0:
        yield tuple(slice(0, n) for n in shape)
        return
    split = axis - 1  # the axis cut into runs; everything after it is whole
    per_block = max(1, max_bytes // (inner * itemsize))
    for outer in itertools.product(*(range(n) for n in shape[:split])):
        for start in range(0, shape[split], per_block):
            stop = min(start + per_block, shape[split])
            yield (
                tuple(slice(i, i + 1) for i in outer)
                + (slice(start, stop),)
                + tuple(slice(0, n) for n in shape[split + 1 :])
            )


def layout_blocks(info: TensorInfo, max_bytes: int) -> Iterator[Index]:
    """Contiguous blocks in the tensor's storage order (C, or Fortran for .npy)."""
    if info.fortran_order:
        for index in c_order_blocks(info.shape[::-1], info.dtype.itemsize, max_bytes):
            yield index[::-1]
    else:
        yield from c_order_blocks(info.shape, info.dtype.itemsize, max_bytes)


def full_index(shape: tuple[int, ...]) -> Index:
    return tuple(slice(0, n) for n in shape)


def normalize_index(index: Index | None, shape: tuple[int, ...]) -> Index:
    if index is None:
        return full_index(shape)
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def contiguous_span(index: Index, shape: tuple[int, ...], fortran: bool) -> tuple[int, int] | None:
    """(first element, element count) if ``index`` is one contiguous run of storage, else None.

    In C order a block is contiguous when every axis after the last partial one
    is whole and every axis before it has extent 1 (Fortran: the mirror image).
    """
    if fortran:
        index, shape = index[::-1], shape[::-1]
    extents = [s.stop - s.start for s in index]
    partial = [i for i, (e, n) in enumerate(zip(extents, shape)) if e != n]
    if partial and any(e != 1 for e in extents[: partial[-1]]):
        return None
    first = 0
    for s, n in zip(index, shape):
        first = first * n + s.start
    return first, math.prod(extents)


# --------------------------------------------------------------------------- protocol


class TensorReader(ABC):
    """A tensor file opened for reading. Use as a context manager."""

    format_name: str = ""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, Any] = {}

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the file."""

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def blocks(self, name: str, max_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[Index]:
        """The blocks this format reads best, covering the tensor once."""
        return layout_blocks(self.tensors[name], max_bytes)

    @abstractmethod
    def read(self, name: str, index: Index | None = None, scratch: bytearray | None = None) -> np.ndarray:
        """Read one rectangular block (None: the whole tensor).

        With ``scratch``, a reader may read into that buffer and return a view of
        it, valid until the buffer is used again: reusing one buffer spares the
        page faults of a fresh multi-MiB allocation per block. Without it the
        result is a new array.
        """

    def pieces(self, name: str, max_bytes: int = DEFAULT_BLOCK_BYTES,
               scratch: bytearray | None = None) -> Iterator[tuple[Index, np.ndarray]]:
        """(index, block) over the tensor; with ``scratch`` each block is only valid until the next."""
        for index in self.blocks(name, max_bytes):
            yield index, self.read(name, index, scratch)


class TensorWriter(ABC):
    """A tensor file being written to a temporary path beside its target."""

    format_name: str = ""

    def __init__(self, target: Path, tensors: list[TensorInfo], output: "AtomicOutput") -> None:
        self.target = Path(target)
        self.tensors = {t.name: t for t in tensors}
        self.output = output

    def blocks(self, name: str, max_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[Index]:
        """The blocks :meth:`write` must receive for ``name``, in this order."""
        return layout_blocks(self.tensors[name], max_bytes)

    @abstractmethod
    def write(self, name: str, index: Index, data: np.ndarray) -> None:
        """Write one block; blocks arrive in the order :meth:`blocks` gave."""

    def copy_tensor(self, reader: TensorReader, name: str, max_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
        """Copy a tensor unchanged; formats override this for byte-exact copies."""
        for index in self.blocks(name, max_bytes):
            self.write(name, index, reader.read(name, index))

    @abstractmethod
    def _finish(self) -> None:
        """Write what remains (trailers, directories) and close the temporary file."""

    def commit(self) -> None:
        """Finish, fsync and rename the temporary file over the target."""
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise
        self.output.commit()

    def abort(self) -> None:
        """Close and remove the temporary file; the target is untouched."""
        try:
            self._close_quietly()
        finally:
            self.output.abort()

    def _close_quietly(self) -> None:
        """Close whatever handle is open, ignoring errors (used on abort)."""

    def __enter__(self) -> "TensorWriter":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.abort()


# --------------------------------------------------------------------------- raw byte regions


class RegionSource:
    """Reads blocks of a tensor stored as one contiguous byte region of a file.

    Contiguous blocks are read with one ``os.pread`` into a fresh buffer (no
    mapping, so the resident memory stays the block size); other blocks go
    through a read-only ``np.memmap`` of the region.
    """

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    def read(self, offset: int, info: TensorInfo, index: Index | None,
             scratch: bytearray | None = None) -> np.ndarray:
        index = normalize_index(index, info.shape)
        shape = tuple(s.stop - s.start for s in index)
        span = contiguous_span(index, info.shape, info.fortran_order) if shape else (0, 1)
        if span is not None:
            first, count = span
            nbytes = count * info.dtype.itemsize
            if scratch is not None and len(scratch) >= nbytes:
                buffer = memoryview(scratch)[:nbytes]
            else:
                buffer = memoryview(np.empty(nbytes, np.uint8))  # no zero-fill, unlike bytearray
            got = os.preadv(self.fd, [buffer], offset + first * info.dtype.itemsize) if nbytes else 0
            if got != nbytes:
                raise FormatError(f"tensor {info.name!r}: file is truncated", self.path)
            flat = np.frombuffer(buffer, dtype=info.dtype, count=count)
            return flat.reshape(shape, order="F" if info.fortran_order else "C")
        mapped = np.memmap(self.path, dtype=info.dtype, mode="r", offset=offset, shape=info.shape,
                           order="F" if info.fortran_order else "C")
        try:
            return np.array(mapped[index], order="F" if info.fortran_order else "C")
        finally:
            del mapped


def write_all(handle: BinaryIO, data: np.ndarray, fortran: bool = False) -> None:
    """Write an array's bytes in storage order without an extra copy where possible."""
    array = np.asarray(data)
    if fortran:
        array = array.T
    # A byte view: memoryview cannot describe ml_dtypes' bfloat16/float8.
    handle.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)


def copy_bytes(source_fd: int, offset: int, count: int, target: BinaryIO, path: object) -> None:
    """Append ``count`` bytes of a file from ``offset`` to ``target``, in the kernel
    where it can (``copy_file_range``, what ``cp`` uses), else through a buffer."""
    target.flush()
    target_fd = target.fileno()
    while count:
        try:
            done = os.copy_file_range(source_fd, target_fd, count, offset)
        except (AttributeError, OSError):
            done = -1
        if done <= 0:
            chunk = os.pread(source_fd, min(count, DEFAULT_BLOCK_BYTES), offset)
            if not chunk:
                raise FormatError("file is truncated", path)
            done = os.write(target_fd, chunk)
        offset += done
        count -= done


class SequentialBlocks:
    """Checks that blocks arrive exactly in the order a sequential writer needs."""

    def __init__(self) -> None:
        self.expected: dict[str, int] = {}  # tensor name -> next element expected

    def check(self, info: TensorInfo, index: Index) -> None:
        index = normalize_index(index, info.shape)
        span = contiguous_span(index, info.shape, info.fortran_order)
        position = self.expected.get(info.name, 0)
        if span is None or span[0] != position:
            raise TclipError(f"internal error: block {index} of {info.name!r} is out of order")
        self.expected[info.name] = position + span[1]


# --------------------------------------------------------------------------- atomic output


def _rename_noreplace(source: Path, target: Path) -> bool:
    """Move ``source`` to ``target`` unless ``target`` exists, atomically; False if it exists.

    Checking for the target and then renaming would race with another run
    writing the same output. A hard link fails atomically when the target
    exists (then the temporary name is removed); where the file system has no
    hard links, ``renameat2(RENAME_NOREPLACE)`` does the same in one call.
    Only where neither exists does a check-then-rename remain.
    """
    try:
        os.link(source, target)
    except FileExistsError:
        return False
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK,
                               errno.ENOSYS, errno.EACCES):
            raise
        done = _renameat2_noreplace(source, target)
        if done is None:  # neither links nor renameat2 here
            if os.path.lexists(target):
                return False
            os.rename(source, target)
        return done is not False
    os.unlink(source)
    return True


def _renameat2_noreplace(source: Path, target: Path) -> bool | None:
    """renameat2 with RENAME_NOREPLACE (Linux); None where it is unavailable."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # only on file systems without hard links: a rare path

    libc = ctypes.CDLL(None, use_errno=True)
    function = getattr(libc, "renameat2", None)
    if function is None:
        return None
    at_fdcwd, rename_noreplace = -100, 1
    result = function(at_fdcwd, os.fsencode(source), at_fdcwd, os.fsencode(target), rename_noreplace)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code == errno.EEXIST:
        return False
    if code in (errno.ENOSYS, errno.EINVAL):
        return None
    raise OSError(code, os.strerror(code), str(target))


class AtomicOutput:
    """A temporary file beside ``target`` that replaces it only on :meth:`commit`.

    The temporary name starts with a dot and ends in ``.tclip-tmp`` so a crash
    leaves something recognisable; every error path removes it.
    """

    def __init__(self, target: Path, *, overwrite: bool = False, mode_from: Path | None = None) -> None:
        self.target = Path(target)
        if self.target.exists() and not overwrite:
            raise OutputExistsError("output already exists; pass --force to replace it", self.target)
        if not self.target.parent.is_dir():
            raise TclipError("output directory does not exist", self.target.parent)
        self.mode_from = mode_from
        token = secrets.token_hex(4)
        self.temp = self.target.parent / f".{self.target.name}.{token}.tclip-tmp"
        self.overwrite = overwrite
        self._done = False

    def commit(self) -> None:
        try:
            fd = os.open(self.temp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            if self.mode_from is not None and self.mode_from.exists():
                os.chmod(self.temp, self.mode_from.stat().st_mode & 0o7777)
            if self.overwrite:
                os.replace(self.temp, self.target)
            elif not _rename_noreplace(self.temp, self.target):
                self.abort()
                raise OutputExistsError("output already exists (it appeared while writing); "
                                        "pass --force to replace it", self.target)
            self._done = True
            dir_fd = os.open(self.target.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as error:
            self.abort()
            raise TclipError(f"cannot write output: {error.strerror or error}", self.target) from error

    def abort(self) -> None:
        if not self._done:
            try:
                self.temp.unlink()
            except FileNotFoundError:
                pass
            self._done = True
