"""The files ``torch.save`` writes, read without torch and without running pickle.

The zip format (torch >= 1.6, the default)::

    <archive>/data.pkl            the pickled object; tensors are persistent ids
    <archive>/data/<key>          one member per storage: raw elements, stored, 64-byte aligned
    <archive>/byteorder           "little" or "big" (absent before torch 1.12: little)
    <archive>/version             the format version
    <archive>/.data/serialization_id, .format_version, .storage_alignment (recent torch)

``<archive>`` is the name of the file when it was saved; torch takes it from the
first member. The pickle is interpreted by :mod:`.unpickler`, which builds
records and calls nothing. Each storage's bytes are located from the zip's central
directory and the member's own local header (never decompressed, never read
here), and every view is checked to lie inside its storage.

The legacy format (``_use_new_zipfile_serialization=False``) is a chain of pickles
(magic number, protocol version, system info, the object, the storage keys)
followed by each storage as an 8-byte element count and its little-endian
elements; it is read the same way. TorchScript archives (``torch.jit.save``) and
the pre-1.0 tar format are refused with a message naming them.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ...errors import FormatError, UnsupportedError
from ..limits import NAME_BYTES, name_memory
from .pickled import PickleLimits, TensorRef, _dtype_text, flatten, kind_of
from .unpickler import load_torch_pickle

__all__ = [
    "LEGACY_MAGIC",
    "NonTensor",
    "StorageInfo",
    "TorchArchive",
    "load_torch_archive",
    "read_tensor",
    "sniff_torch",
]

#: The first pickle of a legacy (non-zip) torch.save file holds this number.
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL_VERSION = 1001

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # the fixed 30 bytes of a zip local file header
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, NotImplementedError,
               IndexError, KeyError, struct.error, zlib.error, RuntimeError, UnicodeDecodeError, OverflowError,
               TypeError)
_SMALL_MEMBER = 64  # byteorder, version: a few bytes each
# An honest pickle spends at least a byte on each name it holds (a None in a list, a memo GET
# of a tied tensor: two), plus a few: more names than that come from shared sub-trees.
_FREE_NAMES = 64
_WALK_PER_NAME = 32


@dataclass(frozen=True)
class StorageInfo:
    """Where one storage's bytes are in the file.

    Attributes:
        key: the storage key the pickle uses.
        member: its zip member (None in the legacy format).
        dtype: element type, with the file's byte order.
        numel: elements declared by the pickle (bytes for an untyped storage).
        offset: absolute file offset of its first byte.
        nbytes: its size in bytes (``numel * dtype.itemsize``, checked against the member).
        location: the device it was saved from.
    """

    key: str
    member: str | None
    dtype: np.dtype
    numel: int
    offset: int
    nbytes: int
    location: str


class NonTensor(NamedTuple):
    """A leaf of the saved object that is not a tensor (``step``, ``lr``...)."""

    name: str
    kind: str   # int, float, str, bool, None, bytes, dict (empty), dtype, storage...
    value: Any


@dataclass
class TorchArchive:
    """A ``torch.save`` file as tclip sees it: tensors as views of located storages.

    Attributes:
        path: the file.
        format: ``"zip"`` or ``"legacy"``.
        prefix: the archive's folder name inside the zip (``""`` for legacy files).
        byteorder: ``"little"`` or ``"big"`` (the dtypes carry it too).
        version: the archive's ``version`` record, if any.
        root: the unpickled tree (see :func:`.unpickler.load_torch_pickle`).
        tensors: flattened name -> view, in the order of the saved object.
        storages: key -> location of its bytes, for every storage the pickle refers to.
        others: the leaves that are not tensors, in order.
        pickle_member: ``(offset, size)`` of the pickle's bytes in the file (legacy:
            the whole chain of pickles before the storages).
        shared: storage key -> names of the tensors viewing it, for storages viewed
            by more than one name (tied weights, slices of one buffer).
        crc32: whether the zip carries CRC-32s: False for a file saved with
            ``torch.serialization.set_crc32_options(False)``, whose members all have CRC 0.
    """

    path: Path
    format: str
    prefix: str
    byteorder: str
    version: str | None
    root: Any
    tensors: dict[str, TensorRef]
    storages: dict[str, StorageInfo]
    others: list[NonTensor]
    pickle_member: tuple[int, int]
    shared: dict[str, tuple[str, ...]] = field(default_factory=dict)
    crc32: bool = True


# --------------------------------------------------------------------------- sniffing


def sniff_torch(head: bytes) -> str | None:
    """Guess from a file's first bytes whether ``torch.save`` may have written it.

    Args:
        head: at least the first 512 bytes (fewer if the file is shorter).

    Returns:
        ``"zip"`` for a zip archive (torch's or another's: :func:`load_torch_archive`
        decides), ``"legacy"`` for the legacy pickle chain, ``"tar"`` for the pre-1.0
        tar format, None otherwise.
    """
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "zip"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    try:
        result = load_torch_pickle(head, limits=PickleLimits(max_bytes=len(head)), where="head")
    except (FormatError, UnsupportedError):
        return None
    return "legacy" if _is_int(result.root) and result.root == LEGACY_MAGIC else None


# --------------------------------------------------------------------------- loading


def load_torch_archive(path: str | os.PathLike[str], *, limits: PickleLimits | None = None,
                       root_name: str | None = None) -> TorchArchive:
    """Read the structure of a ``torch.save`` file: names, views, storage locations.

    Reads the zip directory, the pickle and a few small records; never a storage's data.

    Args:
        path: the file.
        limits: caps on the pickle interpreter (defaults: :class:`PickleLimits`).
        root_name: the name of a tensor saved alone (``torch.save(t, f)``); default:
            the file's stem.

    Returns:
        A :class:`TorchArchive`.

    Raises:
        UnsupportedError: the file holds something other than tensors and plain data
            (the message says what and what to do), or is TorchScript / legacy tar.
        FormatError: the file is malformed: not a torch file, a truncated member, a
            storage whose size disagrees with the pickle, a view outside its storage.
    """
    path = Path(path)
    limits = limits or PickleLimits()
    root_name = path.stem if root_name is None else root_name
    try:
        with open(path, "rb") as handle:
            head = handle.read(512)
            kind = sniff_torch(head)
            if kind == "zip":
                return _load_zip(path, handle, limits, root_name)
            if kind == "legacy":
                return _load_legacy(path, handle, limits, root_name)
    except OSError as error:
        raise FormatError(f"cannot read: {error.strerror or error}", path) from None
    if kind == "tar":
        raise UnsupportedError("a PyTorch file in the tar format of torch < 0.4, which tclip does not "
                               "read; load it with an old torch and save it again", path)
    raise FormatError("not a PyTorch file (neither the zip format of torch.save nor its legacy format)",
                      path)


class _Members(NamedTuple):
    """A torch.save zip's directory: its members in order and by name, and their folder."""

    archive: zipfile.ZipFile
    infos: list[zipfile.ZipInfo]
    by_name: dict[str, zipfile.ZipInfo]
    prefix: str


