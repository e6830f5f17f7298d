"""One tensor set across many files: sharded checkpoints, explicit file lists, clusters.

A set is either the shards an index names (``model.safetensors.index.json``, as
``save_pretrained`` and PyTorch's Hugging Face storage writer write it: its
``weight_map`` maps every tensor to its shard) or a list of files given with
``--across-files`` (one gradient file per pipeline stage, say). The work is the
pipeline's three steps over all files:

1. pass 1 per file (:func:`stats_task`), on an executor: a local thread pool
   by default, a ``dask.distributed`` cluster with ``--dask`` (its
   ``Client.get_executor()`` is a ``concurrent.futures.Executor``);
2. one plan over every file's statistics (one global norm: an exact sum of
   every tensor's sum of squares, so any split into files gives the same bits);
3. pass 2 per file (:func:`rewrite_task`), each shard written atomically; the
   index last.

Only per-tensor statistics cross process boundaries, never tensors: each task
opens its own files by path.

An index is data from the file system, so it is checked like any file: JSON
without duplicate keys, shard names inside the index's folder, every listed
tensor present in its shard and no tensor in two shards.

``--in-place`` on an index keeps a journal beside it
(``NAME.index.json.tclip-journal``) and marks the index while shards are being
replaced; see README ("Sharded checkpoints") for what a crash leaves and how
to resume.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .engine import Budget
from .errors import FormatError, OutputExistsError, TclipError, UnsupportedError
from .formats import TensorReader
from .formats.atomic import marker_names
from .pipeline import (
    ClipOptions,
    FileStats,
    Plan,
    RewriteResult,
    Selection,
    TensorWork,
    check_outputs,
    default_output,
    file_statistics,
    finish_report,
    make_plan,
    mode_params,
    report_from_stats,
    refuse_quantized,
    rewrite_file,
    start_report,
)
from .report import FileReport, InfoReport

INDEX_SUFFIX = ".index.json"
MAX_INDEX_BYTES = 256 << 20
JOURNAL_SUFFIX = ".tclip-journal"
MARKER_SUFFIX = ".tclip-commit"
IN_PROGRESS_KEY = "tclip_in_progress"


def is_index(path: Path | None) -> bool:
    return path is not None and Path(path).name.endswith(INDEX_SUFFIX) and Path(path).is_file()


@dataclass
class TensorSet:
    """Files that hold one set of tensors; ``allow`` maps each file to the names the index gives it."""

    name: str
    files: list[Path]
    index: Path | None = None
    index_data: dict[str, Any] = field(default_factory=dict)
    allow: dict[Path, frozenset[str]] | None = None
    names: list[str] = field(default_factory=list)  # every tensor of the set (filled when resolved)

    @property
    def metadata(self) -> dict[str, Any]:
        return dict(self.index_data.get("metadata") or {})


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def load_index(path: Path) -> TensorSet:
    """Read and check an index: its shards, in the order they first appear, and each one's tensors."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_INDEX_BYTES:
            raise FormatError(f"index larger than {MAX_INDEX_BYTES >> 20} MiB", path)
        data = json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise FormatError(f"not a valid index (JSON: {str(error)[:200]})", path) from None
    except OSError as error:
        raise TclipError(f"cannot read ({error.strerror or error})", path) from None
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise FormatError("not a valid index: no \"weight_map\" object mapping tensors to shard files", path)
    if "metadata" in data and not isinstance(data["metadata"], dict):
        raise FormatError("not a valid index: \"metadata\" is not an object", path)
    folder = path.parent
    files: dict[str, Path] = {}
    names: dict[Path, set[str]] = {}
    for tensor, shard in data["weight_map"].items():
        if not isinstance(shard, str) or not shard:
            raise FormatError(f"index maps tensor {tensor!r} to {shard!r}, not a file name", path)
        parts = shard.replace("\\", "/").split("/")
        if shard.startswith(("/", "\\")) or ".." in parts or ":" in parts[0] or "\0" in shard:
            raise FormatError(f"index maps tensor {tensor!r} to {shard!r}, outside the index's folder", path)
        file = files.setdefault(shard, folder / shard)
        names.setdefault(file, set()).add(tensor)
    if not files:
        raise FormatError("index lists no tensors", path)
    return TensorSet(str(path), list(files.values()), path, data, {f: frozenset(n) for f, n in names.items()})


