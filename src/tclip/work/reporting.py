"""Reports from the passes: what pass 1, the plan and pass 2 found, as report data."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..core.dtypes import is_complex
from ..core.modes import GlobalNormClip, Mode, NormClip, ValueClip
from ..core.stats import TensorStats
from ..messages import Option
from ..text import name_list
from .gate import gate_tolerance
from .plan import Plan
from .quantized import nonfinite_detail, quantization_json, quantized_notes
from .results import (
    NEAR_ZERO_NORM,
    WORST_SLICES,
    FileReport,
    Note,
    NoteKind,
    OtherReport,
    TensorReport,
)
from .rewrite import RewriteResult
from .selection import Selection, SkipKind, is_rank_skip
from .statistics import FileStats


def mode_params(mode: Mode) -> dict[str, object]:
    if isinstance(mode, ValueClip):
        return {"min": mode.clip_value_min, "max": mode.clip_value_max}
    params: dict[str, object] = {"clip": mode.clip_norm}
    if isinstance(mode, NormClip):
        axes = mode.axes
        params["axes"] = None if axes is None else list(axes)
    if isinstance(mode, GlobalNormClip):
        params["use_norm"] = mode.use_norm
    return params


def start_report(stats: FileStats, mode_name: str, params: dict[str, object]) -> FileReport:
    """The report of one file from its pass 1: every tensor with its skip reason and statistics."""
    report = FileReport(file=stats.path, mode=mode_name, params=params, format=stats.format)
    for entry in stats.tensors:
        tensor = TensorReport(entry.name, list(entry.shape), entry.dtype, entry.nbytes, skipped=entry.skipped,
                              dtype_label=entry.dtype_label)
        if entry.encoding is not None:
            found = stats.findings.get(entry.name)
            tensor.quantization = quantization_json(entry, found)
            tensor.nonfinite_where = nonfinite_detail(found) or None
        s = stats.stats.get(entry.name)
        if s is not None:
            fill_before(tensor, s)
        tensor.tied_to, tensor.part_of = stats.shared.tied.get(entry.name), stats.shared.part_of.get(entry.name)
        if entry.name in stats.owned:
            tensor.counted_norm = math.sqrt(stats.owned[entry.name][0])
        report.tensors.append(tensor)
    unmeasured = set(stats.unmeasured_others)
    report.others = [OtherReport.of(o, o.name in unmeasured) for o in stats.others]
    report.bytes_read = stats.bytes_read
    return report


def fill_before(entry: TensorReport, stats: TensorStats) -> None:
    entry.norm = stats.norm
    entry.nan, entry.inf = stats.nan_count, stats.inf_count
    entry.max_abs = stats.max_abs
    if stats.size and stats.count:
        entry.min = stats.min_value if stats.count > stats.nan_count else None
        entry.max = stats.max_value if stats.count > stats.nan_count else None
    if stats.axes is not None:
        entry.slices = int(stats.sum_of_squares.size)
        entry.max_slice_norm = float(np.max(stats.slice_norms(), initial=0.0)) if entry.slices else 0.0


def fill_after(entry: TensorReport, after: TensorStats | None, scale: np.ndarray | None) -> None:
    if after is not None:
        _fill_after_norms(entry, after)
    if scale is not None:
        scale = np.asarray(scale, dtype=np.float64)
        entry.scale = float(np.min(scale)) if scale.size else 1.0
        entry.clipped = bool(np.any(scale != 1.0))
        if scale.ndim:
            entry.slices_clipped = int(np.count_nonzero(scale != 1.0))


def _fill_after_norms(entry: TensorReport, after: TensorStats) -> None:
    entry.norm_after = after.norm
    if after.axes is not None:
        entry.max_slice_norm_after = float(np.max(after.slice_norms(), initial=0.0)) if after.size else 0.0


def finish_report(report: FileReport, stats: FileStats, plan: Plan, rewrite: RewriteResult | None) -> None:
    """Fill the after-columns and totals of a report from the plan and pass 2."""
    entries = {t.name: t for t in report.tensors}
    scales = plan.scales.get(stats.path, {})
    chosen = stats.selected
    for name in chosen:
        entry, before = entries[name], stats.stats[name]
        if rewrite is not None and name in rewrite.after:
            measured = rewrite.after[name]
            fill_after(entry, measured if rewrite.measured else None, scales.get(name))
            if isinstance(plan.mode, ValueClip):
                entry.changed = rewrite.changed.get(name)  # (None: not known, see RewriteResult)
                entry.clipped = bool(entry.changed)
        else:
            fill_after(entry, before, scales.get(name))
            if isinstance(plan.mode, ValueClip):
                entry.changed, entry.clipped = 0, False
        if rewrite is not None and name in rewrite.flushed:
            entry.flushed_to_zero = rewrite.flushed[name]
        if before.axes is not None:
            slice_summary(entry, before, scales.get(name))
        if entry.counted_norm is not None and not entry.clipped:
            entry.counted_norm_after = entry.counted_norm  # unchanged
    if rewrite is not None and rewrite.owned is not None:
        for name, (squares, _) in rewrite.owned.items():
            entries[name].counted_norm_after = math.sqrt(squares)
    report.global_norm, after = global_norms([entries[n] for n in chosen])
    if after is not None:
        report.global_norm_after = after
    if rewrite is not None:
        report.bytes_read += rewrite.bytes_read
        report.bytes_written = rewrite.bytes_written
        report.output = rewrite.output
        report.warnings += rewrite.warnings
    note = flush_note(report.tensors)
    if note is not None:
        report.warnings.append(note)


def flush_note(tensors: list[TensorReport]) -> Note | None:
    """The warning that scaling 16- or 8-bit floats made non-zero values zero: the tensors,
    most values lost first, each with how many of its values."""
    hit = sorted((t for t in tensors if t.flushed_to_zero), key=lambda t: -(t.flushed_to_zero or 0))
    if not hit:
        return None
    parts = [f"{t.name} ({t.flushed_to_zero:,} of {t.numel:,} values, {t.dtype_text})" for t in hit[:3]]
    tensors_text = "1 tensor" if len(hit) == 1 else f"{len(hit):,} tensors"
    return Note(NoteKind.FLUSHED_TO_ZERO, f"clipping flushed non-zero values to 0 (scaled below their dtype's "
                                          f"smallest value) in {tensors_text}: {name_list(parts, total=len(hit))}")


def global_norms(picked: list[TensorReport]) -> tuple[float, float | None]:
    """The global norm of the tensors worked on, before and after (None: not measured), from
    their norms (their sums of squares were added exactly, the norms are summed with fsum)."""
    before = math.sqrt(math.fsum((t.counted() or 0.0) ** 2 for t in picked)) if picked else 0.0
    after = [a for a in (t.counted(after=True) for t in picked) if a is not None]
    if len(after) != len(picked):
        return before, None
    return before, math.sqrt(math.fsum(a ** 2 for a in after)) if picked else 0.0


def report_from_stats(stats: FileStats, ord: str, params: dict[str, object],
                      selection: Selection | None = None) -> FileReport:
    """The read-only report of one file from its pass 1."""
    report = start_report(stats, "report", params)
    report.ord = ord
    report.metadata = dict(stats.metadata)
    for entry in report.tensors:
        s = stats.stats.get(entry.name)
        if s is None:
            continue
        entry.norm = {"2": s.norm, "1": s.l1_norm if ord == "1" else 0.0, "inf": s.max_abs}[ord]
        if s.nan_count and ord != "2":
            entry.norm = math.nan  # as the L2 norm is, so NaN is never hidden
        complex_values = is_complex(entry.dtype)
        if s.moments is not None and not complex_values:
            entry.mean, entry.std = s.mean, s.std
            entry.zeros = s.moments.zeros
            entry.histogram = s.moments.histogram()
        if complex_values:
            entry.min = entry.max = None  # complex numbers have no order
        if s.axes is not None:
            slice_summary(entry, s, None, params.get("max_norm"))  # type: ignore[arg-type]
        if entry.name in stats.owned:
            squares, absolute = stats.owned[entry.name]
            entry.counted_norm = {"2": math.sqrt(squares), "1": absolute, "inf": None}[ord]
    # The global norm is over floating tensors (a complex one is measured, not counted),
    # each stored element once (the largest |x| needs no care).
    counted = [t for t in report.tensors if t.name in stats.stats and (t.skipped is None or is_rank_skip(t.skipped))]
    norms = [(t.norm if ord == "inf" else t.counted()) or 0.0 for t in counted]
    if ord == "2":
        report.global_norm = math.sqrt(math.fsum(n * n for n in norms))
    elif ord == "1":
        report.global_norm = math.fsum(norms)
    else:
        report.global_norm = max(norms, default=0.0)
    # (an object of a type tclip cannot read is selected too: the gate counts it unless left out)
    for pattern in (selection or Selection()).unmatched([*(t.name for t in report.tensors),
                                                        *(o.name for o in report.others if o.unreadable_type)]):
        report.warnings.append(unmatched_note(pattern))
    optimizer = optimizer_note([t.name for t in report.tensors
                                if t.skipped is not None and t.skipped.kind is SkipKind.OPTIMIZER_STATE], True)
    if optimizer:
        report.warnings.append(optimizer)
    report.warnings += quantized_notes([stats])
    return report


def optimizer_note(names: list[str], measured: bool) -> Note | None:
    """The word that a training optimizer's variables were left out (counted, a few named)."""
    if not names:
        return None
    done = "left out of the global norm" if measured else "left unchanged"
    return Note(NoteKind.OPTIMIZER_STATE, (f"{len(names):,} optimizer variable{'s' if len(names) > 1 else ''} "
                                           f"(a training optimizer's moments, step counts, learning rate) {done}: "
                                           f"{name_list(names)}; name them with ", Option.INCLUDE,
                                           " to work on them too"))


