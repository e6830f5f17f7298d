"""The work on files: pass 1 (statistics), the plan, pass 2 (the rewrite).

Each step takes and returns plain, picklable data, so the same steps serve one
file, a sharded tensor set (:mod:`tclip.tensorset`) and a cluster:

- :func:`file_statistics` (pass 1): the statistics of one file's selected
  tensors -- a :class:`FileStats`, whose :class:`~tclip.stats.TensorStats`
  merge exactly.
- :func:`make_plan`: from the statistics of every file and a clip mode, what
  to do to each tensor (:class:`TensorWork`: a scale factor, per slice or
  whole, or value bounds).
- :func:`rewrite_file` (pass 2): rewrites one file given its tensors' work and
  returns the after-statistics (:class:`RewriteResult`).

:func:`clip_file` is their composition for one file, :func:`report_file` is pass 1
alone, :func:`file_info` reads the header. They know formats only through the
reader/writer protocol and arithmetic only through :mod:`tclip.stats`,
:mod:`tclip.plan` and :mod:`tclip.kernels`; blocks run on :mod:`tclip.engine`.
"""

from __future__ import annotations

import errno
import fnmatch
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .core.dtypes import dtype_name, is_complex, is_floating
from .engine import BlockRunner, Budget, Job, tensor_jobs
from .errors import NonFiniteError, OutputExistsError, TclipError, UnsupportedError
from .formats import TensorInfo, TensorReader, TensorWriter, create_writer, open_reader
from .formats.registry import holds_metadata, kept_endings, output_format
from .core.kernels import clip_unit, scale_unit
from .core.modes import (
    AverageNormClip,
    GlobalNormClip,
    Mode,
    NormClip,
    ValueClip,
    global_norm_of,
    plan_scales,
    value_bounds,
)
from .quantized import describe, scale_companions
from .report import (
    FileReport,
    InfoReport,
    InfoTensor,
    OtherReport,
    TensorReport,
    slice_summary,
)
from .core.stats import TensorStats, kept_index, normalize_axes
from .core.units import UnitGrid

Progress = Callable[[int], None]

# Tensors up to this size that pass 1 reads are kept in memory for pass 2 of
# the same run (within an eighth of --memory), so files of many small tensors
# are read once.
IN_MEMORY_TENSOR_BYTES = 1 << 20


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Selection:
    """Which tensors to work on, by shell-style globs over their names.

    A leading ``/`` in a pattern is ignored (HDF5 paths are named without it,
    but ``h5ls`` shows it).
    """

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    allow: frozenset[str] | None = None  # a tensor set's allowlist (an index's weight_map for this shard)

    def matches(self, name: str) -> bool:
        if self.allow is not None and name not in self.allow:
            return False
        if self.include and not any(fnmatch.fnmatchcase(name, p.lstrip("/")) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, p.lstrip("/")) for p in self.exclude)

    def unmatched(self, names: list[str]) -> list[str]:
        """The include/exclude patterns that match none of ``names``."""
        return [p for p in (*self.include, *self.exclude)
                if not any(fnmatch.fnmatchcase(n, p.lstrip("/")) for n in names)]


@dataclass(frozen=True)
class ClipOptions:
    """How :func:`clip_file` writes its result and treats awkward tensors.

    Attributes:
        output: the output path (its suffix picks the format); default
            ``NAME.clipped.EXT`` beside the input, or in ``out_dir``.
        in_place: replace the input itself (atomically).
        overwrite: replace an existing output.
        nonfinite: "error" refuses a file whose selected tensors hold NaN/Inf,
            "propagate" computes TensorFlow's result.
        strict: tensors whose rank cannot take ``--axes`` are an error, not skipped.
        dry_run: compute the report, write nothing.
        block_bytes: the largest block read at once (None: sized from ``memory``).
        memory, threads: the budget of a pass (:class:`tclip.engine.Budget`).
        drop_nonnumeric: a conversion drops what the output format cannot hold
            (non-numeric datasets, metadata), with a warning, instead of failing.
        measure_after: measure the values written (the report's "after" column);
            the command line skips it when it shows no report (-q).
    """

    output: Path | None = None
    out_dir: Path | None = None
    in_place: bool = False
    overwrite: bool = False
    selection: Selection = field(default_factory=Selection)
    nonfinite: str = "error"
    strict: bool = False
    dry_run: bool = False
    block_bytes: int | None = None
    memory: int = Budget.memory
    threads: int = 0
    drop_nonnumeric: bool = False
    measure_after: bool = True

    @property
    def budget(self) -> Budget:
        return Budget(self.memory, self.threads, self.block_bytes)