def _open_zip(path: Path, handle: Any) -> _Members:
    """The zip's members, refused unless it is a torch.save archive (one folder, a data.pkl,
    no member twice, no TorchScript code)."""
    try:
        archive = zipfile.ZipFile(handle)
    except _ZIP_ERRORS as error:
        cut = _truncation(handle.fileno())
        if cut is not None:
            raise FormatError(f"file is truncated: {cut}", path) from None
        raise FormatError(f"not a valid zip archive ({_first_line(error)})", path) from None
    infos = archive.infolist()
    if not infos:
        raise FormatError("an empty zip archive, not a torch.save file", path)
    by_name: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        if info.filename in by_name:
            raise FormatError(f"the zip archive holds two members named {info.filename!r}", path)
        by_name[info.filename] = info
    first = infos[0].filename
    if "/" not in first:
        raise FormatError(f"not a torch.save archive: member {first!r} is not in a folder", path)
    prefix = first.split("/", 1)[0]
    if f"{prefix}/constants.pkl" in by_name or any(n.startswith(f"{prefix}/code/") for n in by_name):
        raise UnsupportedError("a TorchScript archive (torch.jit.save), whose pickles name compiled code; "
                               "tclip reads torch.save files: save the model's state_dict with torch.save, "
                               "or convert it to safetensors", path)
    pickle_name = f"{prefix}/data.pkl"
    if pickle_name not in by_name:
        raise FormatError(f"not a torch.save archive: no member {pickle_name!r}", path)
    return _Members(archive, infos, by_name, prefix)


