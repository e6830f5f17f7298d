"""Pass 2: write a file again with each planned tensor rewritten (scaled or clamped).

Tensors without work are copied byte for byte where the formats allow; the output
appears atomically, only when everything succeeded."""

from __future__ import annotations

import errno
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..core.kernels import Scratch, clip_unit, scale_unit
from ..core.stats import Axes, TensorStats, UnitResult, kept_index, normalize_axes
from ..core.zeros import counted, counts_flushes, flush_limit, flushed_count, nonzero_count
from ..errors import TclipError, UnsupportedError
from ..formats import TensorReader, TensorWriter, create_writer, open_reader
from ..formats.atomic import identity_of
from ..formats.base import TensorInfo
from ..formats.registry import holds_metadata, output_format
from ..messages import Option
from ..quant.contract import LandingCheck, computing
from ..quant.layout import QuantLayout
from ..quant.view import logical_view, open_logical, stored_reader
from ..text import name_list
from .budget import Budget
from .gate import gate_tolerance
from .passes import Action, Block, HeldTensors, Progress, Walk, run_pass, tensor_walk
from .plan import TensorWork
from .results import Note, NoteKind


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
    warnings: list[Note] = field(default_factory=list)
    measured: bool = True  # the after-statistics were measured
    # Per rewritten 16- or 8-bit float tensor: how many non-zero values the scaling made zero.
    flushed: dict[str, int] = field(default_factory=dict)
    # The output file this pass wrote (tclip.formats.atomic.file_identity): a failed run removes
    # only what it wrote itself, never a file another run put at that name meanwhile.
    written: tuple[int, int, int] | None = None
    # Other files the pass put where nothing was before (a DCP folder's .distcp files), by path:
    # removed with ``output`` by a run that fails or is interrupted after this pass committed.
    also_written: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    # Views overlapping in the output (see FileStats.owned): (sum of squares, sum of |x|) of the
    # stored elements each holds first, read back from the output (None: not measured).
    owned: dict[str, tuple[float, float]] | None = None


def rewrite_file(source: Path | str | TensorReader, work: dict[str, TensorWork], target: Path | None, *,
                 axes: Axes = None, overwrite: bool = False, budget: Budget | None = None,
                 progress: Progress | None = None, held: HeldTensors | None = None,
                 drop_nonnumeric: bool = False, metadata: dict[str, str] | None = None,
                 writer_factory: Callable[..., TensorWriter] | None = None,
                 measure_after: bool = True, commit_marker: Path | None = None,
                 layout: QuantLayout | None = None, expect: tuple[int, int, int] | None = None) -> RewriteResult:
    """Pass 2: write ``source`` to ``target`` with each tensor of ``work`` rewritten.

    Tensors not in ``work`` are copied byte for byte where the formats allow.
    With ``target`` None nothing is written (a dry run computes the after-statistics).
    ``measure_after`` False skips the after-statistics (norms of the values written),
    for callers that show nobody the report. The output appears atomically, only when
    everything succeeded. ``commit_marker``: see :meth:`AtomicOutput.commit`.

    A quantized weight (an encoded tensor) in ``work`` is rescaled by rewriting only
    the stored parts that hold its scales (its encoding's ``rescale`` jobs); its codes
    are copied byte for byte. ``layout``: as for :func:`~tclip.work.statistics.file_statistics`.

    ``expect``: the identity of the file pass 1 measured (:func:`~tclip.formats.atomic.file_identity`);
    the file opened, and the file about to be replaced, must still be that one, else nothing is
    written (another run, or a program, replaced or changed it: its plan is not this file's).
    """
    if isinstance(source, TensorReader):
        return _rewrite(logical_view(source, layout), work, target, axes, overwrite, budget or Budget(), progress,
                        held, drop_nonnumeric, metadata, writer_factory, measure_after, commit_marker, expect)
    with open_logical(source, layout, None if layout is None else str(source)) as reader:
        return _rewrite(reader, work, target, axes, overwrite, budget or Budget(), progress, held,
                        drop_nonnumeric, metadata, writer_factory, measure_after, commit_marker, expect,
                        measured=Path(source))


def check_same(path: Path | str, expect: tuple[int, int, int] | None) -> None:
    """Refuse a file that is not the one pass 1 measured (see :func:`rewrite_file`'s ``expect``)."""
    if expect is not None and identity_of(path) != expect:
        raise TclipError("was replaced or changed since tclip measured it (by another run or program); its plan "
                         "is not this file's, so nothing was written to it", path)