def default_output(path: Path, out_dir: Path | None = None) -> Path:
    """``grads.npz`` -> ``grads.clipped.npz`` beside it, or ``out_dir/grads.npz``.

    Keras 3 loads weights only from names ending in ``.weights.h5``, so
    ``model.weights.h5`` -> ``model.clipped.weights.h5``.
    """
    path = Path(path)
    if out_dir is not None:
        return Path(out_dir) / path.name
    for ending in kept_endings():
        cut = len(ending)
        if path.name.lower().endswith(ending) and len(path.name) > cut:
            return path.with_name(f"{path.name[:-cut]}.clipped{path.name[-cut:]}")
    return path.with_name(f"{path.stem}.clipped{path.suffix}")


def mode_params(mode: Mode) -> dict[str, object]:
    if isinstance(mode, ValueClip):
        return {"min": mode.clip_value_min, "max": mode.clip_value_max}
    params: dict[str, object] = {"clip": mode.clip_norm}
    if isinstance(mode, NormClip):
        axes = mode.axes
        params["axes"] = None if axes is None else ([axes] if isinstance(axes, int) else list(axes))
    if isinstance(mode, GlobalNormClip):
        params["use_norm"] = mode.use_norm
    return params


def axes_problem(ndim: int, axes: object) -> str | None:
    """Why a tensor of rank ``ndim`` cannot take ``axes`` (None if it can)."""
    if axes is None:
        return None
    items = [axes] if isinstance(axes, int) else list(axes)  # type: ignore[call-overload]
    seen: dict[int, int] = {}
    for axis in items:
        if not -ndim <= axis < ndim:
            return f"rank {ndim} has no axis {axis}"
        if axis % ndim in seen:
            return f"axes {seen[axis % ndim]} and {axis} are the same axis at rank {ndim}"
        seen[axis % ndim] = axis
    return None


def is_rank_skip(reason: str | None) -> bool:
    return bool(reason) and reason.startswith(("rank ", "axes "))  # type: ignore[union-attr]


def skip_reason(info: TensorInfo, selection: Selection, axes: object = None) -> str | None:
    """Why a tensor is left as it is (None: it is worked on). Every mode and the
    report select the same tensors: floating ones, matching the globs, whose rank
    can take the axes."""
    if not selection.matches(info.name):
        return "not selected"
    if info.refused:
        return info.refused
    if not info.numeric:
        return f"{info.dtype_label or info.dtype} is not numeric"
    if not is_floating(info.dtype):
        return f"{dtype_name(info.dtype)} is not floating-point"
    return axes_problem(len(info.shape), axes)


# --------------------------------------------------------------------------- pass 1


@dataclass
class TensorEntry:
    """What pass 1 knows of one tensor of a file (plain data)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    skipped: str | None = None


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


class HeldTensors:
    """Small tensors pass 1 read, kept for pass 2 of the same run (never pickled)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self.data: dict[str, np.ndarray] = {}

    def offer(self, name: str, raw: np.ndarray) -> None:
        if raw.nbytes <= IN_MEMORY_TENSOR_BYTES and self.used + raw.nbytes <= self.limit:
            self.data[name] = raw.copy()
            self.used += raw.nbytes


def _storage(info: TensorInfo, axes: tuple[int, ...] | None) -> tuple[UnitGrid, tuple[int, ...] | None]:
    shape = info.storage_shape
    if axes is not None and info.fortran_order:
        axes = tuple(sorted(len(shape) - 1 - a for a in axes))
    return UnitGrid.of(shape), axes


def _storage_view(array: np.ndarray, info: TensorInfo) -> np.ndarray:
    return array.T if info.fortran_order and array.ndim else array


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