def _load_zip(path: Path, handle: Any, limits: PickleLimits, root_name: str) -> TorchArchive:
    archive, infos, by_name, prefix = _open_zip(path, handle)
    pickle_name = f"{prefix}/data.pkl"
    file_size = os.fstat(handle.fileno()).st_size
    end_of_data = min(getattr(archive, "start_dir", file_size), file_size)
    # torch.save with set_crc32_options(False) writes CRC 0 for every member and torch.load
    # accepts it. Damage does not zero every CRC: one 0 among real CRCs is a failed check
    # (a pickle's CRC is never 0 by chance in practice: it is 1 value in 2**32).
    crc32 = any(info.CRC for info in infos)
    record = functools.partial(_small_record, archive, crc32=crc32, fd=handle.fileno(), end_of_data=end_of_data,
                               path=path)
    byteorder = record(by_name.get(f"{prefix}/byteorder"))
    if byteorder is None:
        byteorder = "little"  # files before torch 1.12 have no record; torch reads them as little
    elif byteorder not in ("little", "big"):
        raise FormatError(f"unknown byte order {byteorder[:20]!r} in {prefix}/byteorder", path)
    version = record(by_name.get(f"{prefix}/version") or by_name.get(f"{prefix}/.data/version"))

    fd = handle.fileno()
    pickle_info = by_name[pickle_name]
    if pickle_info.file_size > limits.max_bytes:
        raise UnsupportedError(f"{pickle_name}: pickle of {pickle_info.file_size} bytes is larger than the "
                               f"limit of {limits.max_bytes} bytes", path)
    pickle_offset = _data_offset(pickle_info, fd, end_of_data, path)
    data = os.pread(fd, pickle_info.file_size, pickle_offset)
    if len(data) != pickle_info.file_size:
        raise FormatError(f"member {pickle_name!r} is truncated", path)
    if crc32 and zlib.crc32(data) != pickle_info.CRC:
        raise FormatError(f"member {pickle_name!r} fails its CRC-32 check (the file is damaged)", path)
    result = load_torch_pickle(data, byteorder=byteorder, limits=limits, where=pickle_name, path=path)

    storages: dict[str, StorageInfo] = {}
    regions = [(pickle_info.header_offset, _member_end(pickle_info, pickle_offset, fd, file_size),
                pickle_name)]
    for key, ref in result.storages.items():
        member = f"{prefix}/data/{key}"
        found = by_name.get(member)
        if found is None:
            raise FormatError(f"storage {key!r} named by the pickle has no member {member!r}", path)
        offset = _data_offset(found, fd, end_of_data, path)
        if found.file_size != ref.nbytes:
            raise FormatError(
                f"storage {key!r}: member {member!r} holds {found.file_size} bytes, the pickle declares "
                f"{ref.numel} x {_dtype_text(ref.dtype)} = {ref.nbytes} bytes", path)
        storages[key] = StorageInfo(key, member, ref.dtype, ref.numel, offset, ref.nbytes, ref.location)
        regions.append((found.header_offset, _member_end(found, offset, fd, file_size), member))
    # Every other member and the directory too: a storage running over them (the byteorder
    # record, a local header) would be rewritten into them, and the output fail to load.
    located = {pickle_name, *(s.member for s in storages.values())}
    regions += [(other.header_offset, _member_end(other, None, fd, file_size), other.filename)
                for other in infos if other.filename not in located]
    regions.append((end_of_data, max(file_size, end_of_data + 1), "the zip's central directory"))
    _check_disjoint(regions, path)
    tensors, others, shared = _names(result.root, root_name, len(data), limits, pickle_name, path)
    _check_views(tensors, storages, path)
    return TorchArchive(path, "zip", prefix, byteorder, version, result.root, tensors, storages, others,
                        (pickle_offset, pickle_info.file_size), shared, crc32)


