"""The HDF5 library's work on an untrusted file, done in a child process.

The HDF5 library is C code that trusts a file's metadata more than it should: a
few flipped bits in an object header, a B-tree, a heap or a compressed chunk can
make it crash (SIGSEGV), loop, or fail in ways h5py reports as odd exceptions. tclip
reads untrusted files, so everything the library does with one happens in a child
process (:mod:`tclip.formats.hdf5.walk`), never in tclip's own:

- reading: the child opens the file, walks its structure (groups, links, attributes,
  dataset headers, chunk indexes, overlaps) and sends back a plain description;
  tclip then reads contiguous datasets and unfiltered chunks itself, as raw byte
  regions, and asks the child for everything HDF5 must decode (compressed chunks,
  chunks never written, odd layouts, the values of string datasets). A child that
  only had to walk the file has already ended (about 0.15 s per file, measured on
  the development machine);
- rewriting: tclip copies the file's bytes and writes raw regions itself; datasets
  HDF5 must write (compressed ones) are written by a child that opens the copy.

A child that dies from a signal, runs past its time or its memory refuses the file
with one error line; tclip goes on with the next file. ``TCLIP_HDF5_PROBE=0``
does the library's work in tclip's own process, for files you trust.

The protocol is framed JSON plus raw bytes on the child's stdin and stdout (never
pickle): a request or reply is ``<u4 header length><u4 payload length>``, the header
(a JSON object) and the payload.
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import struct
import subprocess
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from .child import child_command, close_pipes, kill_process, take
from ...errors import FormatError, TclipError, UnsupportedError

# The walk of a file of a few MiB takes well under a second; a hang is refused after this
# long, plus a second per 16 MiB of file (chunk indexes and object headers grow with it).
WALK_SECONDS = 8
WALK_BYTES_PER_SECOND = 16 << 20
# A walking child says it is making progress (:func:`beat`) at least every BEAT_SECONDS while
# tclip's walk goes from object to object; after its first word, one that says nothing for
# STALL_SECONDS (plus a second per 16 MiB of file) is stuck in the library (a malformed heap
# can make HDF5 loop forever) and is refused then, not after WALK_SECONDS. A walk that keeps
# making progress may take up to WALK_MAX_SECONDS (files with a great many objects).
STALL_SECONDS = 3
BEAT_SECONDS = 0.5
WALK_MAX_SECONDS = 600
# A request (a block read or written) may take this long, plus a second per 8 MiB.
REQUEST_SECONDS = 30
REQUEST_BYTES_PER_SECOND = 8 << 20
PROBE_MEMORY_BYTES = 4 << 30
EXIT_OUT_OF_MEMORY = 3
_FRAME = struct.Struct("<II")


def isolated() -> bool:
    """Whether the HDF5 library's work runs in a child (the default) or in this process."""
    return os.environ.get("TCLIP_HDF5_PROBE", "1") != "0"


_beat_sink: list[Any] = []  # in a walking child: the stream progress goes to, and when it last went


def beat() -> None:
    """Say that the walk is making progress: a frame to the parent, at most every BEAT_SECONDS
    (in a walking child; nothing anywhere else)."""
    if _beat_sink:
        now = time.monotonic()
        if now - _beat_sink[1] >= BEAT_SECONDS:
            _beat_sink[1] = now
            send_frame(_beat_sink[0], PROGRESS)


def beats_to(stream: Any | None) -> None:
    """Send :func:`beat`'s frames to ``stream`` from now on (one at once); None: stop."""
    _beat_sink.clear()
    if stream is not None:
        _beat_sink.extend([stream, -math.inf])
        beat()


PROGRESS = {"progress": True}


