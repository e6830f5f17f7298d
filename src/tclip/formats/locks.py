"""Advisory locks that keep two tclip runs off the same files at once.

An ``--in-place`` run holds an exclusive lock on every file it replaces (a set's
index and each shard, or the one file), a run writing a sharded checkpoint into
``--out-dir`` one on that folder, and it holds a shared lock on the index it reads.
A second run that wants a lock held against it fails at once with one error naming
the holder's process id: two runs clipping the same shards would scale them twice.

The locks are ``flock`` locks on a lock file beside what they protect
(``.NAME.tclip-lock``; a folder's is ``FOLDER/.tclip-lock``): the kernel drops them
when their process ends, however it ends, so a killed run never blocks the next.
The holder of an exclusive lock writes its pid into a lock file it created itself
and removes that file when done; a run that finds a lock file nobody holds (left by
a kill) takes the lock, removes the file and starts afresh. Every taker checks, once
it holds the lock, that the file it locked is still the one at the name (a run that
was releasing may have removed it meanwhile), and tries again if not.

Standard library only.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from ..errors import TclipError

LOCK_SUFFIX = ".tclip-lock"
FOLDER_LOCK = LOCK_SUFFIX  # a folder's lock file, inside it
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locks (README)
    fcntl = None  # type: ignore[assignment]


def lock_file(path: Path, folder: bool = False) -> Path:
    """Where the lock of ``path`` is: beside the file it names (a symlink's target: two
    names of one file share a lock), or inside a folder."""
    real = Path(os.path.realpath(path))
    if folder:
        return real / FOLDER_LOCK
    return real.with_name(f".{real.name}{LOCK_SUFFIX}")


class Busy(TclipError):
    """Another tclip run holds a lock this run needs."""


class RunLock:
    """One lock held by this run (see the module's docstring). ``required`` False: a
    lock file that cannot be created (a read-only folder) is done without, silently:
    nothing there can be rewritten either."""

    def __init__(self, path: Path, *, shared: bool = False, folder: bool = False, required: bool = True,
                 doing: str = "rewritten") -> None:
        self.path = Path(path)
        self.target = lock_file(path, folder)
        self.shared = shared
        self.required = required
        self.doing = doing
        self.fd = -1
        self._mine = False  # this run created the lock file (and wrote its pid there)

    def acquire(self) -> RunLock:
        if fcntl is None:
            return self
        for _ in range(100):  # each retry follows another run's removal of the file: never endless
            fd, created = self._open()
            if fd < 0:
                return self
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except OSError as error:
                holder = _pid_in(fd)
                os.close(fd)
                if error.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    self._cannot(error)
                    return self
                who = f"another tclip run (pid {holder})" if holder else "another tclip run"
                raise Busy(f"is being {self.doing} by {who}; nothing was done (try again when it has finished)",
                           self.path) from None
            if not _still_named(fd, self.target):
                os.close(fd)  # the file was removed by a run that let go of it: take the new one
                continue
            if not self.shared and not created:
                # A lock file nobody held (a killed run's): replaced by one of this run's own.
                _unlink_quietly(self.target)
                os.close(fd)
                continue
            self.fd, self._mine = fd, created
            if created and not self.shared:
                os.write(fd, f"{os.getpid()}\n".encode())
            return self
        raise TclipError("cannot take its lock (its lock file keeps being replaced)", self.path)

    def _open(self) -> tuple[int, bool]:
        try:
            return os.open(self.target, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644), True
        except FileExistsError:
            pass
        except OSError as error:
            return self._cannot(error), False
        try:
            # Never written: a link or another file planted at the name is only read and locked.
            fd = os.open(self.target, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC)
        except FileNotFoundError:
            return self._open()  # removed between the two calls
        except OSError as error:
            return self._cannot(error), False
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return self._cannot(OSError(errno.EINVAL, "not a regular file")), False
        return fd, False

    def _cannot(self, error: OSError) -> int:
        if not self.required:
            return -1
        raise TclipError(f"cannot take its lock ({self.target.name}: {error.strerror or error})", self.path)

    def release(self) -> None:
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        try:
            if not self.shared:
                remove = True
            else:
                # The last reader removes the file: the one that can take it whole.
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    remove = True
                except OSError:
                    remove = False
            if remove and _still_named(fd, self.target):
                _unlink_quietly(self.target)
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class Locks:
    """Several locks taken in a fixed order (by lock file), released together."""

    def __init__(self) -> None:
        self.held: list[RunLock] = []

    def take(self, lock: RunLock) -> None:
        if any(h.target == lock.target for h in self.held):
            return
        self.held.append(lock.acquire())

    def release(self) -> None:
        while self.held:
            self.held.pop().release()

    def __enter__(self) -> Locks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _pid_in(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() and len(text) < 12 else None


def _still_named(fd: int, target: Path) -> bool:
    try:
        st = os.lstat(target)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def shared_locks(paths: Iterable[Path]) -> Locks:
    """Shared locks on what a read-only run reads as a whole (a set's index: a run rewriting the
    set in place holds it exclusively while it replaces the shards one by one), done without
    where no lock file can be made (a read-only folder, where nothing is rewritten either)."""
    locks = Locks()
    try:
        for path in sorted(paths, key=os.path.realpath):
            locks.take(RunLock(path, shared=True, required=False))
    except BaseException:
        locks.release()
        raise
    return locks