def _small_record(archive: zipfile.ZipFile, info: zipfile.ZipInfo | None, *, crc32: bool, fd: int,
                  end_of_data: int, path: Path) -> str | None:
    if info is None:
        return None
    if info.file_size > _SMALL_MEMBER:
        raise FormatError(f"member {info.filename!r} is {info.file_size} bytes, expected a few", path)
    if not crc32:  # zipfile would refuse its CRC 0: read the stored bytes directly
        raw = os.pread(fd, info.file_size, _data_offset(info, fd, end_of_data, path))
        return raw.decode("ascii", "replace").strip()
    if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1:
        # As torch writes it: the stored bytes read directly, their CRC checked here (zipfile's
        # open costs more than the rest of a small chunk's zip in a DCP folder of thousands);
        # a bad CRC is left to zipfile below, for its own words.
        raw = os.pread(fd, info.file_size, _data_offset(info, fd, end_of_data, path))
        if len(raw) == info.file_size and zlib.crc32(raw) == info.CRC:
            return raw.decode("ascii", "replace").strip()
    try:
        with archive.open(info) as member:
            raw = member.read(_SMALL_MEMBER + 1)
    except _ZIP_ERRORS as error:
        raise FormatError(f"member {info.filename!r}: {_first_line(error)}", path) from None
    return raw.decode("ascii", "replace").strip()


def _data_offset(info: zipfile.ZipInfo, fd: int, end_of_data: int, path: Path) -> int:
    """The absolute offset of a stored member's bytes, from its local header, checked."""
    name = info.filename
    if info.compress_type != zipfile.ZIP_STORED:
        raise UnsupportedError(f"member {name!r} is compressed (method {info.compress_type}); torch.save "
                               "stores members uncompressed: save the file again with torch.save", path)
    if info.flag_bits & 0x1:
        raise UnsupportedError(f"member {name!r} is encrypted", path)
    if info.compress_size != info.file_size:
        raise FormatError(f"stored member {name!r} has compressed size {info.compress_size} "
                          f"and size {info.file_size}", path)
    header = os.pread(fd, _LOCAL_HEADER.size, info.header_offset)
    if len(header) != _LOCAL_HEADER.size:
        raise FormatError(f"member {name!r}: local header past the end of the file", path)
    signature, _, flags, method, _, _, _, csize, usize, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        raise FormatError(f"member {name!r}: no local header at offset {info.header_offset}", path)
    raw_name = os.pread(fd, name_len, info.header_offset + _LOCAL_HEADER.size)
    local_name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", "replace")
    if local_name != info.orig_filename:
        raise FormatError(f"member {name!r}: its local header names {local_name!r}", path)
    if method != zipfile.ZIP_STORED:
        raise FormatError(f"member {name!r}: local header says method {method}, the directory says stored",
                          path)
    # Sizes in the local header are zero when a data descriptor follows the data
    # (torch's writer does this), all ones when a zip64 extra field holds them.
    if not flags & 0x8:
        for local, central in ((csize, info.compress_size), (usize, info.file_size)):
            if local != 0xFFFFFFFF and local != central:
                raise FormatError(f"member {name!r}: local header says {local} bytes, "
                                  f"the directory {central}", path)
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if start + info.file_size > end_of_data:
        raise FormatError(f"member {name!r} runs past the end of the data ({start + info.file_size} > "
                          f"{end_of_data}): the file is truncated", path)
    return start


def _member_end(info: zipfile.ZipInfo, start: int | None, fd: int, file_size: int) -> int:
    """Where a member's bytes end: its data, and the data descriptor after it when its flags
    say there is one. ``start``: where its data starts, None to take it from its local header
    (as written: a member tclip does not read is not checked further)."""
    if start is None:
        start = info.header_offset + _LOCAL_HEADER.size
        if start <= file_size:
            lengths = _LOCAL_HEADER.unpack(os.pread(fd, _LOCAL_HEADER.size, info.header_offset))[-2:]
            start += sum(lengths)
    end = start + info.compress_size
    if info.flag_bits & 0x8 and end < file_size:
        wide = max(info.compress_size, info.file_size) >= 0xFFFFFFFF  # zip64: 8-byte sizes
        end += (20 if wide else 12) + (4 if os.pread(fd, 4, end) == b"PK\x07\x08" else 0)
    return end


# --------------------------------------------------------------------------- files cut short

_DIRECTORY_SIGNATURES = (b"PK\x01\x02", b"PK\x06\x06", b"PK\x06\x07", b"PK\x05\x06")