def select(reader: TensorReader, selection: Selection, axes: object = None,
           whole_if_rank_skip: bool = False) -> tuple[list[TensorEntry], dict[str, tuple[int, ...] | None]]:
    """Header-only: every tensor with its skip reason, and the reduction axes of those to read.

    With ``whole_if_rank_skip`` (the report), a tensor whose rank cannot take
    the axes is still read, reduced as a whole (NaN/Inf and its norm are never hidden).
    """
    entries, to_read = [], {}
    for info in reader.tensors.values():
        reason = skip_reason(info, selection, axes)
        entries.append(TensorEntry(info.name, tuple(info.shape), info.dtype_label or dtype_name(info.dtype),
                                   info.nbytes, reason))
        if reason is None:
            to_read[info.name] = normalize_axes(axes, len(info.shape))
        elif whole_if_rank_skip and (is_rank_skip(reason) or (is_complex(info.dtype) and info.numeric
                                                               and selection.matches(info.name))):
            to_read[info.name] = None  # complex: never clipped, but its NaN/Inf and norm are shown
    return entries, to_read


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
    layouts = {name: _storage(reader.tensors[name], a) for name, a in to_read.items()}
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
            target = _storage_view(tensor_stats.sum_of_squares, reader.tensors[job.name]) \
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


# --------------------------------------------------------------------------- plan


@dataclass
class TensorWork:
    """What pass 2 does to one tensor: multiply by ``scale`` (a 0-d array, or one
    factor per slice in keepdims form) or clamp to ``bounds``."""

    scale: np.ndarray | None = None
    bounds: tuple[float, float] | None = None


@dataclass
class Plan:
    """Pass 2's work for every file of a run: ``work[path][tensor]``; tensors not listed are copied."""

    mode: Mode
    work: dict[str, dict[str, TensorWork]]
    scales: dict[str, dict[str, np.ndarray]]
    global_norm: float | None = None


def make_plan(mode: Mode, files: list[FileStats]) -> Plan:
    """Scale factors (or value bounds) for every selected tensor of every file.

    ``global`` reduces the statistics of all files to one norm (an exact sum of
    every tensor's sum of squares); the other modes work per tensor.
    """
    work: dict[str, dict[str, TensorWork]] = {}
    scales: dict[str, dict[str, np.ndarray]] = {}
    global_norm = None
    if isinstance(mode, GlobalNormClip):
        every = [f.stats[n] for f in files for n in f.selected]
        global_norm = global_norm_of(every) if mode.use_norm is None else float(mode.use_norm)
    for stats in files:
        chosen = {n: stats.stats[n] for n in stats.selected}
        file_work: dict[str, TensorWork] = {}
        if isinstance(mode, ValueClip):
            dtypes = {t.name: t.dtype for t in stats.tensors}
            for name, s in chosen.items():
                lo, hi = _value_bounds_of(dtypes[name], mode)
                if s.min_value < lo or s.max_value > hi:
                    file_work[name] = TensorWork(bounds=(lo, hi))
            scales[stats.path] = {}
        else:
            if isinstance(mode, GlobalNormClip):
                file_scales = plan_scales(GlobalNormClip(mode.clip_norm, global_norm), chosen)
            else:
                file_scales = plan_scales(mode, chosen)
            scales[stats.path] = file_scales
            for name, scale in file_scales.items():
                if not np.all(scale == 1.0):
                    file_work[name] = TensorWork(scale=scale)
        work[stats.path] = file_work
    return Plan(mode, work, scales, global_norm)


def _value_bounds_of(dtype: str, mode: ValueClip) -> tuple[float, float]:
    from .core.dtypes import ML_FLOAT_TYPES

    numpy_dtype = next((np.dtype(t) for t in ML_FLOAT_TYPES if np.dtype(t).name == dtype), None)
    if numpy_dtype is None:
        numpy_dtype = np.dtype(dtype.replace(" (big-endian)", ""))
    lo, hi = value_bounds(numpy_dtype, mode.clip_value_min, mode.clip_value_max)
    return float(lo), float(hi)


# --------------------------------------------------------------------------- pass 2


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
        layouts[name] = _storage(info, tensor_axes)
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
                scale = _storage_view(task.scale, reader.tensors[job.name])
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
            target = _storage_view(after.sum_of_squares, reader.tensors[job.name]) \
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


