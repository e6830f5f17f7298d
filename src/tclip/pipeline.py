"""The work on one file: pass 1 (statistics), the plan, pass 2 (the rewrite).

These functions are the library behind every command: ``clip_file`` clips a
file and returns its report, ``report_file`` only reads, ``file_info`` reads the
header alone. They know formats only through the reader/writer protocol and
clipping only through :mod:`tclip.stats` and :mod:`tclip.plan`.
"""

from __future__ import annotations

import fnmatch
import math
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .dtypes import dtype_name, is_floating
from .errors import NonFiniteError, TclipError, UnsupportedError
from .formats import (
    DEFAULT_BLOCK_BYTES,
    TensorInfo,
    TensorReader,
    TensorWriter,
    create_writer,
    open_reader,
)
from .plan import (
    AverageNormClip,
    GlobalNormClip,
    Mode,
    NormClip,
    ValueClip,
    apply_scale,
    clip_values,
    plan_scales,
    scale_for_piece,
    stats_axes,
    value_bounds,
)
from .report import FileReport, InfoReport, InfoTensor, TensorReport
from .stats import TensorStats

Progress = Callable[[int], None]

# A tensor up to this size (one block) is read once and kept in memory between
# its two passes; a larger one is read twice, the second time from the page
# cache as a rule. Holding larger tensors measured slower: fresh multi-MiB
# buffers cost page faults on every tensor.
IN_MEMORY_TENSOR_BYTES = DEFAULT_BLOCK_BYTES


@dataclass(frozen=True)
class Selection:
    """Which tensors to work on, by shell-style globs over their names."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def matches(self, name: str) -> bool:
        if self.include and not any(fnmatch.fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)


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
    """

    output: Path | None = None
    out_dir: Path | None = None
    in_place: bool = False
    overwrite: bool = False
    selection: Selection = field(default_factory=Selection)
    nonfinite: str = "error"
    strict: bool = False
    dry_run: bool = False
    block_bytes: int = DEFAULT_BLOCK_BYTES


def default_output(path: Path, out_dir: Path | None = None) -> Path:
    """``grads.npz`` -> ``grads.clipped.npz`` beside it, or ``out_dir/grads.npz``."""
    path = Path(path)
    if out_dir is not None:
        return Path(out_dir) / path.name
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


def _skip_reason(info: TensorInfo, selection: Selection, axes: object = None) -> str | None:
    """Why a tensor is left as it is (None: it is worked on). Every mode and the
    report select the same tensors: floating ones, matching the globs, whose rank
    can take the axes."""
    if not selection.matches(info.name):
        return "not selected"
    if info.refused:
        return info.refused
    if not info.numeric:
        return f"{info.dtype} is not numeric"
    if not is_floating(info.dtype):
        return f"{dtype_name(info.dtype)} is not floating-point"
    return axes_problem(len(info.shape), axes)


def _start_report(reader: TensorReader, path: Path, mode_name: str, params: dict[str, object]) -> FileReport:
    report = FileReport(file=str(path), mode=mode_name, params=params, format=reader.format_name)
    for info in reader.tensors.values():
        report.tensors.append(TensorReport(info.name, list(info.shape), dtype_name(info.dtype), info.nbytes))
    return report


def tensor_statistics(reader: TensorReader, name: str, axes: object = None, *,
                      block_bytes: int = DEFAULT_BLOCK_BYTES, progress: Progress | None = None,
                      track_l1: bool = False) -> TensorStats:
    """Pass 1 for one tensor: statistics accumulated block by block."""
    info = reader.tensors[name]
    stats = TensorStats.empty(info.shape, axes, track_l1=track_l1)
    scratch = bytearray(min(block_bytes, info.nbytes))
    for index, piece in reader.pieces(name, block_bytes, scratch):
        stats.add(piece, index)
        if progress is not None:
            progress(piece.nbytes)
    return stats


