"""One file, end to end: :func:`clip_file` (pass 1, the plan, pass 2), :func:`report_file`
(pass 1 alone) and :func:`file_info` (the header alone)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from ..core.modes import Mode, NormClip, ValueClip, value_bounds
from ..errors import OutputExistsError
from ..formats.locks import Locks, RunLock
from ..formats.registry import output_format
from ..messages import Option
from ..quant.layout import QuantLayout
from ..quant.view import open_logical
from .budget import Budget
from .inputs import check_outputs, output_for
from .options import ClipOptions
from .passes import HeldTensors, Progress
from .plan import make_plan
from .policy import check_nonfinite, check_selection
from .quantized import check_quantized_plan, quantized_notes
from .reporting import finish_report, mode_params, report_from_stats, start_report
from .results import FileReport, InfoReport, InfoTensor, Note, NoteKind, OtherReport
from .rewrite import rewrite_file
from .selection import Selection, select
from .statistics import file_statistics, owned_sums
from .tied import check_tied


def clip_file(path: Path | str, mode: Mode, options: ClipOptions | None = None,
              progress: Progress | None = None) -> FileReport:
    """Clip every selected floating tensor of a file and write the result.

    The composition of the three steps for one file: :func:`file_statistics`,
    :func:`make_plan`, :func:`rewrite_file`.

    Args:
        path: the input file (.npy, .npz, .safetensors, .h5/.hdf5, .pt/.pth/.bin, .gguf).
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
    # In place, two runs on one file at once would each replace it; the second is refused.
    lock = RunLock(path) if options.in_place and not options.dry_run and os.path.lexists(path) else Locks()
    with lock, open_logical(path) as reader:
        entries, _ = select(reader, options.selection, axes)
        warnings = check_selection(entries, list(reader.tensors), mode, options, path)
        target = output_for(path, options)
        if not options.in_place:
            check_outputs({path: target}, [path])
        overwrite = options.overwrite or options.in_place
        would_write, exists = target, os.path.lexists(target)
        if options.dry_run:
            target = None
        elif not overwrite and exists:
            raise OutputExistsError(("output already exists; pass ", Option.FORCE, " to replace it"), target)
        if options.in_place and not options.dry_run:
            links = os.stat(path).st_nlink
            if links > 1:
                warnings.append(Note(NoteKind.HARD_LINKS, (f"the input has {links - 1} other hard link(s); ",
                                                           Option.IN_PLACE, " gives this name a new file and the "
                                                           "other names keep the old data")))
        held = HeldTensors(budget.memory // 8, options.hold_bytes)
        stats = file_statistics(reader, selection=options.selection, axes=axes, budget=budget, progress=progress,
                                held=held)
        report = start_report(stats, mode.name, mode_params(mode))
        report.dry_run = options.dry_run
        if options.dry_run:
            report.would_write, report.output_exists = str(would_write), exists
            report.in_place, report.overwrite = options.in_place, options.overwrite
        report.warnings += warnings + quantized_notes([stats])
        check_nonfinite(report, options, path)
        plan = make_plan(mode, [stats])
        if output_format(target or would_write, reader) in (None, reader.format_name):
            check_tied(stats, plan.work[stats.path], mode.name)  # a conversion stores each tensor apart
        check_quantized_plan(plan, [stats], path)
        rewrite = rewrite_file(reader, plan.work[stats.path], target, axes=axes,
                               overwrite=options.overwrite or options.in_place, budget=budget, progress=progress,
                               held=held, drop_nonnumeric=options.drop_nonnumeric,
                               measure_after=options.measure_after)
        if stats.shared.groups and target is not None and options.measure_after \
                and output_format(target, reader) in (None, reader.format_name):
            # views overlapping partly: their part of the global norm after, from the output
            with open_logical(target) as written:
                rewrite.owned, extra = owned_sums(written, stats.shared)
            rewrite.bytes_read += extra
        finish_report(report, stats, plan, rewrite)
    report.elapsed_s = time.perf_counter() - started
    return report


def report_file(path: Path | str, *, axes: object = None, ord: str = "2", selection: Selection | None = None,
                block_bytes: int | None = None, progress: Progress | None = None, moments: bool = False,
                memory: int = Budget.memory, threads: int = 0, max_norm: float | None = None) -> FileReport:
    """Read a file and report the norms and statistics of its tensors; writes nothing.

    Args:
        path: the file.
        axes: also compute slice norms along these axes (tensors whose rank
            cannot take them are reported whole, with the reason).
        ord: the norm reported: "2" (L2), "1" or "inf" (largest |x|).
        selection: include/exclude globs.
        moments: also mean, std, zeros and a log2-magnitude histogram.
        max_norm: the limit a gate will check (see :func:`tclip.work.gate.apply_gate`):
            with ``axes``, each tensor then counts its slices above it.

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
    if max_norm is not None:
        params["max_norm"] = max_norm
    stats = file_statistics(path, selection=selection, axes=axes, track_l1=ord == "1", track_moments=moments,
                            budget=Budget(memory, threads, block_bytes), progress=progress, whole_if_rank_skip=True)
    report = report_from_stats(stats, ord, params, selection)
    report.elapsed_s = time.perf_counter() - started
    return report


def file_info(path: Path | str, layout: QuantLayout | None = None) -> InfoReport:
    """Names, shapes, dtypes, sizes and metadata from the header alone; a quantized weight is
    one tensor of its real shape, its scheme shown as its dtype (``layout``: of its set)."""
    path = Path(path)
    with open_logical(path, layout, None if layout is None else str(path)) as reader:
        tensors = [InfoTensor(t.name, list(t.shape), t.dtype, t.nbytes, dict(t.attrs), t.refused, t.dtype_label,
                              None if t.encoding is None else t.encoding.summary, t.role)
                   for t in reader.tensors.values()]
        shared = reader.shared_elements(list(reader.tensors))  # parameters: each stored element once
        for t in tensors:
            t.tied_to, t.part_of, t.stored = shared.tied.get(t.name), shared.part_of.get(t.name), \
                shared.owned.get(t.name)
        others = [OtherReport.of(o) for o in reader.others]
        info = InfoReport(str(path), reader.format_name, path.stat().st_size, tensors, dict(reader.metadata), others,
                          [list(names) for names in reader.shared_storage()])
        if reader.damage is not None:  # the header is all info reads: list it, and say what is missing
            info.warnings.append(Note(NoteKind.DATA_MISSING, f"{reader.damage}: only the header can be listed"))
        return info
