"""A DCP folder's ``.metadata`` read without torch and without running pickle.

PyTorch writes ``.metadata`` with ``pickle.dump(Metadata)`` and reads it back with a raw
``pickle.load``. Here the pickle is walked by tclip's own interpreter
(:mod:`..torch.unpickler`), with its budgets on size, opcodes, objects and memo, and an
allowlist of its own: the DCP record classes, ``torch.Size``, the dtypes, the layout
and memory-format helpers and ``pathlib`` paths. Every other global (``os.system``,
``builtins.eval``, a payload class) ends the run at the opcode that names it, before
anything is looked up.

Protocol 4 builds each record with NEWOBJ on its class and then BUILD with its state (a
dict; a tuple for ``TensorProperties``). The interpreter accepts NEWOBJ only on an
allowlisted record class with no arguments, giving a :class:`_Record` that holds the
state once BUILD sets it (once: a second BUILD is refused). Nothing of torch is
imported or run. The records are then read by a fixed schema into the plain values of
:class:`DcpMetadata`, every field's type checked; what does not fit is a malformed file.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

from ...errors import FormatError, UnsupportedError
from ..torch.machine import _is_int
from ..torch.pickled import _OTHER_TORCH_DTYPES, TORCH_DTYPES, PickleLimits, TorchValue, _Global, _kind
from ..torch.unpickler import _describe_global, _Interpreter

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"
_MEGATRON_MODULE = "megatron.core.dist_checkpointing.strategies.torch"

#: The record classes a ``.metadata`` may build, by (module, class).
RECORD_CLASSES: dict[tuple[str, str], str] = {
    (_METADATA_MODULE, "Metadata"): "Metadata",
    (_METADATA_MODULE, "TensorStorageMetadata"): "TensorStorageMetadata",
    (_METADATA_MODULE, "ChunkStorageMetadata"): "ChunkStorageMetadata",
    (_METADATA_MODULE, "BytesStorageMetadata"): "BytesStorageMetadata",
    (_METADATA_MODULE, "TensorProperties"): "TensorProperties",
    (_METADATA_MODULE, "StorageMeta"): "StorageMeta",
    (_METADATA_MODULE, "MetadataIndex"): "MetadataIndex",
    (_FILESYSTEM_MODULE, "_StorageInfo"): "_StorageInfo",
    # Megatron-Core pickles its Metadata subclass (same fields, plus mcore_data)
    (_MEGATRON_MODULE, "MCoreMetadata"): "Metadata",
}


def _accepted() -> dict[tuple[str, str], _Global]:
    table = {key: _Global("record", f"{key[0]}.{key[1]}", kind) for key, kind in RECORD_CLASSES.items()}
    table["torch", "Size"] = _Global("size", "torch.Size")
    for name in (*TORCH_DTYPES, *_OTHER_TORCH_DTYPES):
        table["torch", name] = _Global("dtype", f"torch.{name}", name)
    table["torch.serialization", "_get_layout"] = _Global("layout", "torch.serialization._get_layout")
    table[_METADATA_MODULE, "_MEM_FORMAT_ENCODING"] = _Global("memory_format",
                                                               f"{_METADATA_MODULE}._MEM_FORMAT_ENCODING")
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        table["pathlib", name] = _Global("path", f"pathlib.{name}")
    return table


_ACCEPTED = _accepted()

#: Every global a ``.metadata`` may name; anything else is refused.
ACCEPTED_GLOBALS: frozenset[str] = frozenset(g.name for g in _ACCEPTED.values())

_ADVICE = "tclip reads the records torch.distributed.checkpoint writes and never runs pickled code"
_LAYOUTS = frozenset({"torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc",
                      "torch.sparse_bsr", "torch.sparse_bsc", "torch._mkldnn", "torch.jagged"})


class _Record:
    """An instance of an allowlisted DCP class as the pickle built it: its state, once set."""

    __slots__ = ("kind", "state", "built")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.state: Any = None
        self.built = False


class _MetadataInterpreter(_Interpreter):
    """The torch pickle interpreter with the DCP allowlist, NEWOBJ on record classes and
    BUILD of their state. Records are dict keys by identity (``storage_data``'s keys are
    ``MetadataIndex`` records): no hash of attacker-chosen values is ever taken for them."""

    EXTRA_OPS = {0x81: "op_newobj"}  # NEWOBJ; NEWOBJ_EX, INST, OBJ stay refused

    def refused(self, what: str) -> UnsupportedError:
        return UnsupportedError(f"{self.where}: {what}; {_ADVICE}", self.path)

    def find(self, module: str, name: str) -> _Global | TorchValue:
        found = _ACCEPTED.get((module, name))
        if found is None:
            raise self.refused(_describe_global(module, name))
        if found.kind == "dtype":
            return TorchValue("dtype", found.arg)
        return found

    def op_newobj(self) -> None:
        args = self.pop()
        cls = self.pop()
        if not isinstance(cls, _Global) or cls.kind != "record":
            what = f" of class {cls.name}" if isinstance(cls, _Global) else f" of a {_kind(cls)}"
            raise self.refused(f"pickles an object{what} (opcode NEWOBJ)")
        if args != ():
            raise self.malformed(f"NEWOBJ of {cls.name} with arguments")
        self.new(_Record(cls.arg))

    def op_build(self) -> None:
        state = self.pop()
        target = self.top()
        if not isinstance(target, _Record):
            raise self.refused(f"sets the state of a {_kind(target)} (opcode BUILD)")
        if target.built:
            raise self.malformed(f"BUILD on a {target.kind} twice")
        target.state = state
        target.built = True

    def key(self, value: Any, what: str = "dict key") -> Any:
        if isinstance(value, _Record):
            return value
        return super().key(value, what)

    def reduce_layout(self, func: _Global, args: tuple[Any, ...]) -> str:
        self._arity(func, args, 1)
        if args[0] not in _LAYOUTS:
            raise self.malformed(f"{func.name} called with {str(args[0])[:60]!r}")
        return str(args[0])

    def reduce_memory_format(self, func: _Global, args: tuple[Any, ...]) -> int:
        self._arity(func, args, 1)
        if not _is_int(args[0]) or not 0 <= args[0] < 16:
            raise self.malformed(f"{func.name} called with {_kind(args[0])}")
        return int(args[0])

    def reduce_path(self, func: _Global, args: tuple[Any, ...]) -> str:
        if not all(isinstance(a, str) for a in args) or sum(len(a) for a in args) > 4096:
            raise self.malformed(f"{func.name} called with {', '.join(_kind(a) for a in args)}")
        return posixpath.join(*args) if args else "."


# --------------------------------------------------------------------------- plain data


@dataclass(frozen=True)
class Chunk:
    """One piece of a tensor: where it sits in the global tensor and its extent."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the checkpoint: its torch dtype name, global shape and chunks."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    layout: str = "torch.strided"