def _fill_before(entry: TensorReport, stats: TensorStats) -> None:
    entry.norm = stats.norm
    entry.nan, entry.inf = stats.nan_count, stats.inf_count
    entry.max_abs = stats.max_abs
    if stats.axes is not None:
        entry.slices = int(stats.sum_of_squares.size)
        entry.max_slice_norm = float(np.max(stats.slice_norms(), initial=0.0)) if entry.slices else 0.0


def _fill_after(entry: TensorReport, after: TensorStats, scale: np.ndarray | None) -> None:
    entry.norm_after = after.norm
    if after.axes is not None:
        entry.max_slice_norm_after = float(np.max(after.slice_norms(), initial=0.0)) if after.size else 0.0
    if scale is not None:
        scale = np.asarray(scale, dtype=np.float64)
        entry.scale = float(np.min(scale)) if scale.size else 1.0
        entry.clipped = bool(np.any(scale != 1.0))
        if scale.ndim:
            entry.slices_clipped = int(np.count_nonzero(scale != 1.0))


class _Rewrite:
    """Pass 2: read blocks, transform them, write them, and gather the after-statistics.

    Writing happens on one background thread, in submission order, so the copy
    into the page cache overlaps the next block's arithmetic (NumPy and file
    writes release the GIL). Two output buffers alternate: a buffer is reused
    only once the write that read from it has finished.
    """

    def __init__(self, reader: TensorReader, writer: TensorWriter | None, block_bytes: int,
                 progress: Progress | None) -> None:
        self.reader, self.writer = reader, writer
        self.block_bytes, self.progress = block_bytes, progress
        self.bytes_read = 0
        self.read_buffer = bytearray(block_bytes)  # consumed before the next read
        self.out_buffers = [bytearray(block_bytes), bytearray(block_bytes)]
        self._writes: list[Future | None] = [None, None]  # the write using each buffer
        self._turn = 0
        self._last: Future | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tclip-writer") if writer else None

    def blocks(self, name: str) -> Iterable:
        if self.writer is not None:
            return self.writer.blocks(name, self.block_bytes)
        return self.reader.blocks(name, self.block_bytes)

    def _submit(self, function: Callable[..., None], *args: object) -> Future:
        assert self._pool is not None
        self._last = self._pool.submit(function, *args)
        return self._last

    def tensor(self, name: str,
               transform: Callable[[tuple, np.ndarray, TensorStats, bytearray], np.ndarray],
               axes: object = None, held: np.ndarray | None = None) -> TensorStats:
        """Rewrite one tensor; ``transform(index, piece, after, buffer)`` returns the
        new block (possibly a view of ``buffer``) and adds its statistics to ``after``."""
        info = self.reader.tensors[name]
        after = TensorStats.empty(info.shape, axes)
        for index in self.blocks(name):
            if held is not None:
                piece = held[index]
            else:
                piece = self.reader.read(name, index, self.read_buffer)
                self.bytes_read += piece.nbytes
                if self.progress is not None:
                    self.progress(piece.nbytes)
            slot = self._turn % 2
            self._turn += 1
            pending = self._writes[slot]
            if pending is not None:
                pending.result()  # the buffer is free again (and a write error surfaces here)
            out = transform(index, piece, after, self.out_buffers[slot])
            if self.writer is not None:
                self._writes[slot] = self._submit(self.writer.write, name, index, out)
        return after

    def copy(self, name: str) -> None:
        # On this thread, after the pending writes: copying reads the source, and
        # a reader (a zip member stream) is not to be shared between threads.
        if self.writer is not None:
            self._drain()
            self.writer.copy_tensor(self.reader, name, self.block_bytes)
            if self.progress is not None:
                self.progress(self.reader.tensors[name].nbytes)

    def _drain(self) -> None:
        for future in (*self._writes, self._last):
            if future is not None:
                future.result()
        self._writes, self._last = [None, None], None

    def finish(self) -> None:
        """Wait for every write; re-raise the first error."""
        if self._pool is None:
            return
        try:
            self._drain()
        finally:
            self._pool.shutdown(wait=True)
            self._pool = None

    def cancel(self) -> None:
        """Stop writing (after an error elsewhere); the output is being thrown away."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _resolve_output(path: Path, options: ClipOptions) -> Path:
    if options.in_place:
        return path
    out = Path(options.output) if options.output is not None else default_output(path, options.out_dir)
    if out.exists() and out.resolve() == path.resolve():
        raise TclipError("the output would replace the input; use --in-place for that", path)
    return out


def _nonfinite_message(report: FileReport) -> str:
    parts = []
    for t in report.tensors:
        if t.skipped is None and t.nonfinite:
            counts = [f"{n} {label}" for n, label in ((t.nan, "NaN"), (t.inf, "Inf")) if n]
            parts.append(f"{t.name} ({', '.join(counts)})")
    return ("NaN/Inf values in " + ", ".join(parts) + "; nothing was written "
            "(--nonfinite propagate clips them as TensorFlow does)")


def clip_file(path: Path | str, mode: Mode, options: ClipOptions | None = None,
              progress: Progress | None = None) -> FileReport:
    """Clip every selected floating tensor of a file and write the result.

    Args:
        path: the input file (.npy, .npz, .safetensors, .h5/.hdf5).
        mode: :class:`NormClip`, :class:`AverageNormClip`,
            :class:`GlobalNormClip` or :class:`ValueClip`.
        options: output, selection and policies (:class:`ClipOptions`).
        progress: called with the number of bytes read, as work goes on.

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
    with open_reader(path) as reader:
        report = _start_report(reader, path, mode.name, mode_params(mode))
        report.dry_run = options.dry_run
        entries = {t.name: t for t in report.tensors}
        selected = []
        for info in reader.tensors.values():
            reason = _skip_reason(info, options.selection, mode.axes if isinstance(mode, NormClip) else None)
            entries[info.name].skipped = reason
            if reason is None:
                selected.append(info.name)
        refused = [info for info in reader.tensors.values()
                   if info.refused and options.selection.matches(info.name) and is_floating(info.dtype)]
        if refused:
            first = refused[0]
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            raise UnsupportedError(f"tensor {first.name!r}{more}: {first.refused}; nothing was written. "
                                   "Leave such tensors out with --exclude to clip the rest", path)
        rank_skips = [t for t in report.tensors if t.skipped and t.skipped.startswith(("rank ", "axes "))]
        if rank_skips:
            listing = ", ".join(f"{t.name} ({t.skipped})" for t in rank_skips)
            if options.strict:
                raise TclipError(f"--axes does not fit {len(rank_skips)} tensor(s): {listing}", path)
            report.warnings.append(f"{len(rank_skips)} tensor(s) left unchanged: {listing}")
        if not selected:
            report.warnings.append("no floating-point tensor selected; the output is a copy")

        writer = None
        if not options.dry_run:
            out = _resolve_output(path, options)
            writer = create_writer(out, reader, overwrite=options.overwrite or options.in_place)
            report.output = str(out)
        rewrite = _Rewrite(reader, writer, options.block_bytes, progress)
        refuse_nonfinite = options.nonfinite == "error"
        try:
            if isinstance(mode, GlobalNormClip):
                _clip_global(reader, mode, selected, entries, rewrite, refuse_nonfinite, report)
            else:
                _clip_per_tensor(reader, mode, selected, entries, rewrite, refuse_nonfinite, report)
            rewrite.finish()
            if refuse_nonfinite and any(entries[n].nonfinite for n in selected):
                raise NonFiniteError(_nonfinite_message(report), path)
            if writer is not None:
                writer.commit()
                report.bytes_written = os.stat(report.output).st_size if report.output else 0
        except BaseException:
            rewrite.cancel()
            if writer is not None:
                writer.abort()
            report.output = None
            raise
        report.bytes_read = rewrite.bytes_read
        _global_norms(report, selected)
    report.elapsed_s = time.perf_counter() - started
    return report


