"""``tclip report --summary``: at which step, which layer -- one row per file, then what changed most.

Files come in natural order (``step_9`` before ``step_10``). Each row gives the
file's global norm, its largest tensor, NaN/Inf counts; a sparkline shows the
global norm across the files; then the tensors whose norm changed most between
consecutive files (by the factor of change, NaN/Inf appearing first).
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.text import Text

from ...text import fmt_column, safe
from ...work.results import FileReport
from ...work.summary import TOP_CHANGES, changes, in_natural_order, largest_tensor
from .table import Column, lay_out, print_lines, shorten_names, sparkline, symbols_for


def render_across_files(reports: list[FileReport], console: Console, width: int | None) -> None:
    symbols = symbols_for(console)
    ordered = in_natural_order(reports)
    if not ordered:
        return
    largest = [largest_tensor(r) for r in ordered]
    globals_ = [r.global_norm for r in ordered]
    spark = sparkline([g if g is not None else math.nan for g in globals_], symbols)
    stems = _stems([r.file for r in ordered])
    norms = fmt_column(globals_, symbols.dash)
    largest_norms = fmt_column([v for _, v in largest], symbols.dash)
    nonfinite = [f"{sum(t.nan for t in r.tensors)}/{sum(t.inf for t in r.tensors)}" if r.nonfinite_tensors else "0"
                 for r in ordered]
    # The largest tensor's name is what this view is for: it is shortened (never dropped)
    # to the room the other columns leave.
    fixed = (max(len(s) for s in stems.values()) + max(11, max(map(len, norms))) + 1
             + max(8, max(map(len, largest_norms))) + 7 + 2 * 5)
    room = None if width is None else max(16, width - fixed)
    names = shorten_names([n or symbols.dash for n, _ in largest], room, symbols.ellipsis)
    columns = [
        Column("global", "global norm", [Text(x) for x in norms], "right"),
        Column("trend", "", [Text(c, style="cyan") for c in spark], drop=0),
        Column("largest", "largest tensor", [Text(safe(names[n or symbols.dash])) for n, _ in largest]),
        Column("largest_norm", "its norm", [Text(x) for x in largest_norms], "right"),
        Column("nonfinite", "NaN/Inf", [Text(x, style="bold magenta" if x != "0" else "dim") for x in nonfinite],
               "right"),
    ]
    lines = [Text(f"{len(ordered)} files, global norm {spark}", style="bold")]
    lines += lay_out([stems[r.file] for r in ordered], columns, width, symbols, name_header="file")
    moves = []
    for previous, current in zip(ordered, ordered[1:]):
        for change in changes(previous, current):
            moves.append((change, previous.file, current.file))
    moves.sort(key=lambda m: (not m[0]["nonfinite_appeared"],
                              -abs(math.log(m[0]["ratio"])) if m[0]["ratio"] and math.isfinite(m[0]["ratio"])
                              and m[0]["ratio"] > 0 else -math.inf))
    moves = moves[:TOP_CHANGES]
    if moves:
        lines.append(Text(""))
        lines.append(Text("largest changes between consecutive files", style="bold"))
        cols = [
            Column("where", "between", [Text(f"{safe(stems[a])} {symbols.arrow} {safe(stems[b])}")
                                        for _, a, b in moves]),
            Column("before", "before", [Text(x) for x in fmt_column([c["norm_before"] for c, _, _ in moves])],
                   "right", drop=1),
            Column("after", "after", [Text(x) for x in fmt_column([c["norm_after"] for c, _, _ in moves])], "right",
                   drop=2),
            Column("ratio", "change", [Text(_ratio(c, symbols.times),
                                            style="bold red" if c["nonfinite_appeared"] else None)
                                       for c, _, _ in moves], "right"),
        ]
        lines += lay_out([c["name"] for c, _, _ in moves], cols, width, symbols)
    print_lines(console, lines)
    console.print()


def _stems(paths: list[str]) -> dict[str, str]:
    """File names without the folder and without a suffix they all share (``step_400``)."""
    names = {p: p.rsplit("/", 1)[-1] for p in paths}
    suffixes = {n[n.rfind("."):] if "." in n else "" for n in names.values()}
    if len(suffixes) == 1 and len(set(names.values())) == len(paths):
        suffix = suffixes.pop()
        names = {p: n[: len(n) - len(suffix)] if suffix else n for p, n in names.items()}
    if len(set(names.values())) != len(paths):
        return {p: p for p in paths}  # same names in different folders: the whole paths
    return names


def _ratio(change: dict[str, Any], times: str) -> str:
    if change["nonfinite_appeared"]:
        return "NaN/Inf"
    ratio = change["ratio"]
    if not math.isfinite(ratio):
        if ratio == math.inf:
            return "from 0"
        return "NaN/Inf gone" if not math.isfinite(change["norm_before"]) else "nan"
    return f"{times}{ratio:.3g}"

