"""Sums of floats kept exactly, so the order in which terms arrive never changes a bit.

Units, blocks, threads, files and cluster workers deliver their partial sums in
any order; :class:`ExactSum` adds them without rounding and rounds once when read.
"""

from __future__ import annotations

import math


class ExactSum:
    """A float sum kept exactly (Shewchuk's non-overlapping partials), rounded once when read.

    Adding the same numbers in any order, or merging two exact sums, gives
    the same bits. Infinities and NaN are kept aside, as in ``math.fsum``.
    """

    __slots__ = ("partials", "special")

    def __init__(self) -> None:
        self.partials: list[float] = []
        self.special = 0.0

    def add(self, x: float) -> None:
        if not math.isfinite(x):
            self.special += x
            return
        partials, i = self.partials, 0
        for y in partials:
            if abs(x) < abs(y):
                x, y = y, x
            high = x + y
            low = y - (high - x)
            if low:
                partials[i] = low
                i += 1
            x = high
        partials[i:] = [x]

    def merge(self, other: "ExactSum") -> None:
        for value in other.partials:
            self.add(value)
        self.special += other.special

    def copy(self) -> "ExactSum":
        twin = ExactSum()
        twin.partials, twin.special = list(self.partials), self.special
        return twin

    @property
    def value(self) -> float:
        if self.special != 0.0 or math.isnan(self.special):
            return self.special
        return math.fsum(self.partials)

    def __getstate__(self) -> tuple[list[float], float]:
        return self.partials, self.special

    def __setstate__(self, state: tuple[list[float], float]) -> None:
        self.partials, self.special = state

