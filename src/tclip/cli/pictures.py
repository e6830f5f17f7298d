"""What ``--plot`` and ``--heatmap`` draw of a grid (tensors x checkpoints), for ``report --summary``
of norms (cli/runner.py) and of grads or drift (cli/history.py); and the command line, the
picture's title. Imports neither: both import it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def show_grid(runner: Any, grid: Any, plot: str | None, heatmap: bool, command: str) -> bool:
    """Write the picture and/or draw the heatmap; False (an error said) when the picture could not be written."""
    from ..work.summary import file_labels

    labels = file_labels(grid.columns)
    if heatmap and not runner.quiet and not runner.as_json:
        from .render.heatmap import render_heatmap

        render_heatmap(grid, [labels.get(c, c) for c in grid.columns], runner.out, runner.width)
    if plot is not None:
        from .render.plot import PlotError, write_plot

        try:
            write_plot(grid, [labels.get(c, c) for c in grid.columns], Path(plot), command)
        except PlotError as error:
            runner.error(plot, f"{plot}: {error}")
            return False
        except OSError as error:
            runner.error(plot, f"{plot}: cannot write ({error.strerror or error})")
            return False
    return True


def command_line() -> str:
    """The command as typed (the pictures' title)."""
    import shlex

    import click

    context = click.get_current_context(silent=True)
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    module = os.path.basename(os.path.dirname(sys.argv[0])) if sys.argv else ""  # python -m tclip
    if program.startswith("tclip") or module in ("tclip", "cli") and program == "__main__.py" or context is None:
        return " ".join(["tclip", *(shlex.quote(a) for a in sys.argv[1:])])
    # called as a library (click's test runner): the options it was given
    from click.core import ParameterSource

    given = []
    for param in context.command.params:
        value = context.params.get(param.name or "")
        if param.name == "files" or not param.opts or value in (None, False, ()) or \
                context.get_parameter_source(param.name or "") is not ParameterSource.COMMANDLINE:
            continue
        given.append(param.opts[-1] if value is True else f"{param.opts[-1]} {shlex.quote(str(value))}")
    words = ["tclip", context.info_name or "", *given, *map(shlex.quote, context.params.get("files", ()))]
    return " ".join(words)


# --------------------------------------------------------------------------- info
