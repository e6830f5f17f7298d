"""``tclip convert``: the library's conversion, its errors and warnings as lines (kept out of
runner.py, which runs the commands over many files)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .exits import EXIT_FAILED
from .runner import Runner

if TYPE_CHECKING:
    from ..work.convert import ConvertResult


def run_convert(*, source: str, target: Path, max_shard_size: str, force: bool, drop_nonnumeric: bool,
                include: tuple[str, ...], exclude: tuple[str, ...], memory: int, threads: int | None,
                as_json: bool, quiet: bool, color: str) -> int:
    from ..work.budget import Budget
    from ..work.convert import convert
    from ..work.selection import Selection

    runner = Runner(as_json, quiet, color)
    result = runner.attempt(source, lambda: convert(
        source, target, selection=Selection(include, exclude), max_shard_size=max_shard_size, overwrite=force,
        drop_nonnumeric=drop_nonnumeric, budget=Budget(memory, threads or 0)))
    if result is None:
        return EXIT_FAILED
    runner.done(source, result, lambda r: _render(r, runner))
    return 0


def _render(result: ConvertResult, runner: Runner) -> None:
    # rich is imported only to print: `convert -q` and `--json` start without it (~0.08 s)
    from .render.convert import render_convert

    render_convert(result, runner.out)
