"""A view of a file whose data regions read as other bytes, for HDF5 to open.

The HDF5 library keeps a file's structure (superblock, object headers, B-trees,
heaps) apart from the datasets' raw data only by the addresses the file gives;
a hostile file can place a dataset's data over its own structure, and a rewrite
of that data would overwrite the structure. Walking the file once more with
every data region inverted tells whether the structure depends on those bytes:
in a sound file nothing HDF5 reads to walk it lies in raw data, so the walk
sees the same file.
"""

from __future__ import annotations

import bisect
import io
import os
from pathlib import Path

import numpy as np


class MaskedFile(io.RawIOBase):
    """A read-only file object (for h5py's ``fileobj`` driver) whose bytes in ``spans``
    (start, end) read inverted, every other byte as the file holds it."""

    def __init__(self, path: Path, spans: list[tuple[int, int]]) -> None:
        super().__init__()
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._size = os.fstat(self._fd).st_size
        self._position = 0
        merged: list[list[int]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self._starts = [start for start, _ in merged]
        self._spans = merged

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        data = bytearray(os.pread(self._fd, len(view), self._position))
        start, end = self._position, self._position + len(data)
        first = max(bisect.bisect_right(self._starts, start) - 1, 0)
        for span_start, span_end in self._spans[first:]:
            if span_start >= end:
                break
            lo, hi = max(span_start, start) - start, min(span_end, end) - start
            if lo < hi:
                np.frombuffer(data, np.uint8)[lo:hi] ^= 0xFF
        view[:len(data)] = data
        self._position = end
        return len(data)

    def close(self) -> None:
        if not self.closed and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        super().close()