class ChildGone(Exception):
    """The child ended (or stopped answering) in the middle of a request."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def send_frame(stream: Any, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    """Write one frame to a binary stream (the child's side). A value JSON cannot hold
    (an attribute of an odd type) is sent as its text."""
    text = json.dumps(header, default=str).encode("utf-8")
    stream.write(_FRAME.pack(len(text), len(payload)) + text)
    if len(payload):
        stream.write(payload)
    stream.flush()


def read_frame(stream: Any) -> tuple[dict[str, Any], bytes] | None:
    """Read one frame from a binary stream (the child's side); None at the end of the stream."""
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        return None
    length, size = _FRAME.unpack(head)
    header = json.loads(stream.read(length).decode("utf-8"))
    payload = stream.read(size) if size else b""
    return header, payload


class Child:
    """One child process working on one HDF5 file (see the module's docstring).

    Creating one starts the child on ``file`` and waits ``seconds`` at most for its first
    reply (``first``: the description of the file, or an error); :meth:`request` sends
    one request and returns the reply. Thread-safe: one request at a time. Every way the
    child can fail becomes a :class:`FormatError` naming ``path``.
    """

    def __init__(self, path: Path, mode: str, file: Path, seconds: float) -> None:
        self.path, self.mode = path, mode
        self._lock = threading.Lock()
        self._busy = False
        self.process: subprocess.Popen[bytes] | None = None
        command = child_command(mode, os.fspath(file))
        try:
            # one the command line started early on this very file, or a new one
            self.process = take(command, os.fspath(file)) or subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError as error:
            raise FormatError(f"cannot start the process that reads HDF5 files ({error.strerror or error}); "
                              "TCLIP_HDF5_PROBE=0 reads files you trust in tclip's own process", path) from None
        assert self.process.stdin is not None and self.process.stdout is not None
        self._in, self._out = self.process.stdin.fileno(), self.process.stdout.fileno()
        # A reader dropped without close(): the child ends when its input closes.
        weakref.finalize(self, _end, self.process)
        os.set_blocking(self._in, False)
        self._stall: float | None = None  # while the walk makes progress: how long it may say nothing
        try:
            self._limit = seconds
            start = time.monotonic()
            self.first = self._reply(start + seconds, "reading the file's structure",
                                     stall=(stall_seconds(file), start + WALK_MAX_SECONDS) if mode == "read" else None)
        except BaseException:
            self.kill()
            raise

    def request(self, header: dict[str, Any], payload: bytes | memoryview = b"", *, what: str,
                nbytes: int = 0) -> tuple[dict[str, Any], bytes]:
        """Send one request; the reply (its header and payload). ``what`` names the work for
        errors (e.g. "reading tensor 'w'"); ``nbytes`` sizes its time limit."""
        limit = REQUEST_SECONDS + max(nbytes, len(payload)) / REQUEST_BYTES_PER_SECOND
        deadline = time.monotonic() + limit
        with self._lock:
            self._limit, self._stall = limit, None
            if self.process is None:
                raise FormatError(f"the process that reads the file has ended; {what} is not possible", self.path)
            text = json.dumps(header).encode("utf-8")
            self._busy = True  # until the whole reply is in: a request abandoned midway ends the child
            try:
                self._write(_FRAME.pack(len(text), len(payload)) + text, deadline)
                if len(payload):
                    self._write(memoryview(payload).cast("B"), deadline)
            except ChildGone:
                pass  # the reply (none) says how it ended
            return self._reply(deadline, what)

    def close(self) -> int | None:
        """End the child (it ends on its own when its input closes); its exit status.
        A child still at work on a request that was abandoned (Ctrl-C) is killed."""
        if self._busy:
            self.kill()
            return None
        process, self.process = self.process, None
        if process is None:
            return None
        try:
            assert process.stdin is not None and process.stdout is not None
            process.stdin.close()
        except OSError:
            pass
        try:
            return process.wait(timeout=REQUEST_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()
        finally:
            assert process.stdout is not None
            process.stdout.close()

    def kill(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            kill_process(process)

    # ------------------------------------------------------------------ the pipes

    def _write(self, data: bytes | memoryview, deadline: float) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChildGone("timeout")
            _, ready, _ = select.select([], [self._in], [], remaining)
            if not ready:
                continue
            try:
                done = os.write(self._in, view[:1 << 20])
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                raise ChildGone("gone") from None
            view = view[done:]

    def _read(self, count: int, deadline: float) -> bytes:
        parts, missing = [], count
        while missing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChildGone("timeout")
            ready, _, _ = select.select([self._out], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(self._out, min(missing, 1 << 20))
            if not chunk:
                raise ChildGone("gone")
            parts.append(chunk)
            missing -= len(chunk)
        return b"".join(parts)

    def _reply(self, deadline: float, what: str,
               stall: tuple[float, float] | None = None) -> tuple[dict[str, Any], bytes]:
        """The next reply; with ``stall`` (seconds, end), progress frames move the deadline to
        that many seconds later, never past ``end``."""
        try:
            while True:
                length, size = _FRAME.unpack(self._read(_FRAME.size, deadline))
                header = json.loads(self._read(length, deadline).decode("utf-8"))
                payload = self._read(size, deadline) if size else b""
                if stall is None or header != PROGRESS or payload:
                    break
                seconds, end = stall
                deadline = min(time.monotonic() + seconds, end)
                # which limit a silence would hit: the stall, or the walk's whole time
                self._stall, self._limit = (seconds if deadline < end else None), WALK_MAX_SECONDS
            self._busy = False
        except ChildGone as gone:
            raise self._failure(gone.what, what) from None
        except (ValueError, struct.error):
            self.kill()
            raise FormatError(f"the process that reads the file answered nonsense while {what}", self.path) from None
        if "error" in header:
            kind = UnsupportedError if header.get("kind") == "unsupported" else FormatError
            raise kind(str(header["error"]), self.path)
        return header, payload

    def _failure(self, how: str, what: str) -> TclipError:
        process = self.process
        if how == "timeout" or process is None:
            self.kill()
            if self._stall is not None:
                return FormatError(f"{what}: the HDF5 library made no progress for {self._stall:.0f} s in a "
                                   "separate process; refused as malformed", self.path)
            return FormatError(f"{what} took the HDF5 library more than {self._limit:.0f} s in a separate "
                               "process; refused as malformed", self.path)
        try:
            status = process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = None
        self.kill()
        if status is not None and status < 0:
            try:
                name = signal.Signals(-status).name
            except ValueError:
                name = f"signal {-status}"
            return FormatError(f"the HDF5 library crashed ({name}) {what} in a separate process; "
                               "the file is malformed", self.path)
        if status == EXIT_OUT_OF_MEMORY:
            return FormatError(f"{what} needed more than {PROBE_MEMORY_BYTES >> 30} GiB in a separate process; "
                               "refused as malformed", self.path)
        return FormatError(f"the process {what} ended unexpectedly (exit status {status}); "
                           "the file may be malformed", self.path)


def _end(process: subprocess.Popen[bytes]) -> None:
    close_pipes(process)  # end of input: the child leaves on its own
    try:
        process.wait(timeout=REQUEST_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def stall_seconds(path: Path) -> float:
    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0
    return STALL_SECONDS + size / WALK_BYTES_PER_SECOND


def walk_seconds(path: Path) -> float:
    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0
    return WALK_SECONDS + size / WALK_BYTES_PER_SECOND


# ------------------------------------------------------------------ values that are not numbers


def encode_values(array: Any) -> tuple[dict[str, Any], bytes]:
    """A dataset's values (``other_values``) as a reply: raw bytes under a NumPy type
    description, or, where they hold Python objects (variable-length strings), one
    canonical byte string per element (equal exactly when the values are)."""
    import numpy as np
    from numpy.lib import format as npy_format

    array = np.asarray(array)
    if not array.dtype.hasobject:
        return {"descr": npy_format.dtype_to_descr(array.dtype), "shape": list(array.shape)}, \
            np.ascontiguousarray(array).tobytes()
    parts = [_canonical(value) for value in array.reshape(-1)]
    lengths = np.asarray([len(p) for p in parts], np.int64)
    return {"objects": len(parts), "shape": list(array.shape)}, lengths.tobytes() + b"".join(parts)


def decode_values(header: dict[str, Any], payload: bytes) -> Any:
    """The parent's side of :func:`encode_values`; None for a reply of no values."""
    import numpy as np
    from numpy.lib import format as npy_format

    if header.get("none"):
        return None
    shape = tuple(header["shape"])
    if "descr" in header:
        dtype = npy_format.descr_to_dtype(_descr(header["descr"]))
        if dtype.hasobject or len(payload) != math_prod(shape) * dtype.itemsize:
            return None
        return np.frombuffer(payload, dtype).reshape(shape)
    count = int(header["objects"])
    if count != math_prod(shape) or len(payload) < 8 * count:
        return None
    lengths = np.frombuffer(payload[:8 * count], np.int64)
    out = np.empty(count, object)
    position = 8 * count
    for i, length in enumerate(lengths.tolist()):
        out[i] = payload[position:position + length]
        position += length
    return out.reshape(shape)


def math_prod(shape: tuple[int, ...]) -> int:
    total = 1
    for n in shape:
        total *= int(n)
    return total


def _descr(value: Any) -> Any:
    """A dtype description back from JSON (lists where NumPy wrote tuples)."""
    if isinstance(value, list):
        return [tuple(_descr(part) if i == 1 else (tuple(part) if i == 2 else part)
                      for i, part in enumerate(field)) for field in value]
    return value


def _canonical(value: Any) -> bytes:
    import numpy as np

    if isinstance(value, bytes):
        return b"b" + value
    if isinstance(value, str):
        return b"s" + value.encode("utf-8", "surrogatepass")
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return b"o" + repr(value.shape).encode() + b"".join(_framed(v) for v in value.reshape(-1))
        return b"a" + value.dtype.str.encode() + repr(value.shape).encode() + b":" + value.tobytes()
    if isinstance(value, np.void) and value.dtype.names:
        return b"v" + b"".join(_framed(value[key]) for key in value.dtype.names)
    return b"r" + repr(value).encode("utf-8", "backslashreplace")


def _framed(value: Any) -> bytes:
    data = _canonical(value)
    return struct.pack("<Q", len(data)) + data