# --------------------------------------------------------------------------- one file


def output_for(path: Path, options: ClipOptions) -> Path:
    """Where clipping ``path`` writes (not checked: see :func:`check_outputs`)."""
    if options.in_place:
        # A symlink stays a symlink: its target is what gets replaced.
        return Path(os.path.realpath(path))
    return Path(options.output) if options.output is not None else default_output(path, options.out_dir)


def check_outputs(outputs: dict[Path, Path], inputs: list[Path]) -> None:
    """Refuse, before anything is written, an output (``outputs`` maps each input to its
    output) that is one of ``inputs`` -- the same file by device and inode, through
    symlinks and hard links -- or that two inputs share. ``--force`` replaces old
    outputs, never an input nor another input's output, so it changes nothing here.
    """
    identities: dict[tuple[int, int], Path] = {}
    for path in inputs:
        try:
            st = os.stat(path)
        except OSError:
            continue  # reported when it is read
        identities.setdefault((st.st_dev, st.st_ino), Path(path))
    claimed: dict[str, Path] = {}
    for source, out in outputs.items():
        try:
            st = os.stat(out)
        except OSError:
            pass
        else:
            replaced = identities.get((st.st_dev, st.st_ino))
            if replaced is not None:
                raise TclipError(f"the output {out} would replace the input {replaced}; nothing was written "
                                 "(--in-place replaces inputs)", source)
        first = claimed.setdefault(os.path.realpath(out), source)
        if first != source and not _same_file(first, source):
            raise TclipError(f"{first} and {source} would both be written to this file; nothing was written "
                             "(clip them into separate folders)", out)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _nonfinite_message(report: FileReport) -> str:
    parts = []
    for t in report.tensors:
        if t.skipped is None and t.nonfinite:
            counts = [f"{n} {label}" for n, label in ((t.nan, "NaN"), (t.inf, "Inf")) if n]
            parts.append(f"{t.name} ({', '.join(counts)})")
    shown = ", ".join(parts[:10]) + (f" and {len(parts) - 10} more" if len(parts) > 10 else "")
    return ("NaN/Inf values in " + shown + "; nothing was written "
            "(--nonfinite propagate clips them as TensorFlow does)")


def start_report(stats: FileStats, mode_name: str, params: dict[str, object]) -> FileReport:
    """The report of one file from its pass 1: every tensor with its skip reason and statistics."""
    report = FileReport(file=stats.path, mode=mode_name, params=params, format=stats.format)
    for entry in stats.tensors:
        tensor = TensorReport(entry.name, list(entry.shape), entry.dtype, entry.nbytes, skipped=entry.skipped)
        s = stats.stats.get(entry.name)
        if s is not None:
            fill_before(tensor, s)
        report.tensors.append(tensor)
    report.others = [OtherReport(o.name, o.kind, o.reason, None if o.shape is None else list(o.shape), o.dtype)
                     for o in stats.others]
    report.bytes_read = stats.bytes_read
    return report


def fill_before(entry: TensorReport, stats: TensorStats) -> None:
    entry.norm = stats.norm
    entry.nan, entry.inf = stats.nan_count, stats.inf_count
    entry.max_abs = stats.max_abs
    if stats.size and stats.count:
        entry.min = stats.min_value if stats.count > stats.nan_count else None
        entry.max = stats.max_value if stats.count > stats.nan_count else None
    if stats.axes is not None:
        entry.slices = int(stats.sum_of_squares.size)
        entry.max_slice_norm = float(np.max(stats.slice_norms(), initial=0.0)) if entry.slices else 0.0


def fill_after(entry: TensorReport, after: TensorStats | None, scale: np.ndarray | None) -> None:
    if after is not None:
        _fill_after_norms(entry, after)
    if scale is not None:
        scale = np.asarray(scale, dtype=np.float64)
        entry.scale = float(np.min(scale)) if scale.size else 1.0
        entry.clipped = bool(np.any(scale != 1.0))
        if scale.ndim:
            entry.slices_clipped = int(np.count_nonzero(scale != 1.0))


