"""``report --max-norm``: whether a report passes a norm limit, and why not.

A check never passes over what it did not measure: NaN/Inf fail it, and a
selection pattern that matches nothing is an error, not a pass."""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from ..core.dtypes import ML_FLOAT_TYPES
from ..errors import TclipError
from ..text import fmt_number
from .results import Note, NoteKind, slice_label

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


def check_report(report: Any, max_norm: float, per_slice: bool) -> list[str]:
    """Why a report fails the --max-norm gate (empty: it passes)."""
    reasons = []
    bad = [t for t in report.tensors if t.nonfinite]
    if bad:
        listing = ", ".join(f"{t.name} ({', '.join(f'{n} {k}' for n, k in ((t.nan, 'NaN'), (t.inf, 'Inf')) if n)})"
                            for t in bad[:5])
        reasons.append(f"NaN/Inf in {listing}" + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
    if per_slice:
        axes = report.params.get("axes")
        for t in report.tensors:
            if t.max_slice_norm is None or not t.worst_slices:
                continue
            limit = max_norm * (1 + gate_tolerance(t.dtype))
            over = [s for s in t.worst_slices if s["norm"] > limit or math.isnan(s["norm"])]
            if over:
                label = slice_label(t.shape, tuple(a % len(t.shape) for a in axes) if axes else None)
                first = over[0]
                where = first["index"][0] if len(first["index"]) == 1 else tuple(first["index"])
                reasons.append(f"{label if label != 'slice' else 'slice'} norm {fmt_number(first['norm'])} above "
                               f"{max_norm:g} in {t.name} {label} {where}")
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


def apply_gate(report: Any, max_norm: float, per_slice: bool, where: object) -> bool:
    """``report --max-norm``: a pattern that matches nothing is an error; a failed check is a
    warning on the report (the command line keeps it under -q). Returns whether it failed."""
    report.params["max_norm"] = max_norm
    unmatched = [w for w in report.warnings if w.kind is NoteKind.UNMATCHED_PATTERN]
    if unmatched:
        raise TclipError(f"{'; '.join(unmatched)}: nothing to check", where)
    reasons = check_report(report, max_norm, per_slice)
    if not reasons:
        return False
    report.warnings.append(Note(NoteKind.CHECK_FAILED, "check failed: " + "; ".join(reasons)))
    return True
