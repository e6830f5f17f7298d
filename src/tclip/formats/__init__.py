"""The format layer: open any tensor file for reading, create a writer like it.

Formats are detected by content (magic bytes) first, then by suffix; the output
format follows the output path's suffix, so writing ``x.safetensors`` from an
.npz converts it.
"""

from __future__ import annotations

import importlib
import json
import os
import stat
import struct
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ..errors import FormatError, TclipError
from .base import (
    DEFAULT_BLOCK_BYTES,
    AtomicOutput,
    Index,
    TensorInfo,
    TensorReader,
    TensorWriter,
)

NPY_MAGIC = b"\x93NUMPY"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "KERAS_WEIGHTS_SUFFIX",
    "Index",
    "TensorInfo",
    "TensorReader",
    "TensorWriter",
    "detect_format",
    "format_for_suffix",
    "open_reader",
    "create_writer",
    "SUFFIXES",
]

# format -> (module, reader class, writer class); modules are imported on first
# use, so a run that never meets HDF5 never pays for importing h5py.
FORMATS: dict[str, tuple[str, str, str]] = {
    "npy": ("npy", "NpyReader", "NpyWriter"),
    "npz": ("npz", "NpzReader", "npz_writer_for"),
    "safetensors": ("safetensors", "SafetensorsReader", "SafetensorsWriter"),
    "hdf5": ("hdf5", "Hdf5Reader", "Hdf5Writer"),
}


def _format_class(kind: str, role: int) -> Any:
    module = importlib.import_module(f"{__name__}.{FORMATS[kind][0]}")
    return getattr(module, FORMATS[kind][role])


# What a damaged file makes parsers raise besides tclip's own errors.
_MALFORMED = (ValueError, TypeError, KeyError, IndexError, OverflowError, struct.error, RecursionError,
              UnicodeError, NotImplementedError, RuntimeError, EOFError, LookupError)

SUFFIXES = {".npy": "npy", ".npz": "npz", ".safetensors": "safetensors", ".h5": "hdf5", ".hdf5": "hdf5"}
# Keras 3 loads weights only from names ending so: tclip's outputs keep the ending whole.
KERAS_WEIGHTS_SUFFIX = ".weights.h5"


def format_for_suffix(path: Path) -> str | None:
    return SUFFIXES.get(Path(path).suffix.lower())


def _sniff(head: bytes, size: int) -> str | None:
    if head.startswith(NPY_MAGIC):
        return "npy"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "npz"
    if head.startswith(HDF5_SIGNATURE):
        return "hdf5"
    if len(head) >= 9:
        (header_length,) = struct.unpack("<Q", head[:8])
        if 8 + header_length <= size and head[8:9] == b"{":
            return "safetensors"
    return None


def detect_format(path: Path) -> str:
    """The format of a file by its first bytes, else by its suffix."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.close(fd)
            raise IsADirectoryError
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise TclipError("not a regular file (a FIFO, device or socket is never read)", path)
        with os.fdopen(fd, "rb") as handle:
            head = handle.read(16)
            size = path.stat().st_size
            found = _sniff(head, size)
            if found is None and size >= 520:
                # HDF5 may sit behind a user block of 512, 1024, 2048... bytes.
                offset = 512
                while offset + 8 <= size and found is None:
                    handle.seek(offset)
                    if handle.read(8) == HDF5_SIGNATURE:
                        found = "hdf5"
                    offset *= 2
    except IsADirectoryError:
        raise TclipError("is a directory", path) from None
    except FileNotFoundError:
        raise TclipError("no such file", path) from None
    except PermissionError:
        raise TclipError("permission denied", path) from None
    except OSError as error:
        raise TclipError(f"cannot read ({error.strerror or error})", path) from None
    if found is None:
        found = format_for_suffix(path)
    if found is None:
        raise FormatError("not a tensor file tclip knows (.npy, .npz, .safetensors, .h5/.hdf5)", path)
    return found


def open_reader(path: Path | str) -> TensorReader:
    """Open a tensor file lazily; raises a TclipError naming the file when it cannot."""
    path = Path(path)
    kind = detect_format(path)
    try:
        return _format_class(kind, 1)(path)
    except TclipError:
        raise
    except MemoryError:
        raise FormatError("a size in the header is impossibly large", path) from None
    except OSError as error:
        raise TclipError(f"cannot read ({error.strerror or error})", path) from None
    except _MALFORMED as error:
        text = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise FormatError(f"malformed {kind} file ({text})", path) from None


def create_writer(
    target: Path | str,
    like: TensorReader,
    *,
    tensors: list[TensorInfo] | None = None,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    rewritten: Collection[str] | None = None,
) -> TensorWriter:
    """A writer for ``target`` (format by suffix) holding ``like``'s tensors and metadata.

    Nothing appears at ``target`` until :meth:`TensorWriter.commit`; an existing
    target is refused unless ``overwrite``. The source file's permissions carry
    over. ``rewritten`` names the tensors that will be written anew (the others
    are copied): a writer of the source's own format then starts from a copy of
    the source without them and writes them in place.
    """
    target = Path(target)
    # A target without a known suffix (an input recognised by its content,
    # rewritten in place or beside itself) keeps the input's format.
    kind = format_for_suffix(target) or (like.format_name if format_for_suffix(like.path) is None else None)
    if kind is None:
        raise TclipError("unknown output format: use .npy, .npz, .safetensors, .h5 or .hdf5", target)
    tensors = list(like.tensors.values()) if tensors is None else tensors
    # The output takes the input's permissions (a rewrite in place keeps them).
    output = AtomicOutput(target, overwrite=overwrite, mode_from=like.path)
    try:
        if kind in ("safetensors", "hdf5"):
            carry = metadata
            if carry is None and like.format_name != kind:
                carry = _portable_metadata(like.metadata) if like.metadata else None
            return _format_class(kind, 2)(target, tensors, output, like=like, metadata=carry, rewritten=rewritten)
        return _format_class(kind, 2)(target, tensors, output, like=like, rewritten=rewritten)
    except TclipError as error:
        output.abort()
        if error.path is None:
            raise type(error)(error.detail, target) from None
        raise
    except BaseException:
        output.abort()
        raise


def _portable_metadata(metadata: dict[str, Any]) -> dict[str, str]:
    """Metadata as strings, the only values safetensors can hold."""
    out = {}
    for key, value in metadata.items():
        out[str(key)] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out
