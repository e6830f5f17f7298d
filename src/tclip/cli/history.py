"""``report --summary --of grads|drift`` and the grid's pictures (``--plot``, ``--heatmap``).

Imported only when asked for: the pictures' modules are imported only when drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import TclipError
from ..text import fmt_number
from .exits import EXIT_CHECK_FAILED
from .runner import Runner
from .pictures import show_grid
from .words import flag


def run_history(*, files: tuple[str, ...], recursive: bool, quantity: str, sort: str, top: int | None,
                include: tuple[str, ...], exclude: tuple[str, ...], as_json: bool, quiet: bool, color: str,
                threads: int | None, memory: int, max_drift: float | None, plot: str | None, heatmap: bool,
                command: str) -> int:
    from ..work.history import TOP_CELLS, drift_grid, drift_violations, grads_grid, grid_json
    from ..work.selection import Selection
    from ..work.summary import file_labels

    runner = Runner(as_json, quiet, color, batch=not as_json)
    paths: list[Path] = []
    for name, path in runner.expand(_with_folders(files), recursive):
        if path is None:
            runner.error(name, f"{name}: no tensor files match")
        else:
            paths.append(path)
    selection = Selection(include, exclude)
    try:
        if quantity == "grads":
            grid = grads_grid(paths, sort, selection)
        else:
            grid = drift_grid(paths, sort, selection, memory, threads or 0)
    except TclipError as error:
        runner.error(str(error.path or ""), error.spelled(flag))
        return 1
    except OSError as error:
        runner.error(str(error.filename or ""), f"{error.filename}: {error.strerror or error}")
        return 1
    labels = file_labels(grid.columns)
    if as_json:
        for item in grid_json(grid, labels):
            runner.emit(item)
    elif not quiet:
        from .render.history import render_grid_summary

        render_grid_summary(grid, labels, runner.out, runner.width, top=top or TOP_CELLS)
    for column, notes in grid.notes.items():
        for note in notes:
            runner.warn(labels.get(column, column), note)
    failed_check = False
    if max_drift is not None:
        for tensor, before, after, value in drift_violations(grid, max_drift):
            failed_check = True
            what = "was not measured" if value is None else f"changed by {fmt_number(value)} of its norm"
            runner.say(f"Warning: {tensor}: {what} between {before} and {after} (--max-drift {max_drift:g})")
    if (plot is not None or heatmap) and not show_grid(runner, grid, plot, heatmap, command):
        return 1
    runner.say_held()
    if runner.failed:
        return 1
    return EXIT_CHECK_FAILED if failed_check else 0


def _with_folders(items: tuple[str, ...]) -> tuple[str, ...]:
    """A glob naming checkpoint folders (``run/checkpoint-*``) stands for those folders."""
    import glob
    import os

    from ..text import natural_key

    out: list[str] = []
    for item in items:
        if glob.has_magic(item) and not os.path.lexists(item):
            matches = sorted(glob.glob(item), key=natural_key)
            if any(os.path.isdir(m) for m in matches):
                out += matches
                continue
        out.append(item)
    return tuple(out)
