"""The one reader/writer protocol every format implements.

A :class:`TensorReader` opens a file lazily: names, shapes, dtypes and metadata
come from the header alone. Data is read either as rectangular blocks (a tuple
of slices, the same ``index`` that :mod:`tclip.core.stats` takes) or as flat runs
of elements in storage order (:meth:`TensorReader.read_flat`), which is what the
passes over files use: their blocks are runs of whole units (:mod:`tclip.core.units`).

A :class:`TensorWriter` is created "like" a reader (same tensors, layout and
metadata). It takes flat runs (:meth:`TensorWriter.write_flat`) or the
rectangular blocks it asks for (:meth:`TensorWriter.blocks`), and only appears
at its target path when :meth:`TensorWriter.commit` has flushed, fsynced and
renamed it (:class:`~tclip.formats.atomic.AtomicOutput`). Writers whose data sits
at known offsets (``.npy``, safetensors, stored ``.npz`` members rewritten in
place, contiguous HDF5 datasets) write with ``pwrite`` and accept runs in any
order from any thread (:meth:`TensorWriter.parallel_safe`); the others take them
in order.
"""

from __future__ import annotations

import math
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..core.units import Index, flat_rectangles
from ..errors import FormatError, TclipError
from ._blocks import contiguous_span, layout_blocks, normalize_index
from ._io import (
    DEFAULT_BLOCK_BYTES,
    as_bytes,
    copy_range,
    flat_result,
    pread_into,
    pwrite_all,
)
from .atomic import AtomicOutput


@dataclass(frozen=True)
class EncodingSummary:
    """What the passes, the plan and the reports need to know of an encoding, without its data
    (plain and picklable: it crosses process boundaries with a file's statistics).

    Attributes:
        scheme: short, for tables (``e4m3 xf32 128x128``, ``nvfp4 xe4m3 1x16 xf32``, ``Q8_0``).
        convention: who stores weights this way, for people (``fp8 block (DeepSeek)``).
        parts: every stored tensor it is made of, as (name, role, dtype, shape), codes (or
            blocks) first; roles: ``codes``, ``scales``, ``global scale``, ``blocks``, ``part``.
        rescaled: the parts a rescale rewrites (never codes that are not also scales).
        factors: which factors a rescale applies: ``"any"`` (each scale rounded once in its
            dtype), ``"power of two"`` (exactly, E8M0 exponents), ``"none"``.
        per_row: a rescale can take one factor per row (per slice along the last axis):
            every scale it rewrites belongs to one row.
        problem: recognised as encoded but not understood (why): never measured, never
            rescaled; None when understood.
    """

    scheme: str
    convention: str
    parts: tuple[tuple[str, str, str, tuple[int, ...]], ...]
    rescaled: tuple[str, ...] = ()
    factors: str = "any"
    per_row: bool = False
    problem: str | None = None


