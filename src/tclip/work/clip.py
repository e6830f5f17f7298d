"""Clipping a tensor set, of one file or many: pass 1 on every file (on a
:class:`~tclip.work.sets.TaskPool`), one plan, pass 2 on every file, the index last.

:func:`clip_file` is a set of one file. A set of one loose file (no index) reports as that
file: its ``output`` is its output, and there is no ``files`` list (see README, "JSON")."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, as_completed, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..core.modes import GlobalNormClip, Mode, NormClip, ValueClip, value_bounds
from ..errors import OutputExistsError, TclipError
from ..formats.atomic import remove_if_same
from ..formats.dcp import METADATA_NAME, is_dcp_folder
from ..formats.dcp.per_rank import standing_for
from ..formats.locks import Locks, RunLock
from ..formats.registry import output_format
from ..formats.sharded import IN_PROGRESS_KEY, INDEX_SUFFIX, TensorSet, load_index, resolve, write_index
from ..messages import Option
from ..quant.view import open_logical
from .companions import Companions, companions, copy_companions, with_plain_files
from .inputs import check_outputs, output_for
from .journal import commit_marker, journal_done, journal_path, mark_index, read_journal, write_journal
from .options import ClipOptions
from .passes import HeldTensors, Progress
from .plan import Plan, make_plan
from .policy import check_nonfinite, check_norm_overflow, check_selection
from .quantized import check_quantized_plan, logical_names, quantized_notes, rescales_that_may_miss
from .reporting import finish_report, flush_note, global_norms, mode_params, start_report
from .results import FileReport, Note, NoteKind
from .rewrite import RewriteResult, check_same
from .selection import select
from .sets import (  # noqa: F401  (report_file, file_info: tclip.work.clip's public names, kept)
    TaskPool,
    _listed,
    _selection_for,
    absolute,
    alone,
    file_info,
    report_file,
    rewrite_task,
    set_layout,
    stats_task,
)
from .statistics import FileStats, owned_sums
from .tied import check_tied

SetProgress = Callable[[str], Callable[[int], None]]


def clip_file(path: Path | str, mode: Mode, options: ClipOptions | None = None,
              progress: Progress | None = None) -> FileReport:
    """Clip every selected floating tensor of a file and write the result: :func:`clip_set`
    on the set of that one file.

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
    path = Path(path)
    return clip_set(TensorSet(str(path), [path]), mode, options or ClipOptions(),
                    progress=None if progress is None else (lambda _: progress))


