"""The report of one file (or tensor set) for people: a table per file, skip reasons,
slices, a summary line; and the line a run of several files ends with."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from ...text import fmt_column, fmt_number, name_list, safe, shown_key
from ...work.results import FileReport, TensorReport, slice_label
from ...work.selection import SkipKind, is_rank_skip
from .table import (
    UNICODE,
    Column,
    Symbols,
    human_bytes,
    lay_out,
    norm_bar,
    print_lines,
    short_dtype,
    sparkline,
    symbols_for,
)


def _threshold(report: FileReport) -> float | None:
    if report.mode == "report":
        limit = report.params.get("max_norm")
        return float(limit) if isinstance(limit, (int, float)) else None
    clip = report.params.get("clip")
    return float(clip) if isinstance(clip, (int, float)) else None


def _compared_norm(t: TensorReport, report: FileReport) -> float | None:
    """The norm the limit applies to: the largest slice's, the average, or the tensor's."""
    if t.max_slice_norm is not None:
        return t.max_slice_norm
    if report.mode == "average" and t.norm is not None and t.numel:
        return t.norm / t.numel
    return t.norm


def _scale_text(t: TensorReport, report: FileReport, symbols: Symbols) -> Text:
    if report.mode == "value":
        return Text(f"{t.changed or 0}", style="bold red" if t.changed else "dim")
    if not t.clipped or t.scale is None:
        return Text(symbols.dash, style="dim")
    detail = f"{symbols.times}{t.scale:.3g}"
    if t.slices_clipped is not None:
        detail += f" {t.slices_clipped}/{t.slices}"
    return Text(detail, style="bold red")


def order_tensors(tensors: list[TensorReport], sort: str) -> list[TensorReport]:
    if sort == "name":
        return sorted(tensors, key=lambda t: shown_key(t.name))
    if sort == "norm":
        def key(t: TensorReport) -> tuple[int, float]:
            if t.norm is None:
                return (2, 0.0)
            if math.isnan(t.norm) or t.nonfinite:
                return (0, 0.0)
            return (1, -t.norm)
        return sorted(tensors, key=key)
    return list(tensors)


def _stats_columns(tensors: list[TensorReport], numbers: Callable[[list[float | None]], list[Text]],
                   symbols: Symbols) -> list[Column]:
    """The ``--stats`` columns of a report: min, max, mean, std, zeros, log2 histogram."""
    columns = []
    columns.append(Column("min", "min", numbers([t.min for t in tensors]), "right", drop=4))
    columns.append(Column("max", "max", numbers([t.max for t in tensors]), "right", drop=4))
    columns.append(Column("mean", "mean", numbers([t.mean for t in tensors]), "right", drop=4))
    columns.append(Column("std", "std", numbers([t.std for t in tensors]), "right", drop=4))
    zeros = [Text(f"{100 * t.zeros / t.numel:.1f}%" if t.zeros is not None and t.numel else "")
             for t in tensors]
    columns.append(Column("zeros", "zeros", zeros, "right", drop=4))
    hist = [Text(sparkline(t.histogram[1], symbols) if t.histogram and t.histogram[1] else "", style="cyan")
            for t in tensors]
    columns.append(Column("hist", "log2 |x|", hist, drop=1))
    return columns


def _change_columns(tensors: list[TensorReport], report: FileReport,
                    numbers: Callable[[list[float | None]], list[Text]], slice_mode: bool, measured: list[bool],
                    symbols: Symbols) -> list[Column]:
    """A rewrite's columns: the compared norm before, after, and the scale (or values changed)."""
    columns = []
    before = [t.max_slice_norm if slice_mode else _compared_norm(t, report) for t in tensors]
    after = []
    for t in tensors:
        value = t.max_slice_norm_after if slice_mode else t.norm_after
        if report.mode == "average" and value is not None and t.numel:
            value = value / t.numel
        after.append(value)
    first = numbers(before)
    for cell, t in zip(first, tensors):
        if t.skipped is not None and t.norm is None:
            cell.append("skipped", style="dim")
    columns.append(Column("before", "max slice" if slice_mode else "average" if report.mode == "average"
                          else "norm", first, "right"))
    columns.append(Column("after", "after", numbers(after), "right", drop=3))
    columns.append(Column("scale", "changed" if report.mode == "value" else "scale",
                          [_scale_text(t, report, symbols) if m else Text("") for t, m in zip(tensors, measured)],
                          "right", drop=4))
    return columns