def _fill_after_norms(entry: TensorReport, after: TensorStats) -> None:
    entry.norm_after = after.norm
    if after.axes is not None:
        entry.max_slice_norm_after = float(np.max(after.slice_norms(), initial=0.0)) if after.size else 0.0


def finish_report(report: FileReport, stats: FileStats, plan: Plan, rewrite: RewriteResult | None) -> None:
    """Fill the after-columns and totals of a report from the plan and pass 2."""
    entries = {t.name: t for t in report.tensors}
    scales = plan.scales.get(stats.path, {})
    chosen = stats.selected
    for name in chosen:
        entry, before = entries[name], stats.stats[name]
        if rewrite is not None and name in rewrite.after:
            measured = rewrite.after[name]
            fill_after(entry, measured if rewrite.measured else None, scales.get(name))
            if isinstance(plan.mode, ValueClip):
                entry.changed = rewrite.changed[name]
                entry.clipped = entry.changed > 0
        else:
            fill_after(entry, before, scales.get(name))
            if isinstance(plan.mode, ValueClip):
                entry.changed, entry.clipped = 0, False
        if before.axes is not None:
            slice_summary(entry, before, scales.get(name))
    picked = [entries[n] for n in chosen]
    report.global_norm = math.sqrt(math.fsum((t.norm or 0.0) ** 2 for t in picked)) if picked else 0.0
    if all(t.norm_after is not None for t in picked):
        report.global_norm_after = math.sqrt(math.fsum(t.norm_after ** 2 for t in picked)) if picked else 0.0  # type: ignore[operator]
    if rewrite is not None:
        report.bytes_read += rewrite.bytes_read
        report.bytes_written = rewrite.bytes_written
        report.output = rewrite.output
        report.warnings += rewrite.warnings


def refuse_quantized(names: list[str], selection: Selection, path: object) -> None:
    """Refuse to clip a quantized weight (codes plus scale tensors) as if it were plain values.

    Multiplying the codes rounds them again and multiplying codes and scales
    scales the real weight twice: the model would be destroyed. Until tclip
    clips such weights by their scales, a selected code or scale tensor is an error.
    """
    pairs = scale_companions(names)
    hit = [(weight, scales) for weight, scales in pairs.items()
           if any(selection.matches(n) for n in (weight, *scales))]
    if not hit:
        return
    weight, scales = hit[0]
    more = f" (and {len(hit) - 1} more quantized weight(s))" if len(hit) > 1 else ""
    raise UnsupportedError(f"tensor {describe(weight, scales)}{more} is a quantized weight: its real values are "
                           "codes times scales, and clipping codes or scales as plain values would destroy it; "
                           "tclip does not clip quantized weights yet; nothing was written. Leave them out "
                           "with --exclude to clip the rest", path)


def quantized_warning(names: list[str]) -> str | None:
    """The report's word that the norms of quantized weights shown are of their raw codes."""
    pairs = scale_companions(names)
    if not pairs:
        return None
    listing = ", ".join(describe(w, s) for w, s in list(pairs.items())[:3])
    if len(pairs) > 3:
        listing += f" and {len(pairs) - 3} more"
    return (f"{len(pairs)} quantized weight(s) ({listing}): the norms shown are of their raw codes and of "
            "their scale tensors as plain values, not of the real (dequantized) weights")


def header_checks(reader: TensorReader, entries: list[TensorEntry], mode: Mode, options: ClipOptions,
                  path: Path, warnings: list[str]) -> None:
    """What can be refused from the header alone, before any data is read."""
    selection = options.selection
    refuse_quantized(list(reader.tensors), selection, path)
    refused = [info for info in reader.tensors.values()
               if info.refused and selection.matches(info.name) and is_floating(info.dtype)]
    if refused:
        first = refused[0]
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise UnsupportedError(f"tensor {first.name!r}{more}: {first.refused}; nothing was written. "
                               "Leave such tensors out with --exclude to clip the rest", path)
    rank_skips = [e for e in entries if is_rank_skip(e.skipped)]
    if rank_skips:
        listing = ", ".join(f"{e.name} ({e.skipped})" for e in rank_skips[:20])
        if len(rank_skips) > 20:
            listing += f" and {len(rank_skips) - 20} more"
        if options.strict:
            raise TclipError(f"--axes does not fit {len(rank_skips)} tensor(s): {listing}", path)
        if not any(e.skipped is None for e in entries):
            raise TclipError(f"--axes {_axes_text(getattr(mode, 'axes', None))} fits no tensor of the file "
                             f"({listing}); nothing was written", path)
        warnings.append(f"{len(rank_skips)} tensor(s) left unchanged: {listing}")
    for pattern in selection.unmatched(list(reader.tensors)):
        warnings.append(f"pattern {pattern!r} matches no tensor")
    if not any(e.skipped is None for e in entries):
        warnings.append("no floating-point tensor selected; the output is a copy")


