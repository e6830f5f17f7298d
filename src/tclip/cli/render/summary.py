"""``tclip report --summary``: at which step, which layer -- one row per file, then what changed most.

Files come in natural order (``step_9`` before ``step_10``; ``--sort order``: as given,
``--sort norm``: largest global norm first), labelled by the part of their paths that
differs (``checkpoint-700``). Each row gives the file's global norm, its largest tensor,
NaN/Inf counts; a sparkline shows the global norm across the files (scaled around the
median, so noise is flat: :func:`~tclip.cli.render.table.trend_sparkline`); then the
tensors whose norm changed most between consecutive files (by the factor of change),
after a line for each file where NaN/Inf appeared in tensors or left them.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

from ...text import fmt_column, name_list, safe
from ...work.results import FileReport
from ...work.summary import (
    TOP_CHANGES,
    consecutive_pairs,
    file_labels,
    in_row_order,
    in_step_order,
    largest_changes,
    largest_tensor,
    nonfinite_events,
)
from .report import gave_way_line
from .table import (
    Column,
    Symbols,
    lay_out,
    name_floor,
    print_lines,
    shorten_names,
    symbols_for,
    trend_sparkline,
)

# How many tensors a line of NaN/Inf appearing names before "and N more" (JSON lists them all).
FEW = 3


def render_across_files(reports: list[FileReport], console: Console, width: int | None, *, sort: str = "name",
                        top: int = TOP_CHANGES) -> None:
    symbols = symbols_for(console)
    steps = in_step_order(reports, sort)
    if not steps:
        return
    rows = in_row_order(reports, sort)
    trend = dict(zip(map(id, steps), trend_sparkline([r.global_norm for r in steps], symbols)))
    spark = "".join(trend[id(r)] for r in steps)
    labels = file_labels([r.file for r in steps])
    largest = [largest_tensor(r) for r in rows]
    norms = fmt_column([r.global_norm for r in rows], symbols.dash)
    largest_norms = fmt_column([v for _, v in largest], symbols.dash)
    nonfinite = [f"{sum(t.nan for t in r.tensors)}/{sum(t.inf for t in r.tensors)}" if r.nonfinite_tensors else "0"
                 for r in rows]
    # The largest tensor's name is what this view is for: it is shortened to the room the
    # other columns leave, never below what tells it apart (layer number, projection).
    shown_names = [n or symbols.dash for n, _ in largest]
    fixed = (max(len(labels[r.file]) for r in rows) + max(11, max(map(len, norms))) + 1
             + max(8, max(map(len, largest_norms))) + 7 + 2 * 5)
    room = None if width is None else max(16, width - fixed, name_floor(shown_names, symbols.ellipsis))
    names = shorten_names(shown_names, room, symbols.ellipsis)
    columns = [
        Column("global", "global norm", [Text(x) for x in norms], "right"),
        Column("trend", "", [Text(trend[id(r)], style="cyan") for r in rows], drop=0),
        Column("largest", "largest tensor", [Text(safe(names[n])) for n in shown_names]),
        Column("largest_norm", "its norm", [Text(x) for x in largest_norms], "right", drop=1),
        Column("nonfinite", "NaN/Inf", [Text(x, style="bold magenta" if x != "0" else "dim") for x in nonfinite],
               "right"),
    ]
    if any(r.not_measured_count for r in rows):  # a global norm that leaves tensors out says so on its row
        columns.append(Column("unmeasured", "not measured",
                              [Text(f"{r.not_measured_count:,} of {r.measured_count + r.not_measured_count:,}",
                                    style="bold magenta" if r.not_measured_count else "dim") for r in rows],
                              "right"))
    gave_way: list[str] = []
    lines = [Text(f"{len(steps)} files, global norm {spark}", style="bold")]
    lines += lay_out([safe(labels[r.file]) for r in rows], columns, width, symbols, name_header="file",
                     gave_way=gave_way)
    moves = largest_changes(steps, top)
    events = nonfinite_lines(steps, labels, width, symbols)
    if moves or events:
        lines.append(Text(""))
        lines.append(Text("largest changes between consecutive files", style="bold"))
        lines += events
    if moves:
        cols = [
            Column("where", "between", [Text(f"{safe(labels[a])} {symbols.arrow} {safe(labels[b])}")
                                        for _, a, b in moves]),
            Column("before", "before", [Text(x) for x in fmt_column([c["norm_before"] for c, _, _ in moves])],
                   "right", drop=1),
            Column("after", "after", [Text(x) for x in fmt_column([c["norm_after"] for c, _, _ in moves])], "right",
                   drop=2),
            Column("ratio", "change", [Text(_ratio(c, symbols.times)) for c, _, _ in moves], "right"),
        ]
        lines += lay_out([c["name"] for c, _, _ in moves], cols, width, symbols, gave_way=gave_way)
    if gave_way and width is not None:
        lines.append(gave_way_line(gave_way, width))
    print_lines(console, lines)
    console.print()


def nonfinite_lines(steps: list[FileReport], labels: dict[str, str], width: int | None,
                   symbols: Symbols) -> list[Text]:
    """A line per file where NaN/Inf appeared in tensors (or left them): one event, however many
    tensors it touched, with a few of their names -- on a line of their own, indented, where
    the width leaves too little room beside the count for one whole name."""
    lines = []
    for previous, current in consecutive_pairs(steps):
        appeared, gone = nonfinite_events(previous, current)
        for names, what, style in ((appeared, "appeared in", "bold red"), (gone, "gone from", "green")):
            if not names:
                continue
            count = f"{len(names):,} tensors" if len(names) > 1 else "1 tensor"
            head = f"NaN/Inf {what} {count} at {safe(labels[current.file])}:"
            beside = _some_names(names, None if width is None else width - len(head) - 1)
            if beside is not None:
                lines.append(Text(f"{head} {beside}", style=style))
                continue
            room = max(1, (width or 0) - 2)
            below = _some_names(names, room)
            if below is None:  # not even one name whole: the first one shortened, never ambiguous
                more = f" and {len(names) - 1:,} more" if len(names) > 1 else ""
                below = safe(shorten_names([names[0]], max(1, room - len(more)), symbols.ellipsis)[names[0]]) + more
            lines += [Text(head, style=style), Text(f"  {below}", style=style)]
    return lines


def _some_names(names: list[str], room: int | None) -> str | None:
    """A few of ``names``, whole, as many as fit in ``room`` (None: unlimited), then how many
    more; None when not even the first one fits."""
    for limit in range(min(len(names), FEW), 0, -1):
        text = name_list([safe(n) for n in names], limit)
        if room is None or len(text) <= room:
            return text
    return None


def _ratio(change: dict[str, Any], times: str) -> str:
    """A change as a factor: ``×9,617``, ``×0.953``, with the digits that tell 1.003 from 1."""
    if change["kind"] == "from_zero":
        return "from 0"
    if change["kind"] == "to_zero":
        return "to 0"
    ratio = change["ratio"]
    if 1000 <= ratio < 1e6:
        return f"{times}{ratio:,.0f}"
    digits = 3
    while digits < 17 and float(f"{ratio:.{digits}g}") == 1.0:
        digits += 1
    return f"{times}{ratio:.{digits}g}"