def unmatched_note(pattern: str) -> Note:
    return Note(NoteKind.UNMATCHED_PATTERN, f"pattern {pattern!r} matches no tensor")


def slice_summary(entry: TensorReport, stats: Any, scale: np.ndarray | None, limit: float | None = None) -> None:
    """Smallest slice norm, near-zero slices, the largest (or clipped) slices by index, and
    with a gate's ``limit`` how many slices are above it (by the gate's tolerance)."""
    norms = np.asarray(stats.slice_norms(), dtype=np.float64)
    axes = stats.axes
    kept_shape = [n for i, n in enumerate(stats.shape) if i not in axes]
    flat = norms.reshape(-1)
    if not flat.size:
        return
    entry.min_slice_norm = float(np.nanmin(flat)) if not np.isnan(flat).all() else math.nan
    entry.near_zero_slices = int(np.count_nonzero(flat <= NEAR_ZERO_NORM))
    if limit is not None:
        bound = limit * (1 + gate_tolerance(entry.dtype))
        entry.slices_above = int(np.count_nonzero((flat > bound) | np.isnan(flat)))
    order_key = np.where(np.isnan(flat), np.inf, flat)
    count = min(WORST_SLICES, flat.size)
    top = np.argpartition(-order_key, count - 1)[:count] if flat.size > count else np.arange(flat.size)
    top = top[np.argsort(-order_key[top], kind="stable")]
    scales = None if scale is None or np.ndim(scale) == 0 else np.asarray(scale).reshape(-1)
    worst = []
    for i in top:
        index = [int(v) for v in np.unravel_index(int(i), kept_shape)] if kept_shape else []
        item: dict[str, Any] = {"index": index, "norm": float(flat[i])}
        if scales is not None:
            item["clipped"] = bool(scales[i] != 1.0)
        worst.append(item)
    entry.worst_slices = worst
