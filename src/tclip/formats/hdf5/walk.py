"""The child process that does the HDF5 library's work on a file (see :mod:`tclip.formats.hdf5.probe`).

``read FILE``: open the file as tclip does (:class:`~tclip.formats.hdf5.Hdf5Reader` with h5py in
this process), send its description, then, if reading it needs HDF5 itself, answer requests
(``read``, ``flat``, ``values``) until the input ends.

``write FILE``: open tclip's own copy of a file for writing and write the blocks sent
(``write``) until ``finish``, which flushes and closes it.

Limits: 4 GiB of memory (exit status 3 beyond); the parent bounds the time. An error tclip
reports (a :class:`~tclip.errors.TclipError`, or an exception of h5py) is a reply, and the
process goes on; a crash of the library ends only this process.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from .probe import EXIT_OUT_OF_MEMORY, PROBE_MEMORY_BYTES, beats_to, encode_values, read_frame, send_frame


def _error_reply(error: BaseException) -> dict[str, Any]:
    from ...errors import TclipError, UnsupportedError
    from .safety import _first_line

    if isinstance(error, TclipError):
        return {"error": error.detail, "kind": "unsupported" if isinstance(error, UnsupportedError) else "format"}
    return {"error": f"the HDF5 library failed ({_first_line(error)})", "kind": "format"}


def _serve_reader(path: str, out: Any, requests: Any) -> int:
    import numpy as np

    from ...errors import TclipError
    from .reader import Hdf5Reader
    from .safety import _H5_ERRORS, import_h5py

    import_h5py()  # (its time is the first reply's, not a stall)
    beats_to(out)  # the walk says it makes progress: a library stuck in a loop is told apart
    try:
        reader = Hdf5Reader(Path(path), isolated=False)
    except (TclipError, *_H5_ERRORS) as error:
        beats_to(None)
        send_frame(out, _error_reply(error))
        return 0
    try:
        description, table = reader.describe()
        serving = reader.needs_library()
        beats_to(None)
        send_frame(out, {"description": description, "serving": serving}, table)
        while True:
            frame = read_frame(requests)
            if frame is None:
                return 0
            request, _ = frame
            try:
                op, name = request["op"], request["name"]
                if op == "values":
                    values = reader.other_values(name, int(request["limit"]))
                    if values is None:
                        send_frame(out, {"none": True})
                    else:
                        send_frame(out, *encode_values(values))
                    continue
                if op == "flat":
                    data = reader.read_flat(name, int(request["start"]), int(request["stop"]))
                elif op == "read":
                    index = tuple(slice(int(a), int(b)) for a, b in request["index"])
                    data = reader.read(name, index if index else None)
                else:
                    raise ValueError(f"unknown request {op!r}")
                data = np.ascontiguousarray(data)
                send_frame(out, {"dtype": data.dtype.str, "shape": list(data.shape)}, data.reshape(-1).view(np.uint8))
            except MemoryError:
                raise
            except (TclipError, *_H5_ERRORS, KeyError) as error:
                send_frame(out, _error_reply(error))
    finally:
        reader.close()


def _serve_writer(path: str, out: Any, requests: Any) -> int:
    import numpy as np

    from ...errors import TclipError
    from .safety import _H5_ERRORS
    from .writer import DatasetWrites

    try:
        writes = DatasetWrites(Path(path))
    except (TclipError, *_H5_ERRORS) as error:
        send_frame(out, _error_reply(error))
        return 0
    send_frame(out, {"ready": True})
    try:
        while True:
            frame = read_frame(requests)
            if frame is None:
                return 1  # ended without finishing: the copy is thrown away
            request, payload = frame
            try:
                if request["op"] == "finish":
                    writes.close()
                    send_frame(out, {"done": True})
                    return 0
                shape = tuple(int(n) for n in request["shape"])
                data = np.frombuffer(payload, np.dtype(request["dtype"])).reshape(shape)
                index = tuple(slice(int(a), int(b)) for a, b in request["index"])
                writes.write(request["name"], index, data)
                send_frame(out, {})
            except MemoryError:
                raise
            except (TclipError, *_H5_ERRORS) as error:
                send_frame(out, _error_reply(error))
    finally:
        writes.abandon()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops; this one ends when its input does
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (PROBE_MEMORY_BYTES, PROBE_MEMORY_BYTES))
    except (ImportError, ValueError, OSError):
        pass
    mode, path = argv
    # The replies get a descriptor of their own; whatever a library prints goes where stderr goes.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    try:
        if mode == "read":
            return _serve_reader(path, out, requests)
        return _serve_writer(path, out, requests)
    except MemoryError:
        return EXIT_OUT_OF_MEMORY
    except (BrokenPipeError, ConnectionResetError):
        return 1


if __name__ == "__main__":
    sys.exit(main())