def check_members(tensor_set: TensorSet, headers: dict[Path, list[str]]) -> None:
    """Every tensor the index gives a shard is there, and no tensor is in two files."""
    where: dict[str, Path] = {}
    for file in tensor_set.files:
        present = set(headers[file])
        if tensor_set.allow is not None:
            missing = sorted(tensor_set.allow[file] - present)
            if missing:
                raise FormatError(f"the index maps tensor {missing[0]!r} to {file.name}, which does not hold it"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                                  tensor_set.index)
        for name in headers[file]:
            if name in where:
                raise FormatError(f"tensor {name!r} is in two files: {where[name]} and {file}",
                                  tensor_set.index or file)
            where[name] = file


def _headers(files: list[Path]) -> dict[Path, list[str]]:
    from .formats import open_reader

    out = {}
    for file in files:
        with open_reader(file) as reader:
            out[file] = list(reader.tensors)
    return out


# --------------------------------------------------------------------------- tasks (picklable)


def stats_task(path: str, selection: Selection, axes: Any, budget: Budget, track_l1: bool = False,
               track_moments: bool = False, whole_if_rank_skip: bool = False,
               progress: Callable[[int], None] | None = None) -> FileStats:
    """Pass 1 of one file, on whatever machine runs it."""
    return file_statistics(path, selection=selection, axes=axes, budget=budget, track_l1=track_l1,
                           track_moments=track_moments, whole_if_rank_skip=whole_if_rank_skip, progress=progress)


def rewrite_task(path: str, work: dict[str, TensorWork], target: str | None, axes: Any, overwrite: bool,
                 budget: Budget, drop_nonnumeric: bool, progress: Callable[[int], None] | None = None,
                 commit_marker: str | None = None) -> RewriteResult:
    """Pass 2 of one file, on whatever machine runs it; the output appears atomically."""
    return rewrite_file(path, work, None if target is None else Path(target), axes=axes, overwrite=overwrite,
                        budget=budget, progress=progress, drop_nonnumeric=drop_nonnumeric,
                        commit_marker=None if commit_marker is None else Path(commit_marker))


# --------------------------------------------------------------------------- executors


class Engine:
    """Where per-file tasks run: a local thread pool, or a Dask cluster."""

    def __init__(self, budget: Budget, files: int, dask_address: str | None) -> None:
        self.client: Any = None
        self.local = dask_address is None
        if dask_address is None:
            self.parallel = max(1, min(files, budget.workers))
            self.task_budget = budget.share(self.parallel)
            self.executor: Executor = ThreadPoolExecutor(self.parallel, thread_name_prefix="tclip-file")
        else:
            try:
                from dask.distributed import Client
            except ImportError:
                raise UnsupportedError("--dask needs dask.distributed: pip install 'tclip[dask]'") from None
            try:
                self.client = Client(dask_address, timeout="30s", set_as_default=False)
            except (OSError, TimeoutError, ValueError) as error:
                raise TclipError(f"cannot reach the Dask scheduler at {dask_address} ({error})") from None
            # Each worker runs its tasks with the budget given (its --memory and --threads).
            self.parallel = files
            self.task_budget = budget
            self.executor = self.client.get_executor(retries=2, pure=False)

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


# --------------------------------------------------------------------------- grouping inputs


def group_sets(inputs: list[tuple[str, Path | None]], across: bool) -> list[tuple[str, TensorSet | None]]:
    """Indexes become sets; with ``across`` all other files form one set; else each file is its own set."""
    out: list[tuple[str, TensorSet | None]] = []
    loose: list[Path] = []
    for name, path in inputs:
        if path is None:
            out.append((name, None))
        elif is_index(path):
            out.append((name, TensorSet(name, [], path)))
        elif across:
            loose.append(path)
        else:
            out.append((name, TensorSet(name, [path])))
    if loose:
        label = f"{len(loose)} files" if len(loose) > 1 else str(loose[0])
        out.append((label, TensorSet(label, loose)))
    return out


