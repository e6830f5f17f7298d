"""The geometry of a DCP tensor's chunks: whether they tile the tensor exactly once.

Moved out of :mod:`.reader`, which uses (and re-exports) :func:`_coverage` and :func:`_c_strides`.
"""

from __future__ import annotations

import math

import numpy as np

from ._metadata import Chunk


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