def _global_norms(report: FileReport, selected: list[str]) -> None:
    entries = {t.name: t for t in report.tensors}
    chosen = [entries[n] for n in selected]
    report.global_norm = math.sqrt(math.fsum((t.norm or 0.0) ** 2 for t in chosen)) if chosen else 0.0
    if all(t.norm_after is not None for t in chosen):
        report.global_norm_after = math.sqrt(math.fsum(t.norm_after ** 2 for t in chosen)) if chosen else 0.0  # type: ignore[operator]


def _clip_global(reader: TensorReader, mode: GlobalNormClip, selected: list[str], entries: dict[str, TensorReport],
                 rewrite: _Rewrite, refuse_nonfinite: bool, report: FileReport) -> None:
    stats = {}
    for name in selected:
        stats[name] = tensor_statistics(reader, name, block_bytes=rewrite.block_bytes, progress=rewrite.progress)
        rewrite.bytes_read += reader.tensors[name].nbytes
        _fill_before(entries[name], stats[name])
    if refuse_nonfinite and any(s.nonfinite_count for s in stats.values()):
        return  # clip_file raises, naming every tensor
    scales = plan_scales(mode, stats)
    for name in reader.tensors:
        if name not in stats:
            rewrite.copy(name)
            continue
        scale = scales[name]
        if np.all(scale == 1.0):  # nothing to change: copy the bytes as they are
            rewrite.copy(name)
            _fill_after(entries[name], stats[name], scale)
            continue
        after = rewrite.tensor(name, lambda index, piece, stats, buffer, s=scale: apply_scale(
            piece, s, buffer, after=stats, index=index))
        _fill_after(entries[name], after, scale)