def _resolve(tensor_set: TensorSet) -> TensorSet:
    if tensor_set.index is not None and not tensor_set.files:
        loaded = load_index(tensor_set.index)
        loaded.name = tensor_set.name
        tensor_set = loaded
    for file in tensor_set.files:
        if not file.is_file():
            raise TclipError(f"shard {file.name} is missing" if tensor_set.index else "no such file", file)
    headers = _headers(tensor_set.files)
    check_members(tensor_set, headers)
    tensor_set.names = [n for f in tensor_set.files for n in headers[f]
                        if tensor_set.allow is None or n in tensor_set.allow[f]]
    return tensor_set


def _selection_for(tensor_set: TensorSet, file: Path, selection: Selection) -> Selection:
    if tensor_set.allow is None:
        return selection
    return replace(selection, allow=tensor_set.allow[file])


# --------------------------------------------------------------------------- clipping a set


def _targets(tensor_set: TensorSet, options: ClipOptions) -> tuple[dict[Path, Path | None], Path | None]:
    """Each file's output, and the index's."""
    if options.dry_run:
        return {f: None for f in tensor_set.files}, None
    if tensor_set.index is not None:
        if options.in_place:
            return {f: f for f in tensor_set.files}, tensor_set.index
        if options.out_dir is None:
            raise TclipError("a sharded checkpoint needs --out-dir DIR (shards and index keep their names) "
                             "or --in-place", tensor_set.index)
        folder = Path(options.out_dir)
        if folder.resolve() == tensor_set.index.parent.resolve():
            raise TclipError("--out-dir is the checkpoint's own folder; use --in-place for that", tensor_set.index)
        return ({f: folder / f.relative_to(tensor_set.index.parent) for f in tensor_set.files},
                folder / tensor_set.index.name)
    if options.in_place:
        return {f: f for f in tensor_set.files}, None
    return {f: default_output(f, options.out_dir) for f in tensor_set.files}, None


def planned_outputs(tensor_set: TensorSet, options: ClipOptions) -> tuple[dict[Path, Path], list[Path]]:
    """What a run that is not ``--in-place`` would write: each input (shards and index)
    with its output, and every input of the set, for :func:`tclip.pipeline.check_outputs`."""
    if tensor_set.index is not None and not tensor_set.files:
        tensor_set = load_index(tensor_set.index)
    targets, index_target = _targets(tensor_set, replace(options, dry_run=False))
    outputs: dict[Path, Path] = {f: t for f, t in targets.items() if t is not None}
    inputs = list(tensor_set.files)
    if tensor_set.index is not None:
        inputs.append(tensor_set.index)
        if index_target is not None:
            outputs[tensor_set.index] = index_target
    return outputs, inputs


