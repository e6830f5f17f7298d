"""``report --max-norm``: whether a report passes a norm limit, and why not.

A check never passes over what it did not measure: NaN/Inf fail it, a selected
tensor tclip could not read (refused by its format: an HDF5 filter missing,
external storage; or of a type it cannot read) fails it, and a selection pattern
that matches nothing is an error, not a pass. With axes every slice is gated, and
a tensor whose rank cannot take the axes is gated on its whole norm.

The decision is data (:class:`GateResult`: a :class:`GateVerdict` and typed
:class:`GateReason` entries), made in one place (:func:`gate_reasons`); the JSON's
``verdict``, the warning's text and the exit status all come from it. For people each
kind of reason is one line of bounded length: a few names, largest first, then how many more."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from ..core.dtypes import ML_FLOAT_TYPES
from ..errors import TclipError
from ..text import fmt_number, name_list, natural_key
from .results import UNMEASURED, Note, NoteKind, json_safe, slice_label
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


class GateVerdict(str, enum.Enum):
    """The answer of a ``--max-norm`` gate (the JSON's ``verdict``): only ``PASSED`` exits 0."""

    PASSED = "passed"
    FAILED = "failed"  # a norm above the limit, or NaN/Inf
    INCOMPLETE = "incomplete"  # nothing above the limit, but a selected tensor could not be measured

    def __str__(self) -> str:
        return self.value


class ReasonKind(str, enum.Enum):
    """Why a gate did not pass (the JSON reason's ``kind``)."""

    MAX_NORM = "max_norm"  # a norm above the limit: the global norm, a slice's, or a whole tensor's
    NONFINITE = "nonfinite"
    UNMEASURED = "unmeasured"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class GateReason:
    """One reason a gate did not pass. ``tensor`` is None for the global norm; ``value`` the
    norm above ``limit``; ``slice_kind``/``slice_index`` the slice (``row``, ``(3,)``) where a
    slice is above it, None for a whole tensor; ``nan``/``inf`` the counts of a tensor holding
    them, ``where`` where a quantized weight holds them; ``why`` what kept a tensor unmeasured;
    ``largest`` the largest tensor and its norm, for a global norm above the limit."""

    kind: ReasonKind
    file: str
    tensor: str | None = None
    value: float | None = None
    limit: float | None = None
    slice_kind: str | None = None
    slice_index: tuple[int, ...] | None = None
    nan: int = 0
    inf: int = 0
    where: str | None = None
    why: str | None = None
    largest: tuple[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        item: dict[str, Any] = {"kind": self.kind.value, "file": self.file, "tensor": self.tensor}
        if self.kind is ReasonKind.MAX_NORM:
            item.update(value=self.value, limit=self.limit,
                        slice=None if self.slice_index is None else {"kind": self.slice_kind,
                                                                    "index": list(self.slice_index)})
            if self.largest is not None:
                item["largest"] = {"name": self.largest[0], "norm": self.largest[1]}
        elif self.kind is ReasonKind.NONFINITE:
            item.update(nan=self.nan, inf=self.inf)
            if self.where is not None:
                item["where"] = self.where
        else:
            item["why"] = self.why
        return json_safe(item)


@dataclass
class GateResult:
    """What a ``--max-norm`` gate decided about one report: the verdict and every reason, typed."""

    max_norm: float
    reasons: list[GateReason] = field(default_factory=list)

    @property
    def verdict(self) -> GateVerdict:
        """``FAILED`` for a norm above the limit or NaN/Inf; ``INCOMPLETE`` when the only reasons
        are tensors it could not measure (a check never passes over those); else ``PASSED``."""
        if any(r.kind is not ReasonKind.UNMEASURED for r in self.reasons):
            return GateVerdict.FAILED
        return GateVerdict.INCOMPLETE if self.reasons else GateVerdict.PASSED

    @property
    def passed(self) -> bool:
        return self.verdict is GateVerdict.PASSED

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "reasons": [r.to_json() for r in self.reasons]}

    def lines(self) -> list[str]:
        """The reasons for people, grouped by kind, each one line of bounded length."""
        return reason_lines(self.reasons, self.max_norm)


def gate_reasons(report: Any, max_norm: float, per_slice: bool,
                 selection: Selection | None = None) -> list[GateReason]:
    """Every reason the report fails the --max-norm gate (empty: it passes): the decision
    itself; the texts and the exit status both come from it."""
    file = report.file
    reasons = [GateReason(ReasonKind.UNMEASURED, file, name, why=why) for name, why in unmeasured(report, selection)]
    bad = sorted((t for t in report.tensors if t.nonfinite), key=lambda t: (-t.nonfinite, natural_key(t.name)))
    reasons += [GateReason(ReasonKind.NONFINITE, file, t.name, nan=t.nan, inf=t.inf,
                           where=getattr(t, "nonfinite_where", None) or None) for t in bad]  # codes or scales
    if per_slice:
        reasons += [GateReason(ReasonKind.MAX_NORM, file, name, norm, max_norm, kind, index)
                    for norm, name, kind, index in _over_per_slice(report, max_norm)]
    elif report.global_norm is not None:
        dtypes = [t.dtype for t in report.tensors if t.norm is not None and t.skipped is None]
        tolerance = max((gate_tolerance(d) for d in dtypes), default=gate_tolerance(np.dtype(np.float32)))
        if report.global_norm > max_norm * (1 + tolerance) or math.isnan(report.global_norm):
            biggest = max((t for t in report.tensors if t.norm is not None),  # a NaN norm counts as largest
                          key=lambda t: (math.isnan(t.norm), t.norm if not math.isnan(t.norm) else 0.0),
                          default=None)
            reasons.append(GateReason(ReasonKind.MAX_NORM, file, None, report.global_norm, max_norm,
                                      largest=None if biggest is None else (biggest.name, biggest.norm)))
    return reasons


def judge(report: Any, max_norm: float, per_slice: bool, selection: Selection | None = None) -> GateResult:
    """The --max-norm gate's verdict on a report, with its reasons (see :class:`GateResult`)."""
    return GateResult(max_norm, gate_reasons(report, max_norm, per_slice, selection))


def _by_reason(items: list[tuple[str, str]]) -> str:
    """``a, b and 3 more (why)``: each reason once, after a few of its names."""
    groups: dict[str, list[str]] = {}
    for name, why in items:
        groups.setdefault(why, []).append(name)
    if len(groups) > FEW:  # e.g. external storage naming a different file for each dataset
        return f"{name_list([n for n, _ in items])} (the first: {items[0][1]})"
    return "; ".join(f"{name_list(names)} ({why})" for why, names in groups.items())


def _slice_where(reason: GateReason) -> str | None:
    if reason.slice_index is None:
        return None
    index = reason.slice_index[0] if len(reason.slice_index) == 1 else reason.slice_index
    return f"{reason.slice_kind} {index}"


def reason_lines(reasons: list[GateReason], max_norm: float) -> list[str]:
    """The reasons as lines for people: one per kind, a few names, largest first, then how many more."""
    lines = []
    missing = [(r.tensor or "", r.why or "") for r in reasons if r.kind is ReasonKind.UNMEASURED]
    if missing:
        lines.append(f"{_count(len(missing), 'selected tensor')} not measured: {_by_reason(missing)}")
    bad = [r for r in reasons if r.kind is ReasonKind.NONFINITE]
    if bad:
        parts = [f"{r.tensor} ({', '.join(f'{n:,} {k}' for n, k in ((r.nan, 'NaN'), (r.inf, 'Inf')) if n)}"
                 f"{': ' + r.where if r.where else ''})" for r in bad[:FEW]]
        lines.append(f"NaN/Inf in {name_list(parts, FEW, total=len(bad))}")
    over = [r for r in reasons if r.kind is ReasonKind.MAX_NORM and r.tensor is not None]
    if len(over) == 1:
        r = over[0]
        where = _slice_where(r)
        what = "whole-tensor norm" if where is None else f"{r.slice_kind} norm"
        lines.append(f"{what} {fmt_number(r.value)} above {max_norm:g} in {r.tensor}"
                     + (f" {where}" if where is not None else " (its rank cannot take the axes)"))
    elif over:
        parts = [f"{r.tensor} {_slice_where(r)} ({fmt_number(r.value)})" if r.slice_index is not None
                 else f"{r.tensor} (whole tensor, {fmt_number(r.value)})" for r in over[:FEW]]
        lines.append(f"norms above {max_norm:g} in {len(over):,} tensors (largest first): "
                     f"{name_list(parts, FEW, total=len(over))}")
    for r in reasons:
        if r.kind is ReasonKind.MAX_NORM and r.tensor is None:
            extra = f" (largest: {r.largest[0]}, {fmt_number(r.largest[1])})" if r.largest is not None else ""
            lines.append(f"global norm {fmt_number(r.value)} above {max_norm:g}{extra}")
    return lines


def check_report(report: Any, max_norm: float, per_slice: bool, selection: Selection | None = None) -> list[str]:
    """Why a report fails the --max-norm gate (empty: it passes); each reason one bounded line."""
    return judge(report, max_norm, per_slice, selection).lines()


def _over_per_slice(report: Any, max_norm: float) -> list[tuple[float, str, str | None, tuple[int, ...] | None]]:
    """(norm, tensor, which slice: its kind and index -- None: the whole tensor) of every tensor
    with a norm above the limit, largest first: its largest slice, or its whole norm where its rank
    cannot take the axes. NaN norms are left to the NaN/Inf reason."""
    axes = report.params.get("axes")
    over: list[tuple[float, str, str | None, tuple[int, ...] | None]] = []
    for t in report.tensors:
        limit = max_norm * (1 + gate_tolerance(t.dtype))
        if t.max_slice_norm is not None and t.worst_slices:
            above = [s for s in t.worst_slices if s["norm"] > limit]
            if above:
                label = slice_label(t.shape, tuple(a % len(t.shape) for a in axes) if axes else None)
                over.append((above[0]["norm"], t.name, label, tuple(int(i) for i in above[0]["index"])))
        elif is_rank_skip(t.skipped) and t.norm is not None and t.norm > limit:
            over.append((t.norm, t.name, None, None))
    over.sort(key=lambda item: (-item[0], natural_key(item[1])))  # ties in natural order
    return over


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}" if n == 1 else f"{n:,} {what}s"