def _clip_per_tensor(reader: TensorReader, mode: Mode, selected: list[str], entries: dict[str, TensorReport],
                     rewrite: _Rewrite, refuse_nonfinite: bool, report: FileReport) -> None:
    chosen = set(selected)
    for name, info in reader.tensors.items():
        entry = entries[name]
        if name not in chosen:
            rewrite.copy(name)
            continue
        if refuse_nonfinite and any(entries[n].nonfinite for n in selected):
            # The file is refused already: gather statistics only, to name every bad tensor.
            _fill_before(entry, tensor_statistics(reader, name, block_bytes=rewrite.block_bytes))
            continue
        if isinstance(mode, ValueClip):
            _clip_values_of(reader, mode, name, entry, rewrite)
            continue
        axes = stats_axes(mode, len(info.shape))
        held = None
        if info.nbytes <= IN_MEMORY_TENSOR_BYTES:
            held = reader.read(name)
            rewrite.bytes_read += held.nbytes
            if rewrite.progress is not None:
                rewrite.progress(held.nbytes)
            stats = TensorStats.empty(info.shape, axes)
            for index in reader.blocks(name, rewrite.block_bytes):
                stats.add(held[index], index)
        else:
            stats = tensor_statistics(reader, name, axes, block_bytes=rewrite.block_bytes, progress=rewrite.progress)
            rewrite.bytes_read += info.nbytes
        _fill_before(entry, stats)
        if refuse_nonfinite and stats.nonfinite_count:
            continue
        scale = plan_scales(mode, {name: stats})[name]
        if np.all(scale == 1.0):  # within the limit: copy the bytes as they are
            rewrite.copy(name)
            _fill_after(entry, stats, scale)
            continue
        ndim = len(info.shape)
        after = rewrite.tensor(
            name,
            lambda index, piece, stats, buffer, s=scale, n=ndim, a=axes: apply_scale(
                piece, scale_for_piece(s, index, n, a), buffer, after=stats, index=index),
            axes=axes, held=held)
        _fill_after(entry, after, scale)


