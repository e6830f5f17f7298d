"""Pass 1: the statistics of one file's selected tensors, block by block.

The result, :class:`FileStats`, is plain and picklable: it is what crosses a
process or machine boundary when a tensor set is measured on many workers, and
its :class:`~tclip.core.stats.TensorStats` merge exactly."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.stats import TensorStats
from ..errors import TclipError
from ..formats import TensorInfo, TensorReader, open_reader
from .budget import BlockRunner, Budget, Job, tensor_jobs
from .passes import HeldTensors, storage_layout, storage_view
from .selection import Selection, TensorEntry, select


Progress = Callable[[int], None]


@dataclass
class FileStats:
    """Pass 1 of one file: its tensors, the statistics of the selected ones, and what is not a tensor.

    Plain and picklable: this is what crosses a process or machine boundary.
    ``stats`` holds one :class:`TensorStats` per tensor that was read (the
    selected ones; for the report also those whose rank cannot take the axes,
    reduced as a whole).
    """

    path: str
    format: str
    size_bytes: int
    tensors: list[TensorEntry]
    stats: dict[str, TensorStats]
    others: list[Any] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    bytes_read: int = 0
    elapsed_s: float = 0.0

    @property
    def selected(self) -> list[str]:
        return [t.name for t in self.tensors if t.skipped is None]


def _check_slice_memory(infos: list[tuple[TensorInfo, tuple[int, ...] | None]], budget: Budget,
                        path: object) -> None:
    total = 0
    for info, axes in infos:
        if axes is None or info.size == 0:
            continue
        slices = math.prod(n for i, n in enumerate(info.shape) if i not in axes)
        total += slices * 16  # a float64 sum and a float64 scale per slice
        if total > budget.slice_bytes:
            raise TclipError(f"tensor {info.name!r}: per-slice statistics of {slices:,} slices need "
                             f"{total / 2**20:.0f} MiB, more than --memory allows for them "
                             f"({budget.slice_bytes / 2**20:.0f} MiB); raise --memory", path)


def file_statistics(source: Path | str | TensorReader, *, selection: Selection | None = None, axes: object = None,
                    track_l1: bool = False, track_moments: bool = False, budget: Budget | None = None,
                    progress: Progress | None = None, whole_if_rank_skip: bool = False,
                    held: HeldTensors | None = None) -> FileStats:
    """Pass 1: statistics of one file's selected tensors, block by block, on the engine's threads.

    Args:
        source: a path, or a reader already open.
        selection: include/exclude globs; only floating tensors are read.
        axes: reduce per slice along these axes (tensors whose rank cannot take
            them are skipped, or with ``whole_if_rank_skip`` reduced as a whole).
        track_l1, track_moments: also the L1 norm / mean, zeros and histogram.
        budget: memory and threads (:class:`tclip.engine.Budget`).
        progress: called with byte counts; one pass advances it by the file's size.

    Returns:
        A :class:`FileStats`, identical to the last bit for any budget.
    """
    if isinstance(source, TensorReader):
        return _statistics(source, selection or Selection(), axes, track_l1, track_moments, budget or Budget(),
                           progress, whole_if_rank_skip, held)
    with open_reader(source) as reader:
        return _statistics(reader, selection or Selection(), axes, track_l1, track_moments, budget or Budget(),
                           progress, whole_if_rank_skip, held)


def _statistics(reader: TensorReader, selection: Selection, axes: object, track_l1: bool, track_moments: bool,
                budget: Budget, progress: Progress | None, whole_if_rank_skip: bool,
                held: HeldTensors | None) -> FileStats:
    started = time.perf_counter()
    path = reader.path
    entries, to_read = select(reader, selection, axes, whole_if_rank_skip)
    _check_slice_memory([(reader.tensors[n], a) for n, a in to_read.items()], budget, path)
    stats = {name: TensorStats.empty(reader.tensors[name].shape, a, track_l1=track_l1,
                                     track_moments=track_moments) for name, a in to_read.items()}
    size = os.stat(path).st_size
    result = FileStats(str(path), reader.format_name, size, entries, stats, list(reader.others),
                       dict(reader.metadata))
    itemsize = max((reader.tensors[n].dtype.itemsize for n in to_read), default=4)
    layouts = {name: storage_layout(reader.tensors[name], a) for name, a in to_read.items()}
    with BlockRunner(budget, itemsize) as runner:
        def jobs() -> Iterator[Job]:
            for name in to_read:
                yield from tensor_jobs(name, layouts[name][0], reader.tensors[name].dtype.itemsize,
                                       runner.block_bytes, reader.align(name))

        def read(job: Job, buffer: np.ndarray) -> np.ndarray:
            return reader.read_flat(job.name, job.start, job.end, buffer)

        def prepare(job: Job, buffer: np.ndarray) -> np.ndarray | None:
            return None if reader.parallel_safe(job.name) else read(job, buffer)

        def work(job: Job, buffer: np.ndarray) -> tuple[np.ndarray, list[tuple]]:
            data = job.data if job.data is not None else read(job, buffer)
            grid, storage_axes = layouts[job.name]
            tensor_stats = stats[job.name]
            scratch = runner.scratch()
            results = []
            for k in range(job.first, job.stop):
                lo, hi = grid.bounds(k)
                unit = data[lo - job.start:hi - job.start].reshape(grid.unit_shape(k))
                results.append(tensor_stats.reduce(unit, scratch, storage_axes))
            return data, results

        def finish(job: Job, outcome: tuple[np.ndarray, list[tuple]]) -> None:
            data, results = outcome
            grid, storage_axes = layouts[job.name]
            tensor_stats = stats[job.name]
            target = storage_view(tensor_stats.sum_of_squares, reader.tensors[job.name]) \
                if tensor_stats.axes is not None else None
            for k, unit_result in zip(range(job.first, job.stop), results):
                at = grid.index(k) if storage_axes is not None else ()
                tensor_stats.add_unit(unit_result, at, target, storage_axes)
            if held is not None and job.start == 0 and job.end == reader.tensors[job.name].size:
                held.offer(job.name, data)
            result.bytes_read += data.nbytes
            if progress is not None:
                progress(data.nbytes)

        runner.run(jobs(), prepare, work, finish,
                   lambda job: (job.end - job.start) * reader.tensors[job.name].dtype.itemsize)
    if progress is not None:
        progress(max(0, size - result.bytes_read))  # a pass advances by the file's size
    result.elapsed_s = time.perf_counter() - started
    return result