def _truncation(fd: int) -> str | None:
    """Why a zip that zipfile refuses was cut short, or None when the bytes do not say so.

    The evidence: local headers follow one another from byte 0 as a writer leaves them
    (each member's size from its header, or from the data descriptor after its data, as
    torch writes them), then the central directory's entries, and the bytes end inside one
    of them, before the end record. Garbage anywhere on the way is no evidence.
    """
    size = os.fstat(fd).st_size
    if size < _LOCAL_HEADER.size:
        return None
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as data:
        members: dict[str, tuple[int, int]] = {}  # name -> (data offset, size), for members found whole
        position = 0
        while True:
            head = data[position:position + 4]
            if head in _DIRECTORY_SIGNATURES or (position == size and members):
                return _directory_truncation(data, position, size)
            if position + _LOCAL_HEADER.size > size:
                return (f"it ends at byte {size}, inside the local header of a member at byte {position} "
                        f"(expected at least {position + _LOCAL_HEADER.size} bytes)"
                        if members and b"PK\x03\x04".startswith(head) else None)
            fields = _LOCAL_HEADER.unpack_from(data, position)
            signature, flags, method, csize, name_length, extra_length = (fields[0], fields[2], fields[3],
                                                                          fields[7], fields[9], fields[10])
            start = position + _LOCAL_HEADER.size + name_length + extra_length
            if signature != b"PK\x03\x04" or method not in (0, 8) or not name_length:
                return None
            if position + _LOCAL_HEADER.size + name_length > size:  # the first name whole, or no evidence
                return (f"it ends at byte {size}, inside the local header of a member at byte {position} "
                        f"(expected at least {start} bytes)" if members else None)
            name = data[position + _LOCAL_HEADER.size:position + _LOCAL_HEADER.size + name_length].decode(
                "utf-8", "replace")
            if start > size:
                return (f"it ends at byte {size}, inside the local header of member {name!r} "
                        f"(expected at least {start} bytes)")
            if not flags & 0x8 and csize != 0xFFFFFFFF:
                end = next_position = start + csize
            else:
                found = _descriptor_after(data, start, method)
                if found is None:
                    return _cut_member(data, members, name, start, size)
                end, next_position = found
            if end > size:
                return (f"it ends at byte {size}, inside member {name!r} ({end - start} bytes from byte "
                        f"{start}): expected at least {end} bytes")
            members[name] = (start, end - start)
            position = next_position


def _descriptor_after(data: Any, start: int, method: int) -> tuple[int, int] | None:
    """``(end of the data, end of the descriptor)`` of the member whose data starts at ``start``:
    the first data descriptor after it whose size is the distance to it."""
    found = data.find(b"PK\x07\x08", start)
    while found >= 0:
        length = found - start
        for layout, span in (("<LLL", 16), ("<LQQ", 24)):
            if found + span <= len(data):
                _, packed, real = struct.unpack_from(layout, data, found + 4)
                if packed == length and (method != 0 or real == length):
                    return found, found + span
        found = data.find(b"PK\x07\x08", found + 1)
    return None


def _cut_member(data: Any, members: dict[str, tuple[int, int]], name: str, start: int, size: int) -> str:
    """The member the file ends in, with the size its pickle declares when it is a storage."""
    prefix, _, rest = name.partition("/")
    key = rest[len("data/"):] if rest.startswith("data/") else None
    pickle = members.get(f"{prefix}/data.pkl")
    if key is not None and pickle is not None:
        try:
            declared = load_torch_pickle(data[pickle[0]:pickle[0] + pickle[1]]).storages.get(key)
        except (FormatError, UnsupportedError):
            declared = None
        if declared is not None:
            return (f"it ends at byte {size}, inside storage {name!r}, which the pickle declares as "
                    f"{declared.nbytes} bytes: expected at least {start + declared.nbytes} bytes")
    return f"it ends at byte {size}, inside the data of member {name!r} (from byte {start})"


def _directory_truncation(data: Any, position: int, size: int) -> str | None:
    """Walk the central directory's records from ``position``: the end it runs into, or None
    when the end record is whole (the zip is damaged, not cut short)."""
    while True:
        head = data[position:position + 4]
        if position + 4 > size:
            if not b"PK".startswith(head[:2]):
                return None
            return f"it ends at byte {size}, before the zip's central directory or within it, without its end record"
        if head == b"PK\x01\x02":
            if position + 46 > size:
                needed = position + 46
            else:
                lengths = struct.unpack_from("<3H", data, position + 28)
                needed = position + 46 + sum(lengths)
        elif head == b"PK\x06\x06":
            needed = position + 12 + (struct.unpack_from("<Q", data, position + 4)[0] if position + 12 <= size
                                      else 0)
        elif head == b"PK\x06\x07":
            needed = position + 20
        elif head == b"PK\x05\x06":
            needed = position + 22 + (struct.unpack_from("<H", data, position + 20)[0] if position + 22 <= size
                                      else 0)
            if needed <= size:
                return None
        else:
            return None
        if needed > size:
            return (f"it ends at byte {size}, in the zip's central directory "
                    f"(expected at least {needed} bytes)")
        position = needed