def _targets(tensor_set: TensorSet, options: ClipOptions) -> tuple[dict[Path, Path | None], Path | None]:
    """Each file's output, and the index's."""
    if options.dry_run:
        return {f: None for f in tensor_set.files}, None
    if tensor_set.index is not None:
        if options.in_place:
            # A symlink stays a symlink (a shard, or the index, in a Hugging Face cache's
            # snapshot folder): its target is what gets replaced.
            return {f: Path(os.path.realpath(f)) for f in tensor_set.files}, Path(os.path.realpath(tensor_set.index))
        if options.out_dir is None:
            raise TclipError(("a sharded checkpoint needs ", Option.OUT_DIR, " DIR (shards and index keep their "
                              "names) or ", Option.IN_PLACE), tensor_set.index)
        folder = Path(options.out_dir)
        if folder.resolve() == tensor_set.index.parent.resolve():
            raise TclipError((Option.OUT_DIR, " is the checkpoint's own folder; use ", Option.IN_PLACE, " for that"),
                             tensor_set.index)
        return ({f: folder / f.relative_to(tensor_set.index.parent) for f in tensor_set.files},
                folder / tensor_set.index.name)
    dcp = next((f.parent for f in tensor_set.files if f.name == METADATA_NAME and is_dcp_folder(f.parent)), None)
    if dcp is not None and options.in_place:
        # Its .metadata and .distcp files are replaced one by one: an interrupted run would leave a mix.
        raise TclipError(("a DCP checkpoint is clipped into ", Option.OUT_DIR, " DIR, not ", Option.IN_PLACE,
                          " (an interrupted run would leave it half clipped)"), dcp)
    if dcp is not None and _into_itself(dcp, options):
        raise TclipError(("the output folder is the checkpoint's own; a DCP checkpoint is clipped into another "
                          "folder, not ", Option.IN_PLACE, " (an interrupted run would leave it half clipped): clip "
                          "into a new folder with ", Option.OUT_DIR, " DIR and swap the two"), dcp)
    per_rank = next((f for f in tensor_set.files if f == standing_for(f if f.is_dir() else f.parent)), None)
    if per_rank is not None:  # (no .metadata to keep: the writer rewrites a folder described by one)
        raise TclipError("a DCP checkpoint saved per rank (__R.metadata files or shard-* pieces, no .metadata) is "
                         "read only; tclip convert writes it as safetensors", per_rank)
    if dcp is not None and options.out_dir is None and options.output is None:
        raise TclipError(("a DCP checkpoint is a folder: clip it into ", Option.OUT_DIR, " DIR (its files keep "
                          "their names)"), dcp)
    if options.in_place and tensor_set.keep_names:
        # Without an index there is nowhere to mark a run in progress: an interrupted one would
        # leave some files clipped and others not, and a rerun would clip them again.
        raise TclipError(("a split GGUF set is clipped into ", Option.OUT_DIR, " DIR, not ", Option.IN_PLACE,
                          " (an interrupted run would leave it half clipped)"), tensor_set.files[0])
    if tensor_set.keep_names and options.out_dir is None:
        raise TclipError(("a split GGUF set needs ", Option.OUT_DIR, " DIR (its files keep their names, by which "
                          "llama.cpp finds them)"), tensor_set.files[0])
    # loose files: in place (a symlink's target), -o for one file, else NAME.clipped.EXT or --out-dir
    return {f: output_for(f, options) for f in tensor_set.files}, None


def _into_itself(folder: Path, options: ClipOptions) -> bool:
    """Whether ``--out-dir`` (or ``-o DIR/.metadata``) names the DCP folder being clipped."""
    out = Path(options.out_dir) if options.out_dir is not None else \
        Path(options.output).parent if options.output is not None else None
    try:
        return out is not None and os.path.samefile(out, folder)
    except OSError:  # (a folder not made yet is not the input's)
        return False


def _companions(tensor_set: TensorSet, options: ClipOptions) -> Companions:
    """The checkpoint folder's other files that go with an index written to ``--out-dir``."""
    if tensor_set.index is None or options.in_place or options.out_dir is None:
        return Companions()
    return with_plain_files(companions(tensor_set, Path(options.out_dir)), tensor_set.index.parent,
                            Path(options.out_dir))


def planned_outputs(tensor_set: TensorSet, options: ClipOptions) -> tuple[dict[Path, Path], list[Path]]:
    """What a run that is not ``--in-place`` would write: each input (shards, index and
    the folder's other files it copies) with its output, and every input of the set, for
    :func:`tclip.work.inputs.check_outputs`."""
    if tensor_set.index is not None and not tensor_set.files:
        tensor_set = load_index(tensor_set.index)
    targets, index_target = _targets(tensor_set, replace(options, dry_run=False))
    outputs: dict[Path, Path] = {f: t for f, t in targets.items() if t is not None}
    inputs = list(tensor_set.files)
    if tensor_set.index is not None:
        inputs.append(tensor_set.index)
        if index_target is not None:
            outputs[tensor_set.index] = index_target
        for source, target in _companions(tensor_set, options).copies:
            outputs[source] = target
            inputs.append(source)
    return outputs, inputs


