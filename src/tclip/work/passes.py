"""The one unit-by-unit pass over a file's tensors: pass 1, pass 2 and diff all run on it.

A pass is a list of *steps* in file order: a :class:`Walk` (one tensor, or two
read in step, cut into the fixed units of :mod:`tclip.core.units`) or an
:class:`Action` (a whole-tensor job on the main thread at its turn, e.g. a byte
copy). :func:`run_pass` owns everything but the arithmetic:

- jobs: each walk is cut into blocks of whole units, sized from the
  :class:`~tclip.work.budget.Budget` (blocks end on the source's alignment, e.g.
  HDF5 chunk rows);
- reads: a block's data comes from the walk's *sources*, on a worker thread
  when every source allows it, else on the main thread, in order;
- unit slicing: :meth:`Block.units` gives each unit of a block in its own shape;
- Fortran order, one way: :func:`tensor_walk` walks a tensor in its storage
  order (a Fortran-order tensor's units are those of its reversed shape; its
  reduction axes and per-slice arrays are mirrored by :meth:`Walk.view`), and
  :func:`pair_walk` walks two tensors in step in C order of their shape (two
  files need not store a tensor in the same order);
- merging: ``merge`` sees every block in file order on the main thread, so
  per-slice sums are added in unit order and every result is the same bits for
  any thread count and block size;
- writing: after ``work`` a block goes to the walk's *sink*, from the worker
  when the sink allows writes in any order, else in order;
- held tensors: a whole tensor read by pass 1 may be kept (:class:`HeldTensors`)
  and pass 2 reads it from memory (:func:`source_for`);
- progress: bytes per block and per action as they are merged, topped up to
  the file's size.

A pass supplies only ``work(block, scratch)`` (any thread: the arithmetic of the
block's units, returning anything) and ``merge(block, result)`` (main thread, in
order). Memory: the budget's block buffers plus one unit scratch per thread.

The seam for logical tensors
----------------------------
A walk never calls a reader or writer itself: it reads a tensor's elements
through a :class:`Source` (``read(start, stop, out)``: elements ``[start, stop)``
of the tensor in its storage order, as a 1-D array of ``dtype``) and writes them
through a :class:`Sink` (``write(start, data)``). :func:`source_for` and
:func:`sink_for` pick them.

A tensor whose :class:`~tclip.formats.base.TensorInfo` carries an ``encoding``
(a weight stored as quantized codes plus scales, or as quantized blocks: see
:class:`~tclip.quant.contract.QuantEncoding` for the contract) is walked differently:

- statistics (pass 1, and pass 2's after-statistics) walk its *reducer*
  (:func:`tensor_walk` sets :attr:`Walk.reducer`): a source of raw data whose
  ``reduce`` gives each unit's :class:`~tclip.core.stats.UnitResult` in closed form, plus what the stored
  parts held (:class:`~tclip.quant.codes.Findings`); blocks, units and the order of
  merging are the driver's as for every tensor, so the results are the same bits
  for any thread count and block size;
- values (``diff``) come from its ``source``: float64, C order;
- it is never written through a sink: pass 2 runs the encoding's ``rescale`` jobs
  (which rewrite only the parts that hold scales) as actions, and the parts it does
  not rewrite are copied like any untouched tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..core.kernels import Scratch
from ..core.units import UNIT_ELEMENTS, UnitGrid, flat_rectangles
from ..formats import TensorReader, TensorWriter
from ..quant.contract import Reducer, computing
from .budget import BlockRunner, Budget, Job, tensor_jobs

Progress = Callable[[int], None]

# Tensors up to this size that pass 1 reads are kept in memory for pass 2 of
# the same run (within an eighth of --memory), so files of many small tensors
# are read once.
IN_MEMORY_TENSOR_BYTES = 1 << 20


class Source(Protocol):
    """Where a walk gets a tensor's elements."""

    dtype: np.dtype       # of the elements ``read`` returns
    parallel_safe: bool   # ``read`` may run on any thread, in any order
    align: int            # blocks should end on multiples of this many elements (0: anywhere)

    def read(self, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
        """Elements ``[start, stop)`` as a 1-D array; a view of ``out`` (raw bytes) when it is large enough."""


class Sink(Protocol):
    """Where a walk writes a tensor's elements."""

    parallel_safe: bool   # ``write`` takes runs in any order, from any thread

    def write(self, start: int, data: np.ndarray) -> None:
        """Write elements ``[start, start + data.size)``."""


class StoredSource:
    """A tensor's stored elements, in storage order, from its reader."""

    def __init__(self, reader: TensorReader, name: str) -> None:
        self.reader, self.name = reader, name
        self.dtype = reader.tensors[name].dtype
        self.parallel_safe = reader.parallel_safe(name)
        self.align = reader.align(name)

    def read(self, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
        return self.reader.read_flat(self.name, start, stop, out)


class COrderSource:
    """A tensor's elements in C order of its shape, whatever order it is stored in
    (a Fortran-order tensor is read as the rectangles that cover the run)."""

    def __init__(self, reader: TensorReader, name: str) -> None:
        self.reader, self.name = reader, name
        self.info = reader.tensors[name]
        self.dtype = self.info.dtype
        self.parallel_safe = reader.parallel_safe(name)
        self.align = 0 if self.info.fortran_order else reader.align(name)

    def read(self, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
        if not self.info.fortran_order:
            return self.reader.read_flat(self.name, start, stop, out)
        count = (stop - start) * self.dtype.itemsize
        result = out[:count].view(self.dtype) if out is not None and out.size >= count \
            else np.empty(stop - start, self.dtype)
        position = 0
        for rect in flat_rectangles(tuple(self.info.shape), start, stop):
            block = np.ascontiguousarray(self.reader.read(self.name, rect)).reshape(-1)
            result[position:position + block.size] = block
            position += block.size
        return result


class HeldSource:
    """A tensor pass 1 kept in memory (:class:`HeldTensors`): copied into the block buffer,
    which the pass may change in place."""

    parallel_safe = True
    align = 0

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.dtype = array.dtype

    def read(self, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
        count = (stop - start) * self.dtype.itemsize
        result = out[:count].view(self.dtype) if out is not None and out.size >= count \
            else np.empty(stop - start, self.dtype)
        result[...] = self.array[start:stop]
        return result


class WriterSink:
    """A tensor's elements written in storage order through its writer."""

    def __init__(self, writer: TensorWriter, name: str) -> None:
        self.writer, self.name = writer, name
        self.parallel_safe = writer.parallel_safe(name)

    def write(self, start: int, data: np.ndarray) -> None:
        self.writer.write_flat(self.name, start, data)


class HeldTensors:
    """Small tensors pass 1 read, kept for pass 2 of the same run (never pickled)."""

    def __init__(self, limit: int, tensor_bytes: int = IN_MEMORY_TENSOR_BYTES) -> None:
        self.limit, self.used, self.tensor_bytes = limit, 0, tensor_bytes
        self.data: dict[str, np.ndarray] = {}

    def offer(self, name: str, raw: np.ndarray) -> None:
        if raw.nbytes <= self.tensor_bytes and self.used + raw.nbytes <= self.limit:
            self.data[name] = raw.copy()
            self.used += raw.nbytes


def source_for(reader: TensorReader, name: str, held: HeldTensors | None = None) -> Source:
    """How a walk reads tensor ``name``: its encoding's source, the copy pass 1 kept, or the reader."""
    info = reader.tensors[name]
    if info.encoding is not None:
        return computing(reader, info).source(reader, info)
    if held is not None and name in held.data:
        return HeldSource(held.data[name])
    return StoredSource(reader, name)


def sink_for(writer: TensorWriter, name: str) -> Sink:
    """How a walk writes stored tensor ``name`` (encoded tensors are rescaled by jobs, never sunk)."""
    return WriterSink(writer, name)


# --------------------------------------------------------------------------- steps


@dataclass
class Walk:
    """One tensor (or a pair read in step) walked unit by unit.

    Attributes:
        name: the step's name (the tensor's; for a pair, A's).
        grid: the units, over the shape in the order the elements are walked.
        sources: one per tensor read; their elements line up one to one.
        sink: where the first source's block goes after ``work`` (None: nowhere).
        axes: the reduction axes in the walked order (None: whole-tensor sums).
        mirrored: walked in the storage order of a Fortran-order tensor, so
            per-slice arrays of the logical tensor are seen through :meth:`view`.
        reducer: an encoded tensor's reducer (also its one source): its
            ``reduce(data, grid, first, stop, stats, scratch)`` gives the units'
            statistics; None for stored values.
    """

    name: str
    grid: UnitGrid
    sources: tuple[Source, ...]
    sink: Sink | None = None
    axes: tuple[int, ...] | None = None
    mirrored: bool = False
    reducer: Reducer | None = None

    @property
    def itemsize(self) -> int:
        return sum(source.dtype.itemsize for source in self.sources)

    @property
    def parallel_safe(self) -> bool:
        return all(source.parallel_safe for source in self.sources)

    @property
    def align(self) -> int:
        return self.sources[0].align if len(self.sources) == 1 else 0

    def view(self, array: np.ndarray) -> np.ndarray:
        """A keepdims array of the logical tensor (per-slice sums or scales) in the walked order."""
        return array.T if self.mirrored and array.ndim else array


def tensor_walk(reader: TensorReader, name: str, *, axes: tuple[int, ...] | None = None,
                held: HeldTensors | None = None, writer: TensorWriter | None = None,
                factor: np.ndarray | None = None) -> Walk:
    """Tensor ``name`` in its storage order (pass 1, pass 2); ``axes`` of the logical tensor.

    An encoded tensor is walked through its reducer (statistics only: no ``writer``), as a
    rescale by ``factor`` would leave it when that is given."""
    info = reader.tensors[name]
    if info.encoding is not None:
        reducer = computing(reader, info).reducer(reader, info, factor)
        grid = UnitGrid.of(tuple(info.shape), getattr(reducer, "unit_elements", UNIT_ELEMENTS))
        return Walk(name, grid, (reducer,), None, axes, False, reducer)
    shape = info.storage_shape
    if axes is not None and info.fortran_order:
        axes = tuple(sorted(len(shape) - 1 - a for a in axes))
    return Walk(name, UnitGrid.of(shape), (source_for(reader, name, held),),
                None if writer is None else sink_for(writer, name), axes, info.fortran_order)


def pair_walk(name: str, reader_a: TensorReader, name_a: str, reader_b: TensorReader, name_b: str) -> Walk:
    """Two tensors of one shape read in step, element by element in C order (diff)."""
    sources = tuple(source_for(reader, tensor) if reader.tensors[tensor].encoding is not None
                    else COrderSource(reader, tensor) for reader, tensor in ((reader_a, name_a), (reader_b, name_b)))
    return Walk(name, UnitGrid.of(tuple(reader_a.tensors[name_a].shape)), sources)


@dataclass
class Action:
    """A whole-tensor job run on the main thread at its turn (e.g. copying a tensor);
    ``run`` returns the bytes it covered, for progress."""

    name: str
    run: Callable[[], int]


@dataclass
class Block:
    """A run of whole units of a walk, with its data (one array per source)."""

    walk: Walk
    first: int      # units [first, stop)
    stop: int
    start: int      # elements [start, end) in the walked order
    end: int
    data: tuple[np.ndarray, ...]

    def units(self) -> Iterator[tuple[int, tuple[np.ndarray, ...]]]:
        """Each unit ``k`` of the block with its data in the unit's own shape."""
        grid = self.walk.grid
        for k in range(self.first, self.stop):
            lo, hi = grid.bounds(k)
            shape = grid.unit_shape(k)
            yield k, tuple(d[lo - self.start:hi - self.start].reshape(shape) for d in self.data)

    @property
    def nbytes(self) -> int:
        """The bytes read for the block (a source of decoded values says how many it read)."""
        total = 0
        for source, data in zip(self.walk.sources, self.data):
            stored = getattr(source, "stored_bytes", None)
            total += stored(self.start, self.end) if stored is not None else data.nbytes
        return total


# --------------------------------------------------------------------------- the driver


def run_pass(steps: Iterable[Walk | Action], budget: Budget, work: Callable[[Block, Scratch], Any],
             merge: Callable[[Block, Any], None], *, keep: HeldTensors | None = None,
             progress: Progress | None = None, total: int | None = None) -> int:
    """Run ``steps`` in order: ``work`` on every block (any thread), ``merge`` of every block
    in order (main thread), each :class:`Action` at its turn.

    ``keep`` is offered every tensor a single-source walk read whole; ``progress``
    is advanced by the bytes of each block and action, then up to ``total``.
    Returns the bytes read by the walks.
    """
    steps = list(steps)
    itemsize = max((s.itemsize for s in steps if isinstance(s, Walk)), default=4)
    counts = {"read": 0, "advanced": 0}

    def advance(nbytes: int) -> None:
        counts["advanced"] += nbytes
        if progress is not None:
            progress(nbytes)

    with BlockRunner(budget, itemsize) as runner:
        def jobs() -> Iterator[Job]:
            for step in steps:
                if isinstance(step, Action):
                    yield Job(step.name, kind="main", action=lambda s=step: advance(s.run()))
                    continue
                for job in tensor_jobs(step.name, step.grid, step.itemsize, runner.block_bytes, step.align):
                    job.step = step
                    yield job

        def read(job: Job, buffer: np.ndarray) -> tuple[np.ndarray, ...]:
            data, offset = [], 0
            for source in job.step.sources:
                nbytes = (job.end - job.start) * source.dtype.itemsize
                data.append(source.read(job.start, job.end, buffer[offset:offset + nbytes]))
                offset += nbytes
            return tuple(data)

        def prepare(job: Job, buffer: np.ndarray) -> tuple[np.ndarray, ...] | None:
            return None if job.step.parallel_safe else read(job, buffer)

        def on_worker(job: Job, buffer: np.ndarray) -> tuple[Block, Any, bool]:
            data = job.data if job.data is not None else read(job, buffer)
            block = Block(job.step, job.first, job.stop, job.start, job.end, data)
            result = work(block, runner.scratch())
            sink = block.walk.sink
            written = sink is not None and sink.parallel_safe
            if written:
                sink.write(block.start, block.data[0])  # type: ignore[union-attr]
            return block, result, written

        def in_order(job: Job, outcome: tuple[Block, Any, bool]) -> None:
            block, result, written = outcome
            merge(block, result)
            walk = block.walk
            if walk.sink is not None and not written:
                walk.sink.write(block.start, block.data[0])
            if keep is not None and walk.reducer is None and len(block.data) == 1 and block.start == 0 \
                    and block.end == walk.grid.size:
                keep.offer(walk.name, block.data[0])
            counts["read"] += block.nbytes
            advance(block.nbytes)

        runner.run(jobs(), prepare, on_worker, in_order, lambda job: (job.end - job.start) * job.step.itemsize)
    if progress is not None and total is not None:
        progress(max(0, total - counts["advanced"]))  # a pass advances by the file's size
    return counts["read"]

