"""The ``tclip`` console entry point: signals, interrupts and broken pipes, before anything is imported.

Everything heavy (click, NumPy, rich, the formats) is imported inside
:func:`main`, after the handlers are in place, so Ctrl-C at any moment -- even
during start-up -- ends with exit status 130 and no traceback, SIGTERM with 143
and SIGHUP with 129, each with one line and no temporary file left behind.
"""

from __future__ import annotations

import os
import signal
import sys

from .. import interrupt
from ..interrupt import Terminated
from .exits import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, quiet_stdout


def _raise_terminated(signum: int, frame: object) -> None:
    interrupt.requested = signum
    raise Terminated(signum)


def _unraisable(hook: object) -> object:
    def handle(info: object) -> None:
        # A stop raised inside a destructor or weakref callback is swallowed by Python;
        # it is recorded in tclip.interrupt and acted on at the next check.
        if isinstance(getattr(info, "exc_value", None), Terminated):
            return
        hook(info)  # type: ignore[operator]
    return handle


def _remove_live_temps() -> int:
    """Remove this process's unfinished outputs; how many there were."""
    base = sys.modules.get("tclip.formats.atomic")
    removed = 0
    for path in list(getattr(base, "LIVE_TEMPS", ())):
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed


def _say(message: str) -> None:
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def main() -> None:
    """Console entry point."""
    code = 0
    try:
        sys.unraisablehook = _unraisable(sys.unraisablehook)  # type: ignore[assignment]
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), _raise_terminated)
        for stream in (sys.stdout, sys.stderr):
            try:
                # A terminal or pipe that cannot encode a name must never raise.
                stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
            except (AttributeError, ValueError):
                pass
        from ..formats.hdf5.child import prestart

        prestart(sys.argv[1:])  # the HDF5 child imports its libraries while tclip imports its own
        from .commands import cli

        code = cli.main(prog_name="tclip", standalone_mode=False) or 0
        interrupt.check()  # a stop that was swallowed on the way
    except KeyboardInterrupt:
        _remove_live_temps()
        _say("Error: interrupted")
        code = EXIT_INTERRUPTED
    except Terminated as stop:
        base = sys.modules.get("tclip.formats.atomic")
        abandoned = _remove_live_temps() + (getattr(base, "ABANDONED_TEMPS", [0])[0] if base else 0)
        removed = "; unfinished outputs were removed" if abandoned else ""
        if stop.signum == signal.SIGINT:
            _say(f"Error: interrupted{removed}")
        else:
            _say(f"Error: terminated by {signal.Signals(stop.signum).name}{removed}")
        code = 128 + stop.signum
    except BrokenPipeError:
        quiet_stdout()
        code = EXIT_BROKEN_PIPE
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except Exception as error:  # click's own errors are handled below; anything else is a bug
        code = _click_error(error)
    finally:
        _remove_live_temps()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_stdout()
        code = code or EXIT_BROKEN_PIPE
    except (OSError, ValueError):
        pass
    # The work is over: a signal arriving while the interpreter shuts down (when Python
    # puts the default handlers back) must not turn a finished run into a killed one.
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    sys.exit(code)


def _click_error(error: Exception) -> int:
    import click

    if isinstance(error, click.exceptions.Exit):
        return error.exit_code
    if isinstance(error, click.Abort):
        _say("Error: interrupted")
        return EXIT_INTERRUPTED
    if isinstance(error, click.ClickException):
        error.show()
        return error.exit_code
    if isinstance(error, BrokenPipeError):
        quiet_stdout()
        return EXIT_BROKEN_PIPE
    if isinstance(error, OSError) and error.strerror and not os.environ.get("TCLIP_DEBUG"):
        # The system refused a path outside any one file's work (a name over 255 bytes,
        # ENAMETOOLONG): that is the user's input, not a bug.
        from ..text import safe

        where = error.filename if error.filename is not None else "tclip"
        _say(f"Error: {safe(where)}: {error.strerror}")
        return 1
    if os.environ.get("TCLIP_DEBUG"):
        raise error
    _say(f"Error: internal error: {type(error).__name__}: {error}")
    return 1