def clip_set(tensor_set: TensorSet, mode: Any, options: ClipOptions, dask_address: str | None = None,
             progress: SetProgress | None = None, folder_files: Companions | None = None) -> FileReport:
    """Clip one tensor set: pass 1 on every file, one plan, pass 2 on every file, the index last.

    ``folder_files``: the other files of the folder a loose ``model.safetensors`` stands for,
    copied beside its output (:func:`tclip.work.companions.folder_companions`).
    Two runs never rewrite one set at once (see :mod:`tclip.formats.locks`): the second fails."""
    with _run_locks(tensor_set, options):
        return _clip_set(tensor_set, mode, options, dask_address, progress, folder_files)


def _run_locks(tensor_set: TensorSet, options: ClipOptions) -> Locks:
    """The locks of a run: in place, every file it replaces (the index, each file of the
    set); into ``--out-dir``, the index read (shared, where its folder can hold a lock
    file) and the output folder of a sharded checkpoint. A dry run writes nothing, not
    even a lock file."""
    locks = Locks()
    if options.dry_run:
        return locks
    try:
        if options.in_place:
            if tensor_set.index is not None:
                locks.take(RunLock(tensor_set.index))
            files = tensor_set.files
            if tensor_set.index is not None and not files and tensor_set.index.name.endswith(INDEX_SUFFIX):
                files = load_index(tensor_set.index).files
            for file in sorted(files, key=os.path.realpath):
                if os.path.lexists(file):  # (a missing one is reported when the set is resolved)
                    locks.take(RunLock(file))
        elif tensor_set.index is not None and options.out_dir is not None:
            locks.take(RunLock(tensor_set.index, shared=True, required=False))
            if os.path.isdir(options.out_dir):
                locks.take(RunLock(Path(options.out_dir), folder=True, required=False, doing="written"))
        elif tensor_set.index is None:
            for file in tensor_set.files:  # an output replacing a file another run rewrites in place
                target = output_for(file, options)  # would lose one of the two results
                if os.path.lexists(target):
                    locks.take(RunLock(target, required=False, doing="rewritten"))
    except BaseException:
        locks.release()
        raise
    return locks


@dataclass
class _Run:
    """What a clip of one set works from, decided before any tensor data is read."""

    tensor_set: TensorSet
    mode: Any
    options: ClipOptions
    layout: Any
    planned: dict[Path, Path | None]  # what a real run writes (a dry run names it, and writes nothing)
    planned_index: Path | None
    unplanned: TclipError | None  # a dry run of what a real run would refuse: why
    others: Companions
    folder_files: bool  # ``others`` are a loose model.safetensors' folder's files
    journal: Path | None = None
    resumed: dict[str, Any] | None = None
    one: bool = False  # a set of one loose file: reported as that file
    early: list[Note] | None = None  # that file's notes from its header, found before any data is read
    converts: bool = False  # that file is written in another format (shared storage is written apart)
    held: dict[str, Any] = field(default_factory=dict)  # pass 1 of that one file keeps small tensors for pass 2

    @property
    def axes(self) -> Any:
        return self.mode.axes if isinstance(self.mode, NormClip) else None

    @property
    def where(self) -> str:
        return str(self.tensor_set.files[0]) if self.one else self.tensor_set.name

    @property
    def targets(self) -> dict[Path, Path | None]:
        return {f: None for f in self.planned} if self.options.dry_run else self.planned

    @property
    def index_target(self) -> Path | None:
        return None if self.options.dry_run else self.planned_index

    @property
    def overwrite(self) -> bool:
        return self.options.overwrite or self.options.in_place