def carried_loss(reader: TensorReader, target: Path) -> list[str]:
    """What writing ``reader`` to ``target`` (another format) cannot carry, for people."""
    kind = output_format(target, reader) or reader.format_name
    if kind == reader.format_name:
        return []
    lost = [f"{o.name} ({o.kind})" for o in reader.others]
    lost += [f"{t.name} ({t.dtype} is not numeric)" for t in reader.tensors.values() if not t.numeric]
    lost += reader.lost_in_conversion()
    if reader.metadata and not holds_metadata(kind):
        keys = name_list([repr(str(key)) for key in list(reader.metadata)[:4]], 4, total=len(reader.metadata))
        lost.append(f"the file's metadata ({'key' if len(reader.metadata) == 1 else 'keys'} {keys})")
    return lost


_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def _rewrite(reader: TensorReader, work: dict[str, TensorWork], target: Path | None, axes: Axes,
             overwrite: bool, budget: Budget, progress: Progress | None, held: HeldTensors | None,
             drop_nonnumeric: bool, metadata: dict[str, str] | None,
             writer_factory: Callable[..., TensorWriter] | None, measure_after: bool = True,
             commit_marker: Path | None = None, expect: tuple[int, int, int] | None = None,
             measured: Path | None = None) -> RewriteResult:
    # ``measured``: the path pass 1 took the identity of (a DCP folder's reader is named by the
    # folder, but what pass 1 measured, and what must not change, is its .metadata)
    started = time.perf_counter()
    measured = reader.path if measured is None else measured
    check_same(measured, expect)  # (after the reader opened it: what it reads is that file)
    if reader.damage is not None:
        raise TclipError(reader.damage, reader.path)
    result = RewriteResult(str(reader.path), None if target is None else str(target), {}, {},
                           measured=measure_after)
    stored = stored_reader(reader)  # what the file holds: what the writer writes
    tensors = list(stored.tensors.values())
    if target is not None:
        lost = carried_loss(stored, target)
        if lost:
            listing = ", ".join(lost[:8]) + (f" and {len(lost) - 8} more" if len(lost) > 8 else "")
            if not drop_nonnumeric:
                raise UnsupportedError((f"{output_format(target, stored) or 'the output format'} cannot hold "
                                        f"{listing}; nothing was written (", Option.DROP_NONNUMERIC,
                                        " drops them with a warning)"), reader.path)
            result.warnings.append(Note(NoteKind.DROPPED, f"dropped what the output format cannot hold: {listing}"))
            tensors = [t for t in tensors if t.numeric and t.encoding is None]  # (GGUF blocks: no other format)
    writer: TensorWriter | None = None
    if target is not None:
        factory = writer_factory or create_writer
        writer = factory(target, stored, tensors=tensors if len(tensors) != len(stored.tensors) else None,
                         overwrite=overwrite, rewritten=_rewritten(reader, stored, work), metadata=metadata)
    written = {t.name for t in tensors}
    lossy = {name: text for name, text in reader.lossy_filters().items() if name in work and name in written}
    if target is not None and (output_format(target, reader) or reader.format_name) != reader.format_name:
        lossy = {}  # a conversion writes new datasets, without the source's filters
    try:
        _run_rewrite(reader, writer, work, axes, budget, progress, held, written, result, measure_after)
        if writer is not None and target is not None:  # (a writer is made only for a target)
            check_same(measured, expect)
            writer.commit(commit_marker)
            result.written = getattr(getattr(writer, "output", None), "written", None)
            result.also_written = writer.also_written()
            result.bytes_written = writer.written_size()
            if lossy and measure_after:
                result.after.update(_measure_written(target, {n: result.after[n].axes for n in lossy}, budget))
    except BaseException as error:
        if writer is not None:
            writer.abort()
        if isinstance(error, OSError) and error.errno in _WRITE_ERRNOS and target is not None:
            # Name where it could not write (the error itself names no file).
            raise TclipError(f"cannot write {target}: {error.strerror or error}; nothing was written",
                             reader.path) from None
        raise
    if lossy:
        result.warnings.append(_lossy_note(lossy, written=target is not None))
    result.elapsed_s = time.perf_counter() - started
    return result


def _lossy_note(lossy: dict[str, str], written: bool) -> Note:
    shown = name_list(list(lossy))
    filters = ", ".join(sorted(set(lossy.values())))
    if written:
        return Note(NoteKind.LOSSY, f"{shown}: stored through a lossy filter ({filters}), so the file holds other "
                                    "values than those computed; the norms after were measured from the file")
    return Note(NoteKind.LOSSY, f"{shown}: stored through a lossy filter ({filters}); a rewrite would hold other "
                                "values than those computed, so the norms after shown here are not what the "
                                "file would hold")


