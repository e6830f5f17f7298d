"""Tables for people: the layout every rendering shares, fitted to the terminal's width.

JSON output does not come through here. Tables are laid out here, not by rich's Table, because the rules are ours:

- a tensor name is shown whole whenever the width allows; other columns give
  way first (the bar shrinks, then goes; dtypes are abbreviated; then the
  least important columns go); NaN/Inf is never dropped;
- when a name must be shortened, the parts that tell tensors apart stay (the
  last segment, every segment holding a digit, segments that differ between
  names), and no two different names ever render alike;
- output that is not a terminal is never cut (the CLI gives such a console an
  unlimited width);
- text from files is data: shown literally, control characters escaped.

Each line is a rich ``Text`` (styles only, no markup is ever parsed).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from rich.console import Console
from rich.text import Text

from ...core.dtypes import is_big_endian
from ...text import bounded, safe

NAME_WIDTH = 40
BAR_WIDTH = 14
MIN_BAR_WIDTH = 6
MIN_NAME_WIDTH = 12
DECADES = 3  # the bar spans 10**-3 .. 10**3 times the threshold
GAP = 2


# --------------------------------------------------------------------------- symbols


@dataclass(frozen=True)
class Symbols:
    arrow: str = "→"
    times: str = "×"
    ellipsis: str = "…"
    dash: str = "—"
    dot: str = "·"
    block: str = "█"
    mark: str = "│"
    rule: str = "─"
    spark: str = "▁▂▃▄▅▆▇█"
    approx: str = "≈"


UNICODE = Symbols()
ASCII = Symbols("->", "x", "~", "-", ".", "#", "|", "-", " .:-=+*#", "~")


def symbols_for(console: Console) -> Symbols:
    """Unicode symbols where the output encoding can show them, ASCII otherwise."""
    encoding = (getattr(console, "encoding", None) or "utf-8").lower()
    try:
        "→×…—·█│─▁≈".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return ASCII
    return UNICODE


# --------------------------------------------------------------------------- names


_SEGMENTS = re.compile(r"([./:])")


def shorten_middle(name: str, width: int = NAME_WIDTH, ellipsis: str = "…") -> str:
    """``encoder.layers.11.attention.output.dense.weight`` -> ``encoder.layers.1…output.dense.weight``."""
    if len(name) <= width:
        return name
    keep = width - len(ellipsis)
    head = keep * 2 // 5
    return name[:head] + ellipsis + name[len(name) - (keep - head):]


def _split(name: str) -> tuple[list[str], list[str]]:
    parts = _SEGMENTS.split(name)
    return parts[0::2], parts[1::2]


def _render(segments: list[str], separators: list[str], shown: set[int], ellipsis: str) -> str:
    out, hidden = "", False
    for i, segment in enumerate(segments):
        if i in shown:
            if i and not hidden and (i - 1) in shown:
                out += separators[i - 1]
            elif i and hidden:
                pass
            out += segment
            hidden = False
        else:
            if not hidden:
                if out and (i - 1) in shown:
                    out += separators[i - 1]
                out += ellipsis
            hidden = True
    return out


def _anchored(segments: list[str], shown: set[int]) -> set[int]:
    """``shown`` with the segment before each shown number (``layers`` of ``layers.7``): an
    ellipsis right before a number would read as part of it (``…7`` may be ``17``)."""
    out = set(shown)
    for i in sorted(shown, reverse=True):
        while i > 0 and segments[i][:1].isdigit() and (i - 1) not in out:
            out.add(i - 1)
            i -= 1
    return out


def _tail(name: str, width: int, ellipsis: str) -> str:
    """The end of ``name`` after an ellipsis, never starting inside a number or at a separator."""
    start = len(name) - (width - len(ellipsis))
    while start < len(name) and (name[start].isdigit() or name[start] in "./:"):
        start += 1
    return ellipsis + name[start:] if start < len(name) else name


def abbreviate(name: str, width: int, prefer: Sequence[int] = (), ellipsis: str = "…") -> str:
    """``name`` in at most ``width`` characters, keeping what tells it apart.

    Segments (split at ``.``, ``/``, ``:``) are revealed in this order: those in
    ``prefer`` (indices that differ from similar names), the last one, every
    segment holding a digit, the one before the last, the one before each
    numbered segment, the first, then the rest from the end; one that does not fit is
    passed over. Hidden runs become ``…``, never right before a number (the segment
    before it is shown with it: ``…layers.7.``, not ``…7.``, which reads as 17). When
    not even the last segment fits, the end of the name is kept, never cut inside a number.
    """
    if len(name) <= width:
        return name
    segments, separators = _split(name)
    n = len(segments)
    order: list[int] = []
    for i in [*prefer, n - 1, *[i for i, s in enumerate(segments) if any(c.isdigit() for c in s)], n - 2,
              *[i - 1 for i, s in enumerate(segments) if any(c.isdigit() for c in s)], 0,
              *range(n - 1, -1, -1)]:
        if 0 <= i < n and i not in order:
            order.append(i)
    shown: set[int] = set()
    best = None
    for i in order:
        wanted = _anchored(segments, shown | {i})
        candidate = _render(segments, separators, wanted, ellipsis)
        if len(candidate) <= width:
            shown = wanted
            best = candidate
    if best is not None and n - 1 in shown:
        return best
    return _tail(name, width, ellipsis) if width > len(ellipsis) else name[:width]


def essential(name: str, ellipsis: str = "…") -> str:
    """The shortest form :func:`abbreviate` ever gives ``name``: its last segment, every
    numbered segment (``17``, with the one before it: ``layers.17``) and the one before the
    last (``k_proj``) -- what tells a tensor apart from its neighbours -- so
    ``…layers.17.…k_proj.weight``. A column is never narrower than this (see :func:`name_floor`)."""
    segments, separators = _split(name)
    n = len(segments)
    shown = {i for i in (n - 1, n - 2, *[i for i, s in enumerate(segments) if any(c.isdigit() for c in s)])
             if 0 <= i < n}
    short = _render(segments, separators, _anchored(segments, shown), ellipsis)
    return short if len(short) < len(name) else name


def name_floor(names: Sequence[str], ellipsis: str = "…") -> int:
    """The narrowest a column of ``names`` may be: the widest of their essential forms."""
    return max((len(essential(n, ellipsis)) for n in names), default=0)


def shorten_names(names: Sequence[str], width: int | None, ellipsis: str = "…") -> dict[str, str]:
    """How each name is shown in a column of ``width`` (None: unlimited); never two alike,
    unless two are alike once a name past :data:`~tclip.text.LONG_TEXT` characters is
    shortened (:func:`~tclip.text.bounded`: a layout never works through millions of them)."""
    if width is None:
        return {n: bounded(n) for n in names}
    shown = {n: abbreviate(bounded(n), width, ellipsis=ellipsis) for n in names}
    for _ in range(4):
        groups: dict[str, list[str]] = {}
        for name, text in shown.items():
            groups.setdefault(text, []).append(name)
        clashes = [group for group in groups.values() if len(set(group)) > 1]
        if not clashes:
            return shown
        for group in clashes:
            split = [_split(bounded(n))[0] for n in group]
            longest = max(len(s) for s in split)
            differing = []
            for back in range(1, longest + 1):  # aligned from the end
                values = {s[-back] if back <= len(s) else None for s in split}
                if len(values) > 1:
                    differing.append(back)
            for name, segments in zip(group, split):
                prefer = [len(segments) - back for back in differing if back <= len(segments)]
                shown[name] = abbreviate(bounded(name), width, prefer, ellipsis)
    groups = {}
    for name, text in shown.items():
        groups.setdefault(text, []).append(name)
    for group in groups.values():
        if len(set(group)) > 1:
            for name in group:
                shown[name] = bounded(name)  # whole, even past the width: never ambiguous
    return shown


# --------------------------------------------------------------------------- numbers


def human_bytes(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def sparkline(values: Sequence[float], symbols: Symbols) -> str:
    """One character per value, scaled from the smallest to the largest (log scale when it spans decades)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return "".join("!" for _ in values)
    low, high = min(finite), max(finite)
    use_log = low > 0 and high / low > 100
    if use_log:
        low, high = math.log10(low), math.log10(high)
    levels = symbols.spark
    out = []
    for v in values:
        if v is None or not math.isfinite(v):
            out.append("!")
            continue
        x = math.log10(v) if use_log and v > 0 else v
        level = 0 if high == low else round((x - low) / (high - low) * (len(levels) - 1))
        out.append(levels[max(0, min(len(levels) - 1, level))])
    return "".join(out)


