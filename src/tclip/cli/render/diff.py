"""The rendering of ``tclip diff`` for people, in the report's style (same never-ambiguous names)."""

from __future__ import annotations

import math

import numpy as np
from rich.console import Console
from rich.text import Text

from ...text import fmt_column, name_list, safe, shown_key
from ...work.diff import UNMATCHED, DiffReport, RemarkKind, Status, TensorDiff, Verdict
from ...work.results import dtype_text
from ..words import flag
from .report import gave_way_line
from .table import Column, human_bytes, lay_out, print_lines, short_dtype, symbols_for


# How many names a line under the table shows before "and N more".
FEW = 3


def _order(tensors: list[TensorDiff], sort: str) -> list[TensorDiff]:
    if sort == "name":
        return sorted(tensors, key=lambda t: shown_key(t.name))
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
    gave_way: list[str] = []
    if shown:
        names = [t.name if t.name_b is None else f"{t.name} {symbols.arrow} {t.name_b}" for t in shown]
        dtypes: list[str] = []
        short: list[str] = []
        for t in shown:  # compared tensors: both sides have a dtype, so neither text is None
            a, b = dtype_text(t.dtype_a, t.label_a) or "", dtype_text(t.dtype_b, t.label_b) or ""
            dtypes.append(a if a == b else f"{a}/{b}")
            short_a = t.label_a or _short(t.dtype_a)
            short.append(short_a if a == b else f"{short_a}/{t.label_b or _short(t.dtype_b)}")
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
            Column("outside", "differ", [Text(f"{t.outside:,}/{t.elements:,}", style="bold red" if t.outside else "")
                                         for t in shown], "right"),
            Column("nonfinite", "NaN/Inf≠" if symbols.arrow == "→" else "NaN/Inf!=",
                   [Text(str(t.nonfinite_mismatch), style="bold magenta" if t.nonfinite_mismatch else "dim")
                    for t in shown], "right"),
        ]
        lines += lay_out(names, columns, width, symbols, gave_way=gave_way)
        if gave_way and width is not None:
            lines.append(gave_way_line(gave_way, width))
    if top is not None and len(differing) > len(shown):
        lines.append(Text(f"{len(differing) - len(shown)} more differing tensor(s) not shown (--top {top})",
                          style="dim"))
    if same:
        lines.append(Text(f"{same} tensor(s) equal ({tolerance})", style="dim"))
    for status in UNMATCHED:
        items = sorted((t for t in report.tensors if t.status is status), key=lambda t: shown_key(t.name))
        if not items:
            continue
        if status is Status.SHAPE_DIFFERS:
            parts = [f"{safe(t.name)} ({symbols.times.join(map(str, t.shape_a or []))} vs "
                     f"{symbols.times.join(map(str, t.shape_b or []))})" for t in items[:FEW]]
        else:
            parts = [safe(t.name) for t in items[:FEW]]
        lines.append(Text(f"{status.value}: {name_list(parts, FEW, total=len(items))}", style="yellow"))
    lines += _not_compared_lines(report)
    for label, kinds, reason in (("compared as values", (RemarkKind.DTYPES_DIFFER,), " (dtypes differ)"),
                                 ("not numbers, compared exactly", (RemarkKind.BYTES, RemarkKind.AS_DATA), "")):
        picked = [t for t in compared if t.note is not None and t.note.kind in kinds]
        if picked:
            lines.append(Text(f"{label}: {name_list([safe(t.name) for t in picked], FEW)}{reason}", style="dim"))
    lines += _metadata_lines(report)
    verdict = report.verdict
    summary = Text(f"{verdict.value}: ", style="bold green" if verdict is Verdict.SAME else "bold red")
    line = report.summary_line(flag)
    summary.append(line if symbols.arrow == "→" else line.replace("‖", "|").replace("−", "-"), style="bold")
    lines.append(summary)
    sep = f"  {symbols.dot}  "
    lines.append(Text(sep.join([f"{human_bytes(report.bytes_read)} read", f"{report.elapsed_s:.3f} s",
                                f"tolerance: {tolerance}"]), style="dim"))
    print_lines(console, lines)
    console.print()


def _not_compared_lines(report: DiffReport) -> list[Text]:
    """Each reason a tensor was not compared once, after a few of its names: one line per reason."""
    groups: dict[str, list[str]] = {}
    for t in sorted((t for t in report.tensors if t.status is Status.NOT_COMPARED), key=lambda t: shown_key(t.name)):
        groups.setdefault(str(t.note or ""), []).append(safe(t.name))
    lines = [Text(f"not compared: {name_list(names, FEW)} ({safe(reason)})", style="yellow")
             for reason, names in list(groups.items())[:FEW]]
    if len(groups) > FEW:
        rest = sum(len(names) for names in list(groups.values())[FEW:])
        lines.append(Text(f"not compared: {rest} more, for {len(groups) - FEW} other reasons", style="yellow"))
    return lines


def _metadata_lines(report: DiffReport) -> list[Text]:
    """A line per metadata or attribute difference (a few, then how many more); dim when
    ``--tensors-only`` lists them without counting them."""
    lines = []
    style = "yellow" if report.metadata_counts else "dim"
    for d in report.metadata_differences[:FEW]:
        where = "file metadata" if d.where is None else f"attribute of {safe(d.where)}"
        a = "(none)" if d.a is None else safe(d.a)
        b = "(none)" if d.b is None else safe(d.b)
        lines.append(Text(f"{where}: {safe(d.key)}: {a}  vs  {b}", style=style))
    more = len(report.metadata_differences) - FEW
    if more > 0:
        lines.append(Text(f"and {more} more metadata difference{'s' if more > 1 else ''} (--json lists them)",
                          style=style))
    return lines


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