def _clip_set(tensor_set: TensorSet, mode: Any, options: ClipOptions, dask_address: str | None,
              progress: SetProgress | None, folder_files: Companions | None) -> FileReport:
    started = time.perf_counter()
    if isinstance(mode, ValueClip):
        value_bounds(np.dtype(np.float64), mode.clip_value_min, mode.clip_value_max)
    run = _prepare(tensor_set, mode, options, dask_address, folder_files)
    options, files = run.options, run.tensor_set.files
    pool = TaskPool(options.budget, len(files), dask_address)
    written: dict[Path, tuple[int, int, int]] = {}  # what this run wrote (not in place), by identity
    fresh: set[Path] = set()  # its outputs where nothing was before (--force replaces, never restores)
    created: list[Path] = []
    try:
        report, stats, plan, todo = _measure(run, pool, progress)
        if not options.dry_run and not options.in_place:
            targets = run.targets
            created = _make_folders([targets[f] for f in todo], run.index_target,
                                    None if options.out_dir is None else Path(options.out_dir))
            fresh = {t for t in [*(targets[f] for f in todo), run.index_target, *(t for _, t in run.others.copies)]
                     if t is not None and not os.path.lexists(t)}
        _write(run, pool, report, stats, plan, todo, progress, written, fresh)
    except BaseException:
        pool.close()  # every task has stopped: what it wrote can go
        _remove_written({path: mine for path, mine in written.items() if path in fresh}, created)
        raise
    finally:
        pool.close()
    report.elapsed_s = time.perf_counter() - started
    return report


def _prepare(tensor_set: TensorSet, mode: Any, options: ClipOptions, dask_address: str | None,
             folder_files: Companions | None) -> _Run:
    """The set resolved, its outputs decided and checked (none is an input, none exists
    unless replaced), and an interrupted in-place run's journal read."""
    one = alone(tensor_set)
    early: list[Note] = []
    converts = False
    if one:
        tensor_set, early, converts = _open_one(tensor_set, mode, options)
    else:
        tensor_set = resolve(tensor_set)
    if dask_address is not None:
        tensor_set = absolute(tensor_set)
        if options.out_dir is not None:
            options = replace(options, out_dir=Path(os.path.abspath(options.out_dir)))
    unplanned: TclipError | None = None
    try:
        planned, planned_index = _targets(tensor_set, replace(options, dry_run=False))
    except TclipError as error:
        if not options.dry_run:
            raise
        # a dry run still measures (the global norm), and says the real run needs an output
        unplanned, planned, planned_index = error, {f: None for f in tensor_set.files}, None
    others = folder_files if folder_files is not None else \
        _companions(tensor_set, options) if unplanned is None else Companions()
    run = _Run(tensor_set, mode, options, None if one else set_layout(tensor_set), planned, planned_index,
               unplanned, others, folder_files is not None, one=one, early=early, converts=converts)
    if not options.in_place and (not options.dry_run or one):  # (a file's dry run refuses it too, as it did)
        check_outputs(*planned_outputs(tensor_set, options))
    if not run.overwrite and not options.dry_run:
        copies = [t for _, t in others.copies]
        # (a folder's weights: its other files are checked first, as they were before it was a set)
        outs = [*copies, *run.targets.values()] if run.folder_files else [*run.targets.values(), run.index_target,
                                                                           *copies]
        for out in outs:
            if out is not None and os.path.lexists(out):
                raise OutputExistsError(("output already exists; pass ", Option.FORCE, " to replace it"), out)
    run.journal, run.resumed = _journal(tensor_set, mode, options)
    return run


def _open_one(tensor_set: TensorSet, mode: Any, options: ClipOptions) -> tuple[TensorSet, list[Note], bool]:
    """A set of one loose file, from its header: what its selection refuses (raised) or warns
    of, before any data is read; and whether its output is in another format."""
    path = tensor_set.files[0]
    axes = mode.axes if isinstance(mode, NormClip) else None
    with open_logical(path) as reader:
        entries, _ = select(reader, options.selection, axes)
        unreadable = [o for o in reader.others if o.unreadable_type]
        notes = check_selection(entries, [*reader.tensors, *(o.name for o in unreadable)], mode, options, path,
                                unreadable=[o for o in unreadable if options.selection.matches(o.name)])
        target = output_for(path, options)
        converts = output_format(target, reader) not in (None, reader.format_name)
        names = list(reader.tensors)
    if options.in_place and not options.dry_run:
        links = os.stat(path).st_nlink
        if links > 1:
            notes.append(Note(NoteKind.HARD_LINKS, (f"the input has {links - 1} other hard link(s); ",
                                                    Option.IN_PLACE, " gives this name a new file and the "
                                                    "other names keep the old data")))
    return replace(tensor_set, names=names), notes, converts


