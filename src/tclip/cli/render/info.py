"""``tclip info`` for people: names, shapes, dtypes and sizes from the header, then metadata."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.text import Text

from ...text import safe, show_value, shown_key
from ...work.results import InfoReport
from .report import gave_way_line, tie_lines
from .table import (
    GAP,
    MIN_NAME_WIDTH,
    Column,
    Symbols,
    human_bytes,
    lay_out,
    print_lines,
    short_dtype,
    shorten_names,
    symbols_for,
)

# Above this many rows a table is written as plain text in one go: styling each cell of
# a header that lists a million tensors took minutes.
PLAIN_ROWS = 5000


def _plain_info_table(tensors: list[Any], width: int | None, symbols: Symbols,
                      storage: list[str] | None = None) -> list[str]:
    names: dict[tuple[Any, str | None], str] = {}  # one name per distinct dtype: a million rows
    dtypes = [names.get((t.dtype, t.dtype_label)) or names.setdefault((t.dtype, t.dtype_label), t.dtype_text)
              for t in tensors]
    shapes = [symbols.times.join(map(str, t.shape)) or "()" for t in tensors]
    params = [f"{math.prod(t.shape):,}" for t in tensors]
    sizes = [human_bytes(t.nbytes) for t in tensors]
    widths = [max(len(h), max(map(len, col), default=0)) for h, col in
              (("shape", shapes), ("dtype", dtypes), ("params", params), ("bytes", sizes))]
    shards = [safe(t.file) for t in tensors] if any(t.file is not None for t in tensors) else None
    if shards is None and storage is not None and len(storage) > 1:  # a DCP folder's .distcp files
        shards = [safe(_files_cell(t.chunk_files or [], storage, width is not None)) for t in tensors]
    header = "shard" if any(t.file is not None for t in tensors) else "files"
    extra = GAP + max([len(header)] + [len(c) for c in shards]) if shards else 0
    room = None if width is None else max(MIN_NAME_WIDTH, width - sum(widths) - GAP * 4 - extra)
    shown = shorten_names([t.name for t in tensors], room, symbols.ellipsis)
    name_width = max([6] + [len(v) for v in shown.values()])
    sep = " " * GAP
    lines = [f"{'tensor'.ljust(name_width)}{sep}{'shape'.ljust(widths[0])}{sep}{'dtype'.ljust(widths[1])}{sep}"
             f"{'params'.rjust(widths[2])}{sep}{'bytes'.rjust(widths[3])}" + (f"{sep}{header}" if shards else "")]
    lines.append(symbols.rule * len(lines[0]))
    for i, (t, shape, dtype, count, size) in enumerate(zip(tensors, shapes, dtypes, params, sizes)):
        lines.append(f"{safe(shown[t.name]).ljust(name_width)}{sep}{shape.ljust(widths[0])}{sep}"
                     f"{dtype.ljust(widths[1])}{sep}{count.rjust(widths[2])}{sep}{size.rjust(widths[3])}"
                     + (f"{sep}{shards[i]}" if shards else ""))
    return lines


def shard_column(info: InfoReport, tensors: list[Any]) -> Column:
    """Which shard of a set holds each tensor: its file name, or where that does not fit,
    its number among the shards (``3/14``, the files' natural order)."""
    number = {name: i for i, name in enumerate(info.files or [], 1)}
    total = len(info.files or [])
    return Column("shard", "shard", [Text(safe(t.file or "")) for t in tensors],
                  short_cells=[Text(f"{number.get(t.file, '?')}/{total}") for t in tensors], drop=4)


def _files_cell(files: list[str], every: list[str], short: bool) -> str:
    """Which files hold a DCP tensor: ``__0_0 __1_0`` (the ``.distcp`` every name ends with
    left out), ``all 8`` when it is in every file, ``__0_0…__5_0 (6)`` for a run of more than
    two; short (a narrow terminal): the one file's name, ``all``, or ``6 files``."""
    names = [f.removesuffix(".distcp") for f in files]
    if len(files) > 1 and len(files) == len(every):
        return "all" if short else f"all {len(files)}"
    if len(files) <= (1 if short else 2):
        return " ".join(names)
    return f"{len(files)} files" if short else f"{names[0]}…{names[-1]} ({len(files)})"


def files_column(info: InfoReport, tensors: list[Any]) -> Column:
    """The ``.distcp`` files holding each tensor of a DCP folder (every name in ``--json``)."""
    every = list(info.storage_files or ())
    return Column("files", "files", [Text(safe(_files_cell(t.chunk_files or [], every, False))) for t in tensors],
                  short_cells=[Text(safe(_files_cell(t.chunk_files or [], every, True))) for t in tensors], drop=4)


def storage_line(info: InfoReport) -> Text:
    """``stored in 2 files: __0_0.distcp 5.6 kB, __1_0.distcp 9.9 kB`` (the first and last of many)."""
    files = info.storage_files or {}
    shown = [f"{safe(f)} {human_bytes(n)}" for f, n in files.items()]
    if len(shown) > 4:
        shown = [shown[0], "…", shown[-1]]
    noun = "file" if len(files) == 1 else "files"
    return Text(f"stored in {len(files)} {noun} ({human_bytes(sum(files.values()))}): " + ", ".join(shown), style="dim")


def _shown_file(info: InfoReport) -> str:
    """What the title names: a DCP folder rather than its ``.metadata`` (``--json``'s ``file``), as
    ``report`` does; the size beside it is the whole checkpoint's, not that file's few kB."""
    if info.storage_files is not None:
        head, _, name = info.file.replace("\\", "/").rpartition("/")
        if name.endswith(".metadata") or name == "metadata.json":
            return info.file[:len(head)] or "."
    return info.file


def render_info(info: InfoReport, console: Console, *, width: int | None = -1, sort: str = "order") -> None:
    symbols = symbols_for(console)
    fit = console.width if width == -1 else width
    title = Text(safe(_shown_file(info)), style="bold")
    title.append(f"  ({info.format}, {human_bytes(info.size_bytes)})")
    tensors = info.tensors if sort != "name" else sorted(info.tensors, key=lambda t: shown_key(t.name))
    if len(tensors) > PLAIN_ROWS:
        print_lines(console, [title])
        storage = None if info.storage_files is None else list(info.storage_files)
        console.file.write("\n".join(_plain_info_table(tensors, fit, symbols, storage)) + "\n")
        console.file.flush()
        tensors = []
    columns = [
        Column("shape", "shape", [Text(symbols.times.join(map(str, t.shape)) or "()") for t in tensors], drop=2),
        Column("dtype", "dtype", [Text(t.dtype_text) for t in tensors],
               short_cells=[Text(short_dtype(t.dtype, t.dtype_label)) for t in tensors], drop=3),
        Column("params", "params", [Text(f"{math.prod(t.shape):,}") for t in tensors], "right", drop=1),
        Column("bytes", "bytes", [Text(human_bytes(t.nbytes)) for t in tensors], "right", drop=0),
    ]
    if info.files is not None:
        columns.append(shard_column(info, tensors))
    if info.storage_files is not None and len(info.storage_files) > 1:  # (one file: the line below says it)
        columns.append(files_column(info, tensors))
    gave_way: list[str] = []
    lines = [] if not tensors else [title] + lay_out([t.name for t in tensors], columns, fit, symbols,
                                                     gave_way=gave_way)
    if gave_way and fit is not None:
        lines.append(gave_way_line(gave_way, fit))
    counts = info.params_by_dtype()
    total = sum(counts.values())
    noun = "tensor" if len(info.tensors) == 1 else "tensors"
    lines.append(Text(f"{len(info.tensors)} {noun}, {total:,} parameters: "
                      + ", ".join(f"{dtype} {n:,}" for dtype, n in counts.items()), style="bold"))
    if info.storage_files is not None:
        lines.append(storage_line(info))
    refused = [t for t in info.tensors if t.refused]
    for t in refused:
        lines.append(Text(f"not read: {safe(t.name)}: {safe(t.refused)}", style="dim"))
    lines += tie_lines(info.tensors, "the parameters")
    for names in info.shared:
        shown = ", ".join(safe(n) for n in names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        lines.append(Text(f"one storage: {shown}", style="dim"))
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