# A value within this fraction of the median draws the baseline: noise of a few percent
# between steps looks flat, so that what is drawn higher is a real change.
DEAD_BAND = 0.10
# The full block is at least this many decades above the median (more when the largest
# value is further up): a rise of 2x draws a low bump, 10x a full block.
TREND_DECADES = 1.0


def trend_sparkline(values: Sequence[float | None], symbols: Symbols) -> str:
    """One character per value, on a log scale relative to the median of the finite
    positive values: within ±10% of the median the baseline (the second level), lower
    the lowest level, higher up to the full block at max(10x the median, the largest
    value); NaN/Inf ``!``. So ±3% noise is flat and a spike stands out (README: summary)."""
    levels = symbols.spark
    finite = sorted(v for v in values if v is not None and math.isfinite(v) and v > 0)
    if not finite:
        return "".join("!" if v is None or not math.isfinite(v) else levels[0] for v in values)
    middle = len(finite) // 2
    median = finite[middle] if len(finite) % 2 else (finite[middle - 1] + finite[middle]) / 2
    band = math.log10(1 + DEAD_BAND)
    top = max(math.log10(finite[-1]) - math.log10(median), TREND_DECADES)
    steps = len(levels) - 2  # the levels above the baseline
    out = []
    for v in values:
        if v is None or not math.isfinite(v):
            out.append("!")
            continue
        if v <= 0:
            out.append(levels[0])
            continue
        rise = math.log10(v) - math.log10(median)  # a difference of logs: no overflow for subnormals
        if rise < -band:
            out.append(levels[0])
        elif rise <= band:
            out.append(levels[1])
        else:
            out.append(levels[2 + min(steps - 1, int((rise - band) / (top - band) * steps))])
    return "".join(out)