@dataclass(frozen=True)
class BytesEntry:
    """An object saved with ``torch.save`` as one item (``step``, ``lr``, a dataloader's state)."""


@dataclass(frozen=True)
class StorageItem:
    """Where one item's bytes are: ``storage_data[MetadataIndex(fqn, offset, index)]``.

    Attributes:
        fqn: the entry's name.
        chunk_offsets: the chunk's offsets (None for a bytes item).
        index: the chunk's position in the entry's list (None for a bytes item).
        relative_path: the file, relative to the folder.
        offset, length: the byte range in that file.
        transforms: ``transform_descriptors`` (``('stream.zstd/1',)``), empty when none.
    """

    fqn: str
    chunk_offsets: tuple[int, ...] | None
    index: int | None
    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass
class DcpMetadata:
    """What a ``.metadata`` says, as plain values.

    Attributes:
        entries: name -> :class:`TensorEntry` or :class:`BytesEntry`, in the file's order.
        items: every ``storage_data`` entry.
        version: ``Metadata.version`` (``"1.0.0"``), None before torch wrote one.
        has_planner_data: whether ``planner_data`` is set (``dcp_to_torch_save`` rebuilds nesting from it).
    """

    entries: dict[str, TensorEntry | BytesEntry] = field(default_factory=dict)
    items: list[StorageItem] = field(default_factory=list)
    version: str | None = None
    has_planner_data: bool = False


_MAX_DIMS = 64
_WORK_PER_BYTE = 2


