"""An interpreter of the pickles ``torch.save`` writes that never runs them.

``pickle.load`` looks globals up with ``import`` and calls them; this module does
neither. It walks the opcodes itself and knows a short allowlist of global names
(see :data:`ACCEPTED_GLOBALS`): the functions torch rebuilds tensors and parameters
with, the storage and dtype names, ``collections.OrderedDict`` and the handful of
builtins that protocol 2 needs for plain values (bytes, sets, complex numbers).
Each accepted name becomes a marker object; REDUCE on a marker builds a record
(:class:`TensorRef`, :class:`StorageRef`) or a plain Python value from arguments
whose types are checked first. Any other global ends the run with
:class:`~tclip.errors.UnsupportedError` at the opcode that names it, before
anything is looked up, so a payload (``os.system``, a model class) is never
touched, let alone run.

Everything is bounded by what the pickle really holds: lengths are checked
against the bytes left, the memo, the stack and the number of objects built are
capped, and the result tree is walked once (iteratively) to refuse cycles, nesting
deeper than :attr:`PickleLimits.max_depth` and shared sub-trees that would
multiply the work (:func:`flatten`).
"""

from __future__ import annotations

import codecs
import io
import math
import pickletools
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from ..errors import FormatError, NoTensorsError, UnsupportedError
from .limits import name_memory

__all__ = [
    "ACCEPTED_GLOBALS",
    "ACCEPTED_OPCODES",
    "PickleLimits",
    "PickleResult",
    "StorageRef",
    "TensorRef",
    "TorchValue",
    "OrderedDictValue",
    "Leaf",
    "flatten",
    "kind_of",
    "load_torch_pickle",
    "TORCH_DTYPES",
]

ADVICE = "save the state_dict (tensors only), or convert the file to safetensors"

# --------------------------------------------------------------------------- dtypes

# torch dtype name -> NumPy dtype (native little-endian form). torch names its dtypes
# with aliases too (torch.float is torch.float32); a pickled dtype uses the canonical
# name, older files and hand-written ones may use either.
TORCH_DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype("<f8"), "double": np.dtype("<f8"),
    "float32": np.dtype("<f4"), "float": np.dtype("<f4"),
    "float16": np.dtype("<f2"), "half": np.dtype("<f2"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int64": np.dtype("<i8"), "long": np.dtype("<i8"),
    "int32": np.dtype("<i4"), "int": np.dtype("<i4"),
    "int16": np.dtype("<i2"), "short": np.dtype("<i2"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "uint16": np.dtype("<u2"), "uint32": np.dtype("<u4"), "uint64": np.dtype("<u8"),
    "bool": np.dtype("?"),
    "complex64": np.dtype("<c8"), "cfloat": np.dtype("<c8"),
    "complex128": np.dtype("<c16"), "cdouble": np.dtype("<c16"),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "float8_e8m0fnu": np.dtype(ml_dtypes.float8_e8m0fnu),
}

# torch dtypes a file may name that have no NumPy equivalent: accepted as values
# (a config saying dtype=torch.qint8), refused as the dtype of a tensor.
_OTHER_TORCH_DTYPES = frozenset({
    "complex32", "chalf", "qint8", "qint32", "quint8", "quint4x2", "quint2x4",
    "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
})

# Of those, the ones whose elements have a known size (torch's itemsize): a tensor of one is
# carried byte for byte as data tclip cannot read (TensorInfo.unreadable_type), never refused.
_OPAQUE_TORCH_DTYPES = {"complex32": 4, "chalf": 4, "float4_e2m1fn_x2": 1, "bits8": 1, "bits16": 2,
                        "bits1x8": 1, "bits2x4": 1, "bits4x2": 1}

# The legacy typed-storage classes: each names its element dtype. torch maps any
# global whose name contains "Storage" to these (from module torch, or torch.cuda in
# files from torch < 1.0).
_STORAGE_DTYPES: dict[str, str | None] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64",
    "UntypedStorage": "uint8",
    # quantized storages: named so the error says which, never read
    "QInt8Storage": None, "QInt32Storage": None, "QUInt8Storage": None,
    "QUInt4x2Storage": None, "QUInt2x4Storage": None,
}


def _numpy_dtype(name: str, byteorder: str) -> np.dtype:
    dtype = TORCH_DTYPES[name]
    return dtype.newbyteorder(byteorder) if dtype.itemsize > 1 else dtype


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class StorageRef:
    """One storage a pickle refers to by persistent id ``('storage', type, key, location, numel)``.

    Attributes:
        key: the storage's key; its bytes are the archive member ``data/<key>``.
        dtype: element type of the storage, with the archive's byte order
            (``uint8`` for an untyped storage, whose numel counts bytes).
        numel: number of elements the pickle declares.
        location: the device it was saved from (``cpu``, ``cuda:0``), as written.
        storage_type: the pickled class name (``FloatStorage``, ``UntypedStorage``).
    """

    key: str
    dtype: np.dtype
    numel: int
    location: str
    storage_type: str

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class TensorRef:
    """A tensor as torch rebuilds it: a strided view of a storage.

    Offsets and strides count elements of ``dtype`` (torch's convention), not bytes.

    Attributes:
        storage: the storage viewed.
        dtype: the tensor's element type (the storage's, except for tensors torch
            saves on an untyped storage: float8, uint16/32/64).
        offset: index of the first element in the storage.
        shape, stride: per dimension; strides are >= 0.
        requires_grad: as saved.
        parameter: the value was an ``nn.Parameter``.
        conj, neg: torch's lazy conjugate / negative bits: the tensor's values are the
            stored ones conjugated / negated.
        unreadable: the torch dtype (``complex32``) of a tensor tclip cannot read as
            numbers; ``dtype`` is then raw bytes of its element size. None: readable.
    """

    storage: StorageRef
    dtype: np.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool = False
    parameter: bool = False
    conj: bool = False
    neg: bool = False
    unreadable: str | None = None

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def span(self) -> tuple[int, int]:
        """The elements of the storage the view touches: ``(first, stop)``, in elements
        of ``dtype`` (``(offset, offset)`` for an empty tensor)."""
        if self.size == 0:
            return self.offset, self.offset
        last = sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return self.offset, self.offset + last + 1

    def order(self) -> tuple[int, ...] | None:
        """The axis order in which the view is one dense run of ``size`` elements.

        Returns:
            ``tuple(range(ndim))`` for a C-contiguous view; another permutation ``p``
            when the view is a transposed dense block (the run read as shape
            ``[shape[i] for i in p]`` and transposed by ``argsort(p)`` gives the
            tensor); None when no order makes it dense (slices with gaps,
            overlapping or broadcast views with stride 0).
        """
        ndim = len(self.shape)
        if self.size <= 1:
            return tuple(range(ndim))
        # Axes of length 1 may carry any stride; the others must nest exactly, each
        # stride the product of the lengths inside it. The sort is stable, so a
        # C-contiguous view keeps its own order.
        axes = sorted((i for i in range(ndim) if self.shape[i] != 1), key=lambda i: -self.stride[i])
        expected = 1
        for i in reversed(axes):
            if self.stride[i] != expected:
                return None
            expected *= self.shape[i]
        if axes == sorted(axes):
            return tuple(range(ndim))
        return tuple([i for i in range(ndim) if self.shape[i] == 1] + axes)


