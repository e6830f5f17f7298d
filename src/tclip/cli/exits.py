"""How the ``tclip`` process ends: its exit statuses, and a quiet stdout when nobody reads it.

0 success, 1 the work failed, 2 a usage error (click's), 3 a check the user asked
for failed; 128 + N for a signal (130 for Ctrl-C, 141 for a broken pipe)."""

from __future__ import annotations

import os
import sys

EXIT_FAILED = 1


EXIT_CHECK_FAILED = 3


EXIT_INTERRUPTED = 130


EXIT_BROKEN_PIPE = 141  # as a process killed by SIGPIPE


def quiet_stdout() -> None:
    # Nobody reads stdout any more: point it at /dev/null so the final flush is silent.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
