"""Pass 1: the statistics of one file's selected tensors, block by block.

The result, :class:`FileStats`, is plain and picklable: it is what crosses a
process or machine boundary when a tensor set is measured on many workers, and
its :class:`~tclip.core.stats.TensorStats` merge exactly."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.exact import ExactSum
from ..core.kernels import Scratch
from ..core.stats import TensorStats, UnitResult
from ..errors import TclipError
from ..formats import SharedElements, TensorInfo, TensorReader
from ..messages import Option
from ..quant.codes import Findings
from ..quant.layout import QuantLayout
from ..quant.view import logical_view, open_logical
from .budget import Budget
from .passes import Block, HeldTensors, Progress, run_pass, tensor_walk
from .selection import Selection, SkipKind, TensorEntry, is_rank_skip, select


@dataclass
class FileStats:
    """Pass 1 of one file: its tensors, the statistics of the selected ones, and what is not a tensor.

    Plain and picklable: this is what crosses a process or machine boundary.
    ``stats`` holds one :class:`TensorStats` per tensor that was read (the
    selected ones; for the report also those whose rank cannot take the axes,
    reduced as a whole). ``findings`` holds, per encoded tensor (a quantized weight),
    what its stored parts held (NaN codes, NaN/Inf/zero scales and where).
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
    overlaps: list[tuple[str, str, bool]] = field(default_factory=list)  # tensors sharing bytes (tied)
    findings: dict[str, Findings] = field(default_factory=dict)
    # The file pass 1 read (tclip.formats.atomic.file_identity), for pass 2 to check it still is
    # that file; set by the tasks of a tensor set.
    identity: tuple[int, int, int] | None = None
    # The global scale of each quantized weight with one that the selection leaves out: a fused
    # group (q/k/v sharing one NVFP4 global scale) is clipped whole or not at all.
    global_scales: dict[str, float] = field(default_factory=dict)
    # What is not a tensor, of a type tclip cannot read, that the selection takes: skipped, never measured.
    unmeasured_others: list[str] = field(default_factory=list)
    # how the tensors counted in a global norm share stored elements, and for those of its
    # groups, (sum of squares, sum of |x|) of the stored elements each is the first to hold
    shared: SharedElements = field(default_factory=SharedElements)
    owned: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def selected(self) -> list[str]:
        return [t.name for t in self.tensors if t.skipped is None]

    def counted_sum_of_squares(self, name: str) -> float:
        """The tensor's part of a global norm's sum of squares: each stored element once (a tensor
        tied to another, or part of it, adds nothing; one of a group adds the elements it holds first)."""
        if self.shared.counted_elsewhere(name) is not None:
            return 0.0
        if name in self.owned:
            return self.owned[name][0]
        return self.stats[name].total_sum_of_squares


def owned_sums(reader: TensorReader, shared: SharedElements) -> tuple[dict[str, tuple[float, float]], int]:
    """(sum of squares, sum of non-NaN ``|x|``) of the stored elements each tensor of ``shared``'s
    groups is the first to hold, read from ``reader``; and the bytes read."""
    squares: dict[str, ExactSum] = {}
    absolute: dict[str, ExactSum] = {}
    read = 0
    for group in shared.groups:
        for name in group:
            squares[name], absolute[name] = ExactSum(), ExactSum()
        for name, values in reader.read_owned(group):
            wide = values.astype(np.float64)
            read += values.nbytes
            squares[name].add(float(np.dot(wide, wide)))
            absolute[name].add(float(np.nansum(np.abs(wide))))
    return {n: (squares[n].value, absolute[n].value) for n in squares}, read


def _same_sums(stats: dict[str, TensorStats], shared: SharedElements, dtypes: dict[str, Any]) -> None:
    """A tensor holding exactly another's stored elements (a transpose) takes that one's sums:
    summed in its own order they could differ in the last bit, and give another factor."""
    for name, first in shared.tied.items():
        a, b = stats.get(first), stats.get(name)
        if a is None or b is None or a.axes is not None or b.axes is not None or dtypes[name] != dtypes[first]:
            continue
        b._total = a._total.copy()
        b.sum_of_squares = np.asarray(b._total.value)
        b._abs_total = a._abs_total.copy()
        b.sum_abs = b._abs_total.value


def _check_slice_memory(infos: list[tuple[TensorInfo, tuple[int, ...] | None]], budget: Budget,
                        path: object) -> None:
    total = 0
    for info, axes in infos:
        if axes is None or info.size == 0:
            continue
        slices = math.prod(n for i, n in enumerate(info.shape) if i not in axes)
        total += slices * 16  # a float64 sum and a float64 scale per slice
        if total > budget.slice_bytes:
            raise TclipError((f"tensor {info.name!r}: per-slice statistics of {slices:,} slices need "
                              f"{total / 2**20:.0f} MiB, more than ", Option.MEMORY, " allows for them "
                              f"({budget.slice_bytes / 2**20:.0f} MiB); raise ", Option.MEMORY), path)


