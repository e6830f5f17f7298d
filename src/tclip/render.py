"""The rendering of reports for people. JSON output does not come through here.

Tables are laid out here, not by rich's Table, because the rules are ours:

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
from typing import Any

from rich.console import Console
from rich.text import Text

from .work.results import FileReport, InfoReport, TensorReport, slice_label
from .text import fmt_column, fmt_number, natural_key, safe, show_value

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


def abbreviate(name: str, width: int, prefer: Sequence[int] = (), ellipsis: str = "…") -> str:
    """``name`` in at most ``width`` characters, keeping what tells it apart.

    Segments (split at ``.``, ``/``, ``:``) are revealed in this order: those in
    ``prefer`` (indices that differ from similar names), the last one, every
    segment holding a digit, the one before the last, the one before each
    numbered segment, the first, then the rest from the end. Hidden runs
    become ``…``. When even the first choices do not fit, the end of the name is kept.
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
        candidate = _render(segments, separators, shown | {i}, ellipsis)
        if len(candidate) <= width:
            shown.add(i)
            best = candidate
        elif best is None:
            break
    if best is not None and len(best) <= width:
        return best
    return ellipsis + name[len(name) - (width - len(ellipsis)):] if width > len(ellipsis) else name[:width]


def shorten_names(names: Sequence[str], width: int | None, ellipsis: str = "…") -> dict[str, str]:
    """How each name is shown in a column of ``width`` (None: unlimited); never two alike."""
    if width is None:
        return {n: n for n in names}
    shown = {n: abbreviate(n, width, ellipsis=ellipsis) for n in names}
    for _ in range(4):
        groups: dict[str, list[str]] = {}
        for name, text in shown.items():
            groups.setdefault(text, []).append(name)
        clashes = [group for group in groups.values() if len(set(group)) > 1]
        if not clashes:
            return shown
        for group in clashes:
            split = [_split(n)[0] for n in group]
            longest = max(len(s) for s in split)
            differing = []
            for back in range(1, longest + 1):  # aligned from the end
                values = {s[-back] if back <= len(s) else None for s in split}
                if len(values) > 1:
                    differing.append(back)
            for name, segments in zip(group, split):
                prefer = [len(segments) - back for back in differing if back <= len(segments)]
                shown[name] = abbreviate(name, width, prefer, ellipsis)
    groups = {}
    for name, text in shown.items():
        groups.setdefault(text, []).append(name)
    for group in groups.values():
        if len(set(group)) > 1:
            for name in group:
                shown[name] = name  # whole, even past the width: never ambiguous
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
    elif relative:
        filled = max(0, min(width, round(width * (1 + math.log10(norm / threshold) / (2 * DECADES)))))
    else:
        filled = max(0, min(width, round(half + half * math.log10(norm / threshold) / DECADES)))
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


def lay_out(names: list[str], columns: list[Column], width: int | None, symbols: Symbols,
            bar: Callable[[int], list[Text]] | None = None, bar_header: str = "", name_header: str = "tensor",
            row_styles: list[str | None] | None = None) -> list[Text]:
    """Fit the name column and ``columns`` (plus an optional bar) into ``width`` (None: unlimited)."""
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
        for c in sorted([c for c in cols if c.drop is not None], key=lambda c: c.drop):  # type: ignore[arg-type,return-value]
            if total(name_width) <= width:
                break
            cols.remove(c)
            dropped.append(c)
        if total(name_width) > width:
            name_width = max(MIN_NAME_WIDTH, name_width - (total(name_width) - width))
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
    shown = shorten_names(names, name_width if name_width < full else None, symbols.ellipsis)
    name_width = max([len(name_header)] + [len(s) for s in shown.values()])
    bar_cells = bar(bar_width) if bar is not None and bar_width else None

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
        if row_styles is not None and row_styles[row]:
            line.stylize(row_styles[row])  # type: ignore[arg-type]
        lines.append(line)
    return lines


# --------------------------------------------------------------------------- the file report


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


_SHORT_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int64": "i64",
                 "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "bool", "complex64": "c64"}


def short_dtype(dtype: str) -> str:
    if dtype in _SHORT_DTYPES:
        return _SHORT_DTYPES[dtype]
    return dtype.replace("float8_", "f8").replace("float", "f").replace(" (big-endian)", ">")


def order_tensors(tensors: list[TensorReport], sort: str) -> list[TensorReport]:
    if sort == "name":
        return sorted(tensors, key=lambda t: natural_key(t.name))
    if sort == "norm":
        def key(t: TensorReport) -> tuple[int, float]:
            if t.norm is None:
                return (2, 0.0)
            if math.isnan(t.norm) or t.nonfinite:
                return (0, 0.0)
            return (1, -t.norm)
        return sorted(tensors, key=key)
    return list(tensors)


