"""Which tensors a command works on, and why each other one is left as it is.

Every mode and the report select the same tensors: floating ones whose names
match the globs and whose rank can take the axes. :func:`select` decides it from
the header alone."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from ..core.dtypes import dtype_name, is_complex, is_floating
from ..core.stats import normalize_axes
from ..formats import TensorInfo, TensorReader


@dataclass(frozen=True)
class Selection:
    """Which tensors to work on, by shell-style globs over their names.

    A leading ``/`` in a pattern is ignored (HDF5 paths are named without it,
    but ``h5ls`` shows it).
    """

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    allow: frozenset[str] | None = None  # a tensor set's allowlist (an index's weight_map for this shard)

    def matches(self, name: str) -> bool:
        if self.allow is not None and name not in self.allow:
            return False
        if self.include and not any(fnmatch.fnmatchcase(name, p.lstrip("/")) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, p.lstrip("/")) for p in self.exclude)

    def unmatched(self, names: list[str]) -> list[str]:
        """The include/exclude patterns that match none of ``names``."""
        return [p for p in (*self.include, *self.exclude)
                if not any(fnmatch.fnmatchcase(n, p.lstrip("/")) for n in names)]


def axes_problem(ndim: int, axes: object) -> str | None:
    """Why a tensor of rank ``ndim`` cannot take ``axes`` (None if it can)."""
    if axes is None:
        return None
    items = [axes] if isinstance(axes, int) else list(axes)  # type: ignore[call-overload]
    seen: dict[int, int] = {}
    for axis in items:
        if not -ndim <= axis < ndim:
            return f"rank {ndim} has no axis {axis}"
        if axis % ndim in seen:
            return f"axes {seen[axis % ndim]} and {axis} are the same axis at rank {ndim}"
        seen[axis % ndim] = axis
    return None


def is_rank_skip(reason: str | None) -> bool:
    return bool(reason) and reason.startswith(("rank ", "axes "))  # type: ignore[union-attr]


def skip_reason(info: TensorInfo, selection: Selection, axes: object = None) -> str | None:
    """Why a tensor is left as it is (None: it is worked on). Every mode and the
    report select the same tensors: floating ones, matching the globs, whose rank
    can take the axes."""
    if not selection.matches(info.name):
        return "not selected"
    if info.refused:
        return info.refused
    if not info.numeric:
        return f"{info.dtype_label or info.dtype} is not numeric"
    if not is_floating(info.dtype):
        return f"{dtype_name(info.dtype)} is not floating-point"
    return axes_problem(len(info.shape), axes)


@dataclass
class TensorEntry:
    """What pass 1 knows of one tensor of a file (plain data)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    skipped: str | None = None


def select(reader: TensorReader, selection: Selection, axes: object = None,
           whole_if_rank_skip: bool = False) -> tuple[list[TensorEntry], dict[str, tuple[int, ...] | None]]:
    """Header-only: every tensor with its skip reason, and the reduction axes of those to read.

    With ``whole_if_rank_skip`` (the report), a tensor whose rank cannot take
    the axes is still read, reduced as a whole (NaN/Inf and its norm are never hidden).
    """
    entries, to_read = [], {}
    for info in reader.tensors.values():
        reason = skip_reason(info, selection, axes)
        entries.append(TensorEntry(info.name, tuple(info.shape), info.dtype_label or dtype_name(info.dtype),
                                   info.nbytes, reason))
        if reason is None:
            to_read[info.name] = normalize_axes(axes, len(info.shape))
        elif whole_if_rank_skip and (is_rank_skip(reason) or (is_complex(info.dtype) and info.numeric
                                                               and selection.matches(info.name))):
            to_read[info.name] = None  # complex: never clipped, but its NaN/Inf and norm are shown
    return entries, to_read
