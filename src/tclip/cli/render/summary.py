"""``tclip report --summary``: at which step, which layer -- one row per file, then what changed most.

Files come in natural order (``step_9`` before ``step_10``; ``--sort order``: as given,
``--sort norm``: largest global norm first), labelled by the part of their paths that
differs (``checkpoint-700``). Each row gives the file's global norm, its largest tensor,
NaN/Inf counts; a sparkline shows the global norm across the files (scaled around the
median, so noise is flat: :func:`~tclip.cli.render.table.trend_sparkline`); then the
tensors whose norm changed most between consecutive files (by the factor of change,
NaN/Inf appearing first).
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.text import Text

from ...text import fmt_column, safe
from ...work.results import FileReport
from ...work.summary import (
    TOP_CHANGES,
    changes,
    consecutive,
    file_labels,
    in_row_order,
    in_step_order,
    largest_tensor,
)
from .report import gave_way_line
from .table import Column, lay_out, name_floor, print_lines, shorten_names, symbols_for, trend_sparkline


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
    gave_way: list[str] = []
    lines = [Text(f"{len(steps)} files, global norm {spark}", style="bold")]
    lines += lay_out([safe(labels[r.file]) for r in rows], columns, width, symbols, name_header="file",
                     gave_way=gave_way)
    moves = []
    before = consecutive(steps)
    for previous, current in ((before[id(r)], r) for r in steps):
        if previous is None:
            continue
        for change in changes(previous, current, top):
            moves.append((change, previous.file, current.file))
    moves.sort(key=lambda m: (not m[0]["nonfinite_appeared"],
                              -abs(math.log(m[0]["ratio"])) if m[0]["ratio"] and math.isfinite(m[0]["ratio"])
                              and m[0]["ratio"] > 0 else -math.inf))
    moves = moves[:top]
    if moves:
        lines.append(Text(""))
        lines.append(Text("largest changes between consecutive files", style="bold"))
        cols = [
            Column("where", "between", [Text(f"{safe(labels[a])} {symbols.arrow} {safe(labels[b])}")
                                        for _, a, b in moves]),
            Column("before", "before", [Text(x) for x in fmt_column([c["norm_before"] for c, _, _ in moves])],
                   "right", drop=1),
            Column("after", "after", [Text(x) for x in fmt_column([c["norm_after"] for c, _, _ in moves])], "right",
                   drop=2),
            Column("ratio", "change", [Text(_ratio(c, symbols.times),
                                            style="bold red" if c["nonfinite_appeared"] else None)
                                       for c, _, _ in moves], "right"),
        ]
        lines += lay_out([c["name"] for c, _, _ in moves], cols, width, symbols, gave_way=gave_way)
    if gave_way and width is not None:
        lines.append(gave_way_line(gave_way, width))
    print_lines(console, lines)
    console.print()


def _ratio(change: dict[str, Any], times: str) -> str:
    if change["nonfinite_appeared"]:
        return "NaN/Inf"
    ratio = change["ratio"]
    if not math.isfinite(ratio):
        if ratio == math.inf:
            return "from 0"
        return "NaN/Inf gone" if not math.isfinite(change["norm_before"]) else "nan"
    return f"{times}{ratio:.3g}"

