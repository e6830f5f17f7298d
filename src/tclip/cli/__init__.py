"""The command line: the only users of click and rich.

- :mod:`~tclip.cli.entry`: the console entry point (signals, interrupts, broken pipes);
- :mod:`~tclip.cli.exits`: exit statuses;
- :mod:`~tclip.cli.params`: parameter types and shared options;
- :mod:`~tclip.cli.commands`: the click group :data:`cli` and its commands, each a thin client of the library;
- :mod:`~tclip.cli.runner`: the loops over inputs, library errors as one line each, the exit status;
- :mod:`~tclip.cli.words`: what the command line calls the library's options in messages;
- :mod:`~tclip.cli.render`: tables for people (JSON comes from the library's report data).

``cli`` and ``main`` are imported on first use, so that the entry point installs
its signal handlers before click is imported.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cli", "main"]


def __getattr__(name: str) -> Any:
    if name == "cli":
        from .commands import cli

        return cli
    if name == "main":
        from .entry import main

        return main
    raise AttributeError(f"module 'tclip.cli' has no attribute {name!r}")
