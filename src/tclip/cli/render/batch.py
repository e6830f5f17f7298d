"""A clipping command's ``--summary``: one line per file for batch runs.

Twelve step files of a 219-tensor model make a table of twelve rows (global norm
before and after, tensors clipped and skipped, tensors holding NaN/Inf, the output)
instead of twelve tables of 219 rows; files are labelled by the part of their paths
that differs (``step_700``, ``checkpoint-700``)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.text import Text

from ...text import fmt_column, safe
from ...work.inputs import default_output
from ...work.results import FileReport
from ...work.summary import file_labels
from .report import gave_way_line
from .table import Column, lay_out, print_lines, symbols_for


def _output(report: FileReport) -> str | None:
    return report.output if report.output else report.would_write


def _output_text(report: FileReport) -> str:
    """The output as written: its name alone beside its input, else its path."""
    output = _output(report)
    if not output:
        return ""
    same_folder = Path(output).parent == Path(report.file).parent
    return Path(output).name if same_folder else output


def _where_outputs_go(reports: list[FileReport]) -> str | None:
    """One phrase for the outputs when they follow one rule (then no column lists them)."""
    pairs = [(Path(r.file), _output(r)) for r in reports]
    if any(out is None for _, out in pairs):
        return None
    outputs = [(source, Path(out)) for source, out in pairs if out is not None]  # (all of them: see above)
    if all(out == source for source, out in outputs):
        return "in place"
    if all(out.parent == source.parent and out.name == default_output(source).name for source, out in outputs):
        return "each beside its input as NAME.clipped.EXT"
    folders = {out.parent for _, out in outputs}
    if len(folders) == 1 and all(out.name == source.name for source, out in outputs):
        return f"into {safe(folders.pop())} under the same names"
    return None


def render_batch(reports: list[FileReport], console: Console, width: int | None) -> None:
    symbols = symbols_for(console)
    labels = file_labels([r.file for r in reports])
    dash = symbols.dash
    before = fmt_column([r.global_norm for r in reports], dash)
    after = fmt_column([r.global_norm_after for r in reports], dash)
    dry = all(r.dry_run for r in reports)
    columns = [
        Column("before", "global norm", [Text(x) for x in before], "right"),
        Column("after", "after", [Text(x) for x in after], "right", drop=3),
        Column("clipped", "clipped", [Text(f"{r.clipped_count:,}", style="bold red" if r.clipped_count else "dim")
                                      for r in reports], "right"),
        Column("skipped", "skipped", [Text(f"{r.skipped_count:,}", style="" if r.skipped_count else "dim")
                                      for r in reports], "right", drop=2),
        Column("nonfinite", "NaN/Inf", [Text(f"{len(r.nonfinite_tensors):,}",
                                             style="bold magenta" if r.nonfinite_tensors else "dim")
                                        for r in reports], "right"),
    ]
    where = _where_outputs_go(reports)
    if where is None:
        columns.append(Column("output", "would write" if dry else "output",
                              [Text(safe(_output_text(r))) for r in reports], drop=1))
    title = f"{len(reports)} file{'s' if len(reports) != 1 else ''}"
    if dry:
        title += f" (dry run: nothing written{'; would write ' + where if where else ''})"
    elif where:
        title += f", written {where}"
    gave_way: list[str] = []
    lines = [Text(title, style="bold")]
    lines += lay_out([safe(labels[r.file]) for r in reports], columns, width, symbols, name_header="file",
                     gave_way=gave_way)
    if gave_way and width is not None:
        lines.append(gave_way_line(gave_way, width))
    print_lines(console, lines)