def file_lines(report: FileReport, width: int | None, symbols: Symbols = UNICODE, *, sort: str = "order",
               top: int | None = None, stats: bool = False) -> tuple[list[Text], int]:
    """The per-tensor table as lines, fitted to ``width``; and how many tensors ``top`` left out."""
    threshold = _threshold(report)
    slice_mode = any(t.max_slice_norm is not None for t in report.tensors)
    reading = report.mode == "report"
    tensors = order_tensors(report.tensors, sort)
    left_out = 0
    if top is not None:
        ranked = order_tensors([t for t in tensors if t.skipped is None or t.norm is not None], "norm")[:top]
        keep = {id(t) for t in ranked}
        left_out = len(tensors) - len(keep)
        tensors = [t for t in tensors if id(t) in keep]
    dash = symbols.dash
    names = [t.name for t in tensors]
    shapes = [Text(symbols.times.join(map(str, t.shape)) or "()") for t in tensors]
    measured = [t.norm is not None for t in tensors]

    def numbers(values: list[float | None]) -> list[Text]:
        texts = fmt_column([v if m else None for v, m in zip(values, measured)], dash)
        return [Text(x if m else "", style=None) for x, m in zip(texts, measured)]

    reading_order = report.mode == "report"
    columns = [Column("shape", "shape", shapes, drop=3 if reading_order else 1),
               Column("dtype", "dtype", [Text(t.dtype) for t in tensors], drop=5 if reading_order else 2,
                      short_cells=[Text(short_dtype(t.dtype)) for t in tensors])]
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
    else:
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
    return lay_out(names, columns, width, symbols, bar, header, row_styles=styles), left_out