def norm_bar(norm: float | None, threshold: float | None, highlight: bool, *, relative: bool = False,
             width: int = BAR_WIDTH, symbols: Symbols = UNICODE) -> Text:
    """A log-scale bar of ``norm``.

    Against a threshold (``relative`` False) the mark in the middle is the limit
    and the bar spans 10**-3 .. 10**3 times it; the part past the mark is red when
    ``highlight`` (the tensor was clipped), yellow otherwise. With ``relative``,
    ``threshold`` is the largest norm in the file and fills the whole bar.
    """
    if norm is None or threshold is None or threshold <= 0 or math.isinf(threshold):
        return Text("")
    if math.isnan(norm):
        return Text("NaN".center(width), style="bold magenta")
    half = width // 2
    if norm <= 0:
        filled = 0
    elif math.isinf(norm):
        filled = width
    else:
        # A difference of logarithms, not the log of a ratio: norm / threshold overflows
        # to inf for a threshold of 1e-320 (a subnormal), and round(inf) raises.
        decades = math.log10(norm) - math.log10(threshold)
        if relative:
            filled = max(0, min(width, round(width * (1 + decades / (2 * DECADES)))))
        else:
            filled = max(0, min(width, round(half + half * decades / DECADES)))
    bar = Text()
    for i in range(width):
        if i < filled:
            past = not relative and i >= half
            bar.append(symbols.block, style=("bold red" if highlight else "yellow") if past else "green")
        elif i == half and not relative:
            bar.append(symbols.mark, style="dim")
        else:
            bar.append(symbols.dot, style="dim")
    return bar


# --------------------------------------------------------------------------- tables


@dataclass
class Column:
    """A table column; ``drop`` orders which go first when space runs out (lower: sooner; None: never)."""

    key: str
    header: str
    cells: list[Text]
    justify: str = "left"
    drop: int | None = None
    short_cells: list[Text] | None = None  # a narrower form (abbreviated dtypes)
    bar: bool = False

    @property
    def width(self) -> int:
        return max([len(self.header)] + [c.cell_len for c in self.cells])


def _table_lines(names: list[str], shown: dict[str, str], name_width: int, name_header: str, cols: list[Column],
                 use_short: set[str], bar_cells: list[Text] | None, bar_header: str, bar_width: int,
                 symbols: Symbols, row_styles: list[str | None] | None) -> list[Text]:
    """:func:`lay_out`'s header, rule and rows, once it has settled the columns and widths."""
    col_cells = [c.short_cells if c.key in use_short and c.short_cells is not None else c.cells for c in cols]
    widths = [max([len(c.header)] + [x.cell_len for x in cells]) for c, cells in zip(cols, col_cells)]
    header = Text(name_header.ljust(name_width), style="bold")
    for c, w in zip(cols, widths):
        header.append(" " * GAP)
        header.append(c.header.rjust(w) if c.justify == "right" else c.header.ljust(w), style="bold")
    if bar_cells is not None:
        header.append(" " * GAP)
        header.append(bar_header, style="bold")
    table_width = name_width + sum(GAP + w for w in widths) + (GAP + bar_width if bar_cells is not None else 0)
    header.rstrip()
    lines = [header]
    lines.append(Text(symbols.rule * max(table_width, header.cell_len), style="dim"))
    for row, name in enumerate(names):
        line = Text(safe(shown[name]).ljust(name_width))
        for c, cells, w in zip(cols, col_cells, widths):
            cell = cells[row]
            pad = " " * max(0, w - cell.cell_len)
            line.append(" " * GAP)
            line.append_text(Text(pad) + cell if c.justify == "right" else cell + Text(pad))
        if bar_cells is not None:
            line.append(" " * GAP)
            line.append_text(bar_cells[row])
        line.rstrip()
        style = row_styles[row] if row_styles is not None else None
        if style:
            line.stylize(style)
        lines.append(line)
    return lines


