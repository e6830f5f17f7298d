"""README's read-only samples (report, the gate, info, diff), and docs/commands.md's, are what tclip prints.

Each ``    $ tclip ...`` block of README.md or docs/commands.md whose files are under samples/ (and
that is not a pipeline) is run in a pseudo-terminal of 80 columns on copies of the sample files: its
``Warning:`` lines must be among what tclip wrote to stderr, and its other lines what it printed,
but for the times and speeds of the last line. ``samples/grads.clipped.npz`` is made first by
README's clip, which tests/commands/test_report_legible.py checks itself.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import support

ROOT = support.ROOT
README = (ROOT / "README.md").read_text()
DOCS = {"README.md": README, "docs/commands.md": (ROOT / "docs" / "commands.md").read_text()}
BLOCK = re.compile(r"^    \$ tclip (?P<args>.+)\n(?P<out>(?:    (?!\$ ).*\n)*)(?:    \$ echo \$\?\n    (?P<rc>\d+)\n)?",
                   re.M)


def sample_blocks(text: str = "\n".join(DOCS.values())) -> list[tuple[list[str], list[str], int | None]]:
    blocks = []
    for match in BLOCK.finditer(text):
        args = shlex.split(match["args"])
        if any(arg.startswith("samples/") for arg in args) and "|" not in args:
            lines = [line[4:] for line in match["out"].splitlines()]
            blocks.append((args, lines, None if match["rc"] is None else int(match["rc"])))
    return blocks


def pty_run(args: list[str], cwd: Path) -> tuple[str, str, int]:
    """tclip's stdout in an 80-column pseudo-terminal without colour, its stderr, its exit status."""
    import pty
    import tempfile

    code = ("import fcntl, struct, sys, termios; "
            "fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack('HHHH', 50, 80, 0, 0)); "
            "from tclip.cli.entry import main; sys.argv = ['tclip'] + sys.argv[1:]; main()")
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR",)}
    env.update({"COLUMNS": "80", "TERM": "xterm-256color", "NO_COLOR": "1"})
    master, slave = pty.openpty()
    errors = tempfile.TemporaryFile(dir=cwd)
    process = subprocess.Popen([sys.executable, "-c", code, *args], stdout=slave, stderr=errors,
                               stdin=subprocess.DEVNULL, env=env, cwd=cwd)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    process.wait()
    os.close(master)
    errors.seek(0)
    stderr = errors.read().decode("utf-8", "replace")
    errors.close()
    return b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n"), stderr, process.returncode


def without_speed(line: str) -> str:
    """The last line's times and speeds change from run to run; what was read does not."""
    return re.sub(r"  ·  [0-9.]+ s  ·  .*$", "", line.rstrip())


def test_readme_shows_a_first_read_only_run_of_report_info_and_diff():
    commands = {args[0] for args, _, _ in sample_blocks(README)}
    assert {"report", "info", "diff"} <= commands


@pytest.mark.parametrize("args, expected, rc", sample_blocks(), ids=lambda v: " ".join(v) if isinstance(v, list)
                         and v and v[0] in ("report", "info", "diff") else None)
def test_readme_sample_is_what_tclip_prints(tmp_path, args, expected, rc):
    shutil.copytree(ROOT / "samples", tmp_path / "samples", ignore=shutil.ignore_patterns("*.clipped.*", "*.py"))
    clip = next(line for line in README.splitlines() if line.startswith("    pip install . && tclip "))
    assert pty_run(shlex.split(clip.split("&& tclip ", 1)[1]), tmp_path)[2] == 0
    printed, stderr, code = pty_run(args, tmp_path)
    warnings = [line for line in expected if line.startswith("Warning: ")]
    assert set(warnings) <= set(stderr.splitlines()), stderr
    assert [without_speed(line) for line in printed.rstrip("\n").splitlines()] == \
        [without_speed(line) for line in expected if line not in warnings], printed
    if rc is not None:
        assert code == rc
    else:
        assert code in (0, 3)
