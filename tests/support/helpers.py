"""Shared test helpers."""

from __future__ import annotations

import numpy as np


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How many representable float32 values lie between a and b (elementwise)."""
    a32 = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    b32 = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    # Map the sign-magnitude bit patterns onto a monotonic integer line.
    a32 = np.where(a32 < 0, -(a32 & 0x7FFFFFFF), a32)
    b32 = np.where(b32 < 0, -(b32 & 0x7FFFFFFF), b32)
    return np.abs(a32 - b32)


def correctly_rounded(exact: np.ndarray, dtype) -> np.ndarray:
    """float64 values rounded once to ``dtype``."""
    return np.asarray(exact, dtype=np.float64).astype(dtype)


class PickleTrap:
    """Unpickling this runs code: it creates the file named at pickling time. Tests plant
    it in object arrays to prove tclip never loads a pickle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