def clip_set(tensor_set: TensorSet, mode: Any, options: ClipOptions, dask_address: str | None = None,
             progress: Callable[[str], Callable[[int], None]] | None = None) -> FileReport:
    """Clip one tensor set: pass 1 on every file, one plan, pass 2 on every file, the index last."""
    import numpy as np

    from .core.modes import GlobalNormClip, NormClip, ValueClip, value_bounds

    started = time.perf_counter()
    if isinstance(mode, ValueClip):
        value_bounds(np.dtype(np.float64), mode.clip_value_min, mode.clip_value_max)
    tensor_set = _resolve(tensor_set)
    refuse_quantized(tensor_set.names, options.selection, tensor_set.name)
    axes = mode.axes if isinstance(mode, NormClip) else None
    targets, index_target = _targets(tensor_set, options)
    if not options.in_place and not options.dry_run:
        check_outputs(*planned_outputs(tensor_set, options))
    overwrite = options.overwrite or options.in_place
    if not overwrite:
        for out in [*targets.values(), index_target]:
            if out is not None and os.path.lexists(out):
                raise OutputExistsError("output already exists; pass --force to replace it", out)
    journal = _journal_path(tensor_set) if options.in_place and tensor_set.index is not None else None
    if IN_PROGRESS_KEY in tensor_set.metadata:
        # A half-clipped checkpoint: clipping it anew would take the norm of a mix.
        if journal is None:
            raise TclipError("an in-place run was interrupted here and some shards may be clipped and others "
                             "not; finish it by rerunning that command (with --in-place), or restore the "
                             "checkpoint", tensor_set.index)
        if not journal.exists():
            raise TclipError(f"the index says an in-place run was interrupted, but its journal ({journal.name}) "
                             "is missing; restore the checkpoint from a copy", tensor_set.index)
    resumed = _read_journal(journal, mode, options, record=not options.dry_run) if journal is not None else None
    if options.dry_run:
        journal = None  # a dry run shows what a resumed run would do, and writes nothing
    files = tensor_set.files
    engine = Engine(options.budget, len(files), dask_address)
    try:
        def file_progress(file: Path) -> Callable[[int], None] | None:
            return progress(str(file)) if progress is not None and engine.local else None

        done = set(resumed["done"]) if resumed is not None else set()
        todo = [f for f in files if str(f) not in done]
        selections = {f: _selection_for(tensor_set, f, options.selection) for f in files}
        stats = engine.map(stats_task, [((str(f), selections[f], axes, engine.task_budget),
                                         {"progress": file_progress(f)}) for f in todo])
        report = _set_report(tensor_set, stats, mode)
        report.dry_run = options.dry_run
        _set_checks(report, stats, options, tensor_set)
        if resumed is not None:
            # The finished shards are clipped already: the global norm is the one recorded.
            if isinstance(mode, GlobalNormClip) and mode.use_norm is None:
                mode = GlobalNormClip(mode.clip_norm, resumed["global_norm"])
            report.warnings.append(f"resumed an unfinished run: {len(done)} of {len(files)} shard(s) were "
                                   "clipped by it already")
        plan = make_plan(mode, stats)
        if journal is not None and resumed is None:
            _write_journal(journal, tensor_set, mode, options, stats, plan)
            for f in files:  # a marker left by a run given up on (restored, journal removed) means nothing now
                _commit_marker(f).unlink(missing_ok=True)
            _mark_index(tensor_set, journal)
        calls, order = [], []
        for f, s in zip(todo, stats):
            target = targets[f]
            marker = {"commit_marker": str(_commit_marker(f))} if journal is not None else {}
            calls.append(((str(f), plan.work[s.path], None if target is None else str(target), axes,
                           overwrite or not engine.local, engine.task_budget, options.drop_nonnumeric),
                          {"progress": file_progress(f), **marker}))
            order.append(f)
        results = _rewrite_all(engine, calls, order, journal)
        rewrites = {r.path: r for r in results}
        _finish_set_report(report, stats, plan, rewrites, targets)
        if plan.global_norm is not None:
            report.global_norm = plan.global_norm
        if index_target is not None:
            _write_index(tensor_set, index_target, [targets[f] for f in files], overwrite=overwrite)
            report.output = str(index_target)
            if journal is not None:
                journal.unlink(missing_ok=True)
    finally:
        engine.close()
    report.elapsed_s = time.perf_counter() - started
    return report


def _rewrite_all(engine: Engine, calls: list, order: list[Path], journal: Path | None) -> list[RewriteResult]:
    if journal is None:
        return engine.map(rewrite_task, calls)
    # In place: every shard that is replaced is written down in the journal as soon as it
    # is, even when the run stops (an error, Ctrl-C) while other shards are being written.
    futures = {engine.executor.submit(rewrite_task, *args, **kwargs): file
               for (args, kwargs), file in zip(calls, order)}
    results: dict[Path, RewriteResult] = {}
    try:
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            _journal_done(journal, futures[future])
    except BaseException:
        for future in futures:
            future.cancel()
        wait(list(futures))
        for future, file in futures.items():
            if file not in results and future.done() and not future.cancelled() and future.exception() is None:
                _journal_done(journal, file)
        raise
    return [results[f] for f in order]


def _set_report(tensor_set: TensorSet, stats: list[FileStats], mode: Any) -> FileReport:
    report = FileReport(file=tensor_set.name, mode=mode.name, params=mode_params(mode),
                        format=stats[0].format if stats else None)
    for s in stats:
        part = start_report(s, mode.name, {})
        report.tensors += [t for t in part.tensors if t.skipped != "not selected" or tensor_set.allow is None]
        report.others += part.others
        report.bytes_read += part.bytes_read
    report.members = [{"file": s.path, "output": None} for s in stats]
    return report