def _measure_written(target: Path, axes: dict[str, tuple[int, ...] | None], budget: Budget) -> dict[str, TensorStats]:
    """Statistics of tensors as the output holds them (read back after a lossy filter)."""
    with open_reader(target) as reader:
        stats = {name: TensorStats.empty(reader.tensors[name].shape, tensor_axes)
                 for name, tensor_axes in axes.items()}

        def work(block: Block, scratch: Scratch) -> list[UnitResult]:
            return [stats[block.walk.name].reduce(unit, scratch, block.walk.axes) for _, (unit,) in block.units()]

        def merge(block: Block, results: list[UnitResult]) -> None:
            walk, tensor_stats = block.walk, stats[block.walk.name]
            target_sums = walk.view(tensor_stats.sum_of_squares) if tensor_stats.axes is not None else None
            for k, unit_result in zip(range(block.first, block.stop), results):
                tensor_stats.add_unit(unit_result, walk.grid.index(k) if walk.axes is not None else (), target_sums,
                                      walk.axes)

        run_pass([tensor_walk(reader, name, axes=tensor_axes) for name, tensor_axes in axes.items()], budget,
                 work, merge)
    return stats


def _rewritten(reader: TensorReader, stored: TensorReader, work: dict[str, TensorWork]) -> set[str]:
    """The stored tensors written anew: plain tensors with work, and the scale parts of
    encoded tensors with work that this file holds."""
    names = set()
    for name in work:
        info = reader.tensors[name]
        if info.encoding is None:
            names.add(name)
        else:
            names.update(p for p in info.encoding.summary.rescaled if p in stored.tensors)
    return names


def _encoded_steps(reader: TensorReader, writer: TensorWriter | None, work: dict[str, TensorWork], axes: Axes,
                   result: RewriteResult, measure_after: bool) -> tuple[dict[str, Action], list[Walk]]:
    """For each encoded tensor with work: the jobs that rewrite its scale parts (by stored
    name) and the walk measuring what they leave (its after-statistics)."""
    jobs: dict[str, Action] = {}
    walks: list[Walk] = []
    for name, task in work.items():
        info = reader.tensors[name]
        if info.encoding is None:
            continue
        if task.scale is None:
            raise UnsupportedError(f"tensor {name!r} is quantized: its values cannot be clamped without "
                                   "requantizing its codes; nothing was written", reader.path)
        factor = np.asarray(task.scale, np.float64)
        tensor_axes = normalize_axes(axes, len(info.shape)) if factor.ndim else None
        if writer is not None:
            try:
                for part, job in computing(reader, info).rescale(reader, writer, info, factor):
                    jobs[part] = Action(part, job)
            except ValueError as error:
                raise UnsupportedError(f"tensor {name!r}: {error}; nothing was written", reader.path) from None
        result.after[name] = TensorStats.empty(info.shape, tensor_axes)
        result.changed[name] = 0
        walk = tensor_walk(reader, name, axes=tensor_axes, factor=factor)
        if measure_after or getattr(walk.reducer, "landing", None) is not None:  # (its check needs them)
            walks.append(walk)
        else:
            result.after[name].count = info.size
    return jobs, walks


def _check_encoded(reader: TensorReader, walks: list[Walk], result: RewriteResult) -> None:
    """After the walks measuring rescaled weights, before anything is committed: refuse a
    rescale whose rounded scales miss the factor by more than their dtype's gate tolerance,
    and count the values it flushed to zero."""
    for walk in walks:
        if not isinstance(walk.reducer, LandingCheck):
            continue
        walk.reducer.check_landing(gate_tolerance(reader.tensors[walk.name].dtype), reader.path)
        flushed = walk.reducer.flushed()
        if flushed:
            result.flushed[walk.name] = flushed


