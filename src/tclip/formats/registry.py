"""The formats tclip knows, built from their modules: detection, opening, writers like a reader.

A format is one module exporting:

- ``NAME``: its name in reports and JSON (``"safetensors"``);
- ``SUFFIXES``: the file name endings it is recognised and written by, lower case;
- ``sniff(head: bytes, size: int) -> bool``: whether the first bytes of a file of
  ``size`` bytes (``HEAD_BYTES``, fewer when the file is shorter) are this format's;
- ``Reader(path)``: a :class:`~tclip.formats.base.TensorReader`;
- ``Writer(target, tensors, output, *, like, metadata, rewritten)``: a
  :class:`~tclip.formats.base.TensorWriter` of ``tensors`` (``TensorInfo`` list)
  into ``output`` (an :class:`~tclip.formats.atomic.AtomicOutput`), "like" the
  reader ``like`` when given (the same layout where the formats match), with the
  file ``metadata`` (strings; None: none) and knowing which tensors will be
  ``rewritten`` (the others are copied);

and optionally ``HOLDS_METADATA`` (whether its files carry file-level metadata;
False when absent), ``KEPT_ENDINGS`` (name endings an output keeps whole, e.g.
Keras' ``.weights.h5``), ``SNIFF_BEFORE`` (names of formats whose sniff would
claim this format's files too, so this one's is tried first), ``CONTENT_SUFFIXES`` (suffixes that name other things
too, as ``.bin``: directories and globs pick up such a file only when a sniff
claims it) and ``sniff_file(handle, size) -> bool`` (for a signature that need
not be at the start, as HDF5's behind a user block).

A format module imports its heavy libraries inside its functions, so importing
this registry (which imports every format module) costs NumPy and nothing more:
a run that never meets an HDF5 file never imports h5py. :func:`register` adds a
format at run time (a test's toy format, a plugin).

Formats are detected by content (the sniffs, in registration order but for
``SNIFF_BEFORE``: PyTorch's sniff claims the zips ``torch.save`` writes, .npz's any
zip) first, then by suffix; the output format follows the output path's suffix, so writing
``x.safetensors`` from an .npz converts it.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Collection
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import FormatError, TclipError
from . import dcp, gguf, hdf5, npy, npz, safetensors
from . import torch as pytorch
from .atomic import AtomicOutput
from .base import TensorInfo, TensorReader, TensorWriter

FORMATS: list[ModuleType] = [npy, npz, safetensors, hdf5, pytorch, gguf, dcp]
_REQUIRED = ("NAME", "SUFFIXES", "sniff", "Reader", "Writer")

# What a damaged file makes parsers raise besides tclip's own errors.
_MALFORMED = (ValueError, TypeError, KeyError, IndexError, OverflowError, struct.error, RecursionError,
              UnicodeError, NotImplementedError, RuntimeError, EOFError, LookupError)
# What the sniffs see of a file: a zip's first member name is at byte 30.
HEAD_BYTES = 512


def register(module: ModuleType) -> None:
    """Add a format module (see this module's docstring for what it exports)."""
    missing = [name for name in _REQUIRED if not hasattr(module, name)]
    if missing:
        raise ValueError(f"format module {module.__name__} lacks {', '.join(missing)}")
    if any(known.NAME == module.NAME for known in FORMATS):
        raise ValueError(f"a format named {module.NAME!r} is registered already")
    FORMATS.append(module)


def unregister(module: ModuleType) -> None:
    """Remove a format added by :func:`register`."""
    FORMATS.remove(module)


def by_name(name: str) -> ModuleType:
    for module in FORMATS:
        if module.NAME == name:
            return module
    raise KeyError(name)


def suffixes() -> dict[str, str]:
    """Every known suffix with its format's name, in registration order."""
    return {suffix: module.NAME for module in FORMATS for suffix in module.SUFFIXES}


def kept_endings() -> tuple[str, ...]:
    """Name endings an output keeps whole (``model.weights.h5`` -> ``model.clipped.weights.h5``)."""
    return tuple(ending for module in FORMATS for ending in getattr(module, "KEPT_ENDINGS", ()))


def sniff_order() -> list[ModuleType]:
    """The formats in the order their sniffs are tried: registration order, each format moved
    before the formats its ``SNIFF_BEFORE`` names."""
    order = list(FORMATS)
    for module in FORMATS:
        before = [i for i, m in enumerate(order) if m.NAME in getattr(module, "SNIFF_BEFORE", ())]
        if before and order.index(module) > min(before):
            order.remove(module)
            order.insert(min(before), module)
    return order


def content_suffixes() -> frozenset[str]:
    """Suffixes a file must also be claimed by content to count as a tensor file (``.bin``)."""
    return frozenset(s for module in FORMATS for s in getattr(module, "CONTENT_SUFFIXES", ()))


def claimed_by_content(path: Path) -> bool:
    """Whether a format's sniff claims the regular file ``path`` (False when it cannot be read)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return False
        head = os.pread(fd, HEAD_BYTES, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return any(m.sniff(head, info.st_size) for m in sniff_order())


def suffix_list(last: str = "or") -> str:
    """``.npy, .npz, .safetensors, .h5 or .hdf5`` for messages."""
    every = list(suffixes())
    return every[0] if len(every) == 1 else f"{', '.join(every[:-1])} {last} {every[-1]}"


def format_for_suffix(path: Path) -> str | None:
    return suffixes().get(Path(path).suffix.lower())


def holds_metadata(name: str) -> bool:
    return bool(getattr(by_name(name), "HOLDS_METADATA", False))


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
            head = handle.read(HEAD_BYTES)
            size = path.stat().st_size
            found = next((m.NAME for m in sniff_order() if m.sniff(head, size)), None)
            if found is None:
                found = next((m.NAME for m in FORMATS if hasattr(m, "sniff_file") and m.sniff_file(handle, size)),
                             None)
    except IsADirectoryError:
        if dcp.is_hf_shards_folder(path):  # DCP's per-rank safetensors pieces: the folder is the checkpoint
            return dcp.NAME
        raise TclipError("is a directory", path) from None
    except FileNotFoundError:
        raise TclipError("no such file", path) from None
    except PermissionError:
        raise TclipError("permission denied", path) from None
    except OSError as error:
        raise TclipError(f"cannot read ({error.strerror or error})", path) from None
    if found is None and Path(path).suffix.lower() not in content_suffixes():
        found = format_for_suffix(path)  # (a .bin no sniff claims is not taken for a PyTorch file)
    if found is None:
        known = ", ".join("/".join(m.SUFFIXES) for m in FORMATS if m.SUFFIXES)
        raise FormatError(f"not a tensor file tclip knows ({known})", path)
    return found


def open_reader(path: Path | str) -> TensorReader:
    """Open a tensor file lazily; raises a TclipError naming the file when it cannot."""
    path = Path(path)
    kind = detect_format(path)
    try:
        return by_name(kind).Reader(path)
    except TclipError:
        raise
    except MemoryError:
        raise FormatError("a size in the header is impossibly large", path) from None
    except OSError as error:
        raise TclipError(f"cannot read ({error.strerror or error})", path) from None
    except _MALFORMED as error:
        text = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise FormatError(f"malformed {kind} file ({text})", path) from None


def output_format(target: Path, like: TensorReader) -> str | None:
    """The format ``target`` is written in: by its suffix; a target without a known suffix
    (an input recognised by its content, rewritten in place or beside itself) keeps the
    input's format, and so does the input's own file reached through a symlink (in place,
    a Hugging Face cache's link is rewritten at its target, a blob named by its hash)."""
    if os.path.realpath(target) == os.path.realpath(like.path):
        return like.format_name
    return format_for_suffix(target) or (like.format_name if format_for_suffix(like.path) is None else None)


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
    the source without them and writes them in place. The metadata carried is
    ``metadata``, else, converting, the source's as strings.
    """
    target = Path(target)
    kind = output_format(target, like)
    if kind is None:
        raise TclipError(f"unknown output format: use {suffix_list()}", target)
    tensors = list(like.tensors.values()) if tensors is None else tensors
    carry = metadata
    if carry is None and like.format_name != kind and like.metadata:
        carry = _portable_metadata(like.metadata)
    # The output takes the input's permissions (a rewrite in place keeps them).
    output = AtomicOutput(target, overwrite=overwrite, mode_from=like.path)
    try:
        return by_name(kind).Writer(target, tensors, output, like=like, metadata=carry, rewritten=rewritten)
    except TclipError as error:
        output.abort()
        if error.path is None:
            raise type(error)(error.message, target) from None
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