def _set_checks(report: FileReport, stats: list[FileStats], options: ClipOptions, tensor_set: TensorSet) -> None:
    from .errors import NonFiniteError
    from .pipeline import _nonfinite_message, is_rank_skip

    names = [t.name for t in report.tensors]
    for pattern in options.selection.unmatched(names):
        report.warnings.append(f"pattern {pattern!r} matches no tensor")
    rank_skips = [t for t in report.tensors if is_rank_skip(t.skipped)]
    if rank_skips:
        listing = ", ".join(f"{t.name} ({t.skipped})" for t in rank_skips[:20])
        if options.strict:
            raise TclipError(f"--axes does not fit {len(rank_skips)} tensor(s): {listing}", tensor_set.name)
        report.warnings.append(f"{len(rank_skips)} tensor(s) left unchanged: {listing}")
    refused = [t for t in report.tensors if t.skipped and ("external storage" in t.skipped
                                                             or "virtual dataset" in t.skipped)]
    if refused:
        raise UnsupportedError(f"tensor {refused[0].name!r}: {refused[0].skipped}; nothing was written",
                               tensor_set.name)
    if options.nonfinite == "error" and any(t.nonfinite for t in report.tensors if t.skipped is None):
        raise NonFiniteError(_nonfinite_message(report), tensor_set.name)


def _finish_set_report(report: FileReport, stats: list[FileStats], plan: Plan, rewrites: dict[str, RewriteResult],
                       targets: dict[Path, Path | None]) -> None:
    by_name = {t.name: t for t in report.tensors}
    for s in stats:
        part = FileReport(file=s.path, mode=report.mode)
        part.tensors = [by_name[t.name] for t in s.tensors if t.name in by_name]
        finish_report(part, s, plan, rewrites.get(s.path))
        report.bytes_read += rewrites[s.path].bytes_read if s.path in rewrites else 0
        report.bytes_written += rewrites[s.path].bytes_written if s.path in rewrites else 0
        report.warnings += rewrites[s.path].warnings if s.path in rewrites else []
    picked = [t for t in report.tensors if t.skipped is None]
    report.global_norm = plan.global_norm if plan.global_norm is not None else \
        math.sqrt(math.fsum((t.norm or 0.0) ** 2 for t in picked))
    if all(t.norm_after is not None for t in picked):
        report.global_norm_after = math.sqrt(math.fsum(t.norm_after ** 2 for t in picked))  # type: ignore[operator]
    report.members = [{"file": s.path, "output": None if targets[Path(s.path)] is None else str(targets[Path(s.path)]),
                       "bytes_written": rewrites[s.path].bytes_written if s.path in rewrites else 0}
                      for s in stats]


# --------------------------------------------------------------------------- the index


def _write_index(tensor_set: TensorSet, target: Path, shards: list[Path | None], overwrite: bool) -> None:
    """The index, last: same weight_map, total_size recomputed from the written shards'
    headers (all of them: a resumed run rewrites only some)."""
    from .formats import open_reader

    data = json.loads(json.dumps(tensor_set.index_data))
    metadata = dict(data.get("metadata") or {})
    metadata.pop(IN_PROGRESS_KEY, None)
    total = 0
    for shard in shards:
        assert shard is not None
        with open_reader(shard) as reader:
            total += sum(t.nbytes for t in reader.tensors.values())
    metadata["total_size"] = total
    data["metadata"] = metadata
    _atomic_json(target, data, tensor_set.index, overwrite=overwrite)


def _journal_path(tensor_set: TensorSet) -> Path:
    assert tensor_set.index is not None
    return tensor_set.index.with_name(tensor_set.index.name + JOURNAL_SUFFIX)