def file_lines(report: FileReport, width: int | None, symbols: Symbols = UNICODE, *, sort: str = "order",
               top: int | None = None, stats: bool = False,
               gave_way: list[str] | None = None,
               shown: list[TensorReport] | None = None) -> tuple[list[Text], int]:
    """The per-tensor table as lines, fitted to ``width``; and how many tensors ``top`` left out.
    ``gave_way`` receives the headers of the columns the width left out, ``shown`` the rows' tensors."""
    threshold = _threshold(report)
    slice_mode = any(t.max_slice_norm is not None for t in report.tensors)
    reading = report.mode == "report"
    # Tensors the selection left out are counted under the table, not listed: with
    # --include 'model.layers.17.*' the rows are the nine picked, not 219.
    tensors = order_tensors([t for t in report.tensors if t.selected], sort)
    left_out = 0
    if top is not None:
        ranked = order_tensors([t for t in tensors if t.skipped is None or t.norm is not None], "norm")[:top]
        keep = {id(t) for t in ranked}
        left_out = len(tensors) - len(keep)
        tensors = [t for t in tensors if id(t) in keep]
    if shown is not None:
        shown += tensors
    dash = symbols.dash
    names = [t.name for t in tensors]
    shapes = [Text(symbols.times.join(map(str, t.shape)) or "()") for t in tensors]
    measured = [t.norm is not None for t in tensors]

    def numbers(values: list[float | None]) -> list[Text]:
        texts = fmt_column([v if m else None for v, m in zip(values, measured)], dash)
        return [Text(x if m else "") for x, m in zip(texts, measured)]

    reading_order = report.mode == "report"
    columns = [Column("shape", "shape", shapes, drop=3 if reading_order else 1),
               Column("dtype", "dtype", [Text(t.dtype_text) for t in tensors], drop=5 if reading_order else 2,
                      short_cells=[Text(short_dtype(t.dtype, t.dtype_label)) for t in tensors])]
    if reading:
        label = {"2": "L2 norm", "1": "L1 norm", "inf": "max |x|"}.get(report.ord, "norm")
        norm_cells = numbers([t.norm for t in tensors])
        for cell, t in zip(norm_cells, tensors):
            if t.norm is None and t.skipped:
                cell.append("skipped", style="dim")
        columns.append(Column("norm", label, norm_cells, "right"))
        if slice_mode:
            columns.append(Column("max_slice", "max slice", numbers([t.max_slice_norm for t in tensors]), "right"))
            columns.append(Column("min_slice", "min slice", numbers([t.min_slice_norm for t in tensors]), "right",
                                  drop=2))
        if stats:
            columns += _stats_columns(tensors, numbers, symbols)
    else:
        columns += _change_columns(tensors, report, numbers, slice_mode, measured, symbols)
    nonfinite = [Text(f"{t.nan}/{t.inf}", style="bold magenta") if t.nonfinite else
                 Text("0" if m else "", style="dim") for t, m in zip(tensors, measured)]
    columns.append(Column("nonfinite", "NaN/Inf", nonfinite, "right"))

    bar_reference = threshold
    if reading and threshold is None:
        norms = [t.norm for t in tensors if t.norm is not None and math.isfinite(t.norm)]
        bar_reference = max(norms, default=0.0) or None
    bar = None
    header = ""
    if bar_reference is not None:
        header = f"vs {fmt_number(threshold, dash)}" if threshold is not None else "vs max"

        def bar(w: int) -> list[Text]:
            cells = []
            for t in tensors:
                if t.norm is None:
                    cells.append(Text(""))
                    continue
                shown = (t.max_slice_norm if (reading and slice_mode and t.max_slice_norm is not None)
                         else t.norm if reading else _compared_norm(t, report))
                cells.append(norm_bar(shown, bar_reference, t.clipped or reading, relative=threshold is None,
                                      width=w, symbols=symbols))
            return cells
    styles = ["dim" if t.skipped and t.norm is None else None for t in tensors]
    return lay_out(names, columns, width, symbols, bar, header, row_styles=styles, gave_way=gave_way), left_out


