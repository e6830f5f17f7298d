"""``tclip convert`` for people: what was written where."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from ...text import name_list, safe
from ...work.convert import ConvertResult
from .table import human_bytes


def render_convert(result: ConvertResult, console: Console) -> None:
    """A few plain lines: the output, its files, what was copied and not copied."""
    files = len(result.files)
    where = f"{files} shards and {safe(result.index)}" if result.index else safe(result.files[0]) if files else "-"
    lines = [f"{safe(result.source)} -> {safe(result.target)}  ({result.format})",
             f"{result.tensors:,} tensor{'s' if result.tensors != 1 else ''}, {human_bytes(result.bytes_written)} "
             f"written in {result.elapsed_s:.2f} s: {where}"]
    if result.copied:
        lines.append(f"copied beside them: {safe(name_list(result.copied, 6))}")
    if result.not_copied:
        lines.append("not copied: " + safe(", ".join(f"{n} ({why})" for n, why in result.not_copied[:6]))
                     + (f" and {len(result.not_copied) - 6} more" if len(result.not_copied) > 6 else ""))
    for line in lines:
        console.print(Text(line), soft_wrap=True)
