"""Signals that ask tclip to stop, as seen by long-running loops (no terminal, no click here).

The command line's handlers (:mod:`tclip.cli.entry`) raise :class:`Terminated` at once;
when Python swallows that exception (a signal landing inside a weakref callback or a
destructor is "ignored"), the request is still recorded here, and the pass driver's loops
call :func:`check` between blocks, so the run stops within one block anyway.
"""

from __future__ import annotations

requested: int | None = None  # the signal number, once one arrived


class Terminated(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived: unwind (removing temporary files) and exit.

    Not KeyboardInterrupt: click would catch that and print a stray blank line.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def check() -> None:
    """Raise :class:`Terminated` if a stop was asked for and not acted on yet."""
    if requested is not None:
        raise Terminated(requested)