def skipped_lines(report: FileReport, symbols: Symbols = UNICODE) -> list[Text]:
    """'skipped (reason): name, …' grouped by reason, under the table; then what is not a tensor."""
    # (how it is shown, the reason) -> names, in order of first appearance
    reasons: dict[tuple[str, str], list[str]] = {}
    skipped = [t for t in report.tensors if t.skipped is not None and t.skipped.kind is not SkipKind.NOT_SELECTED]
    for t in sorted(skipped, key=lambda t: shown_key(t.name)):
        if t.norm is not None and is_rank_skip(t.skipped):
            form = "measured whole"  # the report measured it whole
        elif t.norm is not None:
            form = "measured"
        else:
            form = "skipped"
        reasons.setdefault((form, str(t.skipped)), []).append(t.name)
    for o in report.others:
        reasons.setdefault(("skipped", f"not a tensor: {o.kind}"), []).append(o.name)
    lines = []
    for (form, reason), names in reasons.items():
        shown = name_list([safe(n) for n in names[:3]], total=len(names))
        if form == "measured whole":
            label = f"no slices: {safe(reason)}; measured whole"
        elif form == "measured":
            label = f"measured, not clipped and not in the global norm ({safe(reason)})"
        else:
            label = f"skipped ({safe(reason)})"
        lines.append(Text(f"{label}: {shown}", style="dim"))
    return lines


# Tensors whose slices get a note under the table, at most: the worst first, then one line
# for the rest (a 219-tensor file clipped by rows would otherwise add a line per tensor).
SLICE_NOTES = 5


def slice_lines(report: FileReport, shown: Sequence[TensorReport] | None = None) -> list[Text]:
    """Per tensor with slices: how many slices are clipped (or over the limit) and the worst
    by index, the smallest, dead ones -- for the tensors most affected (of ``shown``, the
    table's rows), worst first; a line counts the others."""
    limit = report.params.get("max_norm") if report.mode == "report" else report.params.get("clip")
    notes: list[tuple[tuple[int, int], str, Text]] = []
    for t in report.tensors if shown is None else shown:
        if not t.worst_slices or t.slices is None:
            continue
        axes = report.params.get("axes")
        label = slice_label(t.shape, tuple(a % len(t.shape) for a in axes) if axes and t.shape else None)
        plural = label + "s"
        flagged = [s for s in t.worst_slices  # a NaN slice norm is over any limit, as the gate has it
                   if s.get("clipped") or (isinstance(limit, (int, float))
                                           and (s["norm"] > limit or math.isnan(s["norm"])))]
        # How many of how many, then the worst few: "46 of 64 rows clipped; worst: 32, 63, 55"
        # (the worst slices alone read as if only they were).
        count = t.slices_clipped if report.mode != "report" else t.slices_above
        if count is None or count < len(flagged):
            count = len(flagged)
        parts = []
        if flagged:
            indices = ", ".join(_slice_index(s["index"]) for s in flagged[:3])
            verb = "clipped" if report.mode != "report" else f"above {fmt_number(limit)}"
            what = label if t.slices == 1 else plural
            parts.append(f"{count:,} of {t.slices:,} {what} {verb}" + (f": {indices}" if count <= 3
                                                                          else f"; worst: {indices}"))
        if t.min_slice_norm is not None:
            parts.append(f"smallest {label} norm {fmt_number(t.min_slice_norm)}")
        if t.near_zero_slices:
            parts.append(f"{t.near_zero_slices} of {t.slices} {plural} near zero")
        if flagged or t.near_zero_slices:
            notes.append(((-count if flagged else 0, -(t.near_zero_slices or 0)), t.name,
                          Text(f"{safe(t.name)}: " + "; ".join(parts), style="dim")))
    notes.sort(key=lambda n: (n[0], shown_key(n[1])))
    lines = [text for _, _, text in notes[:SLICE_NOTES]]
    if len(notes) > SLICE_NOTES:
        what = "clipped" if report.mode != "report" else "over the limit" if isinstance(limit, (int, float)) else ""
        kinds = f"{what} or near-zero" if what else "near-zero"
        lines.append(Text(f"and {len(notes) - SLICE_NOTES:,} more tensors with {kinds} slices (--json lists them all)",
                          style="dim"))
    return lines


# Ties named under a table, at most (a line counts the others).
TIE_NOTES = 5


