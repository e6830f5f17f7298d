"""Pass 2: write a file again with each planned tensor rewritten (scaled or clamped).

Tensors without work are copied byte for byte where the formats allow; the output
appears atomically, only when everything succeeded."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..core.kernels import clip_unit, scale_unit
from ..core.stats import TensorStats, kept_index, normalize_axes
from ..errors import TclipError, UnsupportedError
from ..formats import TensorReader, TensorWriter, create_writer, open_reader
from ..formats.registry import holds_metadata, output_format
from .budget import BlockRunner, Budget, Job, tensor_jobs
from .passes import HeldTensors, storage_layout, storage_view
from .plan import TensorWork
from .statistics import Progress


@dataclass
class RewriteResult:
    """Pass 2 of one file: where it went and the after-statistics of the rewritten tensors."""

    path: str
    output: str | None
    after: dict[str, TensorStats]
    changed: dict[str, int]
    bytes_read: int = 0
    bytes_written: int = 0
    elapsed_s: float = 0.0
    warnings: list[str] = field(default_factory=list)
    measured: bool = True  # the after-statistics were measured


def rewrite_file(source: Path | str | TensorReader, work: dict[str, TensorWork], target: Path | None, *,
                 axes: object = None, overwrite: bool = False, budget: Budget | None = None,
                 progress: Progress | None = None, held: HeldTensors | None = None,
                 drop_nonnumeric: bool = False, metadata: dict[str, str] | None = None,
                 writer_factory: Callable[..., TensorWriter] | None = None,
                 measure_after: bool = True, commit_marker: Path | None = None) -> RewriteResult:
    """Pass 2: write ``source`` to ``target`` with each tensor of ``work`` rewritten.

    Tensors not in ``work`` are copied byte for byte where the formats allow.
    With ``target`` None nothing is written (a dry run computes the after-statistics).
    ``measure_after`` False skips the after-statistics (norms of the values written),
    for callers that show nobody the report. The output appears atomically, only when
    everything succeeded. ``commit_marker``: see :meth:`AtomicOutput.commit`.
    """
    if isinstance(source, TensorReader):
        return _rewrite(source, work, target, axes, overwrite, budget or Budget(), progress, held,
                        drop_nonnumeric, metadata, writer_factory, measure_after, commit_marker)
    with open_reader(source) as reader:
        return _rewrite(reader, work, target, axes, overwrite, budget or Budget(), progress, held,
                        drop_nonnumeric, metadata, writer_factory, measure_after, commit_marker)


def carried_loss(reader: TensorReader, target: Path) -> list[str]:
    """What writing ``reader`` to ``target`` (another format) cannot carry, for people."""
    kind = output_format(target, reader) or reader.format_name
    if kind == reader.format_name:
        return []
    lost = [f"{o.name} ({o.kind})" for o in reader.others]
    lost += [f"{t.name} ({t.dtype} is not numeric)" for t in reader.tensors.values() if not t.numeric]
    lost += reader.lost_in_conversion()
    if reader.metadata and not holds_metadata(kind):
        lost.append(f"the file's metadata ({len(reader.metadata)} entries)")
    return lost


_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def _rewrite(reader: TensorReader, work: dict[str, TensorWork], target: Path | None, axes: object,
             overwrite: bool, budget: Budget, progress: Progress | None, held: HeldTensors | None,
             drop_nonnumeric: bool, metadata: dict[str, str] | None,
             writer_factory: Callable[..., TensorWriter] | None, measure_after: bool = True,
             commit_marker: Path | None = None) -> RewriteResult:
    started = time.perf_counter()
    result = RewriteResult(str(reader.path), None if target is None else str(target), {}, {},
                           measured=measure_after)
    tensors = list(reader.tensors.values())
    if target is not None:
        lost = carried_loss(reader, target)
        if lost:
            listing = ", ".join(lost[:8]) + (f" and {len(lost) - 8} more" if len(lost) > 8 else "")
            if not drop_nonnumeric:
                raise UnsupportedError(f"{output_format(target, reader) or 'the output format'} cannot hold {listing}; "
                                       "nothing was written (--drop-nonnumeric drops them with a warning)",
                                       reader.path)
            result.warnings.append(f"dropped what the output format cannot hold: {listing}")
            tensors = [t for t in tensors if t.numeric]
    writer: TensorWriter | None = None
    if target is not None:
        factory = writer_factory or create_writer
        writer = factory(target, reader, tensors=tensors if len(tensors) != len(reader.tensors) else None,
                         overwrite=overwrite, rewritten=set(work), metadata=metadata)
    written = {t.name for t in tensors}
    try:
        _run_rewrite(reader, writer, work, axes, budget, progress, held, written, result, measure_after)
        if writer is not None:
            writer.commit(commit_marker)
            result.bytes_written = os.stat(target).st_size  # type: ignore[arg-type]
    except BaseException as error:
        if writer is not None:
            writer.abort()
        if isinstance(error, OSError) and error.errno in _WRITE_ERRNOS and target is not None:
            # Name where it could not write (the error itself names no file).
            raise TclipError(f"cannot write {target}: {error.strerror or error}; nothing was written",
                             reader.path) from None
        raise
    result.elapsed_s = time.perf_counter() - started
    return result


def _run_rewrite(reader: TensorReader, writer: TensorWriter | None, work: dict[str, TensorWork], axes: object,
                 budget: Budget, progress: Progress | None, held: HeldTensors | None, written: set[str],
                 result: RewriteResult, measure_after: bool = True) -> None:
    layouts = {}
    for name, task in work.items():
        info = reader.tensors[name]
        tensor_axes = normalize_axes(axes, len(info.shape)) if task.scale is not None and task.scale.ndim else None
        layouts[name] = storage_layout(info, tensor_axes)
        result.after[name] = TensorStats.empty(info.shape, tensor_axes)
        result.changed[name] = 0
    size = os.stat(reader.path).st_size
    itemsize = max((reader.tensors[n].dtype.itemsize for n in work), default=4)
    counted = 0

    def advance(nbytes: int) -> None:
        nonlocal counted
        counted += nbytes
        if progress is not None:
            progress(nbytes)

    with BlockRunner(budget, itemsize) as runner:
        def copy(name: str) -> None:
            if writer is not None and name in written:
                writer.copy_tensor(reader, name)
            advance(reader.tensors[name].nbytes)

        def jobs() -> Iterator[Job]:
            for name, info in reader.tensors.items():
                if name not in work:
                    yield Job(name, kind="main", action=lambda n=name: copy(n))
                    continue
                yield from tensor_jobs(name, layouts[name][0], info.dtype.itemsize, runner.block_bytes,
                                       reader.align(name))

        def read(job: Job, buffer: np.ndarray) -> np.ndarray:
            kept = held.data.get(job.name) if held is not None else None
            if kept is not None:
                nbytes = (job.end - job.start) * kept.dtype.itemsize
                out = buffer[:nbytes].view(kept.dtype)
                out[...] = kept[job.start:job.end]
                return out
            return reader.read_flat(job.name, job.start, job.end, buffer)

        def prepare(job: Job, buffer: np.ndarray) -> np.ndarray | None:
            held_here = held is not None and job.name in held.data
            return None if held_here or reader.parallel_safe(job.name) else read(job, buffer)

        def work_on(job: Job, buffer: np.ndarray) -> tuple[np.ndarray, list[tuple], int, bool]:
            data = job.data if job.data is not None else read(job, buffer)
            task = work[job.name]
            grid, storage_axes = layouts[job.name]
            after = result.after[job.name]
            scratch = runner.scratch()
            scale = None
            if task.scale is not None and task.scale.ndim:
                scale = storage_view(task.scale, reader.tensors[job.name])
            results, changed = [], 0
            for k in range(job.first, job.stop):
                lo, hi = grid.bounds(k)
                unit = data[lo - job.start:hi - job.start].reshape(grid.unit_shape(k))
                if task.bounds is not None:
                    count, wide = clip_unit(unit, task.bounds[0], task.bounds[1], scratch)
                    changed += count
                elif scale is not None:
                    wide = scale_unit(unit, scale[kept_index(grid.index(k), unit.ndim, storage_axes)], scratch)
                else:
                    wide = scale_unit(unit, float(task.scale), scratch)  # type: ignore[arg-type]
                if measure_after:
                    results.append(after.reduce(unit, scratch, storage_axes, wide, extremes=False))
            done = False
            if writer is not None and job.name in written and writer.parallel_safe(job.name):
                writer.write_flat(job.name, job.start, data)
                done = True
            return data, results, changed, done

        def finish(job: Job, outcome: tuple[np.ndarray, list[tuple], int, bool]) -> None:
            data, results, changed, done = outcome
            grid, storage_axes = layouts[job.name]
            after = result.after[job.name]
            target = storage_view(after.sum_of_squares, reader.tensors[job.name]) \
                if after.axes is not None else None
            for k, unit_result in zip(range(job.first, job.stop), results):
                at = grid.index(k) if storage_axes is not None else ()
                after.add_unit(unit_result, at, target, storage_axes)
            if not measure_after:
                after.count += job.end - job.start
            result.changed[job.name] += changed
            if writer is not None and job.name in written and not done:
                writer.write_flat(job.name, job.start, data)
            result.bytes_read += data.nbytes
            advance(data.nbytes)

        runner.run(jobs(), prepare, work_on, finish,
                   lambda job: (job.end - job.start) * reader.tensors[job.name].dtype.itemsize)
    if progress is not None:
        progress(max(0, size - counted))