def _journal(tensor_set: TensorSet, mode: Any, options: ClipOptions) -> tuple[Path | None, dict[str, Any] | None]:
    """The journal of an in-place run on an index, and what an interrupted run recorded in it
    (a dry run reads it, to show what a resumed run would do, and writes nothing)."""
    journal = journal_path(tensor_set) if options.in_place and tensor_set.index is not None else None
    if IN_PROGRESS_KEY in tensor_set.metadata:
        # A half-clipped checkpoint: clipping it anew would take the norm of a mix.
        if journal is None:
            raise TclipError(("an in-place run was interrupted here and some shards may be clipped and others "
                              "not; finish it by rerunning that command (with ", Option.IN_PLACE, "), or restore the "
                              "checkpoint"), tensor_set.index)
        if not journal.exists():
            raise TclipError(f"the index says an in-place run was interrupted, but its journal ({journal.name}) "
                             "is missing; restore the checkpoint from a copy", tensor_set.index)
    resumed = None if journal is None else read_journal(journal, tensor_set, mode, options,
                                                        record=not options.dry_run)
    return (None if options.dry_run else journal), resumed


def _file_progress(progress: SetProgress | None, pool: TaskPool, file: Path) -> Callable[[int], None] | None:
    return progress(str(file)) if progress is not None and pool.local else None


