"""The fixed grid of reduction units every tensor is summed over.

Floating-point sums depend on the order of their terms. So that a norm is the
same to the last bit whatever the block size (``--memory``), the thread count,
the file format or the way a tensor set is split into shards, every tensor is
cut into the same *units*, which depend on its shape alone: runs of at most
:data:`UNIT_ELEMENTS` consecutive elements in storage order, each a rectangle
of the tensor (whole trailing rows where they fit, else pieces of one row).
Each unit is reduced by one fixed kernel (:mod:`tclip.core.kernels`); unit results
are combined exactly (whole-tensor sums) or in unit order (per-slice sums).

Blocks, the pieces read and written at once, are runs of whole units, so a
block size only changes how many units travel together, never the arithmetic.
Nothing here touches data: this is index arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

# Elements per unit: large enough that the per-unit Python overhead (about 30
# NumPy calls, each holding the GIL for a moment) stays small, small enough that
# the float64 copy (2 MiB) stays near the core. Measured on 1 GiB files with two
# threads, 2**18 beat 2**16, 2**17 and 2**19 for float32 and bfloat16 (15-25%).
UNIT_ELEMENTS = 1 << 18

Index = tuple[slice, ...]


@dataclass(frozen=True)
class UnitGrid:
    """The units of a tensor of ``shape`` (its storage order: C order).

    Axes ``split + 1 ..`` are whole in every unit (``inner`` elements per index
    of the ``split`` axis); the ``split`` axis is cut into runs of ``step``
    indices; the axes before it are taken one index at a time. ``split`` is -1
    when the whole tensor is one unit.
    """

    shape: tuple[int, ...]
    split: int
    inner: int
    step: int

    @classmethod
    def of(cls, shape: tuple[int, ...], unit: int = UNIT_ELEMENTS) -> "UnitGrid":
        shape = tuple(int(n) for n in shape)
        inner, axis = 1, len(shape)
        while axis > 0 and inner * shape[axis - 1] <= unit:
            inner *= shape[axis - 1]
            axis -= 1
        if axis == 0:
            return cls(shape, -1, inner, 1)
        split = axis - 1
        return cls(shape, split, inner, max(1, unit // inner))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def _per_outer(self) -> int:
        return -(-self.shape[self.split] // self.step)

    @property
    def count(self) -> int:
        """How many units there are (0 for an empty tensor)."""
        if self.size == 0:
            return 0
        if self.split < 0:
            return 1
        return math.prod(self.shape[: self.split]) * self._per_outer

    @property
    def unit_elements(self) -> int:
        """The size of a full unit (the last of each run may be smaller)."""
        if self.split < 0:
            return self.size
        return min(self.step, self.shape[self.split]) * self.inner

    def bounds(self, k: int) -> tuple[int, int]:
        """Flat (start, stop) of unit ``k`` in storage order."""
        if self.split < 0:
            return 0, self.size
        outer, j = divmod(k, self._per_outer)
        length = self.shape[self.split]
        base = outer * length * self.inner
        return base + j * self.step * self.inner, base + min((j + 1) * self.step, length) * self.inner

    def index(self, k: int) -> Index:
        """Unit ``k`` as a rectangle of the tensor (a tuple of slices)."""
        if self.split < 0:
            return tuple(slice(0, n) for n in self.shape)
        outer, j = divmod(k, self._per_outer)
        head = []
        for n in reversed(self.shape[: self.split]):
            outer, i = divmod(outer, n)
            head.append(slice(i, i + 1))
        head.reverse()
        stop = min((j + 1) * self.step, self.shape[self.split])
        return (*head, slice(j * self.step, stop), *(slice(0, n) for n in self.shape[self.split + 1 :]))

    def unit_shape(self, k: int) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.index(k))

    def blocks(self, max_elements: int, align: int = 0) -> Iterator[tuple[int, int]]:
        """Runs of whole units ``[first, stop)`` of about ``max_elements`` each, in order.

        A block holds at least one unit. With ``align`` (elements; e.g. the rows
        of an HDF5 chunk) blocks end on multiples of it where that costs at most
        four times ``max_elements``, so no chunk is read or written twice.
        """
        count = self.count
        if count == 0:
            return
        per_block = max(1, max_elements // max(1, self.unit_elements))
        if align > 0 and self.split >= 0 and self.shape[self.split] % self.step == 0:
            # Every unit is full: a block of n units spans n * unit_elements.
            quantum = math.lcm(self.unit_elements, align) // self.unit_elements
            if quantum * self.unit_elements <= 4 * max(max_elements, self.unit_elements):
                per_block = max(quantum, per_block // quantum * quantum)
        for first in range(0, count, per_block):
            yield first, min(first + per_block, count)

    def span(self, first: int, stop: int) -> tuple[int, int]:
        """Flat (start, stop) of the units ``[first, stop)``."""
        return self.bounds(first)[0], self.bounds(stop - 1)[1]


def flat_rectangles(shape: tuple[int, ...], start: int, stop: int) -> list[Index]:
    """The fewest rectangles that cover the C-order run ``[start, stop)`` of ``shape``, in order."""
    if start >= stop:
        return []
    if not shape:
        return [()]
    inner = math.prod(shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)
    rest = shape[1:]
    if first == last:
        return [(slice(first, first + 1), *r) for r in flat_rectangles(rest, head, tail)]
    out: list[Index] = []
    if head:
        out += [(slice(first, first + 1), *r) for r in flat_rectangles(rest, head, inner)]
        first += 1
    if last > first:
        out.append((slice(first, last), *(slice(0, n) for n in rest)))
    if tail:
        out += [(slice(last, last + 1), *r) for r in flat_rectangles(rest, 0, tail)]
    return out
