"""The header of a GGUF file (llama.cpp's format), parsed from the spec (ggml's docs/gguf.md).

Layout: the bytes ``GGUF``; a uint32 version (2 or 3); uint64 tensor and metadata
counts; the metadata key/values (a string key, a uint32 value type, the value; arrays
carry their element type and a uint64 length and may nest); one info per tensor
(name, uint32 dimension count, uint64 dimensions innermost first, uint32 ggml type,
uint64 offset from the start of the data section); zero padding to the alignment
(``general.alignment``, default 32); the tensor data. Strings are a uint64 length
and UTF-8 bytes. Version 3 files may be big-endian throughout, which shows as a
byte-swapped version field.

Nothing a header claims is trusted: every count and length is checked against the
file's size before anything is allocated, long arrays (a tokenizer's vocabulary)
are kept as :class:`GgufArray` summaries (type, length, where, first few values),
and every problem is one :class:`~tclip.errors.FormatError` naming the file.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from types import MappingProxyType
from typing import Any

from ...errors import FormatError
from .ggml_types import GGML_TYPES, type_name

__all__ = [
    "DEFAULT_ALIGNMENT",
    "GGUF_MAGIC",
    "GgufArray",
    "GgufHeader",
    "GgufLongString",
    "GgufSplit",
    "GgufTensor",
    "ValueType",
    "parse_gguf",
    "read_array",
]

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
VERSIONS = (2, 3)  # 1 had 32-bit counts and lengths; ggml refuses it too
MAX_DIMS = 8  # ggml has 4; more is read (and reported) but never an allocation
MAX_NAME_BYTES = 65535  # the spec's limit for keys; tensor names are held to it as well
MAX_NESTING = 16  # arrays of arrays of ...
ARRAY_HEAD = 8  # values of an array kept for display
MAX_INLINE_STRING = 1 << 20  # longer string values are kept as GgufLongString
LONG_STRING_HEAD = 200  # characters of a long string kept for display


class ValueType(IntEnum):
    """GGUF metadata value types (gguf_metadata_value_type)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct codes and sizes of the fixed-size value types (BOOL is a byte checked to be 0 or 1)
_SCALARS: dict[int, tuple[str, int]] = {
    ValueType.UINT8: ("B", 1), ValueType.INT8: ("b", 1),
    ValueType.UINT16: ("H", 2), ValueType.INT16: ("h", 2),
    ValueType.UINT32: ("I", 4), ValueType.INT32: ("i", 4),
    ValueType.FLOAT32: ("f", 4), ValueType.BOOL: ("B", 1),
    ValueType.UINT64: ("Q", 8), ValueType.INT64: ("q", 8),
    ValueType.FLOAT64: ("d", 8),
}
# the fewest bytes one element can take: a string is at least its length, an array its type and length
_MIN_BYTES = {**{t: size for t, (_, size) in _SCALARS.items()}, ValueType.STRING: 8, ValueType.ARRAY: 12}
_INTEGER_TYPES = frozenset({ValueType.UINT8, ValueType.INT8, ValueType.UINT16, ValueType.INT16,
                            ValueType.UINT32, ValueType.INT32, ValueType.UINT64, ValueType.INT64})


@dataclass(frozen=True)
class GgufArray:
    """A metadata array, summarised: its elements stay in the file.

    ``offset`` is the file offset of the first element and ``nbytes`` the size of all
    of them; ``head`` holds the first :data:`ARRAY_HEAD` elements (nested arrays as
    :class:`GgufArray`, long strings as :class:`GgufLongString`). :func:`read_array`
    reads the whole array when someone really wants it.
    """

    element_type: ValueType
    length: int
    offset: int
    nbytes: int
    head: tuple[Any, ...]

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class GgufLongString:
    """A string value longer than :data:`MAX_INLINE_STRING` bytes, left in the file."""

    offset: int
    nbytes: int
    head: str


