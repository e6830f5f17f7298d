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

Three modules: :mod:`.machine` runs the opcodes that build plain values, this one adds the
globals, torch's storages and the calls (REDUCE, BUILD), and :mod:`.pickled` holds the records
both build and the walk over the result.
"""

from __future__ import annotations

import io
import math
import pickletools
from typing import Any

import numpy as np

from ...errors import NoTensorsError, UnsupportedError
from .machine import ACCEPTED_OPCODES, _ascii, _is_int, _Machine, _text
from .pickled import (
    _GLOBALS,
    _OPAQUE_TORCH_DTYPES,
    _STORAGE_DTYPES,
    ACCEPTED_GLOBALS,
    TORCH_DTYPES,
    Leaf,
    OrderedDictValue,
    PickleLimits,
    PickleResult,
    StorageRef,
    TensorRef,
    TorchValue,
    _dtype_text,
    _Global,
    _kind,
    _numpy_dtype,
    flatten,
    kind_of,
)

# The interpreter's records and walk live in :mod:`.pickled`, its machine in :mod:`.machine`;
# the names below are this module's API as they always were.
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


_MAX_DIMS = 64


class _Interpreter(_Machine):
    """One run over one pickle; see :func:`load_torch_pickle`."""

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