def tie_lines(tensors: Sequence[Any], what: str = "the global norm") -> list[Text]:
    """Views of one storage (a PyTorch file) that ``what`` counts once: ``tied: A = B`` for the
    same stored elements, ``part of B: ...`` for elements within another's, and the views that
    overlap otherwise. ``tensors``: report or info lines (``tied_to``, ``part_of``, and
    ``counted_norm`` or ``stored`` where they overlap otherwise)."""
    ties = [t for t in tensors if t.tied_to is not None]
    lines = [Text(f"tied: {safe(t.name)} = {safe(t.tied_to)} (one storage, counted once in {what})", style="dim")
             for t in ties[:TIE_NOTES]]
    if len(ties) > TIE_NOTES:
        lines.append(Text(f"and {len(ties) - TIE_NOTES:,} more tied tensors (--json: tied_to)", style="dim"))
    within: dict[str, list[str]] = {}
    for t in tensors:
        if t.part_of is not None:
            within.setdefault(t.part_of, []).append(t.name)
    for whole, parts in within.items():
        lines.append(Text(f"part of {safe(whole)}: {name_list([safe(p) for p in parts], 4)} (counted with it in "
                          f"{what})", style="dim"))
    overlapping = [t.name for t in tensors if getattr(t, "counted_norm", None) is not None
                   or getattr(t, "stored", None) is not None]
    if overlapping:
        lines.append(Text(f"overlapping views: {name_list([safe(n) for n in overlapping], 4)} (each "
                          f"stored element counted once in {what})", style="dim"))
    return lines


def _slice_index(index: list[int]) -> str:
    return str(index[0]) if len(index) == 1 else "(" + ", ".join(map(str, index)) + ")"


def file_summary(report: FileReport, symbols: Symbols = UNICODE) -> list[Text]:
    text = Text()
    if report.global_norm is not None:
        label = "global norm" if report.ord == "2" else {"1": "global L1", "inf": "global max |x|"}[report.ord]
        text.append(f"{label} {fmt_number(report.global_norm)}", style="bold")
        if report.global_norm_after is not None and report.mode != "report":
            text.append(f" {symbols.arrow} {fmt_number(report.global_norm_after)}", style="bold")
        missing = report.not_measured_count
        if missing:  # the norm covers only what was measured: say so beside it
            text.append(f" over {report.measured_count:,} of {report.measured_count + missing:,} tensors "
                        f"({missing:,} not measured)", style="bold magenta")
    parts = []
    if report.mode != "report":
        parts.append(f"{report.clipped_count} clipped")
    parts.append(f"{report.skipped_count} skipped")
    if report.not_selected_count:
        parts.append(f"{report.not_selected_count} not selected")
    if report.nonfinite_tensors:
        parts.append(f"{len(report.nonfinite_tensors)} with NaN/Inf")
    sep = f"  {symbols.dot}  "
    text.append(sep + sep.join(parts))
    parts = [f"{human_bytes(report.bytes_read)} read"]
    if report.bytes_written:
        parts.append(f"{human_bytes(report.bytes_written)} written")
    parts.append(f"{report.elapsed_s:.3f} s")
    if report.elapsed_s > 0 and report.bytes_read:
        parts.append(f"{human_bytes(report.bytes_read / report.elapsed_s)}/s")
    return [text, Text(sep.join(parts), style="dim")]


def file_title(report: FileReport, symbols: Symbols = UNICODE) -> Text:
    """'input → output' on one line; paths are never folded, so they can be copied."""
    title = Text(safe(report.file), style="bold")
    if report.output:
        title.append(f" {symbols.arrow} {safe(report.output)}")
    elif report.dry_run:
        title.append(f"  (dry run: {dry_run_outputs(report)}; nothing written)", style="italic")
    return title