def lay_out(names: list[str], columns: list[Column], width: int | None, symbols: Symbols,
            bar: Callable[[int], list[Text]] | None = None, bar_header: str = "", name_header: str = "tensor",
            row_styles: list[str | None] | None = None, gave_way: list[str] | None = None) -> list[Text]:
    """Fit the name column and ``columns`` (plus an optional bar) into ``width`` (None: unlimited).

    The names are never cut below what tells them apart (:func:`name_floor`), even if the
    line then runs past ``width``. ``gave_way`` receives the headers of the columns left out
    (for a line saying so: a column never vanishes without a word)."""
    names = [bounded(n) for n in names]  # (rows are by position: a name's shortened form stands for it)
    full = max([len(name_header)] + [len(n) for n in names])
    bar_width = BAR_WIDTH if bar is not None else 0
    cols = list(columns)
    use_short: set[str] = set()

    def total(name_width: int) -> int:
        widths = [name_width] + [c.width if c.key not in use_short or c.short_cells is None
                                 else max([len(c.header)] + [x.cell_len for x in c.short_cells]) for c in cols]
        if bar_width:
            widths.append(max(bar_width, len(bar_header)))
        return sum(widths) + GAP * (len(widths) - 1)

    name_width = full
    if width is not None and total(name_width) > width:
        # Other columns give way before the name: the bar shrinks, then goes; dtypes are
        # abbreviated; then the least important columns go; only then is the name shortened.
        while total(name_width) > width and bar_width > MIN_BAR_WIDTH:
            bar_width -= 1
        if total(name_width) > width:
            bar_width = 0
        for c in cols:
            if total(name_width) > width and c.short_cells is not None:
                use_short.add(c.key)
        dropped = []
        for c in sorted([c for c in cols if c.drop is not None], key=lambda c: c.drop or 0):
            if total(name_width) <= width:
                break
            cols.remove(c)
            dropped.append(c)
        if total(name_width) > width:
            floor = min(full, max(MIN_NAME_WIDTH, name_floor(names, symbols.ellipsis)))
            name_width = max(floor, name_width - (total(name_width) - width))
        else:
            for c in reversed(dropped):  # a column dropped too eagerly comes back if it fits
                position = columns.index(c)
                cols.insert(sum(1 for x in cols if columns.index(x) < position), c)
                if total(name_width) > width:
                    cols.remove(c)
        if bar is not None and not bar_width and name_width == full:
            room = width - total(name_width) - GAP
            if room >= max(MIN_BAR_WIDTH, len(bar_header)):
                bar_width = min(BAR_WIDTH, room)
    if gave_way is not None:
        # Columns with a header (a sparkline column without one is only decoration).
        gave_way += [c.header for c in columns if c.header and all(c is not kept for kept in cols)]
    shown = shorten_names(names, name_width if name_width < full else None, symbols.ellipsis)
    name_width = max([len(name_header)] + [len(s) for s in shown.values()])
    bar_cells = bar(bar_width) if bar is not None and bar_width else None

    return _table_lines(names, shown, name_width, name_header, cols, use_short, bar_cells, bar_header, bar_width,
                        symbols, row_styles)


# --------------------------------------------------------------------------- the file report


_SHORT_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int64": "i64",
                 "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "bool", "complex64": "c64"}


def short_dtype(dtype: np.dtype | None, label: str | None = None) -> str:
    """A dtype in a few characters (``f32``, ``bf16``, ``f8e4m3fn``, ``f32>`` big-endian); a label as it is."""
    if label is not None or dtype is None:
        return label or ""
    name = dtype.name
    if is_big_endian(dtype):
        return name.replace("float8_", "f8").replace("float", "f") + ">"
    return _SHORT_DTYPES.get(name) or name.replace("float8_", "f8").replace("float", "f")


def print_lines(console: Console, lines: Sequence[Text]) -> None:
    """Print lines as they are: never folded, never cropped (the layout fitted them already)."""
    for line in lines:
        console.print(line, soft_wrap=True, markup=False, highlight=False, emoji=False)