def _measure(run: _Run, pool: TaskPool, progress: SetProgress | None
             ) -> tuple[FileReport, list[FileStats], Plan, list[Path]]:
    """Pass 1 on every file still to do, the report's first half, the checks, and the plan."""
    tensor_set, options, layout, mode = run.tensor_set, run.options, run.layout, run.mode
    done = set(run.resumed["done"]) if run.resumed is not None else set()
    todo = [f for f in tensor_set.files if f not in done]
    held = {"held": HeldTensors(options.budget.memory // 8, options.hold_bytes)} if run.one and pool.local else {}
    stats = pool.map(stats_task, [((str(f), _selection_for(tensor_set, f, options.selection, layout), run.axes,
                                    pool.task_budget), {"progress": _file_progress(progress, pool, f),
                                                        "layout": layout, **held}) for f in todo])
    run.held = held
    report = _set_report(run, stats)
    report.dry_run = options.dry_run
    _measure_notes(run, report, stats, todo)
    check_nonfinite(report, options, run.where)
    check_norm_overflow(report, options, run.where)
    if run.resumed is not None:
        # The finished shards are clipped already: the global norm is the one recorded.
        if isinstance(mode, GlobalNormClip) and mode.use_norm is None:
            mode = GlobalNormClip(mode.clip_norm, run.resumed["global_norm"])
        report.warnings.append(Note(NoteKind.RESUMED, f"resumed an unfinished run: {len(done)} of "
                                                      f"{len(tensor_set.files)} shard(s) were clipped by it already"))
    plan = make_plan(mode, stats)
    _check_plan(run, pool, plan, stats, todo)
    return report, stats, plan, todo


def _measure_notes(run: _Run, report: FileReport, stats: list[FileStats], todo: list[Path]) -> None:
    """What a dry run would write, and the warnings from pass 1."""
    options = run.options
    if options.dry_run and run.unplanned is None:
        _would_write(report, run, [(f, run.planned[f]) for f in todo])
    elif run.unplanned is not None:
        unplanned = run.unplanned
        report.warnings.append(Note(NoteKind.NO_OUTPUT, ("a real run would fail: ", *unplanned.message)
                                    if isinstance(unplanned.message, tuple) else
                                    f"a real run would fail: {unplanned.message}"))
    if not run.one or run.folder_files:
        report.not_copied = [{"name": name, "reason": why} for name, why in run.others.left]
    if run.one:
        report.warnings += (run.early or []) + quantized_notes(stats)
    elif stats:
        entries = [t for s in stats for t in _listed(run.tensor_set, s.path, s.tensors, run.layout)]
        unreadable = [o for s in stats for o in s.others if o.name in s.unmeasured_others]
        names = [*logical_names(run.tensor_set.names, run.layout), *(o.name for s in stats for o in s.others
                                                                      if o.unreadable_type)]
        report.warnings += check_selection(entries, names, run.mode, options, run.tensor_set.name, "set",
                                           unreadable=unreadable)
        report.warnings += quantized_notes(stats)


def _check_plan(run: _Run, pool: TaskPool, plan: Plan, stats: list[FileStats], todo: list[Path]) -> None:
    """What the plan cannot do is refused before any file is written; in place, the journal
    records the plan (and the index says a run is in progress) before the first shard is."""
    options, tensor_set = run.options, run.tensor_set
    if not run.converts:
        for file_stats in stats:  # shards keep their format: bytes shared by tensors are written once
            check_tied(file_stats, plan.work[file_stats.path], run.mode.name)
    check_quantized_plan(plan, stats, run.where)
    if not options.dry_run:
        for f, file_stats in zip(todo, stats):  # nothing is written when a file is not the one measured
            check_same(f, file_stats.identity)  # (the path measured: a DCP folder's .metadata)
    may_miss = rescales_that_may_miss(plan, stats) if len(todo) > 1 and not options.dry_run else {}
    if may_miss:  # where a rescale may miss its factor, check it before any file is written
        pool.map(rewrite_task, [((path, work, None, run.axes, False, pool.task_budget, options.drop_nonnumeric),
                                 {"layout": run.layout}) for path, work in may_miss.items()])
    if run.journal is not None and run.resumed is None:
        write_journal(run.journal, tensor_set, run.mode, options, stats, plan)
        for f in tensor_set.files:  # a marker left by a run given up on (restored, journal removed) means nothing
            commit_marker(f).unlink(missing_ok=True)
        mark_index(tensor_set, run.journal)


def _write(run: _Run, pool: TaskPool, report: FileReport, stats: list[FileStats], plan: Plan, todo: list[Path],
           progress: SetProgress | None, written: dict[Path, tuple[int, int, int]], fresh: set[Path]) -> None:
    """Pass 2 on every file, the report's second half, the folder's other files, the index last
    (``written``, ``fresh``: see :func:`_rewrite_all`)."""
    options, tensor_set, targets = run.options, run.tensor_set, run.targets
    calls, order = [], []
    for f, s in zip(todo, stats):
        target = targets[f]
        # In place, a task leaves a commit marker just before its rename: run again
        # (Dask's retry), it finds its shard done; resumed after a crash, so does the run.
        marker = {"commit_marker": str(commit_marker(f))} if options.in_place and not options.dry_run else {}
        calls.append(((str(f), plan.work[s.path], None if target is None else str(target), run.axes,
                       run.overwrite or not pool.local, pool.task_budget, options.drop_nonnumeric),
                      {"progress": _file_progress(progress, pool, f), "layout": run.layout, "expect": s.identity,
                       "measure_after": options.measure_after, **run.held, **marker}))
        order.append(f)
    results = _rewrite_all(pool, calls, order, run.journal, tensor_set, None if options.in_place else written, fresh)
    _finish_set_report(run, report, stats, plan, {r.path: r for r in results})
    index_target = run.index_target
    if not options.dry_run and not options.in_place and (index_target is not None or run.folder_files):
        copy_companions(run.others.copies, run.overwrite, written)
        report.copied = [source.name for source, _ in run.others.copies]
    if index_target is not None:
        identity = write_index(tensor_set, index_target, [targets[f] for f in tensor_set.files],
                               overwrite=run.overwrite)
        if identity is not None and not options.in_place:
            written[index_target] = identity
        report.output = str(index_target)
        if run.journal is not None:
            run.journal.unlink(missing_ok=True)
            for f in tensor_set.files:  # a marker a crash left beside a shard the journal had recorded
                commit_marker(f).unlink(missing_ok=True)


def _would_write(report: FileReport, run: _Run, outputs: list[tuple[Path, Path | None]]) -> None:
    """A dry run's account of what the real run would write: each file's output (the
    shards a resumed run has still to do; a set of one loose file: its output), the folder's
    other files it would copy and the index, each saying whether it exists."""
    options, copies = run.options, run.others.copies
    report.in_place, report.overwrite = options.in_place, options.overwrite
    if run.one:
        target = outputs[0][1] if outputs else None
        if target is not None:
            report.would_write, report.output_exists = str(target), os.path.lexists(target)
    else:
        report.would_write_files = [{"file": str(f), "output": str(t), "exists": os.path.lexists(t)}
                                    for f, t in outputs if t is not None]
    if not run.one or run.folder_files:
        report.would_copy = [{"file": str(f), "output": str(t), "exists": os.path.lexists(t)} for f, t in copies]
    if run.planned_index is not None:
        report.would_write, report.output_exists = str(run.planned_index), os.path.lexists(run.planned_index)


def _make_folders(targets: list[Path | None], index_target: Path | None, out_dir: Path | None) -> list[Path]:
    """The folders inside ``out_dir`` the outputs go into (shards in a subfolder of the index's
    folder keep it), created; those this run made, innermost first. A subfolder of ``out_dir``
    that is a symlink is refused: the shards would land wherever it points. (The folder of an
    output named with -o is not made: a mistyped one is an error.)"""
    created: list[Path] = []
    if out_dir is None:
        return created
    folders = [f for f in dict.fromkeys(t.parent for t in [*targets, index_target] if t is not None)
               if f.is_relative_to(out_dir)]
    for target in folders:
        step = Path(out_dir)
        for part in target.relative_to(out_dir).parts:
            step = step / part
            if os.path.islink(step):
                raise TclipError("is a symbolic link inside the output folder; shards are written only into "
                                 "folders tclip makes or finds there", step)
    for target in folders:
        missing = []
        folder = target
        while not os.path.lexists(folder) and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            _remove_written({}, created)
            raise TclipError(f"cannot create the output folder ({error.strerror or error})", target) from None
        created += missing
    return created


def _remove_written(written: dict[Path, tuple[int, int, int]], created: list[Path]) -> None:
    """After a failed run (not in place), the outputs it wrote where nothing was before and
    the folders it made (when empty): the output folder is as it was. Each file goes only
    while it is the file this run wrote (by identity): one another run put at that name
    meanwhile stays. A kill leaves them (README)."""
    for path, identity in written.items():
        remove_if_same(path, identity)
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            pass


def _rewrite_all(pool: TaskPool, calls: list, order: list[Path], journal: Path | None, tensor_set: TensorSet,
                 written: dict[Path, tuple[int, int, int]] | None, fresh: set[Path]) -> list[RewriteResult]:
    """Pass 2 on every file. In place, every shard that is replaced is written down in the
    journal as soon as it is, even when the run stops (an error, Ctrl-C) while other shards
    are being written; into new files, what each task wrote goes into ``written`` (a failed
    run removes those, and only those), and the other files a task put where nothing was (a
    DCP folder's ``.distcp`` files) into ``fresh`` too: an interrupt after the commit leaves
    no ``.distcp`` files without their ``.metadata``."""
    futures = {pool.executor.submit(rewrite_task, *args, **kwargs): (file, kwargs.get("commit_marker"))
               for (args, kwargs), file in zip(calls, order)}
    results: dict[Path, RewriteResult] = {}

    def finished(future: Future) -> None:
        file, marker = futures[future]
        result = results[file] = future.result()
        if journal is not None:
            journal_done(journal, tensor_set, file)
        elif marker is not None:
            Path(marker).unlink(missing_ok=True)
        if written is not None and result.written is not None and result.output is not None:
            written[Path(result.output)] = result.written  # (first: removed before the files it names)
            for path, identity in result.also_written.items():
                written[Path(path)] = identity
                fresh.add(Path(path))

    try:
        for future in as_completed(futures):
            finished(future)
    except BaseException:
        for future in futures:
            future.cancel()
        wait(list(futures))
        for future, (file, _) in futures.items():
            if file not in results and future.done() and not future.cancelled() and future.exception() is None:
                finished(future)
        raise
    return [results[f] for f in order]


def _set_report(run: _Run, stats: list[FileStats]) -> FileReport:
    """The report from pass 1: a set of one loose file's is that file's (its name, no ``files``)."""
    mode = run.mode
    if run.one:
        return start_report(stats[0], mode.name, mode_params(mode)) if stats else \
            FileReport(file=run.where, mode=mode.name, params=mode_params(mode))
    report = FileReport(file=run.tensor_set.name, mode=mode.name, params=mode_params(mode),
                        format=stats[0].format if stats else None)
    for s in stats:
        part = start_report(s, mode.name, {})
        report.tensors += _listed(run.tensor_set, s.path, part.tensors, run.layout)
        report.others += part.others
        report.bytes_read += part.bytes_read
    report.members = [{"file": s.path, "output": None} for s in stats]
    return report


def _finish_set_report(run: _Run, report: FileReport, stats: list[FileStats], plan: Plan,
                       rewrites: dict[str, RewriteResult]) -> None:
    """The after-columns and totals from the plan and pass 2."""
    targets = run.targets
    if run.one:
        for s in stats:  # (one file: its target, whatever its reader calls it -- a DCP folder for its .metadata)
            target = targets[Path(s.path)] if Path(s.path) in targets else next(iter(targets.values()), None)
            _measure_owned(s, rewrites.get(s.path), target)
            finish_report(report, s, plan, rewrites.get(s.path))
        return
    by_name = {t.name: t for t in report.tensors}
    for s in stats:
        part = FileReport(file=s.path, mode=report.mode)
        part.tensors = [by_name[t.name] for t in s.tensors if t.name in by_name]
        _measure_owned(s, rewrites.get(s.path), targets[Path(s.path)])
        finish_report(part, s, plan, rewrites.get(s.path))
        report.bytes_read += rewrites[s.path].bytes_read if s.path in rewrites else 0
        report.bytes_written += rewrites[s.path].bytes_written if s.path in rewrites else 0
        report.warnings += rewrites[s.path].warnings if s.path in rewrites else []
    note = flush_note(report.tensors)  # one line for the set (each part's own went with the part)
    if note is not None:
        report.warnings.append(note)
    before, after = global_norms([t for t in report.tensors if t.skipped is None])
    report.global_norm = plan.global_norm if plan.global_norm is not None else before
    if after is not None:
        report.global_norm_after = after
    report.members = [{"file": s.path, "output": None if targets[Path(s.path)] is None else str(targets[Path(s.path)]),
                       "bytes_written": rewrites[s.path].bytes_written if s.path in rewrites else 0}
                      for s in stats]


def _measure_owned(stats: FileStats, rewrite: RewriteResult | None, target: Path | None) -> None:
    """Views of a shard overlapping partly: their part of the global norm after, read from the output."""
    if rewrite is None or not stats.shared.groups or target is None or not rewrite.measured:
        return
    with open_logical(target) as written:
        if written.format_name == stats.format:
            rewrite.owned, extra = owned_sums(written, stats.shared)
            rewrite.bytes_read += extra


