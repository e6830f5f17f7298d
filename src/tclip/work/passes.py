"""The unit-by-unit passes over a file's tensors."""

from __future__ import annotations

import numpy as np

from ..core.units import UnitGrid
from ..formats import TensorInfo


# Tensors up to this size that pass 1 reads are kept in memory for pass 2 of
# the same run (within an eighth of --memory), so files of many small tensors
# are read once.
IN_MEMORY_TENSOR_BYTES = 1 << 20


class HeldTensors:
    """Small tensors pass 1 read, kept for pass 2 of the same run (never pickled)."""

    def __init__(self, limit: int, tensor_bytes: int = IN_MEMORY_TENSOR_BYTES) -> None:
        self.limit, self.used, self.tensor_bytes = limit, 0, tensor_bytes
        self.data: dict[str, np.ndarray] = {}

    def offer(self, name: str, raw: np.ndarray) -> None:
        if raw.nbytes <= self.tensor_bytes and self.used + raw.nbytes <= self.limit:
            self.data[name] = raw.copy()
            self.used += raw.nbytes


def storage_layout(info: TensorInfo, axes: tuple[int, ...] | None) -> tuple[UnitGrid, tuple[int, ...] | None]:
    shape = info.storage_shape
    if axes is not None and info.fortran_order:
        axes = tuple(sorted(len(shape) - 1 - a for a in axes))
    return UnitGrid.of(shape), axes


def storage_view(array: np.ndarray, info: TensorInfo) -> np.ndarray:
    return array.T if info.fortran_order and array.ndim else array