def _axes_text(axes: object) -> str:
    if axes is None:
        return ""
    return ",".join(str(a) for a in ([axes] if isinstance(axes, int) else axes))  # type: ignore[union-attr]


def clip_file(path: Path | str, mode: Mode, options: ClipOptions | None = None,
              progress: Progress | None = None) -> FileReport:
    """Clip every selected floating tensor of a file and write the result.

    The composition of the three steps for one file: :func:`file_statistics`,
    :func:`make_plan`, :func:`rewrite_file`.

    Args:
        path: the input file (.npy, .npz, .safetensors, .h5/.hdf5).
        mode: :class:`NormClip`, :class:`AverageNormClip`,
            :class:`GlobalNormClip` or :class:`ValueClip`.
        options: output, selection and policies (:class:`ClipOptions`).
        progress: called with byte counts as work goes on (two passes: twice the file's size).

    Returns:
        The :class:`FileReport`: norms before and after, scales, skips, output.

    Raises:
        TclipError: the file is unreadable or malformed, the output exists, NaN/Inf
            were found under ``nonfinite="error"``, or ``strict`` and a tensor's
            rank cannot take the axes. Nothing is written then.

    Example:
        >>> report = clip_file("grads.npz", NormClip(5.0, axes=1))  # doctest: +SKIP
        >>> report.output, report.global_norm_after  # doctest: +SKIP
    """
    options = options or ClipOptions()
    path = Path(path)
    started = time.perf_counter()
    if isinstance(mode, ValueClip):
        value_bounds(np.dtype(np.float64), mode.clip_value_min, mode.clip_value_max)
    axes = mode.axes if isinstance(mode, NormClip) else None
    budget = options.budget
    with open_reader(path) as reader:
        entries, _ = select(reader, options.selection, axes)
        warnings: list[str] = []
        header_checks(reader, entries, mode, options, path, warnings)
        target = output_for(path, options)
        if not options.in_place:
            check_outputs({path: target}, [path])
        overwrite = options.overwrite or options.in_place
        would_write, exists = target, os.path.lexists(target)
        if options.dry_run:
            target = None
        elif not overwrite and exists:
            raise OutputExistsError("output already exists; pass --force to replace it", target)
        if options.in_place and not options.dry_run:
            links = os.stat(path).st_nlink
            if links > 1:
                warnings.append(f"the input has {links - 1} other hard link(s); --in-place gives this name a new "
                                "file and the other names keep the old data")
        held = HeldTensors(budget.memory // 8)
        stats = file_statistics(reader, selection=options.selection, axes=axes, budget=budget, progress=progress,
                                held=held)
        report = start_report(stats, mode.name, mode_params(mode))
        report.dry_run = options.dry_run
        if options.dry_run:
            report.would_write, report.output_exists = str(would_write), exists
        report.warnings += warnings
        if options.nonfinite == "error" and any(report_entry.nonfinite for report_entry in report.tensors
                                                 if report_entry.skipped is None):
            raise NonFiniteError(_nonfinite_message(report), path)
        plan = make_plan(mode, [stats])
        rewrite = rewrite_file(reader, plan.work[stats.path], target, axes=axes,
                               overwrite=options.overwrite or options.in_place, budget=budget, progress=progress,
                               held=held, drop_nonnumeric=options.drop_nonnumeric,
                               measure_after=options.measure_after)
        finish_report(report, stats, plan, rewrite)
    report.elapsed_s = time.perf_counter() - started
    return report


def report_file(path: Path | str, *, axes: object = None, ord: str = "2", selection: Selection | None = None,
                block_bytes: int | None = None, progress: Progress | None = None, moments: bool = False,
                memory: int = Budget.memory, threads: int = 0) -> FileReport:
    """Read a file and report the norms and statistics of its tensors; writes nothing.

    Args:
        path: the file.
        axes: also compute slice norms along these axes (tensors whose rank
            cannot take them are reported whole, with the reason).
        ord: the norm reported: "2" (L2), "1" or "inf" (largest |x|).
        selection: include/exclude globs.
        moments: also mean, std, zeros and a log2-magnitude histogram.

    Returns:
        A :class:`FileReport` with mode "report"; ``global_norm`` is of that order
        over the floating tensors reported.
    """
    path = Path(path)
    started = time.perf_counter()
    selection = selection or Selection()
    params: dict[str, object] = {"ord": ord}
    if axes is not None:
        params["axes"] = [axes] if isinstance(axes, int) else list(axes)  # type: ignore[call-overload]
    stats = file_statistics(path, selection=selection, axes=axes, track_l1=ord == "1", track_moments=moments,
                            budget=Budget(memory, threads, block_bytes), progress=progress, whole_if_rank_skip=True)
    report = report_from_stats(stats, ord, params, selection)
    report.elapsed_s = time.perf_counter() - started
    return report


def report_from_stats(stats: FileStats, ord: str, params: dict[str, object],
                      selection: Selection | None = None) -> FileReport:
    """The read-only report of one file from its pass 1."""
    report = start_report(stats, "report", params)
    report.ord = ord
    report.metadata = dict(stats.metadata)
    for entry in report.tensors:
        s = stats.stats.get(entry.name)
        if s is None:
            continue
        entry.norm = {"2": s.norm, "1": s.l1_norm if ord == "1" else 0.0, "inf": s.max_abs}[ord]
        if s.nan_count and ord != "2":
            entry.norm = math.nan  # as the L2 norm is, so NaN is never hidden
        if s.moments is not None and not entry.dtype.startswith("complex"):
            entry.mean, entry.std = s.mean, s.std
            entry.zeros = s.moments.zeros
            entry.histogram = s.moments.histogram()
        if entry.dtype.startswith("complex"):
            entry.min = entry.max = None  # complex numbers have no order
        if s.axes is not None:
            slice_summary(entry, s, None)
    # The global norm is over floating tensors (a complex one is measured, not counted).
    counted = [t for t in report.tensors if t.name in stats.stats and (t.skipped is None or is_rank_skip(t.skipped))]
    norms = [t.norm or 0.0 for t in counted]
    if ord == "2":
        report.global_norm = math.sqrt(math.fsum(n * n for n in norms))
    elif ord == "1":
        report.global_norm = math.fsum(norms)
    else:
        report.global_norm = max(norms, default=0.0)
    for pattern in (selection or Selection()).unmatched([t.name for t in report.tensors]):
        report.warnings.append(f"pattern {pattern!r} matches no tensor")
    quantized = quantized_warning([t.name for t in report.tensors])
    if quantized:
        report.warnings.append(quantized)
    return report


def file_info(path: Path | str) -> InfoReport:
    """Names, shapes, dtypes, sizes and metadata from the header alone."""
    path = Path(path)
    with open_reader(path) as reader:
        tensors = [InfoTensor(t.name, list(t.shape), t.dtype_label or dtype_name(t.dtype), t.nbytes, dict(t.attrs),
                              t.refused)
                   for t in reader.tensors.values()]
        others = [OtherReport(o.name, o.kind, o.reason, None if o.shape is None else list(o.shape), o.dtype)
                  for o in reader.others]
        return InfoReport(str(path), reader.format_name, path.stat().st_size, tensors, dict(reader.metadata), others)


__all__ = [
    "ClipOptions",
    "Selection",
    "FileStats",
    "Plan",
    "TensorWork",
    "RewriteResult",
    "file_statistics",
    "make_plan",
    "rewrite_file",
    "clip_file",
    "report_file",
    "file_info",
    "default_output",
    "NormClip",
    "AverageNormClip",
    "GlobalNormClip",
    "ValueClip",
]
