"""PyTorch files (``torch.save``): read without torch and without running pickle; rewritten in place.

What a file holds is read by :mod:`.archive` (the zip directory, the pickle
through the allowlist interpreter of :mod:`.unpickler`, which calls nothing).
Each tensor is a view of a storage: a dtype, a shape, strides and an offset into
the storage's bytes, which sit uncompressed in the file. So:

- a C-contiguous view is one run of the file: :meth:`TorchReader.region`, read
  with ``pread`` from any thread, as safetensors tensors are;
- any other view (a transposed weight, a slice with gaps, a column, a broadcast
  view) is gathered from its storage piece by piece: each piece is one ``pread``
  of at most twice the elements it yields (or 1 MiB), cut up with NumPy strides,
  so a view over a huge storage never reads or holds more than its block's worth;
- the tensors' names are the saved object's keys joined with dots; what is not a
  tensor (``step``, ``lr``, a config) is listed as such and kept unchanged;
- tensors viewing one storage (tied weights, slices of one buffer) are known:
  :meth:`TorchReader.shared_storage` and :meth:`TorchReader.overlaps`.

Writing is a rewrite of the same file only (:class:`TorchWriter`): the output starts
as a byte copy of the source without the bytes that will be rewritten, and the
rewritten tensors' elements are written where their views put them, so the pickle,
the zip structure, the member order and the 64-byte alignment stay byte for byte.
The CRC-32 of every rewritten member is set anew (in its local header where it is
there, its data descriptor and the central directory): ``torch.load`` does not check
them, but zip tools do. A file saved with CRC-32s off (``set_crc32_options(False)``:
every member's CRC is 0) is read without checking them and rewritten with them left 0.
A storage viewed by several tensors is written once per element: identical views (tied
weights) by the first of them; whether several views may be clipped at all is decided
before any writing (:mod:`tclip.work.tied`).
Writing a PyTorch file from another format is refused: there is no pickle to keep.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ...core.units import Index, flat_rectangles
from ...errors import FormatError, UnsupportedError
from .._blocks import normalize_index
from .._io import pread_into
from ..base import OtherObject, SharedElements, TensorInfo, TensorReader, read_region

if TYPE_CHECKING:  # imported where used: the pickle machine and zipfile cost 10 ms of every command's start-up
    from .archive import NonTensor, StorageInfo, TorchArchive
    from .pickled import TensorRef

NAME = "pytorch"
SUFFIXES = (".pt", ".pth", ".bin")
HOLDS_METADATA = False
SNIFF_BEFORE = ("npz",)  # a torch.save file is a zip, which .npz's sniff claims
#: ``.bin`` names many other things: a file so named is this format's when its
#: content says so (directories and globs pick up only those).
CONTENT_SUFFIXES = (".bin",)

# The records a torch.save (or torch.jit.save) zip may begin with, after its folder.
_FIRST_RECORDS = frozenset({"data.pkl", "version", "byteorder", ".format_version", ".storage_alignment",
                            "constants.pkl"})
_FIRST_FOLDERS = ("data/", "code/", ".data/", "extra/")
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")



def sniff(head: bytes, size: int) -> bool:
    """A zip whose first member is a record of ``torch.save`` (``<folder>/data.pkl``...),
    or the pickled magic number that starts the legacy format."""
    if head.startswith(b"PK\x03\x04"):
        if len(head) < _LOCAL_HEADER.size:
            return False
        name_length = _LOCAL_HEADER.unpack(head[:_LOCAL_HEADER.size])[-2]
        raw = head[_LOCAL_HEADER.size:_LOCAL_HEADER.size + name_length]
        if len(raw) != name_length:
            return False
        name = raw.decode("utf-8", "replace")
        folder, _, rest = name.partition("/")
        return bool(folder) and (rest in _FIRST_RECORDS or rest.startswith(_FIRST_FOLDERS))
    # every legacy file starts with pickle's PROTO; the interpreter then reads the magic number
    if not head.startswith(b"\x80"):
        return False
    from .archive import sniff_torch

    return sniff_torch(head) == "legacy"


# A gathered piece is one pread of at most twice the elements it yields, or of at most
# this many bytes: below it, reading a gap costs less than another system call.
_SMALL_READ = 1 << 20
_CHUNK = 8 << 20  # bytes read at once when CRCs are computed from the output


class View(NamedTuple):
    """One tensor as the reader and writer locate it."""

    ref: TensorRef
    storage: StorageInfo
    dense: bool  # C-contiguous with no lazy negation/conjugation: one run of the file

    @property
    def first_byte(self) -> int:
        """File offset of the view's first element."""
        return self.storage.offset + self.ref.offset * self.ref.dtype.itemsize

    def byte_span(self) -> tuple[int, int]:
        """``[start, stop)`` file offsets of the bytes the view touches."""
        first, stop = self.ref.span()
        itemsize = self.ref.dtype.itemsize
        return self.storage.offset + first * itemsize, self.storage.offset + stop * itemsize

    @property
    def identity(self) -> tuple[Any, ...]:
        ref = self.ref
        return (ref.storage.key, ref.dtype, ref.offset, ref.shape, ref.stride, ref.neg, ref.conj)


