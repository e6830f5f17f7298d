"""``report --max-norm``: whether a report passes a norm limit, and why not.

A check never passes over what it did not measure: NaN/Inf fail it, a selected
tensor tclip could not read (refused by its format: an HDF5 filter missing,
external storage; or of a type it cannot read) fails it, and a selection pattern
that matches nothing is an error, not a pass. With axes every slice is gated, and
a tensor whose rank cannot take the axes is gated on its whole norm. Each reason
is one line of bounded length: a few names, largest first, then how many more."""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from ..core.dtypes import ML_FLOAT_TYPES
from ..errors import TclipError
from ..text import fmt_number, name_list, natural_key
from .results import UNMEASURED, Note, NoteKind, slice_label
from .selection import Selection, SkipKind, is_rank_skip

# How many names a line of the gate shows before "and N more".
FEW = 3

# Relative tolerance of the --max-norm gate per dtype: 2 ulps (2 * machine epsilon); the
# narrow floats of ml_dtypes other than bfloat16 get 2 * 2**-3, those with two mantissa bits 2 * 2**-2.
_EPS = {np.float64: 2.0 ** -52, np.float32: 2.0 ** -23, np.float16: 2.0 ** -10, ml_dtypes.bfloat16: 2.0 ** -7}
_TWO_MANTISSA_BITS = frozenset(getattr(ml_dtypes, name) for name in ("float8_e5m2", "float8_e5m2fnuz")
                               if hasattr(ml_dtypes, name))


def gate_tolerance(dtype: np.dtype) -> float:
    """How far above a limit a norm of ``dtype`` values may be and still pass: 2 ulps, relative."""
    kind = np.dtype(dtype).type
    if kind in _TWO_MANTISSA_BITS:
        return 2 * 2.0 ** -2
    if kind in ML_FLOAT_TYPES and kind not in _EPS:
        return 2 * 2.0 ** -3
    return 2 * _EPS.get(kind, 2.0 ** -23)


_UNMEASURED = UNMEASURED


def unmeasured(report: Any, selection: Selection | None = None) -> list[tuple[str, str]]:
    """(name, why) of every selected tensor -- or dataset of a type tclip cannot read -- that
    a check could not measure, in the report's order."""
    selection = selection or Selection()
    found = [(t.name, str(t.skipped)) for t in report.tensors
             if t.skipped is not None and t.skipped.kind in _UNMEASURED]
    found += [(o.name, o.reason) for o in report.others if o.unreadable_type and selection.matches(o.name)]
    return found


def _by_reason(items: list[tuple[str, str]]) -> str:
    """``a, b and 3 more (why)``: each reason once, after a few of its names."""
    groups: dict[str, list[str]] = {}
    for name, why in items:
        groups.setdefault(why, []).append(name)
    if len(groups) > FEW:  # e.g. external storage naming a different file for each dataset
        return f"{name_list([n for n, _ in items])} (the first: {items[0][1]})"
    return "; ".join(f"{name_list(names)} ({why})" for why, names in groups.items())


def check_report(report: Any, max_norm: float, per_slice: bool, selection: Selection | None = None) -> list[str]:
    """Why a report fails the --max-norm gate (empty: it passes); each reason one bounded line."""
    reasons = []
    missing = unmeasured(report, selection)
    if missing:
        reasons.append(f"{_count(len(missing), 'selected tensor')} not measured: {_by_reason(missing)}")
    bad = sorted((t for t in report.tensors if t.nonfinite), key=lambda t: (-t.nonfinite, natural_key(t.name)))
    if bad:
        parts = [f"{t.name} ({', '.join(f'{n:,} {k}' for n, k in ((t.nan, 'NaN'), (t.inf, 'Inf')) if n)}"
                 f"{': ' + t.nonfinite_where if getattr(t, 'nonfinite_where', None) else ''})"  # codes or scales
                 for t in bad[:FEW]]
        reasons.append(f"NaN/Inf in {name_list(parts, FEW, total=len(bad))}")
    if per_slice:
        over = _over_per_slice(report, max_norm)
        if len(over) == 1:
            norm, name, where = over[0]
            what = "whole-tensor norm" if where is None else f"{where.split(' ')[0]} norm"
            reasons.append(f"{what} {fmt_number(norm)} above {max_norm:g} in {name}"
                           + (f" {where}" if where is not None else " (its rank cannot take the axes)"))
        elif over:
            parts = [f"{name} {where} ({fmt_number(norm)})" if where is not None
                     else f"{name} (whole tensor, {fmt_number(norm)})" for norm, name, where in over[:FEW]]
            reasons.append(f"norms above {max_norm:g} in {len(over):,} tensors (largest first): "
                           f"{name_list(parts, FEW, total=len(over))}")
    elif report.global_norm is not None:
        dtypes = [t.dtype for t in report.tensors if t.norm is not None and t.skipped is None]
        tolerance = max((gate_tolerance(d) for d in dtypes), default=gate_tolerance(np.dtype(np.float32)))
        if report.global_norm > max_norm * (1 + tolerance) or math.isnan(report.global_norm):
            biggest = max((t for t in report.tensors if t.norm is not None),  # a NaN norm counts as largest
                          key=lambda t: (math.isnan(t.norm), t.norm if not math.isnan(t.norm) else 0.0),
                          default=None)
            extra = f" (largest: {biggest.name}, {fmt_number(biggest.norm)})" if biggest is not None else ""
            reasons.append(f"global norm {fmt_number(report.global_norm)} above {max_norm:g}{extra}")
    return reasons


def _over_per_slice(report: Any, max_norm: float) -> list[tuple[float, str, str | None]]:
    """(norm, tensor, which slice -- None: the whole tensor) of every tensor with a norm above
    the limit, largest first: its largest slice, or its whole norm where its rank cannot take the
    axes. NaN norms are left to the NaN/Inf reason."""
    axes = report.params.get("axes")
    over = []
    for t in report.tensors:
        limit = max_norm * (1 + gate_tolerance(t.dtype))
        if t.max_slice_norm is not None and t.worst_slices:
            above = [s for s in t.worst_slices if s["norm"] > limit]
            if above:
                label = slice_label(t.shape, tuple(a % len(t.shape) for a in axes) if axes else None)
                first = above[0]
                where = first["index"][0] if len(first["index"]) == 1 else tuple(first["index"])
                over.append((first["norm"], t.name, f"{label} {where}"))
        elif is_rank_skip(t.skipped) and t.norm is not None and t.norm > limit:
            over.append((t.norm, t.name, None))
    over.sort(key=lambda item: (-item[0], natural_key(item[1])))  # ties in natural order
    return over


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}" if n == 1 else f"{n:,} {what}s"


def apply_gate(report: Any, max_norm: float, per_slice: bool, where: object,
               selection: Selection | None = None) -> bool:
    """``report --max-norm``: a pattern that matches nothing is an error; a failed check
    (a limit exceeded, NaN/Inf, or a selected tensor that could not be measured) is a
    warning on the report (the command line keeps it under -q). Returns whether it failed."""
    report.params["max_norm"] = max_norm
    unmatched = [w for w in report.warnings if w.kind is NoteKind.UNMATCHED_PATTERN]
    if unmatched:
        raise TclipError(f"{'; '.join(unmatched)}: nothing to check", where)
    reasons = check_report(report, max_norm, per_slice, selection)
    if not reasons:
        return False
    report.warnings.append(Note(NoteKind.CHECK_FAILED, "check failed: " + "; ".join(reasons)))
    return True
