"""``report --summary --heatmap``: the tensors x checkpoints grid in the terminal.

One character per cell, its height the value relative to the row's median (log scale,
as the pictures: :mod:`.cells`), coloured where the console has colour; ``!`` NaN/Inf,
a blank where a tensor has no value. Checkpoints beyond the width are binned: a bin
shows its cell farthest from the median (NaN/Inf first), so no spike is averaged away.
With NO_COLOR or into a pipe the characters alone are written, never an escape.
"""

from __future__ import annotations

import math

import numpy as np
from rich.console import Console
from rich.text import Text

from ...text import safe
from ...work.history import Grid
from .cells import colour_at, ratio_text, row_order, shades
from .table import print_lines, shorten_names, symbols_for

UNICODE_RAMP = "▁▂▃▄▅▆▇█"
ASCII_RAMP = "_.,-=+*#"
PIPE_WIDTH = 120  # output that is not a terminal is never cut, but a heatmap needs some width


def bins(columns: int, room: int) -> list[range]:
    """Contiguous groups of columns, at most ``room`` of them."""
    count = max(1, min(columns, room))
    edges = [round(i * columns / count) for i in range(count + 1)]
    return [range(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def render_heatmap(grid: Grid, labels: list[str], console: Console, width: int | None) -> None:
    symbols = symbols_for(console)
    ramp = UNICODE_RAMP if symbols.block == "█" else ASCII_RAMP
    order = row_order(grid.rows)
    if not order or not grid.columns:
        return
    values = grid.array()[order]
    present = grid.present()[order]
    s = shades(values, present)
    names = [grid.rows[i] for i in order]
    total = width or PIPE_WIDTH
    name_room = max(12, min(40, total // 3, max(len(n) for n in names)))
    short = shorten_names(names, name_room, symbols.ellipsis)
    name_width = max(len(short[n]) for n in names)
    groups = bins(len(grid.columns), max(1, total - name_width - 2))
    lines = [Text(f"{len(names)} tensors x {len(grid.columns)} checkpoints"
                  + (f" in {len(groups)} bins (each its cell farthest from the median)"
                     if len(groups) < len(grid.columns) else "")
                  + f"; height: value / row median, {ratio_text(-1, s.span)} to {ratio_text(1, s.span)}; "
                    "! NaN/Inf", style="bold")]
    for r, name in enumerate(names):
        line = Text(safe(short[name]).ljust(name_width) + "  ")
        for group in groups:
            line.append(*_cell(s.level[r, group.start:group.stop], s.nonfinite[r, group.start:group.stop],
                               s.missing[r, group.start:group.stop], ramp))
        lines.append(line)
    first, last = safe(labels[0]), safe(labels[-1])
    axis = " " * (name_width + 2) + first
    room = name_width + 2 + len(groups) - len(axis) - len(last)
    if len(groups) > 1 and room >= 1:
        axis += " " * room + last
    lines.append(Text(axis, style="dim"))
    print_lines(console, lines)
    console.print()


def _cell(level: np.ndarray, nonfinite: np.ndarray, missing: np.ndarray, ramp: str) -> tuple[str, str]:
    """The character and style of one bin."""
    if nonfinite.any():
        return "!", "bold white on black"
    shown = level[~missing]
    if not shown.size:
        return " ", ""
    pick = float(shown[int(np.argmax(np.abs(shown)))])
    if math.isnan(pick):
        pick = 0.0
    index = min(len(ramp) - 1, max(0, int(round((pick + 1) / 2 * (len(ramp) - 1)))))
    return ramp[index], "#%02x%02x%02x" % colour_at(pick)