def _clip_values_of(reader: TensorReader, mode: ValueClip, name: str, entry: TensorReport,
                    rewrite: _Rewrite) -> None:
    info = reader.tensors[name]
    lo, hi = value_bounds(info.dtype, mode.clip_value_min, mode.clip_value_max)
    before = TensorStats.empty(info.shape)
    changed = 0

    def transform(index: tuple, piece: np.ndarray, after: TensorStats, buffer: bytearray) -> np.ndarray:
        nonlocal changed
        nans_before = before.nan_count
        before.add(piece, index)
        out = clip_values(piece, lo, hi)
        # NaN stays NaN but compares unequal to itself: take this piece's NaNs off.
        changed += int(np.count_nonzero(out != piece)) - (before.nan_count - nans_before)
        after.add(out, index)
        return out

    after = rewrite.tensor(name, transform)
    _fill_before(entry, before)
    entry.norm_after = after.norm
    entry.changed = changed
    entry.clipped = changed > 0


def report_file(path: Path | str, *, axes: object = None, ord: str = "2", selection: Selection | None = None,
                block_bytes: int = DEFAULT_BLOCK_BYTES, progress: Progress | None = None) -> FileReport:
    """Read a file and report the norms and statistics of its tensors; writes nothing.

    Args:
        path: the file.
        axes: also compute slice norms along these axes (tensors whose rank
            cannot take them are skipped with the reason).
        ord: the norm reported: "2" (L2), "1" or "inf" (largest |x|).
        selection: include/exclude globs.

    Returns:
        A :class:`FileReport` with mode "report"; ``global_norm`` is of that order
        over the numeric tensors reported.
    """
    path = Path(path)
    started = time.perf_counter()
    selection = selection or Selection()
    params: dict[str, object] = {"ord": ord}
    if axes is not None:
        params["axes"] = [axes] if isinstance(axes, int) else list(axes)  # type: ignore[call-overload]
    with open_reader(path) as reader:
        report = _start_report(reader, path, "report", params)
        report.ord = ord
        report.metadata = dict(reader.metadata)
        for entry, info in zip(report.tensors, reader.tensors.values()):
            # The same tensors the clipping commands would work on: floating ones.
            entry.skipped = _skip_reason(info, selection, axes)
            if entry.skipped is not None:
                continue
            stats = tensor_statistics(reader, info.name, None if axes is None else axes,
                                      block_bytes=block_bytes, progress=progress, track_l1=ord == "1")
            report.bytes_read += info.nbytes
            _fill_before(entry, stats)
            entry.norm = {"2": stats.norm, "1": stats.l1_norm if ord == "1" else 0.0, "inf": stats.max_abs}[ord]
            if stats.nan_count and ord != "2":
                entry.norm = math.nan  # as the L2 norm is, so NaN is never hidden
        counted = [t for t in report.tensors if t.skipped is None]
        norms = [t.norm or 0.0 for t in counted]
        if ord == "2":
            report.global_norm = math.sqrt(math.fsum(n * n for n in norms))
        elif ord == "1":
            report.global_norm = math.fsum(norms)
        else:
            report.global_norm = max(norms, default=0.0)
    report.elapsed_s = time.perf_counter() - started
    return report


def file_info(path: Path | str) -> InfoReport:
    """Names, shapes, dtypes, sizes and metadata from the header alone."""
    path = Path(path)
    with open_reader(path) as reader:
        tensors = [InfoTensor(t.name, list(t.shape), dtype_name(t.dtype), t.nbytes, dict(t.attrs))
                   for t in reader.tensors.values()]
        return InfoReport(str(path), reader.format_name, path.stat().st_size, tensors, dict(reader.metadata))


__all__ = [
    "ClipOptions",
    "Selection",
    "clip_file",
    "report_file",
    "file_info",
    "tensor_statistics",
    "default_output",
    "NormClip",
    "AverageNormClip",
    "GlobalNormClip",
    "ValueClip",
]
