"""Index arithmetic of tensor blocks: rectangles, contiguous spans, flat runs in storage order.

A block is a tuple of slices (the same ``index`` :mod:`tclip.core.stats` takes); a
flat run is ``[start, stop)`` of the elements in storage order (C order, or
Fortran order for some .npy files). Nothing here touches data.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from ..core.units import Index


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


def layout_blocks(shape: tuple[int, ...], itemsize: int, fortran: bool, max_bytes: int) -> Iterator[Index]:
    """Contiguous blocks in a tensor's storage order (C, or Fortran for .npy)."""
    if fortran:
        for index in c_order_blocks(shape[::-1], itemsize, max_bytes):
            yield index[::-1]
    else:
        yield from c_order_blocks(shape, itemsize, max_bytes)


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