def apply_gate(report: Any, max_norm: float, per_slice: bool, where: object,
               selection: Selection | None = None) -> bool:
    """``report --max-norm``: a pattern that matches nothing is an error; the verdict
    (:func:`judge`) is kept on the report as ``report.gate`` (its JSON's ``verdict`` and
    ``reasons``), and a check that did not pass (a limit exceeded, NaN/Inf, or a selected
    tensor that could not be measured) is also a warning on it (the command line keeps it
    under -q). Returns whether the check did not pass: what makes the command line exit 3.

    Example:
        >>> report = report_file("grads.safetensors", max_norm=100.0)  # doctest: +SKIP
        >>> apply_gate(report, 100.0, False, "grads.safetensors")  # doctest: +SKIP
        >>> report.gate.verdict, [r.kind for r in report.gate.reasons]  # doctest: +SKIP
    """
    report.params["max_norm"] = max_norm
    unmatched = [w for w in report.warnings if w.kind is NoteKind.UNMATCHED_PATTERN]
    if unmatched:
        raise TclipError(f"{'; '.join(unmatched)}: nothing to check", where)
    result = judge(report, max_norm, per_slice, selection)
    report.gate = result
    if result.passed:
        return False
    report.warnings.append(Note(NoteKind.CHECK_FAILED, "check failed: " + "; ".join(result.lines())))
    return True