class Overlap(NamedTuple):
    """Two tensors whose data share bytes of the file; ``same``: identical views (tied weights)."""

    first: str
    second: str
    same: bool


def _view_of(archive: TorchArchive, name: str) -> View:
    ref = archive.tensors[name]
    ndim = len(ref.shape)
    dense = ref.order() == tuple(range(ndim)) and not ref.neg and not ref.conj
    return View(ref, archive.storages[ref.storage.key], dense)


def _pieces(view: View, lo: tuple[int, ...], extent: tuple[int, ...]) -> Iterator[tuple[Index, int, int]]:
    """Cover the block ``lo + [0, extent)`` of a view with pieces, each readable by one pread.

    Yields ``(index within the block, first storage element, span in elements)``, in
    storage order for views with positive strides. A piece spans at most twice its
    elements, or at most :data:`_SMALL_READ` bytes (reading a gap is cheaper than a
    system call). A block too sparse for one piece is cut along its axis of the
    largest stride into runs of as many indices as fit, and so on inwards: a
    transposed view becomes groups of its storage's rows, a column small reads.
    """
    ref = view.ref
    stride = ref.stride
    small = max(1, _SMALL_READ // ref.dtype.itemsize)

    def cover(start: tuple[int, ...], sizes: tuple[int, ...]) -> Iterator[tuple[Index, int, int]]:
        count = math.prod(sizes)
        if count == 0:
            return
        span = sum((n - 1) * s for n, s in zip(sizes, stride)) + 1
        if span <= 2 * count or span <= small:
            first = ref.offset + sum((a + b) * s for a, b, s in zip(lo, start, stride))
            yield tuple(slice(a, a + n) for a, n in zip(start, sizes)), first, span
            return
        axis = max((i for i, n in enumerate(sizes) if n > 1), key=lambda i: (stride[i], -i))
        step, inner = stride[axis], span - (sizes[axis] - 1) * stride[axis]
        inner_count = count // sizes[axis]
        # The most indices k along the axis whose piece fits: (k-1)*step + inner elements
        # within the small read, or within 2*k*inner_count (possible for some k only when
        # the axis is sparser than that: step > 2*inner_count). A piece of one index is
        # cut further along its other axes.
        fits = (small - inner) // step + 1 if inner <= small else 0
        if step > 2 * inner_count and step >= inner:
            fits = max(fits, (step - inner) // (step - 2 * inner_count))
        k = max(1, min(fits, sizes[axis] // 2))  # the whole block did not fit: cut it
        for first_index in range(0, sizes[axis], k):
            piece_start, piece_sizes = list(start), list(sizes)
            piece_start[axis] += first_index
            piece_sizes[axis] = min(k, sizes[axis] - first_index)
            yield from cover(tuple(piece_start), tuple(piece_sizes))

    return cover(tuple(0 for _ in extent), extent)


def _strided(buffer: np.ndarray, ref: TensorRef, sizes: tuple[int, ...], writeable: bool = False) -> np.ndarray:
    itemsize = ref.dtype.itemsize
    # as_strided goes through __array_interface__, whose type text NumPy cannot parse back for
    # some ml_dtypes types ('<f1' of float8_e5m2): stride raw items, then view them as the dtype
    raw = buffer.view(np.dtype((np.void, itemsize)))
    strided = np.lib.stride_tricks.as_strided(raw, sizes, [s * itemsize for s in ref.stride], writeable=writeable)
    return strided.view(ref.dtype)


def _optimizer_prefixes(others: Any) -> set[str]:
    """Where a saved ``optimizer.state_dict()`` sits: the prefixes P (``"optimizer."``, or ``""``
    for one saved alone) of the leaves ``P param_groups.N.lr``. Its tensors are ``P state.*``
    (Adam's moments, step counts): a training optimizer's state, clipped only when asked for,
    as for a Keras file's."""
    prefixes = set()
    for leaf in others:
        head, found, tail = leaf.name.rpartition("param_groups.")
        if found and (not head or head.endswith(".")) and tail.split(".", 1)[-1] == "lr":
            prefixes.add(head)
    return prefixes


class TorchReader(TensorReader):
    """A ``torch.save`` file (zip or legacy format): tensors as views of located storages."""

    format_name = NAME

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            before = os.fstat(self._fd)
            from .archive import load_torch_archive
            from .pickled import NOT_FLOATING_TORCH_DTYPES

            self.archive = load_torch_archive(path)
            after = os.stat(path)
            if (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns) != \
                    (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns):
                raise FormatError("the file changed while it was being read", path)
            self.views = {name: _view_of(self.archive, name) for name in self.archive.tensors}
            for name, view in self.views.items():
                ref = view.ref
                # (no attrs: strides, offsets and storage keys are layout, which diff must not
                # report as differences between two saves of the same tensors)
                if ref.unreadable is None:
                    self.tensors[name] = TensorInfo(name, ref.shape, ref.dtype)
                else:  # carried as bytes, never measured
                    self.tensors[name] = TensorInfo(name, ref.shape, ref.dtype, numeric=False,
                                                    dtype_label=f"torch.{ref.unreadable} (not supported)",
                                                    unreadable_type=True,
                                                    not_floating=ref.unreadable in NOT_FLOATING_TORCH_DTYPES)
            self.others = [_other(leaf) for leaf in self.archive.others]
            self._values = {leaf.name: leaf.value for leaf in self.archive.others}
            for prefix in _optimizer_prefixes(self.archive.others):
                for name, info in self.tensors.items():
                    if name.startswith(f"{prefix}state."):
                        info.optimizer_state = True
        except BaseException:
            os.close(self._fd)
            raise

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    # ----------------------------------------------------------------------- storages

    def shared_storage(self) -> list[tuple[str, ...]]:
        """The names viewing each storage that more than one tensor views, in file order."""
        return list(self.archive.shared.values())

    def overlaps(self) -> list[Overlap]:
        """Pairs of tensors whose data share bytes of the file.

        Identical views (tied weights) pair each with the first of them; other views
        of one storage pair when their elements meet (views of one buffer with gaps
        between their elements, as ``t[::2]`` and ``t[1::2]``, do not).

        Raises:
            UnsupportedError: so many views of one storage overlap that checking them
                all is unreasonable (no file saved from a model has more than a few).
        """
        pairs: list[Overlap] = []
        budget = [_MAX_OVERLAP_CHECKS]
        for names in self.archive.shared.values():
            first_of: dict[tuple[Any, ...], str] = {}
            distinct: list[str] = []
            for name in names:
                view = self.views[name]
                if view.ref.size == 0:
                    continue
                # A negated view of the same elements is tied too: it shares every stored element
                # at the same index, so factors per slice agree (the clip by value's sign is checked
                # by work/tied.py).
                key = view.identity[:5] + view.identity[6:]
                if key in first_of:
                    pairs.append(Overlap(first_of[key], name, True))
                else:
                    first_of[key] = name
                    distinct.append(name)
            pairs += self._meeting(distinct, budget)
        return pairs

    def _meeting(self, names: list[str], budget: list[int]) -> list[Overlap]:
        spans = sorted((self.views[n].byte_span(), i, n) for i, n in enumerate(names))
        found: list[Overlap] = []
        active: list[tuple[int, int, str]] = []  # (stop, order, name) of spans still open
        for (start, stop), order, name in spans:
            active = [a for a in active if a[0] > start]
            for _, other_order, other in active:
                budget[0] -= 1
                if budget[0] < 0:
                    raise UnsupportedError(f"more than {_MAX_OVERLAP_CHECKS} pairs of views of one storage "
                                           "overlap; tclip refuses such a file", self.path)
                if _elements_meet(self.views[other], self.views[name]):
                    pair = (other, name) if other_order < order else (name, other)
                    found.append(Overlap(pair[0], pair[1], False))
            active.append((stop, order, name))
        return found

    def shared_elements(self, names: list[str]) -> SharedElements:
        """How the tensors ``names`` (in file order) share stored elements (see :class:`SharedElements`).

        Views with the same set of storage elements (identical views, a transpose, a negated
        view) are tied to the first of them; views within a dense range of another (a row,
        a column, a block of a weight) are part of it; the views left that still meet, and
        views repeating their own elements, form groups read through a map of their storage
        span (:meth:`read_owned`). Views of one storage in two dtypes (float8 on an untyped
        storage) cannot be compared element by element: each is counted whole.

        Raises:
            UnsupportedError: a group's span is too long for the map.
        """
        result = SharedElements()
        by_storage: dict[str, list[str]] = {}
        for name in names:
            ref = self.views[name].ref
            if ref.size == 0:
                continue
            if ref.neg:
                result.negated.add(name)
            by_storage.setdefault(ref.storage.key, []).append(name)
        for members in by_storage.values():
            self._relate(members, result)
        return result

    def _relate(self, members: list[str], result: SharedElements) -> None:
        forms = {n: _element_set(self.views[n].ref) for n in members}
        repeating = {n for n in members if self._repeats(n, forms[n])}
        result.repeating.update({n: (self.views[n].ref.shape, self.views[n].ref.stride) for n in repeating})
        if len({self.views[n].ref.dtype.itemsize for n in members}) > 1:
            return
        first_of: dict[tuple[Any, ...], str] = {}
        distinct = []
        for name in members:
            key = forms[name][:2]
            if key in first_of:
                result.tied[name] = first_of[key]
            else:
                first_of[key] = name
                distinct.append(name)
        spans = {n: self.views[n].ref.span() for n in distinct}
        position = {n: i for i, n in enumerate(distinct)}
        ranges = sorted((n for n in distinct if _is_range(forms[n])),
                        key=lambda n: (spans[n][0] - spans[n][1], position[n]))
        for whole in ranges:
            if whole in result.part_of:
                continue
            lo, hi = spans[whole]
            for name in distinct:
                if name != whole and name not in result.part_of and lo <= spans[name][0] and spans[name][1] <= hi:
                    result.part_of[name] = whole
        rest = [n for n in distinct if n not in result.part_of]
        for group in self._meeting_groups(rest):
            if len(group) > 1 or group[0] in repeating:
                owner = self._owner_map(group)
                counts = np.bincount(owner[owner >= 0], minlength=len(group))
                result.owned.update({n: int(c) for n, c in zip(group, counts)})
                result.groups.append(tuple(group))

    def _repeats(self, name: str, form: tuple[int, tuple[tuple[int, int], ...], bool]) -> bool:
        """Whether a view holds some storage element at two indices (exactly, through a map of its span)."""
        ref = self.views[name].ref
        if form[2]:
            return False
        first, stop = ref.span()
        if ref.size > stop - first:
            return True
        if stop - first > _MAX_ELEMENT_MAP:
            raise UnsupportedError(f"tensor {name!r} is a view whose elements may repeat over a span of "
                                   f"{stop - first:,} storage elements, more than tclip maps "
                                   f"({_MAX_ELEMENT_MAP:,}); tclip refuses such a file", self.path)
        seen = np.zeros(stop - first, bool)
        np.lib.stride_tricks.as_strided(seen, ref.shape, ref.stride, writeable=True)[...] = True
        return int(np.count_nonzero(seen)) < ref.size

    def _meeting_groups(self, names: list[str]) -> list[list[str]]:
        """``names`` in groups of views that meet, directly or through others (file order kept);
        past :data:`_MAX_OVERLAP_CHECKS` checks, the views left join one group (the map is exact)."""
        parent = {n: n for n in names}

        def root(n: str) -> str:
            while parent[n] != n:
                parent[n] = parent[parent[n]]
                n = parent[n]
            return n

        order = {n: i for i, n in enumerate(names)}
        spans = sorted((self.views[n].ref.span(), order[n], n) for n in names)
        active: list[tuple[int, str]] = []
        checks = _MAX_OVERLAP_CHECKS
        for (start, stop), _, name in spans:
            active = [a for a in active if a[0] > start]
            for _, other in active:
                checks -= 1
                if checks < 0 or _elements_meet(self.views[other], self.views[name]):
                    parent[root(name)] = root(other)
            active.append((stop, name))
        groups: dict[str, list[str]] = {}
        for name in names:
            groups.setdefault(root(name), []).append(name)
        return list(groups.values())

    def _owner_map(self, names: tuple[str, ...] | list[str]) -> np.ndarray:
        """For each storage element of the group's span, the index of the first view holding it (-1: none)."""
        refs = [self.views[n].ref for n in names]
        lo = min(r.span()[0] for r in refs)
        hi = max(r.span()[1] for r in refs)
        if hi - lo > _MAX_ELEMENT_MAP or len(refs) > 32767:
            raise UnsupportedError(f"tensors {names[0]!r} and {names[1 % len(names)]!r} view a storage in ways "
                                   f"that overlap partly over {hi - lo:,} elements; counting each stored element "
                                   f"once maps them, and tclip maps at most {_MAX_ELEMENT_MAP:,}", self.path)
        owner = np.full(hi - lo, -1, np.int16)
        for i in reversed(range(len(refs))):  # the first view holding an element writes last
            ref = refs[i]
            np.lib.stride_tricks.as_strided(owner[ref.offset - lo:], ref.shape, [s * 2 for s in ref.stride],
                                            writeable=True)[...] = i
        return owner

    def read_owned(self, names: tuple[str, ...]) -> Iterator[tuple[str, np.ndarray]]:
        owner = self._owner_map(names)
        ref = self.views[names[0]].ref
        storage = self.views[names[0]].storage
        lo = min(self.views[n].ref.span()[0] for n in names)
        itemsize = ref.dtype.itemsize
        step = max(1, _CHUNK // itemsize)
        for start in range(0, owner.size, step):
            part = owner[start:start + step]
            raw = np.empty(part.size * itemsize, np.uint8)
            pread_into(self._fd, raw.data, storage.offset + (lo + start) * itemsize, self.path, names[0])
            values = raw.view(ref.dtype)
            for i, name in enumerate(names):
                mine = values[part == i]
                if mine.size:
                    yield name, mine

    # ----------------------------------------------------------------------- reading

    def region(self, name: str) -> tuple[int, int] | None:
        view = self.views[name]
        return (self._fd, view.first_byte) if view.dense else None

    def parallel_safe(self, name: str) -> bool:
        return True  # every read is a pread

    def read(self, name: str, index: Index | None = None, scratch: bytearray | None = None) -> np.ndarray:
        view = self.views[name]
        if view.dense:
            return read_region(self, name, index)
        index = normalize_index(index, view.ref.shape)
        sizes = tuple(s.stop - s.start for s in index)
        out = np.empty(sizes, view.ref.dtype)
        self._gather(name, view, tuple(s.start for s in index), out)
        return out

    def read_flat(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        view = self.views[name]
        if view.dense:
            return super().read_flat(name, start, stop, out)
        count = stop - start
        nbytes = count * view.ref.dtype.itemsize
        result = out[:nbytes].view(view.ref.dtype) if out is not None and out.size >= nbytes \
            else np.empty(count, view.ref.dtype)
        position = 0
        for rect in flat_rectangles(view.ref.shape, start, stop):
            sizes = tuple(s.stop - s.start for s in rect)
            n = math.prod(sizes)
            self._gather(name, view, tuple(s.start for s in rect), result[position:position + n].reshape(sizes))
            position += n
        return result

    def _gather(self, name: str, view: View, lo: tuple[int, ...], out: np.ndarray) -> None:
        """Fill ``out`` (the block at ``lo`` of its shape) from the storage, piece by piece."""
        ref = view.ref
        itemsize = ref.dtype.itemsize
        for index, first, span in _pieces(view, lo, out.shape):
            raw = np.empty(span * itemsize, np.uint8)
            pread_into(self._fd, raw.data, view.storage.offset + first * itemsize, self.path, name)
            out[index] = _strided(raw.view(ref.dtype), ref, out[index].shape)
        if ref.conj:
            np.conjugate(out, out=out)
        if ref.neg:
            np.negative(out, out=out)

    def stored_bytes(self, name: str, chunk: int = 1 << 20) -> Iterator[bytes] | None:
        return super().stored_bytes(name, chunk) if self.views[name].dense else None

    def other_values(self, name: str, limit: int) -> np.ndarray | None:
        """A saved number or string (``step``, ``lr``), for comparing two checkpoints."""
        return _plain_value(self._values[name], limit) if name in self._values else None

    def plain_data(self, name: str) -> Any:
        """A saved number, string, or tuple/list of them (an optimizer's ``betas``, its
        ``params`` indices or names), as the pickle interpreter built it (it calls nothing)."""
        return _plain_data(self._values[name]) if name in self._values else None


_MAX_OVERLAP_CHECKS = 100_000  # about a second of exact checks


def _elements_meet(a: View, b: View) -> bool:
    """Whether two views of one storage whose byte spans intersect share an element's bytes.

    Dense views cover their spans. Otherwise NumPy's exact test of two strided
    arrays decides, on arrays that only describe the views (its answer is
    arithmetic on their addresses and strides; nothing is read); a question too
    hard for its work limit counts as meeting.
    """
    if a.ref.order() is not None and b.ref.order() is not None:
        return True
    try:
        # numpy's stubs allow only the special values -1 and 0; NumPy takes any positive bound
        return bool(np.shares_memory(_describe(a), _describe(b), max_work=100_000))  # type: ignore[arg-type]
    except _TOO_HARD:
        return True


_TOO_HARD = getattr(getattr(np, "exceptions", np), "TooHardError")
_MAX_ELEMENT_MAP = 1 << 26  # storage elements mapped at most (64 MiB) to count views that overlap partly


def _element_set(ref: TensorRef) -> tuple[int, tuple[tuple[int, int], ...], bool]:
    """A view's set of storage elements as ``(offset, dims, nested)``: the elements
    ``offset + sum(i_k * stride_k)`` over ``dims`` of ``(stride, size)``, sizes above one and
    strides above zero, by stride, runs merged (``(1, 4), (4, 3)`` is ``(1, 12)``). Two views
    with one offset and dims hold the same elements. ``nested``: each stride passes every
    element of the dims inside it, so no element repeats (a stride 0 repeats)."""
    dims = sorted((s, n) for n, s in zip(ref.shape, ref.stride) if n > 1)
    nested = not any(s == 0 for s, _ in dims)
    merged: list[tuple[int, int]] = []
    for stride, size in dims:
        if stride == 0:
            continue
        if merged and merged[-1][0] * merged[-1][1] == stride:
            merged[-1] = (merged[-1][0], merged[-1][1] * size)
        else:
            merged.append((stride, size))
    extent = 1
    for stride, size in merged:
        nested = nested and stride >= extent
        extent += (size - 1) * stride
    return ref.offset, tuple(merged), nested


def _is_range(form: tuple[int, tuple[tuple[int, int], ...], bool]) -> bool:
    """Whether an element set is every element of its span."""
    dims = form[1]
    return form[2] and (not dims or (len(dims) == 1 and dims[0][0] == 1))


class _Described:
    """An object whose ``__array_interface__`` describes a view's bytes at a made-up
    address (its storage's file offset): NumPy never touches that memory here."""

    def __init__(self, view: View) -> None:
        ref = view.ref
        itemsize = ref.dtype.itemsize
        self.__array_interface__ = {
            "shape": (*ref.shape, itemsize), "typestr": "|u1", "version": 3,
            "strides": (*(s * itemsize for s in ref.stride), 1),
            "data": ((1 << 40) + view.first_byte, True),
        }


def _describe(view: View) -> np.ndarray:
    return np.asarray(_Described(view))


def _other(leaf: NonTensor) -> OtherObject:
    text = _value_text(leaf.value)
    return OtherObject(leaf.name, leaf.kind, f"value {text}" if text else "not a tensor; kept as it is")


def _value_text(value: Any) -> str:
    from .pickled import TorchValue

    if isinstance(value, TorchValue):
        return f"torch.{value.text}" if value.kind == "dtype" else value.text
    if value is None or isinstance(value, bool | int | float | complex):
        text = repr(value)
    elif isinstance(value, str):
        text = repr(value)
    else:
        return ""
    return text if len(text) <= 60 else text[:57] + "..."


def _plain_data(value: Any, depth: int = 0) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple) and depth < 4:
        items = [_plain_data(v, depth + 1) for v in value]
        if all(i is not None or v is None for i, v in zip(items, value)):
            return tuple(items) if isinstance(value, tuple) else items
    return None


def _plain_value(value: Any, limit: int) -> np.ndarray | None:
    if isinstance(value, bool) or isinstance(value, float):
        return np.asarray(value)
    if isinstance(value, int):
        return np.asarray(value) if -(1 << 63) <= value < (1 << 63) else None
    if isinstance(value, str) and len(value) * 4 <= limit:
        return np.asarray(value)
    return None


# --------------------------------------------------------------------------- writing


Reader = TorchReader