class _Schema:
    """Reads the records into :class:`DcpMetadata`, checking every field; the work is
    capped (a pickle may share one big list among many records through its memo)."""

    def __init__(self, budget: int, where: str, path: object) -> None:
        self.budget = budget
        self.where = where
        self.path = path
        # chunk lists read once each: the memo lets one list stand in many records (id -> (list, chunks))
        self.chunk_lists: dict[int, tuple[Any, tuple[Chunk, ...]]] = {}

    def bad(self, what: str) -> FormatError:
        return FormatError(f"{self.where}: {what}", self.path)

    def spend(self, n: int) -> None:
        self.budget -= n
        if self.budget < 0:
            raise UnsupportedError(f"{self.where}: its records share sub-trees that expand beyond what the "
                                   "file's size allows (a pickle bomb?); tclip stops here", self.path)

    def state(self, value: Any, kind: str, what: str) -> dict[str, Any]:
        if not isinstance(value, _Record) or value.kind != kind:
            raise self.bad(f"{what} is a {_kind_of(value)}, expected {kind}")
        state = value.state
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None and isinstance(state[1], dict):
            state = state[1]  # (None, slot state): a dataclass with __slots__
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise self.bad(f"{what}: the state of {kind} is a {_kind(state)}, expected a dict")
        return state

    def ints(self, value: Any, what: str) -> tuple[int, ...]:
        if not isinstance(value, tuple | list) or len(value) > _MAX_DIMS:
            raise self.bad(f"{what} is a {_kind(value)}, expected a tuple of at most {_MAX_DIMS} integers")
        self.spend(len(value) + 1)
        if not all(_is_int(n) and 0 <= n <= 1 << 62 for n in value):
            raise self.bad(f"{what} {_short(value)} holds something other than integers >= 0")
        return tuple(value)

    def metadata(self, root: Any) -> DcpMetadata:
        state = self.state(root, "Metadata", "the pickled object")
        result = DcpMetadata()
        version = state.get("version")
        if version is not None and not isinstance(version, str):
            raise self.bad(f"version is a {_kind(version)}")
        result.version = version
        result.has_planner_data = state.get("planner_data") is not None
        entries = state.get("state_dict_metadata")
        if not isinstance(entries, dict):
            raise self.bad(f"state_dict_metadata is a {_kind(entries)}, expected a dict")
        for name, entry in entries.items():
            self.spend(1)
            if not isinstance(name, str):
                raise self.bad(f"state_dict_metadata has a key that is a {_kind(name)}, not a name")
            result.entries[name] = self.entry(name, entry)
        storage = state.get("storage_data")
        if not isinstance(storage, dict):
            raise self.bad(f"storage_data is a {_kind(storage)}, expected a dict (this folder was not "
                           "written by FileSystemWriter)")
        for key, info in storage.items():
            self.spend(1)
            result.items.append(self.item(key, info))
        return result

    def entry(self, name: str, value: Any) -> TensorEntry | BytesEntry:
        if isinstance(value, _Record) and value.kind == "BytesStorageMetadata":
            return BytesEntry()
        state = self.state(value, "TensorStorageMetadata", f"entry {name!r}")
        dtype, layout = self.properties(name, state.get("properties"))
        shape = self.ints(state.get("size"), f"entry {name!r}: size")
        chunks = state.get("chunks")
        if not isinstance(chunks, list | tuple):
            raise self.bad(f"entry {name!r}: chunks is a {_kind(chunks)}, expected a list")
        known = self.chunk_lists.get(id(chunks))
        if known is None:
            known = (chunks, self.chunks(name, shape, chunks))
            self.chunk_lists[id(chunks)] = known
        elif known[1] and len(known[1][0].offsets) != len(shape):
            raise self.bad(f"entry {name!r}: its chunks are for a tensor of {len(known[1][0].offsets)} dimensions, "
                           f"not of shape {list(shape)}")
        return TensorEntry(dtype, shape, known[1], layout)

    def chunks(self, name: str, shape: tuple[int, ...], chunks: list[Any] | tuple[Any, ...]) -> tuple[Chunk, ...]:
        parsed = []
        for i, chunk in enumerate(chunks):
            self.spend(1)
            chunk_state = self.state(chunk, "ChunkStorageMetadata", f"entry {name!r}: chunk {i}")
            offsets = self.ints(chunk_state.get("offsets"), f"entry {name!r}: chunk {i}: offsets")
            sizes = self.ints(chunk_state.get("sizes"), f"entry {name!r}: chunk {i}: sizes")
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                raise self.bad(f"entry {name!r}: chunk {i} has offsets {_short(offsets)} and sizes {_short(sizes)} "
                               f"for a tensor of shape {list(shape)}")
            parsed.append(Chunk(offsets, sizes))
        return tuple(parsed)

    def properties(self, name: str, value: Any) -> tuple[str, str]:
        if not isinstance(value, _Record) or value.kind != "TensorProperties":
            raise self.bad(f"entry {name!r}: properties is a {_kind_of(value)}, expected TensorProperties")
        state = value.state
        if isinstance(state, tuple):  # its __getstate__: (dtype, layout, requires_grad, memory_format, pin_memory)
            if len(state) != 5:
                raise self.bad(f"entry {name!r}: TensorProperties state of {len(state)} fields, expected 5")
            dtype, layout = state[0], state[1]
        else:
            fields = self.state(value, "TensorProperties", f"entry {name!r}: properties")
            dtype, layout = fields.get("dtype"), fields.get("layout", "torch.strided")
        if not isinstance(dtype, TorchValue) or dtype.kind != "dtype":
            raise self.bad(f"entry {name!r}: its dtype is a {_kind(dtype)}")
        if not isinstance(layout, str):
            raise self.bad(f"entry {name!r}: its layout is a {_kind(layout)}")
        return dtype.text, layout

    def item(self, key: Any, value: Any) -> StorageItem:
        index_state = self.state(key, "MetadataIndex", "a storage_data key")
        fqn = index_state.get("fqn")
        if not isinstance(fqn, str):
            raise self.bad(f"a storage_data key names a {_kind(fqn)}, not a tensor name")
        offset, index = index_state.get("offset"), index_state.get("index")
        offsets = None if offset is None else self.ints(offset, f"storage_data[{fqn!r}]: offset")
        if index is not None and not (_is_int(index) and 0 <= index < 1 << 31):
            raise self.bad(f"storage_data[{fqn!r}]: index {_short(index)}")
        info = self.state(value, "_StorageInfo", f"storage_data[{fqn!r}]")
        relative, start, length = info.get("relative_path"), info.get("offset"), info.get("length")
        if not isinstance(relative, str) or not relative:
            raise self.bad(f"storage_data[{fqn!r}]: relative_path is a {_kind(relative)}")
        first, size = _byte_count(start), _byte_count(length)
        if first is None:
            raise self.bad(f"storage_data[{fqn!r}]: offset {_short(start)}")
        if size is None:
            raise self.bad(f"storage_data[{fqn!r}]: length {_short(length)}")
        transforms = info.get("transform_descriptors") or ()
        if not isinstance(transforms, list | tuple) or not all(isinstance(t, str) and len(t) < 200
                                                               for t in transforms):
            raise self.bad(f"storage_data[{fqn!r}]: transform_descriptors {_short(transforms)}")
        self.spend(len(transforms))
        return StorageItem(fqn, offsets, index, relative, first, size, tuple(transforms))