@dataclass(frozen=True)
class GgufTensor:
    """One tensor info.

    Attributes:
        name: the GGUF tensor name.
        shape: NumPy order (GGUF stores the dimensions innermost first: ``dims``).
        ggml_type: ggml's type id; ``type_name`` its name (``type 99`` when unknown).
        offset: absolute file offset of the data.
        nbytes: size of the data, None for a type ggml does not define.
    """

    name: str
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    ggml_type: int
    type_name: str
    offset: int
    nbytes: int | None

    @property
    def known(self) -> bool:
        """Whether the type is one ggml defines (its size and layout are known)."""
        return self.nbytes is not None

    @property
    def size(self) -> int:
        """Number of values."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class GgufSplit:
    """The ``split.*`` keys of one file of a split set (``model-00001-of-00003.gguf``)."""

    no: int
    count: int
    tensors_count: int | None


@dataclass(frozen=True)
class GgufHeader:
    """Everything before the tensor data, parsed.

    ``metadata`` maps keys to Python values (int, float, bool, str) or to
    :class:`GgufArray` / :class:`GgufLongString` summaries, in file order;
    ``metadata_types`` gives each key's :class:`ValueType`. ``tensor_info_end`` is
    where the tensor infos end (padding follows up to ``data_offset``).
    """

    path: str
    version: int
    byteorder: str
    file_size: int
    metadata: Mapping[str, Any]
    metadata_types: Mapping[str, ValueType]
    tensors: tuple[GgufTensor, ...]
    alignment: int
    tensor_info_end: int
    data_offset: int
    _by_name: Mapping[str, GgufTensor] = field(repr=False, compare=False, default_factory=dict)
    # Parsed with data_may_be_missing: why the tensor data is not all there (None: it is).
    truncated: str | None = None

    def tensor(self, name: str) -> GgufTensor:
        """The tensor called ``name`` (KeyError if there is none)."""
        return self._by_name[name]

    @property
    def split(self) -> GgufSplit | None:
        """``split.no``, ``split.count`` and ``split.tensors.count``, when the file has them."""
        if "split.count" not in self.metadata and "split.no" not in self.metadata:
            return None
        split = GgufSplit(self._integer_key("split.no", 0), self._integer_key("split.count", 1),
                          self._integer_key("split.tensors.count", None))
        if split.count < 1 or not 0 <= split.no < split.count:
            raise FormatError(f"its split.no ({split.no}) is out of range for split.count {split.count} "
                              f"(0 to {split.count - 1}): it is no file of a split set", self.path)
        return split

    def _integer_key(self, key: str, default: int | None) -> Any:
        if key not in self.metadata:
            return default
        if self.metadata_types[key] not in _INTEGER_TYPES:
            raise FormatError(f"metadata {key!r} must be an integer, got {self.metadata_types[key].name}", self.path)
        return self.metadata[key]


def parse_gguf(path: str | os.PathLike[str], data_may_be_missing: bool = False) -> GgufHeader:
    """Parse the header of the GGUF file at ``path`` and check its tensor layout.

    ``data_may_be_missing``: tensor data running past the end of the file (a file cut after
    its header) is no error; the header's ``truncated`` says what is missing instead.

    Raises:
        FormatError: not a GGUF file, an unsupported version, a malformed or
            truncated header, or tensor data that is misaligned, overlaps another
            tensor's or runs past the end of the file (the message names the tensor).
        OSError: the file cannot be opened or read.

    Example:
        >>> header = parse_gguf("model.gguf")  # doctest: +SKIP
        >>> header.metadata["general.architecture"], header.tensors[0].shape  # doctest: +SKIP
        ('llama', (32000, 4096))
    """
    name = str(path)
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        start = file.read(24)
        if start[:4] != GGUF_MAGIC:
            raise FormatError("not a GGUF file (it does not start with 'GGUF')", name)
        if len(start) < 24:
            raise FormatError(f"truncated GGUF header: the file has only {size} bytes", name)
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            parser = _Parser(buffer, size, name)
            parser.data_may_be_missing = data_may_be_missing
            return parser.header()


def read_array(path: str | os.PathLike[str], array: GgufArray, byteorder: str = "<") -> list[Any]:
    """All elements of a metadata array, read from the file (strings decoded, nested arrays as lists).

    Raises:
        FormatError: the file changed since it was parsed.
    """
    name = str(path)
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if array.offset + array.nbytes > size:
            raise FormatError("the file is shorter than when its header was read", name)
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            parser = _Parser(buffer, size, name, byteorder)
            parser.pos = array.offset
            return parser.elements(array.element_type, array.length, 1)


def _align(offset: int, alignment: int) -> int:
    return offset + (-offset % alignment)


def _decode(raw: bytes) -> str:
    # Text from files is data: undecodable bytes stay visible as escapes, never an error.
    return raw.decode("utf-8", errors="backslashreplace")


class _Parser:
    """A cursor over the mapped file; every read is checked against its size."""

    def __init__(self, buffer: Any, size: int, path: str, byteorder: str = "<") -> None:
        self.buffer = buffer
        self.size = size
        self.path = path
        self.order = byteorder
        self.pos = 0
        self.data_may_be_missing = False
        self.past_end: list[str] = []  # with data_may_be_missing: why each tensor's data is not there

    def fail(self, message: str) -> FormatError:
        return FormatError(message, self.path)

    def need(self, count: int, what: str) -> None:
        if count > self.size - self.pos:
            raise self.fail(f"truncated GGUF header: {what} at byte {self.pos} needs {count} bytes, "
                            f"the file ends at byte {self.size}")

    def unpack(self, code: str, nbytes: int, what: str) -> Any:
        self.need(nbytes, what)
        (value,) = struct.unpack_from(self.order + code, self.buffer, self.pos)
        self.pos += nbytes
        return value

    def u32(self, what: str) -> int:
        return self.unpack("I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("Q", 8, what)

    def raw_string(self, what: str, limit: int | None = None) -> tuple[int, int]:
        """(offset, length) of a string, checked to lie within the file (and ``limit``)."""
        length = self.u64(f"the length of {what}")
        if limit is not None and length > limit:
            raise self.fail(f"{what} at byte {self.pos - 8} is {length} bytes long, more than {limit}")
        if length > self.size - self.pos:
            raise self.fail(f"{what} at byte {self.pos - 8} claims {length} bytes, "
                            f"past the end of the file ({self.size} bytes)")
        offset = self.pos
        self.pos += length
        return offset, length

    def name(self, what: str) -> str:
        offset, length = self.raw_string(what, MAX_NAME_BYTES)
        return _decode(self.buffer[offset:offset + length])

    def string_value(self, what: str) -> str | GgufLongString:
        offset, length = self.raw_string(what)
        if length > MAX_INLINE_STRING:
            head = _decode(self.buffer[offset:offset + LONG_STRING_HEAD * 4])[:LONG_STRING_HEAD]
            return GgufLongString(offset, length, head)
        return _decode(self.buffer[offset:offset + length])

    def value_type(self, what: str) -> ValueType:
        code = self.u32(what)
        try:
            return ValueType(code)
        except ValueError:
            raise self.fail(f"{what} at byte {self.pos - 4} is {code}, not a GGUF value type (0-12)") from None

    def value(self, kind: ValueType, what: str, depth: int = 0) -> Any:
        if kind == ValueType.STRING:
            return self.string_value(what)
        if kind == ValueType.ARRAY:
            return self.array(what, depth + 1)
        code, nbytes = _SCALARS[kind]
        value = self.unpack(code, nbytes, what)
        if kind == ValueType.BOOL:
            if value > 1:
                raise self.fail(f"{what} at byte {self.pos - 1} is a bool of value {value} (must be 0 or 1)")
            return bool(value)
        return value

    def array(self, what: str, depth: int) -> GgufArray:
        if depth > MAX_NESTING:
            raise self.fail(f"{what}: arrays nested deeper than {MAX_NESTING} levels")
        kind = self.value_type(f"the element type of {what}")
        length = self.u64(f"the length of {what}")
        if length > (self.size - self.pos) // _MIN_BYTES[kind]:
            raise self.fail(f"{what} at byte {self.pos - 12} claims {length} elements of {kind.name}, "
                            f"more than the rest of the file ({self.size - self.pos} bytes) can hold")
        start = self.pos
        head = self.elements(kind, min(length, ARRAY_HEAD), depth)
        rest = length - len(head)
        if kind in _SCALARS:
            nbytes = rest * _SCALARS[kind][1]
            if kind == ValueType.BOOL and rest:
                stored = self.buffer[self.pos:self.pos + nbytes]
                if stored.count(0) + stored.count(1) != nbytes:
                    raise self.fail(f"{what}: a bool element is neither 0 nor 1")
            self.pos += nbytes  # within the file: checked against the length above
        elif kind == ValueType.STRING:
            self.skip_strings(rest, what)
        else:
            for _ in range(rest):
                self.array(what, depth + 1)
        return GgufArray(kind, length, start, self.pos - start, tuple(head))

    def elements(self, kind: ValueType, count: int, depth: int) -> list[Any]:
        if kind in _SCALARS and kind != ValueType.BOOL:
            code, nbytes = _SCALARS[kind]
            self.need(count * nbytes, f"an array of {kind.name}")
            values = list(struct.unpack_from(f"{self.order}{count}{code}", self.buffer, self.pos))
            self.pos += count * nbytes
            return values
        return [self.value(kind, f"element {i} of an array", depth) for i in range(count)]

    def skip_strings(self, count: int, what: str) -> None:
        """Walk ``count`` strings; the hot loop of a tokenizer vocabulary (one unpack each)."""
        unpack = struct.Struct(self.order + "Q").unpack_from
        buffer, pos, end = self.buffer, self.pos, self.size
        try:
            for _ in range(count):
                (length,) = unpack(buffer, pos)
                pos += 8 + length
                if pos > end:
                    break
        except struct.error:  # a length field itself past the end
            pos = end + 1
        if pos > end:
            raise self.fail(f"{what}: its strings run past the end of the file ({end} bytes)")
        self.pos = pos

    def header(self) -> GgufHeader:
        self.pos = 4
        version = self.u32("the version")
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in VERSIONS:
                self.order = ">"
                version = swapped
            elif 1 in (version, swapped):
                raise self.fail("GGUF version 1 is not supported (obsolete since 2023; "
                                "convert the file with a current llama.cpp)")
            else:
                raise self.fail(f"unsupported GGUF version {version} (tclip reads versions 2 and 3)")
        tensor_count = self.u64("the tensor count")
        kv_count = self.u64("the metadata count")
        if kv_count > (self.size - self.pos) // 13:  # a key length, a type and one byte at least
            raise self.fail(f"the header claims {kv_count} metadata entries, "
                            f"more than the file ({self.size} bytes) can hold")
        metadata: dict[str, Any] = {}
        types: dict[str, ValueType] = {}
        for index in range(kv_count):
            key = self.name(f"metadata key {index}")
            kind = self.value_type(f"the value type of {key!r}")
            value = self.value(kind, f"the value of {key!r}")
            if key in metadata:
                raise self.fail(f"metadata key {key!r} appears twice")
            metadata[key] = value
            types[key] = kind
        alignment = self.alignment(metadata, types)
        if tensor_count > (self.size - self.pos) // 24:  # name length, dims count, type, offset
            raise self.fail(f"the header claims {tensor_count} tensors, "
                            f"more than the file ({self.size} bytes) can hold")
        infos = [self.tensor_info(index) for index in range(tensor_count)]
        info_end = self.pos
        data_offset = _align(info_end, alignment)
        tensors = tuple(self.place(info, data_offset, alignment) for info in infos)
        by_name: dict[str, GgufTensor] = {}
        for tensor in tensors:
            if tensor.name in by_name:
                raise self.fail(f"tensor name {tensor.name!r} appears twice")
            by_name[tensor.name] = tensor
        self.check_overlaps(tensors)
        return GgufHeader(self.path, version, self.order, self.size, MappingProxyType(metadata),
                          MappingProxyType(types), tensors, alignment, info_end, data_offset,
                          MappingProxyType(by_name), self._truncation())

    def _truncation(self) -> str | None:
        """What a file cut short lacks: the first tensor whose data is not all there, and how many more."""
        if not self.past_end:
            return None
        more = len(self.past_end) - 1
        return self.past_end[0] + (f" (and {more} more tensor{'s' if more > 1 else ''})" if more else "")

    def alignment(self, metadata: dict[str, Any], types: dict[str, ValueType]) -> int:
        if "general.alignment" not in metadata:
            return DEFAULT_ALIGNMENT
        if types["general.alignment"] != ValueType.UINT32:  # as ggml requires
            raise self.fail(f"general.alignment must be a UINT32, got {types['general.alignment'].name}")
        alignment = metadata["general.alignment"]
        if alignment == 0 or alignment & (alignment - 1):
            raise self.fail(f"general.alignment {alignment} is not a power of two")
        return alignment

    def tensor_info(self, index: int) -> tuple[str, tuple[int, ...], int, int]:
        name = self.name(f"the name of tensor {index}")
        n_dims = self.u32(f"the dimension count of {name!r}")
        if n_dims > MAX_DIMS:
            raise self.fail(f"tensor {name!r} claims {n_dims} dimensions "
                            f"(ggml allows 4, tclip reads up to {MAX_DIMS})")
        self.need(8 * n_dims, f"the dimensions of {name!r}")
        dims = struct.unpack_from(f"{self.order}{n_dims}Q", self.buffer, self.pos)
        self.pos += 8 * n_dims
        if any(d >= 1 << 63 for d in dims):  # ggml reads them as int64
            raise self.fail(f"tensor {name!r} has a negative dimension ({list(dims)})")
        if math.prod(dims) >= 1 << 63:
            raise self.fail(f"tensor {name!r} claims {math.prod(dims)} values ({list(dims)}), "
                            f"more than 2**63 - 1")
        ggml_type = self.u32(f"the type of {name!r}")
        offset = self.u64(f"the data offset of {name!r}")
        return name, tuple(dims), ggml_type, offset

    def place(self, info: tuple[str, tuple[int, ...], int, int], data_offset: int, alignment: int) -> GgufTensor:
        name, dims, ggml_type, offset = info
        shape = tuple(reversed(dims))
        kind = GGML_TYPES.get(ggml_type)
        nbytes = None
        if kind is not None:
            count = math.prod(dims)
            row = dims[0] if dims else 1  # a 0-d tensor (a scalar) is one row of one value
            if count and row % kind.block_elements:
                raise self.fail(f"tensor {name!r}: rows of {row} values are not a whole number of "
                                f"{kind.name} blocks ({kind.block_elements} values each)")
            nbytes = count // kind.block_elements * kind.block_bytes
        if offset % alignment:
            raise self.fail(f"tensor {name!r}: its data offset {offset} is not a multiple of the "
                            f"alignment {alignment}")
        start = data_offset + offset
        end = start + (nbytes or 0)
        if end > self.size:
            extent = f"bytes {start}..{end}" if nbytes is not None else f"byte {start}"
            message = (f"tensor {name!r}: its data ({extent}) runs past the end of the file "
                       f"({self.size} bytes); the file is truncated or the header is wrong")
            if not self.data_may_be_missing:
                raise self.fail(message)
            self.past_end.append(message)
        return GgufTensor(name, shape, dims, ggml_type, type_name(ggml_type), start, nbytes)

    def check_overlaps(self, tensors: tuple[GgufTensor, ...]) -> None:
        """No two tensors share a byte; a tensor of unknown size may not start inside another."""
        spans = sorted((t.offset, t.offset + (t.nbytes or 0), t.known, t.name) for t in tensors
                       if not t.known or t.nbytes)
        reach_end, reach_name = -1, ""
        for start, end, known, name in spans:
            if start < reach_end:
                raise self.fail(f"tensors {reach_name!r} and {name!r} overlap: their data share "
                                f"bytes from {start} on")
            if known and end > reach_end:
                reach_end, reach_name = end, name
