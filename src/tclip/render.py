"""The rich rendering of reports for people. JSON output does not come through here."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .report import FileReport, InfoReport, TensorReport

NAME_WIDTH = 40
BAR_WIDTH = 14
DECADES = 3  # the bar spans 10**-3 .. 10**3 times the threshold


def shorten_middle(name: str, width: int = NAME_WIDTH) -> str:
    """``encoder.layers.11.attention.output.dense.weight`` -> ``encoder.layers.1…output.dense.weight``."""
    if len(name) <= width:
        return name
    keep = width - 1
    head = keep * 2 // 5
    return name[:head] + "…" + name[len(name) - (keep - head):]


def human_bytes(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def fmt_number(value: float | None) -> str:
    if value is None:
        return "—"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if 1e-3 <= magnitude < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


def norm_bar(norm: float | None, threshold: float | None, highlight: bool, *, relative: bool = False,
             width: int = BAR_WIDTH) -> Text:
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
            bar.append("█", style=("bold red" if highlight else "yellow") if past else "green")
        elif i == half and not relative:
            bar.append("│", style="dim")
        else:
            bar.append("·", style="dim")
    return bar


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


def _scale_text(t: TensorReport, report: FileReport) -> Text:
    if report.mode == "value":
        return Text(f"{t.changed or 0}", style="bold red" if t.changed else "dim")
    if not t.clipped or t.scale is None:
        return Text("—", style="dim")
    detail = f"×{t.scale:.3g}"
    if t.slices_clipped is not None:
        detail += f" {t.slices_clipped}/{t.slices}"
    return Text(detail, style="bold red")


def file_table(report: FileReport, console_width: int = 100) -> Table:
    """The per-tensor table; names are shortened in the middle to fit the width."""
    threshold = _threshold(report)
    slice_mode = any(t.max_slice_norm is not None for t in report.tensors)
    reading = report.mode == "report"
    headers: list[tuple[str, str]] = [("shape", "left"), ("dtype", "left")]
    if reading:
        headers.append(({"2": "L2 norm", "1": "L1 norm", "inf": "max |x|"}.get(report.ord, "norm"), "right"))
        if slice_mode:
            headers.append(("max slice", "right"))
    else:
        headers += [("max slice" if slice_mode else "average" if report.mode == "average" else "norm", "right"),
                    ("after", "right"), ("changed" if report.mode == "value" else "scale", "right")]
    headers.append(("NaN/Inf", "right"))
    bar_reference = threshold
    if reading and threshold is None:
        norms = [t.norm for t in report.tensors if t.norm is not None and math.isfinite(t.norm)]
        bar_reference = max(norms, default=0.0) or None
    show_bar = bar_reference is not None
    if show_bar:
        headers.append((f"vs {fmt_number(threshold)}" if threshold is not None else "vs max", "left"))

    rows: list[tuple[TensorReport, list[Text]]] = []
    for t in report.tensors:
        cells = [Text("×".join(map(str, t.shape)) or "()"), Text(t.dtype)]
        if t.skipped is not None:
            cells.append(Text("skipped", style="dim"))
            cells += [Text("")] * (len(headers) - len(cells))
            rows.append((t, cells))
            continue
        if reading:
            cells.append(Text(fmt_number(t.norm)))
            if slice_mode:
                cells.append(Text(fmt_number(t.max_slice_norm)))
        else:
            before = t.max_slice_norm if slice_mode else _compared_norm(t, report)
            after = t.max_slice_norm_after if slice_mode else t.norm_after
            if report.mode == "average" and after is not None and t.numel:
                after = after / t.numel
            cells += [Text(fmt_number(before)), Text(fmt_number(after)), _scale_text(t, report)]
        cells.append(Text(f"{t.nan}/{t.inf}", style="bold magenta") if t.nonfinite else Text("0", style="dim"))
        if show_bar:
            cells.append(Text(""))
        rows.append((t, cells))

    # Fit the width: numbers keep their width, the bar takes 6..14 cells and the
    # names what is left (at least 12), shortened in the middle.
    widths = [max([len(h)] + [c[i].cell_len for _, c in rows if i < len(c)]) for i, (h, _) in enumerate(headers)]
    if show_bar:
        widths[-1] = 0
    gaps = 2 * (len(headers) + 1)  # a separator and a right pad per column
    longest = max((len(t.name) for t in report.tensors), default=6)
    room = console_width - sum(widths) - gaps
    # Share what is left: names up to 24 cells, the bar up to 10, names up to their
    # full length (at most 40), then the bar up to 14.
    name_target = min(longest, NAME_WIDTH)
    name_width = min(name_target, 24, max(12, room - (6 if show_bar else 0)))
    bar_width = max(6, min(10, room - name_width)) if show_bar else 0
    name_width += max(0, min(name_target - name_width, room - name_width - bar_width))
    if show_bar:
        bar_width += max(0, min(BAR_WIDTH - bar_width, room - name_width - bar_width))
    name_width = max(12, name_width)
    if show_bar:
        widths[-1] = max(bar_width, len(headers[-1][0]))
        for t, cells in rows:
            if t.skipped is not None:
                continue
            shown = (t.max_slice_norm if (reading and slice_mode and t.max_slice_norm is not None)
                     else t.norm if reading else _compared_norm(t, report))
            cells[-1] = norm_bar(shown, bar_reference, t.clipped or reading, relative=threshold is None,
                                 width=bar_width)

    table = Table(header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                  padding=(0, 1, 0, 0))
    table.add_column("tensor", no_wrap=True, min_width=min(name_width, longest))
    for (header, justify), width in zip(headers, widths):
        table.add_column(header, justify=justify, no_wrap=True, min_width=width)  # type: ignore[arg-type]
    for t, cells in rows:
        table.add_row(Text(shorten_middle(t.name, name_width)), *cells, style="dim" if t.skipped else None)
    return table


def skipped_lines(report: FileReport) -> Text | None:
    """'skipped: name (reason), …' grouped by reason, under the table."""
    reasons: dict[str, list[str]] = {}
    for t in report.tensors:
        if t.skipped is not None and t.skipped != "not selected":
            reasons.setdefault(t.skipped, []).append(t.name)
    if not reasons:
        return None
    text = Text(style="dim")
    for i, (reason, names) in enumerate(reasons.items()):
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        text.append(("\n" if i else "") + f"skipped ({reason}): {shown}")
    return text


def file_summary(report: FileReport) -> Text:
    text = Text()
    if report.global_norm is not None:
        label = "global norm" if report.ord == "2" else {"1": "global L1", "inf": "global max |x|"}[report.ord]
        text.append(f"{label} {fmt_number(report.global_norm)}", style="bold")
        if report.global_norm_after is not None and report.mode != "report":
            text.append(f" → {fmt_number(report.global_norm_after)}", style="bold")
    parts = []
    if report.mode != "report":
        parts.append(f"{report.clipped_count} clipped")
    parts.append(f"{report.skipped_count} skipped")
    if report.nonfinite_tensors:
        parts.append(f"{len(report.nonfinite_tensors)} with NaN/Inf")
    text.append("  ·  " + "  ·  ".join(parts))
    parts = []
    parts.append(f"{human_bytes(report.bytes_read)} read")
    if report.bytes_written:
        parts.append(f"{human_bytes(report.bytes_written)} written")
    parts.append(f"{report.elapsed_s:.3f} s")
    if report.elapsed_s > 0 and report.bytes_read:
        parts.append(f"{human_bytes(report.bytes_read / report.elapsed_s)}/s")
    text.append("\n" + "  ·  ".join(parts), style="dim")
    return text


def file_title(report: FileReport) -> Text:
    """'input → output' on one line; paths are never folded, so they can be copied."""
    title = Text(report.file, style="bold", no_wrap=True, overflow="ignore")
    if report.output:
        title.append(f" → {report.output}")
    elif report.dry_run:
        title.append("  (dry run: nothing written)", style="italic")
    return title


def render_file(report: FileReport, console: Console) -> None:
    console.print(file_title(report), soft_wrap=True)  # never folded nor cropped
    parts = [file_table(report, console.width)]
    skipped = skipped_lines(report)
    if skipped is not None:
        parts.append(skipped)
    parts.append(file_summary(report))
    console.print(Group(*parts))
    console.print()


def render_info(info: InfoReport, console: Console) -> None:
    title = Text(info.file, style="bold", no_wrap=True, overflow="ignore")
    title.append(f"  ({info.format}, {human_bytes(info.size_bytes)})")
    console.print(title, soft_wrap=True)
    table = Table(header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1, 0, 0))
    longest = max((len(t.name) for t in info.tensors), default=6)
    name_width = max(16, min(60, longest, console.width - 40))
    table.add_column("tensor", no_wrap=True, min_width=min(name_width, longest))
    table.add_column("shape", no_wrap=True)
    table.add_column("dtype", no_wrap=True)
    table.add_column("params", justify="right")
    table.add_column("bytes", justify="right")
    for t in info.tensors:
        table.add_row(shorten_middle(t.name, name_width), "×".join(map(str, t.shape)) or "()", t.dtype,
                      f"{math.prod(t.shape):,}", human_bytes(t.nbytes))
    console.print(table)
    counts = info.params_by_dtype()
    total = sum(counts.values())
    noun = "tensor" if len(info.tensors) == 1 else "tensors"
    console.print(Text(f"{len(info.tensors)} {noun}, {total:,} parameters: "
                       + ", ".join(f"{dtype} {n:,}" for dtype, n in counts.items()), style="bold"))
    if info.metadata:
        console.print(Text("metadata", style="bold"))
        meta = Table(show_header=False, pad_edge=False, box=None, padding=(0, 2, 0, 0))
        meta.add_column("key", style="cyan", no_wrap=True)
        meta.add_column("value")
        for key, value in info.metadata.items():
            meta.add_row(str(key), str(value))
        console.print(meta)
    console.print()


def render_summary(ok: int, failed: Sequence[str], console: Console) -> None:
    if ok + len(failed) > 1:
        text = Text(f"{ok + len(failed)} files: {ok} ok", style="bold")
        if failed:
            text.append(f", {len(failed)} failed ({', '.join(failed)})", style="bold red")
        console.print(text)