def dry_run_outputs(report: FileReport) -> str:
    """What the real run would write, and which of it exists: in place replaces the input
    (no --force needed); else an output that exists needs --force (given or not)."""
    files = report.would_write_files
    count = len(files) if files is not None else 0
    if report.in_place:
        if files is None:
            return f"would replace {safe(report.would_write)} in place" if report.would_write else "would write nothing"
        what = f"{count} file(s)" + (" and the index" if report.would_write else "")
        return f"would replace {what} in place"
    if files is None:
        if not report.would_write:
            return "would write nothing"
        exists = ""
        if report.output_exists:
            exists = " (exists: --force replaces it)" if report.overwrite else " (exists: a real run needs --force)"
        if report.would_copy:  # a folder's model.safetensors takes the folder's other files along
            there = sum(bool(f["exists"]) for f in report.would_copy)
            need = "--force replaces them" if report.overwrite else "a real run needs --force"
            exists += f", and copy {len(report.would_copy)} other file(s) of its folder" + \
                (f" ({there} exist: {need})" if there else "")
        return f"would write {safe(report.would_write)}{exists}"
    copies = len(report.would_copy or [])
    if report.would_write:
        text = f"would write {safe(report.would_write)} and its {count} shard(s)"
        if copies:
            text += f", and copy {copies} other file(s) of its folder"
    elif count == 1:
        text = f"would write {safe(files[0]['output'])}"
    else:
        folders = {str(Path(f["output"]).parent) for f in files}
        text = f"would write {count} files" + (f" into {safe(folders.pop())}" if len(folders) == 1 else "")
    existing = report.outputs_existing
    if existing:
        total = count + bool(report.would_write) + copies
        need = "--force replaces them" if report.overwrite else "a real run needs --force"
        text += f" ({existing} of {total} exist: {need})" if total > 1 else \
            (" (exists: --force replaces it)" if report.overwrite else " (exists: a real run needs --force)")
    return text


def render_file(report: FileReport, console: Console, *, width: int | None = -1, sort: str = "order",
                top: int | None = None, stats: bool = False) -> None:
    """The report of one file; ``width`` -1: the console's, None: unlimited."""
    symbols = symbols_for(console)
    fit = console.width if width == -1 else width
    lines = [file_title(report, symbols)]
    gave_way: list[str] = []
    shown: list[TensorReport] = []
    table, left_out = file_lines(report, fit, symbols, sort=sort, top=top, stats=stats, gave_way=gave_way,
                                 shown=shown)
    lines += table
    if left_out:
        lines.append(Text(f"{left_out} more tensor(s) not shown (--top {top})", style="dim"))
    if gave_way and fit is not None:
        lines.append(gave_way_line(gave_way, fit))
    lines += skipped_lines(report, symbols)
    lines += slice_lines(report, shown if top is not None else None)
    lines += tie_lines(report.tensors)
    lines += copy_lines(report)
    lines += file_summary(report, symbols)
    print_lines(console, lines)
    console.print()


def copy_lines(report: FileReport) -> list[Text]:
    """A set written to an output folder: in a dry run the outputs that exist already;
    the folder's other files copied with it, and those left out (a few names each;
    JSON lists them all)."""
    lines = []
    if report.dry_run and not report.in_place and report.outputs_existing and report.would_write_files is not None:
        existing = [f["output"] for f in [*report.would_write_files, *(report.would_copy or [])] if f["exists"]]
        if report.would_write and report.output_exists:
            existing.append(report.would_write)
        lines.append(Text(f"exist already: {name_list([safe(n) for n in existing], 3)}", style="dim"))
    if report.copied:
        lines.append(Text(f"copied {len(report.copied)} other file(s) of the checkpoint's folder: "
                          f"{name_list([safe(n) for n in report.copied], 4)}", style="dim"))
    if report.not_copied and (report.copied is not None or report.would_copy is not None):
        reasons: dict[str, list[str]] = {}
        for item in report.not_copied:
            reasons.setdefault(item["reason"], []).append(safe(item["name"]))
        lines.append(Text("not copied: " + "; ".join(f"{name_list(names, 3)} ({why})" for why, names in reasons.items()),
                          style="dim"))
    return lines


def gave_way_line(headers: Sequence[str], width: int) -> Text:
    """The dim line saying which columns the width left out (they never vanish silently),
    within the width when it can be."""
    unique = list(dict.fromkeys(headers))
    for limit in range(len(unique), 0, -1):
        text = f"left out at {width} columns: {name_list(unique, limit)} (a pipe shows all)"
        if len(text) <= width:
            break
    return Text(text, style="dim")


def render_summary(ok: int, failed: Sequence[str], console: Console) -> None:
    if ok + len(failed) > 1:
        text = Text(f"{ok + len(failed)} files: {ok} ok", style="bold")
        if failed:
            text.append(f", {len(failed)} failed ({name_list([safe(f) for f in failed[:3]], total=len(failed))})",
                        style="bold red")
        print_lines(console, [text])