def _start_after(name: str, info: TensorInfo, task: TensorWork, axes: Axes, result: RewriteResult,
                 flushing: dict[str, int | None]) -> tuple[int, ...] | None:
    """Start ``name``'s after-statistics and its flush count (in ``flushing``); the axes its slices keep."""
    tensor_axes = normalize_axes(axes, len(info.shape)) if task.scale is not None and task.scale.ndim else None
    result.after[name] = TensorStats.empty(info.shape, tensor_axes)
    result.changed[name] = 0
    if task.scale is not None and task.bounds is None and info.encoding is None \
            and counted(info.dtype):
        result.flushed[name] = 0
        smallest = float(np.min(task.scale)) if np.size(task.scale) else 1.0
        if counts_flushes(info.dtype, smallest):
            # One factor: the codes that flush are a range, counted once before scaling;
            # per-slice factors: the non-zero values before and after.
            flushing[name] = flush_limit(info.dtype, smallest) if task.scale.ndim == 0 else None
    return tensor_axes


def _run_rewrite(reader: TensorReader, writer: TensorWriter | None, work: dict[str, TensorWork], axes: Axes,
                 budget: Budget, progress: Progress | None, held: HeldTensors | None, written: set[str],
                 result: RewriteResult, measure_after: bool = True) -> None:
    steps: list[Walk | Action] = []
    # Tensors whose factors may flush values to zero: the range of codes that flush (see
    # tclip.core.zeros.flush_limit), or None to count the non-zero values before and after.
    flushing: dict[str, int | None] = {}
    stored = stored_reader(reader)
    jobs, after_walks = _encoded_steps(reader, writer, work, axes, result, measure_after)
    for name, info in stored.tensors.items():
        if name in jobs:
            if name in written:
                steps.append(jobs[name])
            continue
        task = work.get(name)
        if task is None or name not in reader.tensors or reader.tensors[name].encoding is not None:
            steps.append(Action(name, functools.partial(_copy, stored, writer, name, written)))
            continue
        tensor_axes = _start_after(name, info, task, axes, result, flushing)
        steps.append(tensor_walk(reader, name, axes=tensor_axes, held=held,
                                 writer=writer if writer is not None and name in written else None))
    steps += after_walks

    def rewrite(block: Block, scratch: Scratch) -> tuple[list[UnitResult], int, int]:
        walk = block.walk
        task, after = work[walk.name], result.after[walk.name]
        if walk.reducer is not None:  # an encoded tensor's after-statistics: its scales were rewritten
            return walk.reducer.reduce(block.data[0], walk.grid, block.first, block.stop, after, scratch)[0], 0, 0
        scale = walk.view(task.scale) if task.scale is not None and task.scale.ndim else None
        count_flushes = walk.name in flushing
        limit = flushing.get(walk.name)
        results, changed, flushed = [], 0, 0
        wide: np.ndarray | None
        for k, (unit,) in block.units():
            if task.bounds is not None:
                count, wide = clip_unit(unit, task.bounds[0], task.bounds[1], scratch)
                changed += count
                if measure_after:
                    results.append(after.reduce(unit, scratch, walk.axes, wide, extremes=False))
                continue
            nonzero = 0
            if count_flushes:
                if limit is not None:
                    flushed += flushed_count(unit, limit, scratch.bits)
                else:
                    nonzero = nonzero_count(unit, scratch.bits)
            if scale is not None:
                wide = scale_unit(unit, scale[kept_index(walk.grid.index(k), unit.ndim, walk.axes)], scratch)
            else:
                assert task.scale is not None, walk.name  # (without bounds, the plan gives a scale)
                wide = scale_unit(unit, float(task.scale), scratch)
            if count_flushes and limit is None:
                flushed += nonzero - nonzero_count(unit, scratch.bits)
            if measure_after:
                results.append(after.reduce(unit, scratch, walk.axes, wide, extremes=False))
        return results, changed, flushed

    def merge(block: Block, outcome: tuple[list[UnitResult], int, int]) -> None:
        results, changed, flushed = outcome
        walk = block.walk
        after = result.after[walk.name]
        target = walk.view(after.sum_of_squares) if after.axes is not None else None
        for k, unit_result in zip(range(block.first, block.stop), results):
            after.add_unit(unit_result, walk.grid.index(k) if walk.axes is not None else (), target, walk.axes)
        if not measure_after and walk.reducer is None:
            after.count += block.end - block.start
        result.changed[walk.name] += changed
        if flushed:
            result.flushed[walk.name] += flushed

    result.bytes_read += run_pass(steps, budget, rewrite, merge, progress=progress,
                                  total=os.stat(reader.path).st_size)
    _check_encoded(reader, after_walks, result)


def _copy(reader: TensorReader, writer: TensorWriter | None, name: str, written: set[str]) -> int:
    """A tensor without work, copied as it is (byte for byte where the formats allow)."""
    if writer is not None and name in written:
        writer.copy_tensor(reader, name)
    return reader.tensors[name].nbytes