@dataclass(frozen=True)
class TorchValue:
    """A torch object kept as a value: ``kind`` is ``dtype`` (``text`` like ``float16``)
    or ``device`` (``text`` like ``cuda:0``)."""

    kind: str
    text: str


class OrderedDictValue(dict):  # type: ignore[type-arg]
    """A pickled ``collections.OrderedDict`` (a plain dict keeps insertion order too).

    ``attributes`` holds what the pickle set on it with BUILD (a state_dict's
    ``_metadata``), kept apart from the items and never set as Python attributes.
    """

    __slots__ = ("_states",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # the state dicts BUILD applied, by id, in the order they last applied:
        # kept by reference, so applying a big state many times costs nothing
        self._states: dict[int, dict[str, Any]] = {}

    @property
    def attributes(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for state in self._states.values():
            merged.update(state)
        return merged

    def _add_state(self, state: dict[str, Any]) -> None:
        self._states.pop(id(state), None)
        self._states[id(state)] = state


class _HashedTuple(tuple):  # type: ignore[type-arg]
    """A tuple used as a dict key or set element, hashed through the text of its
    items' hashes: CPython's tuple hash of attacker-chosen ints collides at will, and
    colliding keys make every insert compare with all the others (quadratic work
    from a small pickle). Its items are canonical keys (see ``_Interpreter.key``)."""

    def __new__(cls, items: list[Any]) -> _HashedTuple:
        self = super().__new__(cls, items)
        self._hash = hash(",".join(map(_item_text, self)))  # str hashes are keyed per process
        return self

    def __hash__(self) -> int:
        return self._hash


def _item_text(item: Any) -> str:
    # Equal items (1, 1.0, True) must give equal text: they are equal keys.
    if isinstance(item, _HashedTuple):
        return f"t{item._hash}"
    if isinstance(item, str):
        return f"s{hash(item)}"
    if isinstance(item, bytes):
        return f"b{hash(item)}"
    if isinstance(item, float):
        if item.is_integer():
            return f"i{int(item)}"
        # NaN equals only itself (tuples compare items by identity first)
        return f"f{item.hex()}" if item == item else f"n{id(item)}"
    if isinstance(item, int):
        return f"i{int(item)}"
    return "N"  # None


@dataclass(frozen=True)
class _Global:
    """An accepted global name, pushed where pickle would push the object itself."""

    kind: str       # what REDUCE does with it
    name: str       # dotted, for messages
    arg: str = ""   # the dtype / storage class named


class Leaf(NamedTuple):
    """One entry of a flattened tree: the keys leading to it and the value."""

    path: tuple[Any, ...]
    value: Any


@dataclass(frozen=True)
class PickleLimits:
    """Caps that keep a hostile pickle from using unbounded time or memory.

    Attributes:
        max_bytes: largest pickle accepted (a state_dict of 100 000 tensors is ~10 MB).
        max_objects: values built (containers, records, strings, numbers).
        max_ops: opcodes run (each pushes at most one value, references included).
        max_memo: memo entries.
        max_marks: MARKs open at once.
        max_depth: nesting of containers in the result.
        flatten_factor: the walk over the result may visit at most
            ``flatten_factor * len(pickle) + 1_000_000`` nodes and path entries (less
            when the names ``--memory`` allows need less: :mod:`._torch_archive`), so
            shared sub-trees cannot multiply the work.
    """

    max_bytes: int = 64 << 20
    max_objects: int = 4_000_000
    max_ops: int = 32_000_000
    max_memo: int = 4_000_000
    max_marks: int = 1_000
    max_depth: int = 100
    flatten_factor: int = 8


@dataclass
class PickleResult:
    """What :func:`load_torch_pickle` returns.

    Attributes:
        root: the unpickled value: dicts (:class:`OrderedDictValue` for OrderedDicts),
            lists, tuples, sets, scalars, str/bytes, :class:`TensorRef`,
            :class:`StorageRef`, :class:`TorchValue`.
        end: offset just past the STOP opcode.
        storages: every storage the pickle refers to, by key.
    """

    root: Any
    end: int
    storages: dict[str, StorageRef] = field(default_factory=dict)


# --------------------------------------------------------------------------- the allowlist


def _accepted_globals() -> dict[tuple[str, str], _Global]:
    table: dict[tuple[str, str], _Global] = {}

    def add(module: str, name: str, kind: str, arg: str = "") -> None:
        table[module, name] = _Global(kind, f"{module}.{name}", arg)

    add("torch._utils", "_rebuild_tensor", "rebuild_tensor")
    add("torch._utils", "_rebuild_tensor_v2", "rebuild_tensor_v2")
    add("torch._utils", "_rebuild_tensor_v3", "rebuild_tensor_v3")
    add("torch._utils", "_rebuild_parameter", "rebuild_parameter")
    add("torch._utils", "_rebuild_parameter_with_state", "rebuild_parameter_with_state")
    for storage in _STORAGE_DTYPES:
        add("torch", storage, "storage_type", storage)
        add("torch.cuda", storage, "storage_type", storage)
    add("torch.storage", "UntypedStorage", "storage_type", "UntypedStorage")
    for name in (*TORCH_DTYPES, *_OTHER_TORCH_DTYPES):
        add("torch", name, "dtype", name)
    add("torch", "Size", "size")
    add("torch", "device", "device")
    add("collections", "OrderedDict", "ordered_dict")
    # Protocol 2 has no opcodes for these plain values: Python 3 pickles them
    # through builtins (under their Python 2 module name __builtin__).
    for module in ("builtins", "__builtin__"):
        add(module, "set", "set")
        add(module, "frozenset", "frozenset")
        add(module, "complex", "complex")
        add(module, "bytearray", "bytearray")
        add(module, "bytes", "bytes")  # b"" under protocols 0-2: bytes()
    add("_codecs", "encode", "encode")  # bytes under protocol 2: encode(str, 'latin1')
    return table


_GLOBALS = _accepted_globals()

#: Every ``(module, name)`` the interpreter accepts; anything else is refused.
ACCEPTED_GLOBALS: frozenset[str] = frozenset(g.name for g in _GLOBALS.values())

# --------------------------------------------------------------------------- opcodes

# one byte each; the names are pickle's own
_OP = {
    "MARK": b"(", "STOP": b".", "POP": b"0", "POP_MARK": b"1", "DUP": b"2",
    "FLOAT": b"F", "INT": b"I", "BININT": b"J", "BININT1": b"K", "LONG": b"L", "BININT2": b"M",
    "NONE": b"N", "PERSID": b"P", "BINPERSID": b"Q", "REDUCE": b"R", "STRING": b"S",
    "BINSTRING": b"T", "SHORT_BINSTRING": b"U", "UNICODE": b"V", "BINUNICODE": b"X",
    "APPEND": b"a", "BUILD": b"b", "GLOBAL": b"c", "DICT": b"d", "EMPTY_DICT": b"}",
    "APPENDS": b"e", "GET": b"g", "BINGET": b"h", "INST": b"i", "LONG_BINGET": b"j",
    "LIST": b"l", "EMPTY_LIST": b"]", "OBJ": b"o", "PUT": b"p", "BINPUT": b"q",
    "LONG_BINPUT": b"r", "SETITEM": b"s", "TUPLE": b"t", "EMPTY_TUPLE": b")",
    "SETITEMS": b"u", "BINFLOAT": b"G",
    "PROTO": b"\x80", "NEWOBJ": b"\x81", "EXT1": b"\x82", "EXT2": b"\x83", "EXT4": b"\x84",
    "TUPLE1": b"\x85", "TUPLE2": b"\x86", "TUPLE3": b"\x87", "NEWTRUE": b"\x88",
    "NEWFALSE": b"\x89", "LONG1": b"\x8a", "LONG4": b"\x8b",
    "BINBYTES": b"B", "SHORT_BINBYTES": b"C",
    "SHORT_BINUNICODE": b"\x8c", "BINUNICODE8": b"\x8d", "BINBYTES8": b"\x8e",
    "EMPTY_SET": b"\x8f", "ADDITEMS": b"\x90", "FROZENSET": b"\x91", "NEWOBJ_EX": b"\x92",
    "STACK_GLOBAL": b"\x93", "MEMOIZE": b"\x94", "FRAME": b"\x95",
    "BYTEARRAY8": b"\x96", "NEXT_BUFFER": b"\x97", "READONLY_BUFFER": b"\x98",
}
# Opcodes that build objects from classes or need out-of-band data: always refused.
_REFUSED_OPS = frozenset({"INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4",
                          "NEXT_BUFFER", "READONLY_BUFFER", "PERSID"})

#: The opcodes the interpreter runs (PERSID, INST, OBJ, NEWOBJ, NEWOBJ_EX, EXT1/2/4,
#: NEXT_BUFFER and READONLY_BUFFER are recognised and refused).
ACCEPTED_OPCODES: tuple[str, ...] = tuple(sorted(set(_OP) - _REFUSED_OPS))

_CHECK_EVERY = 4096
_OBJECT_BYTES = 64  # what a value built costs the process, at least (a small str or tuple)
_REFERENCE_BYTES = 8  # a stack slot or memo entry referring to a value built earlier
_MAX_KEY_NESTING = 8
_MAX_KEY_INT = (1 << 61) - 2  # ints hash to themselves below 2**61 - 1 (no collision chains)
_MAX_DIMS = 64


class _Stop(Exception):
    pass


class _Interpreter:
    """One run over one pickle; see :func:`load_torch_pickle`."""

    def __init__(self, data: Any, start: int, stop: int, persistent: str, byteorder: str,
                 limits: PickleLimits, where: str, path: object) -> None:
        self.data = data  # bytes or mmap: both slice to bytes and find without copying
        self.pos = start
        self.stop = stop
        self.truncated_by_limit = stop < len(data)
        self.persistent = persistent
        self.byteorder = byteorder
        self.limits = limits
        self.where = where
        self.path = path
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.objects = 0
        self.copied = 0
        self.copy_budget = (stop - start) + 1_000_000
        self.storages: dict[str, StorageRef] = {}
        # id(value) -> (value, canonical key, tuple depth); holding value keeps its id unique
        self.key_cache: dict[int, tuple[Any, Any, int]] = {}
        self.canonical: dict[Any, Any] = {}  # one object per distinct str/bytes/tuple key
        self.plain_seen: dict[int, Any] = {}  # containers already found plain (BUILD state)
        self.op_start = start
        self.begin = start

    # ------------------------------------------------------------------ errors

    def malformed(self, what: str) -> FormatError:
        return FormatError(f"{self.where}: malformed pickle at byte {self.op_start}: {what}", self.path)

    def refused(self, what: str) -> UnsupportedError:
        return UnsupportedError(
            f"{self.where}: {what}; tclip reads tensors, storages and plain containers only and "
            f"never runs pickled code: {ADVICE}", self.path)

    # ------------------------------------------------------------------ reading

    def take(self, n: int) -> bytes:
        left = self.stop - self.pos
        if n < 0 or n > left:
            if self.truncated_by_limit:
                raise self.too_long()
            raise self.malformed(f"needs {n} bytes, {left} left")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def too_long(self) -> UnsupportedError:
        return UnsupportedError(f"{self.where}: pickle larger than the limit of "
                                f"{self.limits.max_bytes} bytes", self.path)

    def line(self) -> bytes:
        end = self.data.find(b"\n", self.pos, self.stop)
        if end < 0:
            if self.truncated_by_limit:
                raise self.too_long()
            raise self.malformed("text argument without an end of line")
        text = self.data[self.pos:end]
        self.pos = end + 1
        return text

    def unpack(self, fmt: struct.Struct) -> Any:
        pos = self.pos
        if pos + fmt.size > self.stop:
            self.take(fmt.size)  # raises the right error
        self.pos = pos + fmt.size
        return fmt.unpack_from(self.data, pos)[0]

    def byte(self) -> int:
        pos = self.pos
        if pos >= self.stop:
            self.take(1)  # raises the right error
        self.pos = pos + 1
        return self.data[pos]

    # ------------------------------------------------------------------ stack

    # Limits are checked every _CHECK_EVERY opcodes by run(), not per push: each
    # opcode builds at most one object and pushes at most one value, so they are
    # overshot by at most that many, and the hot path stays two lines.

    def push(self, value: Any) -> None:
        self.stack.append(value)

    def new(self, value: Any) -> None:
        self.objects += 1
        self.stack.append(value)

    def check_limits(self, ops: int) -> None:
        limits = self.limits
        if ops > limits.max_ops:
            raise self.refused_limit(f"runs more than {limits.max_ops} opcodes")
        if self.objects > limits.max_objects:
            raise self.refused_limit(f"builds more than {limits.max_objects} objects")
        if len(self.memo) > limits.max_memo:
            raise self.refused_limit(f"builds more than {limits.max_memo} memo entries")
        # What the pickle makes this process hold counts against --memory as its names do:
        # a pickle of honest size per name (a million short keys) would otherwise be read
        # whole, for seconds and hundreds of MB, before its names exceed --memory.
        held = self.objects * _OBJECT_BYTES + (len(self.stack) + len(self.memo)) * _REFERENCE_BYTES
        memory = name_memory()
        if held > memory:
            raise UnsupportedError(
                f"{self.where}: the pickle builds {self.objects} objects and holds {len(self.stack)} values and "
                f"{len(self.memo)} memo entries, more than --memory ({memory / 2**20:.0f} MiB, "
                f"{_OBJECT_BYTES} bytes an object) holds; raise --memory", self.path)

    def refused_limit(self, what: str) -> UnsupportedError:
        return UnsupportedError(f"{self.where}: the pickle {what} (a pickle bomb?); tclip stops here",
                                self.path)

    def pop(self) -> Any:
        if not self.stack:
            raise self.malformed("stack underflow")
        return self.stack.pop()

    def top(self) -> Any:
        if not self.stack:
            raise self.malformed("stack underflow")
        return self.stack[-1]

    def pop_mark(self) -> list[Any]:
        if not self.metastack:
            raise self.malformed("no MARK to pop to")
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    # ------------------------------------------------------------------ values

    def key(self, value: Any, what: str = "dict key") -> Any:
        """A value checked for use as a dict key or set element, made canonical.

        Equal str/bytes/tuple keys become one object, found by the id of the value
        (each object is compared once, at a cost its own pickle bytes paid for);
        dicts then match them by identity, so re-inserting an equal key never
        compares long strings again.
        """
        if value is None or isinstance(value, float):
            return value
        if isinstance(value, int):  # bool included
            if abs(value) > _MAX_KEY_INT:  # larger ints collide by hash (n and n + 2**61 - 1)
                raise self.refused(f"{what} {value} is out of range")
            return value
        return self._canonical_key(value, what, 1)[0]

    def _canonical_key(self, value: Any, what: str, level: int) -> tuple[Any, int]:
        cached = self.key_cache.get(id(value))
        if cached is not None:
            _, canonical, depth = cached
        elif isinstance(value, str | bytes):
            canonical, depth = self.canonical.setdefault(value, value), 0
        elif isinstance(value, tuple):
            if level > _MAX_KEY_NESTING:
                raise self.refused(f"{what} nested more than {_MAX_KEY_NESTING} tuples deep")
            items, depth = [], 1
            for item in value:
                if isinstance(item, str | bytes | tuple):
                    item, inner = self._canonical_key(item, what, level + 1)
                    depth = max(depth, inner + 1)
                else:
                    item = self.key(item, what)
                items.append(item)
            hashed = _HashedTuple(items)
            canonical = self.canonical.setdefault(hashed, hashed)
        else:
            raise self.refused(f"{what} of type {_kind(value)}")
        if level - 1 + depth > _MAX_KEY_NESTING:
            raise self.refused(f"{what} nested more than {_MAX_KEY_NESTING} tuples deep")
        self.key_cache[id(value)] = (value, canonical, depth)
        return canonical, depth

    # ------------------------------------------------------------------ run

    def run(self) -> Any:
        data = self.data
        stop = self.stop
        handlers = self.handlers()
        ops = 0
        try:
            while True:
                pos = self.pos
                if pos >= stop:
                    if self.truncated_by_limit:
                        raise self.too_long()
                    raise self.malformed("ends without STOP")
                self.op_start = pos
                self.pos = pos + 1
                handlers[data[pos]]()
                ops += 1
                if not ops % _CHECK_EVERY:
                    self.check_limits(ops)
        except _Stop:
            pass
        except RecursionError:
            raise self.malformed("nested too deeply") from None
        except (ValueError, OverflowError, UnicodeDecodeError, struct.error) as error:
            if isinstance(error, (FormatError, UnsupportedError)):
                raise
            raise self.malformed(str(error).splitlines()[0][:200] or type(error).__name__) from None
        self.check_limits(ops)
        if self.metastack:
            raise self.malformed("MARK left open at STOP")
        if len(self.stack) != 1:
            raise self.malformed(f"{len(self.stack)} values on the stack at STOP, expected 1")
        return self.stack[0]

    def handlers(self) -> list[Any]:
        table: list[Any] = [self.unknown_op] * 256
        for name, code in _OP.items():
            if name in _REFUSED_OPS:
                table[code[0]] = self.refuse_op(name)
            else:
                table[code[0]] = getattr(self, "op_" + name.lower())
        return table

    def unknown_op(self) -> None:
        raise self.malformed(f"unknown opcode 0x{self.data[self.op_start]:02x}")

    def refuse_op(self, name: str) -> Any:
        def handler() -> None:
            if name in ("INST", "OBJ"):
                if name == "INST":
                    module, cls = self.line(), self.line()
                    raise self.refused(f"pickles an object of class "
                                       f"{_text(module)}.{_text(cls)} (opcode INST)")
                raise self.refused(f"pickles an object{self._class_of_mark()} (opcode OBJ)")
            if name in ("NEWOBJ", "NEWOBJ_EX"):
                depth = 3 if name == "NEWOBJ_EX" else 2
                cls = self.stack[-depth] if len(self.stack) >= depth else None
                what = f" of class {cls.name}" if isinstance(cls, _Global) else ""
                raise self.refused(f"pickles an object{what} (opcode {name})")
            if name == "PERSID":
                raise self.refused("has a text persistent id (not a torch storage)")
            if name.startswith("EXT"):
                raise self.refused(f"refers to a registered extension code (opcode {name})")
            raise self.refused(f"uses out-of-band buffers (opcode {name})")
        return handler

    def _class_of_mark(self) -> str:
        if self.stack and isinstance(self.stack[0], _Global):
            return f" of class {self.stack[0].name}"
        return ""

    # ------------------------------------------------------------------ framing

    def op_proto(self) -> None:
        version = self.byte()
        if version > 5:
            raise self.malformed(f"unsupported pickle protocol {version}")

    def op_frame(self) -> None:
        size = self.unpack(_U64)
        if size > self.stop - self.pos and not self.truncated_by_limit:
            raise self.malformed(f"frame of {size} bytes, {self.stop - self.pos} left")

    def op_stop(self) -> None:
        raise _Stop

    # ------------------------------------------------------------------ stack ops

    def op_mark(self) -> None:
        if len(self.metastack) >= self.limits.max_marks:
            raise self.refused_limit(f"nests more than {self.limits.max_marks} MARKs")
        self.metastack.append(self.stack)
        self.stack = []

    def op_pop(self) -> None:
        if self.stack:
            self.stack.pop()
        else:
            self.pop_mark()

    def op_pop_mark(self) -> None:
        self.pop_mark()

    def op_dup(self) -> None:
        self.push(self.top())

    # ------------------------------------------------------------------ scalars

    def op_none(self) -> None:
        self.push(None)

    def op_newtrue(self) -> None:
        self.push(True)

    def op_newfalse(self) -> None:
        self.push(False)

    def op_int(self) -> None:
        text = self.line()
        if text == b"01":
            self.push(True)
        elif text == b"00":
            self.push(False)
        else:
            self.new(_parse_int(text))

    def op_binint(self) -> None:
        self.new(self.unpack(_I32))

    def op_binint1(self) -> None:
        self.push(self.byte())

    def op_binint2(self) -> None:
        self.new(self.unpack(_U16))

    def op_long(self) -> None:
        text = self.line()
        if text.endswith(b"L"):
            text = text[:-1]
        self.new(_parse_int(text))

    def op_long1(self) -> None:
        n = self.byte()
        self.new(int.from_bytes(self.take(n), "little", signed=True))

    def op_long4(self) -> None:
        n = self.unpack(_I32)
        if n < 0:
            raise self.malformed("negative LONG4 length")
        if n > 64:
            # no value torch or plain data needs is this large; int.from_bytes is
            # linear, but printing or hashing huge ints is not
            raise self.refused(f"holds an integer of {n} bytes")
        self.new(int.from_bytes(self.take(n), "little", signed=True))

    def op_float(self) -> None:
        self.new(float(self.line()))

    def op_binfloat(self) -> None:
        self.new(self.unpack(_F64))

    # ------------------------------------------------------------------ strings

    def op_string(self) -> None:
        text = self.line()
        if len(text) < 2 or text[0] not in b"'\"" or text[-1] != text[0]:
            raise self.malformed("STRING argument is not quoted")
        raw = codecs.escape_decode(text[1:-1])[0]
        self.new(_decode_str8(raw))

    def op_binstring(self) -> None:
        n = self.unpack(_I32)
        self.new(_decode_str8(bytes(self.take(n))))

    def op_short_binstring(self) -> None:
        n = self.byte()
        self.new(_decode_str8(bytes(self.take(n))))

    def op_unicode(self) -> None:
        self.new(self.line().decode("raw-unicode-escape"))

    def op_binunicode(self) -> None:
        n = self.unpack(_U32)
        self.new(str(self.take(n), "utf-8", "surrogatepass"))

    def op_short_binunicode(self) -> None:
        n = self.byte()
        self.new(str(self.take(n), "utf-8", "surrogatepass"))

    def op_binunicode8(self) -> None:
        n = self.unpack(_U64)
        self.new(str(self.take(n), "utf-8", "surrogatepass"))

    def op_binbytes(self) -> None:
        self.new(bytes(self.take(self.unpack(_U32))))

    def op_short_binbytes(self) -> None:
        self.new(bytes(self.take(self.byte())))

    def op_binbytes8(self) -> None:
        self.new(bytes(self.take(self.unpack(_U64))))

    def op_bytearray8(self) -> None:
        self.new(bytearray(self.take(self.unpack(_U64))))

    # ------------------------------------------------------------------ containers

    def op_empty_tuple(self) -> None:
        self.push(())

    def op_tuple(self) -> None:
        items = self.pop_mark()
        self.new(tuple(items))

    def op_tuple1(self) -> None:
        a = self.pop()
        self.new((a,))

    def op_tuple2(self) -> None:
        b = self.pop()
        a = self.pop()
        self.new((a, b))

    def op_tuple3(self) -> None:
        c = self.pop()
        b = self.pop()
        a = self.pop()
        self.new((a, b, c))

    def op_empty_list(self) -> None:
        self.new([])

    def op_list(self) -> None:
        items = self.pop_mark()
        self.new(items)

    def op_append(self) -> None:
        value = self.pop()
        target = self.top()
        if not isinstance(target, list):
            raise self.malformed(f"APPEND to a {_kind(target)}")
        target.append(value)

    def op_appends(self) -> None:
        items = self.pop_mark()
        target = self.top()
        if not isinstance(target, list):
            raise self.malformed(f"APPENDS to a {_kind(target)}")
        target.extend(items)

    def op_empty_dict(self) -> None:
        self.new({})

    def op_dict(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise self.malformed("DICT with an odd number of items")
        result: dict[Any, Any] = {}
        self._set_items(result, items)
        self.new(result)

    def op_setitem(self) -> None:
        value = self.pop()
        key = self.pop()
        target = self.top()
        if not isinstance(target, dict):
            raise self.malformed(f"SETITEM on a {_kind(target)}")
        target[self.key(key)] = value

    def op_setitems(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise self.malformed("SETITEMS with an odd number of items")
        target = self.top()
        if not isinstance(target, dict):
            raise self.malformed(f"SETITEMS on a {_kind(target)}")
        self._set_items(target, items)

    def _set_items(self, target: dict[Any, Any], items: list[Any]) -> None:
        for i in range(0, len(items), 2):
            target[self.key(items[i])] = items[i + 1]

    def op_empty_set(self) -> None:
        self.new(set())

    def op_additems(self) -> None:
        items = self.pop_mark()
        target = self.top()
        if not isinstance(target, set):
            raise self.malformed(f"ADDITEMS to a {_kind(target)}")
        for item in items:
            target.add(self.key(item, "set element"))

    def op_frozenset(self) -> None:
        items = self.pop_mark()
        self.new(frozenset(self.key(item, "set element") for item in items))

    # ------------------------------------------------------------------ memo

    def op_put(self) -> None:
        self._memo_put(_parse_int(self.line()))

    def op_binput(self) -> None:
        self._memo_put(self.byte())

    def op_long_binput(self) -> None:
        self._memo_put(self.unpack(_U32))

    def op_memoize(self) -> None:
        self._memo_put(len(self.memo))

    def _memo_put(self, index: int) -> None:
        if index < 0:
            raise self.malformed("negative memo index")
        if not self.stack:
            raise self.malformed("stack underflow")
        self.memo[index] = self.stack[-1]

    def op_get(self) -> None:
        self._memo_get(_parse_int(self.line()))

    def op_binget(self) -> None:
        self._memo_get(self.byte())

    def op_long_binget(self) -> None:
        self._memo_get(self.unpack(_U32))

    def _memo_get(self, index: int) -> None:
        try:
            value = self.memo[index]
        except KeyError:
            raise self.malformed(f"memo entry {index} read before it is written") from None
        self.push(value)

    # ------------------------------------------------------------------ globals

    def op_global(self) -> None:
        module = _text(self.line())
        name = _text(self.line())
        self.push(self.find(module, name))

    def op_stack_global(self) -> None:
        name = self.pop()
        module = self.pop()
        if not isinstance(module, str) or not isinstance(name, str):
            raise self.malformed("STACK_GLOBAL needs two strings")
        self.push(self.find(module, name))

    def find(self, module: str, name: str) -> _Global | TorchValue:
        found = _GLOBALS.get((module, name))
        if found is None:
            if self.persistent == "zip" and _no_floating_storage(bytes(self.data[self.begin:self.stop])):
                # A Trainer's rng_state.pth (NumPy's and Python's generator states) or
                # training_args.bin (an object): nothing to measure; saving a state_dict is no advice here.
                raise NoTensorsError(f"{self.where}: holds no tensors tclip reads (no floating-point storage; "
                                     f"its Python objects are never built: {_describe_global(module, name)})",
                                     self.path)
            raise self.refused(_describe_global(module, name))
        if found.kind == "dtype":  # a dtype is pickled as the global itself: a value
            return TorchValue("dtype", found.arg)
        return found

    # ------------------------------------------------------------------ persistent ids

    def op_binpersid(self) -> None:
        pid = self.pop()
        self.new(self.storage(pid))

    def storage(self, pid: Any) -> StorageRef:
        if not isinstance(pid, tuple) or not pid:
            raise self.refused(f"has a persistent id that is a {_kind(pid)}, not a torch storage")
        typename = _ascii(pid[0])
        if typename == "module":
            cls = pid[1] if len(pid) > 1 else None
            what = f" of class {cls.name}" if isinstance(cls, _Global) else ""
            raise self.refused(f"holds a module saved whole{what}")
        if typename != "storage":
            raise self.refused(f"has a persistent id of type {typename!r}, not a torch storage")
        expected = 6 if self.persistent == "legacy" else 5
        if len(pid) != expected:
            raise self.malformed(f"storage persistent id with {len(pid)} fields, expected {expected}")
        storage_type, key, location, numel = pid[1:5]
        if self.persistent == "legacy" and pid[5] is not None:
            raise self.refused("holds a storage view (a torch < 1.0 feature tclip does not read)")
        if not isinstance(storage_type, _Global) or storage_type.kind != "storage_type":
            raise self.malformed("storage persistent id without a storage type")
        key = _ascii(key)
        location = _ascii(location)
        if key is None or location is None:
            raise self.malformed("storage key and location must be strings")
        if not _is_int(numel) or numel < 0:
            raise self.malformed(f"storage {key!r} declares {numel!r} elements")
        dtype_name = _STORAGE_DTYPES[storage_type.arg]
        if dtype_name is None:
            raise self.refused(f"holds a quantized storage ({storage_type.arg})")
        dtype = _numpy_dtype(dtype_name, self.byteorder)
        if numel * dtype.itemsize > 1 << 62:
            raise self.malformed(f"storage {key!r} declares {numel} elements")
        ref = StorageRef(key, dtype, numel, location, storage_type.arg)
        known = self.storages.get(key)
        if known is None:
            self.storages[key] = ref
            return ref
        if known.dtype != ref.dtype or known.numel != ref.numel:
            raise self.malformed(
                f"storage {key!r} is declared twice, as {known.numel} x {_dtype_text(known.dtype)} "
                f"and as {ref.numel} x {_dtype_text(ref.dtype)}")
        return known

    # ------------------------------------------------------------------ calls (none run)

    def op_reduce(self) -> None:
        args = self.pop()
        func = self.pop()
        if not isinstance(func, _Global):
            raise self.refused(f"calls a {_kind(func)} (REDUCE on something not an accepted global)")
        if not isinstance(args, tuple):
            raise self.malformed(f"{func.name} called with a {_kind(args)} as its arguments")
        builder = getattr(self, "reduce_" + func.kind, None)
        if builder is None:
            raise self.refused(f"calls {func.name}, which only names a value")
        # Builders copy their arguments (set(list), bytes from str): a pickle could
        # call one on the same big argument over and over, a few bytes per call.
        # Copies that the pickle's own bytes did not pay for are refused.
        self.copied += sum(len(a) for a in args if isinstance(a, str | bytes | list | tuple | dict))
        if self.copied > self.copy_budget:
            raise self.refused_limit(f"copies more than {self.copy_budget} items in calls")
        self.new(builder(func, args))

    def _arity(self, func: _Global, args: tuple[Any, ...], *counts: int) -> None:
        if len(args) not in counts:
            raise self.malformed(f"{func.name} called with {len(args)} arguments")

    def reduce_ordered_dict(self, func: _Global, args: tuple[Any, ...]) -> OrderedDictValue:
        self._arity(func, args, 0, 1)
        result = OrderedDictValue()
        if args:
            pairs = args[0]
            if not isinstance(pairs, list | tuple):
                raise self.malformed(f"{func.name} called with a {_kind(pairs)}")
            for pair in pairs:
                if not isinstance(pair, list | tuple) or len(pair) != 2:
                    raise self.malformed(f"{func.name} item is not a pair")
                result[self.key(pair[0])] = pair[1]
        return result

    def reduce_rebuild_tensor(self, func: _Global, args: tuple[Any, ...]) -> TensorRef:
        self._arity(func, args, 4)
        return self.tensor(func, args[0], args[1], args[2], args[3], False, None, None)

    def reduce_rebuild_tensor_v2(self, func: _Global, args: tuple[Any, ...]) -> TensorRef:
        self._arity(func, args, 6, 7)
        metadata = args[6] if len(args) == 7 else None
        return self.tensor(func, *args[:4], args[4], args[5], metadata)

    def reduce_rebuild_tensor_v3(self, func: _Global, args: tuple[Any, ...]) -> TensorRef:
        self._arity(func, args, 7, 8)
        dtype = args[6]
        if not isinstance(dtype, TorchValue) or dtype.kind != "dtype":
            raise self.malformed(f"{func.name} without a dtype")
        metadata = args[7] if len(args) == 8 else None
        return self.tensor(func, *args[:4], args[4], args[5], metadata, dtype.text)

    def tensor(self, func: _Global, storage: Any, offset: Any, shape: Any, stride: Any,
               requires_grad: Any, hooks: Any, metadata: Any, dtype_name: str | None = None) -> TensorRef:
        if not isinstance(storage, StorageRef):
            raise self.malformed(f"{func.name} called on a {_kind(storage)}, not a storage")
        if not _is_int(offset) or offset < 0:
            raise self.malformed(f"{func.name}: storage offset {offset!r}")
        shape = self._dims(func, "size", shape)
        stride = self._dims(func, "stride", stride)
        if len(shape) != len(stride):
            raise self.malformed(f"{func.name}: size {list(shape)} and stride {list(stride)} differ in length")
        if not isinstance(requires_grad, bool):
            raise self.malformed(f"{func.name}: requires_grad is a {_kind(requires_grad)}")
        if hooks is not None and not (isinstance(hooks, dict) and not hooks):
            raise self.refused(f"{func.name} with backward hooks")
        conj = neg = False
        if metadata is not None:
            if not isinstance(metadata, dict):
                raise self.malformed(f"{func.name}: metadata is a {_kind(metadata)}")
            for flag, value in metadata.items():
                if flag not in ("conj", "neg") or not isinstance(value, bool):
                    raise self.refused(f"{func.name} with tensor metadata {flag!r}")
            conj, neg = bool(metadata.get("conj", False)), bool(metadata.get("neg", False))
        unreadable = None
        if dtype_name is None:
            dtype = storage.dtype
        elif dtype_name in TORCH_DTYPES:
            dtype = _numpy_dtype(dtype_name, self.byteorder)
        elif dtype_name in _OPAQUE_TORCH_DTYPES:
            dtype, unreadable = np.dtype((np.void, _OPAQUE_TORCH_DTYPES[dtype_name])), dtype_name
        else:
            raise self.refused(f"holds a tensor of dtype torch.{dtype_name}, which tclip cannot read")
        size = math.prod(shape)
        if size * dtype.itemsize > 1 << 62:
            raise self.malformed(f"{func.name}: size {list(shape)} is impossibly large")
        if size:
            stride = _settled(shape, stride)
        return TensorRef(storage, dtype, offset, shape, stride, requires_grad, False, conj, neg, unreadable)

    def _dims(self, func: _Global, what: str, value: Any) -> tuple[int, ...]:
        if not isinstance(value, tuple | list):
            raise self.malformed(f"{func.name}: {what} is a {_kind(value)}")
        if len(value) > _MAX_DIMS:
            raise self.malformed(f"{func.name}: {len(value)} dimensions (at most {_MAX_DIMS})")
        for n in value:
            if not _is_int(n) or n < 0 or n > 1 << 62:
                raise self.malformed(f"{func.name}: {what} {list(value)!r}")
        return tuple(value)

    def reduce_rebuild_parameter(self, func: _Global, args: tuple[Any, ...]) -> TensorRef:
        self._arity(func, args, 3)
        return self.parameter(func, args[0], args[1], args[2])

    def reduce_rebuild_parameter_with_state(self, func: _Global, args: tuple[Any, ...]) -> TensorRef:
        self._arity(func, args, 4)
        self.plain_state(func.name, args[3])
        return self.parameter(func, args[0], args[1], args[2])

    def parameter(self, func: _Global, data: Any, requires_grad: Any, hooks: Any) -> TensorRef:
        if not isinstance(data, TensorRef):
            raise self.malformed(f"{func.name} called on a {_kind(data)}, not a tensor")
        if not isinstance(requires_grad, bool):
            raise self.malformed(f"{func.name}: requires_grad is a {_kind(requires_grad)}")
        if not (isinstance(hooks, dict) and not hooks):
            raise self.refused(f"{func.name} with backward hooks")
        return TensorRef(data.storage, data.dtype, data.offset, data.shape, data.stride,
                         requires_grad, True, data.conj, data.neg, data.unreadable)

    def plain_state(self, what: str, state: Any) -> None:
        """Refuse state that is not plain attribute data (tensors, records, markers).

        Each container is walked once per pickle (shared or repeated state costs
        nothing the second time), so the work stays linear in the pickle's size.
        """
        pending = [state]
        while pending:
            value = pending.pop()
            if isinstance(value, dict | list | tuple | set | frozenset):
                if id(value) in self.plain_seen:
                    continue
                self.plain_seen[id(value)] = value  # held, so its id is not reused
                if isinstance(value, dict):
                    pending.extend(value.keys())
                    pending.extend(value.values())
                else:
                    pending.extend(value)
            elif not isinstance(value, _PLAIN_SCALARS):
                raise self.refused(f"{what} with state holding a {_kind(value)}")

    def reduce_encode(self, func: _Global, args: tuple[Any, ...]) -> bytes:
        self._arity(func, args, 1, 2)
        text = args[0]
        encoding = args[1] if len(args) == 2 else "utf-8"
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise self.refused(f"calls {func.name} with {_kind(text)}, {encoding!r} (only latin1 text)")
        return text.encode("latin-1")

    def reduce_bytes(self, func: _Global, args: tuple[Any, ...]) -> bytes:
        self._arity(func, args, 0)
        return b""

    def reduce_set(self, func: _Global, args: tuple[Any, ...]) -> set[Any]:
        return set(self._set_items_of(func, args))

    def reduce_frozenset(self, func: _Global, args: tuple[Any, ...]) -> frozenset[Any]:
        return frozenset(self._set_items_of(func, args))

    def _set_items_of(self, func: _Global, args: tuple[Any, ...]) -> list[Any]:
        self._arity(func, args, 0, 1)
        if not args:
            return []
        if not isinstance(args[0], list | tuple):
            raise self.malformed(f"{func.name} called with a {_kind(args[0])}")
        return [self.key(item, "set element") for item in args[0]]

    def reduce_complex(self, func: _Global, args: tuple[Any, ...]) -> complex:
        self._arity(func, args, 1, 2)
        if not all(isinstance(a, int | float) for a in args):
            raise self.malformed(f"{func.name} called with {', '.join(_kind(a) for a in args)}")
        return complex(*(float(a) for a in args))

    def reduce_bytearray(self, func: _Global, args: tuple[Any, ...]) -> bytearray:
        self._arity(func, args, 0, 1, 2)
        if not args:
            return bytearray()
        if len(args) == 1 and isinstance(args[0], bytes):
            return bytearray(args[0])
        if len(args) == 2 and isinstance(args[0], str) and args[1] in ("latin1", "latin-1"):
            return bytearray(args[0].encode("latin-1"))
        raise self.malformed(f"{func.name} called with {', '.join(_kind(a) for a in args)}")

    def reduce_size(self, func: _Global, args: tuple[Any, ...]) -> tuple[int, ...]:
        self._arity(func, args, 0, 1)
        dims = args[0] if args else ()
        if not isinstance(dims, tuple | list) or not all(_is_int(n) for n in dims):
            raise self.malformed(f"{func.name} called with a {_kind(dims)}")
        return tuple(dims)

    def reduce_device(self, func: _Global, args: tuple[Any, ...]) -> TorchValue:
        self._arity(func, args, 1, 2)
        kind = args[0]
        if not isinstance(kind, str) or len(kind) > 64 or (len(args) == 2 and not (
                _is_int(args[1]) or args[1] is None)):
            raise self.malformed(f"{func.name} called with {', '.join(_kind(a) for a in args)}")
        text = kind if len(args) == 1 or args[1] is None else f"{kind}:{args[1]}"
        return TorchValue("device", text)

    # ------------------------------------------------------------------ BUILD

    def op_build(self) -> None:
        state = self.pop()
        target = self.top()
        if isinstance(target, OrderedDictValue):
            # OrderedDict has no __setstate__: pickle would update its __dict__.
            # A state_dict's _metadata (per-module versions) arrives this way.
            if isinstance(state, tuple) and len(state) == 2:
                parts = [s for s in state if s is not None]
            else:
                parts = [state]
            for part in parts:
                if not isinstance(part, dict):
                    raise self.refused(f"sets attributes on an OrderedDict from a {_kind(part)}")
                if id(part) not in self.plain_seen:
                    if not all(isinstance(k, str) for k in part):
                        raise self.refused("sets attributes on an OrderedDict with names that are not text")
                    self.plain_state("OrderedDict attributes", part)
                target._add_state(part)
            return
        if isinstance(target, TensorRef):
            # Attributes on a tensor or parameter are Python-side state, not data:
            # accepted when plain, not kept.
            self.plain_state("tensor attributes", state)
            return
        raise self.refused(f"sets the state of a {_kind(target)} (opcode BUILD)")


_PLAIN_SCALARS = (str, bytes, bytearray, int, float, complex, type(None), TorchValue)

_I32 = struct.Struct("<i")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct(">d")


def _settled(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    """The strides with each dimension of size 1 given the stride C order would (the one
    below times its size): such a stride never moves the view (torch loads a (1, 4) view of
    stride (2**62, 2)), and a huge one would overflow NumPy's byte strides."""
    settled, inner = list(stride), 1
    for axis in reversed(range(len(shape))):
        if shape[axis] == 1:
            settled[axis] = inner
        inner *= shape[axis]
    return tuple(settled)


def _parse_int(text: bytes) -> int:
    text = text.strip()
    if not text or len(text) > 40:
        raise ValueError(f"bad integer {text[:40]!r}")
    return int(text)


def _decode_str8(raw: bytes) -> str:
    # Python 2 str: torch.load decodes them as UTF-8 (its default pickle encoding)
    return raw.decode("utf-8")


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


def _ascii(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("ascii")
        except UnicodeDecodeError:
            return None
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dtype_text(dtype: np.dtype) -> str:
    return str(dtype.newbyteorder("=")) if dtype.itemsize > 1 else str(dtype)


def _kind(value: Any) -> str:
    """What a value is, in words for messages and reports."""
    if value is None:
        return "None"
    if isinstance(value, _Global):
        return f"reference to {value.name}"
    if isinstance(value, TensorRef):
        return "tensor"
    if isinstance(value, StorageRef):
        return "storage"
    if isinstance(value, TorchValue):
        return value.kind
    if isinstance(value, OrderedDictValue):
        return "dict"
    if isinstance(value, _HashedTuple):
        return "tuple"
    return type(value).__name__


# Storages that hold no floating-point values: a pickle naming only these holds no weights.
_WHOLE_NUMBER_STORAGES = frozenset(f"{module} {name}" for module in ("torch", "torch.cuda") for name in (
    "LongStorage", "IntStorage", "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage"))


def _no_floating_storage(pickled: bytes) -> bool:
    """Whether a pickle provably names no storage that could hold floating-point values: its
    opcodes are only parsed (``pickletools.genops`` runs nothing), every torch storage class
    it names is an integer or bool one. A global named through the stack (protocol 4) or a
    pickle that does not parse counts as one that may hold them."""
    try:
        for opcode, arg, _ in pickletools.genops(io.BytesIO(pickled)):
            if opcode.name == "STACK_GLOBAL":
                return False
            if opcode.name == "GLOBAL" and str(arg).endswith("Storage") and arg not in _WHOLE_NUMBER_STORAGES:
                return False
    except Exception:  # a pickle genops cannot parse: nothing proven
        return False
    return True


def _describe_global(module: str, name: str) -> str:
    dotted = f"{module}.{name}"
    shown = dotted if len(dotted) <= 200 else dotted[:200] + "..."
    shown = shown.encode("unicode_escape").decode("ascii")
    if dotted == "torch._tensor._rebuild_from_type_v2":
        hint = " (a tensor subclass or a tensor with Python attributes)"
    elif module.startswith("torch.nn.modules") or module == "__main__":
        hint = " (a model or other Python object saved whole)"
    elif module.startswith("torch"):
        hint = " (a torch object that is not a plain tensor)"
    else:
        hint = ""
    return f"refused global '{shown}'{hint}"


# --------------------------------------------------------------------------- API


def load_torch_pickle(data: Any, *, start: int = 0, persistent: str = "zip",
                      byteorder: str = "little", limits: PickleLimits | None = None,
                      where: str = "data.pkl", path: object = None) -> PickleResult:
    """Interpret one pickle written by ``torch.save`` without running it.

    Args:
        data: the bytes holding the pickle (``bytes`` or an ``mmap``; the legacy format's
            pickles are read from the mapped file, ending wherever their STOP is).
        start: offset of its first opcode in ``data`` (the legacy format chains pickles).
        persistent: ``"zip"`` for persistent ids ``('storage', type, key, location, numel)``,
            ``"legacy"`` for the non-zip format's 6-field ids (with a view entry).
        byteorder: ``"little"`` or ``"big"``: the byte order given to the dtypes.
        limits: caps on size and work (defaults: :class:`PickleLimits`).
        where: what the pickle is, for messages (``archive/data.pkl``).
        path: the file, for messages.

    Returns:
        A :class:`PickleResult`: the value tree, where the pickle ends, and its storages.

    Raises:
        UnsupportedError: a global outside the allowlist, an object, a module saved
            whole, a limit exceeded (the message names what was found).
        FormatError: a malformed pickle.
    """
    limits = limits or PickleLimits()
    if byteorder not in ("little", "big"):
        raise ValueError(f"Expected byteorder 'little' or 'big', got {byteorder!r}")
    if persistent not in ("zip", "legacy"):
        raise ValueError(f"Expected persistent 'zip' or 'legacy', got {persistent!r}")
    if isinstance(data, memoryview | bytearray):
        data = bytes(data)
    size = len(data) - start
    if size > limits.max_bytes and persistent == "zip":
        raise UnsupportedError(f"{where}: pickle of {size} bytes is larger than the limit of "
                               f"{limits.max_bytes} bytes", path)
    stop = min(len(data), start + limits.max_bytes)
    interpreter = _Interpreter(data, start, stop, persistent, "<" if byteorder == "little" else ">",
                               limits, where, path)
    root = interpreter.run()
    return PickleResult(root, interpreter.pos, interpreter.storages)


def flatten(root: Any, *, budget: int, max_depth: int = 100, where: str = "data.pkl",
            path: object = None) -> Iterator[Leaf]:
    """Walk a value tree depth-first, in container order, yielding its leaves.

    Dicts are walked, and lists and tuples that hold tensors or containers; empty
    containers, lists/tuples of scalars, sets and every other value are leaves. The
    walk is iterative and bounded.

    Args:
        root: a tree from :func:`load_torch_pickle`.
        budget: the most nodes plus path entries the walk may visit; a tree that shares
            sub-trees (legal in a pickle: the memo) could otherwise expand exponentially.
        max_depth: deepest nesting accepted.
        where, path: for messages.

    Yields:
        :class:`Leaf` ``(path, value)``: ``path`` is the tuple of dict keys and list
        indices from the root.

    Raises:
        UnsupportedError: a container holding itself, nesting deeper than ``max_depth``,
            the budget exceeded, or a bare reference to a global left in the tree.
    """
    work = 0
    # (value, path, ids of the containers above it)
    pending: list[tuple[Any, tuple[Any, ...], frozenset[int]]] = [(root, (), frozenset())]
    while pending:
        value, keys, above = pending.pop()
        work += 1 + len(keys) + (len(value) if isinstance(value, list | tuple) else 0)
        if work > budget:
            raise UnsupportedError(f"{where}: the pickle's containers share sub-trees that expand to more "
                                   f"than {budget} entries (a pickle bomb?)", path)
        if isinstance(value, dict) and value or isinstance(value, list | tuple) and _walked(value):
            if id(value) in above:
                raise UnsupportedError(f"{where}: a container holds itself at "
                                       f"{'.'.join(str(k) for k in keys)!r}", path)
            if len(keys) >= max_depth:
                raise UnsupportedError(f"{where}: containers nested more than {max_depth} deep", path)
            inner = above | {id(value)}
            items = value.items() if isinstance(value, dict) else enumerate(value)
            children = [(child, (*keys, _plain_key(key)), inner) for key, child in items]
            pending.extend(reversed(children))
        elif isinstance(value, _Global):
            raise UnsupportedError(f"{where}: holds a reference to {value.name} at "
                                   f"{'.'.join(str(k) for k in keys)!r}: {ADVICE}", path)
        else:
            yield Leaf(keys, value)


def _walked(sequence: list[Any] | tuple[Any, ...]) -> bool:
    # A list or tuple of plain scalars (an optimizer's param ids, betas) is one
    # value; one holding tensors or containers is walked like a dict.
    return any(isinstance(item, _CONTAINS) for item in sequence)


_CONTAINS = (dict, list, tuple, TensorRef, StorageRef, _Global)


def _plain_key(key: Any) -> Any:
    if isinstance(key, _HashedTuple):
        return tuple(_plain_key(k) for k in key)
    return key


def kind_of(value: Any) -> str:
    """A short word for what a non-tensor value is (``int``, ``str``, ``dict``, ``dtype``...).

    Args:
        value: a leaf from :func:`flatten`.

    Returns:
        The kind, for listings.
    """
    return _kind(value)
