"""Raw byte I/O on file descriptors: reads and writes at explicit offsets (thread-safe),
copies between files in the kernel, early write-back.

The formats whose data sits at known offsets read and write through these, from
any thread, with no library in between.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection
from typing import Any, BinaryIO

import numpy as np

from ..errors import FormatError

# Upper bound of one block read or written by the format-level helpers (copies,
# conversions); the passes over files size their own blocks from --memory.
DEFAULT_BLOCK_BYTES = 8 << 20


def pread_into(fd: int, buffer: memoryview, offset: int, path: object, name: str) -> None:
    """Fill ``buffer`` from ``fd`` at ``offset`` (thread-safe); a short file is an error."""
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got <= 0:
            raise FormatError(f"tensor {name!r}: file is truncated", path)
        done += got


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (thread-safe), and start writing it to the disk."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
    start_writeback(fd, offset, len(data))


_SYNC_FILE_RANGE: Any = None


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range to the disk now, without waiting.

    The final fsync then finds most of the file already written: measured on
    the development machine, a 1 GiB durable write took 0.30 s this way
    against 0.39 s for write-then-fsync (and 0.5-0.6 s for ``dd conv=fsync``).
    Linux's ``sync_file_range`` has no binding in the ``os`` module, hence ctypes;
    elsewhere this does nothing.
    """
    global _SYNC_FILE_RANGE
    if _SYNC_FILE_RANGE is None:
        _SYNC_FILE_RANGE = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                function = ctypes.CDLL(None, use_errno=True).sync_file_range
                function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                _SYNC_FILE_RANGE = function
            except (ImportError, OSError, AttributeError):
                pass
    if _SYNC_FILE_RANGE:
        _SYNC_FILE_RANGE(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE: start, do not wait


def as_bytes(array: np.ndarray) -> memoryview:
    """A byte view of a contiguous array (memoryview cannot describe ml_dtypes' types)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def copy_range(source_fd: int, source_offset: int, count: int, target_fd: int, target_offset: int,
               path: object) -> None:
    """Copy ``count`` bytes between two files at explicit offsets, in the kernel where it
    can (``copy_file_range``, what ``cp`` uses), else through a buffer. Thread-safe."""
    while count:
        try:
            done = os.copy_file_range(source_fd, target_fd, count, source_offset, target_offset)
        except (AttributeError, OSError):
            done = -1
        if done <= 0:
            chunk = os.pread(source_fd, min(count, DEFAULT_BLOCK_BYTES), source_offset)
            if not chunk:
                raise FormatError("file is truncated", path)
            done = os.pwrite(target_fd, chunk, target_offset)
        source_offset += done
        target_offset += done
        count -= done


def copy_except(source_fd: int, target_fd: int, size: int, holes: Collection[tuple[int, int]],
                path: object) -> None:
    """Copy bytes ``[0, size)`` of a file except the ``(offset, length)`` holes, at the same offsets."""
    position = 0
    for offset, length in sorted(holes):
        if offset > position:
            copy_range(source_fd, position, offset - position, target_fd, position, path)
        position = max(position, offset + length)
    if size > position:
        copy_range(source_fd, position, size - position, target_fd, position, path)


def write_all(handle: BinaryIO, data: np.ndarray, fortran: bool = False) -> None:
    """Write an array's bytes in storage order without an extra copy where possible."""
    array = np.asarray(data)
    if fortran:
        array = array.T
    handle.write(as_bytes(array))


def flat_result(dtype: np.dtype, count: int, out: np.ndarray | None) -> np.ndarray:
    """``count`` elements of ``dtype``: a view of ``out`` (raw bytes) when it is large enough, else new."""
    if out is not None and out.size >= count * dtype.itemsize:
        return out[: count * dtype.itemsize].view(dtype)
    return np.empty(count, dtype)
