"""The geometry of a DCP tensor's chunks: whether they tile the tensor exactly once, and how a
block of the tensor is read from the chunks it meets (:class:`PieceReads`, shared by the
``.metadata`` reader and the reader of per-rank Hugging Face pieces).

Moved out of :mod:`.reader`, which uses (and re-exports) :func:`_coverage` and :func:`_c_strides`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ...core.units import Index, flat_rectangles
from ...errors import TclipError
from .._blocks import normalize_index
from .._io import flat_result
from ..base import TensorInfo
from ._metadata import Chunk


class PieceReads:
    """``read`` and ``read_flat`` of tensors assembled from rectangular pieces (each with a
    ``chunk`` of offsets and sizes): a block is read from every piece it meets, by the reader's
    ``_read_piece``, after its ``_ensure`` (what a tensor needs before its first read)."""

    path: Path
    tensors: dict[str, TensorInfo]
    pieces: dict[str, list[Any]]

    def _ensure(self, name: str) -> None:
        """Nothing to do before a tensor's first read (a reader that checks its pieces then says so)."""

    def _read_piece(self, piece: Any, local: Index, dest: np.ndarray, name: str) -> None:
        raise NotImplementedError

    def read(self, name: str, index: Index | None = None, scratch: bytearray | None = None) -> np.ndarray:
        info = self._readable(name)
        index = normalize_index(index, info.shape)
        out = np.empty(tuple(s.stop - s.start for s in index), info.dtype)
        self._fill(name, index, out)
        return out

    def read_flat(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Elements ``[start, stop)`` in C order, each piece's part read straight into the result
        where it is one run there (a ``Shard(0)`` piece, a replicated tensor)."""
        info = self._readable(name)
        result = flat_result(info.dtype, stop - start, out)
        position = 0
        for rect in flat_rectangles(info.shape, start, stop):
            sizes = tuple(s.stop - s.start for s in rect)
            n = math.prod(sizes)
            self._fill(name, rect, result[position:position + n].reshape(sizes))
            position += n
        return result

    def _readable(self, name: str) -> TensorInfo:
        info = self.tensors[name]
        if info.refused:
            raise TclipError(f"tensor {name!r}: {info.refused}", self.path)
        return info

    def _fill(self, name: str, index: Index, out: np.ndarray) -> None:
        """Write the block ``index`` of a tensor into ``out`` (a view of its shape), piece by piece."""
        if out.size == 0:
            return
        self._ensure(name)
        for piece in self.pieces[name]:
            chunk = piece.chunk
            local, target = [], []
            for s, o, n in zip(index, chunk.offsets, chunk.sizes):
                lo, hi = max(s.start, o), min(s.stop, o + n)
                if lo >= hi:
                    break
                local.append(slice(lo - o, hi - o))
                target.append(slice(lo - s.start, hi - s.start))
            else:
                self._read_piece(piece, tuple(local), out[tuple(target)] if target else out[...], name)


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _coverage(shape: tuple[int, ...], chunks: list[Chunk], budget: list[int]) -> str | None:
    """Why the chunks do not cover ``shape`` exactly once (None when they do).

    The chunks' boundaries cut each axis; every chunk covers a box of the grid of cells
    these cuts make. A DTensor's shards cover one cell each, so the grid is as small as the
    chunk list; an irregular one whose grid is larger than the folder's remaining ``budget``
    (one-element list, spent here) is checked pair by pair, and past that refused.
    """
    covered = sum(math.prod(c.sizes) for c in chunks)
    if covered != math.prod(shape):
        if covered < math.prod(shape):
            return f"leave part of it unwritten ({covered} of {math.prod(shape)} elements in chunks)"
        return f"overlap ({covered} elements in chunks for {math.prod(shape)})"
    if not shape:
        return None if len(chunks) == 1 else "overlap"
    cuts = [sorted({0, n} | {c.offsets[a] for c in chunks} | {c.offsets[a] + c.sizes[a] for c in chunks})
            for a, n in enumerate(shape)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells <= budget[0]:
        budget[0] -= cells
        grid = np.zeros([len(c) - 1 for c in cuts], np.uint32)
        for c in chunks:
            box = tuple(slice(np.searchsorted(cut, o), np.searchsorted(cut, o + s))
                        for cut, o, s in zip(cuts, c.offsets, c.sizes))
            grid[box] += 1
        if grid.max() > 1:
            return "overlap"
        return None if grid.min() == 1 else "leave part of it unwritten"
    pairs = len(chunks) * (len(chunks) - 1) // 2
    if pairs > budget[0]:
        return f"are too irregular to check ({len(chunks)} chunks); tclip refuses them"
    budget[0] -= pairs
    for i, a in enumerate(chunks):
        for b in chunks[i + 1:]:
            if all(x < y + m and y < x + n for x, n, y, m in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                return "overlap"
    return None  # disjoint chunks whose sizes add up to the whole cover it
