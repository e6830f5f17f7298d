"""The HDF5 child's command line, and children started early (no NumPy, no formats here).

The HDF5 library's work on a file happens in a child interpreter
(:mod:`tclip.formats.hdf5.probe`), which spends most of its start importing NumPy and
h5py. Started when the reader opens the file, that comes after tclip's own imports;
started by the command line before them (:func:`prestart`), the two run side by side
on two cores: measured, ``tclip report`` of a small .h5 file 0.65-0.89 s -> 0.37-0.50 s.

A child started early is only a head start: the reader adopts it (:func:`take`) when its
command line is exactly the one it would run and the file is still the one it was
started on (device, inode, size, modification time); anything else is discarded (killed)
and the reader starts its own, as it always did. Children never adopted are killed when
tclip exits.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

HDF5_SUFFIXES = (".h5", ".hdf5")  # the package's SUFFIXES (__init__.py) take these
# The libraries the child imports, told to it by location (see child_command).
_LIBRARIES = ("numpy", "h5py", "ml_dtypes", "hdf5plugin")
_SPARES: dict[tuple[str, ...], tuple[subprocess.Popen[bytes], tuple[int, ...]]] = {}


def child_command(*args: str) -> list[str]:
    """The HDF5 child's command line: an isolated interpreter (``-I``: no current folder, no
    PYTHONPATH, no user site on ``sys.path``; ``-B``: no bytecode written), told exactly
    where tclip and the libraries it imports live.

    ``python -m`` would put the current folder first on ``sys.path``: an ``h5py.py`` or
    ``numpy.py`` there would run in the child (and could make the check pass). The folders
    named here are those this process imported the libraries from, or would import them
    from (found without importing them); each is absolute.
    """
    source = str(Path(__file__).resolve().parents[3])  # the folder holding the tclip package
    libraries = []
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None) if module is not None else _origin(name)
        if origin:
            libraries.append(str(Path(origin).resolve().parents[1]))
    # tclip's folder first (as PYTHONPATH would put it); the libraries' after the
    # interpreter's own, where an isolated child finds them anyway (a venv's site-packages).
    code = (f"import sys; sys.path.insert(0, {source!r}); "
            f"sys.path += [p for p in {libraries!r} if p not in sys.path]; "
            "from tclip.formats.hdf5.walk import main; sys.exit(main())")
    return [sys.executable, "-I", "-B", "-c", code, *args]


def _origin(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.has_location else None


def identity(path: str) -> tuple[int, ...] | None:
    """What says a regular file is still the one it was (None: not a regular file)."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(info.st_mode):
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def prestart(arguments: list[str], limit: int = 2) -> None:
    """Start the HDF5 child for the first ``limit`` arguments naming regular .h5/.hdf5 files
    (what the reader will run for them: ``read`` mode). Never raises: a child that cannot
    start here is started by the reader, which reports why."""
    if os.environ.get("TCLIP_HDF5_PROBE", "1") == "0":
        return
    started = 0
    for argument in arguments:
        if started >= limit:
            break
        if argument.startswith("-") or not argument.lower().endswith(HDF5_SUFFIXES):
            continue
        key = identity(argument)
        if key is None:
            continue
        command = child_command("read", argument)
        try:
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL)
        except (OSError, ValueError):
            return
        if not _SPARES:
            atexit.register(discard_all)
        old = _SPARES.pop(tuple(command), None)
        if old is not None:
            kill_process(old[0])
        _SPARES[tuple(command)] = (process, key)
        started += 1


def take(command: list[str], file: str) -> subprocess.Popen[bytes] | None:
    """A child started early with exactly ``command`` on ``file`` as it still is; else None
    (and a child started for a file changed since is killed)."""
    spare = _SPARES.pop(tuple(command), None)
    if spare is None:
        return None
    process, key = spare
    if key != identity(file) or process.poll() is not None:
        kill_process(process)
        return None
    return process


def discard_all() -> None:
    """Kill every child started early and never adopted."""
    while _SPARES:
        _, (process, _) = _SPARES.popitem()
        kill_process(process)


def kill_process(process: subprocess.Popen[bytes]) -> None:
    """Kill a child, reap it and close its pipes."""
    try:
        process.kill()
    except OSError:
        pass
    process.wait()
    close_pipes(process)


def close_pipes(process: subprocess.Popen[bytes]) -> None:
    """Close a child's stdin and stdout, whatever state they are in."""
    for stream in (process.stdin, process.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