def skipped_lines(report: FileReport, symbols: Symbols = UNICODE) -> list[Text]:
    """'skipped (reason): name, …' grouped by reason, under the table; then what is not a tensor."""
    reasons: dict[str, list[str]] = {}
    skipped = [t for t in report.tensors if t.skipped is not None and t.skipped != "not selected"]
    for t in sorted(skipped, key=lambda t: natural_key(t.name)):
        if t.norm is not None and t.skipped.startswith(("rank ", "axes ")):  # the report measured it whole
            reasons.setdefault(f"no slices: {t.skipped}; measured whole", []).append(t.name)
        elif t.norm is not None:
            reasons.setdefault(f"measured, not clipped and not in the global norm ({t.skipped})", []).append(t.name)
        else:
            reasons.setdefault(t.skipped, []).append(t.name)
    for o in report.others:
        reasons.setdefault(f"not a tensor: {o.kind}", []).append(o.name)
    lines = []
    for reason, names in reasons.items():
        shown = ", ".join(safe(n) for n in names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        label = safe(reason) if reason.startswith(("no slices", "measured")) else f"skipped ({safe(reason)})"
        lines.append(Text(f"{label}: {shown}", style="dim"))
    return lines


def slice_lines(report: FileReport) -> list[Text]:
    """Per tensor with slices: the largest (clipped or over the limit) by index, the smallest, dead ones."""
    limit = report.params.get("max_norm") if report.mode == "report" else report.params.get("clip")
    lines = []
    for t in report.tensors:
        if not t.worst_slices or t.slices is None:
            continue
        axes = report.params.get("axes")
        label = slice_label(t.shape, tuple(a % len(t.shape) for a in axes) if axes and t.shape else None)
        plural = label + "s"
        flagged = [s for s in t.worst_slices
                   if s.get("clipped") or (isinstance(limit, (int, float)) and s["norm"] > limit)]
        parts = []
        if flagged:
            indices = ", ".join(_slice_index(s["index"]) for s in flagged)
            verb = "clipped" if report.mode != "report" else f"above {fmt_number(limit)}"
            parts.append(f"{plural} {indices} {verb}")
        if t.min_slice_norm is not None:
            parts.append(f"smallest {label} norm {fmt_number(t.min_slice_norm)}")
        if t.near_zero_slices:
            parts.append(f"{t.near_zero_slices} of {t.slices} {plural} near zero")
        if flagged or t.near_zero_slices:
            lines.append(Text(f"{safe(t.name)}: " + "; ".join(parts), style="dim"))
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
    parts = []
    if report.mode != "report":
        parts.append(f"{report.clipped_count} clipped")
    parts.append(f"{report.skipped_count} skipped")
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
        would = report.would_write
        if would:
            exists = " (exists: --force replaces it)" if report.output_exists else ""
            title.append(f"  (dry run: would write {safe(would)}{exists}; nothing written)", style="italic")
        else:
            title.append("  (dry run: nothing written)", style="italic")
    return title


def print_lines(console: Console, lines: Sequence[Text]) -> None:
    """Print lines as they are: never folded, never cropped (the layout fitted them already)."""
    for line in lines:
        console.print(line, soft_wrap=True, markup=False, highlight=False, emoji=False)


def render_file(report: FileReport, console: Console, *, width: int | None = -1, sort: str = "order",
                top: int | None = None, stats: bool = False) -> None:
    """The report of one file; ``width`` -1: the console's, None: unlimited."""
    symbols = symbols_for(console)
    fit = console.width if width == -1 else width
    lines = [file_title(report, symbols)]
    table, left_out = file_lines(report, fit, symbols, sort=sort, top=top, stats=stats)
    lines += table
    if left_out:
        lines.append(Text(f"{left_out} more tensor(s) not shown (--top {top})", style="dim"))
    lines += skipped_lines(report, symbols)
    lines += slice_lines(report)
    lines += file_summary(report, symbols)
    print_lines(console, lines)
    console.print()


# Above this many rows a table is written as plain text in one go: styling each cell of
# a header that lists a million tensors took minutes.
PLAIN_ROWS = 5000


def _plain_info_table(tensors: list[Any], width: int | None, symbols: Symbols) -> list[str]:
    shapes = [symbols.times.join(map(str, t.shape)) or "()" for t in tensors]
    params = [f"{math.prod(t.shape):,}" for t in tensors]
    sizes = [human_bytes(t.nbytes) for t in tensors]
    widths = [max(len(h), max(map(len, col), default=0)) for h, col in
              (("shape", shapes), ("dtype", [t.dtype for t in tensors]), ("params", params), ("bytes", sizes))]
    room = None if width is None else max(MIN_NAME_WIDTH, width - sum(widths) - GAP * 4)
    shown = shorten_names([t.name for t in tensors], room, symbols.ellipsis)
    name_width = max([6] + [len(v) for v in shown.values()])
    sep = " " * GAP
    lines = [f"{'tensor'.ljust(name_width)}{sep}{'shape'.ljust(widths[0])}{sep}{'dtype'.ljust(widths[1])}{sep}"
             f"{'params'.rjust(widths[2])}{sep}{'bytes'.rjust(widths[3])}"]
    lines.append(symbols.rule * len(lines[0]))
    for t, shape, count, size in zip(tensors, shapes, params, sizes):
        lines.append(f"{safe(shown[t.name]).ljust(name_width)}{sep}{shape.ljust(widths[0])}{sep}"
                     f"{t.dtype.ljust(widths[1])}{sep}{count.rjust(widths[2])}{sep}{size.rjust(widths[3])}")
    return lines


def render_info(info: InfoReport, console: Console, *, width: int | None = -1, sort: str = "order") -> None:
    symbols = symbols_for(console)
    fit = console.width if width == -1 else width
    title = Text(safe(info.file), style="bold")
    title.append(f"  ({info.format}, {human_bytes(info.size_bytes)})")
    tensors = info.tensors if sort != "name" else sorted(info.tensors, key=lambda t: natural_key(t.name))
    if len(tensors) > PLAIN_ROWS:
        print_lines(console, [title])
        console.file.write("\n".join(_plain_info_table(tensors, fit, symbols)) + "\n")
        console.file.flush()
        tensors = []
    columns = [
        Column("shape", "shape", [Text(symbols.times.join(map(str, t.shape)) or "()") for t in tensors], drop=2),
        Column("dtype", "dtype", [Text(t.dtype) for t in tensors], short_cells=[Text(short_dtype(t.dtype))
                                                                               for t in tensors], drop=3),
        Column("params", "params", [Text(f"{math.prod(t.shape):,}") for t in tensors], "right", drop=1),
        Column("bytes", "bytes", [Text(human_bytes(t.nbytes)) for t in tensors], "right", drop=0),
    ]
    lines = [] if not tensors else [title] + lay_out([t.name for t in tensors], columns, fit, symbols)
    counts = info.params_by_dtype()
    total = sum(counts.values())
    noun = "tensor" if len(info.tensors) == 1 else "tensors"
    lines.append(Text(f"{len(info.tensors)} {noun}, {total:,} parameters: "
                      + ", ".join(f"{dtype} {n:,}" for dtype, n in counts.items()), style="bold"))
    refused = [t for t in info.tensors if t.refused]
    for t in refused:
        lines.append(Text(f"not read: {safe(t.name)}: {safe(t.refused)}", style="dim"))
    if info.others:
        lines.append(Text("not tensors", style="bold"))
        for o in info.others:
            shape = symbols.times.join(map(str, o.shape)) if o.shape else ""
            text = f"  {safe(o.name)}  {safe(o.kind)}  {shape} {safe(o.dtype)}  ({safe(o.reason)})"
            lines.append(Text(text.rstrip()))
    if info.metadata:
        lines.append(Text("metadata", style="bold"))
        key_width = min(40, max(len(safe(k)) for k in info.metadata))
        for key, value in info.metadata.items():
            line = Text(safe(key).ljust(key_width), style="cyan")
            line.append("  " + show_value(value))
            lines.append(line)
    print_lines(console, lines)
    console.print()


def render_summary(ok: int, failed: Sequence[str], console: Console) -> None:
    if ok + len(failed) > 1:
        text = Text(f"{ok + len(failed)} files: {ok} ok", style="bold")
        if failed:
            text.append(f", {len(failed)} failed ({', '.join(safe(f) for f in failed)})", style="bold red")
        print_lines(console, [text])
