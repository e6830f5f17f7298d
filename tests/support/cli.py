"""tclip's command line run in the test's own process, through click's CliRunner.

click >= 8.2 keeps stdout and stderr apart (``result.stdout``, ``result.stderr``); every argument is
passed through ``str()``, so paths and numbers go in as they are.
"""

from __future__ import annotations

from click.testing import CliRunner, Result

from tclip.cli import cli


def run(*args: object, env: dict[str, str] | None = None, **kwargs) -> Result:
    """``tclip ARGS...``; ``env`` adds to (or, with None values, removes from) the environment;
    ``kwargs`` go to ``CliRunner.invoke`` (``input=``, ``catch_exceptions=``...)."""
    return CliRunner().invoke(cli, [str(a) for a in args], env=env, **kwargs)


def run80(*args: object, env: dict[str, str] | None = None, **kwargs) -> Result:
    """``run`` in an 80-column terminal (COLUMNS=80), the width tables are laid out for in these tests."""
    return run(*args, env={"COLUMNS": "80", **(env or {})}, **kwargs)
