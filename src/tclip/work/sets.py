"""Tensor sets: sharded checkpoints, explicit file lists, clusters, and a single file (a
set of one). Here: where per-file tasks run, how inputs group into sets, and the read-only
commands over a set (:func:`report_set`, :func:`set_info`); clipping is in :mod:`tclip.work.clip`.

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
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..core.stats import Axes, AxesLike, parse_axes
from ..errors import TclipError, UnsupportedError
from ..formats import SharedElements
from ..formats.atomic import identity_of, marker_names
from ..formats.locks import shared_locks
from ..formats.registry import open_reader
from ..formats.sharded import GGUF_SPLIT_NAME, IN_PROGRESS_KEY, TensorSet, is_index, resolve, set_anchor
from ..messages import Option
from ..text import natural_key
from ..quant.layout import QuantLayout
from ..quant.view import layout_of_files, open_logical
from .budget import Budget
from .passes import HeldTensors, Progress
from .plan import TensorWork
from .reporting import report_from_stats
from .results import FileReport, InfoReport, InfoTensor, Note, NoteKind, OtherReport
from .rewrite import RewriteResult, rewrite_file
from .selection import Selection
from .statistics import FileStats, file_statistics

def stats_task(path: str, selection: Selection, axes: Axes, budget: Budget, track_l1: bool = False,
               track_moments: bool = False, whole_if_rank_skip: bool = False,
               progress: Callable[[int], None] | None = None, layout: QuantLayout | None = None,
               held: HeldTensors | None = None) -> FileStats:
    """Pass 1 of one file, on whatever machine runs it (``layout``: the set's quantized weights;
    ``held``: tensors small enough to keep for pass 2, in this process).
    The statistics say which file they are of (``identity``): pass 2 rewrites only that file."""
    before = identity_of(path)
    stats = file_statistics(path, selection=selection, axes=axes, budget=budget, track_l1=track_l1,
                            track_moments=track_moments, whole_if_rank_skip=whole_if_rank_skip, progress=progress,
                            layout=layout, held=held)
    if identity_of(path) != before:
        raise TclipError("was replaced or changed while tclip read it (by another run or program); nothing was "
                         "written", path)
    stats.identity = before
    return stats


def rewrite_task(path: str, work: dict[str, TensorWork], target: str | None, axes: Axes, overwrite: bool,
                 budget: Budget, drop_nonnumeric: bool, progress: Callable[[int], None] | None = None,
                 commit_marker: str | None = None, layout: QuantLayout | None = None,
                 expect: tuple[int, int, int] | None = None, measure_after: bool = True,
                 held: HeldTensors | None = None) -> RewriteResult:
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
                        expect=expect, measure_after=measure_after, held=held)


def _found_done(path: str, work: dict[str, TensorWork], target: str | None, axes: Axes, budget: Budget,
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
            self.task_budget = budget if files == 1 else budget.share(self.parallel)
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


def alone(tensor_set: TensorSet) -> bool:
    """Whether a set is one loose file (no index, not a GGUF split set): it is reported as that file."""
    return tensor_set.index is None and len(tensor_set.files) == 1 and not tensor_set.keep_names


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


def report_set(tensor_set: TensorSet, selection: Selection, order: str, axes: Axes, moments: bool, budget: Budget,
               progress: Callable[[str], Callable[[int], None]] | None = None,
               dask_address: str | None = None, max_norm: float | None = None) -> FileReport:
    """The read-only report of a set: every tensor of every file, one global norm. A set of
    one loose file reports as that file (its name and metadata, no ``files`` list).

    A set with an index is read under a shared lock on it (:mod:`tclip.formats.locks`): a run
    rewriting the set in place replaces its shards one by one, and a report reading them
    meanwhile would sum old shards with new ones; the one that comes second fails at once.
    (A loose file needs none: it is replaced whole, by rename, and read through one descriptor.)"""
    with shared_locks([] if tensor_set.index is None else [tensor_set.index]):
        return _report_set(tensor_set, selection, order, axes, moments, budget, progress, dask_address, max_norm)


def _report_set(tensor_set: TensorSet, selection: Selection, order: str, axes: Axes, moments: bool, budget: Budget,
                progress: Callable[[str], Callable[[int], None]] | None, dask_address: str | None,
                max_norm: float | None) -> FileReport:
    started = time.perf_counter()
    one = alone(tensor_set)
    tensor_set = tensor_set if one else resolve(tensor_set)  # (one file: its reader says what is wrong)
    if dask_address is not None:
        tensor_set = absolute(tensor_set)
    layout = None if one else set_layout(tensor_set)
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
    params: dict[str, Any] = {"ord": order}
    if axes is not None:
        params["axes"] = list(axes)
    if max_norm is not None:
        params["max_norm"] = max_norm
    report = report_from_stats(stats[0] if one else _merged(tensor_set, stats, layout), order, params, selection)
    if not one:
        report.members = [{"file": s.path, "output": None} for s in stats]
    if IN_PROGRESS_KEY in tensor_set.metadata:
        report.warnings.append(Note(NoteKind.INTERRUPTED, ("an in-place run was interrupted here: some shards may be "
                                                           "clipped and others not (rerun it with ", Option.IN_PLACE,
                                                           " to finish it)")))
    report.elapsed_s = time.perf_counter() - started
    return report


def _merged(tensor_set: TensorSet, stats: list[FileStats], layout: QuantLayout | None) -> FileStats:
    """Pass 1 of every file of a set, as the statistics of one file."""
    return FileStats(tensor_set.name, stats[0].format if stats else "", sum(s.size_bytes for s in stats),
                     [t for s in stats for t in _listed(tensor_set, s.path, s.tensors, layout)],
                     {k: v for s in stats for k, v in s.stats.items()},
                     [o for s in stats for o in s.others], tensor_set.metadata,
                     sum(s.bytes_read for s in stats),
                     findings={k: v for s in stats for k, v in s.findings.items()},
                     unmeasured_others=[n for s in stats for n in s.unmeasured_others],
                     shared=SharedElements.merged([s.shared for s in stats]),
                     owned={k: v for s in stats for k, v in s.owned.items()})


def report_file(path: Path | str, *, axes: AxesLike = None, ord: str = "2", selection: Selection | None = None,
                block_bytes: int | None = None, progress: Progress | None = None, moments: bool = False,
                memory: int = Budget.memory, threads: int = 0, max_norm: float | None = None) -> FileReport:
    """Read a file and report the norms and statistics of its tensors; writes nothing:
    :func:`report_set` on the set of that one file.

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
    return report_set(TensorSet(str(path), [path]), selection or Selection(), ord, parse_axes(axes), moments,
                      Budget(memory, threads, block_bytes), None if progress is None else (lambda _: progress),
                      max_norm=max_norm)


