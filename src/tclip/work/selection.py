"""Which tensors a command works on, and why each other one is left as it is.

Every mode and the report select the same tensors: floating ones whose names
match the globs and whose rank can take the axes. :func:`select` decides it from
the header alone."""

from __future__ import annotations

import enum
import fnmatch
from dataclasses import dataclass

import numpy as np

from ..core.dtypes import dtype_name, is_complex, is_floating
from ..core.stats import Axes, axes_fault, axes_items, normalize_axes
from ..formats import TensorInfo, TensorReader
from ..formats.base import EncodingSummary
from ..messages import Tagged


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

    def names_explicitly(self, name: str) -> bool:
        """Whether an include pattern matches ``name`` (what is left out by default, such
        as optimizer state, is worked on only then)."""
        return any(fnmatch.fnmatchcase(name, p.lstrip("/")) for p in self.include)

    def unmatched(self, names: list[str]) -> list[str]:
        """The include/exclude patterns that match none of ``names``."""
        return [p for p in (*self.include, *self.exclude)
                if not any(fnmatch.fnmatchcase(n, p.lstrip("/")) for n in names)]


class SkipKind(enum.Enum):
    """Why a tensor is left as it is."""

    NOT_SELECTED = "not selected"     # the globs (or a set's index) leave it out
    OPTIMIZER_STATE = "optimizer state"  # a training optimizer's variables: only when an include pattern names them
    REFUSED = "refused"               # the format will not read it (TensorInfo.refused)
    NOT_NUMERIC = "not numeric"       # strings, opaque bytes, pickles: copied as they are
    UNREADABLE_TYPE = "unreadable type"  # a type tclip cannot read that may hold numbers: copied, never measured
    NOT_FLOATING = "not floating"     # integers, bool, complex: copied as they are
    AXES = "axes"                     # its rank cannot take the axes
    NOT_A_WEIGHT = "not a weight"     # an activation scale of a quantized checkpoint: no norm, no clip
    NOT_UNDERSTOOD = "not understood"  # a quantized weight tclip cannot read: never measured nor clipped


class Skip(Tagged):
    """A skip reason: the text shown in reports and JSON, and its :class:`SkipKind`."""

    kind: SkipKind


def axes_problem(ndim: int, axes: Axes) -> str | None:
    """Why a tensor of rank ``ndim`` cannot take ``axes`` (None if it can)."""
    if axes is None:
        return None
    fault = axes_fault(axes_items(axes), ndim)
    if fault is None:
        return None
    if fault.kind == "type":
        raise TypeError(f"axes: expected integers, got {fault.axis!r}")
    if fault.kind == "repeat":
        return f"axes {fault.earlier} and {fault.axis} are the same axis at rank {ndim}"
    return f"rank {ndim} has no axis {fault.axis}"


def is_rank_skip(reason: Skip | None) -> bool:
    """Whether a tensor was left out only because its rank cannot take the axes."""
    return reason is not None and reason.kind is SkipKind.AXES


def skip_reason(info: TensorInfo, selection: Selection, axes: Axes = None) -> Skip | None:
    """Why a tensor is left as it is (None: it is worked on). Every mode and the
    report select the same tensors: floating ones, matching the globs, whose rank
    can take the axes."""
    if not selection.matches(info.name):
        return Skip(SkipKind.NOT_SELECTED, "not selected")
    if info.optimizer_state and not selection.names_explicitly(info.name):
        return Skip(SkipKind.OPTIMIZER_STATE, "optimizer state, left out unless an include pattern names it")
    if info.refused:
        return Skip(SkipKind.REFUSED, info.refused)
    if info.role is not None:
        return Skip(SkipKind.NOT_A_WEIGHT, info.role)
    if info.encoding is not None and info.encoding.summary.problem is not None:
        return Skip(SkipKind.NOT_UNDERSTOOD, f"quantized, not measured: {info.encoding.summary.problem}")
    if not info.numeric:
        return Skip(SkipKind.UNREADABLE_TYPE if info.unreadable_type else SkipKind.NOT_NUMERIC,
                    f"{info.dtype_label or info.dtype} is not numeric")
    if not is_floating(info.dtype):
        return Skip(SkipKind.NOT_FLOATING, f"{dtype_name(info.dtype)} is not floating-point")
    problem = axes_problem(len(info.shape), axes)
    return None if problem is None else Skip(SkipKind.AXES, problem)


@dataclass
class TensorEntry:
    """What pass 1 knows of one tensor of a file (plain data).

    ``dtype`` is the stored dtype; ``dtype_label`` what reports show instead for data
    that is not numbers, or the scheme of a quantized weight (None: the dtype's name);
    ``encoding``: a quantized weight's :class:`~tclip.formats.base.EncodingSummary`;
    ``unread_floats``: selected, never read (refused, or of a type tclip cannot read) and may
    hold floating-point values: a clip refuses it rather than pass over it.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    skipped: Skip | None = None
    dtype_label: str | None = None
    encoding: EncodingSummary | None = None
    unread_floats: bool = False


def _unread_floats(info: TensorInfo, reason: Skip | None) -> bool:
    """Whether a tensor left unread may hold floats: a refused float, or one of a type tclip
    cannot read unless its format knows the type holds none (torch.complex32)."""
    if reason is None or reason.kind not in (SkipKind.REFUSED, SkipKind.UNREADABLE_TYPE):
        return False
    return is_floating(info.dtype) if info.numeric else not info.not_floating


def select(reader: TensorReader, selection: Selection, axes: Axes = None,
           whole_if_rank_skip: bool = False) -> tuple[list[TensorEntry], dict[str, tuple[int, ...] | None]]:
    """Header-only: every tensor with its skip reason, and the reduction axes of those to read.

    With ``whole_if_rank_skip`` (the report), a tensor whose rank cannot take
    the axes is still read, reduced as a whole (NaN/Inf and its norm are never hidden).
    """
    entries, to_read = [], {}
    for info in reader.tensors.values():
        reason = skip_reason(info, selection, axes)
        entries.append(TensorEntry(info.name, tuple(info.shape), info.dtype, info.nbytes, reason, info.dtype_label,
                                   None if info.encoding is None else info.encoding.summary,
                                   _unread_floats(info, reason)))
        if reason is None:
            to_read[info.name] = normalize_axes(axes, len(info.shape))
        elif whole_if_rank_skip and (is_rank_skip(reason) or (
                (is_complex(info.dtype) or (reason.kind is SkipKind.OPTIMIZER_STATE and is_floating(info.dtype)))
                and info.numeric and not info.refused and selection.matches(info.name))):
            # Complex tensors and optimizer state: never clipped nor in the global norm, but
            # their NaN/Inf and norm are shown.
            to_read[info.name] = None
    return entries, to_read
