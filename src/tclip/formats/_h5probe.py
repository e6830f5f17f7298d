"""Walk an HDF5 file's structure in a child process before tclip opens it.

The HDF5 library is C code that trusts a file's metadata more than it should:
a few flipped bits in an object header or a B-tree can make it crash
(SIGSEGV) or loop. tclip reads untrusted files, so it first walks the whole
structure -- every group, link, attribute, dataset header, the chunk index of
every chunked dataset and the first element of every tensor -- in a child
process with limits on memory and time. If the child dies from a signal or
runs out of time, the file is refused with one error line and tclip goes on
with the next file; otherwise tclip opens the file itself.

The child costs one interpreter start with h5py (about 0.15 s, measured on the
development machine), once per HDF5 file and run. ``TCLIP_HDF5_PROBE=0`` skips
it for files you trust.

    python -I -c 'import sys; from tclip.formats._h5walk import main; sys.exit(main())' FILE  # 0: walk done

The child's body is :mod:`tclip.formats._h5walk` (it imports the HDF5 reader; this module,
which the reader imports, does not).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from ..errors import FormatError

PROBE_SECONDS = 60
PROBE_MEMORY_BYTES = 4 << 30
_CHECKED: set[tuple[int, int, int, int]] = set()


def check_in_child(path: Path) -> None:
    """Refuse ``path`` if walking its structure crashes or hangs a child process."""
    if os.environ.get("TCLIP_HDF5_PROBE", "1") == "0":
        return
    try:
        stat = os.stat(path)
    except OSError:
        return  # opening it reports the problem
    key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key in _CHECKED:
        return
    import subprocess  # here, not with the module: the format registry imports the HDF5 module always

    try:
        result = subprocess.run(child_command(os.fspath(path)), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=PROBE_SECONDS)
    except subprocess.TimeoutExpired:
        raise FormatError(f"reading the file's structure took more than {PROBE_SECONDS} s in a check "
                          "run before opening it; refused as malformed", path) from None
    except OSError:
        return  # no child could be started: tclip opens the file itself
    if result.returncode < 0:
        try:
            name = signal.Signals(-result.returncode).name
        except ValueError:
            name = f"signal {-result.returncode}"
        raise FormatError(f"the HDF5 library crashed ({name}) reading the file's structure in a check run "
                          "before opening it; the file is malformed", path)
    if result.returncode == 3:
        raise FormatError("reading the file's structure needed more than "
                          f"{PROBE_MEMORY_BYTES >> 30} GiB in a check run before opening it; "
                          "refused as malformed", path)
    _CHECKED.add(key)


def child_command(path: str) -> list[str]:
    """The probe's command line: an isolated interpreter (``-I``: no current folder, no
    PYTHONPATH, no user site on ``sys.path``; ``-B``: no bytecode written), told exactly
    where tclip and the libraries it imports live.

    ``python -m`` would put the current folder first on ``sys.path``: an ``h5py.py`` or
    ``numpy.py`` there would run in the child (and could make the check pass). The
    folders named here are the ones this process imported them from; each is absolute.
    """
    source = str(Path(__file__).resolve().parents[2])  # the folder holding the tclip package
    modules = [sys.modules.get(name) for name in ("numpy", "h5py", "ml_dtypes", "hdf5plugin")]
    libraries = [str(Path(module.__file__).resolve().parents[1]) for module in modules
                 if module is not None and getattr(module, "__file__", None)]
    # tclip's folder first (as PYTHONPATH would put it); the libraries' after the
    # interpreter's own, where an isolated child finds them anyway (a venv's site-packages).
    code = (f"import sys; sys.path.insert(0, {source!r}); "
            f"sys.path += [p for p in {libraries!r} if p not in sys.path]; "
            "from tclip.formats._h5walk import main; sys.exit(main())")
    return [sys.executable, "-I", "-B", "-c", code, path]
