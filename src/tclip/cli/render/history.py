"""``report --summary --of grads|drift`` as tables: one row per checkpoint, then the cells
farthest from their tensor's median (a spike, a slow drift of one layer, a small layer
gone wild: what the global sparkline averages away)."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.text import Text

from ...text import fmt_column, safe
from ...work.history import Grid, departures, row_medians
from .report import gave_way_line
from .table import Column, lay_out, name_floor, print_lines, shorten_names, symbols_for, trend_sparkline

_WHAT = {"grads": "gradient norm over each interval (from Adam's exp_avg_sq)",
         "drift": "relative change ||W_t - W_t-1|| / ||W_t-1||",
         "norms": "tensor norm"}


def render_grid_summary(grid: Grid, labels: dict[str, str], console: Console, width: int | None, *,
                        top: int = 10) -> None:
    symbols = symbols_for(console)
    if not grid.columns or not grid.rows:
        return  # nothing measured: the warnings say why
    medians = row_medians(grid)
    # per column: the tensor farthest from its row's median, and a global figure
    unusual: list[tuple[str | None, float | None, float | None]] = []
    totals: list[float | None] = []
    for c in range(len(grid.columns)):
        best: tuple[float, str, float, float | None] | None = None
        squares = []
        for r, row in enumerate(grid.values):
            v = row[c]
            if v is None:
                continue
            squares.append(v * v if grid.quantity == "grads" else v)
            m = medians[r]
            score = math.inf if not math.isfinite(v) else (abs(math.log(v / m)) if m and v > 0 else 0.0)
            if best is None or score > best[0]:
                best = (score, grid.rows[r], v, (v / m) if m and math.isfinite(v) else None)
        unusual.append((best[1], best[2], best[3]) if best else (None, None, None))
        if not squares:
            totals.append(None)
        elif grid.quantity == "grads":
            totals.append(math.sqrt(math.fsum(squares)))
        else:
            totals.append(max(squares))
    total_header = "all tensors" if grid.quantity == "grads" else "largest"
    # an empty column (drift's first file, a checkpoint without state) is a blank, not NaN's '!'
    spark = [" " if t is None else ch for t, ch in zip(totals, trend_sparkline(totals, symbols))]
    lines = [Text(f"{len(grid.columns)} checkpoints, {_WHAT[grid.quantity]}: {''.join(spark)}", style="bold")]
    shown = [n or symbols.dash for n, _, _ in unusual]
    room = None if width is None else max(16, width - 60, name_floor(shown, symbols.ellipsis))
    names = shorten_names(shown, room, symbols.ellipsis)
    columns = []
    if grid.quantity == "grads":
        columns.append(Column("step", "step", [Text(_step(s, symbols.dash)) for s in grid.steps], "right"))
    columns += [
        Column("total", total_header, [Text(x) for x in fmt_column(totals, symbols.dash)], "right"),
        Column("trend", "", [Text(x, style="cyan") for x in spark], drop=0),
        Column("unusual", "most unusual tensor", [Text(safe(names[n])) for n in shown]),
        Column("value", "its value", [Text(x) for x in fmt_column([v for _, v, _ in unusual], symbols.dash)],
               "right", drop=2),
        Column("ratio", f"{symbols.times} median", [Text(_ratio(x, symbols)) for _, _, x in unusual], "right",
               drop=1),
    ]
    gave_way: list[str] = []
    lines += lay_out([safe(labels.get(c, c)) for c in grid.columns], columns, width, symbols,
                     name_header="checkpoint", gave_way=gave_way)
    cells = departures(grid, top)
    if cells:
        lines += [Text(""), Text("farthest from their tensor's median", style="bold")]
        cols = [
            Column("where", "checkpoint", [Text(safe(labels.get(c["column"], c["column"]))) for c in cells]),
            Column("value", "value", [Text(x) for x in fmt_column([c["value"] for c in cells], symbols.dash)],
                   "right"),
            Column("median", "median", [Text(x) for x in fmt_column([c["median"] for c in cells], symbols.dash)],
                   "right", drop=1),
            Column("ratio", symbols.times, [Text(_ratio(c["ratio"], symbols),
                                                 style="bold red" if not math.isfinite(c["value"]) else "")
                                            for c in cells], "right"),
        ]
        lines += lay_out([c["tensor"] for c in cells], cols, width, symbols, gave_way=gave_way)
    if gave_way and width is not None:
        lines.append(gave_way_line(gave_way, width))
    print_lines(console, lines)
    console.print()


def _step(step: float | None, dash: str) -> str:
    if step is None:
        return dash
    return str(int(step)) if step == int(step) else f"{step:g}"


def _ratio(ratio: Any, symbols: Any) -> str:
    if ratio is None:
        return symbols.dash
    if isinstance(ratio, float) and math.isnan(ratio):
        return "NaN/Inf"
    return f"{symbols.times}{ratio:.3g}"
