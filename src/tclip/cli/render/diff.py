"""The rendering of ``tclip diff`` for people, in the report's style (same never-ambiguous names)."""

from __future__ import annotations

import math

import numpy as np
from rich.console import Console
from rich.text import Text

from ...text import fmt_column, natural_key, safe
from ...work.diff import UNMATCHED, DiffReport, RemarkKind, Status, TensorDiff
from ...work.results import dtype_text
from .table import Column, human_bytes, lay_out, print_lines, short_dtype, symbols_for


def _order(tensors: list[TensorDiff], sort: str) -> list[TensorDiff]:
    if sort == "name":
        return sorted(tensors, key=lambda t: natural_key(t.name))
    if sort == "order":
        return list(tensors)

    def key(t: TensorDiff) -> tuple[int, float]:
        if t.nonfinite_mismatch:
            return (0, 0.0)
        rel = t.relative if t.relative is not None else 0.0
        return (1, -(rel if not math.isnan(rel) else math.inf))
    return sorted(tensors, key=key)


def render_diff(report: DiffReport, console: Console, width: int | None, *, sort: str = "diff",
                top: int | None = None) -> None:
    symbols = symbols_for(console)
    lines = [Text(f"{safe(report.a)}  vs  {safe(report.b)}", style="bold")]
    tolerance = "exact" if report.rtol == 0 and report.atol == 0 else f"rtol {report.rtol:g}, atol {report.atol:g}"
    compared = [t for t in report.tensors if t.status is Status.COMPARED]
    differing = _order([t for t in compared if t.differs], sort)
    same = len(compared) - len(differing)
    shown = differing[:top] if top is not None else differing
    if shown:
        names = [t.name if t.name_b is None else f"{t.name} {symbols.arrow} {t.name_b}" for t in shown]
        dtypes, short = [], []
        for t in shown:
            a, b = dtype_text(t.dtype_a), dtype_text(t.dtype_b)
            dtypes.append(a if a == b else f"{a}/{b}")
            short.append(_short(t.dtype_a) if a == b else f"{_short(t.dtype_a)}/{_short(t.dtype_b)}")
        columns = [
            Column("shape", "shape", [Text(symbols.times.join(map(str, t.shape_a or [])) or "()") for t in shown],
                   drop=2),
            Column("dtype", "dtype", [Text(d) for d in dtypes], drop=3,
                   short_cells=[Text(s) for s in short]),
            Column("diff", "‖a−b‖" if symbols.arrow == "→" else "|a-b|",
                   [Text(x) for x in fmt_column([t.diff_norm for t in shown])], "right"),
            Column("rel", "relative", [Text(x) for x in fmt_column([t.relative for t in shown])], "right"),
            Column("max", "max |a−b|" if symbols.arrow == "→" else "max |a-b|",
                   [Text(x) for x in fmt_column([t.max_abs_diff for t in shown])], "right", drop=1),
            Column("cos", "cosine", [Text(_cosine(t.cosine)) for t in shown], "right", drop=0),
            Column("outside", "differ", [Text(f"{t.outside:,}/{t.elements:,}", style="bold red" if t.outside else None)
                                         for t in shown], "right"),
            Column("nonfinite", "NaN/Inf≠" if symbols.arrow == "→" else "NaN/Inf!=",
                   [Text(str(t.nonfinite_mismatch), style="bold magenta" if t.nonfinite_mismatch else "dim")
                    for t in shown], "right"),
        ]
        lines += lay_out(names, columns, width, symbols)
    if top is not None and len(differing) > len(shown):
        lines.append(Text(f"{len(differing) - len(shown)} more differing tensor(s) not shown (--top {top})",
                          style="dim"))
    if same:
        lines.append(Text(f"{same} tensor(s) equal ({tolerance})", style="dim"))
    for status in (*UNMATCHED, Status.NOT_COMPARED):
        items = [t for t in report.tensors if t.status is status]
        if not items:
            continue
        parts = []
        for t in items[:12]:
            if status is Status.SHAPE_DIFFERS:
                parts.append(f"{safe(t.name)} ({symbols.times.join(map(str, t.shape_a or []))} vs "
                             f"{symbols.times.join(map(str, t.shape_b or []))})")
            elif status is Status.NOT_COMPARED:
                parts.append(f"{safe(t.name)} ({safe(t.note or '')})")
            else:
                parts.append(safe(t.name))
        more = f" and {len(items) - 12} more" if len(items) > 12 else ""
        lines.append(Text(f"{status.value}: {', '.join(parts)}{more}",
                          style="yellow" if status is not Status.NOT_COMPARED else "dim"))
    for label, kinds, reason in (("compared as values", (RemarkKind.DTYPES_DIFFER,), " (dtypes differ)"),
                                 ("not numbers, compared exactly", (RemarkKind.BYTES, RemarkKind.AS_DATA), "")):
        picked = [t for t in compared if t.note is not None and t.note.kind in kinds]
        if picked:
            lines.append(Text(f"{label}: {', '.join(safe(t.name) for t in picked[:6])}"
                              + (f" and {len(picked) - 6} more" if len(picked) > 6 else "") + reason, style="dim"))
    verdict = "differ" if report.differs else "same"
    summary = Text(f"{verdict}: ", style="bold red" if report.differs else "bold green")
    summary.append(report.summary_line() if symbols.arrow == "→" else
                   report.summary_line().replace("‖", "|").replace("−", "-"), style="bold")
    lines.append(summary)
    sep = f"  {symbols.dot}  "
    lines.append(Text(sep.join([f"{human_bytes(report.bytes_read)} read", f"{report.elapsed_s:.3f} s",
                                f"tolerance: {tolerance}"]), style="dim"))
    print_lines(console, lines)
    console.print()


def _short(dtype: np.dtype | str | None) -> str:
    return short_dtype(dtype) if isinstance(dtype, np.dtype) else (dtype or "")


def _cosine(value: float | None) -> str:
    if value is None:
        return "—"
    if math.isnan(value):
        return "nan"
    if abs(value) == 1.0:
        return f"{value:.0f}"  # exactly parallel
    digits = 6
    while digits < 17 and abs(float(f"{value:.{digits}f}")) == 1.0:
        digits += 1  # 0.9999999952 is not shown as 1.000000
    return f"{value:.{digits}f}"