class Encoding(Protocol):
    """How a *logical* tensor's values come from what the file stores, as far as a listing knows it.

    A weight may be stored as several stored tensors (FP8/NVFP4 codes plus scale tensors,
    possibly in other shards of a set) or as one stored tensor of quantized blocks (GGUF's
    Q8_0 ... Q6_K). A reader describes such a weight by one :class:`TensorInfo` of its logical
    shape whose ``encoding`` is one of these; its ``dtype`` is the floating type in which a
    rescale rounds and ``nbytes`` is :attr:`nbytes` (the stored parts' bytes).

    Here an encoding only says what is stored (:attr:`summary`, :attr:`nbytes`): a format lists,
    it never computes. The values, statistics and rescales of quantized weights are
    :mod:`tclip.quant` (its contract: :class:`tclip.quant.contract.QuantEncoding`); the GGUF
    reader lists its blocks tagged with their ggml type (``GgmlStored``), which
    :mod:`tclip.quant` decodes.

    A reader whose stored tensors are blocks lists the encoded tensor under its stored name,
    with ``nbytes`` the blob's size; its ``read_part(name, start, stop)`` gives the blob's raw
    bytes ``[start, stop)``, and a :class:`PositionalWriter` takes them back as
    ``write_flat(name, start, uint8 data)``.
    """

    @property
    def summary(self) -> EncodingSummary:
        """What the encoding is (see :class:`EncodingSummary`)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """The bytes of every stored part."""
        return 0


@dataclass(slots=True)
class TensorInfo:
    """What a header says about one tensor (treat it as read-only; not frozen only
    because a frozen dataclass is three times slower to create, and a header can list
    a million tensors).

    Attributes:
        name: the tensor's name in its file (HDF5: path without the leading '/').
        shape, dtype: as stored (dtype with its byte order).
        fortran_order: the data is stored column-major (.npy only).
        numeric: False for data tclip never changes nor reads as numbers
            (void/opaque types); such tensors are copied as they are.
        refused: why tclip will not read this tensor's data at all (None: it
            will), e.g. HDF5 external storage or a virtual dataset, whose data
            lives in other files. Such a tensor is never read nor written.
        dtype_label: shown instead of the dtype for data that is not numbers.
        unreadable_type: the data is of a type tclip cannot read although it may
            hold numbers (a newer safetensors dtype such as F4): carried as bytes, never
            measured, so a check never passes over it.
        not_floating: of an unreadable type known to hold no floating-point values
            (torch.complex32): a clip, which changes floating tensors only, carries it; one of
            any other unreadable type may hold floats, and a clip selecting it is refused.
        optimizer_state: the tensor is a training optimizer's state saved beside the
            weights (a Keras file's Adam moments, iteration count, learning rate):
            left as it is unless an include pattern names it.
        encoding: how the values come from stored parts (:class:`Encoding`);
            None: the stored elements are the values.
        role: what a tensor that is neither weight nor gradient is for (an activation
            scale of a quantized checkpoint): it is left out of norms and clips.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool = False
    numeric: bool = True
    attrs: Mapping[str, Any] = field(default_factory=dict, compare=False)
    refused: str | None = field(default=None, compare=False)
    dtype_label: str | None = field(default=None, compare=False)
    encoding: Encoding | None = field(default=None, compare=False)
    unreadable_type: bool = field(default=False, compare=False)
    not_floating: bool = field(default=False, compare=False)
    optimizer_state: bool = field(default=False, compare=False)
    role: str | None = field(default=None, compare=False)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        if self.encoding is not None:
            return self.encoding.nbytes
        return self.size * self.dtype.itemsize

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """The shape in the order the elements are stored (reversed for Fortran order)."""
        return tuple(self.shape[::-1]) if self.fortran_order else tuple(self.shape)

    def blocks(self, max_bytes: int) -> Iterator[Index]:
        """Contiguous blocks of at most ``max_bytes`` in storage order, in file order."""
        return layout_blocks(self.shape, self.dtype.itemsize, self.fortran_order, max_bytes)


@dataclass(frozen=True)
class OtherObject:
    """Something in a file that is not a tensor tclip reads (an HDF5 string dataset,
    a dimension scale, ...): listed in reports, carried unchanged where the format allows."""

    name: str
    kind: str          # e.g. "string dataset", "dimension scale"
    reason: str        # why it is not a tensor, for people
    shape: tuple[int, ...] | None = None
    dtype: str = ""
    numeric: bool = False  # plain numbers another format could hold (a dimension scale)
    unreadable_type: bool = False  # a type tclip cannot read, which may hold numbers (quad floats): never measured


def checked_size(shape: tuple[int, ...], itemsize: int, path: object, name: str) -> int:
    """Byte size of a tensor, refusing negative or absurd dimensions before allocating."""
    for n in shape:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise FormatError(f"tensor {name!r}: invalid shape {list(shape)}", path)
    if len(shape) > 64:
        raise FormatError(f"tensor {name!r}: {len(shape)} dimensions (at most 64 are supported)", path)
    if 0 in shape:
        return 0
    if any(n > 1 << 62 for n in shape) or math.prod(shape) * max(itemsize, 1) > 1 << 62:
        raise FormatError(f"tensor {name!r}: shape {list(shape)} is impossibly large", path)
    return math.prod(shape) * itemsize


@dataclass
class SharedElements:
    """How some tensors of a file hold stored elements in common (a PyTorch file's views of one
    storage), so that a norm or a count over them takes each stored element once.

    Attributes:
        tied: tensor -> an earlier one holding exactly its stored elements (tied weights, a
            transpose, a negated view); the two have the same sums.
        part_of: tensor -> one holding all its stored elements and more (a row of a weight).
        groups: tensors whose stored elements overlap otherwise, or repeat within one tensor
            (a stride 0, an unfold): each stored element is counted for the first of them
            that holds it (:meth:`TensorReader.read_owned`).
        owned: for the tensors of ``groups``, how many stored elements each counts.
        repeating: tensors holding some stored element at more than one index, each with its
            ``(shape, strides)`` in elements (where the same element sits at two indices).
        negated: tensors whose values are their stored elements negated (torch's neg bit).
    """

    tied: dict[str, str] = field(default_factory=dict)
    part_of: dict[str, str] = field(default_factory=dict)
    groups: list[tuple[str, ...]] = field(default_factory=list)
    owned: dict[str, int] = field(default_factory=dict)
    repeating: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    negated: set[str] = field(default_factory=set)

    @classmethod
    def merged(cls, parts: list["SharedElements"]) -> "SharedElements":
        """Those of several files (a set's shards, whose tensor names differ) as one."""
        out = cls()
        for part in parts:
            out.tied.update(part.tied)
            out.part_of.update(part.part_of)
            out.groups += part.groups
            out.owned.update(part.owned)
            out.repeating.update(part.repeating)
            out.negated |= part.negated
        return out

    def counted_elsewhere(self, name: str) -> str | None:
        """The tensor whose count holds all of ``name``'s stored elements, if another one does."""
        return self.tied.get(name) or self.part_of.get(name)


class TensorReader(ABC):
    """A tensor file opened for reading. Use as a context manager."""

    format_name: str = ""
    # What makes the data the header lists unreadable (a GGUF file cut after its header), or None:
    # info lists the header with it as a warning; every command that reads data refuses the file with it.
    damage: str | None = None

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, Any] = {}
        self.others: list[OtherObject] = []  # what is not a tensor (HDF5 strings, scales...)
        self.group_attributes: dict[str, dict[str, Any]] = {}  # attributes of containers (HDF5 groups), by path

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the file."""

    def blocks(self, name: str, max_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[Index]:
        """The blocks this format reads best, covering the tensor once."""
        return self.tensors[name].blocks(max_bytes)

    @abstractmethod
    def read(self, name: str, index: Index | None = None, scratch: bytearray | None = None) -> np.ndarray:
        """Read one rectangular block (None: the whole tensor).

        With ``scratch``, a reader may read into that buffer and return a view of
        it, valid until the buffer is used again. Without it the result is a new array.
        """

    def region(self, name: str) -> tuple[int, int] | None:
        """(file descriptor, offset) of the tensor's raw bytes when they are one contiguous
        run of the file in storage order, else None. Reading a region is thread-safe."""
        return None

    def runs(self, name: str) -> list[tuple[int, int, int, int]] | None:
        """The tensor's raw bytes in storage order as several runs of files, where
        :meth:`region` finds no single one (a DCP tensor sharded by rows: one run per shard):
        ``(first byte in the tensor, byte count, file descriptor, offset)`` in order, together
        covering the tensor once; None where they are not (the default). Thread-safe reads."""
        return None

    def parallel_safe(self, name: str) -> bool:
        """Whether :meth:`read_flat` of this tensor may run on several threads at once."""
        return self.region(name) is not None

    def shared_storage(self) -> list[tuple[str, ...]]:
        """Groups of tensors stored in one buffer of the file (a PyTorch storage viewed by
        several tensors: tied weights, slices of one buffer), for people. None elsewhere."""
        return []

    def overlaps(self) -> Sequence[tuple[str, str, bool]]:
        """Pairs ``(first, second, same_view)`` of tensors whose data share bytes of the file
        (tied weights and views of one buffer in a PyTorch file): rewriting the file in its
        own format writes such bytes once. None where every tensor has bytes of its own."""
        return []

    def shared_elements(self, names: list[str]) -> SharedElements:
        """How the tensors ``names`` (in file order) share stored elements; nothing where
        every tensor has elements of its own (every format but PyTorch's)."""
        return SharedElements()

    def read_owned(self, names: tuple[str, ...]) -> Iterator[tuple[str, np.ndarray]]:
        """For a group of :attr:`SharedElements.groups`: pieces ``(tensor, values)`` of the stored
        elements each tensor is the first to hold, each stored element once, as stored (a
        negated view's elements with the storage's sign)."""
        return iter(())

    def lost_in_conversion(self) -> list[str]:
        """What this file holds that only its own format can carry (for people): what a
        conversion to another format would drop, beyond non-tensors, non-numeric data and
        file metadata (which every reader reports the same way)."""
        return []

    def lossy_filters(self) -> dict[str, str]:
        """Tensors stored through a lossy filter (HDF5's scale-offset on floats, ZFP, SZ...),
        with the filter: rewritten in this format they hold other values than those written
        to them, so their statistics after a rewrite are measured from the output."""
        return {}

    def other_values(self, name: str, limit: int) -> np.ndarray | None:
        """The values of a non-tensor object (an HDF5 string dataset, ...) for comparing,
        when the format can give them as data (never code) in at most ``limit`` bytes."""
        return None

    def other_stored_bytes(self, name: str, chunk: int = 1 << 20) -> Iterator[bytes] | None:
        """The stored bytes of a non-tensor object, never interpreted (an item a DCP folder saved
        as an object, which tclip never unpickles), for comparing two files; None where the format
        keeps no such bytes for it."""
        return None

    def plain_data(self, name: str) -> Any:
        """A non-tensor object as plain data (numbers, strings, booleans, None, and tuples
        or lists of them: an optimizer's ``param_groups.N.betas`` or ``.params``), or None
        where the format keeps no such object under that name. Never runs code."""
        return None

    def stored_bytes(self, name: str, chunk: int = 1 << 20) -> Iterator[bytes] | None:
        """The tensor's stored bytes in storage order, never interpreted (for data that
        is not numbers: strings, dates, opaque types), or None where the format keeps
        them in no single run of the file."""
        region = self.region(name)
        if region is None:
            return None
        fd, offset = region
        total = self.tensors[name].nbytes

        def chunks() -> Iterator[bytes]:
            done = 0
            while done < total:
                data = os.pread(fd, min(chunk, total - done), offset + done)
                if not data:
                    raise FormatError(f"tensor {name!r}: file is truncated", self.path)
                done += len(data)
                yield data

        return chunks()

    def align(self, name: str) -> int:
        """Blocks should end on multiples of this many elements (0: anywhere), e.g. HDF5 chunk rows."""
        return 0

    def read_part(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Elements ``[start, stop)`` of a *stored* tensor, also one that is a part of a logical
        tensor (and so not in :attr:`tensors`): what encodings read. Readers that list logical
        tensors under stored names, or keep parts in other files, override it."""
        return self.read_flat(name, start, stop, out)

    def part_parallel_safe(self, name: str) -> bool:
        """Whether :meth:`read_part` of this stored tensor may run on several threads at once."""
        return self.parallel_safe(name)

    def read_flat(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Elements ``[start, stop)`` in storage order, as a 1-D array of the tensor's dtype.

        With ``out`` (a 1-D uint8 array of at least the byte size) the result is a view of it.
        """
        info = self.tensors[name]
        if info.refused:
            raise TclipError(f"tensor {name!r}: {info.refused}", self.path)
        result = flat_result(info.dtype, stop - start, out)
        region = self.region(name)
        if region is not None:
            fd, offset = region
            pread_into(fd, result.view(np.uint8).data, offset + start * info.dtype.itemsize, self.path, name)
            return result
        position = 0
        storage = info.storage_shape
        for rect in flat_rectangles(storage, start, stop):
            logical = rect[::-1] if info.fortran_order else rect
            block = self.read(name, logical)
            if info.fortran_order:
                block = block.T
            n = block.size
            result[position : position + n] = block.reshape(-1)
            position += n
        return result


def _tile(runs: list[tuple[int, int, int, int]], nbytes: int) -> bool:
    """Whether runs ``(first byte, count, ...)`` cover ``[0, nbytes)`` once, in order."""
    position = 0
    for first, count, _, _ in runs:
        if first != position or count <= 0:
            return False
        position += count
    return position == nbytes


def read_region(reader: TensorReader, name: str, index: Index | None) -> np.ndarray:
    """A rectangular block of a tensor stored as one raw region, through a read-only map
    when it is not one contiguous run (the resident memory stays the block's)."""
    info = reader.tensors[name]
    index = normalize_index(index, info.shape)
    shape = tuple(s.stop - s.start for s in index)
    span = contiguous_span(index, info.shape, info.fortran_order) if shape else (0, 1)
    if span is not None:
        flat = reader.read_flat(name, span[0], span[0] + span[1])
        return flat.reshape(shape, order="F" if info.fortran_order else "C")
    fd, offset = reader.region(name)  # type: ignore[misc]
    mapped = np.memmap(reader.path, dtype=info.dtype, mode="r", offset=offset, shape=info.shape,
                       order="F" if info.fortran_order else "C")
    try:
        return np.array(mapped[index], order="F" if info.fortran_order else "C")
    finally:
        del mapped


class TensorWriter(ABC):
    """A tensor file being written to a temporary path beside its target."""

    format_name: str = ""

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput) -> None:
        self.target = Path(target)
        self.tensors = {t.name: t for t in tensors}
        self.output = output

    def blocks(self, name: str, max_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[Index]:
        """The blocks :meth:`write` must receive for ``name``, in this order."""
        return self.tensors[name].blocks(max_bytes)

    @abstractmethod
    def write(self, name: str, index: Index, data: np.ndarray) -> None:
        """Write one block; blocks arrive in the order :meth:`blocks` gave."""

    def parallel_safe(self, name: str) -> bool:
        """Whether :meth:`write_flat` of this tensor takes runs in any order, from any thread."""
        return False

    def write_flat(self, name: str, start: int, data: np.ndarray) -> None:
        """Write elements ``[start, start + data.size)`` in storage order.

        Unless :meth:`parallel_safe`, runs must come in order, one at a time.
        """
        info = self.tensors[name]
        storage = info.storage_shape
        position = 0
        for rect in flat_rectangles(storage, start, start + data.size):
            extent = tuple(s.stop - s.start for s in rect)
            n = math.prod(extent)
            block = data[position : position + n].reshape(extent)
            position += n
            if info.fortran_order:
                self.write(name, rect[::-1], block.T)
            else:
                self.write(name, rect, block)

    def copy_tensor(self, reader: TensorReader, name: str, max_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
        """Copy a tensor unchanged; formats override this for byte-exact copies."""
        for index in self.blocks(name, max_bytes):
            self.write(name, index, reader.read(name, index))

    @abstractmethod
    def _finish(self) -> None:
        """Write what remains (trailers, directories) and close the temporary file."""

    def commit(self, marker: Path | None = None) -> None:
        """Finish, fsync and rename the temporary file over the target (see
        :meth:`AtomicOutput.commit` for ``marker``)."""
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise
        self.output.commit(marker)

    def written_size(self) -> int:
        """The bytes :meth:`commit` put in place: the target's size (a format written as a
        folder counts all its files)."""
        return os.stat(self.target).st_size

    def also_written(self) -> dict[str, tuple[int, int, int]]:
        """The files besides the target that :meth:`commit` put in place where nothing was before,
        by :func:`~tclip.formats.atomic.file_identity` (a DCP folder's ``.distcp`` files): a run
        that fails or is interrupted after the commit removes them with the target."""
        return {}

    def abort(self) -> None:
        """Close and remove the temporary file; the target is untouched."""
        try:
            self._close_quietly()
        finally:
            self.output.abort()

    def _close_quietly(self) -> None:
        """Close whatever handle is open, ignoring errors (used on abort)."""

    def __enter__(self) -> "TensorWriter":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.abort()


class PositionalWriter(TensorWriter):
    """A writer whose tensors sit at byte offsets known up front (.npy, safetensors).

    The temporary file is sized at once; runs are written with ``pwrite`` at
    their offsets in any order, from any thread; untouched tensors are copied
    in the kernel. A tensor is complete when every one of its bytes was written.
    An encoded tensor listed under its stored name (one stored tensor of quantized
    blocks) takes raw bytes: ``write_flat(name, first byte, uint8 data)``.
    """

    def __init__(self, target: Path, tensors: list[TensorInfo], output: AtomicOutput) -> None:
        super().__init__(target, tensors, output)
        self.offsets: dict[str, int] = {}
        self._written: dict[str, int] = {}
        self._lock = threading.Lock()
        self._fd = -1

    def _open(self, header: bytes, total: int) -> None:
        self._fd = self.output.open()
        pwrite_all(self._fd, memoryview(header), 0)
        os.ftruncate(self._fd, total)

    def parallel_safe(self, name: str) -> bool:
        return True

    def _stored_dtype(self, name: str) -> np.dtype:
        info = self.tensors[name]
        return np.dtype(np.uint8) if info.encoding is not None else info.dtype

    def _items(self, name: str) -> int:
        """How many stored items (elements, or bytes of an encoded tensor) ``name`` has."""
        info = self.tensors[name]
        return info.nbytes if info.encoding is not None else info.size

    def write_flat(self, name: str, start: int, data: np.ndarray) -> None:
        dtype = self._stored_dtype(name)
        array = np.asarray(data)
        if array.dtype != dtype:
            array = array.astype(dtype)
        pwrite_all(self._fd, as_bytes(array), self.offsets[name] + start * dtype.itemsize)
        with self._lock:
            self._written[name] = self._written.get(name, 0) + array.size

    def write(self, name: str, index: Index, data: np.ndarray) -> None:
        info = self.tensors[name]
        index = normalize_index(index, info.shape)
        span = contiguous_span(index, info.shape, info.fortran_order) if info.shape else (0, 1)
        if span is None:
            raise TclipError(f"internal error: block {index} of {name!r} is not contiguous")
        array = np.asarray(data)
        self.write_flat(name, span[0], (array.T if info.fortran_order else array).reshape(-1))

    def copy_region(self, name: str, source_fd: int, source_offset: int, path: object) -> None:
        info = self.tensors[name]
        copy_range(source_fd, source_offset, info.nbytes, self._fd, self.offsets[name], path, writeback=True)
        with self._lock:
            self._written[name] = self._written.get(name, 0) + self._items(name)

    def copy_tensor(self, reader: TensorReader, name: str, max_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
        region = reader.region(name)
        source = reader.tensors[name]
        info = self.tensors[name]
        same = source.dtype == self._stored_dtype(name) and source.fortran_order == info.fortran_order \
            and source.shape == info.shape
        if region is not None and same:
            self.copy_region(name, region[0], region[1], reader.path)
            return
        runs = reader.runs(name) if same else None
        if runs is not None and _tile(runs, info.nbytes):
            # each run (a row shard of a DCP tensor) copied in the kernel, as one region would be
            for first, count, source_fd, source_offset in runs:
                copy_range(source_fd, source_offset, count, self._fd, self.offsets[name] + first, reader.path,
                           writeback=True)
            with self._lock:
                self._written[name] = self._written.get(name, 0) + self._items(name)
            return
        size = self._items(name)
        step = max(1, max_bytes // max(1, self._stored_dtype(name).itemsize))
        for start in range(0, size, step):
            self.write_flat(name, start, reader.read_part(name, start, min(size, start + step)))

    def _check_complete(self) -> None:
        for name in self.tensors:
            if self._written.get(name, 0) != self._items(name):
                raise FormatError(f"internal error: tensor {name!r} incomplete", self.target)

    def _finish(self) -> None:
        self._check_complete()
        fd, self._fd = self._fd, -1
        os.close(fd)

    def _close_quietly(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass
