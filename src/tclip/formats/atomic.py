"""Outputs that appear atomically: a temporary file beside the target, renamed over it
only when everything was written and fsynced; never a write through a planted link.

Also the sweep of temporary files that killed runs left, and the commit markers an
in-place rewrite of a tensor set leaves beside a shard just before its rename.
Standard library only: the command line's signal handler reads :data:`LIVE_TEMPS`
without importing NumPy.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
import threading
from pathlib import Path
from typing import Any

from ..errors import OutputExistsError, TclipError
from ..messages import Option


def _rename_noreplace(source: Path, target: Path) -> bool:
    """Move ``source`` to ``target`` unless ``target`` exists, atomically; False if it exists.

    Checking for the target and then renaming would race with another run
    writing the same output. A hard link fails atomically when the target
    exists (then the temporary name is removed); where the file system has no
    hard links, ``renameat2(RENAME_NOREPLACE)`` does the same in one call.
    Only where neither exists does a check-then-rename remain.
    """
    try:
        os.link(source, target)
    except FileExistsError:
        return False
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK,
                               errno.ENOSYS, errno.EACCES):
            raise
        done = _renameat2_noreplace(source, target)
        if done is None:  # neither links nor renameat2 here
            if os.path.lexists(target):
                return False
            os.rename(source, target)
        return done is not False
    os.unlink(source)
    return True


def _renameat2_noreplace(source: Path, target: Path) -> bool | None:
    """renameat2 with RENAME_NOREPLACE (Linux); None where it is unavailable."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # only on file systems without hard links: a rare path

    libc = ctypes.CDLL(None, use_errno=True)
    function = getattr(libc, "renameat2", None)
    if function is None:
        return None
    at_fdcwd, rename_noreplace = -100, 1
    result = function(at_fdcwd, os.fsencode(source), at_fdcwd, os.fsencode(target), rename_noreplace)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code == errno.EEXIST:
        return False
    if code in (errno.ENOSYS, errno.EINVAL):
        return None
    raise OSError(code, os.strerror(code), str(target))


TEMP_SUFFIX = ".tclip-tmp"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _host_name() -> str:
    # os.uname()'s node name is what socket.gethostname() returns on POSIX, without
    # importing socket (about 3 ms of every command's start-up).
    if hasattr(os, "uname"):
        return os.uname().nodename
    import socket

    return socket.gethostname()


_HOST = re.sub(r"[^A-Za-z0-9-]", "-", _host_name())[:40] or "host"


def _token() -> str:
    """Eight random hex digits, as secrets.token_hex(4) (from os.urandom too), without
    importing secrets and hashlib (5 ms)."""
    return os.urandom(4).hex()
# .NAME.HOST.PID.TOKEN.tclip-tmp
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tclip-tmp$")

# Temporary files of this process that exist right now: a signal handler
# removes them before the process ends (see tclip.cli).
LIVE_TEMPS: set[str] = set()
# Temporary files given up (removed unfinished) by this process, for the last words on a signal.
ABANDONED_TEMPS = [0]


_SWEPT: set[str] = set()


def remove_stale_temps(folder: Path) -> list[Path]:
    """Remove temporary files that earlier tclip runs on this host left in ``folder``
    (killed with SIGKILL, or a power loss): those whose process no longer exists.
    Each folder is looked at once per process."""
    removed: list[Path] = []
    key = os.path.realpath(folder)
    if key in _SWEPT:
        return removed
    _SWEPT.add(key)
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
        if not match or match["host"] != _HOST:
            continue
        pid = int(match["pid"])
        if pid == os.getpid() or _process_exists(pid):
            continue
        try:
            os.unlink(entry.path)
            removed.append(Path(entry.path))
        except OSError:
            pass
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


class AtomicOutput:
    """A temporary file beside ``target`` that replaces it only on :meth:`commit`.

    The temporary file is named ``.NAME.HOST.PID.TOKEN.tclip-tmp`` and created
    at once with the output's final permissions (never wider: a private input
    stays private while it is being written); every error path removes it, a
    signal handler removes it on SIGINT/SIGTERM/SIGHUP, and one left by a
    killed run is removed by the next run that writes to the same folder.
    """

    def __init__(self, target: Path, *, overwrite: bool = False, mode_from: Path | None = None) -> None:
        self.target = Path(target)
        if not overwrite and os.path.lexists(self.target):
            raise OutputExistsError(("output already exists; pass ", Option.FORCE, " to replace it"), self.target)
        if not self.target.parent.is_dir():
            raise TclipError("output directory does not exist", self.target.parent)
        remove_stale_temps(self.target.parent)
        self.mode = 0o644 & ~_umask()
        if mode_from is not None:
            try:
                # setuid/setgid/sticky bits are dropped: an output is data, never a program.
                self.mode = os.stat(mode_from).st_mode & 0o777
            except OSError:
                pass
        token = _token()
        self.temp = self.target.parent / f".{self.target.name}.{_HOST}.{os.getpid()}.{token}{TEMP_SUFFIX}"
        self.overwrite = overwrite
        self._done = False
        self.written: tuple[int, int, int] | None = None  # the file committed (see file_identity)
        # Registered before it exists: a signal between the file's creation and its
        # registration would otherwise leave it behind (the handler removes what is
        # registered, and a name not yet created costs it nothing).
        LIVE_TEMPS.add(str(self.temp))
        self._fd = -1
        try:
            # O_EXCL: a link planted at this name fails the call, it is never followed.
            self._fd = os.open(self.temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
        except OSError as error:
            LIVE_TEMPS.discard(str(self.temp))
            raise TclipError(f"cannot write to this folder ({error.strerror or error})", self.target.parent) \
                from None
        # The file stays open until commit or abort: writers get copies of this descriptor,
        # never the file found under the name (whoever else can write to the folder could
        # have put a link there meanwhile), and its inode number cannot be reused meanwhile.
        st = os.fstat(self._fd)
        self._identity = (st.st_dev, st.st_ino)
        os.fchmod(self._fd, self.mode)

    def open(self) -> int:
        """A new descriptor of the temporary file, for reading and writing (the caller closes it)."""
        return os.dup(self._fd)

    def check(self) -> None:
        """The name of the temporary file is still this file (before a library opens it by
        name, as h5py does, and before the rename): a link or another file put in its place is
        never written through, nor renamed to the target."""
        try:
            st = os.lstat(self.temp)
        except OSError:
            raise self._replaced() from None
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != self._identity:
            raise self._replaced()

    def _replaced(self) -> TclipError:
        return TclipError(f"the temporary file {self.temp.name} was replaced while tclip wrote it (by a link or "
                          "another file); nothing was written through it", self.target.parent)

    def _release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def commit(self, marker: Path | None = None) -> None:
        """Make the temporary file the target. With ``marker``, first write there (durably)
        which file is about to become the target (its device, inode and size, which the
        rename keeps): after a crash between the rename and whatever the caller records
        next, the marker tells the new file from the old (see tclip.work.journal)."""
        try:
            self.check()
            os.fsync(self._fd)
            os.fchmod(self._fd, self.mode)  # libraries that recreate the file (h5py) may have changed it
            final = os.fstat(self._fd)
            if marker is not None:
                write_marker(marker, final)
            if self.overwrite:
                os.replace(self.temp, self.target)
            elif not _rename_noreplace(self.temp, self.target):
                self.abort()
                raise OutputExistsError(("output already exists (it appeared while writing); pass ", Option.FORCE,
                                         " to replace it"), self.target)
            self._done = True
            self.written = file_identity(final)
            self._release()
            LIVE_TEMPS.discard(str(self.temp))
            dir_fd = os.open(self.target.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as error:
            self.abort()
            raise TclipError(f"cannot write output: {error.strerror or error}", self.target) from error
        except TclipError:
            self.abort()
            raise

    def abort(self) -> None:
        self._release()
        if not self._done:
            try:
                self.temp.unlink()
            except FileNotFoundError:
                pass
            self._done = True
            LIVE_TEMPS.discard(str(self.temp))
            ABANDONED_TEMPS[0] += 1


def write_marker(marker: Path, st: os.stat_result) -> None:
    """``{"device", "inode", "size"}`` of a file, written to ``marker`` and fsynced."""
    data = json.dumps({"device": st.st_dev, "inode": st.st_ino, "size": st.st_size}).encode()
    # A fresh file, never one found there: a symlink (or a hard link to another file)
    # planted at the marker's name is removed, not written through.
    Path(marker).unlink(missing_ok=True)
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def marker_names(marker: Path, path: Path) -> bool:
    """Whether ``marker`` (see :func:`write_marker`) describes the file now at ``path``."""
    try:
        data = json.loads(Path(marker).read_bytes())
        st = os.stat(path)
        return [data["device"], data["inode"], data["size"]] == [st.st_dev, st.st_ino, st.st_size]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def file_identity(st: os.stat_result) -> tuple[int, int, int]:
    """What tells one version of a file from another: (inode, size, mtime in ns). The device
    number is left out: a shared file system's differs between the machines of a cluster,
    and a path names one file system anyway."""
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def identity_of(path: Path | str) -> tuple[int, int, int] | None:
    """:func:`file_identity` of the file at ``path`` (links followed); None when there is none."""
    try:
        return file_identity(os.stat(path))
    except OSError:
        return None


def remove_if_same(path: Path | str, identity: tuple[int, int, int]) -> bool:
    """Remove ``path`` only while it is the file of ``identity`` (a file this run wrote), never
    whatever else was put at that name since; True if removed."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or file_identity(st) != identity:
        return False
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    with _UMASK_LOCK:  # reading the umask means setting it
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def write_json(target: Path, data: Any, mode_from: Path | None = None,
               overwrite: bool = True) -> tuple[int, int, int] | None:
    """``data`` as indented JSON at ``target``, atomically (an index, a journal); the
    :func:`file_identity` of the file written."""
    output = AtomicOutput(target, overwrite=overwrite, mode_from=mode_from)
    try:
        with os.fdopen(output.open(), "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, ensure_ascii=False)
            handle.write("\n")
        output.commit()
    except BaseException:
        output.abort()
        raise
    return output.written
