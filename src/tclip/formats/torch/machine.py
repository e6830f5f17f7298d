"""The pickle machine the interpreter of :mod:`.unpickler` runs on: it reads opcodes from bytes (or
an mmap) and keeps the stack, the memo and the limits, building plain values only (scalars, strings,
lists, tuples, dicts, sets). Every length is checked against the bytes left; the memo, the stack and
the objects built are capped.
"""

from __future__ import annotations

import codecs
import functools
import struct
from typing import Any, Literal

from ...errors import FormatError, UnsupportedError
from ..limits import name_memory
from .pickled import ADVICE, PickleLimits, StorageRef, _Global, _HashedTuple, _kind


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


class _Stop(Exception):
    pass


class _Machine:
    """The pickle machine: bytes, stack, memo, limits and the opcodes that build plain values
    (scalars, strings, containers). What a global may be, torch's storages and the calls
    (REDUCE, BUILD) are :class:`~.unpickler._Interpreter`'s; the opcode table is built from
    the ``op_`` methods of the class at hand."""

    def __init__(self, data: Any, start: int, stop: int, persistent: str, byteorder: Literal["<", ">"],
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
        handlers = self.dispatch()
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
                handlers[data[pos]](self)
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

    # Opcodes a subclass handles beyond this class's (opcode -> method name), e.g. NEWOBJ.
    EXTRA_OPS: dict[int, str] = {}

    def dispatch(self) -> list[Any]:
        """Each opcode's handler, called with the interpreter: built once per class (a DCP folder's
        thousands of chunk pickles each took ~0.1 ms to build it anew)."""
        cls = type(self)
        table = cls.__dict__.get("_dispatch")
        if table is None:
            table = [cls.unknown_op] * 256
            for name, code in _OP.items():
                if name in _REFUSED_OPS:
                    table[code[0]] = functools.partial(_refuse, name)
                else:
                    table[code[0]] = getattr(cls, "op_" + name.lower())
            for extra, method in cls.EXTRA_OPS.items():
                table[extra] = getattr(cls, method)
            cls._dispatch = table  # type: ignore[attr-defined]
        return table

    def unknown_op(self) -> None:  # (also in the dispatch table, called with the interpreter)
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
                made = self.stack[-depth] if len(self.stack) >= depth else None
                what = f" of class {made.name}" if isinstance(made, _Global) else ""
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


_I32 = struct.Struct("<i")


_U16 = struct.Struct("<H")


_U32 = struct.Struct("<I")


_U64 = struct.Struct("<Q")


_F64 = struct.Struct(">d")


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


def _refuse(name: str, interpreter: Any) -> None:
    """A refused opcode's handler in the shared dispatch table."""
    interpreter.refuse_op(name)()
