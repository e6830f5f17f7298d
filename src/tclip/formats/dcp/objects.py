"""The stored bytes of what a DCP folder holds besides its tensors, for ``diff``: each item saved
as an object (``BytesStorageMetadata``: torchtitan's ``lr_scheduler.lr_lambdas``, Megatron's rng
state), a Megatron ``common.pt`` the ``.pt`` allowlist does not read, and the tensors of one it
reads (their elements' bytes); and the checkpoint's size over all its files, for ``info``.

Such an item is a ``torch.save`` zip that tclip never unpickles, so two are compared by their bytes.
Equal bytes are the same object. torch 2.13 writes the same object to the same bytes (measured:
the same state saved twice, in one process and in two, gives byte-identical ``.distcp`` files; the
zip's ``.data/serialization_id`` is derived from its records' checksums, not drawn at random), so
bytes that differ are reported as differing; a pickle of one value can still differ in bytes
(another torch version, a set of strings under another hash seed), which ``docs/dcp.md`` says.
An item compressed with ``stream.zstd/1`` is compared decompressed (up to 1 MiB, else not
compared): the same bytes compressed at another level must not read as a difference.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .layouts import COMMON_STATE, MEGATRON_CONFIG

_MAX_COMMON_TENSOR = 64 << 20  # common.pt holds rng states and counters, not weights

def common_bytes(folder: Path, name: str, listed: bool, chunk: int = 1 << 20) -> Iterator[bytes] | None:
    """The stored bytes of an unread ``common.pt`` (``name`` is that file), or the elements' bytes
    of one of its tensors (``common.pt/<name>``); None for anything else. ``listed``: the folder's
    reader lists ``name`` among the items that are not tensors."""
    if not listed:
        return None
    if name == COMMON_STATE:  # (listed under this name only when the .pt allowlist did not read it)
        return _file_bytes(folder / COMMON_STATE, chunk)
    if name.startswith(COMMON_STATE + "/"):
        return _common_tensor_bytes(folder / COMMON_STATE, name[len(COMMON_STATE) + 1:])
    return None


def range_bytes(fd: int, offset: int, length: int, chunk: int = 1 << 20) -> Iterator[bytes]:
    """``length`` bytes of ``fd`` from ``offset``, ``chunk`` at a time."""
    return _range_bytes(fd, offset, length, chunk)


def _range_bytes(fd: int, offset: int, length: int, chunk: int) -> Iterator[bytes]:
    done = 0
    while done < length:
        part = os.pread(fd, min(chunk, length - done), offset + done)
        if not part:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += len(part)
        yield part


def _file_bytes(path: Path, chunk: int) -> Iterator[bytes]:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            yield from _range_bytes(fd, 0, st.st_size, chunk)
    finally:
        os.close(fd)


def _common_tensor_bytes(path: Path, name: str) -> Iterator[bytes] | None:
    """A tensor of Megatron's ``common.pt`` (an rng state): its elements' bytes, read by the ``.pt``
    reader (at most :data:`_MAX_COMMON_TENSOR` bytes; None for a plain value or past that)."""
    from ...errors import TclipError
    from ..torch.reader import TorchReader

    try:
        reader = TorchReader(path)
    except (TclipError, OSError):
        return None
    with reader:
        info = reader.tensors.get(name)
        if info is None or info.refused or info.nbytes > _MAX_COMMON_TENSOR:
            return None
        return iter([np.ascontiguousarray(reader.read(name)).tobytes()])


def checkpoint_size(reader: object) -> int:
    """Bytes in all the checkpoint's files: its metadata (``.metadata``, or every rank's
    ``__R.metadata``), every file ``storage_data`` names (or every piece file), and Megatron's
    ``metadata.json`` and ``common.pt`` when they are there."""
    total = sum(getattr(reader, "storage_files")().values())
    folder = Path(getattr(reader, "path"))
    own = list(getattr(reader, "rank_files", None) or [])
    if not own and getattr(reader, "metadata_path", None) is not None:
        own = [getattr(reader, "metadata_path")]
    if own:  # (a folder of per-rank pieces has no metadata file: nothing of Megatron's either)
        own += [folder / MEGATRON_CONFIG, folder / COMMON_STATE]
    for path in dict.fromkeys(own):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total
