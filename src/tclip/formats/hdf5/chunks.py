"""Raw chunk I/O: where an unfiltered chunked dataset's chunks lie, read and written as byte regions.
"""

from __future__ import annotations

import itertools
import math
import threading
from typing import Any

import numpy as np

from ...core.units import flat_rectangles
from .._io import pread_into, pwrite_all


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
