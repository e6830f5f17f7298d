"""What the allowlist pickle interpreter builds (:mod:`.unpickler`): storage and tensor records, the
markers of accepted globals, plain values, the limits of a run, and the walk over the result tree.

The walk (:func:`flatten`) is iterative and bounded: it refuses cycles, nesting deeper than
:attr:`PickleLimits.max_depth` and shared sub-trees that would multiply the work.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import ml_dtypes
import numpy as np

from ...errors import UnsupportedError


ADVICE = "save the state_dict (tensors only), or convert the file to safetensors"


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
# Of those, the ones known to hold no floating-point values (complex ones, which a clip never
# changes): carried by a clip; the others may hold floats, and a clip selecting one is refused.
NOT_FLOATING_TORCH_DTYPES = frozenset({"complex32", "chalf"})


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


def _numpy_dtype(name: str, byteorder: Literal["<", ">"]) -> np.dtype:
    dtype = TORCH_DTYPES[name]
    return dtype.newbyteorder(byteorder) if dtype.itemsize > 1 else dtype


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


class OrderedDictValue(dict):
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


class _HashedTuple(tuple):
    """A tuple used as a dict key or set element, hashed through the text of its
    items' hashes: CPython's tuple hash of attacker-chosen ints collides at will, and
    colliding keys make every insert compare with all the others (quadratic work
    from a small pickle). Its items are canonical keys (see ``_Interpreter.key``)."""

    _hash: int

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
            when the names ``--memory`` allows need less: :mod:`.archive`), so
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
    """What :func:`.unpickler.load_torch_pickle` returns.

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


def flatten(root: Any, *, budget: int, max_depth: int = 100, where: str = "data.pkl",
            path: object = None) -> Iterator[Leaf]:
    """Walk a value tree depth-first, in container order, yielding its leaves.

    Dicts are walked, and lists and tuples that hold tensors or containers; empty
    containers, lists/tuples of scalars, sets and every other value are leaves. The
    walk is iterative and bounded.

    Args:
        root: a tree from :func:`.unpickler.load_torch_pickle`.
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
