"""One tensor set across many files: sharded checkpoints, explicit file lists, clusters.

The work is the one-file steps over all files:

1. pass 1 per file (:func:`stats_task`), on an executor: a local thread pool
   by default, a ``dask.distributed`` cluster with ``--dask`` (its
   ``Client.get_executor()`` is a ``concurrent.futures.Executor``);
2. one plan over every file's statistics (one global norm: an exact sum of
   every tensor's sum of squares, so any split into files gives the same bits);
3. pass 2 per file (:func:`rewrite_task`), each shard written atomically; the
   index last.

Only per-tensor statistics cross process boundaries, never tensors: each task
opens its own files by path."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor, as_completed, wait
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..core.modes import GlobalNormClip, NormClip, ValueClip, value_bounds
from ..errors import OutputExistsError, TclipError, UnsupportedError
from ..formats import SharedElements
from ..formats.atomic import identity_of, marker_names, remove_if_same
from ..formats.locks import Locks, RunLock
from ..formats.registry import open_reader
from ..formats.sharded import (
    GGUF_SPLIT_NAME,
    IN_PROGRESS_KEY,
    INDEX_SUFFIX,
    TensorSet,
    is_index,
    load_index,
    resolve,
    set_anchor,
    write_index,
)
from ..messages import Option
from ..quant.layout import QuantLayout
from ..quant.view import layout_of_files, open_logical
from .budget import Budget
from .companions import Companions, companions, copy_companions, with_plain_files
from .clip import file_info
from .inputs import check_outputs, default_output
from .journal import (
    commit_marker,
    journal_done,
    journal_path,
    mark_index,
    read_journal,
    write_journal,
)
from .options import ClipOptions
from .plan import Plan, TensorWork, make_plan
from .policy import check_nonfinite, check_selection
from .quantized import check_quantized_plan, logical_names, quantized_notes, rescales_that_may_miss
from .reporting import (
    finish_report,
    flush_note,
    global_norms,
    mode_params,
    report_from_stats,
    start_report,
)
from .results import FileReport, InfoReport, Note, NoteKind
from .rewrite import RewriteResult, check_same, rewrite_file
from .selection import Selection
from .statistics import FileStats, file_statistics, owned_sums
from .tied import check_tied


def stats_task(path: str, selection: Selection, axes: Any, budget: Budget, track_l1: bool = False,
               track_moments: bool = False, whole_if_rank_skip: bool = False,
               progress: Callable[[int], None] | None = None, layout: QuantLayout | None = None) -> FileStats:
    """Pass 1 of one file, on whatever machine runs it (``layout``: the set's quantized weights).
    The statistics say which file they are of (``identity``): pass 2 rewrites only that file."""
    before = identity_of(path)
    stats = file_statistics(path, selection=selection, axes=axes, budget=budget, track_l1=track_l1,
                            track_moments=track_moments, whole_if_rank_skip=whole_if_rank_skip, progress=progress,
                            layout=layout)
    if identity_of(path) != before:
        raise TclipError("was replaced or changed while tclip read it (by another run or program); nothing was "
                         "written", path)
    stats.identity = before
    return stats


def rewrite_task(path: str, work: dict[str, TensorWork], target: str | None, axes: Any, overwrite: bool,
                 budget: Budget, drop_nonnumeric: bool, progress: Callable[[int], None] | None = None,
                 commit_marker: str | None = None, layout: QuantLayout | None = None,
                 expect: tuple[int, int, int] | None = None) -> RewriteResult:
    """Pass 2 of one file, on whatever machine runs it; the output appears atomically.

    ``expect``: the identity of the file pass 1 measured; another file at ``path`` is refused,
    unless this task replaced it in place already (its ``commit_marker`` names it): a task run
    again (Dask reruns the task of a worker lost after its rename) finds its shard done and
    leaves it, measuring what it holds."""
    if expect is not None and commit_marker is not None and identity_of(path) != expect \
            and marker_names(Path(commit_marker), Path(path)):
        return _found_done(path, work, target, axes, budget, layout)
    return rewrite_file(path, work, None if target is None else Path(target), axes=axes, overwrite=overwrite,
                        budget=budget, progress=progress, drop_nonnumeric=drop_nonnumeric,
                        commit_marker=None if commit_marker is None else Path(commit_marker), layout=layout,
                        expect=expect)


def _found_done(path: str, work: dict[str, TensorWork], target: str | None, axes: Any, budget: Budget,
                layout: QuantLayout | None) -> RewriteResult:
    """The result of a task whose shard an earlier attempt of it replaced already: the
    norms after are measured from the shard; what that attempt counted (values changed by
    a value clip, values flushed to zero) is not known and is not shown as zero."""
    chosen = Selection(tuple(glob.escape(name) for name in work), allow=frozenset(work))
    measured = file_statistics(path, selection=chosen, axes=axes, budget=budget, layout=layout)
    result = RewriteResult(path, target, {name: measured.stats[name] for name in work if name in measured.stats},
                           {}, bytes_read=measured.bytes_read, bytes_written=os.stat(path).st_size)
    result.warnings.append(Note(NoteKind.TASK_REPEATED, f"{Path(path).name}: its task ran again (a worker was lost "
                                                        "after replacing it) and found it clipped already; its norms "
                                                        "after were measured from the file, and counts of changed "
                                                        "values are not known"))
    return result


def set_layout(tensor_set: TensorSet) -> QuantLayout:
    """The quantized weights of a resolved set: weights and scales paired across its files,
    with the quantization config beside its index (or its first file)."""
    folder = tensor_set.index.parent if tensor_set.index is not None else \
        (tensor_set.files[0].parent if tensor_set.files else Path("."))
    return layout_of_files(tensor_set.files, folder, open_reader)


class TaskPool:
    """Where per-file tasks run: a local thread pool, or a Dask cluster."""

    def __init__(self, budget: Budget, files: int, dask_address: str | None) -> None:
        self.client: Any = None
        self.local = dask_address is None
        if dask_address is None:
            # One budget for the whole run: the files' passes share its memory and threads.
            self.parallel = budget.parallel_passes(files)
            self.task_budget = budget.share(self.parallel)
            self.executor: Executor = ThreadPoolExecutor(self.parallel, thread_name_prefix="tclip-file")
        else:
            try:
                from dask.distributed import Client
            except ImportError:
                raise UnsupportedError((Option.DASK, " needs dask.distributed: pip install 'tclip[dask]'")) from None
            try:
                self.client = Client(dask_address, timeout="30s", set_as_default=False)
            except (OSError, TimeoutError, ValueError) as error:
                raise TclipError(f"cannot reach the Dask scheduler at {dask_address} ({error})") from None
            self._check_remote(dask_address)
            # Each worker runs its tasks with the budget given (its --memory and --threads).
            self.parallel = files
            self.task_budget = budget
            self.executor = self.client.get_executor(retries=2, pure=False)

    def _check_remote(self, address: str) -> None:
        """The tasks are tclip's functions, sent by name: a scheduler or worker that cannot import
        tclip would fail each one with a deserialization traceback. Asked first, it is one line
        (a cluster that refuses to run the question, or fails otherwise, is left to the tasks)."""
        import importlib

        where = "scheduler"
        try:
            self.client.run_on_scheduler(importlib.import_module, __name__)
            where = "workers"
            self.client.run(importlib.import_module, __name__)
        except ImportError as error:  # raised there, sent back
            self.client.close()
            text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
            raise TclipError(f"the Dask {where} at {address} cannot import tclip ({type(error).__name__}: {text}); "
                             "tclip must be installed where the scheduler and every worker run too, the same "
                             "version as here") from None
        except Exception:  # (run_on_scheduler refused by the cluster's configuration, say): the tasks will tell
            pass

    def map(self, function: Callable[..., Any], calls: list[tuple[tuple, dict[str, Any]]]) -> list[Any]:
        futures: list[Future] = [self.executor.submit(function, *args, **kwargs) for args, kwargs in calls]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def close(self) -> None:
        if self.local:
            self.executor.shutdown(wait=True, cancel_futures=True)
        elif self.client is not None:
            self.client.close()


def group_sets(inputs: list[tuple[str, Path | None]], across: bool) -> list[tuple[str, TensorSet | None]]:
    """Indexes become sets; with ``across`` all other files form one set; else each file is its own set."""
    out: list[tuple[str, TensorSet | None]] = []
    loose: list[Path] = []
    seen: set[Path] = set()
    anchors = {set_anchor(path) for _, path in inputs if path is not None and is_index(path)}
    for name, path in inputs:
        if path is None:
            out.append((name, None))
        elif _split_anchor(path) in anchors and not is_index(path):
            # A file of a split set (a folder, a glob) whose header cannot be read: the set
            # reads it too and says what is wrong with it, once.
            continue
        elif is_index(path):
            anchor = set_anchor(path)  # several files of one GGUF split set (a glob, a folder) give it once
            if anchor not in seen:
                seen.add(anchor)
                out.append((name, TensorSet(name, [], path)))
        elif across:
            loose.append(path)
        else:
            out.append((name, TensorSet(name, [path])))
    if loose:
        label = f"{len(loose)} files" if len(loose) > 1 else str(loose[0])
        out.append((label, TensorSet(label, loose)))
    return out


def _split_anchor(path: Path) -> Path | None:
    """The first file of the GGUF split set ``path``'s name says it belongs to (None where the
    set would not read it: a name numbered outside 1..count, such as ``m-00000-of-00002``)."""
    match = GGUF_SPLIT_NAME.fullmatch(Path(path).name)
    if match is None or not 1 <= int(match["no"]) <= int(match["count"]):
        return None
    return Path(path).with_name(f"{match['prefix']}-00001-of-{match['count']}.gguf")


def absolute(tensor_set: TensorSet) -> TensorSet:
    """The set with every path absolute, for tasks that run elsewhere: a Dask worker
    started in another folder would read a relative path against its own."""
    def whole(path: Path) -> Path:
        return Path(os.path.abspath(path))

    allow = None if tensor_set.allow is None else {whole(f): names for f, names in tensor_set.allow.items()}
    return replace(tensor_set, files=[whole(f) for f in tensor_set.files], allow=allow,
                   index=None if tensor_set.index is None else whole(tensor_set.index))


def _selection_for(tensor_set: TensorSet, file: Path, selection: Selection,
                   layout: QuantLayout | None = None) -> Selection:
    if tensor_set.allow is None:
        return selection
    owned = layout.owned_by(str(file)) if layout else []  # a quantized weight's name may be another shard's
    return replace(selection, allow=tensor_set.allow[file] | frozenset(owned))


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
    if options.in_place and tensor_set.keep_names:
        # Without an index there is nowhere to mark a run in progress: an interrupted one would
        # leave some files clipped and others not, and a rerun would clip them again.
        raise TclipError(("a split GGUF set is clipped into ", Option.OUT_DIR, " DIR, not ", Option.IN_PLACE,
                          " (an interrupted run would leave it half clipped)"), tensor_set.files[0])
    if options.in_place:
        return {f: Path(os.path.realpath(f)) for f in tensor_set.files}, None
    if tensor_set.keep_names and options.out_dir is None:
        raise TclipError(("a split GGUF set needs ", Option.OUT_DIR, " DIR (its files keep their names, by which "
                          "llama.cpp finds them)"), tensor_set.files[0])
    return {f: default_output(f, options.out_dir) for f in tensor_set.files}, None


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
             progress: Callable[[str], Callable[[int], None]] | None = None) -> FileReport:
    """Clip one tensor set: pass 1 on every file, one plan, pass 2 on every file, the index last.

    Two runs never rewrite one set at once (see :mod:`tclip.formats.locks`): the second fails."""
    with _run_locks(tensor_set, options):
        return _clip_set(tensor_set, mode, options, dask_address, progress)


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
    except BaseException:
        locks.release()
        raise
    return locks


def _clip_set(tensor_set: TensorSet, mode: Any, options: ClipOptions, dask_address: str | None = None,
              progress: Callable[[str], Callable[[int], None]] | None = None) -> FileReport:
    started = time.perf_counter()
    if isinstance(mode, ValueClip):
        value_bounds(np.dtype(np.float64), mode.clip_value_min, mode.clip_value_max)
    tensor_set = resolve(tensor_set)
    if dask_address is not None:
        tensor_set = absolute(tensor_set)
        if options.out_dir is not None:
            options = replace(options, out_dir=Path(os.path.abspath(options.out_dir)))
    layout = set_layout(tensor_set)
    axes = mode.axes if isinstance(mode, NormClip) else None
    # what a real run writes (a dry run names it, and writes nothing)
    unplanned: TclipError | None = None
    try:
        planned, planned_index = _targets(tensor_set, replace(options, dry_run=False))
    except TclipError as error:
        if not options.dry_run:
            raise
        # a dry run still measures (the global norm), and says the real run needs an output
        unplanned, planned, planned_index = error, {f: None for f in tensor_set.files}, None
    targets, index_target = ({f: None for f in planned}, None) if options.dry_run else (planned, planned_index)
    others = _companions(tensor_set, options) if unplanned is None else Companions()
    if not options.in_place and not options.dry_run:
        check_outputs(*planned_outputs(tensor_set, options))
    overwrite = options.overwrite or options.in_place
    if not overwrite and not options.dry_run:
        for out in [*targets.values(), index_target, *(t for _, t in others.copies)]:
            if out is not None and os.path.lexists(out):
                raise OutputExistsError(("output already exists; pass ", Option.FORCE, " to replace it"), out)
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
    resumed = read_journal(journal, tensor_set, mode, options, record=not options.dry_run) if journal is not None else None
    if options.dry_run:
        journal = None  # a dry run shows what a resumed run would do, and writes nothing
    files = tensor_set.files
    pool = TaskPool(options.budget, len(files), dask_address)
    written: dict[Path, tuple[int, int, int]] = {}  # what this run wrote (not in place), by identity
    fresh: set[Path] = set()  # its outputs where nothing was before (--force replaces, never restores)
    created: list[Path] = []
    try:
        def file_progress(file: Path) -> Callable[[int], None] | None:
            return progress(str(file)) if progress is not None and pool.local else None

        done = set(resumed["done"]) if resumed is not None else set()
        todo = [f for f in files if f not in done]
        selections = {f: _selection_for(tensor_set, f, options.selection, layout) for f in files}
        stats = pool.map(stats_task, [((str(f), selections[f], axes, pool.task_budget),
                                         {"progress": file_progress(f), "layout": layout}) for f in todo])
        report = _set_report(tensor_set, stats, mode, layout)
        report.dry_run = options.dry_run
        if options.dry_run and unplanned is None:
            _would_write(report, options, [(f, planned[f]) for f in todo], planned_index, others.copies)
        elif unplanned is not None:
            report.warnings.append(Note(NoteKind.NO_OUTPUT, ("a real run would fail: ", *unplanned.message)
                                        if isinstance(unplanned.message, tuple) else
                                        f"a real run would fail: {unplanned.message}"))
        report.not_copied = [{"name": name, "reason": why} for name, why in others.left]
        if stats:
            entries = [t for s in stats for t in _listed(tensor_set, s.path, s.tensors, layout)]
            report.warnings += check_selection(entries, logical_names(tensor_set.names, layout), mode, options,
                                               tensor_set.name, "set")
            report.warnings += quantized_notes(stats)
        check_nonfinite(report, options, tensor_set.name)
        if resumed is not None:
            # The finished shards are clipped already: the global norm is the one recorded.
            if isinstance(mode, GlobalNormClip) and mode.use_norm is None:
                mode = GlobalNormClip(mode.clip_norm, resumed["global_norm"])
            report.warnings.append(Note(NoteKind.RESUMED, f"resumed an unfinished run: {len(done)} of {len(files)} "
                                                          "shard(s) were clipped by it already"))
        plan = make_plan(mode, stats)
        for file_stats in stats:  # shards keep their format: bytes shared by tensors are written once
            check_tied(file_stats, plan.work[file_stats.path], mode.name)
        check_quantized_plan(plan, stats, tensor_set.name)
        if not options.dry_run:
            for file_stats in stats:  # nothing is written when a file is not the one measured
                check_same(file_stats.path, file_stats.identity)
        may_miss = rescales_that_may_miss(plan, stats) if len(todo) > 1 and not options.dry_run else {}
        if may_miss:  # where a rescale may miss its factor, check it before any file is written
            pool.map(rewrite_task, [((path, work, None, axes, False, pool.task_budget, options.drop_nonnumeric),
                                     {"layout": layout}) for path, work in may_miss.items()])
        if journal is not None and resumed is None:
            write_journal(journal, tensor_set, mode, options, stats, plan)
            for f in files:  # a marker left by a run given up on (restored, journal removed) means nothing now
                commit_marker(f).unlink(missing_ok=True)
            mark_index(tensor_set, journal)
        if not options.dry_run and not options.in_place:
            created = _make_folders([targets[f] for f in todo], index_target,
                                    None if options.out_dir is None else Path(options.out_dir))
            fresh = {t for t in [*(targets[f] for f in todo), index_target, *(t for _, t in others.copies)]
                     if t is not None and not os.path.lexists(t)}
        calls, order = [], []
        for f, s in zip(todo, stats):
            target = targets[f]
            # In place, a task leaves a commit marker just before its rename: run again
            # (Dask's retry), it finds its shard done; resumed after a crash, so does the run.
            marker = {"commit_marker": str(commit_marker(f))} if options.in_place and not options.dry_run else {}
            calls.append(((str(f), plan.work[s.path], None if target is None else str(target), axes,
                           overwrite or not pool.local, pool.task_budget, options.drop_nonnumeric),
                          {"progress": file_progress(f), "layout": layout, "expect": s.identity, **marker}))
            order.append(f)
        results = _rewrite_all(pool, calls, order, journal, tensor_set, None if options.in_place else written)
        rewrites = {r.path: r for r in results}
        _finish_set_report(report, stats, plan, rewrites, targets)
        if plan.global_norm is not None:
            report.global_norm = plan.global_norm
        if index_target is not None and not options.in_place:
            copy_companions(others.copies, overwrite, written)
            report.copied = [source.name for source, _ in others.copies]
        if index_target is not None:
            identity = write_index(tensor_set, index_target, [targets[f] for f in files], overwrite=overwrite)
            if identity is not None and not options.in_place:
                written[index_target] = identity
            report.output = str(index_target)
            if journal is not None:
                journal.unlink(missing_ok=True)
                for f in files:  # a marker a crash left beside a shard the journal had recorded
                    commit_marker(f).unlink(missing_ok=True)
    except BaseException:
        pool.close()  # every task has stopped: what it wrote can go
        _remove_written({path: mine for path, mine in written.items() if path in fresh}, created)
        raise
    finally:
        pool.close()
    report.elapsed_s = time.perf_counter() - started
    return report


def _would_write(report: FileReport, options: ClipOptions, outputs: list[tuple[Path, Path | None]],
                 index_target: Path | None, copies: list[tuple[Path, Path]]) -> None:
    """A dry run's account of what the real run would write: each file's output (the
    shards a resumed run has still to do), the folder's other files it would copy and
    the index, each saying whether it exists."""
    report.in_place, report.overwrite = options.in_place, options.overwrite
    report.would_write_files = [{"file": str(f), "output": str(t), "exists": os.path.lexists(t)}
                                for f, t in outputs if t is not None]
    report.would_copy = [{"file": str(f), "output": str(t), "exists": os.path.lexists(t)} for f, t in copies]
    if index_target is not None:
        report.would_write, report.output_exists = str(index_target), os.path.lexists(index_target)


def _make_folders(targets: list[Path | None], index_target: Path | None, out_dir: Path | None) -> list[Path]:
    """The folders the outputs go into (shards in a subfolder of the index's folder keep
    it), created; those this run made, innermost first. A subfolder of ``out_dir`` that
    is a symlink is refused: the shards would land wherever it points."""
    created: list[Path] = []
    folders = list(dict.fromkeys(t.parent for t in [*targets, index_target] if t is not None))
    for target in folders:
        if out_dir is None or not target.is_relative_to(out_dir):
            continue
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
                 written: dict[Path, tuple[int, int, int]] | None) -> list[RewriteResult]:
    """Pass 2 on every file. In place, every shard that is replaced is written down in the
    journal as soon as it is, even when the run stops (an error, Ctrl-C) while other shards
    are being written; into new files, what each task wrote goes into ``written`` (a failed
    run removes those, and only those)."""
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
            written[Path(result.output)] = result.written

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


def _listed(tensor_set: TensorSet, file: str, tensors: list[Any], layout: QuantLayout | None = None) -> list[Any]:
    """The tensors (entries or report lines) of ``file`` that are the set's: with an index,
    those it maps to the file (a shard's other tensors are not the set's), and the quantized
    weights the file's passes measure; the ones the globs leave out are the set's, counted
    as not selected."""
    if tensor_set.allow is None:
        return list(tensors)
    allowed = tensor_set.allow[Path(file)]
    owned = frozenset(layout.owned_by(file)) if layout else frozenset()
    return [t for t in tensors if t.name in allowed or t.name in owned]


def _set_report(tensor_set: TensorSet, stats: list[FileStats], mode: Any,
                layout: QuantLayout | None = None) -> FileReport:
    report = FileReport(file=tensor_set.name, mode=mode.name, params=mode_params(mode),
                        format=stats[0].format if stats else None)
    for s in stats:
        part = start_report(s, mode.name, {})
        report.tensors += _listed(tensor_set, s.path, part.tensors, layout)
        report.others += part.others
        report.bytes_read += part.bytes_read
    report.members = [{"file": s.path, "output": None} for s in stats]
    return report


def _finish_set_report(report: FileReport, stats: list[FileStats], plan: Plan, rewrites: dict[str, RewriteResult],
                       targets: dict[Path, Path | None]) -> None:
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


def report_set(tensor_set: TensorSet, selection: Selection, order: str, axes: Any, moments: bool, budget: Budget,
               progress: Callable[[str], Callable[[int], None]] | None = None,
               dask_address: str | None = None, max_norm: float | None = None) -> FileReport:
    """The read-only report of a set: every tensor of every file, one global norm."""
    started = time.perf_counter()
    tensor_set = resolve(tensor_set)
    if dask_address is not None:
        tensor_set = absolute(tensor_set)
    layout = set_layout(tensor_set)
    pool = TaskPool(budget, len(tensor_set.files), dask_address)
    try:
        stats = pool.map(stats_task, [((str(f), _selection_for(tensor_set, f, selection, layout), axes,
                                         pool.task_budget),
                                         {"track_l1": order == "1", "track_moments": moments,
                                          "whole_if_rank_skip": True, "layout": layout,
                                          "progress": progress(str(f)) if progress is not None else None})
                                        for f in tensor_set.files])
    finally:
        pool.close()
    merged = FileStats(tensor_set.name, stats[0].format if stats else "", sum(s.size_bytes for s in stats),
                       [t for s in stats for t in _listed(tensor_set, s.path, s.tensors, layout)],
                       {k: v for s in stats for k, v in s.stats.items()},
                       [o for s in stats for o in s.others], tensor_set.metadata,
                       sum(s.bytes_read for s in stats),
                       findings={k: v for s in stats for k, v in s.findings.items()},
                       unmeasured_others=[n for s in stats for n in s.unmeasured_others],
                       shared=SharedElements.merged([s.shared for s in stats]),
                       owned={k: v for s in stats for k, v in s.owned.items()})
    params: dict[str, Any] = {"ord": order}
    if axes is not None:
        params["axes"] = list(axes)
    if max_norm is not None:
        params["max_norm"] = max_norm
    report = report_from_stats(merged, order, params, selection)
    report.members = [{"file": s.path, "output": None} for s in stats]
    if IN_PROGRESS_KEY in tensor_set.metadata:
        report.warnings.append(Note(NoteKind.INTERRUPTED, ("an in-place run was interrupted here: some shards may be "
                                                           "clipped and others not (rerun it with ", Option.IN_PLACE,
                                                           " to finish it)")))
    report.elapsed_s = time.perf_counter() - started
    return report


def index_info(path: Path) -> InfoReport:
    """The headers of every shard an index names, as one info report (no tensor data read)."""
    tensor_set = resolve(TensorSet(str(path), [], Path(path)))
    layout = set_layout(tensor_set)
    tensors, others = [], []
    size = path.stat().st_size if tensor_set.index is not None else 0  # (a GGUF split set has no index)
    fmt = ""
    base = tensor_set.index.parent if tensor_set.index is not None else tensor_set.files[0].parent
    names = {file: file.relative_to(base).as_posix() for file in tensor_set.files}
    for file in tensor_set.files:
        info = file_info(file, layout if layout else None)
        fmt = info.format
        size += info.size_bytes
        allowed = (tensor_set.allow[file] | frozenset(layout.owned_by(str(file)))) \
            if tensor_set.allow is not None else None
        tensors += [replace(t, file=names[file]) for t in info.tensors if allowed is None or t.name in allowed]
        others += info.others
    metadata = tensor_set.metadata
    metadata["shards"] = len(tensor_set.files)
    kind = "index" if tensor_set.index is not None else "split set"
    return InfoReport(str(path), f"{fmt} {kind}", size, tensors, metadata, others,
                      files=[names[f] for f in tensor_set.files])