def _byte_count(value: Any) -> int | None:
    """A file offset or length: an int (not a bool) in [0, 2**62], else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1 << 62:
        return value
    return None


def _kind_of(value: Any) -> str:
    return value.kind if isinstance(value, _Record) else _kind(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_dcp_metadata(data: bytes, *, limits: PickleLimits | None = None, where: str = ".metadata",
                      path: object = None) -> DcpMetadata:
    """Read a ``.metadata`` pickle into plain values, running nothing.

    Args:
        data: the file's bytes.
        limits: caps on size and work (defaults: :class:`PickleLimits`).
        where, path: for messages.

    Returns:
        A :class:`DcpMetadata`.

    Raises:
        UnsupportedError: a global outside the DCP allowlist, an object of another class, a
            limit exceeded.
        FormatError: a malformed pickle, or records that do not hold what DCP writes.
    """
    limits = limits or PickleLimits()
    if len(data) > limits.max_bytes:
        raise UnsupportedError(f"{where}: pickle of {len(data)} bytes is larger than the limit of "
                               f"{limits.max_bytes} bytes", path)
    interpreter = _MetadataInterpreter(data, 0, len(data), "zip", "<", limits, where, path)
    root = interpreter.run()
    if interpreter.storages:
        raise UnsupportedError(f"{where}: holds tensor storages, which a DCP .metadata never does", path)
    # Reading the records costs about one unit per element; a real file needs far less than one per
    # byte (a chunk's record alone takes ~100 bytes). Memo references cost 2 bytes and may stand for
    # a tuple of 64 integers: without a cap, each pickle byte could cost ~60 units.
    schema = _Schema(_WORK_PER_BYTE * len(data) + 1_000_000, where, path)
    return schema.metadata(root)
