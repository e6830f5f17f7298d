"""A read-only file object over a window of a file descriptor: how a ``.distcp`` item (a chunk's
whole ``torch.save`` zip, or a zstd stream) is handed to ``zipfile`` and ``zstandard``."""

from __future__ import annotations

import os


class Window:
    """A read-only file object over ``fd`` that ends at ``end`` (and, for a stream, starts at
    ``begin``): ``zipfile`` then finds the chunk's own zip directory at the window's end, and
    offsets its entries by where the zip starts, as it does for a zip with data before it."""

    def __init__(self, fd: int, end: int, begin: int = 0) -> None:
        self._fd = fd
        self._end = end
        self._pos = begin

    def fileno(self) -> int:
        return self._fd

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._end}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def read(self, n: int = -1) -> bytes:
        left = max(0, self._end - self._pos)
        n = left if n is None or n < 0 else min(n, left)
        data = os.pread(self._fd, n, self._pos) if n else b""
        self._pos += len(data)
        return data

    def close(self) -> None:
        """The descriptor belongs to the reader."""