def as_set(path: Path) -> TensorSet:
    """The set an input stands for: an index's (or a GGUF split set's), else the set of that one file."""
    return TensorSet(str(path), [], Path(path)) if is_index(path) else TensorSet(str(path), [Path(path)])


def set_info(tensor_set: TensorSet) -> InfoReport:
    """Names, shapes, dtypes, sizes and metadata from the headers alone (no tensor data read):
    a set of one loose file is that file's info; a set of many lists its files."""
    if alone(tensor_set):
        return _header_info(tensor_set.files[0])
    path = tensor_set.index if tensor_set.index is not None else tensor_set.files[0]
    tensor_set = resolve(tensor_set)
    layout = set_layout(tensor_set)
    tensors, others = [], []
    size = path.stat().st_size if tensor_set.index is not None else 0  # (a GGUF split set has no index)
    fmt = ""
    base = tensor_set.index.parent if tensor_set.index is not None else tensor_set.files[0].parent
    names = {file: file.relative_to(base).as_posix() for file in tensor_set.files}
    for file in tensor_set.files:
        info = _header_info(file, layout if layout else None)
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


def index_info(path: Path) -> InfoReport:
    """The headers of every shard an index names, as one info report: :func:`set_info`."""
    return set_info(TensorSet(str(path), [], Path(path)))


def file_info(path: Path | str, layout: QuantLayout | None = None) -> InfoReport:
    """Names, shapes, dtypes, sizes and metadata from the header alone: :func:`set_info` on
    the set of that one file (``layout``: the quantized weights of a set it is part of)."""
    path = Path(path)
    return set_info(TensorSet(str(path), [path])) if layout is None else _header_info(path, layout)


def _header_info(path: Path, layout: QuantLayout | None = None) -> InfoReport:
    """One file's header as an info report; a quantized weight is one tensor of its real shape,
    its scheme shown as its dtype (``layout``: of its set)."""
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
        _chunk_files(reader, info)
        return info


def _chunk_files(reader: Any, info: InfoReport) -> None:
    """A DCP folder's info: which ``.distcp`` files hold each tensor, every file with its size, and
    the size of the whole checkpoint (all its files)."""
    if reader.format_name != "dcp":
        return
    for t in info.tensors:
        t.chunk_files = list(dict.fromkeys(reader.chunk_files(t.name)))
    info.storage_files = dict(sorted(reader.storage_files().items(), key=lambda item: natural_key(item[0])))
    from ..formats.dcp.objects import checkpoint_size

    info.size_bytes = checkpoint_size(reader)  # (the checkpoint's, not its .metadata's: info's title says so)