def _check_disjoint(regions: list[tuple[int, int, str]], path: Path) -> None:
    # Two directory entries pointing at the same bytes would make two storages one:
    # a rewrite would scale those bytes twice.
    regions.sort()
    for (_, end, name), (start, _, other) in zip(regions, regions[1:]):
        if start < end:
            raise FormatError(f"members {name!r} and {other!r} overlap in the file", path)


# --------------------------------------------------------------------------- legacy


def _load_legacy(path: Path, handle: Any, limits: PickleLimits, root_name: str) -> TorchArchive:
    file_size = os.fstat(handle.fileno()).st_size
    with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        pos = 0

        def next_pickle(what: str, persistent: str = "zip", byteorder: str = "little") -> Any:
            nonlocal pos
            result = load_torch_pickle(data, start=pos, persistent=persistent, byteorder=byteorder,
                                       limits=limits, where=f"legacy {what} pickle", path=path)
            pos = result.end
            return result

        magic = next_pickle("magic number").root
        if not (_is_int(magic) and magic == LEGACY_MAGIC):
            raise FormatError("not a legacy torch.save file (wrong magic number)", path)
        protocol = next_pickle("protocol version").root
        if not (_is_int(protocol) and protocol == _LEGACY_PROTOCOL_VERSION):
            raise UnsupportedError(f"legacy torch.save protocol version {protocol!r}; tclip reads "
                                   f"{_LEGACY_PROTOCOL_VERSION}", path)
        sys_info = next_pickle("system info").root
        if not isinstance(sys_info, dict):
            raise FormatError("legacy torch.save file: system info is not a dict", path)
        # Storages are written little-endian whatever the machine (sys_info records
        # the writer's own order, which only mattered for the element counts).
        main_start = pos
        main = next_pickle("object", persistent="legacy")
        keys = next_pickle("storage keys").root
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise FormatError("legacy torch.save file: the storage key list is not a list of strings", path)
        pickle_end = pos
        storages: dict[str, StorageInfo] = {}
        for key in keys:
            ref = main.storages.get(key)
            if ref is None:
                raise FormatError(f"storage {key!r} is listed but no tensor refers to it", path)
            if key in storages:
                raise FormatError(f"storage {key!r} is listed twice", path)
            if pos + 8 > file_size:
                raise FormatError(f"storage {key!r}: the file ends at byte {file_size}, before it", path)
            (count,) = struct.unpack("<q", data[pos:pos + 8])
            if count != ref.numel:
                raise FormatError(f"storage {key!r}: the file holds {count} elements, the pickle declares "
                                  f"{ref.numel}", path)
            start = pos + 8
            pos = start + ref.nbytes
            if pos > file_size:
                raise FormatError(f"storage {key!r} runs past the end of the file ({pos} > {file_size}): "
                                  "the file is truncated", path)
            storages[key] = StorageInfo(key, None, ref.dtype, ref.numel, start, ref.nbytes, ref.location)
        for key in main.storages:
            if key not in storages:
                raise FormatError(f"storage {key!r} named by the pickle is not in the file", path)
        tensors, others, shared = _names(main.root, root_name, main.end - main_start, limits,
                                         "legacy object pickle", path)
    _check_views(tensors, storages, path)
    return TorchArchive(path, "legacy", "", "little", str(_LEGACY_PROTOCOL_VERSION), main.root, tensors,
                        storages, others, (0, pickle_end), shared)


# --------------------------------------------------------------------------- names and views