def _mark_index(tensor_set: TensorSet, journal: Path) -> None:
    """While shards are replaced in place, the index says so (and where the journal is)."""
    assert tensor_set.index is not None
    data = json.loads(json.dumps(tensor_set.index_data))
    metadata = dict(data.get("metadata") or {})
    metadata[IN_PROGRESS_KEY] = (f"tclip is replacing this checkpoint's shards in place; until this key is gone "
                                 f"some shards may be clipped and others not. See {journal.name}.")
    data["metadata"] = metadata
    _atomic_json(tensor_set.index, data, tensor_set.index)


def _atomic_json(target: Path, data: Any, mode_from: Path | None = None, overwrite: bool = True) -> None:
    from .formats.atomic import AtomicOutput

    output = AtomicOutput(target, overwrite=overwrite, mode_from=mode_from)
    try:
        with os.fdopen(output.open(), "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, ensure_ascii=False)
            handle.write("\n")
        output.commit()
    except BaseException:
        output.abort()
        raise


def _write_journal(journal: Path, tensor_set: TensorSet, mode: Any, options: ClipOptions, stats: list[FileStats],
                   plan: Plan) -> None:
    """What an unfinished in-place run needs to finish: the plan's one number (the
    global norm, in exact hex form) and which shards are done. Plain JSON."""
    state = {
        "tclip_journal": 1,
        "mode": mode.name,
        "params": {k: (v.hex() if isinstance(v, float) else v) for k, v in mode_params(mode).items()},
        "selection": [list(options.selection.include), list(options.selection.exclude)],
        "global_norm": None if plan.global_norm is None else float(plan.global_norm).hex(),
        "done": [],
        "files": {str(f): [os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in tensor_set.files},
    }
    _atomic_json(journal, state)


def _commit_marker(shard: Path) -> Path:
    """Where the task that replaces ``shard`` in place says, just before the rename,
    which file is about to take its name (see :meth:`AtomicOutput.commit`): a crash
    after the rename and before the journal records it leaves the marker, and the
    resumed run recognises the shard as done instead of refusing it as changed."""
    shard = Path(shard)
    return shard.with_name(f".{shard.name}{MARKER_SUFFIX}")


def _journal_done(journal: Path, file: Path) -> None:
    state = json.loads(journal.read_text(encoding="utf-8"))
    state["done"].append(str(file))
    state["files"][str(file)] = [os.stat(file).st_size, os.stat(file).st_mtime_ns]
    _atomic_json(journal, state)
    _commit_marker(file).unlink(missing_ok=True)


def _read_journal(journal: Path, mode: Any, options: ClipOptions, record: bool = True) -> dict[str, Any] | None:
    """The state of an unfinished in-place run, to finish it; None when there is none.
    ``record`` False (a dry run) writes nothing, not even a shard found done."""
    if not journal.exists():
        return None
    try:
        state = json.loads(journal.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicates)
        params = {k: (float.fromhex(v) if isinstance(v, str) else v) for k, v in state["params"].items()}
        same = (state["mode"] == mode.name and params == mode_params(mode)
                and state["selection"] == [list(options.selection.include), list(options.selection.exclude)])
        done, files = list(state["done"]), dict(state["files"])
        global_norm = None if state["global_norm"] is None else float.fromhex(state["global_norm"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise TclipError("the journal of an unfinished run is unreadable; restore the checkpoint from a copy "
                         "or remove the journal", journal) from None
    if not same:
        raise TclipError(f"an unfinished {state['mode']} run with other parameters left this journal; finish it "
                         "with the same command, or restore the checkpoint and remove the journal", journal)
    for file, (size, mtime) in files.items():
        if not os.path.exists(file):
            raise TclipError(f"shard {file} named by the journal is missing", journal)
        if (os.stat(file).st_size, os.stat(file).st_mtime_ns) != (size, mtime):
            if file not in done and marker_names(_commit_marker(Path(file)), Path(file)):
                if record:
                    _journal_done(journal, Path(file))  # replaced just before the crash: done
                done.append(file)
                continue
            raise TclipError(f"shard {file} changed since the unfinished run wrote its journal; "
                             "cannot resume safely", journal)
    return {"done": done, "global_norm": global_norm}


# --------------------------------------------------------------------------- reports and info of sets


def report_set(tensor_set: TensorSet, selection: Selection, order: str, axes: Any, moments: bool, budget: Budget,
               progress: Callable[[str], Callable[[int], None]] | None = None,
               dask_address: str | None = None) -> FileReport:
    """The read-only report of a set: every tensor of every file, one global norm."""
    started = time.perf_counter()
    tensor_set = _resolve(tensor_set)
    engine = Engine(budget, len(tensor_set.files), dask_address)
    try:
        stats = engine.map(stats_task, [((str(f), _selection_for(tensor_set, f, selection), axes, engine.task_budget),
                                         {"track_l1": order == "1", "track_moments": moments,
                                          "whole_if_rank_skip": True,
                                          "progress": progress(str(f)) if progress is not None else None})
                                        for f in tensor_set.files])
    finally:
        engine.close()
    merged = FileStats(tensor_set.name, stats[0].format if stats else "", sum(s.size_bytes for s in stats),
                       [t for s in stats for t in s.tensors if tensor_set.allow is None or t.skipped != "not selected"],
                       {k: v for s in stats for k, v in s.stats.items()},
                       [o for s in stats for o in s.others], tensor_set.metadata,
                       sum(s.bytes_read for s in stats))
    params: dict[str, Any] = {"ord": order}
    if axes is not None:
        params["axes"] = list(axes)
    report = report_from_stats(merged, order, params, selection)
    report.members = [{"file": s.path, "output": None} for s in stats]
    if IN_PROGRESS_KEY in tensor_set.metadata:
        report.warnings.append("an in-place run was interrupted here: some shards may be clipped and others not "
                               "(rerun it with --in-place to finish it)")
    report.elapsed_s = time.perf_counter() - started
    return report


def index_info(path: Path) -> InfoReport:
    """The headers of every shard an index names, as one info report (no tensor data read)."""
    from .pipeline import file_info

    tensor_set = _resolve(TensorSet(str(path), [], Path(path)))
    tensors, others = [], []
    size = path.stat().st_size
    fmt = ""
    for file in tensor_set.files:
        info = file_info(file)
        fmt = info.format
        size += info.size_bytes
        allowed = tensor_set.allow[file] if tensor_set.allow is not None else None
        tensors += [t for t in info.tensors if allowed is None or t.name in allowed]
        others += info.others
    metadata = tensor_set.metadata
    metadata["shards"] = len(tensor_set.files)
    return InfoReport(str(path), f"{fmt} index", size, tensors, metadata, others)


# --------------------------------------------------------------------------- one reader over a set


class SetReader(TensorReader):
    """The tensors of every file of a set as one reader (for ``diff`` of sharded checkpoints).

    Each shard keeps its own reader; reads go to the shard that holds the tensor.
    """

    format_name = "set"

    def __init__(self, tensor_set: TensorSet) -> None:
        from .formats import open_reader

        super().__init__(Path(tensor_set.name))
        self.readers: list[TensorReader] = []
        self.owner: dict[str, TensorReader] = {}
        try:
            for file in tensor_set.files:
                reader = open_reader(file)
                self.readers.append(reader)
                allowed = tensor_set.allow[file] if tensor_set.allow is not None else None
                for name, info in reader.tensors.items():
                    if allowed is None or name in allowed:
                        self.tensors[name] = info
                        self.owner[name] = reader
                self.others += reader.others
        except BaseException:
            self.close()
            raise
        self.metadata = tensor_set.metadata
        self.format_name = self.readers[0].format_name if self.readers else "set"

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        self.readers = []

    def read(self, name: str, index: Any = None, scratch: Any = None) -> Any:
        return self.owner[name].read(name, index, scratch)

    def read_flat(self, name: str, start: int, stop: int, out: Any = None) -> Any:
        return self.owner[name].read_flat(name, start, stop, out)

    def region(self, name: str) -> tuple[int, int] | None:
        return self.owner[name].region(name)

    def parallel_safe(self, name: str) -> bool:
        return self.owner[name].parallel_safe(name)

    def align(self, name: str) -> int:
        return self.owner[name].align(name)


def open_any(path: Path) -> TensorReader:
    """A reader for a file, or for the set an index names."""
    from .formats import open_reader

    if is_index(path):
        return SetReader(_resolve(TensorSet(str(path), [], path)))
    return open_reader(path)