def file_statistics(source: Path | str | TensorReader, *, selection: Selection | None = None, axes: object = None,
                    track_l1: bool = False, track_moments: bool = False, budget: Budget | None = None,
                    progress: Progress | None = None, whole_if_rank_skip: bool = False,
                    held: HeldTensors | None = None, layout: QuantLayout | None = None) -> FileStats:
    """Pass 1: statistics of one file's selected tensors, block by block (:func:`tclip.work.passes.run_pass`).

    Args:
        source: a path, or a reader already open.
        selection: include/exclude globs; only floating tensors are read.
        axes: reduce per slice along these axes (tensors whose rank cannot take
            them are skipped, or with ``whole_if_rank_skip`` reduced as a whole).
        track_l1, track_moments: also the L1 norm / mean, zeros and histogram.
        budget: memory and threads (:class:`tclip.work.budget.Budget`).
        progress: called with byte counts; one pass advances it by the file's size.
        layout: the quantized weights of the set this file belongs to (None: detected
            from the file and the config beside it); see :mod:`tclip.quant.layout`.

    Returns:
        A :class:`FileStats`, identical to the last bit for any budget.
    """
    if isinstance(source, TensorReader):
        return _statistics(logical_view(source, layout), selection or Selection(), axes, track_l1, track_moments,
                           budget or Budget(), progress, whole_if_rank_skip, held)
    with open_logical(source, layout, None if layout is None else str(source)) as reader:
        return _statistics(reader, selection or Selection(), axes, track_l1, track_moments, budget or Budget(),
                           progress, whole_if_rank_skip, held)


def _statistics(reader: TensorReader, selection: Selection, axes: object, track_l1: bool, track_moments: bool,
                budget: Budget, progress: Progress | None, whole_if_rank_skip: bool,
                held: HeldTensors | None) -> FileStats:
    started = time.perf_counter()
    path = reader.path
    if reader.damage is not None:
        raise TclipError(reader.damage, path)
    entries, to_read = select(reader, selection, axes, whole_if_rank_skip)
    _check_slice_memory([(reader.tensors[n], a) for n, a in to_read.items()], budget, path)
    stats = {name: TensorStats.empty(reader.tensors[name].shape, a, track_l1=track_l1,
                                     track_moments=track_moments) for name, a in to_read.items()}
    size = os.stat(path).st_size
    result = FileStats(str(path), reader.format_name, size, entries, stats, list(reader.others),
                       dict(reader.metadata), overlaps=[tuple(o) for o in reader.overlaps()])
    result.global_scales = _left_out_global_scales(reader, entries)
    result.unmeasured_others = [o.name for o in reader.others if o.unreadable_type and selection.matches(o.name)]
    walks = [tensor_walk(reader, name, axes=stats[name].axes) for name in to_read]

    def work(block: Block, scratch: Scratch) -> tuple[list[UnitResult], Findings | None]:
        tensor_stats, walk = stats[block.walk.name], block.walk
        if walk.reducer is not None:  # an encoded tensor: its own closed form per unit
            return walk.reducer.reduce(block.data[0], walk.grid, block.first, block.stop, tensor_stats, scratch)
        return [tensor_stats.reduce(unit, scratch, walk.axes) for _, (unit,) in block.units()], None

    def merge(block: Block, outcome: tuple[list[UnitResult], Findings | None]) -> None:
        results, found = outcome
        walk = block.walk
        if found is not None:
            result.findings.setdefault(walk.name, Findings(found.codes, found.shape)).merge(found)
        tensor_stats = stats[walk.name]
        target = walk.view(tensor_stats.sum_of_squares) if tensor_stats.axes is not None else None
        for k, unit_result in zip(range(block.first, block.stop), results):
            tensor_stats.add_unit(unit_result, walk.grid.index(k) if walk.axes is not None else (), target,
                                  walk.axes)

    result.bytes_read = run_pass(walks, budget, work, merge, keep=held, progress=progress, total=size)
    counted = [e.name for e in entries if e.name in to_read and (e.skipped is None or is_rank_skip(e.skipped))]
    result.shared = reader.shared_elements(counted)
    if result.shared.groups:
        result.owned, extra = owned_sums(reader, result.shared)
        result.bytes_read += extra
    _same_sums(stats, result.shared, {e.name: e.dtype for e in entries})
    result.elapsed_s = time.perf_counter() - started
    return result


def _left_out_global_scales(reader: TensorReader, entries: list[TensorEntry]) -> dict[str, float]:
    """The global scale of every quantized weight the selection leaves out that has one (one value each)."""
    found = {}
    for entry in entries:
        if entry.encoding is None or entry.skipped is None or entry.skipped.kind is not SkipKind.NOT_SELECTED:
            continue
        part = next((p for p in entry.encoding.parts if p[1] == "global scale"), None)
        if part is not None and math.prod(part[3]) == 1:
            found[entry.name] = float(np.asarray(reader.read_part(part[0], 0, 1)).astype(np.float64).reshape(-1)[0])
    return found