def _names(root: Any, root_name: str, pickle_size: int, limits: PickleLimits, where: str,
           path: Path) -> tuple[dict[str, TensorRef], list[NonTensor], dict[str, tuple[str, ...]]]:
    tensors: dict[str, TensorRef] = {}
    others: list[NonTensor] = []
    seen: dict[str, tuple[Any, ...]] = {}
    viewers: dict[str, list[str]] = {}
    honest, memory, held = pickle_size + _FREE_NAMES, name_memory(), 0
    # The walk's nodes and path entries: honest names are a few dozen each, so neither a big
    # pickle nor a big memo buys more walking than the names --memory allows.
    budget = min(limits.flatten_factor * pickle_size, _WALK_PER_NAME * (memory // NAME_BYTES)) + 1_000_000
    for count, leaf in enumerate(flatten(root, budget=budget, max_depth=limits.max_depth, where=where,
                                         path=path), 1):
        name = ".".join(_key_text(k) for k in leaf.path) if leaf.path else root_name
        held += NAME_BYTES + len(name)
        if count > honest:
            raise UnsupportedError(f"{where}: the pickle names more than {honest} entries in its {pickle_size} "
                                   "bytes: its containers share sub-trees (a pickle bomb?)", path)
        if held > memory:
            raise UnsupportedError(f"{where}: the file names more than {count - 1} entries, more than --memory "
                                   f"({memory / 2**20:.0f} MiB, {NAME_BYTES} bytes a name) holds; raise --memory",
                                   path)
        if name in seen:
            raise UnsupportedError(
                f"two entries flatten to the name {name!r} (keys {_path_text(seen[name])} and "
                f"{_path_text(leaf.path)}); tclip needs unique names", path)
        seen[name] = leaf.path
        if isinstance(leaf.value, TensorRef):
            tensors[name] = leaf.value
            viewers.setdefault(leaf.value.storage.key, []).append(name)
        else:
            kind = kind_of(leaf.value)
            if isinstance(leaf.value, dict | list | tuple) and not leaf.value:
                kind = f"{kind} (empty)"
            others.append(NonTensor(name, kind, leaf.value))
    shared = {key: tuple(names) for key, names in viewers.items() if len(names) > 1}
    return tensors, others, shared


def _key_text(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    return repr(key)


def _path_text(keys: Iterable[Any]) -> str:
    return " -> ".join(repr(k) for k in keys) or "(root)"


def _check_views(tensors: dict[str, TensorRef], storages: dict[str, StorageInfo], path: Path) -> None:
    for name, tensor in tensors.items():
        storage = storages[tensor.storage.key]
        first, stop = tensor.span()
        if tensor.size and stop * tensor.dtype.itemsize > storage.nbytes:
            raise FormatError(
                f"tensor {name!r}: its view (offset {tensor.offset}, shape {list(tensor.shape)}, stride "
                f"{list(tensor.stride)}) needs {stop * tensor.dtype.itemsize} bytes of storage "
                f"{tensor.storage.key!r}, which holds {storage.nbytes}", path)


# --------------------------------------------------------------------------- reading (whole tensors)


def read_tensor(archive: TorchArchive, name: str) -> np.ndarray:
    """Read one tensor's values whole (for tests and small tensors; the pipeline reads
    blocks through the format reader).

    Args:
        archive: from :func:`load_torch_archive`.
        name: a key of ``archive.tensors``.

    Returns:
        A new C-contiguous array of the tensor's dtype (with the file's byte order),
        with torch's lazy conjugate/negative bits applied.
    """
    tensor = archive.tensors[name]
    storage = archive.storages[tensor.storage.key]
    itemsize = tensor.dtype.itemsize
    if tensor.size == 0:
        return np.empty(tensor.shape, tensor.dtype)
    first, stop = tensor.span()
    with open(archive.path, "rb") as handle:
        raw = os.pread(handle.fileno(), (stop - first) * itemsize, storage.offset + first * itemsize)
    if len(raw) != (stop - first) * itemsize:
        raise FormatError(f"tensor {name!r}: the file ends inside its data", archive.path)
    flat = np.frombuffer(raw, dtype=np.dtype((np.void, itemsize)))  # (as in torch._strided: float8_e5m2)
    view = np.lib.stride_tricks.as_strided(flat, tensor.shape, [s * itemsize for s in tensor.stride],
                                           writeable=False).view(tensor.dtype)
    values = np.array(view, order="C")
    if tensor.conj:
        values = np.conj(values)
    if tensor.neg:
        values = np.negative(values)
    return values


# --------------------------------------------------------------------------- helpers


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:200]
